"""The synthesis engine over the real kokoro code with the tiny random-weight config."""

from __future__ import annotations

import numpy as np
import pytest

from voicebus.schemas.contract import UnknownLanguage
from voicebus.synthesis.engine import SAMPLE_RATE, SynthesisEngine
from tests.pipeline.synthesis.test_pieces import LONG

def test_language_aliases():
    engine = SynthesisEngine.tiny()
    assert engine.phonemize("hello", "EN-GB") and engine.phonemize("hola", "es")
    with pytest.raises(UnknownLanguage):
        engine.phonemize("hello", "klingon")
    with pytest.raises(UnknownLanguage):  # an empty language is not English by default in the worker
        engine.phonemize("hello", "")


def test_output_is_pcm16_mono_in_chunks_of_about_chunk_ms(tiny_engine: SynthesisEngine):
    chunks = list(tiny_engine.stream("Hello world, this is a test.", "en", "af_heart", chunk_ms=100))
    assert tiny_engine.sample_rate == SAMPLE_RATE == 24000
    sizes = [len(c) for c in chunks]
    assert len(chunks) >= 3 and all(s % 2 == 0 for s in sizes)
    target = SAMPLE_RATE * 100 // 1000 * 2
    assert all(target // 2 <= s <= target * 3 // 2 for s in sizes[:-1])
    samples = np.frombuffer(b"".join(chunks), "<i2")
    assert samples.std() > 0  # real signal, not silence


def test_deterministic_with_a_seed(tiny_engine: SynthesisEngine):
    first = b"".join(tiny_engine.stream("Good morning.", "en", "af_heart"))
    second = b"".join(tiny_engine.stream("Good morning.", "en", "af_heart"))
    assert first == second
    other_voice = b"".join(tiny_engine.stream("Good morning.", "en", "am_tiny"))
    assert other_voice != first


def test_should_stop_stops_before_the_next_chunk(tiny_engine: SynthesisEngine):
    seen = []
    stream = tiny_engine.stream("Stop me after two chunks, please.", "en", "af_heart", chunk_ms=150, should_stop=lambda: len(seen) >= 2)
    for chunk in stream:
        seen.append(chunk)
    assert len(seen) == 2


def test_long_sentence_first_chunk_comes_from_the_first_piece_only(tiny_engine: SynthesisEngine):
    forwards: list[int] = []
    hook = tiny_engine.model.register_forward_hook(lambda module, args, out: forwards.append(len(args[0])))
    try:
        stream = tiny_engine.stream(LONG, "en", "af_heart")
        next(stream)
        assert len(forwards) == 1  # one forward pass (the first piece) before the first chunk
        for _ in stream:  # the rest of the first piece's chunks, then the second piece
            if len(forwards) >= 2:
                break
        stream.close()
    finally:
        hook.remove()
    assert len(forwards) == 2
    assert forwards[0] < forwards[1]  # the first piece is the short one


def test_unknown_voice_falls_back(tiny_engine: SynthesisEngine):
    assert tiny_engine.resolve_voice("zz_missing") == tiny_engine.fallback_voice
    assert b"".join(tiny_engine.stream("Hi.", "en", "zz_missing")) == b"".join(tiny_engine.stream("Hi.", "en", tiny_engine.fallback_voice))


def test_spanish_goes_through_espeak(tiny_engine: SynthesisEngine):
    assert tiny_engine.phonemize("Hola, amigo.", "es")
    assert list(tiny_engine.stream("Hola.", "es", "ef_tiny"))


def test_the_first_chunk_is_published_once_the_first_window_is_decoded():
    """Windowed decoding: the piece's first chunk comes after one run of the generator, the
    others after the later windows; the chunks' samples are those of all windows joined, and
    the last chunk of each window but the last is marked as a pause."""
    engine = SynthesisEngine.tiny(seed=0)
    engine.silence_margins_ms = (20, 250)  # the real engine's margins
    engine.windowed = True
    assert engine.windows_decoding
    runs = []
    folded = engine.generator

    def counted(*window):
        runs.append(1)
        return folded(*window)

    engine.generator = counted
    stream = engine.stream_timed("Good morning, my friend.", "en", "af_heart", chunk_ms=100)
    first = next(stream)
    assert len(runs) == 1 and first.words and first.pcm
    rest = list(stream)
    assert len(engine.last_seams) >= 1 and len(runs) == len(engine.last_seams) + 1
    assert all(not c.words for c in rest)
    # each window's last chunk says the engine pauses there to decode more (the worker then holds
    # nothing back); the sentence's last chunk does not
    chunks = [first, *rest]
    assert sum(c.pause for c in chunks) == len(engine.last_seams) and not chunks[-1].pause
    decoded, _ = engine.last_decoded_frames
    assert 0 < len(first.pcm) + sum(len(c.pcm) for c in rest) <= 2 * 600 * decoded


def test_the_device_is_cuda_only_where_torch_sees_one():
    """The cuda code path's choice, on this CPU-only machine: auto is cpu, cuda is a clear error."""
    import torch

    from voicebus.synthesis.engine import EngineError, pick_device

    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA device"):
            pick_device("cuda")
    with pytest.raises(EngineError, match="unknown device"):
        pick_device("tpu")


def test_the_worker_s_torch_threads_come_from_the_settings_and_are_at_least_one():
    from voicebus.settings import Settings, SettingsError
    from voicebus.synthesis.engine import intra_op_threads

    assert intra_op_threads(Settings()) == 1  # a node whose cores are shared (docs/benchmarks.md)
    assert intra_op_threads(Settings.from_env({"VOICEBUS_SYNTHESIS_THREADS": "2"})) == 2
    with pytest.raises(SettingsError, match="VOICEBUS_SYNTHESIS_THREADS: .*greater than or equal to 1"):
        Settings(synthesis_threads=0)


def test_windows_are_planned_from_the_decode_speed_the_engine_measured():
    """A slow machine's measured speed makes the first window longer (`kokoro_frames.first_cut`),
    so later windows can be decoded while it plays; the engine measures the speed on every
    window it decodes."""
    from voicebus.synthesis.kokoro_frames import first_cut

    text = "Good morning, my friend, the weather is fine today and the park is open until nine tonight."
    engine = SynthesisEngine.tiny(seed=0)
    engine.silence_margins_ms = (20, 250)
    engine.windowed = True
    engine.clock = lambda: 0.0  # no time passes: the measured speed is 0, the audio ahead all that was sent
    list(engine.stream(text, "en", "af_heart"))
    fast = list(engine.last_seams)
    assert engine.decode_s_per_frame == 0.0
    engine.decode_s_per_frame = 0.016  # as if measured on a machine that decodes 1.5x faster than real time
    list(engine.stream(text, "en", "af_heart"))
    slow = list(engine.last_seams)
    assert fast and slow and slow[0] - fast[0] == first_cut(10**6, 0, 0.016) - first_cut(10**6, 0, None)
    engine.adaptive_windows = False  # the fixed sizes: the speed is not asked
    engine.decode_s_per_frame = 0.016
    list(engine.stream(text, "en", "af_heart"))
    assert engine.last_seams[0] == fast[0]


def test_the_generator_s_precision_is_bfloat16_only_where_the_cpu_multiplies_it(tmp_path):
    """`Settings.synthesis_precision`: ``auto`` gives bfloat16 on a CPU with AMX or AVX-512 BF16
    (read from /proc/cpuinfo's flags), float32 on one with neither (AVX2 only: emulated, slower)
    and on a GPU; an unknown name is an error."""
    import torch

    from voicebus.synthesis.engine import EngineError, cpu_has_bf16, pick_precision

    amx, zen5, avx2, avx512 = (tmp_path / name for name in ("amx", "zen5", "avx2", "avx512"))
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n\n")
    zen5.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c\n\n")
    avx512.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16x\n\n")
    assert cpu_has_bf16(str(amx)) and cpu_has_bf16(str(zen5))
    assert not cpu_has_bf16(str(avx2)) and not cpu_has_bf16(str(avx512))  # whole flags, not prefixes
    assert not cpu_has_bf16(str(tmp_path / "missing"))
    assert pick_precision("auto", "cpu", lambda: True) is torch.bfloat16
    assert pick_precision("auto", "cpu", lambda: False) is torch.float32
    assert pick_precision("auto", "cuda", lambda: True) is torch.float32
    assert pick_precision("float32", "cpu", lambda: True) is torch.float32
    assert pick_precision("bfloat16", "cpu", lambda: False) is torch.bfloat16
    with pytest.raises(EngineError, match="unknown synthesis precision"):
        pick_precision("int8", "cpu")


def test_the_engine_s_float32_decoder_runs_its_convolutions_through_tiles(tiny_engine: SynthesisEngine):
    """`folded_decoder`, what `SynthesisEngine.load` decodes with: in float32 on a CPU the
    generator's 7- and 11-tap convolutions go through short DFTs and the 3-tap ones of 256
    channels or more (the frame-rate half's too) through F(4, 3), `tiled_conv` (fewer
    multiplications, the same audio), and PL-BERT is prepacked; in bfloat16 every convolution
    runs directly, and PL-BERT is bfloat16 too."""
    import torch

    from voicebus.synthesis.engine import folded_decoder
    from voicebus.synthesis.kokoro_frames import Bfloat16Bert, PrepackedBert

    def tiled(generator):
        return {conv.tiled is not None for block in generator.resblocks for layer in block for conv in layer[1::2]
                if conv.shape[-1] >= 7 or conv.shape[0] >= 256}

    def half_tiled(half):
        return {conv.tiled is not None for block in half.blocks for conv in (block.conv1, block.conv2)}

    generator, half, bert = folded_decoder(tiny_engine.model, torch.float32)
    assert tiled(generator) == half_tiled(half) == {True} and generator.dtype == half.dtype == torch.float32
    assert isinstance(bert, PrepackedBert)
    generator, half, bert = folded_decoder(tiny_engine.model, torch.bfloat16)
    assert tiled(generator) == half_tiled(half) == {False} and isinstance(bert, Bfloat16Bert)


def test_without_torch_s_prepacked_linear_the_engine_keeps_kokoro_s_bert(tiny_engine: SynthesisEngine, monkeypatch, caplog):
    """A torch without the private operators `torch_ops` calls: the check at load names what
    is missing, and the engine runs kokoro's own PL-BERT, with a warning, instead of failing."""
    import torch

    from voicebus.synthesis import torch_ops
    from voicebus.synthesis.engine import folded_decoder

    monkeypatch.setattr(torch_ops, "PRIVATE_OPS", (*torch_ops.PRIVATE_OPS, "mkldnn._no_such_operator"))
    with caplog.at_level("WARNING", logger="voicebus.synthesis.engine"):
        _, _, bert = folded_decoder(tiny_engine.model, torch.float32)
    assert bert is None
    assert "PL-BERT runs as kokoro's own" in caplog.text and "_no_such_operator" in caplog.text


def test_the_engine_draws_the_harmonic_source_s_noise_faster_unless_torch_draws_otherwise(
        tiny_engine: SynthesisEngine, monkeypatch, caplog):
    """On a CPU the engine draws the noise with `torch_ops.randn_like_strided`; where the check
    finds torch drawing otherwise, kokoro's own ``m_source``, with a warning, instead of failing."""
    from voicebus.synthesis import torch_ops
    from voicebus.synthesis.engine import noise_drawer

    assert tiny_engine.randn_like is torch_ops.randn_like_strided
    monkeypatch.setattr(torch_ops, "RNG_STATE_BYTES", torch_ops.RNG_STATE_BYTES + 8)
    with caplog.at_level("WARNING", logger="voicebus.synthesis.engine"):
        assert noise_drawer(tiny_engine.model) is None
    assert "the harmonic source's noise is drawn as kokoro draws it" in caplog.text


def test_the_engine_decodes_with_its_folded_generator():
    """The engine's windows and its whole-span decodes go through `SynthesisEngine.generator`
    and `frame_rate_half` (the folded ones), and with them unset through kokoro's own: the same
    audio within float32's rounding."""
    import numpy as np

    engine = SynthesisEngine.tiny(seed=0)
    engine.silence_margins_ms = (20, 250)
    engine.adaptive_windows = False  # the same cuts in both runs (planned ones follow the measured speed)
    calls = []
    folded = engine.generator

    def counted(*window):
        calls.append(1)
        return folded(*window)

    for windowed in (True, False):
        engine.windowed = windowed
        engine.generator = counted
        calls.clear()
        ours = np.frombuffer(b"".join(engine.stream("Good morning, my friend.", "en", "af_heart")), "<i2").astype(int)
        assert calls, f"windowed={windowed}: the folded generator decoded"
        engine.generator, half = None, engine.frame_rate_half
        engine.frame_rate_half = None
        kokoro = np.frombuffer(b"".join(engine.stream("Good morning, my friend.", "en", "af_heart")), "<i2").astype(int)
        assert len(ours) == len(kokoro) and np.abs(ours - kokoro).max() <= 2
        engine.frame_rate_half = half


def test_a_voice_mix_is_the_weighted_sum_of_its_voices_packs_blended_once(tiny_engine: SynthesisEngine):
    import torch

    packs = tiny_engine.voice_packs
    mix = tiny_engine.voice_pack("af_heart:0.7 + am_tiny:0.3")
    assert mix.shape == (510, 1, 256)
    assert torch.allclose(mix, 0.7 * packs["af_heart"] + 0.3 * packs["am_tiny"])
    assert tiny_engine.resolve_voice("am_tiny(3)+af_heart(7)") == "af_heart:0.7+am_tiny:0.3"
    assert tiny_engine.voice_pack("am_tiny(3)+af_heart(7)") is mix  # one canonical spec, blended once
    assert tiny_engine.voice_pack("af_heart:1") is packs["af_heart"]  # one voice: its own pack, as is
    four = ("af_heart", "am_tiny", "ef_tiny", "pf_tiny")
    assert torch.allclose(tiny_engine.voice_pack("+".join(four)), sum(packs[n] for n in four) / 4, atol=1e-6)


def test_the_blended_voices_kept_are_bounded(tiny_engine: SynthesisEngine):
    from voicebus.synthesis.engine import VOICE_MIX_CACHE

    for i in range(1, VOICE_MIX_CACHE + 5):
        tiny_engine.voice_pack(f"af_heart:{i}+am_tiny")
    assert len(tiny_engine._mixes) == VOICE_MIX_CACHE
    assert "af_heart:0.6667+am_tiny:0.3333" not in tiny_engine._mixes  # the oldest (i=2) went first


def test_a_mix_speaks_and_sounds_unlike_its_first_voice(tiny_engine: SynthesisEngine):
    mixed = tiny_engine.synthesize("hˈI", "af_heart:0.5+am_tiny:0.5")
    assert len(mixed) > 1000 and mixed != tiny_engine.synthesize("hˈI", "af_heart")


def test_a_mix_missing_some_voices_is_spoken_with_the_others_and_one_missing_all_with_the_fallback(
        tiny_engine: SynthesisEngine, caplog):
    import dataclasses

    from voicebus.schemas.contract import InvalidVoice
    from voicebus.synthesis.engine import NoVoices

    caplog.set_level("WARNING", logger="voicebus.synthesis.engine")
    assert tiny_engine.resolve_voice("af_heart:0.6+zz_gone:0.2+am_tiny:0.2") == "af_heart:0.75+am_tiny:0.25"
    assert tiny_engine.resolve_voice("zz_gone:0.5+af_heart:0.5") == "af_heart"
    assert tiny_engine.resolve_voice("zz_gone+zz_also") == tiny_engine.fallback_voice
    assert [r.getMessage().split(" is not")[0] for r in caplog.records] == [
        "voice 'zz_gone'", "voice 'zz_gone+zz_also'"]  # each missing voice warned about once
    strict = dataclasses.replace(tiny_engine, fallback_voice=None)
    with pytest.raises(NoVoices):
        strict.resolve_voice("af_heart+zz_gone")
    assert strict.resolve_voice("af_heart+am_tiny") == "af_heart:0.5+am_tiny:0.5"
    with pytest.raises(InvalidVoice):
        tiny_engine.resolve_voice("af_heart:")
    assert tiny_engine.resolve_voice("") == tiny_engine.fallback_voice  # none named: the fallback


def test_the_fallback_voice_may_be_a_mix_of_voices_that_are_there():
    from voicebus.synthesis.weights import fallback_voice, voice_available

    here = ["af_bella", "af_heart", "jm_kumo"]
    assert fallback_voice("af_bella(1)+af_heart(3)", here) == "af_heart:0.75+af_bella:0.25"
    assert fallback_voice("af_heart+af_sky", here) == "af_bella"  # af_sky is not there: the first by name
    assert voice_available("af_heart+jm_kumo", here) and not voice_available("af_heart+", here)


# --- pronunciation: inline phoneme spans (docs/protocol.md, "Pronunciation") ---------------------------


@pytest.mark.parametrize("language, plain, spanned, phonemes, words", [
    ("en", "I like Kokoro.", "I like [Kokoro](/kˈOkəɹO/).", "kˈOkəɹO", ["I", "like", "Kokoro."]),
    ("es", "Me gusta Kokoro, mucho.", "Me gusta [Kokoro](/kˈokoɾo/), mucho.", "kˈokoɾo,",
     ["Me", "gusta", "Kokoro,", "mucho."]),
    ("pt", "Eu vi Nova York.", "Eu vi [Nova York](/nˈɔva jˈɔɾk/).", "nˈɔva jˈɔɾk.", ["Eu", "vi", "Nova York."]),
])
def test_the_engine_speaks_the_phonemes_of_a_span(tiny_engine: SynthesisEngine, language, plain, spanned, phonemes,
                                                  words):
    """misaki (English) reads spans itself; for espeak's languages the engine splices them in."""
    before = tiny_engine.phonemize(plain, language)
    after = tiny_engine.phonemize(spanned, language)
    assert len(after) == 1 and phonemes in after[0] and phonemes not in before[0]
    assert "[" not in after[0] and "/" not in after[0]
    # the rest is phonemized as without the span
    assert after[0].split()[0] == before[0].split()[0]
    spoken = list(tiny_engine.spoken_pieces(spanned, language, "af_heart"))
    timed = [w for piece in spoken for w in piece.words]
    assert [w.text for w in timed] == words
    assert all(a.end <= b.start for a, b in zip(timed, timed[1:])) and all(w.start <= w.end for w in timed)


@pytest.mark.parametrize("language, text", [("en", "We store it in SQL tables."), ("es", "Lo guardo en SQL hoy.")])
def test_what_the_gate_makes_of_a_lexicon_changes_the_phonemes(tiny_engine: SynthesisEngine, language, text):
    from voicebus.gate.core import apply_lexicon

    said = apply_lexicon(text, [{"match": "SQL", "say": "Postgres"}])
    spanned = apply_lexicon(text, [{"match": "SQL", "phonemes": "ˈɛs kjˈu ˈɛl"}])
    assert spanned == text.replace("SQL", "[SQL](/ˈɛs kjˈu ˈɛl/)")
    plain = tiny_engine.phonemize(text, language)[0]
    assert tiny_engine.phonemize(said, language)[0] != plain
    assert "ˈɛs kjˈu ˈɛl" in tiny_engine.phonemize(spanned, language)[0] and "ˈɛs kjˈu ˈɛl" not in plain
