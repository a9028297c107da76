"""bench words: our words paired with Whisper's in order, only the ones both agree on."""

from pipeline.bench.words import pair_starts


def test_words_are_paired_in_order_ignoring_case_punctuation_and_words_only_one_side_has():
    ours = [("Hello,", 0.10), ("Dr.", 0.50), ("Smith's", 0.90), ("cat.", 1.40)]
    theirs = [(" hello", 0.12), (" doctor", 0.48), (" Smith's", 0.95), (" black", 1.2), (" cat", 1.45)]
    assert pair_starts(ours, theirs) == [("hello", 0.10, 0.12), ("smiths", 0.90, 0.95), ("cat", 1.40, 1.45)]
