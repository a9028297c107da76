"""Kokoro's forward pass cut at the decoder (`pipeline.synthesis.kokoro_frames`): the tiny
random-weight model for exactness, the offline pack's real weights for the silence skipped."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.synthesis import kokoro_frames
from pipeline.synthesis.engine import SILENCE_THRESHOLD, trim_silence
from pipeline.synthesis.kokoro_frames import KokoroInternalsChanged, check_kokoro_internals, sound_span


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


def test_a_kokoro_without_the_internals_used_is_named():
    class Bare:
        vocab = {}
        bert = bert_encoder = text_encoder = decoder = object()

    with pytest.raises(KokoroInternalsChanged, match="predictor"):
        check_kokoro_internals(Bare())


@pytest.mark.model
def test_the_decoder_does_not_decode_the_silence_that_is_trimmed(real_engine):
    """The decoder's own output starts and ends within a few frames of the sound: Kokoro's
    ~250 ms lead and ~500 ms trail are neither decoded nor published."""
    decoded: list[np.ndarray] = []
    hook = real_engine.model.decoder.register_forward_hook(lambda module, args, out: decoded.append(out.reshape(-1).numpy().copy()))
    try:
        pcm = b"".join(real_engine.stream("Your refund was issued this morning.", "en", "af_heart"))
    finally:
        hook.remove()
    assert len(decoded) == 1
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
    from pipeline.synthesis.kokoro_frames import stand_in_weights

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


# --- windowed decoding (issue 11 item 2) ---------------------------------------------------


def test_windows_start_short_and_grow_so_each_is_decoded_while_the_ones_before_play():
    from pipeline.synthesis.kokoro_frames import FIRST_WINDOW_FRAMES, MIN_WINDOW_FRAMES, seams

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

    from pipeline.synthesis.kokoro_frames import crossfade_weights

    w = crossfade_weights(2400)
    assert 0 < w[0] < 0.01 and 0.99 < w[-1] < 1 and torch.all(w[1:] >= w[:-1])
    assert torch.allclose(w + w.flip(0), torch.ones(2400))
