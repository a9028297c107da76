"""`voicebus bench synth` (pipeline/ops/bench/synth.py): its variant names and the decoders they
name."""

import pytest

from voicebus.ops.bench import synth


@pytest.fixture(scope="module")
def tiny_engine():
    from voicebus.synthesis.engine import SynthesisEngine

    return SynthesisEngine.tiny()


def test_a_variant_name_sets_the_engine_s_options():
    variant = synth._variant("windowed-2threads-no_grad-fp32dft", threads=1)
    assert variant["windowed"] and variant["threads"] == 2 and variant["grad_mode"] == "no_grad"
    assert variant["generator"] == "fp32dft"
    assert synth._variant("after", threads=1)["generator"] == "default"
    with pytest.raises(SystemExit, match="unknown option 'fp16'"):
        synth._variant("windowed-fp16", threads=1)


def test_kokoronoise_draws_the_noise_as_kokoro_does_and_the_rest_as_the_engine(tiny_engine):
    from voicebus.synthesis.torch_ops import randn_like_strided

    generators, engine_s = synth._generators(tiny_engine, set()), tiny_engine.randn_like
    for name, expected in (("windowed-kokoronoise", None), ("windowed", randn_like_strided)):
        variant = {**synth._variant(name, threads=1), "generators": generators, "randn_like": engine_s}
        synth._apply(tiny_engine, variant)
        assert tiny_engine.randn_like is expected


def test_the_float32_variants_differ_by_what_they_tile(tiny_engine):
    """``fp32``: every convolution direct; ``fp32dft``: the wide ones through short DFTs, kokoro's
    PL-BERT (the float32 path before F(4, 3) and prepacking); ``fp32tiled``: the engine's float32
    path on a CPU, 3-tap convolutions of many channels through F(4, 3), PL-BERT prepacked."""
    from voicebus.synthesis.kokoro_frames import PrepackedBert
    from voicebus.synthesis.tiled_conv import TiledConv, WinogradConv

    built = synth._generators(tiny_engine, {"fp32", "fp32dft", "fp32tiled"})

    def ways(name):
        generator, half, _ = built[name]
        convs = [c for layers in generator.resblocks for layer in layers for c in layer[1::2]]
        convs += [c for b in half.blocks for c in (b.conv1, b.conv2)]
        return {type(c.tiled) for c in convs}

    assert ways("fp32") == {type(None)} and built["fp32"][2] is None
    assert ways("fp32dft") == {type(None), TiledConv} and built["fp32dft"][2] is None
    assert ways("fp32tiled") == {type(None), TiledConv, WinogradConv}
    assert isinstance(built["fp32tiled"][2], PrepackedBert)


def test_the_longest_silence_is_printed_per_window_plan_and_the_engine_left_as_it_was(tiny_engine, whisper, monkeypatch,
                                                                                      capsys):
    """`_longest_silences` decodes each phrase once per `PLAN_SPEEDS` plan (adaptive windows,
    seed 0) and puts the engine back as it was."""
    from voicebus.ops.bench import seams

    monkeypatch.setattr(seams, "LONG_PHRASES", {"en": "The technician will call."})
    tiny_engine.decode_s_per_frame = 0.011
    before = (tiny_engine.inner_pause_frames, tiny_engine.adaptive_windows, tiny_engine.seed)
    seen: list = []
    stream = tiny_engine.stream

    def recorded_stream(*args, **kwargs):
        seen.append((tiny_engine.seed, tiny_engine.adaptive_windows, tiny_engine.decode_s_per_frame))
        return stream(*args, **kwargs)

    monkeypatch.setattr(tiny_engine, "stream", recorded_stream)
    synth._longest_silences(tiny_engine, whisper, "af_heart", tiny_engine.inner_pause_frames)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].split()[:3] == ["en", "af_heart", "max"]
    assert len(lines[1].split(": ")[1].strip("[]").split(", ")) == len(synth.PLAN_SPEEDS)
    assert seen == [(0, True, speed) for speed in synth.PLAN_SPEEDS]
    assert tiny_engine.decode_s_per_frame == 0.011
    assert (tiny_engine.inner_pause_frames, tiny_engine.adaptive_windows, tiny_engine.seed) == before
