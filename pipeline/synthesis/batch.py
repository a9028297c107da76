"""Kokoro's forward pass for many independent requests at once: one padded batch, each item's
output that of `KModel.forward_with_tokens` run on it alone.

This module owns the batched forward (`forward_batch`) and the grouping of requests by length
(`length_buckets`). kokoro==0.9.4 assumes a batch of one in several places, each handled here:

- the predictor's duration LSTM and F0/energy LSTM (``predictor.lstm``, ``predictor.shared``)
  run unpacked in kokoro: padded steps would feed the backward direction, so both are packed with
  each item's own length (`_packed_lstm`);
- durations are per item (``repeat_interleave`` over one sequence, ``/ speed`` per request): the
  alignment becomes a per-item gather of token features into frames (`_alignment`), which is
  exactly kokoro's one-hot matrix product;
- every ``InstanceNorm1d`` (AdaIN in the F0/energy predictor, the decoder and the generator)
  normalizes over time, so padded frames would change each item's statistics: here each norm
  takes its mean and variance over the item's own steps (`_adain`), and padded steps are zeroed
  before every convolution wider than one step, so that no kernel sees past an item's end
  anything but the zero padding kokoro's own convolutions see there;
- the generator's harmonic source (linear resampling, reflect-padded STFT) and its inverse STFT
  depend on where a sequence ends, and the source draws random noise: both run per item, in
  item order (`_harmonics`, the end of `_generate`), so a batch run from one RNG state draws
  the noise the items run one after another from that state would. They are a small share of
  the work.

Everything else (ALBERT with an attention mask, the text encoders, which pack their own LSTMs,
the convolutions and upsamplings) runs on the whole batch. Inference only: the model in
``eval()`` mode, under ``torch.no_grad()`` or ``inference_mode()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

# Padded lengths are rounded up to these steps, so a stream of batches reuses a few shapes
# (kernel choice and caching allocators on a GPU) instead of a new one per batch.
TOKEN_STEP = 16
FRAME_STEP = 32


class BatchError(ValueError):
    """Requests that cannot go through `forward_batch` (none, or too long for the model)."""


@dataclass(frozen=True)
class Request:
    """One item: token ids as `KModel.forward` builds them (``[0, *ids, 0]``, shape [tokens] or
    [1, tokens]), the voice row ``ref_s`` [1, 256] and the speed."""

    input_ids: "torch.Tensor"
    ref_s: "torch.Tensor"
    speed: float = 1.0


@dataclass
class Result:
    """One item's output: float audio [samples] and the frames per token [tokens]."""

    audio: "torch.Tensor"
    durations: "torch.Tensor"


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step if step > 1 else n


def length_buckets(token_counts: Sequence[int], max_batch: int, step: int = TOKEN_STEP) -> list[list[int]]:
    """Indices of requests grouped for `forward_batch`: shortest first, requests whose lengths
    round up to the same multiple of ``step`` together, at most ``max_batch`` a group, so no
    item is padded by more than ``step`` tokens (frames follow tokens)."""
    if max_batch < 1:
        raise BatchError(f"max_batch must be at least 1, not {max_batch}")
    groups: list[list[int]] = []
    key = None
    for i in sorted(range(len(token_counts)), key=lambda i: token_counts[i]):
        k = _round_up(token_counts[i], step)
        if k != key or len(groups[-1]) >= max_batch:
            groups.append([])
            key = k
        groups[-1].append(i)
    return groups


def _mask(valid: "torch.Tensor", steps: int) -> "torch.Tensor":
    """[B, 1, steps] float: 1 at each item's first ``valid[b]`` steps, 0 after."""
    import torch

    return (torch.arange(steps, device=valid.device)[None, :] < valid[:, None]).unsqueeze(1).float()


def _padded_tokens(model, requests: Sequence[Request], step: int):
    """(input_ids [B, T] zero-padded, lengths [B] on the CPU, text_mask [B, T] True at padding)."""
    import torch

    ids = [r.input_ids.reshape(-1) for r in requests]
    longest = max(len(t) for t in ids)
    if longest > model.context_length:
        raise BatchError(f"a request has {longest} tokens; the model takes at most {model.context_length}")
    width = min(_round_up(longest, step), model.context_length)
    input_ids = torch.zeros((len(ids), width), dtype=torch.long, device=model.device)
    for b, t in enumerate(ids):
        input_ids[b, : len(t)] = t.to(model.device)
    lengths = torch.tensor([len(t) for t in ids], dtype=torch.long)
    text_mask = torch.arange(width)[None, :] >= lengths[:, None]
    return input_ids, lengths, text_mask.to(model.device)


