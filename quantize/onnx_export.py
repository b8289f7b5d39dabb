"""ONNX artifacts of an engine bundle, written node by node with ``onnx.helper`` from the bundle's
tensors (no tracing): ``onnx/vision.onnx`` and ``onnx/decoder.onnx`` (+ ``.data`` external weights).

``vision.onnx`` (opset 17): ``pixel_values`` float32 ``(1, 3, H, W)`` with *dynamic* H and W
(multiples of the patch size) -> ``image_features`` ``(1, N, D_text)``. The learned position
embeddings are resized inside the graph with ``Resize`` (cubic, ``cubic_coeff_a = -0.75``,
``half_pixel`` coordinates), which is what PyTorch's bicubic ``interpolate(align_corners=False)``
computes, so one graph serves every rung of the resolution ladder.

``decoder.onnx`` (opset 17 + ``com.microsoft`` 1): inputs ``inputs_embeds (1, T, D)``,
``position_ids (1, T)`` int64 (``P .. P+T-1``) and per layer ``past.{i}.key``/``past.{i}.value``
``(1, n_kv_heads, P, head_dim)``; outputs ``logits (1, V)`` of the last position and
``present.{i}.key``/``.value`` ``(1, n_kv_heads, P+T, head_dim)``. INT4 layers are
``com.microsoft::MatMulNBits`` (onnxruntime contrib operator spec: attributes ``K``, ``N``,
``bits=4``, ``block_size``; ``B`` uint8 ``(N, K/block, block/2)`` with the low nibble first — the
canonical bundle layout byte for byte; ``scales`` ``(N, K/block)``; ``zero_points`` uint8
``(N, ceil(K/block / 2))``, two 4-bit zero points per byte, low nibble first). An AWQ input scale
becomes a ``Mul`` in front. Everything else is float32.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from edgevlm.runtime.models.llava.config import LlavaConfig

logger = logging.getLogger(__name__)

ONNX_DIR = "onnx"
OPSET = 17


class _Graph:
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


class _Weights:
    """The bundle's tensors by runtime canonical name, as float32 / raw numpy arrays."""

    def __init__(self, bundle_dir: Path, cfg: LlavaConfig) -> None:
        from safetensors import safe_open

        from edgevlm.runtime.loader import compile_weight_rules, map_weight_name, weight_files
        from edgevlm.runtime.models.llava.weights import WEIGHT_RULES

        rules = compile_weight_rules(WEIGHT_RULES)
        self.t: dict[str, torch.Tensor] = {}
        for path in weight_files(bundle_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = map_weight_name(key, rules)
                    if name is not None:
                        self.t[name] = f.get_tensor(key)

    def has(self, name: str) -> bool:
        return name in self.t

    def f32(self, name: str) -> np.ndarray:
        return self.t[name].float().numpy()

    def raw(self, name: str) -> np.ndarray:
        return self.t[name].numpy()


def _linear(g: _Graph, w: _Weights, x: str, module: str) -> str:
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


def _act(g: _Graph, name: str, x: str) -> str:
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


def _heads(g: _Graph, x: str, n_heads: int, head_dim: int) -> str:
    """``(1, T, H*Dh)`` -> ``(1, H, T, Dh)``."""
    return g.op("Transpose", g.op("Reshape", x, g.ints([0, 0, n_heads, head_dim])), perm=[0, 2, 1, 3])


def _merge_heads(g: _Graph, x: str) -> str:
    """``(1, H, T, Dh)`` -> ``(1, T, H*Dh)``."""
    return g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 1, 3]), g.ints([0, 0, -1]))


def _layernorm(g: _Graph, w: _Weights, x: str, module: str, eps: float) -> str:
    return g.op("LayerNormalization", x, g.const(w.f32(module + ".weight")), g.const(w.f32(module + ".bias")),
                axis=-1, epsilon=eps)


def _rmsnorm(g: _Graph, w: _Weights, x: str, module: str, eps: float) -> str:
    ms = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)  # opset 17: axes is an attribute
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(eps))))
    return g.op("Mul", g.op("Mul", x, inv), g.const(w.f32(module + ".weight")))


