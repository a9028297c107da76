"""Fixtures of the synthesis tests: the tiny random-weight engine and multilingual Whisper base;
the offline weight pack and the real engine are in tests/conftest.py (the player tests speak with
them too)."""

from __future__ import annotations

import pytest



@pytest.fixture(scope="session")
def tiny_engine():
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.tiny(seed=0)


@pytest.fixture(scope="session")
def whisper_base(tmp_path_factory):
    """Multilingual Whisper base (`voicebus.ops.bench.words.base_whisper`), its model joined once here."""
    from voicebus.ops.bench.words import base_whisper

    return base_whisper(tmp_path_factory.mktemp("whisper"))
