"""`voicebus.synthesis.torch_ops`: torch's prepacked linear layer is ``nn.Linear``, and a torch
without its operators is named at the check."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voicebus.synthesis import torch_ops
from voicebus.synthesis.torch_ops import PrepackedLinear, TorchInternalsMissing, check_prepacked_linear, prepack_linears


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