# ------------------------------------------------------------------------------------ vision
def build_vision_graph(w: _Weights, cfg: LlavaConfig) -> onnx.ModelProto:
    """The vision tower + projector graph (see the module docstring)."""
    vc, g = cfg.vision, _Graph()
    p, d, side = vc.patch_size, vc.hidden_size, vc.grid_side
    e = "vision_tower.encoder."
    conv_inputs = ["pixel_values", g.weight(w.t[e + "embeddings.patch_embedding.weight"])]
    if w.has(e + "embeddings.patch_embedding.bias"):  # SigLIP's patch conv has a bias, CLIP's none
        conv_inputs.append(g.const(w.f32(e + "embeddings.patch_embedding.bias"), "patch_b"))
    conv = g.op("Conv", *conv_inputs, kernel_shape=[p, p], strides=[p, p])  # (1, D, h, w); border floored
    patches = g.op("Transpose", g.op("Reshape", conv, g.ints([0, d, -1])), perm=[0, 2, 1])  # (1, h*w, D)
    pos = w.f32(e + "embeddings.position_embedding.weight")  # (1 + S*S, D) CLIP, (S*S, D) SigLIP
    patch_table = pos[1:] if cfg.vision_has_cls else pos
    grid = g.const(patch_table.reshape(side, side, d).transpose(2, 0, 1)[None], "pos_grid")  # (1, D, S, S)
    hw = g.op("Slice", g.op("Shape", conv), g.ints([2]), g.ints([4]))
    sizes = g.op("Concat", g.ints([1, d]), hw, axis=0)
    resized = g.op("Resize", grid, "", "", sizes, mode="cubic", cubic_coeff_a=-0.75,
                   coordinate_transformation_mode="half_pixel")  # (1, D, h, w)
    patch_pos = g.op("Transpose", g.op("Reshape", resized, g.ints([0, d, -1])), perm=[0, 2, 1])
    if cfg.vision_has_cls:  # CLIP: CLS token first, then pre_layrnorm
        cls = g.const(w.f32(e + "embeddings.class_embedding").reshape(1, 1, d), "cls")
        x = g.op("Concat", cls, patches, axis=1)  # (1, 1 + h*w, D)
        pos_all = g.op("Concat", g.const(pos[:1].reshape(1, 1, d), "cls_pos"), patch_pos, axis=1)
        x = _layernorm(g, w, g.op("Add", x, pos_all), e + "pre_layrnorm", vc.layer_norm_eps)
    else:  # SigLIP: patches + positions, no CLS, no pre-LN
        x = g.op("Add", patches, patch_pos)  # (1, h*w, D)
    states = {0: x}
    scale = g.const(vc.head_dim ** -0.5)
    for i in range(cfg.vision_blocks_needed):
        b = f"{e}layers.{i}."
        h = _layernorm(g, w, x, b + "layer_norm1", vc.layer_norm_eps)
        q, k, v = (_heads(g, _linear(g, w, h, b + f"self_attn.{n}_proj"), vc.num_attention_heads, vc.head_dim)
                   for n in ("q", "k", "v"))
        att = g.op("Softmax", g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), scale), axis=-1)
        x = g.op("Add", x, _linear(g, w, _merge_heads(g, g.op("MatMul", att, v)), b + "self_attn.out_proj"))
        h = _layernorm(g, w, x, b + "layer_norm2", vc.layer_norm_eps)
        h = _linear(g, w, _act(g, vc.hidden_act, _linear(g, w, h, b + "mlp.fc1")), b + "mlp.fc2")
        x = g.op("Add", x, h)
        states[i + 1] = x
    feats = [states[i] for i in cfg.vision_feature_indices]
    if cfg.vision_feature_select_strategy == "default":
        feats = [g.op("Slice", f, g.ints([1]), g.ints([2**62]), g.ints([1])) for f in feats]
    x = feats[0] if len(feats) == 1 else g.op("Concat", *feats, axis=-1)
    pj = "vision_tower.projector."
    y = _linear(g, w, _act(g, cfg.projector_hidden_act, _linear(g, w, x, pj + "linear_1")), pj + "linear_2")
    g.op("Identity", y, out="image_features")
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, vc.num_channels, "height", "width"])]
    outputs = [helper.make_tensor_value_info("image_features", TensorProto.FLOAT, [1, "n_vision_tokens",
                                                                                     cfg.text.hidden_size])]
    graph = helper.make_graph(g.nodes, "edgevlm_vision", inputs, outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("com.microsoft", 1)])


