"""voicebus's uses of torch's internals: oneDNN's prepacked float32 linear layer, and the CPU
generator's one-value-at-a-time Gaussian draws, made faster with the same values.

Owns `PrepackedLinear` (an ``nn.Linear`` whose weight is reordered once into oneDNN's blocked
layout, run by ``torch.ops.mkldnn._linear_pointwise``: the operators torch's inductor uses for
frozen CPU graphs), `prepack_linears` and `check_prepacked_linear`, the check at load that the
installed torch still has them (torch is pinned to the tested range in pyproject.toml).

Why (docs/worker.md, "PL-BERT, prepacked"): eager ``F.linear`` on a CPU calls MKL's sgemm,
which packs the weight again on every call. For PL-BERT's few dozen tokens that packing is a
large share of each product: prepacked, a 768 -> 2048 layer over 20-64 tokens took 0.71-0.83
of the time, over 100-180 tokens 0.93-1.0 (1 thread, Xeon AMX, 2026-12-05). The result is the
same product summed in another order (relative difference ~4e-7).

Owns `randn_like_strided` and `check_randn_like_strided`, its check at load. Why (docs/worker.md,
"The harmonic source's noise"): kokoro draws the generator's noise with ``torch.randn_like`` of
a transposed view. torch fills a tensor that is not contiguous one value at a time (its serial
kernel: Box-Muller in float64, each uniform from one ``random64``), ~52 ns a value: 23 ms of
noise for 2 s of speech, before the first audio. `randn_like_strided` takes the same 64-bit
draws from the same generator in one call and does the same float64 arithmetic on whole
tensors: the same values, the generator left in the same state, in less than half the time
(35.8 -> 15.5 ms for 3 s of speech, 1 thread, Xeon AMX, 2026-12-05).
"""

from __future__ import annotations

import math
import struct

import torch  # imported only where synthesis runs: the engine imports this module lazily

# the private operators this module calls, as torch.ops.<namespace>.<name>
PRIVATE_OPS = ("mkldnn._reorder_linear_weight", "mkldnn._linear_pointwise")


class TorchInternalsMissing(RuntimeError):
    """The installed torch lacks a private operator `PrepackedLinear` calls, or oneDNN, or draws
    Gaussians otherwise than `randn_like_strided` does."""


def check_prepacked_linear() -> None:
    """Raise `TorchInternalsMissing` naming what is missing: oneDNN, or an operator of
    `PRIVATE_OPS`."""
    if not torch.backends.mkldnn.is_available():
        raise TorchInternalsMissing(f"torch {torch.__version__} is built without oneDNN (mkldnn)")
    missing = []
    for path in PRIVATE_OPS:
        namespace, name = path.split(".")
        try:
            getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            missing.append(f"torch.ops.{path}")
    if missing:
        raise TorchInternalsMissing(
            f"torch {torch.__version__} has no {', '.join(missing)}: voicebus's prepacked linear layers need torch 2.10-2.15 "
            "(pipeline/synthesis/torch_ops.py)"
        )


class PrepackedLinear(torch.nn.Module):
    """``linear`` (float32, on a CPU) with its weight in oneDNN's layout; the same call."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(module: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``module`` (in place) by a `PrepackedLinear`; the
    count replaced. Call `check_prepacked_linear` first."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PrepackedLinear(child))
                replaced += 1
    return replaced


# --- the CPU generator's serial Gaussian draws ---------------------------------------------------

# torch.get_rng_state() of the CPU generator: the legacy layout's 5056 bytes, in which the
# float64 Gaussian the serial kernel keeps for its next call (the second of a Box-Muller pair)
# sits at byte 5024, and whether there is one at NORMAL_VALID_AT (an int)
RNG_STATE_BYTES = 5056
NORMAL_VALID_AT = 5040
_MASK53 = (1 << 53) - 1  # uniform_real_distribution<double>: the low 53 bits of a random64, times 2^-53


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage without gaps or overlaps, in some order of its dims."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _cached_normal() -> bool:
    """Whether the CPU generator holds a float64 Gaussian for the serial kernel's next value."""
    state = torch.get_rng_state()
    return state.numel() != RNG_STATE_BYTES or struct.unpack_from("<i", state.numpy().tobytes(), NORMAL_VALID_AT)[0] != 0


def randn_like_strided(t: torch.Tensor) -> torch.Tensor:
    """``torch.randn_like(t)`` from the default CPU generator: the same values, the generator left
    in the same state; faster where torch draws one value at a time (a float32 CPU tensor of an
    even number of elements, at least 16, dense but not contiguous, e.g. a transposed view).
    Anything else, or a generator holding a Gaussian from an earlier serial draw, is
    ``torch.randn_like`` itself. Call `check_randn_like_strided` first."""
    n = t.numel()
    if (t.device.type != "cpu" or t.dtype != torch.float32 or n < 16 or n % 2 or t.is_contiguous()
            or not _dense(t) or _cached_normal()):
        return torch.randn_like(t)
    # the serial kernel's order: the storage's, one random64 per uniform, two uniforms a pair
    bits = torch.empty(n, dtype=torch.int64).random_()  # an int64's full range: one random64 each
    u = bits.bitwise_and_(_MASK53).double().mul_(2.0 ** -53).view(-1, 2)
    r = torch.log1p(u[:, 1].neg()).mul_(-2.0).sqrt_()
    theta = u[:, 0] * (2.0 * math.pi)
    out = torch.empty_like(t)  # t's strides
    pairs = out.as_strided((n // 2, 2), (2, 1), out.storage_offset())
    pairs[:, 0] = r * torch.cos(theta)  # returned first; r sin(theta) is the one kept for the next value
    pairs[:, 1] = r.mul_(torch.sin(theta))
    return out


def check_randn_like_strided() -> None:
    """Raise `TorchInternalsMissing` unless `randn_like_strided` draws what ``torch.randn_like``
    draws on a transposed view and leaves the generator where it does (checked on a forked
    generator: the caller's state is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20261205)
        view = torch.empty(2, 9, 40).transpose(1, 2)
        expected, state = torch.randn_like(view), torch.get_rng_state()
        torch.manual_seed(20261205)
        try:
            got = randn_like_strided(view)
        except (RuntimeError, struct.error) as exc:
            raise TorchInternalsMissing(f"torch {torch.__version__}: the serial Gaussian draws failed: {exc}") from exc
        same_state = torch.equal(torch.get_rng_state(), state)
    if state.numel() != RNG_STATE_BYTES or not torch.equal(got, expected) or not same_state:
        raise TorchInternalsMissing(
            f"torch {torch.__version__} draws Gaussians into a strided tensor otherwise than voicebus expects (torch 2.10-2.15; "
            "pipeline/synthesis/torch_ops.py)"
        )
