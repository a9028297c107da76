"""Word timings: when each word of a sentence starts and ends in its audio, in samples.

This module owns turning Kokoro's predicted phoneme durations (frames per phoneme token, the
pads included; `kokoro_frames.Frames.durations`) into the start and end of every word as the
agent wrote it (whitespace-separated: "Hello," and "don't" are one word each, so captions and
the heard text match the answer).

- English: misaki's tokens (``MToken``: text, phonemes, whitespace) are timed by kokoro's own
  `KPipeline.join_timestamps` (the alignment kokoro's pipeline gives its users), then the tokens
  of each whitespace word are joined (`english_words`).
- Spanish and Portuguese (espeak G2P, no tokens): the phoneme string has one space-separated
  group per spoken word; each group becomes a token timed the same way and is mapped to the
  written word it came from (`phoneme_words`). When the groups and the words do not pair up
  one to one (a number spoken as several words, an abbreviation), each written word is
  phonemized alone to learn how many groups it makes; failing that, groups are spread over the
  words in proportion to their letters.

Times come out in seconds from the start of the piece's *raw* audio (before silence trimming);
the engine shifts them by what it trimmed and by the pieces before (`place`). Pure apart from
kokoro's ``join_timestamps`` and misaki's ``MToken`` (no model, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TimedWord:
    """One written word and its span in seconds of the piece's raw audio (`start` <= `end`)."""

    text: str
    start: float
    end: float


@dataclass(frozen=True)
class WordTiming:
    """One written word and its span in samples within its sentence's audio (what an AudioChunk
    carries in ``words``)."""

    text: str
    start: int
    end: int

    def as_record(self) -> dict:
        return {"text": self.text, "start": self.start, "end": self.end}


def _join(tokens: list, durations: "torch.Tensor") -> None:
    from kokoro import KPipeline

    KPipeline.join_timestamps(tokens, durations.detach().cpu().long().reshape(-1))


def _group(tokens: Sequence, texts: Sequence[str] | None = None) -> list[TimedWord]:
    """Join timed tokens into whitespace words (a word ends at a token followed by whitespace).
    A word with no timed token (past a truncation) starts and ends where the one before ended."""
    words: list[TimedWord] = []
    text, start, end = "", None, None

    def close() -> None:
        nonlocal text, start, end
        if text.strip():
            last = words[-1].end if words else 0.0
            s = start if start is not None else last
            words.append(TimedWord(text.strip(), s, max(s, end if end is not None else s)))
        text, start, end = "", None, None

    for token in tokens:
        text += token.text
        if token.start_ts is not None:
            start = token.start_ts if start is None else min(start, token.start_ts)
        if token.end_ts is not None:
            end = token.end_ts if end is None else max(end, token.end_ts)
        if token.whitespace:
            close()
    close()
    return words


def english_words(tokens: list, durations: "torch.Tensor") -> list[TimedWord]:
    """The whitespace words of one English piece from misaki's tokens, timed by kokoro."""
    _join(tokens, durations)
    return _group(tokens)


def _pair(words: list[str], groups: list[str], phonemize_word: Callable[[str], str] | None) -> list[list[str]]:
    """Per written word, the phoneme groups it was spoken as (every group used once, in order)."""
    if len(words) == len(groups):
        return [[g] for g in groups]
    if phonemize_word is not None:
        counts = [len(phonemize_word(w).split()) for w in words]
        if sum(counts) == len(groups):
            out, i = [], 0
            for n in counts:
                out.append(groups[i : i + n])
                i += n
            return out
    # proportional to letters: every word gets at least nothing, every group goes somewhere
    letters = [max(1, sum(c.isalnum() for c in w)) for w in words]
    total, out, i, seen = sum(letters), [], 0, 0
    for n in letters:
        seen += n
        upto = round(len(groups) * seen / total)
        out.append(groups[i:upto])
        i = max(i, upto)
    return out


def phoneme_words(text: str, phonemes: str, durations: "torch.Tensor",
                  phonemize_word: Callable[[str], str] | None = None) -> list[TimedWord]:
    """The whitespace words of one piece whose phoneme string has a space between spoken words
    (espeak's output), timed by kokoro's alignment of those groups."""
    from misaki.token import MToken

    words = text.split()
    groups = phonemes.split(" ")
    if not words:
        return []
    paired = _pair(words, [g for g in groups if g], phonemize_word)
    tokens = []
    for word, its_groups in zip(words, paired):
        for k, group in enumerate(its_groups):
            # one token per group; the written word's text on its first group only
            tokens.append(MToken(text=word if k == 0 else "", tag="X", whitespace=" ", phonemes=group))
        if not its_groups:  # spoken with the word before: an untimed word of its own
            tokens.append(MToken(text=word, tag="X", whitespace=" ", phonemes=""))
    if tokens:
        tokens[-1].whitespace = ""
    _join(tokens, durations)
    # group per written word: a word's tokens are consecutive; join them by the word boundaries
    out: list[TimedWord] = []
    i = 0
    for word, its_groups in zip(words, paired):
        n = max(1, len(its_groups))
        mine = tokens[i : i + n]
        i += n
        starts = [t.start_ts for t in mine if t.start_ts is not None]
        ends = [t.end_ts for t in mine if t.end_ts is not None]
        last = out[-1].end if out else 0.0
        start = min(starts) if starts else last
        out.append(TimedWord(word, start, max([start, *ends])))
    return out


def place(words: Sequence[TimedWord], sample_rate: int, raw_offset: int, piece_samples: int,
          sentence_offset: int) -> list[WordTiming]:
    """Words of one piece in samples of the sentence: shifted by the samples trimmed off the
    piece's raw audio (`raw_offset`), clamped to the piece's `piece_samples`, moved by the
    sentence's samples before the piece (`sentence_offset`)."""
    out = []
    for w in words:
        start = min(piece_samples, max(0, round(w.start * sample_rate) - raw_offset))
        end = min(piece_samples, max(start, round(w.end * sample_rate) - raw_offset))
        out.append(WordTiming(w.text, sentence_offset + start, sentence_offset + end))
    return out


def heard_words(words: Sequence[WordTiming], rendered: int) -> tuple[list[WordTiming], list[WordTiming]]:
    """Split one sentence's words at a rendered position (samples from the sentence's start):
    the words whose start was rendered (a word in progress counts as heard) and the rest."""
    heard = [w for w in words if w.start < rendered]
    return heard, list(words[len(heard):])
