"""Building blocks of the bundle's ONNX graphs, written node by node with ``onnx.helper`` from the
bundle's tensors (no tracing): a graph builder, the bundle's tensors by runtime name, and the ops the
families share (linear / INT4 ``MatMulNBits``, activations, LayerNorm, RMSNorm, head split/merge,
half-rotation RoPE, masked attention). Used by :mod:`edgevlm.quantize.onnx_export` (LLaVA vision and
decoder) and :mod:`edgevlm.quantize.onnx_vision_export` (Qwen2.5-VL, Qwen3-VL, SmolVLM2 vision).

Why ``onnx.helper`` and not ``torch.onnx.export`` (measured with this environment's torch 2.13 CPU):
the default exporter (``dynamo=True``) needs ``onnxscript``, which is not a dependency; the legacy
TorchScript exporter still runs but is deprecated (a ``DeprecationWarning`` on every call) and traces
the host-side layout code of the Qwen towers (``tolist``, ``argsort``, ``bincount``) into constants of
one grid, so its graph would serve one resolution only. Writing the nodes keeps every shape symbolic.

Activations are float32; 16-bit weights are stored as such (exact, half the bytes) behind a ``Cast``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
#: additive attention bias of a masked key (finite: a row never holds only masked keys, see callers)
MASKED = float(np.finfo(np.float32).min)


class GraphBuilder:
    """Minimal graph builder: initializers and nodes with generated names."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.inits: list = []
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value, hint: str = "c", dtype=np.float32) -> str:
        name = self._name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, t: torch.Tensor, hint: str = "W") -> str:
        """A float32 value from a torch tensor; bf16/fp16 tensors are stored as such (exact, half the
        bytes) followed by a ``Cast`` to float32 that onnxruntime folds when it loads the graph."""
        t = t.detach().contiguous()
        kinds = {torch.bfloat16: TensorProto.BFLOAT16, torch.float16: TensorProto.FLOAT16}
        if t.dtype not in kinds:
            return self.const(t.float().numpy(), hint)
        name = self._name(hint)
        proto = helper.make_tensor(name, kinds[t.dtype], list(t.shape), vals=t.view(torch.int16).numpy().tobytes(),
                                   raw=True)
        self.inits.append(proto)
        return self.op("Cast", name, to=TensorProto.FLOAT)

    def ints(self, values) -> str:
        return self.const(values, "i", np.int64)

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain: str | None = None, **attrs) -> str:
        name = out or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name + "_node", domain=domain, **attrs))
        return name

    def model(self, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
        """The finished model (opset :data:`OPSET` + ``com.microsoft`` 1)."""
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                       helper.make_opsetid("com.microsoft", 1)])


class BundleTensors:
    """The bundle's tensors by runtime canonical name (the family's ``weight_rules``), optionally only
    those under some name prefixes (the vision side: the decoder is never read)."""

    def __init__(self, files, prefixes: tuple[str, ...] | None = None) -> None:
        from safetensors import safe_open

        from edgevlm.runtime.loader import canonical_key

        self.t: dict[str, torch.Tensor] = {}
        for path in files.weight_files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = canonical_key(key, files)
                    if name is not None and (prefixes is None or name.startswith(prefixes)):
                        self.t[name] = f.get_tensor(key)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> BundleTensors:
        """Tensors already in memory, by runtime name (benchmarks of modules built in memory)."""
        self = cls.__new__(cls)
        self.t = dict(tensors)
        return self

    def has(self, name: str) -> bool:
        return name in self.t

    def f32(self, name: str) -> np.ndarray:
        return self.t[name].float().numpy()

    def raw(self, name: str) -> np.ndarray:
        return self.t[name].numpy()


