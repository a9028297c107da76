"""Dequantize the Kokoro-82M v1.0 int8 ONNX export back into a `kokoro.KModel` state dict.

The offline weight pack (see `voicebus.synthesis.weights`) only has the dynamically quantized
ONNX model (ONNX Runtime's MatMulInteger / ConvInteger / DynamicQuantizeLSTM). This module owns
turning it into float tensors in the layout ``kokoro`` loads: ``{'bert': {...},
'bert_encoder': {...}, 'predictor': {...}, 'text_encoder': {...}, 'decoder': {...}}``.

How each tensor is found (measured on the v1.0 export):
- float initializers that keep their module name (biases, LayerNorm/AdaLayerNorm gammas and
  betas, Snake alphas) map by name (the ONNX root ``encoder.``/``decoder.`` is dropped);
- quantized weights are ``<base>_quantized`` with ``<base>_scale``; the zero point is read from
  the input of the node that uses them (it is shared between tensors, so its name says nothing);
  a weight without a module name gets it from the scope of the node that uses it;
- MatMul weights are the transpose of ``nn.Linear.weight``;
- LSTM: ONNX gate order is i,o,f,c where PyTorch uses i,f,g,o; the ONNX bias [8h] is the input
  half then the hidden half;
- weight norm is folded into the ONNX weight: v = W, g = ||W|| per output channel (a channel
  quantized to all zeros gets v = 1, g = 0, else v / ||v|| is NaN);
- InstanceNorm affine pairs were folded away as identity (their defaults match) and
  ``bert.pooler`` is unused by Kokoro: both stay unset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TOP_MODULES = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")


class OnnxImportError(RuntimeError):
    """The ONNX model does not have the structure of the Kokoro-82M export."""


@dataclass
class ImportReport:
    """What the import set, out of what the target model has."""

    set_keys: list[str] = field(default_factory=list)
    unset_keys: list[str] = field(default_factory=list)
    total: int = 0


def _onnx_tensors(graph) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {init.name: numpy_helper.to_array(init) for init in graph.initializer}


def _scope_of(node) -> list[str]:
    """``/decoder/decoder/generator/ups.0/ConvTranspose`` -> ``['decoder', 'generator', 'ups.0']``
    (the ONNX root ``encoder``/``decoder`` wrapper dropped)."""
    parts = [p for p in node.name.split("/") if p][:-1]
    return parts[1:] if parts and parts[0] in {"encoder", "decoder"} else parts


class _KeyIndex:
    """Finds the state-dict key of the target model a name or scope refers to."""

    def __init__(self, shapes: dict[str, tuple]):
        self.shapes = shapes
        self.modules = sorted({k.rsplit(".", 1)[0] for k in shapes})

    def module_for(self, dotted: str) -> str | None:
        if dotted in self.modules:
            return dotted
        matches = [m for m in self.modules if m.endswith("." + dotted)]
        return matches[0] if len(matches) == 1 else None

    def module_for_scope(self, scope: list[str]) -> str | None:
        # scopes nest call sites (``text_encoder/cnn.0/cnn.0.0``): try the longest tails first
        for start in range(len(scope)):
            tail = scope[start:]
            candidates = [".".join(tail)]
            if len(tail) >= 2 and tail[-1].startswith(tail[-2] + "."):
                candidates.append(".".join(tail[:-2] + [tail[-1]]))
            for c in candidates:
                module = self.module_for(c)
                if module is not None:
                    return module
        return None

    def key_for_name(self, onnx_name: str) -> str | None:
        parts = onnx_name.split(".")
        if parts and parts[0] in {"encoder", "decoder"}:
            parts = parts[1:]
        dotted = ".".join(parts)
        if dotted in self.shapes:
            return dotted
        module, _, leaf = dotted.rpartition(".")
        found = self.module_for(module) if module else None
        return f"{found}.{leaf}" if found else None


def _weight_norm(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norm = np.sqrt((w.reshape(w.shape[0], -1).astype(np.float64) ** 2).sum(axis=1)).astype(np.float32)
    v = w.copy()
    dead = norm == 0
    v[dead] = 1.0
    g = norm.reshape((-1,) + (1,) * (w.ndim - 1))
    return v, g


def _dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, channel_axis: int) -> np.ndarray:
    q = q.astype(np.float32)
    scale = np.asarray(scale, np.float32)
    zero_point = np.asarray(zero_point, np.float32)
    if scale.ndim == 1 and scale.size > 1:
        shape = [1] * q.ndim
        shape[channel_axis] = -1
        scale = scale.reshape(shape)
        zero_point = zero_point.reshape(shape) if zero_point.size > 1 else zero_point
    return (q - zero_point) * scale


def _lstm_gates(w: np.ndarray, hidden: int) -> np.ndarray:
    """Rows (4h, ...) from ONNX order i,o,f,c to PyTorch order i,f,g,o."""
    i, o, f, c = (w[k * hidden : (k + 1) * hidden] for k in range(4))
    return np.concatenate([i, f, c, o], axis=0)


def import_state_dict(onnx_path: Path, target_shapes: dict[str, tuple]) -> tuple[dict[str, np.ndarray], ImportReport]:
    """Float tensors for the keys of ``target_shapes`` (a flat KModel state dict's shapes)."""
    import onnx

    model = onnx.load(str(onnx_path))
    graph = model.graph
    tensors = _onnx_tensors(graph)
    index = _KeyIndex(target_shapes)
    out: dict[str, np.ndarray] = {}

    def put(key: str | None, value: np.ndarray) -> None:
        if key is None:
            return
        if key not in target_shapes:
            module, _, leaf = key.rpartition(".")
            if leaf == "weight" and f"{module}.weight_v" in target_shapes:
                v, g = _weight_norm(value)
                put(f"{module}.weight_v", v)
                put(f"{module}.weight_g", g)
            return
        shape = tuple(target_shapes[key])
        if value.size != int(np.prod(shape)):
            raise OnnxImportError(f"{key}: ONNX tensor {value.shape} does not fit {shape}")
        out[key] = value.reshape(shape).astype(np.float32)

    def weight_key(weight_name: str, node) -> str | None:
        """``X.weight_quantized`` names its module; unnamed weights take the user's scope."""
        base = weight_name[: -len("_quantized")] if weight_name.endswith("_quantized") else weight_name
        module = None
        if base.startswith(("encoder.", "decoder.")) and base.endswith(".weight"):
            module = index.module_for(base.split(".", 1)[1].rpartition(".")[0])
        if module is None:
            module = index.module_for_scope(_scope_of(node))
        return f"{module}.weight" if module else None

    def scale_of(weight_name: str) -> np.ndarray:
        base = weight_name[: -len("_quantized")]
        if base + "_scale" not in tensors:
            raise OnnxImportError(f"no scale for {weight_name}")
        return tensors[base + "_scale"]

    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    for node in graph.node:
        op = node.op_type
        if op in {"MatMulInteger", "ConvInteger"} and node.input[1] in tensors:
            wq = tensors[node.input[1]]
            zp = tensors[node.input[3]] if len(node.input) > 3 and node.input[3] in tensors else np.zeros(())
            if op == "MatMulInteger":
                w = _dequantize(wq, scale_of(node.input[1]), zp, channel_axis=1).T
            else:
                w = _dequantize(wq, scale_of(node.input[1]), zp, channel_axis=0)
            put(weight_key(node.input[1], node), w)
        elif op in {"MatMul", "Conv", "ConvTranspose"} and len(node.input) > 1 and node.input[1] in tensors:
            w = tensors[node.input[1]].astype(np.float32)
            if op == "MatMul":
                w = w.T
            module = index.module_for_scope(_scope_of(node))
            if module is not None:
                put(f"{module}.weight", w)
        elif op == "Gather" and node.input[0].endswith("_quantized") and node.input[0] in tensors:
            dq = next((c for c in consumers.get(node.output[0], []) if c.op_type == "DequantizeLinear"), None)
            if dq is None:
                continue
            w = _dequantize(tensors[node.input[0]], tensors[dq.input[1]], tensors[dq.input[2]], channel_axis=0)
            put(index.key_for_name(node.input[0][: -len("_quantized")]), w)
        elif op == "DynamicQuantizeLSTM":
            module = index.module_for_scope(_scope_of(node))
            if module is None:
                raise OnnxImportError(f"no LSTM module for ONNX node {node.name}")
            inputs = list(node.input) + [""] * 12
            wq, rq, bias = tensors[inputs[1]], tensors[inputs[2]], tensors.get(inputs[3])
            w_scale, w_zp, r_scale, r_zp = (tensors[inputs[k]] for k in (8, 9, 10, 11))
            hidden = rq.shape[1]
            for d, suffix in enumerate(("", "_reverse")[: wq.shape[0]]):
                w = _dequantize(wq[d], w_scale[d], w_zp[d], channel_axis=1).T
                r = _dequantize(rq[d], r_scale[d], r_zp[d], channel_axis=1).T
                put(f"{module}.weight_ih_l0{suffix}", _lstm_gates(w, hidden))
                put(f"{module}.weight_hh_l0{suffix}", _lstm_gates(r, hidden))
                if bias is not None:
                    put(f"{module}.bias_ih_l0{suffix}", _lstm_gates(bias[d, : 4 * hidden], hidden))
                    put(f"{module}.bias_hh_l0{suffix}", _lstm_gates(bias[d, 4 * hidden :], hidden))

    for name, value in tensors.items():
        if value.dtype != np.float32 or not name.startswith(("encoder.", "decoder.")):
            continue
        key = index.key_for_name(name)
        if key is not None and key not in out and key in target_shapes and value.size == int(np.prod(target_shapes[key])):
            out[key] = value.reshape(target_shapes[key]).astype(np.float32)

    report = ImportReport(set_keys=sorted(out), unset_keys=sorted(set(target_shapes) - set(out)), total=len(target_shapes))
    return out, report


def nest_for_kokoro(flat: dict[str, "np.ndarray"]) -> dict[str, dict]:
    """``{'decoder.encode.conv1.bias': t}`` -> ``{'decoder': {'module.encode.conv1.bias': t}}``.

    The ``module.`` prefix matches the original Kokoro checkpoint: KModel then loads each part
    with ``strict=False`` after stripping it, so the tensors left unset keep their defaults."""
    import torch

    nested: dict[str, dict] = {top: {} for top in TOP_MODULES}
    for key, value in flat.items():
        top, _, rest = key.partition(".")
        nested[top]["module." + rest] = torch.from_numpy(np.ascontiguousarray(value))
    return nested
