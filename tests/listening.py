"""Listening to speech in tests: Whisper's words for PCM16, and a word error rate."""

from __future__ import annotations

import re


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def word_error_rate(reference: list[str], hypothesis: list[str]) -> float:
    from voicebus.ops.bench.seams import word_errors

    return word_errors(reference, hypothesis) / max(1, len(reference))


def transcribe(model, pcm: bytes, sample_rate: int = 24000) -> str:
    """Whisper's words for PCM16 at `sample_rate`, resampled to the 16 kHz it takes (fed as it is,
    24 kHz speech would be heard 1.5x slower and lower)."""
    from voicebus.ops.bench.words import GREEDY, at_16khz

    segments, _ = model.transcribe(at_16khz(pcm, sample_rate), language="en", beam_size=1, temperature=GREEDY)
    return " ".join(s.text for s in segments)
