"""Kokoro's forward pass cut at the decoder (`voicebus.synthesis.kokoro_frames`): the tiny
random-weight model for exactness, the offline pack's real weights for the silence skipped."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from voicebus.synthesis import kokoro_frames
from voicebus.synthesis.pcm import SILENCE_THRESHOLD, trim_silence
from voicebus.synthesis.kokoro_frames import KokoroInternalsChanged, check_kokoro_internals, sound_span


def test_sound_span_keeps_context_around_the_loud_frames():
    quiet, loud = -9.0, 5.0
    energy = [quiet] * 10 + [loud] * 5 + [quiet] * 20
    assert sound_span(energy, lead=2, trail=3) == (8, 18)
    assert sound_span(energy, lead=0, trail=0) == (10, 15)
    # context never runs past the piece's frames
    assert sound_span([loud] * 4, lead=2, trail=2) == (0, 4)


def test_a_piece_with_no_loud_frame_is_decoded_whole():
    assert sound_span([-9.0] * 7) == (0, 7)
    assert sound_span([]) == (0, 0)


def test_trim_silence_appends_the_undecoded_trail_as_zeros_up_to_the_margin():
    pcm = np.concatenate([np.zeros(100, "<i2"), np.full(50, 1000, "<i2"), np.zeros(30, "<i2")]).tobytes()
    out = np.frombuffer(trim_silence(pcm, 10, 200, undecoded_trail_samples=500), "<i2")
    assert len(out) == 10 + 50 + 200 and not out[60:].any()
    # the model predicted less silence than the margin: only that much is added
    out = np.frombuffer(trim_silence(pcm, 10, 200, undecoded_trail_samples=70), "<i2")
    assert len(out) == 10 + 50 + 30 + 70


def test_the_split_forward_pass_is_kokoros_forward_pass(tiny_engine):
    import torch

    model = tiny_engine.model
    check_kokoro_internals(model)
    phonemes = tiny_engine.phonemize("Good morning, how are you?", "en")[0]
    ref_s = tiny_engine.voice_packs["af_heart"][len(phonemes) - 1]
    with torch.inference_mode():
        torch.manual_seed(7)
        expected = model(phonemes, ref_s, 1.1, return_output=True)
        torch.manual_seed(7)
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s, 1.1)
        audio = kokoro_frames.decode_frames(model, frames)
    assert torch.equal(frames.durations, expected.pred_dur)
    assert torch.equal(audio, expected.audio)
    assert len(audio) == frames.count * kokoro_frames.SAMPLES_PER_FRAME


def test_the_harmonic_source_with_the_faster_draws_is_kokoro_s_and_draws_all_it_draws(tiny_engine):
    """`harmonic_source` with `torch_ops.randn_like_strided` is kokoro's ``m_source`` for a seed,
    and leaves the generator where kokoro's does (its unused noise branch drawn too): the
    sentence after is the same as well. A seeded whole decode through it is kokoro's audio."""
    import torch

    from voicebus.synthesis.torch_ops import randn_like_strided

    gen = tiny_engine.model.decoder.generator
    f0 = torch.rand(1, 1, 160) * 300 * (torch.rand(1, 1, 160) > 0.3)  # voiced frames and unvoiced ones
    upsampled = gen.f0_upsamp(f0).transpose(1, 2)
    with torch.inference_mode():
        torch.manual_seed(3)
        expected, expected_state = gen.m_source(upsampled)[0], torch.get_rng_state()
        torch.manual_seed(3)
        got, state = kokoro_frames.harmonic_source(gen, upsampled, randn_like_strided), torch.get_rng_state()
    assert torch.equal(got, expected) and torch.equal(state, expected_state)

    model = tiny_engine.model
    phonemes = tiny_engine.phonemize("Good morning, how are you?", "en")[0]
    ref_s = tiny_engine.voice_packs["af_heart"][len(phonemes) - 1]
    with torch.inference_mode():
        torch.manual_seed(7)
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s, 1.1)
        kokoro_s = kokoro_frames.generate(model, kokoro_frames.prepare_decoder(model, frames))
        torch.manual_seed(7)
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s, 1.1)
        faster = kokoro_frames.generate(model, kokoro_frames.prepare_decoder(model, frames, randn_like=randn_like_strided))
    assert torch.equal(faster, kokoro_s)


def _weight_normed(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if name.endswith(("weight_g", "weight_v"))]


def test_the_engine_s_model_has_its_weight_norms_baked_and_speaks_exactly_as_before(tiny_engine):
    import io

    import torch
    from kokoro import KModel

    from voicebus.synthesis.engine import REPO_ID, tiny_config

    # the engine's model recomputes no weight on a forward pass (the fix: fails when reverted)
    assert not _weight_normed(tiny_engine.model)
    state = io.BytesIO()
    torch.save({}, state)
    state.seek(0)
    torch.manual_seed(3)
    model = KModel(repo_id=REPO_ID, config=tiny_config(), model=state).eval()
    assert _weight_normed(model), "kokoro builds weight-normed layers: nothing to bake otherwise"
    phonemes = tiny_engine.phonemize("Good morning, how are you?", "en")[0]
    ref_s = tiny_engine.voice_packs["af_heart"][len(phonemes) - 1]

    def speak():
        with torch.inference_mode():
            torch.manual_seed(7)
            return model(phonemes, ref_s, 1.0, return_output=True).audio

    before = speak()
    assert kokoro_frames.bake_weight_norms(model) > 0
    assert not _weight_normed(model)
    assert torch.equal(speak(), before)


