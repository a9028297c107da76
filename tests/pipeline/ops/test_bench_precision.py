"""`voicebus bench precision` runs each candidate and applies the gate as docs/benchmarks.md states it."""

from __future__ import annotations

import math

import pytest

from voicebus.ops.bench import precision


@pytest.fixture(scope="module")
def tiny_engine():
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.tiny()


def test_every_candidate_is_timed_and_compared_with_the_float32_reference(tiny_engine):
    names = ["float32", "float32-seed", "int8-convs"]
    results = precision.measure(tiny_engine, names, ["Hi."], tiny_engine.voices[0], repeats=1)

    assert list(results) == names
    assert results["float32"]["log_mel_distance"] == 0.0  # the reference against itself
    assert results["float32"]["ratio"] == 1.0
    for name in names[1:]:
        row = results[name]
        assert all(math.isfinite(row[key]) and row[key] >= 0 for key in ("bert", "predict", "decode", "log_mel_distance"))
        assert row["passes"] is (row["log_mel_distance"] <= results["float32-seed"]["log_mel_distance"])
    # another excitation seed changes the audio; the int8 convolutions change it too
    assert results["float32-seed"]["log_mel_distance"] > 0
    assert results["int8-convs"]["log_mel_distance"] > 0


def test_every_candidate_builds_and_an_unknown_one_is_refused_with_the_known_ones(tiny_engine):
    built = precision.build_candidates(tiny_engine, list(precision.CANDIDATES))
    assert list(built) == list(precision.CANDIDATES)
    with pytest.raises(SystemExit, match="int8-convs"):
        precision.build_candidates(tiny_engine, ["float16"])
