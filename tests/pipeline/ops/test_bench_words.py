"""bench words: our words paired with a reference's in order (only the ones both agree on), the audio the
references get, the figures, and the forced aligner's refusals."""

from voicebus.ops.bench.words import pair_starts


def test_words_are_paired_in_order_ignoring_case_punctuation_and_words_only_one_side_has():
    ours = [("Hello,", 0.10), ("Dr.", 0.50), ("Smith's", 0.90), ("cat.", 1.40)]
    theirs = [(" hello", 0.12), (" doctor", 0.48), (" Smith's", 0.95), (" black", 1.2), (" cat", 1.45)]
    assert pair_starts(ours, theirs) == [("hello", 0.10, 0.12), ("smiths", 0.90, 0.95), ("cat", 1.40, 1.45)]


def test_24khz_speech_reaches_the_references_resampled_to_16khz_not_relabelled():
    """Fed as if it were 16 kHz, 24 kHz audio plays 1.5x slower: every time 1.5x too late."""
    import numpy as np

    from voicebus.ops.bench.words import at_16khz

    t = np.arange(24000) / 24000
    pcm = (np.sin(2 * np.pi * 440 * t) * 16000).astype("<i2").tobytes()
    audio = at_16khz(pcm, 24000)
    assert abs(len(audio) - 16000) <= 32
    spectrum = np.abs(np.fft.rfft(audio[:16000]))
    assert abs(np.argmax(spectrum) * 16000 / 16000 - 440) <= 2  # 1 Hz bins: still a 440 Hz tone


def test_errors_summarize_absolute_and_signed_start_differences():
    from voicebus.ops.bench.words import Errors

    errors = Errors()
    errors.add([("a", 0.10, 0.12), ("b", 0.50, 0.45), ("c", 1.0, 1.03)])
    summary = errors.summary()
    assert summary["words"] == 3 and summary["median_ms"] == 30.0 and summary["bias_ms"] == -20.0
    assert Errors().summary() == {"words": 0}


def test_the_aligner_refuses_a_text_with_a_word_it_cannot_pronounce():
    import numpy as np

    from voicebus.ops.bench.words import Aligner

    aligner = Aligner()
    assert aligner.words_of("Hello, Dr. O'Neil's cat!") == ["hello", "dr", "o'neil's", "cat"]
    assert aligner.align(np.zeros(16000, dtype=np.float32), "hello zqxjkw") is None


def test_the_lead_sweep_at_3_frames_is_the_published_alignment_and_before_is_kokoros_join():
    import torch
    from misaki.token import MToken

    from voicebus.ops.bench.words import kokoro_join_words, lead_words
    from voicebus.synthesis.words import FRAME_S, english_words

    def tokens():
        return [MToken(text="Hello", tag="X", whitespace="", phonemes="həlˈO"),
                MToken(text=",", tag="X", whitespace=" ", phonemes=","),
                MToken(text="don't", tag="X", whitespace="", phonemes="dˈOnt")]

    phonemes = "həlˈO, dˈOnt"
    durations = torch.tensor([5] + [2] * 6 + [4] + [2] * 5 + [1])
    assert lead_words(tokens(), phonemes, durations, None, 3) == english_words(tokens(), phonemes, durations)
    assert [w.start for w in lead_words(tokens(), phonemes, durations, None, 0)] == [5 * FRAME_S, 21 * FRAME_S]
    # kokoro's join: 3 frames early for every word, and "don't" half the space earlier still
    assert [round(w.start / FRAME_S, 3) for w in kokoro_join_words(tokens(), durations)] == [2, 16]