def test_a_kokoro_without_the_internals_used_is_named():
    class Bare:
        vocab = {}
        bert = bert_encoder = text_encoder = decoder = object()

    with pytest.raises(KokoroInternalsChanged, match="predictor"):
        check_kokoro_internals(Bare())


@pytest.mark.model
def test_the_decoder_does_not_decode_the_silence_that_is_trimmed(real_engine):
    """The decoder's own output starts and ends within a few frames of the sound: Kokoro's
    ~250 ms lead and ~500 ms trail are neither decoded nor published. (On the voice the sound
    threshold was measured on; af_heart's trail keeps ~170 ms: docs/worker.md.)"""
    decoded: list[np.ndarray] = []
    folded = real_engine.generator

    def captured(*window):
        audio = folded(*window)
        decoded.append(audio.reshape(-1).numpy().copy())
        return audio

    real_engine.generator = captured
    real_engine.windowed = False  # the generator in one call, to look at its output whole
    try:
        pcm = b"".join(real_engine.stream("Your refund was issued this morning.", "en", "jf_alpha"))
        one_call = real_engine.last_decoded_frames
    finally:
        real_engine.generator = folded
        real_engine.windowed = True
    assert len(decoded) == 1
    # windowed decoding (the default) decodes the same sounding span, window by window
    b"".join(real_engine.stream("Your refund was issued this morning.", "en", "jf_alpha"))
    assert real_engine.last_decoded_frames == one_call and one_call[0] < one_call[1]
    frame = kokoro_frames.SAMPLES_PER_FRAME
    loud = np.flatnonzero(np.abs(decoded[0]) * 32767 > SILENCE_THRESHOLD)
    # context frames, plus the frames where the predicted energy is above the threshold but the
    # samples are not yet (or no longer) above -60 dBFS; Kokoro alone: ~10 frames before, ~20 after
    edge = 6 * frame
    assert loud[0] <= edge and len(decoded[0]) - 1 - loud[-1] <= edge
    # what is published still keeps the margins (trail made up with zeros, not decoded)
    samples = np.frombuffer(pcm, "<i2")
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > SILENCE_THRESHOLD)
    lead_ms, trail_ms = real_engine.silence_margins_ms
    assert loud[0] == lead_ms * 24 or loud[0] < lead_ms * 24
    assert len(samples) - 1 - loud[-1] == trail_ms * 24


def test_cut_silence_stands_in_the_statistics_through_the_kept_silent_frames():
    from voicebus.synthesis.kokoro_frames import stand_in_weights

    weights = stand_in_weights(start=8, stop=20, count=30, lead=2, trail=2).tolist()
    assert weights[:2] == [5.0, 5.0] and weights[2:10] == [1.0] * 8 and weights[10:] == [6.0, 6.0]
    assert sum(weights) == 30  # the whole piece's frame count
    assert stand_in_weights(0, 30, 30, 2, 2).tolist() == [1.0] * 30


def test_weighted_norms_with_equal_weights_are_kokoros_norms(tiny_engine):
    import torch

    model = tiny_engine.model
    phonemes = tiny_engine.phonemize("Good morning.", "en")[0]
    ref_s = tiny_engine.voice_packs["af_heart"][len(phonemes) - 1]
    with torch.inference_mode():
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s)
        torch.manual_seed(3)
        plain = kokoro_frames.decode_frames(model, frames)
        torch.manual_seed(3)
        weighted = kokoro_frames.decode_frames(model, frames, weights=torch.full((frames.count,), 2.0))
    assert torch.allclose(plain, weighted, atol=1e-4)
    assert not any("forward" in vars(m) for m in model.decoder.modules())  # kokoro's modules restored


# --- windowed decoding ---------------------------------------------------


def test_windows_start_short_and_grow_so_each_is_decoded_while_the_ones_before_play():
    from voicebus.synthesis.kokoro_frames import FIRST_WINDOW_FRAMES, MIN_WINDOW_FRAMES, seams

    cuts = seams(300, lead=2)
    assert cuts[0] == 2 + FIRST_WINDOW_FRAMES
    bounds = [0, *cuts, 300]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert all(later >= 2 * sum(sizes[:i + 1]) for i, later in enumerate(sizes[1:-1]))
    assert sizes[-1] >= MIN_WINDOW_FRAMES
    assert seams(2 + FIRST_WINDOW_FRAMES + MIN_WINDOW_FRAMES - 1, lead=2) == []  # too short: decoded whole


def test_one_window_is_kokoros_decoder_and_windows_give_audio_of_the_same_length(tiny_engine):
    """prepare_decoder + generate with no cut is exactly `kokoro.istftnet.Decoder.forward`; the
    windows' parts join to the span's length (600 samples a frame), the first part ending
    before the first seam's crossfade."""
    import torch

    model = tiny_engine.model
    phonemes = tiny_engine.phonemize("Good morning, my friend.", "en")[0]
    ref_s = tiny_engine.voice_packs["af_heart"][len(phonemes) - 1]
    with torch.inference_mode():
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s)
        torch.manual_seed(5)
        whole = kokoro_frames.decode_frames(model, frames)
        torch.manual_seed(5)
        prepared = kokoro_frames.prepare_decoder(model, frames)
        assert torch.equal(torch.cat(list(kokoro_frames.decode_windows(model, prepared, []))), whole)
        cuts = [kokoro_frames.seams(prepared.count)[0]]
        parts = list(kokoro_frames.decode_windows(model, prepared, cuts))
    frame = kokoro_frames.SAMPLES_PER_FRAME
    assert len(parts) == 2 and sum(len(p) for p in parts) == len(whole)
    assert len(parts[0]) == (cuts[0] - kokoro_frames.CROSSFADE_FRAMES) * frame
    # away from the seam's context, the second window decodes what the whole span does
    # (the generator's statistics differ a little: same excitation, close, not equal)
    tail = slice((cuts[0] + 20) * frame, None)
    assert torch.corrcoef(torch.stack([torch.cat(parts)[tail], whole[tail]]))[0, 1] > 0.9


