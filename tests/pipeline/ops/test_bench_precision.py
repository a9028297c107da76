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


def runtime_and_reference(tiny_engine, runtime: str):
    """The float32 candidate's audio and ``runtime``'s, of one sentence longer than the
    exported example (the ONNX graph's lengths are dynamic)."""
    built = precision.build_candidates(tiny_engine, ["float32", runtime])
    phonemes = tiny_engine.phonemize("This sentence is longer than the exported example.", "en")[0]
    ref_s = tiny_engine.voice_pack(tiny_engine.voices[0])[len(phonemes) - 1]
    return [precision.decode(tiny_engine, phonemes, ref_s, built[name])[0] for name in ("float32", runtime)]


def test_the_onnxruntime_candidate_decodes_the_float32_generator_s_audio(tiny_engine):
    import numpy as np

    reference, audio = runtime_and_reference(tiny_engine, "onnxruntime")
    assert audio.dtype == np.float32 and audio.shape == reference.shape
    assert np.abs(audio - reference).max() < 1e-3  # the same computation in another runtime


def test_the_openvino_candidate_decodes_the_same_or_says_how_to_install_it(tiny_engine):
    """OpenVINO is optional (not a dependency of voicebus): with it, the candidate decodes the
    float32 generator's audio; without it, asking for it names the package to install."""
    import importlib.util

    import numpy as np

    if importlib.util.find_spec("openvino") is None:
        with pytest.raises(SystemExit, match="pip install openvino"):
            precision.build_candidates(tiny_engine, ["float32", "openvino"])
        return
    reference, audio = runtime_and_reference(tiny_engine, "openvino")
    assert np.abs(audio - reference).max() < 1e-3


def test_the_layers_mode_times_each_of_the_decoders_convolutions_both_ways(tiny_engine):
    """`--layers`: every residual-block convolution of the generator, by shape, with the steps
    of a window of that many frames (kokoro's upsampling: 20, then 120 a frame and one), and
    the frame-rate half's 3-tap ones over as many frames (twice as many after its upsampling);
    each says which way the engine takes."""
    rows = precision.layer_times(tiny_engine.model, frames=4, repeats=1)
    generator = [row for row in rows if row["part"] == "generator"]
    half = [row for row in rows if row["part"] == "frame-rate half"]
    assert sum(row["count"] for row in generator) == 48  # 2 stages x (3 blocks + the noise block) x 6
    assert {(row["channels"], row["steps"]) for row in generator} == {(256, 80), (128, 481)}
    assert {row["kernel"] for row in generator} == {3, 7, 11} and {row["dilation"] for row in generator} == {1, 3, 5}
    assert sum(row["count"] for row in half) == 10 and {row["kernel"] for row in half} == {3}
    assert {(row["channels"], row["out"], row["steps"]) for row in half} == {
        (514, 1024, 4), (1024, 1024, 4), (1090, 1024, 4), (1090, 512, 8), (512, 512, 8)}
    assert {(row["kernel"], row["channels"], row["engine"]) for row in rows if row["part"] == "generator"} == {
        (3, 256, "winograd"), (3, 128, "direct"), (7, 256, "dft"), (7, 128, "dft"), (11, 256, "dft"), (11, 128, "dft")}
    assert {row["engine"] for row in half} == {"winograd"}
    assert all(row["direct_ms"] > 0 and row["tiled_ms"] > 0 and row["ratio"] > 0 for row in rows)
