"""Wide 1-D convolutions computed through short DFTs: the generator's float32 path on a CPU.

Owns `TiledConv`, a stride-1, ungrouped convolution (a cross-correlation, as torch's) of a
time-major ``[T, C]`` sequence, with any dilation, computed by overlap-save over tiles of
``n`` samples: each tile goes through a real DFT written as one matrix product, the channels
are mixed per frequency (a complex matrix product, as real ones), and the tiles come back
through the inverse DFT, keeping the ``n - k + 1`` samples that saw no wrap-around. A dilated
convolution is ``d`` interleaved undilated ones (its polyphase components), so every tile is
short whatever the dilation.

Why (docs/worker.md, "Wide convolutions through short DFTs"): on a CPU without bfloat16
arithmetic the generator's convolutions run near a core's float32 peak, so only fewer
multiplications make them faster. Directly, a kernel of ``k`` taps costs ``2 k C_in`` per output
sample and channel; here the mixing costs ``3 (n / 2 + 1) 2 C_in / (n - k + 1)`` (a complex
product as three real ones), 4.7x fewer for ``k = 11`` and 3.6x for ``k = 7`` at ``n = 32``, and
the transforms add work proportional to ``C``, not ``C²``. Measured per layer over a first
window (`voicebus bench precision --layers`), the generator's 7-tap convolutions take 0.55-0.77
of the direct time and its 11-tap ones 0.41-0.66; 3-tap ones would take longer.

Also owns `WinogradConv`, the same tiling for 3-tap kernels with Winograd's minimal filtering
F(4, 3) (Lavin and Gray, 2016) in place of the DFT: each tile of 6 samples gives 4 outputs
through 6 real channel mixings instead of 12, and its transforms are small integer matrices.
It pays where the channels are many (the generator's first 256-channel stage and the decoder's
frame-rate half, 512-1090 channels); at 128 channels the transforms cost what the mixing saves,
so those stay direct (`MIN_WINOGRAD_CHANNELS`).

Both are exact to float32's rounding: the result is within 1e-5 (relative) of the direct
convolution's (~1e-6 for F(4, 3), whose points are 0, ±1, ±2 and infinity).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Kernels at least this wide go through tiles: over a first window a 7-tap convolution took
# 0.55-0.77 of the direct one's time, an 11-tap one 0.41-0.66, a 3-tap one 1.13-1.55
# (`voicebus bench precision --layers`, 1 thread, Xeon AMX, 2026-12-05; docs/benchmarks.md).
MIN_TILED_KERNEL = 7
# Fewer channels than this on either side, and a tiled convolution's transforms cost more than
# its channel mixing saves (``conv_post``'s 22 outputs)
MIN_TILED_CHANNELS = 64
# Samples per tile: 16 kept too few of each tile for an 11-tap kernel, 64 put more work in the
# transforms than it saved in the mixing, for 128 and 256 channels alike
TILE = 32
# Spectra computed at a time: a window's or a sentence's tiles in chunks whose spectra fit a
# core's L2 cache (2 MiB on the Xeon measured). All at once, a 128-channel convolution over a
# sentence (22 921 steps) took 0.99-1.47 of the direct time; in chunks of 1-2 MiB 0.59-0.85,
# and windows were unchanged (half a MiB: 5-20 % slower).
SPECTRA_BYTES = 2 << 20
# 3-tap convolutions with at least this many channels (in and out) go through F(4, 3): over a
# first window one of 256 channels took 0.75-0.81 of the direct time, one of 128 channels
# 1.06-1.25; the frame-rate half's (512-1090 channels) over a sentence 0.66-1.02 (`voicebus
# bench precision --layers`, 1 thread, Xeon AMX, 2026-12-05; docs/benchmarks.md)
MIN_WINOGRAD_CHANNELS = 256


def tiling(kernel: int, channels_in: int, channels_out: int) -> str | None:
    """How the engine's float32 path on a CPU runs a stride-1, ungrouped convolution of this
    shape: ``"dft"`` (`TiledConv`), ``"winograd"`` (`WinogradConv`) or None (directly)."""
    if kernel >= MIN_TILED_KERNEL and min(channels_in, channels_out) >= MIN_TILED_CHANNELS:
        return "dft"
    if kernel == 3 and min(channels_in, channels_out) >= MIN_WINOGRAD_CHANNELS:
        return "winograd"
    return None


def tiled(weight: "torch.Tensor", dilation: int, padding: int, bias: "torch.Tensor | None",
          ways: tuple[str, ...] = ("dft", "winograd")) -> "TiledConv | WinogradConv | None":
    """The convolution ``weight`` [out, in, k] through `tiling`'s way, if it is one of ``ways``."""
    out, cin, k = weight.shape
    way = tiling(k, cin, out)
    if way not in ways:
        return None
    return TiledConv(weight, dilation, padding, bias) if way == "dft" else WinogradConv(weight, dilation, padding, bias)