def test_the_crossfade_weights_sum_to_one_with_their_complement():
    import torch

    from voicebus.synthesis.kokoro_frames import crossfade_weights

    w = crossfade_weights(2400)
    assert 0 < w[0] < 0.01 and 0.99 < w[-1] < 1 and torch.all(w[1:] >= w[:-1])
    assert torch.allclose(w + w.flip(0), torch.ones(2400))


def _share_of_silence(window: "kokoro_frames.DecoderInput", lo: int, hi: int) -> float:
    import torch

    lead, trail = window.silent
    silent = torch.zeros(window.count, dtype=torch.bool)
    silent[:lead] = True
    silent[window.count - trail :] = True
    weights = window.weights[lo:hi]
    return float(weights[silent[lo:hi]].sum() / weights.sum())


def test_every_window_s_norms_see_the_span_s_share_of_silence():
    """The generator's norms weigh each window's silence as the whole span's statistics do
    (`window_input`): a window with edge silence of its own has it reweighted, a window with
    none gets a silence carrier before its left context, and the whole span is left as it is."""
    import torch

    from voicebus.synthesis.kokoro_frames import SILENCE_CARRIER_FRAMES, DecoderInput, window_input

    count, lead, trail = 60, 2, 2
    x = torch.arange(count, dtype=torch.float32).repeat_interleave(2).reshape(1, 1, -1).repeat(1, 3, 1)
    source = torch.arange(count, dtype=torch.float32).repeat_interleave(600).reshape(1, -1)
    weights = torch.ones(count)
    weights[:lead] += 30 / lead  # 30 silent frames cut before the span, 50 after
    weights[count - trail :] += 50 / trail
    span = DecoderInput(x=x, source=source, style=torch.zeros(1, 128), weights=weights, silent=(lead, trail))
    share = _share_of_silence(span, 0, count)

    assert window_input(span, 0, count) == (span, 0, count, 0)
    for left, right in ((0, 24), (40, count)):  # the first window (lead silence), the last (trail)
        window, lo, hi, carrier = window_input(span, left, right)
        assert (lo, hi, carrier) == (left, right, 0) and window.x is span.x
        assert abs(_share_of_silence(window, lo, hi) - share) < 1e-6
        assert torch.equal(window.weights[left:right][lead:-trail], torch.ones(right - left - lead - trail))
    window, lo, hi, carrier = window_input(span, 12, 40)  # a middle window: no silence of its own
    assert (lo, hi, carrier) == (0, SILENCE_CARRIER_FRAMES + 28, SILENCE_CARRIER_FRAMES)
    assert window.silent == (SILENCE_CARRIER_FRAMES, 0)
    assert abs(_share_of_silence(window, lo, hi) - share) < 1e-6
    # the carrier is the span's lead silence; then the window's own frames, input and source alike
    assert window.x[0, 0, ::2].tolist() == [0, 1, 0, 1] + list(range(12, 40))
    assert window.source[0, ::600].tolist() == [0, 1, 0, 1] + list(range(12, 40))
    # a span with no known silence is decoded as it is
    bare = DecoderInput(x=x, source=source, style=span.style, weights=None)
    assert window_input(bare, 12, 40) == (bare, 12, 40, 0)


def test_prepare_decoder_knows_the_span_s_edge_silence():
    from voicebus.synthesis.kokoro_frames import edge_silence

    assert edge_silence([-9, -9, -3, 0, -8, 1, -9]) == (2, 1)
    assert edge_silence([-9, -9]) == (0, 0)


def test_decode_windows_decodes_each_window_with_the_span_s_share_of_silence(tiny_engine):
    """The windows `decode_windows` decodes are `window_input`'s: a middle window's audio is
    the generator on its silence carrier and its own frames (not on its frames alone)."""
    import torch

    from voicebus.synthesis.kokoro_frames import CROSSFADE_FRAMES, SAMPLES_PER_FRAME, SEAM_CONTEXT_FRAMES, window_input

    model = tiny_engine.model
    text = "Good morning, my friend, the weather is fine today and the park is open until nine tonight."
    phonemes = tiny_engine.phonemize(text, "en")[0]
    ref_s = tiny_engine.voice_packs["af_heart"][len(phonemes) - 1]
    with torch.inference_mode():
        torch.manual_seed(5)
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s)
        weights = torch.ones(frames.count)
        weights[:2] += 10.0
        prepared = kokoro_frames.prepare_decoder(model, frames, weights=weights)
        prepared.silent = (2, 2)  # the tiny model's energy is random: say where its silence is
        lo, hi = 24, 24 + 2 * SEAM_CONTEXT_FRAMES + 10
        assert hi + 20 < prepared.count, "the text gives a span long enough for a middle window"
        parts = list(kokoro_frames.decode_windows(model, prepared, [lo, hi]))
        left, right = lo - SEAM_CONTEXT_FRAMES, hi + SEAM_CONTEXT_FRAMES
        window, start, stop, carrier = window_input(prepared, left, right)
        assert carrier
        expected = kokoro_frames.generate(model, window, start, stop)[carrier * SAMPLES_PER_FRAME :]
        plain = kokoro_frames.generate(model, prepared, left, right)
    frame = SAMPLES_PER_FRAME
    # the middle part past its crossfade-in is the middle window's own audio
    inner = slice((lo + CROSSFADE_FRAMES - left) * frame, (hi - CROSSFADE_FRAMES - left) * frame)
    got = parts[1][2 * CROSSFADE_FRAMES * frame :]
    assert torch.allclose(got, expected[inner], atol=1e-6)
    assert not torch.allclose(got, plain[inner], atol=1e-3)


