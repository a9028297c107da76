"""`voicebus.synthesis.torch_ops`: torch's prepacked linear layer is ``nn.Linear``, the faster
serial Gaussian draws are torch's, and a torch without what they need is named at the check."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voicebus.synthesis import torch_ops
from voicebus.synthesis.torch_ops import (
    PrepackedLinear, TorchInternalsMissing, check_prepacked_linear, check_randn_like_strided, prepack_linears,
    randn_like_strided,
)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 200), features_in=st.integers(1, 96), features_out=st.integers(1, 96), bias=st.booleans(),
       leading=st.sampled_from([(), (1,), (2, 3)]), seed=st.integers(0, 2**16))
def test_a_prepacked_linear_layer_is_the_layer(rows, features_in, features_out, bias, leading, seed):
    """Any batch shape, any number of rows (the packing is done once, not for one row count),
    with or without a bias: the layer's output within float32 rounding."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(features_in, features_out, bias=bias)
    x = torch.randn(*leading, rows, features_in)
    with torch.inference_mode():
        expected, got = linear(x), PrepackedLinear(linear)(x)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5 * (float(expected.abs().max()) + 1), rtol=0)


def test_every_linear_layer_of_a_module_is_prepacked_in_place():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Sequential(torch.nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    with torch.inference_mode():
        expected = net(x)
        assert prepack_linears(net) == 2
        got = net(x)
    assert isinstance(net[0], PrepackedLinear) and isinstance(net[2][0], PrepackedLinear)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


def test_the_check_passes_on_the_pinned_torch_and_names_a_missing_operator(monkeypatch):
    check_prepacked_linear()
    monkeypatch.setattr(torch_ops, "PRIVATE_OPS", (*torch_ops.PRIVATE_OPS, "mkldnn._no_such_operator"))
    with pytest.raises(TorchInternalsMissing, match=r"no torch\.ops\.mkldnn\._no_such_operator: .* need torch 2\.10-2\.15"):
        check_prepacked_linear()


def test_the_check_names_a_torch_without_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(TorchInternalsMissing, match="without oneDNN"):
        check_prepacked_linear()


def _draws(draw, t: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``draw(t)`` returns from a generator seeded ``seed``, and the generator's state after."""
    torch.manual_seed(seed)
    return draw(t), torch.get_rng_state()


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=2, max_size=4), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_strided_draws_are_torch_s_and_leave_the_generator_where_torch_does(sizes, seed, data):
    """Any dims in any order (transposed views: the serial kernel; contiguous, odd or small ones:
    torch's own call): the same values and the same generator state after, so what is drawn next
    is the same too."""
    order = data.draw(st.permutations(range(len(sizes))))
    view = torch.empty(*sizes).permute(*order)
    expected, expected_state = _draws(torch.randn_like, view, seed)
    got, state = _draws(randn_like_strided, view, seed)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    # float64 sin/cos/log1p computed by other routines may differ in their last bit: as float32, at most one ulp
    assert torch.all((got - expected).abs() <= torch.finfo(torch.float32).eps * expected.abs()), (got - expected).abs().max()
    assert torch.equal(state, expected_state)


def test_the_harmonic_source_s_draws_are_torch_s_to_the_bit():
    """The shape the generator draws (9 overtones over 2 s at 24 kHz, a transposed view), as kokoro gets them."""
    view = torch.empty(1, 9, 48_000).transpose(1, 2)
    assert not view.is_contiguous()
    expected, expected_state = _draws(torch.randn_like, view, 7)
    got, state = _draws(randn_like_strided, view, 7)
    assert torch.equal(got, expected) and torch.equal(state, expected_state)


def test_a_gaussian_kept_from_an_earlier_serial_draw_is_used_first_as_torch_does():
    def after_an_odd_draw(draw):
        def drawn(t):
            torch.empty(5).normal_()  # fewer than 16: the serial kernel, which keeps the pair's second
            return draw(t)
        return drawn

    view = torch.empty(3, 20).t()
    expected, expected_state = _draws(after_an_odd_draw(torch.randn_like), view, 11)
    got, state = _draws(after_an_odd_draw(randn_like_strided), view, 11)
    assert torch.equal(got, expected) and torch.equal(state, expected_state)


def test_the_draws_check_passes_on_the_pinned_torch_leaves_the_generator_and_names_another_layout(monkeypatch):
    torch.manual_seed(5)
    before = torch.get_rng_state()
    check_randn_like_strided()
    assert torch.equal(torch.get_rng_state(), before)
    monkeypatch.setattr(torch_ops, "RNG_STATE_BYTES", torch_ops.RNG_STATE_BYTES + 8)
    with pytest.raises(TorchInternalsMissing, match=r"draws Gaussians into a strided tensor otherwise than voicebus expects \(torch 2\.10-2\.15"):
        check_randn_like_strided()
