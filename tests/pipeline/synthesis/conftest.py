"""Fixtures of the synthesis tests: the tiny random-weight engine, the offline weight pack
and the real engine are in tests/conftest.py (the player tests speak with them too)."""

from __future__ import annotations

import pytest



@pytest.fixture(scope="session")
def tiny_engine():
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.tiny(seed=0)