def _playback_stall(count: int, decode_s_per_frame: float, plan) -> tuple[float, float]:
    """(time to first audio, silence inside the piece) for a player that starts at the first
    window, when each window takes ``decode_s_per_frame`` per frame it decodes (its overhead
    included) and ``plan(lo, ahead_s)`` says where the window starting at ``lo`` ends."""
    from voicebus.synthesis.kokoro_frames import SECONDS_PER_FRAME, SEAM_CONTEXT_FRAMES, window_overhead

    now, lo, play_end, stall, first = 0.3, 0, None, 0.0, None  # 0.3 s: prediction and the decoder's first half
    while lo < count:
        hi = plan(lo, 0.0 if play_end is None else play_end - now)
        now += decode_s_per_frame * (hi - lo + (window_overhead() if lo else SEAM_CONTEXT_FRAMES))
        if play_end is None:
            first, play_end = now, now
        elif now > play_end:
            stall, play_end = stall + now - play_end, now
        play_end += (hi - lo) * SECONDS_PER_FRAME
        lo = hi
    return first, stall


@pytest.mark.parametrize("decode_ms", [7, 10, 13, 16])
@pytest.mark.parametrize("count", [64, 86, 175, 406])
def test_windows_planned_from_the_decode_speed_keep_the_player_fed(decode_ms, count):
    """On a machine that decodes faster than real time (7 ms a frame: 2 threads on the 2-core
    CPU; 13-16 ms: 1 thread), windows planned from the measured speed leave no silence inside
    a piece; the fixed sizes of `seams` did (up to 2 s at 16 ms a frame)."""
    from voicebus.synthesis.kokoro_frames import first_cut, next_cut, seams

    spf = decode_ms / 1000

    def planned(lo, ahead):
        return first_cut(count, 2, spf) if lo == 0 else next_cut(lo, count, ahead, spf)

    _, stall = _playback_stall(count, spf, planned)
    assert stall <= 0.02
    ends = [*seams(count, lead=2), count]
    _, fixed_stall = _playback_stall(count, spf, lambda lo, ahead: next(e for e in ends if e > lo))
    if decode_ms >= 10 and count >= 86:
        assert fixed_stall > 0.1  # what the plan is for


def test_the_first_window_grows_only_as_much_as_the_decode_speed_needs():
    from voicebus.synthesis.kokoro_frames import (
        FIRST_WINDOW_FRAMES, MAX_FIRST_WINDOW_FRAMES, MIN_WINDOW_FRAMES, first_cut, keep_up_frames, next_cut)

    assert first_cut(500, 2, None) == 2 + FIRST_WINDOW_FRAMES  # nothing measured yet
    assert first_cut(500, 2, 0.005) == 2 + FIRST_WINDOW_FRAMES  # fast: no need
    sizes = [first_cut(500, 0, ms / 1000) for ms in (10, 13, 16, 20, 40)]
    assert sizes == sorted(sizes) and sizes[-1] == MAX_FIRST_WINDOW_FRAMES
    assert keep_up_frames(0.005) == MIN_WINDOW_FRAMES and keep_up_frames(0.03) is None
    # too short for two windows: one
    assert first_cut(2 + FIRST_WINDOW_FRAMES + MIN_WINDOW_FRAMES - 1, 2, None) == 2 + FIRST_WINDOW_FRAMES + MIN_WINDOW_FRAMES - 1
    # a window that would leave less than a minimal one takes the rest
    assert next_cut(40, 70, 10.0, 0.005) == 70
    # no speed known: windows grow as `seams` places them
    assert next_cut(18, 500, 0.3, None) == 18 + int(2.5 * 18)


LONG_TEXT = "Good morning, my friend, the weather is fine today and the park is open until nine tonight."
# ~100 frames of the tiny model: enough for the folds' windows, a third of LONG_TEXT's cost (the
# decoder is full size, and bfloat16 without AMX is ~6x slower than float32: 90 s on LONG_TEXT)
FOLD_TEXT = "Good morning, my friend."


def _tiny_frames(tiny_engine, text: str = LONG_TEXT) -> "kokoro_frames.Frames":
    """The tiny model's prediction for ``text`` (call under inference mode)."""
    phonemes = tiny_engine.phonemize(text, "en")[0]
    return kokoro_frames.predict_frames(tiny_engine.model, phonemes, tiny_engine.voice_packs["af_heart"][len(phonemes) - 1])


def _span(tiny_engine, seed: int = 5, text: str = LONG_TEXT):
    """A prepared span of the tiny model with stand-in weights and a known edge silence."""
    import torch

    model = tiny_engine.model
    torch.manual_seed(seed)
    frames = _tiny_frames(tiny_engine, text)
    weights = torch.ones(frames.count)
    weights[:2] += 10.0
    prepared = kokoro_frames.prepare_decoder(model, frames, weights=weights)
    prepared.silent = (2, 2)
    return prepared


