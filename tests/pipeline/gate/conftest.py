"""Fixtures of the gate tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_settings(make_settings):
    """Per-test settings (tests/conftest.py) with speculative release off unless a test turns it
    on: the gate's shell tests compare the synthesis topic with one request per sentence.
    Speculation (on by default) is tested in the core (test_core.py: after settlement it gives
    exactly these requests, for any split of a text) and through the whole pipeline, a retraction
    included (tests/pipeline/ops/test_runtime.py)."""

    def make(**overrides):
        overrides.setdefault("speculative_release", False)
        return make_settings(**overrides)

    return make
