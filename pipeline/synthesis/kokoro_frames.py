"""Kokoro's forward pass cut in two at the decoder, so the engine decodes only the frames that sound.

This module owns the one place where voicebus calls kokoro's internals (kokoro==0.9.4 is
pinned): `predict_frames` is `KModel.forward_with_tokens` up to, not including, the decoder
(ALBERT, duration predictor, alignment, F0/energy predictor, text encoder), and
`decode_frames` runs the decoder on a slice of those frames. `check_kokoro_internals` says
early and clearly when a kokoro release no longer has the attributes used here.

Why frames, not token durations: Kokoro's predicted durations put the first sound two to three
frames *inside* the leading pad token, and most of the trailing silence on the last phoneme
(e.g. "morning." gives 'ŋ' 21 frames of which 17 are silent, '.' 7, the end pad 1), so capping
the pad's and the punctuation's durations would either clip the onset or leave most of the
silence. The F0/energy predictor also normalizes over the whole frame sequence, so changing
durations would change the prosody of every frame. Instead the durations and the frame-level
F0 and energy (``N``) are predicted for the whole piece as kokoro does, and the decoder (about
90% of a forward pass on CPU, cost proportional to its frames) gets only the frames from just
before the predicted energy rises to just after it falls (`sound_span`).

One frame is 600 samples (25 ms at 24 kHz); F0 and N come at two values per frame.

Inside the sound, `shorten_inner_silence` cuts a silence Kokoro predicts within a phrase (no
punctuation token in it) down to `MAX_INNER_SILENCE_FRAMES` before anything is decoded, and
shortens the durations of the tokens it belonged to (docs/worker.md,
"Mid-phrase pauses").

Windowed decoding (docs/worker.md "First audio from the first window"):
`prepare_decoder` is `Decoder.forward` up to the generator, over a whole span, plus the
generator's harmonic source drawn once; `generate` is `Generator.forward` on a window of that
span; `first_cut` and `next_cut` plan the windows from the decode speed measured (`seams`: the
fixed plan, a short first window, then growing), `window_input` gives each window the span's
share of silence in its statistics, and `decode_windows` yields each window's audio,
crossfaded at the seams.

`FoldedGenerator` is `generate`'s computation built once from the loaded model's weights: 2-D
convolutions over channels-last tensors, AdaIN and Snake folded into per-channel scales, in
float32 (the same audio within 1e-5; on a CPU its convolutions optionally through short DFTs
or F(4, 3), `voicebus.synthesis.tiled_conv`) or bfloat16 (docs/worker.md, "The generator, folded").

Size: about 1 030 lines, kept whole on purpose: this is the one module that reaches into kokoro's
internals (its predictor, decoder and generator attributes, checked by `check_kokoro_internals`),
and the folded generator, the windowed decoding and the frame prediction all do. Split apart, a
kokoro release that renames an attribute would break several modules instead of one.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from typing import Callable

    import torch

from voicebus.synthesis import tiled_conv

SAMPLES_PER_FRAME = 600

# Predicted energy N (Kokoro's log-energy-like curve) above which a frame may sound. Measured
# on the offline pack: silent frames are at -8.3 to -9.5 and decode to |sample| <= 3;
# N = -5.3 decodes to a peak of 11 (-70 dBFS), -3.5 to 8, -2.2 to 76. -6 sits below every
# frame that reaches the engine's silence threshold (33, -60 dBFS), with context frames on top.
SOUND_ENERGY_THRESHOLD = -6.0

# Frames decoded beyond the sounding ones on each side: the decoder's convolutions see past a
# frame's edge, and onsets/decays ring a little beyond the predicted energy.
CONTEXT_FRAMES = 2

_REQUIRED = (
    "vocab", "bert", "bert_encoder", "predictor", "text_encoder", "decoder",
    "predictor.text_encoder", "predictor.lstm", "predictor.duration_proj", "predictor.F0Ntrain",
    # windowed decoding: the decoder's halves (`prepare_decoder`, `generate`)
    "decoder.encode", "decoder.decode", "decoder.F0_conv", "decoder.N_conv", "decoder.asr_res",
    "decoder.generator.m_source", "decoder.generator.f0_upsamp", "decoder.generator.stft",
    # the harmonic source (`harmonic_source`): SourceModuleHnNSF and its SineGen
    "decoder.generator.m_source.l_sin_gen", "decoder.generator.m_source.l_linear", "decoder.generator.m_source.l_tanh",
    "decoder.generator.m_source.l_sin_gen._f02sine", "decoder.generator.m_source.l_sin_gen._f02uv",
    "decoder.generator.m_source.l_sin_gen.harmonic_num", "decoder.generator.m_source.l_sin_gen.sine_amp",
    "decoder.generator.m_source.l_sin_gen.noise_std",
    "decoder.generator.noise_convs", "decoder.generator.noise_res", "decoder.generator.ups",
    "decoder.generator.resblocks", "decoder.generator.conv_post", "decoder.generator.reflection_pad",
    "decoder.generator.num_upsamples", "decoder.generator.num_kernels", "decoder.generator.post_n_fft",
    # the folded generator (`FoldedGenerator`): AdaINResBlock1 and AdaIN1d's parts
    "decoder.generator.resblocks.0.convs1", "decoder.generator.resblocks.0.convs2", "decoder.generator.resblocks.0.adain1",
    "decoder.generator.resblocks.0.adain2", "decoder.generator.resblocks.0.alpha1", "decoder.generator.resblocks.0.alpha2",
    "decoder.generator.resblocks.0.adain1.0.fc", "decoder.generator.resblocks.0.adain1.0.norm",
    # the folded frame-rate half (`FoldedFrameRateHalf`): AdainResBlk1d's parts
    "decoder.encode.norm1", "decoder.encode.norm2", "decoder.encode.conv1", "decoder.encode.conv2",
    "decoder.encode.conv1x1", "decoder.encode.actv", "decoder.decode.3.pool", "decoder.asr_res.0",
)


class KokoroInternalsChanged(RuntimeError):
    """The installed kokoro lacks an attribute this module calls (kokoro==0.9.4 is pinned)."""


def check_kokoro_internals(model: object) -> None:
    """Raise `KokoroInternalsChanged` naming every attribute of ``model`` that is missing."""
    missing = []
    for path in _REQUIRED:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                missing.append(path)
                break
    if missing:
        raise KokoroInternalsChanged(
            f"kokoro.KModel has no {', '.join(missing)}: voicebus needs kokoro==0.9.4 (pipeline/synthesis/kokoro_frames.py)"
        )


def bake_weight_norms(model) -> int:
    """Fold every weight-normalized layer of ``model`` into a plain weight, once; returns how
    many. Kokoro builds its decoder and predictor convolutions with
    ``torch.nn.utils.weight_norm``, whose hook recomputes ``weight = g * v / ||v||`` before
    every call: for inference the weights never change, so that work is repeated for nothing
    on every forward pass (measured on the offline pack, 2-core CPU: 11-13 % of a short piece's
    time to first audio, most of it in the decoder's 1024-channel convolutions). The baked
    weight is the very tensor the hook would compute, so the audio is identical to the bit."""
    import torch

    baked = 0
    for module in model.modules():
        try:
            torch.nn.utils.remove_weight_norm(module)
        except ValueError:  # this module has no weight norm
            continue
        baked += 1
    return baked


@dataclass
class Frames:
    """Everything the decoder needs for one piece, at frame rate."""

    asr: "torch.Tensor"  # [1, 512, frames]: text encoding aligned to frames
    f0: "torch.Tensor"  # [1, 2 * frames]: predicted pitch
    n: "torch.Tensor"  # [1, 2 * frames]: predicted energy
    style: "torch.Tensor"  # [1, 128]: the voice's decoder half of ref_s
    durations: "torch.Tensor"  # [tokens]: frames per token, pads included

    @property
    def count(self) -> int:
        return int(self.asr.shape[-1])

    def frame_energy(self) -> list[float]:
        """The larger of each frame's two predicted energy values."""
        return self.n.reshape(-1, 2).amax(dim=1).tolist()


def token_ids(model, phonemes: str) -> "torch.Tensor":
    """KModel.forward's mapping: unknown symbols dropped, a 0 pad token on each side."""
    import torch

    ids = [i for i in (model.vocab.get(p) for p in phonemes) if i is not None]
    return torch.LongTensor([[0, *ids, 0]])


def predict_frames(model, phonemes: str, ref_s: "torch.Tensor", speed: float = 1.0, bert: "Callable | None" = None) -> Frames:
    """`KModel.forward_with_tokens` (kokoro 0.9.4) up to the decoder, for one phoneme string.
    Run it under no_grad/inference_mode; ``ref_s`` is the voice row, shape [1, 256]. ``bert``:
    what encodes the phonemes instead of ``model.bert`` (`Bfloat16Bert`), float32 out."""
    import torch

    device = model.device
    input_ids = token_ids(model, phonemes).to(device)
    ref_s = ref_s.to(device)
    tokens = input_ids.shape[-1]
    input_lengths = torch.full((1,), tokens, device=device, dtype=torch.long)
    text_mask = torch.zeros((1, tokens), device=device, dtype=torch.bool)  # one unpadded sequence
    bert_dur = (model.bert if bert is None else bert)(input_ids, attention_mask=(~text_mask).int())
    d_en = model.bert_encoder(bert_dur).transpose(-1, -2)
    s = ref_s[:, 128:]
    d = model.predictor.text_encoder(d_en, s, input_lengths, text_mask)
    x, _ = model.predictor.lstm(d)
    duration = torch.sigmoid(model.predictor.duration_proj(x)).sum(axis=-1) / speed
    durations = torch.round(duration).clamp(min=1).long().reshape(-1)
    indices = torch.repeat_interleave(torch.arange(tokens, device=device), durations)
    alignment = torch.zeros((tokens, indices.shape[0]), device=device)
    alignment[indices, torch.arange(indices.shape[0], device=device)] = 1
    alignment = alignment.unsqueeze(0)
    f0, n = model.predictor.F0Ntrain(d.transpose(-1, -2) @ alignment, s)
    asr = model.text_encoder(input_ids, input_lengths, text_mask) @ alignment
    return Frames(asr=asr, f0=f0, n=n, style=ref_s[:, :128], durations=durations)


def decode_frames(
    model, frames: Frames, start: int = 0, stop: int | None = None, weights: "torch.Tensor | None" = None
) -> "torch.Tensor":
    """Float audio of frames ``start:stop`` (600 samples a frame), decoded as one sequence.
    ``weights`` (one per decoded frame): how many frames each stands for in the decoder's
    instance normalization statistics (`weighted_instance_norms`)."""
    stop = frames.count if stop is None else stop
    args = (frames.asr[:, :, start:stop], frames.f0[:, 2 * start : 2 * stop], frames.n[:, 2 * start : 2 * stop], frames.style)
    if weights is None:
        return model.decoder(*args).reshape(-1)
    with weighted_instance_norms(model.decoder, weights):
        return model.decoder(*args).reshape(-1)


def stand_in_weights(start: int, stop: int, count: int, lead: int, trail: int) -> "torch.Tensor":
    """Per decoded frame of ``start:stop`` (of ``count``), the frames it stands for: the
    ``lead`` first and ``trail`` last decoded frames (silence) share the weight of the
    silent frames cut before and after them, so the normalization statistics stay those of
    the whole piece as nearly as the decoder allows."""
    import torch

    weights = torch.ones(stop - start)
    lead, trail = min(lead, stop - start), min(trail, stop - start)
    if start and lead:
        weights[:lead] += start / lead
    if count - stop and trail:
        weights[len(weights) - trail :] += (count - stop) / trail
    return weights


def _norms(module, weights: "torch.Tensor | None"):
    """`weighted_instance_norms`, or kokoro's own norms (exactly) when ``weights`` is None."""
    return nullcontext() if weights is None else weighted_instance_norms(module, weights)


@contextmanager
def weighted_instance_norms(decoder, frame_weights: "torch.Tensor"):
    """Inside the block, every `InstanceNorm1d` of ``decoder`` takes its per-channel mean and
    variance with ``frame_weights`` (one per frame, spread over the layer's time steps).

    Kokoro's decoder normalizes each channel over the whole sequence (AdaIN at frame rate and
    in the generator): decoding fewer frames changes every frame's statistics, measured as a
    log-mel distance 5-20x that between two decodes of the same frames with different noise.
    Silent frames are near copies of each other (the pad token's features repeated, F0 and
    energy flat), so weighting the kept silent frames by the silent frames they replace gives
    statistics close to the whole piece's. Kokoro's own modules are untouched: their
    ``forward`` is shadowed on the instance for the block, then restored."""
    import torch

    norms = [m for m in decoder.modules() if isinstance(m, torch.nn.InstanceNorm1d)]

    def weighted(norm):
        def forward(x):
            length = x.shape[-1]
            index = (torch.arange(length, device=x.device) * len(frame_weights) // length).clamp(max=len(frame_weights) - 1)
            w = frame_weights.to(x.device, x.dtype)[index]
            w = w / w.sum()
            mean = (x * w).sum(-1, keepdim=True)
            var = ((x - mean).square() * w).sum(-1, keepdim=True)
            out = (x - mean) * torch.rsqrt(var + norm.eps)
            if norm.affine:
                out = out * norm.weight[:, None] + norm.bias[:, None]
            return out

        return forward

    for norm in norms:
        norm.forward = weighted(norm)
    try:
        yield
    finally:
        for norm in norms:
            del norm.forward


def sound_span(
    energy: list[float], threshold: float = SOUND_ENERGY_THRESHOLD, lead: int = CONTEXT_FRAMES, trail: int = CONTEXT_FRAMES
) -> tuple[int, int]:
    """Frames ``(start, stop)`` to decode: from ``lead`` frames before the first frame whose
    energy exceeds ``threshold`` to ``trail`` frames after the last one, within the piece.
    A piece with no such frame is decoded whole (trimming must never turn it into nothing)."""
    loud = [i for i, e in enumerate(energy) if e > threshold]
    if not loud:
        return 0, len(energy)
    return max(0, loud[0] - lead), min(len(energy), loud[-1] + 1 + trail)


def decode_sound(
    model, frames: Frames, lead: int = CONTEXT_FRAMES, trail: int = CONTEXT_FRAMES, generator: "Callable | None" = None,
    half: "Callable | None" = None, randn_like: "Callable | None" = None,
) -> tuple["torch.Tensor", int, int]:
    """The audio of ``frames`` from ``lead`` frames before the predicted sound to ``trail``
    after it (`sound_span`), the silent frames cut standing in the normalization statistics
    through the kept silent ones (`stand_in_weights`). Returns (audio, start, stop). With a
    ``generator`` (`FoldedGenerator`), the decoder's frame-rate half is ``half`` (or kokoro's)
    and the generator that one, the harmonic source's noise drawn by ``randn_like`` (or
    kokoro's); else the whole decoder is kokoro's."""
    start, stop = sound_span(frames.frame_energy(), lead=lead, trail=trail)
    whole = (start, stop) == (0, frames.count)
    weights = None if whole else stand_in_weights(start, stop, frames.count, lead, trail)
    if generator is not None:
        return generator(prepare_decoder(model, frames, start, stop, weights, half, randn_like)), start, stop
    return decode_frames(model, frames, start, stop, weights), start, stop


# --- pauses inside a phrase -------------------------------------------------

# Predicted energy at or below which a frame inside a phrase is silence to the ear: -3.5
# decodes to a peak of 8 samples (-72 dBFS), -2.2 to 76 (-53 dBFS). -3 (measured on jf_alpha) left
# af_heart pausing 200-310 ms where its energy decays slowly; -2 left hf_alpha 200-220 ms at five
# unpunctuated Hindi word boundaries, each a decay over 8 frames from about -0.8; -1.4 removes
# those too. Every language's Whisper word error rate stays within 0.02 of -2's but Hindi's
# (+0.034; its character error rate falls), French's by one word (docs/benchmarks.md, "Per
# language"). (`SOUND_ENERGY_THRESHOLD` is lower: it must keep every frame that makes any
# sample at all.)
INNER_SILENCE_ENERGY = -1.4

# Energy a silence may rise to and still go on, when it falls back to `INNER_SILENCE_ENERGY`:
# ef_dora holds "nueve | para" 11 frames under it, 4 of them in a bump from -1.37 to -1.08 that
# decodes to under -40 dB but for 10 ms; split at the bump, neither half was longer than
# `MAX_INNER_SILENCE_FRAMES`, and a 260-290 ms pause was kept whole (where the window plan put
# the bump's 10 ms under -40 dB too, the pause test heard it). pf_dora holds "nove | para" 9,
# with a bump to -0.69 in them: 260 ms under -35 dB. Of the 149 pieces of the languages bench's
# sentences, its held-out ones and the tests' phrases (each language's default voice), any level
# from -0.5 to 0 changes those two silences only.
INNER_SILENCE_RELEASE_ENERGY = -0.5

# Frames kept of a longer silence inside a phrase: 75 ms of predicted silence, which decodes to
# 130-150 ms under -40 dB with the decays around it. A stop's closure ("visit": 2 frames) is
# shorter and untouched. Measured on the offline pack's voice (docs/worker.md, "Mid-phrase
# pauses"): 4 frames left 170 ms after "before nine", 2 cut into a 3-frame closure in pt.
MAX_INNER_SILENCE_FRAMES = 3

# Kokoro's punctuation symbols: a silence reaching the frames of one is a phrase boundary the
# text asks for, and is kept whole.
PHRASE_PUNCTUATION = frozenset(';:,.!?—…"()“”')


def token_symbols(model, phonemes: str) -> list[str]:
    """The symbol of each token `token_ids` gives the model, its pads as ``""``."""
    return ["", *(p for p in phonemes if p in model.vocab), ""]


def inner_silence(
    energy: list[float],
    owners: list[str],
    keep: int = MAX_INNER_SILENCE_FRAMES,
    threshold: float = INNER_SILENCE_ENERGY,
    release: float = INNER_SILENCE_RELEASE_ENERGY,
) -> list[int]:
    """Frames to cut so that no silence inside a phrase is longer than ``keep`` frames. A
    silence starts at a frame whose ``energy`` is at or below ``threshold`` and ends at the last
    such frame before one louder than ``release``, with a louder frame on each side: frames
    between ``threshold`` and ``release`` that fall back to silence are a faint bump inside it,
    not its end. It is inside a phrase when none of its frames is owned (``owners``: the symbol
    of each frame's token) by `PHRASE_PUNCTUATION`. Of a longer one, its first ``ceil(keep/2)``
    and last ``floor(keep/2)`` frames are kept (the decay into it and the onset out of it) and
    the frames between them are cut. Pure: the frames' indices, ascending."""
    cut: list[int] = []
    run = last = None  # the current silence's first and last frame at or below threshold
    for i, value in enumerate(energy):
        if value <= threshold:
            if run is None:
                run = i
            last = i
            continue
        if run is None or value <= release:
            continue
        end = last + 1
        if run > 0 and end - run > keep and not any(owners[k] in PHRASE_PUNCTUATION for k in range(run, end)):
            cut.extend(range(run + (keep + 1) // 2, end - keep // 2))
        run = last = None
    return cut


def shorten_inner_silence(frames: Frames, symbols: list[str], keep: int = MAX_INNER_SILENCE_FRAMES) -> Frames:
    """``frames`` without the frames `inner_silence` cuts: every silence longer than ``keep``
    frames inside a phrase shortened to ``keep`` before anything is decoded, and the durations
    of the tokens those frames belonged to shortened with them (so word timings follow).

    Kokoro predicts such silences for some texts and voices: the offline pack's voice holds
    the "n" of "before nine" 11 frames, 8 of them silent, and the "e" of "El técnico te" 15
    (its unmodified forward pass pauses 310 and 400 ms there). The cut frames are silence,
    near copies of each other, so the decoder sees the frames on either side meet in silence;
    the other frames keep the F0 and energy predicted for the whole piece (re-predicting them
    from shortened durations would change every frame's prosody: the module docstring)."""
    import torch

    if len(symbols) != len(frames.durations):
        raise ValueError(f"{len(symbols)} symbols for {len(frames.durations)} tokens")
    token_of = torch.repeat_interleave(torch.arange(len(symbols)), frames.durations.cpu())
    cut = inner_silence(frames.frame_energy(), [symbols[t] for t in token_of.tolist()], keep)
    if not cut:
        return frames
    dropped = set(cut)
    kept = torch.tensor([i for i in range(frames.count) if i not in dropped], device=frames.asr.device)
    kept2 = torch.stack([2 * kept, 2 * kept + 1], dim=1).reshape(-1)
    durations = frames.durations - torch.bincount(token_of[cut], minlength=len(symbols)).to(frames.durations)
    return Frames(asr=frames.asr[:, :, kept], f0=frames.f0[:, kept2], n=frames.n[:, kept2], style=frames.style, durations=durations)


# --- windowed decoding: the first audio from the first frames ---------------

# Sounding frames (25 ms each) in the first window: its audio is published before the rest of
# the piece is decoded. 16 frames = 400 ms of speech, more than a chunk ahead of the player.
FIRST_WINDOW_FRAMES = 16

# Frames each window decodes beyond its seam (the generator's convolutions reach ~5 frames
# at 20 steps per frame); the two windows then agree around the seam and are crossfaded there.
SEAM_CONTEXT_FRAMES = 6

# Half the crossfade at the seam, in frames: a raised-cosine fade over 2 x 2 frames (100 ms).
CROSSFADE_FRAMES = 2

# In the fixed plan (`seams`, and `next_cut` where no window keeps up with the player) each
# window after the first has ``WINDOW_GROWTH`` times the frames of all the windows before it;
# none is shorter than MIN_WINDOW_FRAMES.
WINDOW_GROWTH = 2.5
MIN_WINDOW_FRAMES = 2 * SEAM_CONTEXT_FRAMES + 8

# Frames of the span's edge silence decoded before a window that has none of its own, so its
# norms see silence in the share the whole span gives it (`window_input`). 4 measured better
# than 2 (word error rate over 8 sentences +0.012 against +0.036), 8 no better than 4.
SILENCE_CARRIER_FRAMES = 4


@dataclass
class DecoderInput:
    """A span of frames run through the decoder's frame-rate half (`prepare_decoder`): what
    its generator needs to decode any window of the span."""

    x: "torch.Tensor"  # [1, 512, 2 * frames]: the generator's input
    source: "torch.Tensor"  # [1, 600 * frames]: the harmonic source, drawn once for the span
    style: "torch.Tensor"  # [1, 128]
    weights: "torch.Tensor | None"  # [frames]: the frames each stands for in the norms (None: 1 each)
    silent: tuple[int, int] = (0, 0)  # frames of silence at the span's start and end (`edge_silence`)

    @property
    def count(self) -> int:
        return int(self.x.shape[-1]) // 2


def harmonic_source(gen, upsampled: "torch.Tensor", randn_like: "Callable") -> "torch.Tensor":
    """kokoro 0.9.4's ``SourceModuleHnNSF.forward`` with its ``SineGen``: the generator's harmonic
    source [1, samples, 1] for the upsampled F0 ``upsampled`` [1, samples, 1], the overtones'
    noise drawn by ``randn_like`` (`torch_ops.randn_like_strided`: torch's own values, faster).
    Every draw kokoro makes is made in kokoro's order, its unused noise branch too, so a seeded
    decode is kokoro's and the generator ends where kokoro's leaves it."""
    import torch

    module = gen.m_source
    sine = module.l_sin_gen
    harmonics = torch.arange(1, sine.harmonic_num + 2, dtype=torch.float32, device=upsampled.device).reshape(1, -1)
    sine_waves = sine._f02sine(upsampled * harmonics) * sine.sine_amp  # [1, samples, harmonics], a transposed view
    uv = sine._f02uv(upsampled)
    noise_amp = uv * sine.noise_std + (1 - uv) * sine.sine_amp / 3
    sine_waves = sine_waves * uv + noise_amp * randn_like(sine_waves)
    merged = module.l_tanh(module.l_linear(sine_waves))
    torch.randn_like(uv)  # kokoro's noise branch, which the generator never reads
    return merged


def prepare_decoder(
    model, frames: Frames, start: int = 0, stop: int | None = None, weights: "torch.Tensor | None" = None,
    half: "Callable | None" = None, randn_like: "Callable | None" = None,
) -> DecoderInput:
    """`kokoro.istftnet.Decoder.forward` (kokoro 0.9.4) up to, not including, the generator's
    upsampling, for frames ``start:stop``, plus the generator's harmonic source for the span.

    The frame-rate half (encode and the four decode blocks, ~7% of the decoder's time) runs
    over the whole span at once, so every one of its instance norms has the statistics of the
    whole span: a window of the generator starts from exactly the features a whole decode
    would. The harmonic source (random initial phase of each overtone, random noise) is drawn
    once for the span and sliced per window, so the two windows carry the same excitation.
    ``half`` computes the frame-rate half instead (`FoldedFrameRateHalf`); with ``randn_like``
    the source is `harmonic_source`'s, else kokoro's ``m_source``."""
    stop = frames.count if stop is None else stop
    dec = model.decoder
    if half is not None:
        x = half(frames, start, stop, weights)
    else:
        x = _frame_rate_half(dec, frames, start, stop, weights)
    gen = dec.generator
    upsampled = gen.f0_upsamp(frames.f0[:, 2 * start : 2 * stop][:, None]).transpose(1, 2)
    source = gen.m_source(upsampled)[0] if randn_like is None else harmonic_source(gen, upsampled, randn_like)
    silent = edge_silence(frames.frame_energy()[start:stop])
    return DecoderInput(x=x, source=source.transpose(1, 2).squeeze(1), style=frames.style, weights=weights, silent=silent)


def _frame_rate_half(dec, frames: Frames, start: int, stop: int, weights: "torch.Tensor | None") -> "torch.Tensor":
    """Kokoro's own frame-rate half of the decoder (`prepare_decoder`)."""
    import torch

    asr = frames.asr[:, :, start:stop]
    f0_curve = frames.f0[:, 2 * start : 2 * stop]
    n = frames.n[:, 2 * start : 2 * stop]
    s = frames.style
    with _norms(dec, weights):
        f0 = dec.F0_conv(f0_curve.unsqueeze(1))
        energy = dec.N_conv(n.unsqueeze(1))
        x = dec.encode(torch.cat([asr, f0, energy], axis=1), s)
        asr_res = dec.asr_res(asr)
        res = True
        for block in dec.decode:
            if res:
                x = torch.cat([x, asr_res, f0, energy], axis=1)
            x = block(x, s)
            if block.upsample_type != "none":
                res = False
    return x


def edge_silence(energy: list[float], threshold: float = SOUND_ENERGY_THRESHOLD) -> tuple[int, int]:
    """Frames before the first and after the last frame whose energy exceeds ``threshold``
    ((0, 0) when none does: nothing is known to be silence)."""
    start, stop = sound_span(energy, threshold, lead=0, trail=0)  # (0, len) when none is loud
    return start, len(energy) - stop


def generate(model, prepared: DecoderInput, start: int = 0, stop: int | None = None) -> "torch.Tensor":
    """`kokoro.istftnet.Generator.forward` (kokoro 0.9.4) on frames ``start:stop`` of a prepared
    span: float audio, 600 samples a frame. The generator's instance norms take their
    statistics over the window (weighted as the span's frames are)."""
    import torch
    import torch.nn.functional as F

    stop = prepared.count if stop is None else stop
    gen = model.decoder.generator
    s = prepared.style
    x = prepared.x[:, :, 2 * start : 2 * stop]
    har_spec, har_phase = gen.stft.transform(prepared.source[:, SAMPLES_PER_FRAME * start : SAMPLES_PER_FRAME * stop])
    har = torch.cat([har_spec, har_phase], dim=1)
    with _norms(gen, None if prepared.weights is None else prepared.weights[start:stop]):
        for i in range(gen.num_upsamples):
            x = F.leaky_relu(x, negative_slope=0.1)
            x_source = gen.noise_res[i](gen.noise_convs[i](har), s)
            x = gen.ups[i](x)
            if i == gen.num_upsamples - 1:
                x = gen.reflection_pad(x)
            x = x + x_source
            xs = None
            for j in range(gen.num_kernels):
                if xs is None:
                    xs = gen.resblocks[i * gen.num_kernels + j](x, s)
                else:
                    xs += gen.resblocks[i * gen.num_kernels + j](x, s)
            x = xs / gen.num_kernels
        x = F.leaky_relu(x)
        x = gen.conv_post(x)
        spec = torch.exp(x[:, : gen.post_n_fft // 2 + 1, :])
        phase = torch.sin(x[:, gen.post_n_fft // 2 + 1 :, :])
        return gen.stft.inverse(spec, phase).reshape(-1)


def channel_stats(x: "torch.Tensor", weights: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Per-channel mean and variance over time of a channels-last ``[1, C, 1, T]`` tensor, each
    step weighted by ``weights`` ([T], summing to 1), in float32 and centred: taken in
    bfloat16, or as E[x^2] - mean^2, the variance cancels where a channel's mean is large
    against its spread (the generator's log-mel distance to kokoro's audio was 1.04 with
    bfloat16 statistics, 0.075 with these)."""
    channels, steps = x.shape[1], x.shape[-1]
    rows = x.permute(0, 2, 3, 1).reshape(steps, channels).float()  # channels-last: a view, then float32
    mean = weights @ rows
    return mean, weights @ (rows - mean).square()


class _FoldedConv(NamedTuple):
    """A Conv1d (or ConvTranspose1d: ``output_padding`` set) as a channels-last Conv2d."""

    weight: "torch.Tensor | None"  # [out, in, 1, k] (transposed: [in, out, 1, k]), channels-last; None: tiled
    bias: "torch.Tensor | None"
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    output_padding: tuple[int, int] | None
    groups: int = 1
    # the same convolution through short DFTs (float32, wide kernels) or F(4, 3) (float32,
    # 3 taps, many channels)
    tiled: "tiled_conv.TiledConv | tiled_conv.WinogradConv | None" = None
    shape: tuple[int, ...] = ()  # the Conv1d's weight's: [out, in, k] (transposed: [in, out, k])


class _FoldedAdaIN(NamedTuple):
    """An AdaIN1d's weights, with the alpha of the Snake that follows it (None: a leaky ReLU follows)."""

    fc_weight: "torch.Tensor"
    fc_bias: "torch.Tensor"
    norm_weight: "torch.Tensor"
    norm_bias: "torch.Tensor"
    eps: float
    alpha: "torch.Tensor | None"


class _FoldedBlock(NamedTuple):
    """An AdainResBlk1d of the frame-rate half, folded (`FoldedFrameRateHalf`)."""

    norm1: _FoldedAdaIN
    norm2: _FoldedAdaIN
    conv1: _FoldedConv
    conv2: _FoldedConv
    pool: _FoldedConv | None  # the upsampling block's depthwise transposed convolution
    shortcut: _FoldedConv | None  # conv1x1, where the block changes the channel count
    upsample: bool
    slope: float  # its leaky ReLU's


class _Folded:
    """What `FoldedGenerator` and `FoldedFrameRateHalf` share: kokoro's convolutions as
    channels-last 2-D ones in ``dtype``, and each AdaIN as a per-channel scale and shift."""

    def __init__(self, model, dtype: "torch.dtype | None" = None, tiled: bool = False, winograd: bool | None = None) -> None:
        import torch

        self.dtype = dtype or torch.float32
        self.device = next(model.decoder.parameters()).device
        # float32 convolutions through short DFTs (``tiled``) and F(4, 3) (``winograd``, by
        # default as ``tiled``), `tiled_conv`: fewer multiplications where the CPU has no
        # bfloat16 arithmetic; a GPU or bfloat16 runs them directly
        cpu32 = self.dtype == torch.float32 and self.device.type == "cpu"
        self.tiled = tiled and cpu32
        self.winograd = (tiled if winograd is None else winograd) and cpu32

    def _conv(self, conv, in_scale: "torch.Tensor | None" = None, dtype=None) -> _FoldedConv:
        import torch

        dtype = dtype or self.dtype
        w = conv.weight.detach().float()
        if in_scale is not None:  # Conv1d weights are [out, in, k]: scale each input channel
            w = w * in_scale.reshape(1, -1, 1)
        transpose = isinstance(conv, torch.nn.ConvTranspose1d)
        bias = None if conv.bias is None else conv.bias.detach().to(dtype)
        tiled = None
        ways = ("dft",) * self.tiled + ("winograd",) * self.winograd
        if ways and dtype == torch.float32 and not transpose and conv.stride[0] == 1 and conv.groups == 1:
            tiled = tiled_conv.tiled(w, conv.dilation[0], conv.padding[0], bias, ways)
        # a tiled convolution keeps only its transformed kernel: the direct weights would be
        # ~200 MB more of a float32 decoder that only a batch would use (`_apply_conv` tiles
        # a batch's items one by one instead)
        weight = None if tiled is not None else w.unsqueeze(2).to(dtype).contiguous(memory_format=torch.channels_last)
        return _FoldedConv(weight, bias, (1, conv.stride[0]), (0, conv.padding[0]), (1, conv.dilation[0]),
                           (0, conv.output_padding[0]) if transpose else None, conv.groups, tiled, tuple(w.shape))

    @staticmethod
    def _adain(adain, alpha: "torch.Tensor | None" = None) -> _FoldedAdaIN:
        return _FoldedAdaIN(adain.fc.weight.detach().float(), adain.fc.bias.detach().float(),
                            adain.norm.weight.detach().float(), adain.norm.bias.detach().float(), adain.norm.eps, alpha)

    @staticmethod
    def _apply_conv(conv: _FoldedConv, x: "torch.Tensor") -> "torch.Tensor":
        import torch
        import torch.nn.functional as F

        if conv.tiled is not None:  # [1, C, 1, T] channels-last is [T, C] in memory
            if x.shape[0] > 1:
                return torch.cat([_Folded._apply_conv(conv, item) for item in x.split(1)])
            steps = x.shape[-1]
            y = conv.tiled(x.permute(0, 2, 3, 1).reshape(steps, x.shape[1]))
            return y.reshape(1, 1, y.shape[0], y.shape[1]).permute(0, 3, 1, 2)
        if conv.output_padding is not None:  # a transposed convolution (the upsampling)
            return F.conv_transpose2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.output_padding,
                                      conv.groups, conv.dilation)
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def _scale_shift(adain: _FoldedAdaIN, x: "torch.Tensor", style: "torch.Tensor", weights: "torch.Tensor"):
        """AdaIN(x) = x * scale + shift, per channel (float32)."""
        import torch
        import torch.nn.functional as F

        gamma, beta = F.linear(style, adain.fc_weight, adain.fc_bias)[0].chunk(2)
        mean, var = channel_stats(x, weights)
        scale = (1 + gamma) * adain.norm_weight * torch.rsqrt(var + adain.eps)
        return scale, (1 + gamma) * adain.norm_bias - scale * mean + beta

    def _laid_out(self, t: "torch.Tensor") -> "torch.Tensor":
        """A [1, C, T] tensor as a channels-last [1, C, 1, T] one in ``dtype``."""
        import torch

        return t.unsqueeze(2).to(self.dtype).contiguous(memory_format=torch.channels_last)

    def _weights_over(self, frame_weights: "torch.Tensor | None", steps: int) -> "torch.Tensor":
        """`weighted_instance_norms`'s spread of one weight per frame over a layer's ``steps``,
        normalized (uniform without weights: kokoro's norm)."""
        import torch

        if frame_weights is None:
            return torch.full((steps,), 1.0 / steps, device=self.device)
        frames = frame_weights.shape[0]  # not len(): traced by torch.onnx.export as a dynamic size
        index = (torch.arange(steps, device=self.device) * frames // steps).clamp(max=frames - 1)
        w = frame_weights[index]
        return w / w.sum()


class FoldedGenerator(_Folded):
    """`generate`'s computation (kokoro 0.9.4's ``Generator.forward`` with this module's
    weighted norms), laid out for oneDNN and folded, in ``dtype``; built once from a loaded
    model, called like `generate` (``prepared, start, stop``) and returns float32 audio.

    Why (docs/worker.md, "The generator, folded"): on CPU the generator is ~90 % of a
    forward pass and ~60 % of that is its 1-D convolutions. oneDNN runs those much faster as
    2-D convolutions over channels-last tensors ``[1, C, 1, T]``: in float32 the generator takes
    ~25 % less time with the same audio (max difference 1e-5), and in bfloat16 on a CPU with
    AMX the convolutions run ~8x faster than kokoro's float32 ones. What is folded, exactly:

    - each AdaIN's instance norm and its style affine become one per-channel scale and shift,
      with the statistics taken in float32 as a weighted mean over time (the weights of
      `weighted_instance_norms`; uniform when the window has none, which is kokoro's norm);
    - each Snake ``x + sin(a x)^2 / a`` is computed as ``u + sin(u)^2`` on ``u = a x`` (the
      ``a`` folded into the AdaIN's scale and shift), its ``1 / a`` into the next convolution's
      input channels.

    The harmonic source's STFT, the last convolution (``conv_post``: the log-magnitude and phase
    of the inverse STFT are sensitive to rounding) and the inverse STFT stay in float32."""

    def __init__(self, model, dtype: "torch.dtype | None" = None, tiled: bool = False, winograd: bool | None = None) -> None:
        import torch

        super().__init__(model, dtype, tiled, winograd)
        gen = model.decoder.generator
        self.gen = gen
        self.num_kernels, self.num_upsamples, self.post_n_fft = gen.num_kernels, gen.num_upsamples, gen.post_n_fft
        self.noise_convs = [self._conv(c) for c in gen.noise_convs]
        self.noise_res = [self._resblock(r) for r in gen.noise_res]
        self.ups = [self._conv(u) for u in gen.ups]
        self.resblocks = [self._resblock(r) for r in gen.resblocks]
        # in float32 whatever the dtype: its output is the log-magnitude and the phase of the
        # inverse STFT, and bfloat16's rounding of those was most of its difference to kokoro's
        # audio (log-mel distance 0.075 -> 0.013 with this one layer in float32, at no cost)
        self.conv_post = self._conv(gen.conv_post, dtype=torch.float32)

    def _resblock(self, block) -> list[tuple]:
        layers = []
        for c1, c2, n1, n2, a1, a2 in zip(block.convs1, block.convs2, block.adain1, block.adain2, block.alpha1, block.alpha2):
            alpha1, alpha2 = a1.detach().float().reshape(-1), a2.detach().float().reshape(-1)
            layers.append((self._adain(n1, alpha1), self._conv(c1, 1 / alpha1), self._adain(n2, alpha2), self._conv(c2, 1 / alpha2)))
        return layers

    # --- the forward pass ---
    def _adain_snake(self, adain: "_FoldedAdaIN", x: "torch.Tensor", style: "torch.Tensor", weights: "torch.Tensor") -> "torch.Tensor":
        """``a * AdaIN(x)`` through ``u + sin(u)^2``: the Snake times its ``a``."""
        import torch

        scale, shift = self._scale_shift(adain, x, style, weights)
        alpha = adain.alpha
        u = torch.addcmul((alpha * shift).to(self.dtype).reshape(1, -1, 1, 1), x, (alpha * scale).to(self.dtype).reshape(1, -1, 1, 1))
        sine = torch.sin(u)
        return torch.addcmul(u, sine, sine)

    def _apply_resblock(self, layers: list[tuple], x, style, weights):
        for adain1, conv1, adain2, conv2 in layers:
            xt = self._apply_conv(conv1, self._adain_snake(adain1, x, style, weights))
            xt = self._apply_conv(conv2, self._adain_snake(adain2, xt, style, weights))
            x = xt + x
        return x

    def __call__(self, prepared: DecoderInput, start: int = 0, stop: int | None = None) -> "torch.Tensor":
        import torch

        stop = prepared.count if stop is None else stop
        gen = self.gen
        frame_weights = None if prepared.weights is None else prepared.weights[start:stop].float().to(self.device)
        har_spec, har_phase = gen.stft.transform(prepared.source[:, SAMPLES_PER_FRAME * start : SAMPLES_PER_FRAME * stop])
        x = self.core(prepared.x[:, :, 2 * start : 2 * stop], torch.cat([har_spec, har_phase], dim=1),
                      prepared.style.float(), frame_weights)
        spec = torch.exp(x[:, : self.post_n_fft // 2 + 1, :])
        phase = torch.sin(x[:, self.post_n_fft // 2 + 1 :, :])
        return gen.stft.inverse(spec, phase).reshape(-1)

    def core(self, x: "torch.Tensor", har: "torch.Tensor", style: "torch.Tensor",
             frame_weights: "torch.Tensor | None") -> "torch.Tensor":
        """The generator between the harmonic source's STFT and the inverse STFT: the frame-rate
        half's output ``x`` [1, C, 2 * frames], the STFT's magnitude and phase ``har`` [1, 2 *
        bins, steps], ``style`` [1, S] and the frames' weights (None: kokoro's uniform norms)
        to ``conv_post``'s output [1, n_fft + 2, steps] in float32 (`voicebus bench precision`
        runs this part through other runtimes)."""
        import torch
        import torch.nn.functional as F

        def weights_over(steps: int) -> "torch.Tensor":
            return self._weights_over(frame_weights, steps)

        x = self._laid_out(x)
        har = self._laid_out(har)
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, negative_slope=0.1)
            source = self._apply_conv(self.noise_convs[i], har)
            source = self._apply_resblock(self.noise_res[i], source, style, weights_over(source.shape[-1]))
            x = self._apply_conv(self.ups[i], x)
            if i == self.num_upsamples - 1:  # kokoro's ReflectionPad1d((1, 0))
                x = F.pad(x, (1, 0, 0, 0), mode="reflect").contiguous(memory_format=torch.channels_last)
            x = x + source
            weights = weights_over(x.shape[-1])
            xs = None
            for j in range(self.num_kernels):
                y = self._apply_resblock(self.resblocks[i * self.num_kernels + j], x, style, weights)
                xs = y if xs is None else xs + y
            x = xs / self.num_kernels
        x = F.leaky_relu(x.float())
        return self._apply_conv(self.conv_post, x).squeeze(2).contiguous()


class Bfloat16Bert:
    """A bfloat16 copy of kokoro's PL-BERT (``model.bert``, an ALBERT of 12 shared layers of 768
    channels), called as it is, its output back in float32 for the rest of the prediction. On a
    CPU that multiplies bfloat16 it is the largest part of a first audio once the decoder is
    folded: 193 -> 59 ms for 80 phonemes, 321 -> 110 ms for 172, at 1 thread on a Zen 5 EPYC,
    its output within 2 % (relative norm) and the predicted durations the same to 1 token's frame
    in 174 (docs/worker.md, "The generator, folded"). The model's own ``bert`` is left as it
    is (kokoro's forward, the benchmarks' A/B)."""

    def __init__(self, model, dtype: "torch.dtype | None" = None) -> None:
        import copy

        import torch

        self.dtype = dtype or torch.bfloat16
        self.bert = copy.deepcopy(model.bert).to(self.dtype).eval()

    def __call__(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        return self.bert(input_ids, attention_mask=attention_mask).float()


class PrepackedBert:
    """A float32 copy of kokoro's PL-BERT with its linear layers prepacked for oneDNN
    (`voicebus.synthesis.torch_ops.PrepackedLinear`), called as it is: the engine's PL-BERT in
    float32 on a CPU. The same products summed in another order (output within ~1e-6,
    relative); over a first sentence's few dozen tokens, where MKL's per-call packing of each
    weight is a large share of the work, it took 0.6-0.9 of kokoro's time (docs/worker.md,
    "PL-BERT, prepacked"). Raises `torch_ops.TorchInternalsMissing` where the installed torch
    lacks the operators. The model's own ``bert`` is left as it is."""

    def __init__(self, model) -> None:
        import copy

        from voicebus.synthesis import torch_ops

        torch_ops.check_prepacked_linear()
        self.bert = copy.deepcopy(model.bert).float().eval()
        self.linears = torch_ops.prepack_linears(self.bert)

    def __call__(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        return self.bert(input_ids, attention_mask=attention_mask)


class FoldedFrameRateHalf(_Folded):
    """`prepare_decoder`'s frame-rate half (kokoro 0.9.4's ``Decoder.forward`` up to the
    generator: ``encode`` and the four ``decode`` blocks, `AdainResBlk1d` of 1024 channels, with
    this module's weighted norms) folded as `FoldedGenerator` is: channels-last 2-D
    convolutions in ``dtype``, each AdaIN a per-channel scale and shift with float32 statistics.
    Called with a piece's `Frames`, its span and weights; returns the generator's input
    ``[1, 512, 2 * frames]`` in float32. On the offline pack, 1 thread, 86-157 frames: kokoro's
    95-138 ms, folded in bfloat16 ~45 ms (docs/worker.md, "The generator, folded"). With
    ``tiled`` (float32 on a CPU) its 3-tap convolutions go through F(4, 3) (`tiled_conv`).
    The F0 and energy convolutions (one channel each) stay kokoro's."""

    def __init__(self, model, dtype: "torch.dtype | None" = None, tiled: bool = False) -> None:
        super().__init__(model, dtype, winograd=tiled)  # its convolutions are 1 or 3 taps wide
        dec = model.decoder
        self.dec = dec
        self.blocks = [self._block(b) for b in (dec.encode, *dec.decode)]
        self.asr_res = self._conv(dec.asr_res[0])

    def _block(self, block) -> _FoldedBlock:
        upsample = block.upsample_type != "none"
        return _FoldedBlock(self._adain(block.norm1), self._adain(block.norm2), self._conv(block.conv1),
                            self._conv(block.conv2), self._conv(block.pool) if upsample else None,
                            self._conv(block.conv1x1) if block.learned_sc else None, upsample,
                            block.actv.negative_slope)

    def _norm_act(self, adain: _FoldedAdaIN, x, style, weights, slope: float):
        import torch
        import torch.nn.functional as F

        scale, shift = self._scale_shift(adain, x, style, weights)
        y = torch.addcmul(shift.to(self.dtype).reshape(1, -1, 1, 1), x, scale.to(self.dtype).reshape(1, -1, 1, 1))
        return F.leaky_relu(y, slope)

    def __call__(self, frames: Frames, start: int, stop: int, weights: "torch.Tensor | None") -> "torch.Tensor":
        import math

        import torch
        import torch.nn.functional as F

        dec = self.dec
        channels_last = torch.channels_last
        asr = frames.asr[:, :, start:stop]
        style = frames.style.float()
        frame_weights = None if weights is None else weights.float().to(self.device)
        # plain convolutions, no norm: kokoro's own
        f0 = self._laid_out(dec.F0_conv(frames.f0[:, 2 * start : 2 * stop].unsqueeze(1)))
        energy = self._laid_out(dec.N_conv(frames.n[:, 2 * start : 2 * stop].unsqueeze(1)))
        asr = self._laid_out(asr)
        x = torch.cat([asr, f0, energy], 1).contiguous(memory_format=channels_last)
        asr_res = self._apply_conv(self.asr_res, asr)
        res = True
        for i, block in enumerate(self.blocks):  # encode, then the decode blocks
            if i and res:
                x = torch.cat([x, asr_res, f0, energy], 1).contiguous(memory_format=channels_last)
            r = self._norm_act(block.norm1, x, style, self._weights_over(frame_weights, x.shape[-1]), block.slope)
            if block.pool is not None:
                r = self._apply_conv(block.pool, r)
            r = self._apply_conv(block.conv1, r)
            r = self._norm_act(block.norm2, r, style, self._weights_over(frame_weights, r.shape[-1]), block.slope)
            r = self._apply_conv(block.conv2, r)
            shortcut = F.interpolate(x, scale_factor=(1, 2), mode="nearest") if block.upsample else x
            if block.shortcut is not None:
                shortcut = self._apply_conv(block.shortcut, shortcut)
            x = (r + shortcut) * (1 / math.sqrt(2))
            if block.upsample:
                res = False
        return x.float().squeeze(2).contiguous()


def window_input(prepared: DecoderInput, left: int, right: int) -> tuple[DecoderInput, int, int, int]:
    """What the generator decodes for the window ``left:right`` of a prepared span: an input,
    the frames ``start:stop`` of it to decode, and how many of those come before the window's
    own (a silence carrier, whose audio is dropped).

    The generator's instance norms take their statistics over what they are given. Its
    statistics depend most on how much of it is silence: the span's edge silence carries the
    weight of all the silence cut around it (`stand_in_weights`), so the first window (the
    lead silence and 16 frames of speech) was mostly silence to its norms and a middle window
    none: measured on the 20 sentences of `voicebus.ops.bench.seams.ENGLISH`, Whisper tiny.en's
    word error rate rose from 0.098 (whole decode) to 0.163 windowed. Here each window's
    silence keeps the share of the statistics it has in the whole span: the window's own edge
    silence is weighted to it, and a window with none gets ``SILENCE_CARRIER_FRAMES`` frames
    of the span's edge silence put before its left context (the generator reaches ~5 frames,
    the context is 6: the kept audio does not hear the join), weighted to it (WER 0.098, the
    same as the whole decode; docs/worker.md). A window that is the whole span, or a span
    with no known silence, is decoded as it is."""
    import torch

    count = prepared.count
    lead, trail = prepared.silent
    if (left, right) == (0, count) or not (lead or trail) or lead + trail >= count:
        return prepared, left, right, 0
    weights = prepared.weights if prepared.weights is not None else torch.ones(count)
    silent = torch.zeros(count, dtype=torch.bool)
    silent[:lead] = True
    silent[count - trail :] = True
    share = float(weights[silent].sum() / weights.sum())
    own, own_silent = weights[left:right].clone(), silent[left:right]
    sound = float(own[~own_silent].sum())
    target = share * sound / (1.0 - share)  # the silence weight that makes its share ``share``
    if own_silent.any():
        own[own_silent] *= target / float(own[own_silent].sum())
        window = weights.clone()
        window[left:right] = own
        return DecoderInput(prepared.x, prepared.source, prepared.style, window, prepared.silent), left, right, 0
    carrier_frames = SILENCE_CARRIER_FRAMES
    edge = list(range(lead)) or list(range(count - trail, count))
    order = torch.tensor([edge[i % len(edge)] for i in range(carrier_frames)] + list(range(left, right)))
    channels = prepared.x.shape[1]
    x = prepared.x.reshape(1, channels, count, 2)[:, :, order].reshape(1, channels, -1)
    source = prepared.source.reshape(1, count, SAMPLES_PER_FRAME)[:, order].reshape(1, -1)
    window = torch.cat([torch.full((carrier_frames,), target / carrier_frames), own])
    return DecoderInput(x, source, prepared.style, window, (carrier_frames, 0)), 0, len(order), carrier_frames


def seams(count: int, first: int = FIRST_WINDOW_FRAMES, lead: int = 0, growth: float = WINDOW_GROWTH) -> list[int]:
    """The frames where one window of a span of ``count`` frames ends and the next begins:
    the first window has ``lead`` silent frames and ``first`` more, each later one ``growth``
    times the frames of all before it, so a window is decoded (real-time factor well under
    the growth) while the audio already published plays. A window that would leave a last one
    of under ``MIN_WINDOW_FRAMES`` takes the rest. [] for a span decoded whole."""
    cuts: list[int] = []
    end = lead + first
    while end + MIN_WINDOW_FRAMES <= count:
        cuts.append(end)
        end = int(end + growth * end)
    return cuts


# Share of the audio ahead of the player that a window may take to decode (`next_cut`): the
# rest is margin for other sessions' forward passes, the hops to the player and the jitter of a
# busy machine.
WINDOW_TIME_SHARE = 0.8

# The first window never grows beyond this many sounding frames to let later windows keep up
# (1.2 s of speech): on a machine too slow for that, the first audio is not delayed further.
MAX_FIRST_WINDOW_FRAMES = 48

SECONDS_PER_FRAME = SAMPLES_PER_FRAME / 24000  # audio seconds in one frame


def window_overhead() -> int:
    """Frames a later window decodes beyond its own: context on both sides, a silence carrier."""
    return 2 * SEAM_CONTEXT_FRAMES + SILENCE_CARRIER_FRAMES


def _decode_rate(decode_s_per_frame: float) -> float:
    """Audio seconds decoded per second, with a 10 % margin."""
    return 0.9 * SECONDS_PER_FRAME / decode_s_per_frame


def keep_up_frames(decode_s_per_frame: float) -> int | None:
    """The smallest later window that is decoded faster than it plays, with a 10 % margin
    (its overhead, `window_overhead`, is paid per window: small windows fall behind), or
    None when no window is (the machine decodes about as fast as real time, or slower)."""
    rate = _decode_rate(decode_s_per_frame)
    if rate <= 1.05:
        return None
    return max(MIN_WINDOW_FRAMES, int(-(-window_overhead() // (rate - 1.0))) + 1)


def first_cut(count: int, lead: int = 0, decode_s_per_frame: float | None = None) -> int:
    """Where the first window of a span of ``count`` frames ends (``count``: one window).

    ``lead`` silent frames and ``FIRST_WINDOW_FRAMES`` sounding ones, or more where the decode
    speed measured on this machine (``decode_s_per_frame``, generator seconds per decoded
    frame, overhead included) says the window after one that short could not be decoded while
    it plays: the first window must hold the audio that covers the decoding of a window of
    `keep_up_frames`, or the player runs dry after it (measured on the 2-core CPU at 1 thread,
    ~13 ms a frame: 16 frames left the player 0.85 s of silence inside a sentence, p50). At
    most ``MAX_FIRST_WINDOW_FRAMES``: a machine that slow gets its first audio no later."""
    first = FIRST_WINDOW_FRAMES
    if decode_s_per_frame:
        rate = _decode_rate(decode_s_per_frame)
        floor = keep_up_frames(decode_s_per_frame)
        needed = MAX_FIRST_WINDOW_FRAMES if floor is None else -(-(floor + window_overhead()) // rate) + CROSSFADE_FRAMES
        first = int(min(MAX_FIRST_WINDOW_FRAMES, max(FIRST_WINDOW_FRAMES, needed)))
    end = lead + first
    return count if count - end < MIN_WINDOW_FRAMES else end


def next_cut(lo: int, count: int, ahead_s: float, decode_s_per_frame: float | None, growth: float = WINDOW_GROWTH) -> int:
    """Where the window starting at frame ``lo`` of ``count`` ends (``count``: it is the last).

    The largest window whose decoding (at ``decode_s_per_frame``, overhead included) takes at
    most `WINDOW_TIME_SHARE` of the ``ahead_s`` seconds of audio the player has yet to play, so
    it arrives before the player runs out; never smaller than `keep_up_frames` (a smaller one
    would fall behind for good). On a machine where no window keeps up, or before the speed is
    known, ``growth`` times all the frames before it, as `seams` places them: fewer, larger
    windows decode fastest."""
    fit = 0 if not decode_s_per_frame else int(ahead_s * WINDOW_TIME_SHARE / decode_s_per_frame) - window_overhead()
    floor = keep_up_frames(decode_s_per_frame) if decode_s_per_frame else None
    size = max(fit, floor) if floor is not None else max(fit, MIN_WINDOW_FRAMES, int(growth * lo))
    end = lo + int(size)
    return count if count - end < MIN_WINDOW_FRAMES else end


def crossfade_weights(samples: int, device=None) -> "torch.Tensor":
    """A raised-cosine fade-in over ``samples`` (its complement fades the other window out)."""
    import torch

    t = (torch.arange(samples, device=device, dtype=torch.float32) + 0.5) / samples
    return 0.5 - 0.5 * torch.cos(torch.pi * t)


def decode_windows(model, prepared: DecoderInput, cuts: "list[int] | Callable[[int], int]", generator: "Callable | None" = None):
    """Yield the span's float audio in order, one part per window: ``cuts`` are the frames
    where one window ends and the next begins (`seams`), or a function that says, when a
    window starting at a frame is about to be decoded, where it ends (``prepared.count``:
    the last; the engine plans windows from the decode speed, `first_cut`, `next_cut`). Window ``k``
    decodes its frames plus ``SEAM_CONTEXT_FRAMES`` on each side, and its audio is crossfaded
    with the window before it over ``cut ± CROSSFADE_FRAMES`` at each cut. Each part ends
    ``CROSSFADE_FRAMES`` before the next cut (the rest waits for the crossfade). The parts'
    concatenation is as long as the span (600 samples a frame); with no cuts it is the
    generator on the whole span at once. Each window's norms see the span's share of silence
    (`window_input`). ``generator`` decodes a window (`FoldedGenerator`; None: `generate`,
    kokoro's own)."""
    import torch

    frame = SAMPLES_PER_FRAME
    if generator is None:
        generator = lambda window, lo, hi: generate(model, window, lo, hi)  # noqa: E731
    if not callable(cuts):
        ends = [*cuts, prepared.count]
        cuts = lambda lo: next(end for end in ends if end > lo)  # noqa: E731
    held = None  # the previous window's audio over the coming crossfade
    lo, k = 0, 0
    while lo < prepared.count:
        hi = min(prepared.count, max(lo + 1, cuts(lo)))
        left = max(0, lo - SEAM_CONTEXT_FRAMES)
        right = min(prepared.count, hi + SEAM_CONTEXT_FRAMES)
        window, lo_frame, hi_frame, carrier = window_input(prepared, left, right)
        audio = generator(window, lo_frame, hi_frame)[carrier * frame :]
        begin = (lo - CROSSFADE_FRAMES) * frame if k else 0
        end = (hi - CROSSFADE_FRAMES) * frame if hi < prepared.count else prepared.count * frame
        part = audio[begin - left * frame : end - left * frame]
        if held is not None:
            fade_in = crossfade_weights(len(held), part.device)
            part = torch.cat([held * (1 - fade_in) + part[: len(held)] * fade_in, part[len(held) :]])
        if hi < prepared.count:
            held = audio[end - left * frame : (hi + CROSSFADE_FRAMES) * frame - left * frame]
        yield part
        lo, k = hi, k + 1