@pytest.mark.parametrize("tiled", [False, True], ids=["direct", "tiled"])
def test_the_folded_generator_in_float32_is_kokoros_generator(tiny_engine, tiled):
    """`FoldedGenerator` (channels-last 2-D convolutions, AdaIN and Snake folded) computes
    kokoro's generator with this module's weighted norms: on a whole span, without weights, on
    a window of it and on a window with a silence carrier (`window_input`); with its wide
    convolutions through short DFTs and its 3-tap ones of 256 channels through F(4, 3)
    (`tiled_conv`, the engine's float32 path) too."""
    import torch

    from voicebus.synthesis.kokoro_frames import FoldedGenerator, window_input
    from voicebus.synthesis.tiled_conv import TiledConv, WinogradConv

    model = tiny_engine.model
    folded = FoldedGenerator(model, torch.float32, tiled=tiled)
    convs = [conv for layers in folded.resblocks + folded.noise_res for layer in layers for conv in layer[1::2]]
    wide = [isinstance(conv.tiled, TiledConv) for conv in convs]
    winograd = [isinstance(conv.tiled, WinogradConv) for conv in convs]
    assert wide == [tiled and conv.shape[-1] >= 7 for conv in convs]
    assert winograd == [tiled and conv.shape[-1] == 3 and conv.shape[0] >= 256 for conv in convs]
    assert any(wide) and any(winograd) if tiled else not any(wide + winograd)
    with torch.inference_mode():
        prepared = _span(tiny_engine, text=FOLD_TEXT)
        unweighted = kokoro_frames.DecoderInput(prepared.x, prepared.source, prepared.style, None, prepared.silent)
        carried = window_input(prepared, 20, 40)
        assert carried[3], "a middle window gets a silence carrier"
        cases = [(prepared, 0, prepared.count), (unweighted, 0, prepared.count), (prepared, 10, 34), carried[:3]]
        for window, start, stop in cases:
            expected = kokoro_frames.generate(model, window, start, stop)
            got = folded(window, start, stop)
            assert got.dtype == torch.float32 and got.shape == expected.shape
            assert torch.allclose(got, expected, atol=1e-4 * float(expected.abs().max()), rtol=0)


def test_a_tiled_convolution_keeps_no_direct_weights_and_still_takes_a_batch(tiny_engine):
    """A convolution through tiles keeps only its transformed kernel (the direct weights would
    double a float32 decoder's memory); given a batch, it tiles each item: the direct
    convolution's output."""
    import torch

    from voicebus.synthesis.kokoro_frames import FoldedGenerator

    model = tiny_engine.model
    direct, tiled = FoldedGenerator(model, torch.float32), FoldedGenerator(model, torch.float32, tiled=True)
    for layer in (0, 1):  # a 3-tap and a 7-tap convolution of the first stage's first block
        ours, theirs = tiled.resblocks[layer][0][1], direct.resblocks[layer][0][1]
        assert ours.tiled is not None and ours.weight is None and theirs.weight is not None
        assert ours.shape == tuple(theirs.weight.squeeze(2).shape)
        x = torch.randn(3, ours.shape[1], 1, 40).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            got, expected = FoldedGenerator._apply_conv(ours, x), FoldedGenerator._apply_conv(theirs, x)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=0)


def test_the_folded_generator_in_bfloat16_stays_close_to_kokoros(tiny_engine):
    """In bfloat16 the convolutions round their inputs to 8 bits of mantissa: the audio stays
    close to kokoro's float32 audio (relative RMS error a few percent, float32 audio out)."""
    import torch

    from voicebus.synthesis.kokoro_frames import FoldedGenerator

    with torch.inference_mode():
        prepared = _span(tiny_engine, text=FOLD_TEXT)
        expected = kokoro_frames.generate(tiny_engine.model, prepared)
        got = FoldedGenerator(tiny_engine.model, torch.bfloat16)(prepared)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    error = float((got - expected).square().mean().sqrt() / expected.square().mean().sqrt())
    assert error < 0.1, error


def test_the_folded_norms_statistics_do_not_cancel_in_bfloat16():
    """A channel whose mean is large against its spread: its variance taken in float32 and
    centred is right to a fraction of a percent on bfloat16 activations, where bfloat16 or
    E[x^2] - mean^2 statistics were off by tens of percent (the generator's log-mel distance to
    kokoro's audio 1.04 against 0.075)."""
    import torch

    from voicebus.synthesis.kokoro_frames import channel_stats

    generator = torch.Generator().manual_seed(0)
    steps = 4000
    x = (4.0 + 0.5 * torch.randn(1, 8, 1, steps, generator=generator)).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last)
    weights = torch.rand(steps, generator=generator)
    weights /= weights.sum()
    mean, var = channel_stats(x, weights)
    values = x.float().reshape(8, steps)
    expected_mean = (values * weights).sum(-1)
    expected_var = ((values - expected_mean[:, None]).square() * weights).sum(-1)
    assert torch.allclose(mean, expected_mean, rtol=1e-5)
    assert torch.allclose(var, expected_var, rtol=1e-3)


