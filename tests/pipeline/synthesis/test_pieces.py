"""Cutting a sentence into the pieces the engine synthesizes one after another."""

from __future__ import annotations

from voicebus.synthesis.pieces import split_for_early_audio

LONG = (
    "When the morning train finally pulled into the station after a long delay, the passengers, "
    "who had been waiting since dawn in the cold, hurried towards the exits without a word."
)


def test_split_keeps_words_and_makes_a_short_first_piece():
    pieces = split_for_early_audio(LONG)
    assert " ".join(pieces) == " ".join(LONG.split())
    assert len(pieces) >= 2
    assert len(pieces[0].split()) <= 8
    assert all(len(p.split()) <= 30 for p in pieces)


def test_split_prefers_clause_boundaries_and_leaves_short_sentences_whole():
    assert split_for_early_audio("Hello there, friend.") == ["Hello there, friend."]
    assert split_for_early_audio("Yes, of course, we can do that for you today.")[0] == "Yes, of course,"


def test_an_opening_sentence_can_end_its_first_piece_at_its_first_clause():
    text = "Thanks for waiting, I found your order."
    assert split_for_early_audio(text) == [text]  # it fits one piece
    assert split_for_early_audio(text, first_clause_min_words=3) == ["Thanks for waiting,", "I found your order."]
    # a first clause shorter than the minimum is kept with the next one
    assert split_for_early_audio("Yes, of course, we can do that.", first_clause_min_words=3)[0] == "Yes, of course,"
    assert split_for_early_audio("No commas in this one at all.", first_clause_min_words=3) == ["No commas in this one at all."]


def test_a_long_sentence_is_not_cut_mid_phrase_when_the_first_audio_comes_from_a_window():
    """With windowed decoding a sentence is cut only at clause punctuation
    when it must be (its words over the phoneme-safe limit), never after its 8th word."""
    from voicebus.synthesis.pieces import WINDOWED_PIECE_MAX_WORDS, piece_limits

    text = "The technician will call you tomorrow morning before nine to confirm the visit."
    first, rest = piece_limits(windowed=True)
    assert split_for_early_audio(text, first, rest) == [text]
    assert split_for_early_audio(text, *piece_limits(windowed=False))[0].endswith("before")
    long = ", ".join(["one two three four five six seven eight nine ten"] * 8) + "."
    pieces = split_for_early_audio(long, first, rest)
    assert len(pieces) > 1 and all(p.endswith((",", ".")) for p in pieces)
    assert all(len(p.split()) <= WINDOWED_PIECE_MAX_WORDS for p in pieces)


def test_a_phoneme_span_is_one_word_the_pieces_never_cut():
    text = "One, two, three four five six seven [New York. City](/nˈu jˈɔɹk, sˈɪti/) eight nine."
    pieces = split_for_early_audio(text, 3, 4)
    assert "[New York. City](/nˈu jˈɔɹk, sˈɪti/)" in " ".join(pieces)
    assert all(p.count("[") == p.count("/)") for p in pieces)
