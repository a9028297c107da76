"""Word timings: when each word of a sentence starts and ends in its audio, in samples.

This module owns turning Kokoro's predicted phoneme durations (frames per phoneme token, the
pads included; `kokoro_frames.Frames.durations`) into the start and end of every word as the
agent wrote it (whitespace-separated: "Hello," and "don't" are one word each, so captions and
the heard text match the answer).

**The alignment** (`time_tokens`): a word starts where the frames of its first phoneme start
and ends where those of its last phoneme end, both moved `ACOUSTIC_LEAD_FRAMES` (3 frames,
75 ms) earlier, and never before the piece's audio first sounds nor after it last sounds
(`place`). The lead is the decoder's: Kokoro's decoder sounds a phoneme about 3 frames before
the frames the duration predictor gave it (its convolutions and the F0/energy predictor see
ahead), as the audio shows two ways (docs/worker.md, "Word timings"): PocketSphinx's HMM
forced alignment of the real model's speech puts word starts 76 ms (median) before the first
phoneme's frames, and 6 ms before those frames less 3 (the error smallest at 3 frames); the
first sound of a piece comes 19-110 ms (median 37) before its first phoneme's frames.
It is also kokoro's own offset for the first word (`KPipeline.join_timestamps`, which this
module used before: it started every later word in the middle of the space before it instead,
half a space early, and put the first word of a piece before the audio had any sound).

- English: misaki's tokens (``MToken``: text, phonemes, whitespace) are found in the piece's
  phoneme string in order, then the tokens of each whitespace word are joined (`english_words`).
- Spanish and Portuguese (espeak G2P, no tokens): the phoneme string has one space-separated
  group per spoken word; each group becomes a token timed the same way and is mapped to the
  written word it came from (`phoneme_words`). When the groups and the words do not pair up
  one to one (a number spoken as several words, an abbreviation), each written word is
  phonemized alone to learn how many groups it makes; failing that, groups are spread over the
  words in proportion to their letters.

Phoneme symbols the model's vocabulary lacks are dropped before the model sees them (as
`kokoro_frames.token_ids` does); ``kept`` says which ones are kept so the frames stay in step.
Times come out in seconds from the start of the piece's *raw* audio (before silence trimming);
the engine shifts them by what it trimmed and by the pieces before (`place`). Pure apart from
misaki's ``MToken`` (no model, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from voicebus.schemas.messages import WordTiming  # a word's span in samples of its sentence, as AudioChunk.words carries it

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TimedWord:
    """One written word and its span in seconds of the piece's raw audio (`start` <= `end`)."""

    text: str
    start: float
    end: float


FRAME_S = 600 / 24000
"""One Kokoro frame: 600 samples at 24 kHz (`kokoro_frames.SAMPLES_PER_FRAME`)."""

ACOUSTIC_LEAD_FRAMES = 3
"""How many frames before its predicted frames a phoneme sounds in Kokoro's decoded audio (see
the module docstring; measured in docs/worker.md, "Word timings")."""


def time_tokens(tokens: Sequence, phonemes: str, durations: "torch.Tensor | Sequence[int]",
                kept: Callable[[str], bool] | None = None, lead_frames: int = ACOUSTIC_LEAD_FRAMES) -> None:
    """Set ``start_ts`` and ``end_ts`` (seconds of the piece's raw audio) on every token whose
    phonemes are found, in order, in ``phonemes`` (the string the model spoke, ``durations``
    its frames per symbol with a pad on each side): from the first frame of its first phoneme
    to the last frame of its last one, both ``lead_frames`` earlier. A token not found (past a
    truncation, or phonemes the string lacks) is left untimed (None)."""
    frames = [int(d) for d in (durations.detach().cpu().reshape(-1).tolist() if hasattr(durations, "detach") else durations)]
    starts = [0]  # starts[k]: the first frame of model symbol k (0 is the leading pad)
    for d in frames:
        starts.append(starts[-1] + d)
    symbol: dict[int, int] = {}  # position in `phonemes` -> the model symbol it became
    k = 1
    for position, char in enumerate(phonemes):
        if kept is None or kept(char):
            symbol[position] = k
            k += 1
    at = 0
    for token in tokens:
        token.start_ts = token.end_ts = None
        if not token.phonemes:
            continue
        found = phonemes.find(token.phonemes, at)
        if found < 0:
            continue
        at = found + len(token.phonemes)
        mine = [symbol[p] for p in range(found, at) if p in symbol]
        if not mine or mine[-1] + 1 >= len(starts):
            continue
        token.start_ts = max(0, starts[mine[0]] - lead_frames) * FRAME_S
        token.end_ts = max(0, starts[mine[-1] + 1] - lead_frames) * FRAME_S


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


def english_words(tokens: list, phonemes: str, durations: "torch.Tensor",
                  kept: Callable[[str], bool] | None = None) -> list[TimedWord]:
    """The whitespace words of one English piece from misaki's tokens (`time_tokens`)."""
    time_tokens(tokens, phonemes, durations, kept)
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
                  phonemize_word: Callable[[str], str] | None = None,
                  kept: Callable[[str], bool] | None = None) -> list[TimedWord]:
    """The whitespace words of one piece whose phoneme string has a space between spoken words
    (espeak's output), each group timed as a token (`time_tokens`)."""
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
    time_tokens(tokens, phonemes, durations, kept)
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
          sentence_offset: int, sound: tuple[int, int] | None = None) -> list[WordTiming]:
    """Words of one piece in samples of the sentence: shifted by the samples trimmed off the
    piece's raw audio (`raw_offset`), kept within ``sound`` (the piece's first and one past its
    last sounding sample, default the whole piece: no word starts before the audio sounds, nor
    ends in the silence after it), moved by the sentence's samples before the piece
    (`sentence_offset`)."""
    first, last = sound if sound is not None else (0, piece_samples)
    first, last = max(0, min(first, piece_samples)), max(0, min(last, piece_samples))
    last = max(first, last)
    out = []
    for w in words:
        start = min(last, max(first, round(w.start * sample_rate) - raw_offset))
        end = min(last, max(start, round(w.end * sample_rate) - raw_offset))
        out.append(WordTiming(text=w.text, start=sentence_offset + start, end=sentence_offset + end))
    return out


def heard_words(words: Sequence[WordTiming], rendered: int) -> tuple[list[WordTiming], list[WordTiming]]:
    """Split one sentence's words at a rendered position (samples from the sentence's start):
    the words whose start was rendered (a word in progress counts as heard) and the rest."""
    heard = [w for w in words if w.start < rendered]
    return heard, list(words[len(heard):])