class _OverlapSave:
    """The tiling `TiledConv` and `WinogradConv` share: the time-major input cut into tiles of
    ``n`` samples that overlap by ``k - 1``, each phase of a dilated convolution apart, taken a
    cache's worth at a time; a subclass turns ``[n, d, tiles, C]`` tiles into their ``[m, d,
    tiles, out]`` valid outputs (`_tiles`), ``m = n - k + 1``."""

    def __init__(self, weight: "torch.Tensor", dilation: int, padding: int, bias: "torch.Tensor | None", n: int) -> None:
        out, _, k = weight.shape
        if n < k + 1:
            raise ValueError(f"a tile of {n} samples cannot hold a kernel of {k} taps")
        self.k, self.d, self.padding, self.n, self.m, self.out = k, dilation, padding, n, n - k + 1, out
        self.bias = None if bias is None else bias.detach().float()

    # floats each tile's transform holds per input channel (`SPECTRA_BYTES` sizes the chunks)
    transformed: int

    def __call__(self, x: "torch.Tensor") -> "torch.Tensor":
        import torch
        import torch.nn.functional as F

        steps, channels = x.shape
        k, d, n, m, p = self.k, self.d, self.n, self.m, self.padding
        out_steps = steps + 2 * p - d * (k - 1)
        per_phase = -(-out_steps // d)  # outputs of each polyphase component
        tiles = -(-per_phase // m)
        span = (tiles - 1) * m + n  # inputs each component's tiles cover
        padded = F.pad(x, (0, 0, p, d * span - steps - p))  # [d * span, C], zeros past the end
        # [n, d, tiles, C]: sample j of tile b of phase q is padded[(b m + j) d + q]
        rows = padded.as_strided((n, d, tiles, channels), (d * channels, channels, m * d * channels, 1))
        y = torch.empty((tiles, m, d, self.out), dtype=x.dtype, device=x.device)  # step (b m + i) d + q
        # a few dozen tiles at a time, so each chunk's transforms stay in the core's cache
        at_once = max(1, SPECTRA_BYTES // (d * self.transformed * channels * x.element_size()))
        for first in range(0, tiles, at_once):
            last = min(tiles, first + at_once)
            y[first:last] = self._tiles(rows[:, :, first:last], last - first).permute(2, 0, 1, 3)
        y = y.view(tiles * m * d, self.out)[:out_steps]
        return y if self.bias is None else y + self.bias

    def _tiles(self, rows: "torch.Tensor", tiles: int) -> "torch.Tensor":
        raise NotImplementedError


class TiledConv(_OverlapSave):
    """``weight`` [out, in, k] (float32, as a Conv1d's), ``dilation``, ``padding`` (each side)
    and ``bias`` [out] or None; called on a time-major ``[T, in]`` float32 tensor, returns
    ``[T + 2 padding - dilation (k - 1), out]``, the Conv1d's output laid out time-major."""

    def __init__(self, weight: "torch.Tensor", dilation: int, padding: int, bias: "torch.Tensor | None",
                 n: int = TILE) -> None:
        import torch

        super().__init__(weight, dilation, padding, bias, n)
        out, cin, k = weight.shape
        self.bins = nb = n // 2 + 1
        self.transformed = 2 * nb
        # computed in float64 once, kept in float32: the transforms' own rounding stays ~1e-7
        t = torch.arange(n, dtype=torch.float64)
        f = torch.arange(nb, dtype=torch.float64)
        angle = 2 * math.pi * torch.outer(f, t) / n  # [bins, n]
        self.forward_dft = torch.cat([torch.cos(angle), -torch.sin(angle)]).float().contiguous()  # [2 bins, n]
        # the inverse, for the m samples of a tile that saw no wrap-around (k - 1 .. n - 1);
        # every bin but the first and (n even) the last stands for itself and its conjugate
        twice = torch.full((nb,), 2.0, dtype=torch.float64)
        twice[0] = 1.0
        if n % 2 == 0:
            twice[-1] = 1.0
        angle = 2 * math.pi * torch.outer(torch.arange(k - 1, n, dtype=torch.float64), f) / n  # [m, bins]
        self.inverse_dft = (torch.cat([twice * torch.cos(angle), -twice * torch.sin(angle)], 1) / n).float().contiguous()
        # overlap-save computes a circular convolution: the kernel reversed is a correlation's
        kernel = torch.zeros(out, cin, n, dtype=torch.float64)
        kernel[:, :, :k] = weight.detach().double().flip(-1)
        spectrum = torch.fft.rfft(kernel, dim=-1)  # [out, in, bins]
        self.w_real = spectrum.real.permute(2, 1, 0).float().contiguous()  # [bins, in, out]
        self.w_imag = spectrum.imag.permute(2, 1, 0).float().contiguous()
        self.w_sum = (self.w_real + self.w_imag).contiguous()

    def _tiles(self, rows: "torch.Tensor", tiles: int) -> "torch.Tensor":
        """[n, d, tiles, C] input tiles to their [m, d, tiles, out] valid outputs."""
        import torch

        n, d, _, channels = rows.shape
        nb = self.bins
        spectra = (self.forward_dft @ rows.reshape(n, d * tiles * channels)).view(2, nb, d * tiles, channels)
        real, imag = spectra[0], spectra[1]
        # the complex product in three real ones (Gauss): re = rr - ii, im = (r + i)(wr + wi) - rr - ii
        rr, ii = torch.bmm(real, self.w_real), torch.bmm(imag, self.w_imag)
        mixed = torch.empty((2 * nb, d * tiles, self.out), dtype=rows.dtype, device=rows.device)  # [re; im]
        torch.sub(rr, ii, out=mixed[:nb])
        imaginary = torch.bmm(real + imag, self.w_sum, out=mixed[nb:])
        imaginary -= rr
        imaginary -= ii
        return (self.inverse_dft @ mixed.view(2 * nb, d * tiles * self.out)).view(self.m, d, tiles, self.out)


# F(4, 3) from the points 0, 1, -1, 2, -2 and infinity: the input transform B^T, the kernel's G
# and the output transform A^T of Lavin and Gray's "Fast Algorithms for Convolutional Neural
# Networks" (2016); A^T ((G g) * (B^T d)) is the correlation of 6 inputs d with 3 taps g
WINOGRAD_BT = ((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0),
               (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1))
WINOGRAD_G = ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6),
              (1 / 24, 1 / 12, 1 / 6), (1 / 24, -1 / 12, 1 / 6), (0, 0, 1))
WINOGRAD_AT = ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))