def _packed_lstm(lstm, x: "torch.Tensor", lengths: "torch.Tensor") -> "torch.Tensor":
    """``lstm`` (batch_first) over each item's first ``lengths[b]`` steps, zeros after."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    lstm.flatten_parameters()
    out, _ = lstm(packed)
    return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


def _durations(model, input_ids, lengths, text_mask, s, speeds: Sequence[float]):
    """kokoro's duration predictor on the batch: (d [B, T, C] for the F0/energy predictor,
    each item's frames per token)."""
    import torch

    bert_dur = model.bert(input_ids, attention_mask=(~text_mask).int())
    d_en = model.bert_encoder(bert_dur).transpose(-1, -2)
    d = model.predictor.text_encoder(d_en, s, lengths.to(model.device), text_mask)
    x = _packed_lstm(model.predictor.lstm, d, lengths)
    summed = torch.sigmoid(model.predictor.duration_proj(x)).sum(axis=-1)
    # divided item by item by a Python float, as kokoro does: a tensor of speeds may round
    # differently, and one ulp can move a duration across .5
    rows = [torch.round(summed[b, :n] / speed).clamp(min=1).long() for b, (n, speed) in enumerate(zip(lengths.tolist(), speeds))]
    return d, list(torch.cat(rows).cpu().split(lengths.tolist()))  # one copy to the host


def _alignment(durations: list["torch.Tensor"], step: int, device):
    """(token index of every frame [B, F], frames per item [B]), both on ``device``: kokoro's
    ``repeat_interleave`` per item, built on the host from durations there, padded frames
    pointing at token 0 (masked later)."""
    import torch

    counts = [int(d.sum()) for d in durations]
    index = torch.zeros((len(durations), _round_up(max(counts), step)), dtype=torch.long)
    for b, d in enumerate(durations):
        index[b, : counts[b]] = torch.repeat_interleave(torch.arange(len(d)), d)
    return index.to(device), torch.tensor(counts, dtype=torch.long).to(device)


