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
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgevlm.quantize.onnx_graph import (
    BundleTensors,
    GraphBuilder,
    act,
    heads,
    layernorm,
    linear,
    merge_heads,
    rmsnorm,
    rope,
    save_model,
)
from edgevlm.runtime.models.llava.config import LlavaConfig

logger = logging.getLogger(__name__)

ONNX_DIR = "onnx"


# ------------------------------------------------------------------------------------ vision
def build_vision_graph(w: BundleTensors, cfg: LlavaConfig) -> onnx.ModelProto:
    """The vision tower + projector graph (see the module docstring)."""
    vc, g = cfg.vision, GraphBuilder()
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
        x = layernorm(g, w, g.op("Add", x, pos_all), e + "pre_layrnorm", vc.layer_norm_eps)
    else:  # SigLIP: patches + positions, no CLS, no pre-LN
        x = g.op("Add", patches, patch_pos)  # (1, h*w, D)
    states = {0: x}
    scale = g.const(vc.head_dim ** -0.5)
    for i in range(cfg.vision_blocks_needed):
        b = f"{e}layers.{i}."
        h = layernorm(g, w, x, b + "layer_norm1", vc.layer_norm_eps)
        q, k, v = (heads(g, linear(g, w, h, b + f"self_attn.{n}_proj"), vc.num_attention_heads, vc.head_dim)
                   for n in ("q", "k", "v"))
        att = g.op("Softmax", g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), scale), axis=-1)
        x = g.op("Add", x, linear(g, w, merge_heads(g, g.op("MatMul", att, v)), b + "self_attn.out_proj"))
        h = layernorm(g, w, x, b + "layer_norm2", vc.layer_norm_eps)
        h = linear(g, w, act(g, vc.hidden_act, linear(g, w, h, b + "mlp.fc1")), b + "mlp.fc2")
        x = g.op("Add", x, h)
        states[i + 1] = x
    feats = [states[i] for i in cfg.vision_feature_indices]
    if cfg.vision_feature_select_strategy == "default":
        feats = [g.op("Slice", f, g.ints([1]), g.ints([2**62]), g.ints([1])) for f in feats]
    x = feats[0] if len(feats) == 1 else g.op("Concat", *feats, axis=-1)
    pj = "vision_tower.projector."
    y = linear(g, w, act(g, cfg.projector_hidden_act, linear(g, w, x, pj + "linear_1")), pj + "linear_2")
    g.op("Identity", y, out="image_features")
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, vc.num_channels, "height", "width"])]
    outputs = [helper.make_tensor_value_info("image_features", TensorProto.FLOAT, [1, "n_vision_tokens",
                                                                                     cfg.text.hidden_size])]
    return g.model("edgevlm_vision", inputs, outputs)


# ------------------------------------------------------------------------------------ decoder
def build_decoder_graph(w: BundleTensors, cfg: LlavaConfig, max_positions: int) -> onnx.ModelProto:
    """The Llama decoder with past key/values (see the module docstring)."""
    from edgevlm.runtime.decoder import rope_inv_freq, rope_tables

    tc, g = cfg.text, GraphBuilder()
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
        h = rmsnorm(g, w, x, b + "input_layernorm", tc.rms_norm_eps)
        q = rope(g, heads(g, linear(g, w, h, b + "self_attn.q_proj"), nh, hd), cos, sin, hd // 2)
        k = rope(g, heads(g, linear(g, w, h, b + "self_attn.k_proj"), nkv, hd), cos, sin, hd // 2)
        v = heads(g, linear(g, w, h, b + "self_attn.v_proj"), nkv, hd)
        k = g.op("Concat", f"past.{i}.key", k, axis=2, out=f"present.{i}.key")  # (1, Hkv, S, Dh)
        v = g.op("Concat", f"past.{i}.value", v, axis=2, out=f"present.{i}.value")
        if nh != nkv:  # grouped-query attention: repeat every kv head nh/nkv times
            rep = nh // nkv
            k, v = (g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, g.ints([2])), g.ints([1, nkv, rep, 1, 1])),
                         g.ints([1, nh, -1, hd])) for t in (k, v))
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), scale), mask)
        att = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # (1, H, T, Dh)
        x = g.op("Add", x, linear(g, w, merge_heads(g, att), b + "self_attn.o_proj"))
        h = rmsnorm(g, w, x, b + "post_attention_layernorm", tc.rms_norm_eps)
        gate = act(g, tc.hidden_act, linear(g, w, h, b + "mlp.gate_proj"))
        x = g.op("Add", x, linear(g, w, g.op("Mul", gate, linear(g, w, h, b + "mlp.up_proj")), b + "mlp.down_proj"))
    last = g.op("Gather", x, g.ints(-1), axis=1)  # (1, D)
    last = rmsnorm(g, w, last, "language_model.norm", tc.rms_norm_eps)
    head = "language_model.lm_head"
    if not (w.has(head + ".weight") or w.has(head + ".qweight")):  # tied embeddings
        w.t[head + ".weight"] = w.t["language_model.embed_tokens.weight"]
    g.op("Identity", linear(g, w, last, head), out="logits")
    return g.model("edgevlm_decoder", inputs, outputs)


def export_bundle_onnx(bundle_dir: str | Path, ladder: list[int] | None = None, *,
                       max_positions: int | None = None) -> list[Path]:
    """Write the ONNX artifacts of the bundle in ``bundle_dir`` (before its manifest is written):
    ``onnx/vision.onnx`` and ``onnx/decoder.onnx`` for LLaVA, ``onnx/vision.onnx`` for the families of
    :data:`edgevlm.quantize.onnx_vision_export.VISION_GRAPHS` (their decoder stays torch-only).
    Returns the written paths.

    Raises:
        ModelLoadError: an unreadable bundle config/weights.
        ValueError: a family with no ONNX export.
    """
    from edgevlm.quantize.onnx_vision_export import VISION_GRAPHS, vision_prefixes
    from edgevlm.runtime.loader import read_model_files

    root = Path(bundle_dir)
    files = read_model_files(root)
    cfg, family = files.config, files.family.name
    out = root / ONNX_DIR
    if family == "llava":
        w = BundleTensors(files)
        max_positions = max_positions or cfg.text.max_position_embeddings
        graphs = [("vision.onnx", lambda: build_vision_graph(w, cfg)),
                  ("decoder.onnx", lambda: build_decoder_graph(w, cfg, max_positions))]
    elif family in VISION_GRAPHS:
        w = BundleTensors(files, vision_prefixes(family))
        graphs = [("vision.onnx", lambda: VISION_GRAPHS[family](w, cfg))]
    else:
        raise ValueError(f"no ONNX export for the {family} family (supported: llava, {', '.join(VISION_GRAPHS)})")
    out.mkdir(exist_ok=True)
    paths = []
    for name, build in graphs:
        save_model(build(), out / name)
        paths.append(out / name)
    logger.info("ONNX artifacts written to %s: %s", out, ", ".join(p.name for p in paths))
    return paths