def linear(g: GraphBuilder, w: BundleTensors, x: str, module: str) -> str:
    """``x (..., K)`` -> ``(..., N)`` through a float MatMul or an INT4 MatMulNBits."""
    if w.has(module + ".qweight"):
        qw, zeros = w.raw(module + ".qweight"), w.raw(module + ".zeros")
        n, k = qw.shape[0], qw.shape[1] * 2
        n_blocks = zeros.shape[1]
        block = k // n_blocks
        if w.has(module + ".input_scale"):
            x = g.op("Mul", x, g.const(w.f32(module + ".input_scale")))
        zp = np.zeros((n, (n_blocks + 1) // 2), np.uint8)
        zp_even, zp_odd = zeros[:, 0::2], zeros[:, 1::2]
        zp[:, : zp_even.shape[1]] = zp_even
        zp[:, : zp_odd.shape[1]] |= zp_odd << 4
        y = g.op("MatMulNBits", x, g.const(qw.reshape(n, n_blocks, block // 2), "B", np.uint8),
                 g.const(w.f32(module + ".scales"), "scales"), g.const(zp, "zp", np.uint8),
                 domain="com.microsoft", K=k, N=n, bits=4, block_size=block)
    else:
        y = g.op("MatMul", x, g.weight(w.t[module + ".weight"].T))
    if w.has(module + ".bias"):
        y = g.op("Add", y, g.const(w.f32(module + ".bias"), "b"))
    return y


def act(g: GraphBuilder, name: str, x: str) -> str:
    """A transformers-named activation (``ACT2FN`` semantics, as :func:`edgevlm.runtime.vision.activation`)."""
    if name == "quick_gelu":
        return g.op("Mul", x, g.op("Sigmoid", g.op("Mul", x, g.const(1.702))))
    if name == "silu":
        return g.op("Mul", x, g.op("Sigmoid", x))
    if name == "relu":
        return g.op("Relu", x)
    if name == "gelu":
        erf = g.op("Erf", g.op("Mul", x, g.const(1.0 / math.sqrt(2.0))))
        return g.op("Mul", g.op("Mul", x, g.const(0.5)), g.op("Add", erf, g.const(1.0)))
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        inner = g.op("Mul", g.op("Add", x, g.op("Mul", g.op("Pow", x, g.const(3.0)), g.const(0.044715))),
                     g.const(math.sqrt(2.0 / math.pi)))
        return g.op("Mul", g.op("Mul", x, g.const(0.5)), g.op("Add", g.op("Tanh", inner), g.const(1.0)))
    raise ValueError(f"unsupported activation {name!r}")


def heads(g: GraphBuilder, x: str, n_heads: int, head_dim: int) -> str:
    """``(1, T, H*Dh)`` -> ``(1, H, T, Dh)``."""
    return g.op("Transpose", g.op("Reshape", x, g.ints([0, 0, n_heads, head_dim])), perm=[0, 2, 1, 3])


def merge_heads(g: GraphBuilder, x: str) -> str:
    """``(1, H, T, Dh)`` -> ``(1, T, H*Dh)``."""
    return g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 1, 3]), g.ints([0, 0, -1]))


def layernorm(g: GraphBuilder, w: BundleTensors, x: str, module: str, eps: float) -> str:
    return g.op("LayerNormalization", x, g.const(w.f32(module + ".weight")), g.const(w.f32(module + ".bias")),
                axis=-1, epsilon=eps)


def rmsnorm(g: GraphBuilder, w: BundleTensors, x: str, module: str, eps: float) -> str:
    ms = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)  # opset 17: axes is an attribute
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(eps))))
    return g.op("Mul", g.op("Mul", x, inv), g.const(w.f32(module + ".weight")))


def unit_offset_rmsnorm(g: GraphBuilder, w: BundleTensors, x: str, module: str, eps: float) -> str:
    """Gemma's RMSNorm ``x / rms(x) * (1 + w)`` (:class:`edgevlm.runtime.decoder.UnitOffsetNorm`)."""
    ms = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(eps))))
    return g.op("Mul", g.op("Mul", x, inv), g.const(1.0 + w.f32(module + ".weight")))


def rope(g: GraphBuilder, x: str, cos: str, sin: str, half: int, axis: int = 3) -> str:
    """``x * cos + rotate_half(x) * sin`` (half-rotation layout) over ``axis``, the head dimension."""
    x1 = g.op("Slice", x, g.ints([0]), g.ints([half]), g.ints([axis]))
    x2 = g.op("Slice", x, g.ints([half]), g.ints([2 * half]), g.ints([axis]))
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=axis)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def attention(g: GraphBuilder, q: str, k: str, v: str, bias: str | None, head_dim: int) -> str:
    """Softmax attention of ``q``/``k``/``v`` ``(B, H, L, Dh)`` with an additive key ``bias``
    broadcasting to ``(B, H, L, L)`` (None: all keys) -> ``(B, H, L, Dh)``; scale ``Dh ** -0.5``."""
    scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(head_dim ** -0.5))
    if bias is not None:
        scores = g.op("Add", scores, bias)
    return g.op("MatMul", g.op("Softmax", scores, axis=-1), v)


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """``path`` with its weights in ``path.name + ".data"`` (external data, one file)."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