@pytest.mark.model
def test_the_engine_s_decoder_sounds_as_kokoro_s_in_float32(real_engine):
    """The engine's decoder (its folded frame-rate half and generator: bfloat16 on a CPU with
    AMX, float32 elsewhere) is closer to
    kokoro's float32 audio of the same frames and excitation than two float32 decodes with
    different noise seeds are to each other. With ``conv_post`` in bfloat16 it was not
    (0.075 against 0.031: its output is the inverse STFT's log-magnitude and phase)."""
    import torch

    from voicebus.ops.bench.seams import log_mel_distance

    model = real_engine.model
    (phonemes,) = real_engine.phonemize("Your refund was issued this morning, and it should reach you soon.", "en")
    ref_s = real_engine.voice_packs[real_engine.resolve_voice("af_heart")][len(phonemes) - 1]
    with torch.inference_mode():
        torch.manual_seed(0)
        frames = kokoro_frames.predict_frames(model, phonemes, ref_s)
        start, stop = kokoro_frames.sound_span(frames.frame_energy())
        weights = kokoro_frames.stand_in_weights(start, stop, frames.count, kokoro_frames.CONTEXT_FRAMES, kokoro_frames.CONTEXT_FRAMES)
        prepared = kokoro_frames.prepare_decoder(model, frames, start, stop, weights)
        other_noise = kokoro_frames.prepare_decoder(model, frames, start, stop, weights)
        kokoro = kokoro_frames.generate(model, prepared).numpy()
        seed_distance = log_mel_distance(kokoro_frames.generate(model, other_noise).numpy(), kokoro)
        ours = real_engine.generator(dataclasses.replace(prepared, x=real_engine.frame_rate_half(frames, start, stop, weights))).numpy()
    assert log_mel_distance(ours, kokoro) < seed_distance, (log_mel_distance(ours, kokoro), seed_distance)


def test_the_bfloat16_bert_stays_close_to_kokoro_s_and_leaves_the_model_s_own(tiny_engine):
    """`Bfloat16Bert`: a copy in bfloat16, float32 out, close to kokoro's float32 PL-BERT; the
    model's ``bert`` (kokoro's forward uses it) stays float32."""
    import torch

    model = tiny_engine.model
    (phonemes,) = tiny_engine.phonemize("Good morning, how are you?", "en")
    ids = kokoro_frames.token_ids(model, phonemes)
    mask = torch.ones_like(ids, dtype=torch.int)
    bert = kokoro_frames.Bfloat16Bert(model)
    with torch.inference_mode():
        ours, theirs = bert(ids, mask), model.bert(ids, attention_mask=mask)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05
    assert next(model.bert.parameters()).dtype == torch.float32


def test_the_prepacked_bert_is_kokoro_s_and_leaves_the_model_s_own(tiny_engine):
    """`PrepackedBert`: a float32 copy with every linear layer prepacked for oneDNN, the same
    output as kokoro's PL-BERT to float32 rounding; the model's ``bert`` keeps its own."""
    import torch

    from voicebus.synthesis.torch_ops import PrepackedLinear

    model = tiny_engine.model
    (phonemes,) = tiny_engine.phonemize("Good morning, how are you?", "en")
    ids = kokoro_frames.token_ids(model, phonemes)
    mask = torch.ones_like(ids, dtype=torch.int)
    bert = kokoro_frames.PrepackedBert(model)
    assert bert.linears == sum(isinstance(m, torch.nn.Linear) for m in model.bert.modules()) > 0
    assert not any(isinstance(m, PrepackedLinear) for m in model.bert.modules())
    with torch.inference_mode():
        ours, theirs = bert(ids, mask), model.bert(ids, attention_mask=mask)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-5 * float(theirs.abs().max()), rtol=0)


def test_the_bfloat16_bert_predicts_kokoro_s_durations(real_engine):
    """On the real weights the bfloat16 PL-BERT (the engine's where its precision is bfloat16)
    predicts the durations kokoro's float32 one does: a token's frames differ by one at most, on
    at most 2 % of the tokens (measured: 1 token of 174)."""
    import torch

    model = real_engine.model
    bert = kokoro_frames.Bfloat16Bert(model)
    generator = real_engine.generator
    assert isinstance(real_engine.bert, kokoro_frames.Bfloat16Bert) == (generator is not None and generator.dtype == torch.bfloat16)
    ref = real_engine.voice_packs[real_engine.resolve_voice("af_heart")]
    differing, tokens = 0, 0
    for text in ("The train to the airport leaves every twenty minutes from the second platform.",
                 "When the morning train finally pulled into the station after a long delay, the passengers, "
                 "who had been waiting since dawn in the cold, hurried towards the exits without a word.",
                 "Your refund was issued this morning.", "Sure, I can help with that."):
        for phonemes in real_engine.phonemize(text, "en"):
            with torch.inference_mode():
                ours = kokoro_frames.predict_frames(model, phonemes, ref[len(phonemes) - 1], bert=bert).durations
                theirs = kokoro_frames.predict_frames(model, phonemes, ref[len(phonemes) - 1]).durations
            assert (ours - theirs).abs().max().item() <= 1, text
            differing, tokens = differing + int((ours != theirs).sum()), tokens + len(theirs)
    assert differing <= 0.02 * tokens, (differing, tokens)


