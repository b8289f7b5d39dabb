"""ONNX artifacts of an engine bundle, written node by node with ``onnx.helper`` from the bundle's
tensors (no tracing, see :mod:`edgevlm.quantize.onnx_graph` for why): ``onnx/vision.onnx`` and
``onnx/decoder.onnx`` (+ ``.data`` external weights) for every family of
:data:`edgevlm.quantize.build.ONNX_FAMILIES`. This module holds LLaVA's vision graph, the decoder graph
of every family and :func:`export_bundle_onnx`; the other families' vision graphs (and their contract)
are in :mod:`edgevlm.quantize.onnx_vision_export`.

LLaVA ``vision.onnx`` (opset 17): ``pixel_values`` float32 ``(1, 3, H, W)`` with *dynamic* H and W
(multiples of the patch size) -> ``image_features`` ``(1, N, D_text)``. The learned position
embeddings are resized inside the graph with ``Resize`` (cubic, ``cubic_coeff_a = -0.75``,
``half_pixel`` coordinates), which is what PyTorch's bicubic ``interpolate(align_corners=False)``
computes, so one graph serves every rung of the resolution ladder.

``decoder.onnx`` (opset 17 + ``com.microsoft`` 1): inputs ``inputs_embeds (1, T, D)`` float32 (vision
tokens already in place: the host embeds), ``position_ids`` int64 and per layer
``past.{i}.key``/``past.{i}.value`` ``(1, n_kv_heads, P, head_dim)``; outputs ``logits (1, V)`` of the
last position and ``present.{i}.key``/``.value`` ``(1, n_kv_heads, P+T, head_dim)``. The new tokens sit
in cache slots ``P .. P+T-1`` (causal mask by slot).

- 1-D RoPE (LLaVA, SmolVLM2): ``position_ids (1, T)`` = the slots, gathered from float32 tables of
  ``max_position_embeddings`` rows (the runtime's ``rope_tables``, with the config's RoPE scaling);
- M-RoPE (Qwen2.5-VL, Qwen3-VL; a text config with ``mrope_section``): ``position_ids (3, 1, T)``
  (temporal, height, width rows, as the model's ``position_ids``; in decode all three rows are
  ``slot + rope_delta``); the graph computes ``angle_j = position_ids[row_j, 0, t] * inv_freq_j`` with
  the frequency -> row map of :func:`mrope_rows` (sequential for Qwen2.5-VL, interleaved for Qwen3-VL),
  then ``cos``/``sin`` of ``[angles, angles]``;
- Qwen3-VL: per-head q/k RMSNorm, and inputs ``layer_add.{i}`` float32 ``(1, T, D)`` for ``i <
  len(deepstack_visual_indexes)``, added to the hidden states after layer ``i`` (the DeepStack feature
  ``i`` at the vision positions, zeros elsewhere and in decode).
- Gemma 3 (a text config with ``layer_types``): ``inputs_embeds`` already scaled by ``sqrt(hidden)``
  (the host embeds as the model does), an input ``image_blocks`` int64 ``(1, T)`` (each image's run
  numbered from 0, -1 elsewhere and in decode: :func:`edgevlm.runtime.models.gemma3.model.image_block_ids`)
  that makes the tokens of one image attend to each other; unit-offset RMSNorm ``x * (1 + w)``, four
  norms per layer, per-head q/k norm, the ``query_pre_attn_scalar`` scale; RoPE computed in the graph
  from ``position_ids`` (``pos * inv_freq``: the full layers' scaled frequencies, the sliding layers'
  own base), and the sliding layers' keys limited to ``slot - k < sliding_layer_window``.

INT4 layers are ``com.microsoft::MatMulNBits`` (onnxruntime contrib operator spec: attributes ``K``,
``N``, ``bits=4``, ``block_size``; ``B`` uint8 ``(N, K/block, block/2)`` with the low nibble first — the
canonical bundle layout byte for byte; ``scales`` ``(N, K/block)``; ``zero_points`` uint8
``(N, ceil(K/block / 2))``, two 4-bit zero points per byte, low nibble first). An AWQ input scale
becomes a ``Mul`` in front. q/k/v biases (Qwen2) are read when the bundle has them. Everything else
is float32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import torch
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
    unit_offset_rmsnorm,
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
def mrope_rows(tc) -> np.ndarray:
    """``(head_dim / 2,)`` int64: the M-RoPE position row (0 t, 1 h, 2 w) each RoPE frequency reads,
    taken from :func:`edgevlm.runtime.models.qwen_vl.rope.mrope_cos_sin` itself (positions 0, 1, 2 on
    the three rows with unit frequencies: the angle of frequency ``j`` is its row), so the graph
    follows the runtime's sequential / interleaved rule."""
    from edgevlm.runtime.models.qwen_vl.rope import mrope_cos_sin

    half = tc.head_dim // 2
    cos, _ = mrope_cos_sin(torch.tensor([[0], [1], [2]]), torch.ones(half), tc.mrope_section, tc.mrope_interleaved)
    return torch.round(torch.acos(cos[0, :half].double())).to(torch.int64).numpy()