class WinogradConv(_OverlapSave):
    """A 3-tap Conv1d, as `TiledConv` takes and returns it, through F(4, 3): tiles of 6
    samples, 4 outputs each; the kernel's transform ``G g`` [6, in, out] is kept (twice the
    weights' memory)."""

    def __init__(self, weight: "torch.Tensor", dilation: int, padding: int, bias: "torch.Tensor | None") -> None:
        import torch

        if weight.shape[-1] != 3:
            raise ValueError(f"F(4, 3) takes a kernel of 3 taps, not {weight.shape[-1]}")
        super().__init__(weight, dilation, padding, bias, n=6)
        self.transformed = 6
        self.input_transform = torch.tensor(WINOGRAD_BT, dtype=torch.float32)  # [6, 6]
        self.output_transform = torch.tensor(WINOGRAD_AT, dtype=torch.float32)  # [4, 6]
        g = torch.tensor(WINOGRAD_G, dtype=torch.float64)
        # [6, in, out], computed in float64 so the kernel's transform adds no rounding of its own
        self.kernel = torch.einsum("jt,oit->jio", g, weight.detach().double()).float().contiguous()

    def _tiles(self, rows: "torch.Tensor", tiles: int) -> "torch.Tensor":
        """[6, d, tiles, C] input tiles to their [4, d, tiles, out] outputs."""
        import torch

        n, d, _, channels = rows.shape
        transformed = (self.input_transform @ rows.reshape(n, d * tiles * channels)).view(n, d * tiles, channels)
        mixed = torch.bmm(transformed, self.kernel)  # [6, d tiles, out]
        return (self.output_transform @ mixed.view(n, d * tiles * self.out)).view(self.m, d, tiles, self.out)
