"""`voicebus.synthesis.tiled_conv`: a convolution through short DFTs or F(4, 3) is torch's
convolution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voicebus.synthesis import tiled_conv
from voicebus.synthesis.tiled_conv import TILE, TiledConv, WinogradConv


def _direct(x, weight, bias, dilation, padding):
    """torch's Conv1d on a time-major [T, C] input, time-major out."""
    return torch.nn.functional.conv1d(x.T.unsqueeze(0), weight, bias, 1, padding, dilation)[0].T


@settings(max_examples=60, deadline=None)
@given(channels_in=st.integers(1, 24), channels_out=st.integers(1, 24), kernel=st.integers(1, 15),
       dilation=st.integers(1, 6), steps=st.integers(1, 300), padding=st.sampled_from(["same", "none", "more"]),
       bias=st.booleans(), n=st.sampled_from([16, TILE, 64]), seed=st.integers(0, 2**16),
       spectra_bytes=st.sampled_from([1, 4096, tiled_conv.SPECTRA_BYTES]))
def test_a_tiled_convolution_is_the_direct_one(channels_in, channels_out, kernel, dilation, steps, padding, bias, n, seed,
                                               spectra_bytes):
    """Any kernel that fits a tile, any dilation (its polyphase components), any length (the
    last tile runs past the end), any padding that leaves an output, the tiles in chunks of
    any size (one tile at a time, a few, all): within float32 rounding."""
    if kernel + 1 > n:
        n = 64 if kernel + 1 <= 64 else kernel + 1
    _assert_the_direct_one(lambda weight, pad, b: TiledConv(weight, dilation, pad, b, n=n), channels_in,
                           channels_out, kernel, dilation, steps, padding, bias, seed, spectra_bytes)


def _assert_the_direct_one(make, channels_in, channels_out, kernel, dilation, steps, padding, bias, seed, spectra_bytes):
    """``make(weight, padding, bias)``'s convolution of a random input, its tiles taken
    ``spectra_bytes`` at a time, against torch's: within float32 rounding."""
    pad = {"same": dilation * (kernel - 1) // 2, "none": 0, "more": dilation * (kernel - 1)}[padding]
    if steps + 2 * pad - dilation * (kernel - 1) < 1:
        return
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(channels_out, channels_in, kernel, generator=g)
    b = torch.randn(channels_out, generator=g) if bias else None
    x = torch.randn(steps, channels_in, generator=g)
    default, tiled_conv.SPECTRA_BYTES = tiled_conv.SPECTRA_BYTES, spectra_bytes
    try:
        got = make(weight, pad, b)(x)
    finally:
        tiled_conv.SPECTRA_BYTES = default
    expected = _direct(x, weight, b, dilation, pad)
    assert got.shape == expected.shape
    scale = float(x.abs().max() * weight.abs().sum(dim=(1, 2)).max()) + 1.0
    assert float((got - expected).abs().max()) <= 1e-5 * scale


def test_the_generators_layers_through_tiles_match_within_float32_rounding():
    """The shapes the generator runs (256 and 128 channels, kernels 7 and 11, dilations 1, 3
    and 5, a window's length): as close to the direct convolution as float32 allows."""
    g = torch.Generator().manual_seed(0)
    for channels, steps in ((256, 560), (128, 3361)):
        for kernel in (7, 11):
            for dilation in (1, 3, 5):
                weight = torch.randn(channels, channels, kernel, generator=g) / (channels * kernel) ** 0.5
                bias = torch.randn(channels, generator=g)
                x = torch.randn(steps, channels, generator=g)
                pad = dilation * (kernel - 1) // 2
                expected = _direct(x, weight, bias, dilation, pad)
                got = TiledConv(weight, dilation, pad, bias)(x)
                assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5


def test_a_kernel_wider_than_its_tile_is_refused():
    with pytest.raises(ValueError, match="cannot hold a kernel of 40 taps"):
        TiledConv(torch.zeros(2, 2, 40), 1, 0, None, n=32)


@settings(max_examples=60, deadline=None)
@given(channels_in=st.integers(1, 24), channels_out=st.integers(1, 24), dilation=st.integers(1, 6),
       steps=st.integers(1, 300), padding=st.sampled_from(["same", "none", "more"]), bias=st.booleans(),
       seed=st.integers(0, 2**16), spectra_bytes=st.sampled_from([1, 4096, tiled_conv.SPECTRA_BYTES]))
def test_a_winograd_convolution_is_the_direct_one(channels_in, channels_out, dilation, steps, padding, bias, seed,
                                                  spectra_bytes):
    """F(4, 3): any dilation, length, padding and chunking, within float32 rounding."""
    _assert_the_direct_one(lambda weight, pad, b: WinogradConv(weight, dilation, pad, b), channels_in, channels_out,
                           3, dilation, steps, padding, bias, seed, spectra_bytes)


def test_the_decoders_3_tap_layers_through_winograd_match_within_float32_rounding():
    """The shapes F(4, 3) runs in the engine: the frame-rate half's (514-1090 channels in,
    512-1024 out, a sentence's frames) and the generator's first stage (256 channels,
    dilations 1, 3 and 5)."""
    g = torch.Generator().manual_seed(0)
    for cin, out, steps, dilation in ((1090, 1024, 85, 1), (514, 1024, 160, 1), (1090, 512, 170, 1),
                                      (256, 256, 560, 1), (256, 256, 560, 3), (256, 256, 560, 5)):
        weight = torch.randn(out, cin, 3, generator=g) / (cin * 3) ** 0.5
        bias = torch.randn(out, generator=g)
        x = torch.randn(steps, cin, generator=g)
        expected = _direct(x, weight, bias, dilation, dilation)
        got = WinogradConv(weight, dilation, dilation, bias)(x)
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5


def test_winograd_takes_3_taps_only():
    with pytest.raises(ValueError, match="3 taps, not 5"):
        WinogradConv(torch.zeros(2, 2, 5), 1, 0, None)