def build_decoder_graph(w: BundleTensors, cfg, max_positions: int, *, n_layer_adds: int = 0) -> onnx.ModelProto:
    """The Llama-family decoder with past key/values (see the module docstring): 1-D RoPE from
    tables gathered at ``position_ids`` (LLaVA, SmolVLM2), or, when the text config has an
    ``mrope_section`` (Qwen2.5-VL, Qwen3-VL), M-RoPE computed in the graph from ``position_ids``
    ``(3, 1, T)``; ``n_layer_adds`` inputs ``layer_add.{i}`` added after layer ``i`` (DeepStack)."""
    from edgevlm.runtime.decoder import rope_inv_freq, rope_tables

    tc, g = cfg.text, GraphBuilder()
    hd, nh, nkv = tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads
    gemma = tc.layer_types is not None
    norm = unit_offset_rmsnorm if tc.norm_unit_offset else rmsnorm
    past = g.op("Slice", g.op("Shape", "past.0.key"), g.ints([2]), g.ints([3]))  # (1,) P
    new = g.op("Slice", g.op("Shape", "inputs_embeds"), g.ints([1]), g.ints([2]))  # (1,) T
    if tc.mrope_section:
        # angle of frequency j at token t: position_ids[row_j, 0, t] * inv_freq_j; [freqs, freqs] (half rotation)
        pos = g.op("Cast", g.op("Reshape", "position_ids", g.ints([3, -1])), to=TensorProto.FLOAT)  # (3, T)
        sel = g.op("Transpose", g.op("Gather", pos, g.ints(mrope_rows(tc)), axis=0), perm=[1, 0])  # (T, Dh/2)
        freqs = g.op("Mul", sel, g.const(rope_inv_freq(tc).float().numpy(), "inv_freq"))
        emb = g.op("Concat", freqs, freqs, axis=-1)  # (T, Dh)
        cos, sin = (g.op("Unsqueeze", g.op(f, emb), g.ints([0, 1])) for f in ("Cos", "Sin"))  # (1, 1, T, Dh)
        slots = g.op("Unsqueeze", g.op("Range", g.op("Squeeze", past, g.ints([0])),
                                       g.op("Squeeze", g.op("Add", past, new), g.ints([0])), g.ints(1)),
                     g.ints([0]))  # (1, T): cache slots P .. P+T-1
        pos_info = helper.make_tensor_value_info("position_ids", TensorProto.INT64, [3, 1, "seq"])
    elif gemma:  # 1-D RoPE computed in the graph: two frequency sets, no max_position tables
        pos = g.op("Unsqueeze", g.op("Cast", g.op("Reshape", "position_ids", g.ints([-1])), to=TensorProto.FLOAT),
                   g.ints([1]))  # (T, 1)

        def tables(inv_freq: torch.Tensor, hint: str) -> tuple[str, str]:
            freqs = g.op("Mul", pos, g.const(inv_freq.float().numpy(), hint))  # (T, Dh/2)
            emb = g.op("Concat", freqs, freqs, axis=-1)  # (T, Dh)
            return tuple(g.op("Unsqueeze", g.op(f, emb), g.ints([0, 1])) for f in ("Cos", "Sin"))  # (1, 1, T, Dh)

        cos, sin = tables(rope_inv_freq(tc), "inv_freq")
        local_cos, local_sin = cos, sin
        if tc.sliding_rope_theta is not None:
            local_inv = 1.0 / (tc.sliding_rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
            local_cos, local_sin = tables(local_inv, "local_inv_freq")
        slots = "position_ids"
        pos_info = helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "seq"])
    else:
        cos_t, sin_t = rope_tables(hd, max_positions, tc.rope_theta, "cpu", rope_inv_freq(tc))
        cos = g.op("Unsqueeze", g.op("Gather", g.const(cos_t.numpy(), "cos"), "position_ids"), g.ints([1]))  # (1,1,T,Dh)
        sin = g.op("Unsqueeze", g.op("Gather", g.const(sin_t.numpy(), "sin"), "position_ids"), g.ints([1]))
        slots = "position_ids"  # the slots are the positions
        pos_info = helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "seq"])
    # causal mask over [past; new] keys: key j is visible to the query in slot s iff j <= s
    keys = g.op("Range", g.ints(0), g.op("Squeeze", g.op("Add", past, new), g.ints([0])), g.ints(1))  # (S,)
    visible = g.op("LessOrEqual", g.op("Unsqueeze", keys, g.ints([0, 1])),
                   g.op("Unsqueeze", slots, g.ints([2])))  # (1, T, S)
    sliding_mask = None
    if gemma:  # OR the image blocks; the sliding layers AND their window (Decoder.forward's rules)
        past_blocks = g.op("ConstantOfShape", past, value=helper.make_tensor("minus1", TensorProto.INT64, [1], [-1]))
        key_blocks = g.op("Unsqueeze", g.op("Concat", past_blocks, g.op("Reshape", "image_blocks", g.ints([-1])),
                                            axis=0), g.ints([0, 1]))  # (1, 1, S)
        query_blocks = g.op("Unsqueeze", "image_blocks", g.ints([2]))  # (1, T, 1)
        same = g.op("And", g.op("Equal", query_blocks, key_blocks), g.op("GreaterOrEqual", query_blocks, g.ints(0)))
        visible = g.op("Or", visible, same)  # (1, T, S)
        if tc.sliding_layer_window is not None:
            in_window = g.op("Greater", g.op("Unsqueeze", keys, g.ints([0, 1])),
                             g.op("Sub", g.op("Unsqueeze", slots, g.ints([2])), g.ints(tc.sliding_layer_window)))
            sliding_mask = g.op("Unsqueeze", g.op("Where", g.op("And", visible, in_window), g.const(0.0),
                                                  g.const(np.finfo(np.float32).min)), g.ints([1]))
    mask = g.op("Unsqueeze", g.op("Where", visible, g.const(0.0), g.const(np.finfo(np.float32).min)), g.ints([1]))
    scale = g.const(tc.attn_scale if tc.attn_scale is not None else hd ** -0.5)
    x = "inputs_embeds"
    inputs = [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, "seq", tc.hidden_size]),
              pos_info]
    if gemma:
        inputs.append(helper.make_tensor_value_info("image_blocks", TensorProto.INT64, [1, "seq"]))
    inputs += [helper.make_tensor_value_info(f"layer_add.{i}", TensorProto.FLOAT, [1, "seq", tc.hidden_size])
               for i in range(n_layer_adds)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, tc.vocab_size])]
    for i in range(tc.num_hidden_layers):
        b = f"language_model.layers.{i}."
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past.{i}.{kv}", TensorProto.FLOAT, [1, nkv, "past", hd]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                         [1, nkv, "total", hd]))
        sliding = gemma and tc.layer_types[i] == "sliding_attention"
        layer_cos, layer_sin = (local_cos, local_sin) if sliding else (cos, sin)
        layer_mask = sliding_mask if sliding and sliding_mask is not None else mask
        h = norm(g, w, x, b + "input_layernorm", tc.rms_norm_eps)
        q = heads(g, linear(g, w, h, b + "self_attn.q_proj"), nh, hd)  # (1, H, T, Dh)
        k = heads(g, linear(g, w, h, b + "self_attn.k_proj"), nkv, hd)
        if tc.qk_norm:  # Qwen3 / Gemma 3: RMSNorm over each head's Dh before RoPE
            q = norm(g, w, q, b + "self_attn.q_norm", tc.rms_norm_eps)
            k = norm(g, w, k, b + "self_attn.k_norm", tc.rms_norm_eps)
        q, k = rope(g, q, layer_cos, layer_sin, hd // 2), rope(g, k, layer_cos, layer_sin, hd // 2)
        v = heads(g, linear(g, w, h, b + "self_attn.v_proj"), nkv, hd)
        k = g.op("Concat", f"past.{i}.key", k, axis=2, out=f"present.{i}.key")  # (1, Hkv, S, Dh)
        v = g.op("Concat", f"past.{i}.value", v, axis=2, out=f"present.{i}.value")
        if nh != nkv:  # grouped-query attention: repeat every kv head nh/nkv times
            rep = nh // nkv
            k, v = (g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, g.ints([2])), g.ints([1, nkv, rep, 1, 1])),
                         g.ints([1, nh, -1, hd])) for t in (k, v))
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), scale), layer_mask)
        att = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # (1, H, T, Dh)
        y = linear(g, w, merge_heads(g, att), b + "self_attn.o_proj")
        if tc.sandwich_norms:  # Gemma 3: post-attention norm on the branch, norms around the MLP
            x = g.op("Add", x, norm(g, w, y, b + "post_attention_layernorm", tc.rms_norm_eps))
            h = norm(g, w, x, b + "pre_feedforward_layernorm", tc.rms_norm_eps)
        else:
            x = g.op("Add", x, y)
            h = rmsnorm(g, w, x, b + "post_attention_layernorm", tc.rms_norm_eps)
        gate = act(g, tc.hidden_act, linear(g, w, h, b + "mlp.gate_proj"))
        y = linear(g, w, g.op("Mul", gate, linear(g, w, h, b + "mlp.up_proj")), b + "mlp.down_proj")
        if tc.sandwich_norms:
            y = norm(g, w, y, b + "post_feedforward_layernorm", tc.rms_norm_eps)
        x = g.op("Add", x, y)
        if i < n_layer_adds:
            x = g.op("Add", x, f"layer_add.{i}")
    last = g.op("Gather", x, g.ints(-1), axis=1)  # (1, D)
    last = norm(g, w, last, "language_model.norm", tc.rms_norm_eps)
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
    from edgevlm.quantize.onnx_vision_export import VISION_GRAPHS
    from edgevlm.runtime.loader import read_model_files

    root = Path(bundle_dir)
    files = read_model_files(root)
    cfg, family = files.config, files.family.name
    out = root / ONNX_DIR
    max_positions = max_positions or cfg.text.max_position_embeddings
    if family == "llava":
        w = BundleTensors(files)
        graphs = [("vision.onnx", lambda: build_vision_graph(w, cfg)),
                  ("decoder.onnx", lambda: build_decoder_graph(w, cfg, max_positions))]
    elif family in VISION_GRAPHS:
        w = BundleTensors(files)
        n_adds = len(cfg.vision.deepstack_visual_indexes) if family == "qwen3_vl" else 0
        graphs = [("vision.onnx", lambda: VISION_GRAPHS[family](w, cfg)),
                  ("decoder.onnx", lambda: build_decoder_graph(w, cfg, max_positions, n_layer_adds=n_adds))]
    else:
        raise ValueError(f"no ONNX export for the {family} family (supported: llava, {', '.join(VISION_GRAPHS)})")
    out.mkdir(exist_ok=True)
    paths = []
    for name, build in graphs:
        save_model(build(), out / name)
        paths.append(out / name)
    logger.info("ONNX artifacts written to %s: %s", out, ", ".join(p.name for p in paths))
    return paths
