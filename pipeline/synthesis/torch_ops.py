"""voicebus's one use of torch's private operators: oneDNN's prepacked float32 linear layer.

Owns `PrepackedLinear` (an ``nn.Linear`` whose weight is reordered once into oneDNN's blocked
layout, run by ``torch.ops.mkldnn._linear_pointwise``: the operators torch's inductor uses for
frozen CPU graphs), `prepack_linears` and `check_prepacked_linear`, the check at load that the
installed torch still has them (torch is pinned to the tested range in pyproject.toml).

Why (docs/worker.md, "PL-BERT, prepacked"): eager ``F.linear`` on a CPU calls MKL's sgemm,
which packs the weight again on every call. For PL-BERT's few dozen tokens that packing is a
large share of each product: prepacked, a 768 -> 2048 layer over 20-64 tokens took 0.71-0.83
of the time, over 100-180 tokens 0.93-1.0 (1 thread, Xeon AMX, 2026-12-05). The result is the
same product summed in another order (relative difference ~4e-7).
"""

from __future__ import annotations

import torch  # imported only where synthesis runs: the engine imports this module lazily

# the private operators this module calls, as torch.ops.<namespace>.<name>
PRIVATE_OPS = ("mkldnn._reorder_linear_weight", "mkldnn._linear_pointwise")


class TorchInternalsMissing(RuntimeError):
    """The installed torch lacks a private operator `PrepackedLinear` calls, or oneDNN."""


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