def test_the_folded_frame_rate_half_in_float32_is_kokoros(tiny_engine):
    """`FoldedFrameRateHalf` computes kokoro's frame-rate half of the decoder (encode and the
    decode blocks, the last upsampling) with this module's weighted norms, its 3-tap
    convolutions directly or through F(4, 3) (`tiled_conv`, the engine's float32 path), and in
    bfloat16 stays close to it."""
    import torch

    from voicebus.synthesis.kokoro_frames import FoldedFrameRateHalf
    from voicebus.synthesis.tiled_conv import WinogradConv

    model = tiny_engine.model
    halves = [FoldedFrameRateHalf(model, torch.float32), FoldedFrameRateHalf(model, torch.float32, tiled=True)]
    through = [sum(isinstance(c.tiled, WinogradConv) for b in half.blocks for c in (b.conv1, b.conv2)) for half in halves]
    assert through == [0, 10]  # encode's and the four decode blocks' two 3-tap convolutions
    with torch.inference_mode():
        torch.manual_seed(5)
        frames = _tiny_frames(tiny_engine)
        start, stop = 3, frames.count - 4
        weights = kokoro_frames.stand_in_weights(start, stop, frames.count, 2, 2)
        for w in (None, weights):
            expected = kokoro_frames.prepare_decoder(model, frames, start, stop, w).x
            for half in halves:
                got = half(frames, start, stop, w)
                assert got.dtype == torch.float32 and got.shape == expected.shape
                assert torch.allclose(got, expected, atol=1e-4 * float(expected.abs().max()), rtol=0)
        near = FoldedFrameRateHalf(model, torch.bfloat16)(frames, start, stop, weights)  # `expected` is the weighted one
    error = float((near - expected).square().mean().sqrt() / expected.square().mean().sqrt())
    assert error < 0.05, error


def test_prepare_decoder_with_a_folded_half_keeps_kokoro_s_excitation(tiny_engine):
    """With the folded frame-rate half, the span's harmonic source is drawn as before (the same
    random draws, after the frame-rate half): only the generator's input changes."""
    import torch

    from voicebus.synthesis.kokoro_frames import FoldedFrameRateHalf

    model = tiny_engine.model
    with torch.inference_mode():
        frames = _tiny_frames(tiny_engine, "Good morning, my friend.")
        torch.manual_seed(7)
        kokoro = kokoro_frames.prepare_decoder(model, frames)
        torch.manual_seed(7)
        folded = kokoro_frames.prepare_decoder(model, frames, half=FoldedFrameRateHalf(model))
    assert torch.equal(kokoro.source, folded.source) and folded.silent == kokoro.silent
    assert torch.allclose(kokoro.x, folded.x, atol=1e-4 * float(kokoro.x.abs().max()), rtol=0)


# --- pauses inside a phrase ----------------------------------------------------

LOUD, QUIET = 5.0, -8.0
FAINT = -1.1  # above `INNER_SILENCE_ENERGY`, below `INNER_SILENCE_RELEASE_ENERGY`


def test_a_long_silence_inside_a_phrase_is_cut_to_its_edges():
    # "nine to": the 'n' holds 8 silent frames, then the space 2 more, then "to" sounds
    energy = [LOUD] * 4 + [QUIET] * 10 + [LOUD] * 4
    owners = ["I"] * 4 + ["n"] * 8 + [" "] * 2 + ["t"] * 4
    cut = kokoro_frames.inner_silence(energy, owners, keep=3)
    # the decay into it (2 frames) and the onset out of it (1) are kept, the 7 between cut
    assert cut == list(range(6, 13))


# Predicted energies of hf_alpha's slow decays into five unpunctuated Hindi word boundaries
# (after "हैं", "वाले", "वाली", "में", "बाद"; the per-language bench's sentences, seeded), each
# heard as a 200-220 ms pause when only its frames at or below -2 were cut.
HINDI_DECAYS = (
    ([-0.9, -1.6, -2.1, -2.7, -3.1, -3.3, -3.4, -3.5], ["̃"] * 7 + [" "]),
    ([-0.8, -1.5, -2.1, -2.5, -2.8, -2.9, -3.2, -3.5], ["ː"] * 5 + [" "] * 3),
    ([-1.0, -1.5, -1.9, -2.3, -2.6, -2.6], ["i"] * 5 + [" "]),
    ([-0.3, -1.1, -1.7, -2.2, -2.7, -3.1, -3.3, -3.2], ["ː"] * 8),
    ([-0.8, -1.5, -2.1, -2.6, -3.0, -3.3, -3.6, -3.7, -2.6], ["ː"] * 7 + [" "] * 2),
)


@pytest.mark.parametrize("decay, owners", HINDI_DECAYS)
def test_a_slow_decay_into_a_word_boundary_is_cut_from_where_it_is_inaudible(decay, owners):
    """A decay is cut from its first frame at or below `INNER_SILENCE_ENERGY` (-1.4): at -2 the
    third was not cut at all, and the others kept 200 ms of quiet (docs/worker.md,
    "Mid-phrase pauses")."""
    energy = [LOUD] * 3 + decay + [LOUD] * 3
    cut = kokoro_frames.inner_silence(energy, ["a"] * 3 + owners + ["k"] * 3, keep=3)
    quiet = [i for i, e in enumerate(energy) if e <= -1.4]
    assert cut == quiet[2:-1]  # of the quiet run, its first 2 frames and its last are kept


# ef_dora's "nwˈeβe | pˌaɾa" in the Spanish long phrase (seeded): 11 frames under -1.4 but for a
# bump to -1.08 in their middle, which decodes under -40 dB but for 10 ms; heard as a 260-280 ms
# pause when the bump split it in two, neither longer than the 3 frames kept. pf_dora's
# "nˈɔvy | pˌaɾæ" in the Portuguese one: a bump to -0.69, 260 ms under -35 dB.
BUMPED = [3.34, 0.09, -1.96, -1.63, -1.37, -1.16, -1.08, -1.15, -1.48, -1.92, -2.12, -2.25, -2.94, 2.68]
BUMPED_OWNERS = ["e"] * 11 + [" "] * 3
BUMPED_PT = [4.11, 1.36, -1.61, -1.06, -0.76, -0.69, -0.81, -1.22, -1.56, -1.75, -2.22, 1.76, 6.77]
BUMPED_PT_OWNERS = ["y"] * 9 + [" "] * 3 + ["p"]