# ------------------------------------------------------------------------------------ decoder
def _rope(g: _Graph, x: str, cos: str, sin: str, half: int) -> str:
    """``x * cos + rotate_half(x) * sin`` for ``x (1, H, T, Dh)``, half-rotation layout."""
    x1 = g.op("Slice", x, g.ints([0]), g.ints([half]), g.ints([3]))
    x2 = g.op("Slice", x, g.ints([half]), g.ints([2 * half]), g.ints([3]))
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=3)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def build_decoder_graph(w: _Weights, cfg: LlavaConfig, max_positions: int) -> onnx.ModelProto:
    """The Llama decoder with past key/values (see the module docstring)."""
    from edgevlm.runtime.decoder import rope_inv_freq, rope_tables

    tc, g = cfg.text, _Graph()
    hd, nh, nkv = tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads
    cos_t, sin_t = rope_tables(hd, max_positions, tc.rope_theta, "cpu", rope_inv_freq(tc))
    cos = g.op("Unsqueeze", g.op("Gather", g.const(cos_t.numpy(), "cos"), "position_ids"), g.ints([1]))  # (1,1,T,Dh)
    sin = g.op("Unsqueeze", g.op("Gather", g.const(sin_t.numpy(), "sin"), "position_ids"), g.ints([1]))
    # causal mask over [past; new] keys: key j is visible to the query at position p iff j <= p
    total = g.op("Slice", g.op("Shape", "past.0.key"), g.ints([2]), g.ints([3]))
    total = g.op("Add", total, g.op("Slice", g.op("Shape", "position_ids"), g.ints([1]), g.ints([2])))
    keys = g.op("Range", g.ints(0), g.op("Squeeze", total, g.ints([0])), g.ints(1))  # (S,)
    visible = g.op("LessOrEqual", g.op("Unsqueeze", keys, g.ints([0, 1])),
                   g.op("Unsqueeze", "position_ids", g.ints([2])))  # (1, T, S)
    mask = g.op("Unsqueeze", g.op("Where", visible, g.const(0.0), g.const(np.finfo(np.float32).min)), g.ints([1]))
    scale = g.const(hd ** -0.5)
    x = "inputs_embeds"
    inputs = [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, "seq", tc.hidden_size]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, tc.vocab_size])]
    for i in range(tc.num_hidden_layers):
        b = f"language_model.layers.{i}."
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past.{i}.{kv}", TensorProto.FLOAT, [1, nkv, "past", hd]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                         [1, nkv, "total", hd]))
        h = _rmsnorm(g, w, x, b + "input_layernorm", tc.rms_norm_eps)
        q = _rope(g, _heads(g, _linear(g, w, h, b + "self_attn.q_proj"), nh, hd), cos, sin, hd // 2)
        k = _rope(g, _heads(g, _linear(g, w, h, b + "self_attn.k_proj"), nkv, hd), cos, sin, hd // 2)
        v = _heads(g, _linear(g, w, h, b + "self_attn.v_proj"), nkv, hd)
        k = g.op("Concat", f"past.{i}.key", k, axis=2, out=f"present.{i}.key")  # (1, Hkv, S, Dh)
        v = g.op("Concat", f"past.{i}.value", v, axis=2, out=f"present.{i}.value")
        if nh != nkv:  # grouped-query attention: repeat every kv head nh/nkv times
            rep = nh // nkv
            k, v = (g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, g.ints([2])), g.ints([1, nkv, rep, 1, 1])),
                         g.ints([1, nh, -1, hd])) for t in (k, v))
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), scale), mask)
        att = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # (1, H, T, Dh)
        x = g.op("Add", x, _linear(g, w, _merge_heads(g, att), b + "self_attn.o_proj"))
        h = _rmsnorm(g, w, x, b + "post_attention_layernorm", tc.rms_norm_eps)
        gate = _act(g, tc.hidden_act, _linear(g, w, h, b + "mlp.gate_proj"))
        x = g.op("Add", x, _linear(g, w, g.op("Mul", gate, _linear(g, w, h, b + "mlp.up_proj")), b + "mlp.down_proj"))
    last = g.op("Gather", x, g.ints(-1), axis=1)  # (1, D)
    last = _rmsnorm(g, w, last, "language_model.norm", tc.rms_norm_eps)
    head = "language_model.lm_head"
    if not (w.has(head + ".weight") or w.has(head + ".qweight")):  # tied embeddings
        w.t[head + ".weight"] = w.t["language_model.embed_tokens.weight"]
    g.op("Identity", _linear(g, w, last, head), out="logits")
    graph = helper.make_graph(g.nodes, "edgevlm_decoder", inputs, outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _save(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def export_bundle_onnx(bundle_dir: str | Path, ladder: list[int] | None = None, *,
                       max_positions: int | None = None) -> list[Path]:
    """Write ``onnx/vision.onnx`` and ``onnx/decoder.onnx`` for the bundle in ``bundle_dir``
    (before its manifest is written). Returns the written paths.

    Raises ``ModelLoadError`` for an unreadable bundle config/weights.
    """
    from edgevlm.runtime.loader import read_model_files

    root = Path(bundle_dir)
    files = read_model_files(root)
    cfg = files.config
    w = _Weights(root, cfg)
    out = root / ONNX_DIR
    out.mkdir(exist_ok=True)
    max_positions = max_positions or cfg.text.max_position_embeddings
    paths = []
    for name, model in (("vision.onnx", build_vision_graph(w, cfg)),
                        ("decoder.onnx", build_decoder_graph(w, cfg, max_positions))):
        _save(model, out / name)
        paths.append(out / name)
    logger.info("ONNX artifacts written to %s", out)
    return paths