def _gather_frames(x: "torch.Tensor", index: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """[B, T, C] token features -> [B, C, F] frame features, zero at padded frames. The same
    numbers as kokoro's product with a one-hot alignment (one term 1, the rest 0)."""
    frames = x.gather(1, index[:, :, None].expand(-1, -1, x.shape[-1]))
    return frames.transpose(1, 2) * mask


def _adain(adain, x, s, m):
    """`AdaIN1d` with the instance norm's statistics over each item's valid steps (``m``),
    the norm's affine and the style's scale and shift folded into one multiply-add."""
    import torch

    norm = adain.norm
    # each item's average over its valid steps as a matrix-vector product: padded steps weigh
    # 0, so no pass over ``x`` is spent masking it
    weights = (m / m.sum(-1, keepdim=True)).transpose(1, 2)
    mean = torch.bmm(x, weights)
    var = torch.bmm((x - mean).square(), weights)
    gamma, beta = adain.fc(s).unsqueeze(-1).chunk(2, dim=1)
    scale = (var + norm.eps).rsqrt()
    shift = -mean * scale
    if norm.affine:
        scale, shift = scale * norm.weight[:, None], shift * norm.weight[:, None] + norm.bias[:, None]
    return torch.addcmul(shift * (1 + gamma) + beta, x, scale * (1 + gamma))


def _adain_resblk(blk, x, s, m_in, m_out):
    """kokoro's `AdainResBlk1d` (decoder and F0/energy predictor), masked; ``m_out`` is
    ``m_in`` upsampled when the block upsamples. Padded steps of the output are not zero."""
    import torch

    r = blk.actv(_adain(blk.norm1, x, s, m_in)) * m_in
    if blk.upsample_type != "none":
        r = blk.pool(r) * m_out  # the transposed convolution's bias lands on padded steps too
    r = blk.conv1(r)
    r = blk.actv(_adain(blk.norm2, r, s, m_out)) * m_out
    r = blk.conv2(r)
    return (r + blk._shortcut(x)) * torch.rsqrt(torch.tensor(2))


def _snake(x, alpha):
    import torch

    return x + (1 / alpha) * (torch.sin(alpha * x) ** 2)


def _adain_resblock1(blk, x, s, m):
    """kokoro's `AdaINResBlock1` (the generator's), masked. Padded steps of the output are not
    zero."""
    for c1, c2, n1, n2, a1, a2 in zip(blk.convs1, blk.convs2, blk.adain1, blk.adain2, blk.alpha1, blk.alpha2):
        xt = c1(_snake(_adain(n1, x, s, m), a1) * m)
        xt = c2(_snake(_adain(n2, xt, s, m), a2) * m)
        x = xt + x
    return x


def _f0_energy(predictor, en, s, frames):
    """`ProsodyPredictor.F0Ntrain` on the batch: (F0 [B, 2F], N [B, 2F]), zero at padding."""
    width = en.shape[-1]
    x = _packed_lstm(predictor.shared, en.transpose(-1, -2), frames.cpu()).transpose(-1, -2)
    masks = {1: _mask(frames, width), 2: _mask(frames * 2, width * 2)}
    outputs = []
    for blocks, proj in ((predictor.F0, predictor.F0_proj), (predictor.N, predictor.N_proj)):
        y, rate = x, 1
        for block in blocks:
            up = 2 if block.upsample_type != "none" else 1
            y = _adain_resblk(block, y, s, masks[rate], masks[rate * up])
            rate *= up
        outputs.append((proj(y) * masks[rate]).squeeze(1))  # 1x1: zero padding is cosmetic
    return outputs[0], outputs[1]


def _harmonics(gen, f0_curve, frames: list[int], steps: int):
    """The generator's harmonic source and its STFT, item by item (see the module docstring),
    zero-padded to ``steps`` STFT frames: [B, n_fft + 2, steps]."""
    import torch

    har = torch.zeros((len(frames), gen.post_n_fft + 2, steps), device=f0_curve.device)
    for b, n in enumerate(frames):
        f0 = gen.f0_upsamp(f0_curve[b : b + 1, : 2 * n][:, None]).transpose(1, 2)
        source, _, _ = gen.m_source(f0)
        spec, phase = gen.stft.transform(source.transpose(1, 2).squeeze(1))
        har[b, :, : spec.shape[-1]] = torch.cat([spec, phase], dim=1)[0]
    return har


def _generate(gen, x, s, f0_curve, frames: "torch.Tensor") -> list["torch.Tensor"]:
    """kokoro's `Generator.forward` on the batch, masked; each item's audio [samples]."""
    import torch
    import torch.nn.functional as F

    valid, steps = frames * 2, x.shape[-1]
    last = gen.num_upsamples - 1
    har_steps = steps * _upsampling(gen) + 1  # the STFT's frames: one per hop, both ends centred
    har = _harmonics(gen, f0_curve, frames.tolist(), har_steps)
    for i in range(gen.num_upsamples):
        x = F.leaky_relu(x, negative_slope=0.1)
        stride = gen.ups[i].stride[0]  # Kokoro's kernels and paddings make each upsampling exactly x stride
        valid, steps = valid * stride + (i == last), steps * stride + (i == last)  # + reflection pad
        m = _mask(valid, steps)
        x_source = _adain_resblock1(gen.noise_res[i], gen.noise_convs[i](har), s, m)
        x = gen.ups[i](x)
        if i == last:
            x = gen.reflection_pad(x)
        x = x + x_source
        xs = None
        for j in range(gen.num_kernels):
            y = _adain_resblock1(gen.resblocks[i * gen.num_kernels + j], x, s, m)
            xs = y if xs is None else xs + y
        x = xs / gen.num_kernels * m  # zero padding for the next transposed convolution and conv_post
    x = gen.conv_post(F.leaky_relu(x))
    half = gen.post_n_fft // 2 + 1
    spec, phase = torch.exp(x[:, :half, :]), torch.sin(x[:, half:, :])
    return [gen.stft.inverse(spec[b : b + 1, :, :n], phase[b : b + 1, :, :n]).reshape(-1) for b, n in enumerate(valid.tolist())]


def _upsampling(gen) -> int:
    import math

    return math.prod(up.stride[0] for up in gen.ups)


def _decode(dec, asr, f0_curve, n_curve, s, frames):
    """kokoro's `Decoder.forward` on the batch, masked; each item's audio."""
    import torch

    width = asr.shape[-1]
    m = _mask(frames, width)
    f0 = dec.F0_conv(f0_curve.unsqueeze(1))
    n = dec.N_conv(n_curve.unsqueeze(1))
    x = _adain_resblk(dec.encode, torch.cat([asr, f0, n], axis=1), s, m, m)
    asr_res = dec.asr_res(asr)
    res = True
    for block in dec.decode:
        if res:
            x = torch.cat([x, asr_res, f0, n], axis=1)
        up = block.upsample_type != "none"
        m_out = _mask(frames * 2, x.shape[-1] * 2) if up else m
        x = _adain_resblk(block, x, s, m, m_out)
        m = m_out
        if up:
            res = False
    return _generate(dec.generator, x * m, s, f0_curve, frames)


def forward_batch(model, requests: Sequence[Request], token_step: int = TOKEN_STEP, frame_step: int = FRAME_STEP) -> list[Result]:
    """One forward pass of ``model`` (a `kokoro.KModel`) for all ``requests``: each `Result`
    is what ``model.forward_with_tokens`` gives for that request alone, within float rounding
    (the audio on the model's device, the durations on the CPU). Token and frame lengths are
    padded up to multiples of ``token_step`` and ``frame_step`` (a batch of one is not padded).
    `BatchError` for no requests or one longer than the model's context."""
    import torch

    if not requests:
        raise BatchError("no requests")
    if len(requests) == 1:
        token_step = frame_step = 1
    with torch.no_grad():
        input_ids, lengths, text_mask = _padded_tokens(model, requests, token_step)
        ref_s = torch.cat([r.ref_s.reshape(1, -1) for r in requests]).to(model.device)
        s = ref_s[:, 128:]
        d, durations = _durations(model, input_ids, lengths, text_mask, s, [r.speed for r in requests])
        index, frames = _alignment(durations, frame_step, model.device)
        frame_mask = _mask(frames, index.shape[1])
        f0, n = _f0_energy(model.predictor, _gather_frames(d, index, frame_mask), s, frames)
        t_en = model.text_encoder(input_ids, lengths.to(model.device), text_mask)
        asr = _gather_frames(t_en.transpose(1, 2), index, frame_mask)
        audio = _decode(model.decoder, asr, f0, n, ref_s[:, :128], frames)
    return [Result(audio=a, durations=d) for a, d in zip(audio, durations)]