def test_a_faint_bump_inside_a_silence_does_not_split_it():
    cut = kokoro_frames.inner_silence(BUMPED, BUMPED_OWNERS, keep=3)
    # the silence from its first frame at -1.96 to its last at -2.94: its first 2 and last 1 kept
    assert cut == list(range(4, 12))
    assert kokoro_frames.inner_silence(BUMPED_PT, BUMPED_PT_OWNERS, keep=3) == list(range(4, 10))


def test_a_louder_bump_ends_the_silence():
    """Above `INNER_SILENCE_RELEASE_ENERGY` a bump is sound: each side a silence of its own,
    the first too short to cut, the second cut to its edges."""
    energy = BUMPED[:6] + [0.0] + BUMPED[7:]
    assert kokoro_frames.inner_silence(energy, BUMPED_OWNERS, keep=3) == [10, 11]


def test_a_closure_and_a_punctuated_pause_are_not_cut():
    closure = [LOUD] * 4 + [QUIET] * 2 + [LOUD] * 4  # the 't' of "visit"
    assert kokoro_frames.inner_silence(closure, ["ɪ"] * 4 + ["t"] * 2 + ["ə"] * 4, keep=3) == []
    comma = [LOUD] * 4 + [QUIET] * 12 + [LOUD] * 4  # "nine, to": the text asks for that pause
    owners = ["n"] * 6 + [","] * 6 + [" "] * 4 + ["t"] * 4
    assert kokoro_frames.inner_silence(comma, owners, keep=3) == []


def test_the_silence_before_and_after_the_sound_is_not_inner():
    energy = [QUIET] * 10 + [LOUD] * 4 + [QUIET] * 12
    assert kokoro_frames.inner_silence(energy, ["n"] * 26, keep=3) == []


def test_inner_silence_leaves_no_unpunctuated_silence_longer_than_kept():
    """Property: whatever the energy and punctuation, after the cut no silence between two loud
    frames (faint bumps inside it included) and owned by no punctuation is longer than ``keep``;
    only silent and faint frames are cut, and every loud frame stays."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    threshold, release = kokoro_frames.INNER_SILENCE_ENERGY, kokoro_frames.INNER_SILENCE_RELEASE_ENERGY
    frame = st.tuples(st.sampled_from([LOUD, 0.0, FAINT, -3.0, QUIET]), st.sampled_from(["a", "n", " ", ",", "."]))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(frame, max_size=60), st.integers(0, 5))
    def check(frames, keep):
        energy = [e for e, _ in frames]
        owners = [o for _, o in frames]
        cut = set(kokoro_frames.inner_silence(energy, owners, keep))
        assert all(energy[i] <= release for i in cut)
        left = [(e, o) for i, (e, o) in enumerate(frames) if i not in cut]
        run: list[str] = []  # the owners of the silence so far, from its first silent frame
        span = 0  # its frames up to its last silent one
        seen_loud = False
        for e, o in left:
            if e <= threshold:
                run.append(o)
                span = len(run)
                continue
            if run and e <= release:
                run.append(o)
                continue
            if seen_loud and span > keep:
                assert any(p in kokoro_frames.PHRASE_PUNCTUATION for p in run[:span]), (frames, keep, cut)
            seen_loud, run, span = True, [], 0

    check()


def test_shortened_frames_stay_in_step_with_their_durations():
    """`shorten_inner_silence` cuts the same frames from the text encoding, F0 and energy (two
    values a frame), and from the durations of the tokens that owned them: word timings, taken
    from the durations, follow the cut."""
    import torch

    durations = torch.tensor([2, 4, 8, 2, 4, 1])  # pad, "I", "n" (6 silent), " " (silent), "t", pad
    symbols = ["", "I", "n", " ", "t", ""]
    count = int(durations.sum())
    energy = [QUIET] * 2 + [LOUD] * 4 + [LOUD] * 2 + [QUIET] * 6 + [QUIET] * 2 + [LOUD] * 4 + [QUIET]
    frames = kokoro_frames.Frames(
        asr=torch.arange(count, dtype=torch.float32).repeat(512, 1)[None],
        f0=torch.arange(2 * count, dtype=torch.float32)[None],
        n=torch.tensor(energy).repeat_interleave(2)[None],
        style=torch.zeros(1, 128),
        durations=durations,
    )
    short = kokoro_frames.shorten_inner_silence(frames, symbols, keep=3)
    assert short.count == count - 5 == int(short.durations.sum())
    # of the 8 silent frames, the "n"'s first 2 and the space's last 1 are kept
    assert short.durations.tolist() == [2, 4, 4, 1, 4, 1]
    kept = short.asr[0, 0].long().tolist()
    assert kept == [*range(0, 10), *range(15, count)]
    assert short.f0[0].long().tolist() == [v for i in kept for v in (2 * i, 2 * i + 1)]
    assert short.frame_energy() == [energy[i] for i in kept]
    # nothing to cut: the very same frames
    assert kokoro_frames.shorten_inner_silence(frames, symbols, keep=8) is frames
    with pytest.raises(ValueError, match="symbols"):
        kokoro_frames.shorten_inner_silence(frames, symbols[:-1])
