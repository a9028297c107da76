"""How the engine cuts one sentence into the pieces it synthesizes one forward pass at a time.

Pure text work, no model: `split_for_early_audio` cuts at clause boundaries (a short first
piece, so its audio comes early, without windowed decoding), never inside an inline phoneme
span; `piece_limits` gives the word limits for the engine's decoding mode.
"""

from __future__ import annotations

import re

from voicebus.schemas.contract import PHONEME_SPAN

# Long sentences are cut at clause boundaries: the first piece short, so its audio is ready
# early; later pieces longer, because each forward pass has a fixed cost and longer context
# gives better prosody. A clause longer than the limit is cut at word boundaries.
FIRST_PIECE_MAX_WORDS = 8
PIECE_MAX_WORDS = 30

# With windowed decoding (the first audio comes from a piece's first frames, however long the
# piece) a sentence is cut only where it must be: pieces of at most this many words, cut at
# clause punctuation when the clauses allow, so the phonemes stay far under MAX_PHONEMES
# (about 6 symbols a word in en/es/pt: ~300 of 510). Each cut is a pause of 250-500 ms heard
# in the middle of the sentence.
WINDOWED_PIECE_MAX_WORDS = 50


def piece_limits(windowed: bool) -> tuple[int, int]:
    """(first piece's, later pieces' most words) for `split_for_early_audio`: without windowed
    decoding a short first piece for early audio; with it, only the phoneme-safe limit."""
    if windowed:
        return WINDOWED_PIECE_MAX_WORDS, WINDOWED_PIECE_MAX_WORDS
    return FIRST_PIECE_MAX_WORDS, PIECE_MAX_WORDS


_CLAUSE_END = re.compile(r"(?<=[,;:.!?…—–])\s+")


def split_for_early_audio(
    text: str,
    first_max_words: int = FIRST_PIECE_MAX_WORDS,
    max_words: int = PIECE_MAX_WORDS,
    first_clause_min_words: int = 0,
) -> list[str]:
    """Cut one sentence into pieces synthesized one after another.

    The first piece has at most ``first_max_words`` words (whole clauses when they fit), the
    others at most ``max_words``; clauses are kept whole when they fit, merged when short.
    With ``first_clause_min_words`` > 0 the first piece also ends at the first clause boundary
    once it has that many words ("Thanks for waiting," of "Thanks for waiting, I found your
    order."): the worker asks for it on a turn's first sentence, whose first audio is the turn's.
    Joining the pieces with single spaces gives back the text with its whitespace normalized.
    An inline phoneme span (``[New York](/nˈu jˈɔɹk/)``) is one word, never cut.
    """
    spans: list[str] = []

    def hide(m: "re.Match[str]") -> str:  # a span as one word without space or punctuation
        spans.append(" ".join(m.group(0).split()))
        return f"{_SPAN_MARK}{len(spans) - 1}{_SPAN_MARK}"

    if "[" in text:
        text = PHONEME_SPAN.sub(hide, text)
    pieces = _split_words(text, first_max_words, max_words, first_clause_min_words)
    if spans:
        pieces = [_SPAN_HIDDEN.sub(lambda m: spans[int(m.group(1))], p) for p in pieces]
    return pieces


_SPAN_MARK = "\ue000"  # a private-use character: no text of a sentence holds it
_SPAN_HIDDEN = re.compile(_SPAN_MARK + r"(\d+)" + _SPAN_MARK)


def _split_words(text: str, first_max_words: int, max_words: int, first_clause_min_words: int) -> list[str]:
    clauses = [c.split() for c in _CLAUSE_END.split(text.strip()) if c.strip()]
    pieces: list[list[str]] = []
    current: list[str] = []
    for words in clauses:
        if first_clause_min_words and not pieces and len(current) >= first_clause_min_words:
            pieces.append(current)
            current = []
        while words:
            limit = first_max_words if not pieces else max_words
            room = limit - len(current)
            if len(words) <= room:
                current.extend(words)
                words = []
            elif current:
                pieces.append(current)  # close the piece at the clause boundary
                current = []
            else:
                # A clause longer than a whole piece: cut it at a word boundary, in parts of
                # about equal size (never a tiny tail) for the later pieces.
                if pieces:
                    parts = -(-len(words) // limit)
                    take = -(-len(words) // parts)
                else:
                    take = limit
                pieces.append(words[:take])
                words = words[take:]
    if current:
        pieces.append(current)
    return [" ".join(p) for p in pieces]
