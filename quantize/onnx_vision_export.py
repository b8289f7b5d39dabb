"""``onnx/vision.onnx`` of the Qwen2.5-VL, Qwen3-VL and SmolVLM2 families: one shape-generic graph
per bundle that serves every rung of the resolution ladder (any patch grid, any number of images,
video frames or tiles), written node by node (:mod:`edgevlm.quantize.onnx_graph`).

Everything that depends on the grid (rotary tables, window layout, attention segments, the
position-embedding resampling weights, SmolVLM's bucketed positions) is computed on the host by the
runtime's own functions and fed as inputs (:mod:`edgevlm.runtime.backends.onnx_vision`, which builds
the feeds); inside the graph every shape is symbolic. Opset 17, activations float32, 16-bit weights
stored as such behind a ``Cast``. N = patches, S = attention segments, L = the longest segment.

**Qwen2.5-VL** (``runtime/models/qwen2_5_vl/vision.py``)

==================  ========  ====================  =====================================================
name                dtype     shape                 meaning
==================  ========  ====================  =====================================================
``pixel_values``    float32   ``(N, C*tp*p*p)``     the processor's patch rows (2x2-merge-block order)
``rope_cos/_sin``   float32   ``(N, head_dim)``     2-D rotary tables, same patch order
``window_index``    int64     ``(S_w, L_w)``        patch rows of each attention window, padded with 0
``window_bias``     float32   ``(S_w, L_w)``        additive key bias: 0 real, float32 min padding
``window_scatter``  int64     ``(N,)``              row of patch i in the flattened ``S_w * L_w`` results
``frame_index``     int64     ``(S_f, L_f)``        as ``window_*`` with one segment per frame, for the
``frame_bias``      float32   ``(S_f, L_f)``        blocks in ``fullatt_block_indexes``
``frame_scatter``   int64     ``(N,)``
``image_features``  float32   ``(N / 4, D_text)``   output: merged vision tokens, the processor's order
==================  ========  ====================  =====================================================

The Conv3d patch embedding is one MatMul over the flattened kernel; blocks are RMSNorm -> attention
(fused qkv, rotary in float32, softmax within the segments through Gather -> batched attention ->
Gather back) -> RMSNorm -> SwiGLU; the merger is RMSNorm, 2x2 rows concatenated, Linear -> GELU ->
Linear. The PyTorch tower reorders patches into window order and back; the graph keeps the
processor's order and reaches the windows through the gather tables (the same sums).

**Qwen3-VL** (``runtime/models/qwen3_vl/vision.py``): ``pixel_values``, ``rope_cos``/``rope_sin``,
``frame_index``/``frame_bias``/``frame_scatter`` as above, plus ``pos_index`` int64 ``(N, 4)`` (rows
of the learned ``G x G`` position table, the bilinear ``align_corners=True`` taps) and ``pos_weight``
float32 ``(N, 4)`` (their weights). Outputs ``image_features`` ``(N / 4, D_text)`` and, for every entry
``k`` of ``deepstack_visual_indexes`` in order, ``deepstack.{k}`` ``(N / 4, D_text)`` (the DeepStack
merger of that block's output: 2x2 concatenation, then LayerNorm, Linear -> GELU -> Linear).

**SmolVLM2** (``runtime/models/smolvlm/vision.py``): ``pixel_values`` float32 ``(N_tiles, 3, H, W)``
(the processor's tiles: H = W = the tile side; border pixels past the last whole patch are dropped
by the stride-p Conv), ``position_ids`` int64 ``(N_tiles, h*w)`` (bucketed fractional positions, 0 for
a padded patch), ``key_bias`` float32 ``(N_tiles, h*w)`` (0 real patch, float32 min padded) ->
``image_features`` float32 ``(N_tiles, h*w / r^2, D_text)`` (SigLIP encoder, post-LayerNorm, pixel
shuffle by ``scale_factor`` r in transformers' channel order, bias-free projection).

**InternVL** (``runtime/models/internvl/vision.py``): ``pixel_values`` float32 ``(N_tiles, 3, T, T)`` (the
processor's tiles at the trained tile size T, so no input depends on the image) -> ``image_features``
float32 ``(N_tiles, (T/p)^2 / r^2, D_text)`` (InternViT: CLS token + absolute positions, blocks with
LayerNorm or RMSNorm, optional q/k RMSNorm over the full width, layer scale; the final LayerNorm when
``use_mean_pooling`` is false; CLS dropped, pixel shuffle by r = ``1 / downsample_ratio``, LayerNorm,
Linear -> act -> Linear).

**Gemma 3** (``runtime/models/gemma3/vision.py``): ``pixel_values`` float32 ``(N_img, 3, P, P)`` (the
processor's images at the tower's ``image_size`` P, so no input depends on the image) ->
``image_features`` float32 ``(N_img, mm_tokens_per_image, D_text)`` (SigLIP encoder, post-LayerNorm,
the ``S x S`` grid average-pooled ``k x k`` with stride k, the unit-offset RMSNorm ``x * (1 + w)``,
``MatMul`` with ``mm_input_projection_weight`` ``(D_v, D_text)``).

A family not listed here gets no vision graph (the build prints one note and keeps the torch bundle).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from edgevlm.quantize.onnx_graph import (
    BundleTensors,
    GraphBuilder,
    act,
    attention,
    heads,
    layernorm,
    linear,
    merge_heads,
    rmsnorm,
    rope,
    unit_offset_rmsnorm,
)

__all__ = ["VISION_GRAPHS", "build_gemma3_vision_graph", "build_internvl_vision_graph", "build_qwen2_5_vl_vision_graph",
           "build_qwen3_vl_vision_graph", "build_smolvlm_vision_graph"]

_F, _I = TensorProto.FLOAT, TensorProto.INT64
_QWEN3_LN_EPS = 1e-6  # fixed in transformers' Qwen3-VL vision blocks and mergers


def _inp(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _segment_inputs(prefix: str) -> list[onnx.ValueInfoProto]:
    s, n = f"{prefix}_segments", f"{prefix}_length"
    return [_inp(f"{prefix}_index", _I, [s, n]), _inp(f"{prefix}_bias", _F, [s, n]),
            _inp(f"{prefix}_scatter", _I, ["n_patches"])]


def _segment_attention(g: GraphBuilder, q: str, k: str, v: str, prefix: str, bias: str, head_dim: int,
                       width: int) -> str:
    """``q``/``k``/``v`` ``(N, H, Dh)`` -> ``(N, H*Dh)``: attention inside the segments of the
    ``{prefix}_index`` table (``bias`` ``(S, 1, 1, L)``), results put back by ``{prefix}_scatter``."""
    def segments(x: str) -> str:  # (N, H, Dh) -> (S, H, L, Dh)
        return g.op("Transpose", g.op("Gather", x, f"{prefix}_index", axis=0), perm=[0, 2, 1, 3])

    y = attention(g, segments(q), segments(k), segments(v), bias, head_dim)  # (S, H, L, Dh)
    y = g.op("Reshape", g.op("Transpose", y, perm=[0, 2, 1, 3]), g.ints([-1, width]))  # (S*L, D)
    return g.op("Gather", y, f"{prefix}_scatter", axis=0)  # (N, D)


def _patch_embed(g: GraphBuilder, w: BundleTensors, module: str) -> str:
    """Conv3d with kernel == stride over one patch row each: ``pixel_values (N, K)`` -> ``(N, D)``."""
    weight = w.t[module + ".weight"]  # (D, C, tp, p, p)
    x = g.op("MatMul", "pixel_values", g.weight(weight.reshape(weight.shape[0], -1).T, "patch_w"))
    if w.has(module + ".bias"):
        x = g.op("Add", x, g.const(w.f32(module + ".bias"), "patch_b"))
    return x


def _qkv_rope(g: GraphBuilder, w: BundleTensors, h: str, module: str, n_heads: int, head_dim: int,
              cos: str, sin: str) -> tuple[str, str, str]:
    """Fused ``qkv`` linear of ``h (N, D)`` -> q, k (rotary applied), v, each ``(N, H, Dh)``."""
    qkv = g.op("Reshape", linear(g, w, h, module), g.ints([0, 3, n_heads, head_dim]))  # (N, 3, H, Dh)
    q, k, v = (g.op("Gather", qkv, g.ints(j), axis=1) for j in range(3))
    return rope(g, q, cos, sin, head_dim // 2, axis=2), rope(g, k, cos, sin, head_dim // 2, axis=2), v


def _rope_inputs(g: GraphBuilder) -> tuple[str, str, list[onnx.ValueInfoProto]]:
    cos = g.op("Unsqueeze", "rope_cos", g.ints([1]))  # (N, 1, Dh): one table for every head
    sin = g.op("Unsqueeze", "rope_sin", g.ints([1]))
    return cos, sin, [_inp("rope_cos", _F, ["n_patches", "head_dim"]), _inp("rope_sin", _F, ["n_patches", "head_dim"])]


def build_qwen2_5_vl_vision_graph(w: BundleTensors, cfg) -> onnx.ModelProto:
    """Qwen2.5-VL's vision tower + merger (contract: the module docstring)."""
    vc, g = cfg.vision, GraphBuilder()
    d, nh, hd, unit = vc.hidden_size, vc.num_heads, vc.head_dim, vc.spatial_merge_size ** 2
    k_in = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    x = _patch_embed(g, w, "visual.patch_embed.proj")  # (N, D)
    cos, sin, rope_in = _rope_inputs(g)
    bias = {p: g.op("Unsqueeze", f"{p}_bias", g.ints([1, 2])) for p in ("window", "frame")}  # (S, 1, 1, L)
    full = set(vc.fullatt_block_indexes)
    for i in range(vc.depth):
        b = f"visual.blocks.{i}."
        q, k, v = _qkv_rope(g, w, rmsnorm(g, w, x, b + "norm1", vc.rms_norm_eps), b + "attn.qkv", nh, hd, cos, sin)
        prefix = "frame" if i in full else "window"
        y = _segment_attention(g, q, k, v, prefix, bias[prefix], hd, d)
        x = g.op("Add", x, linear(g, w, y, b + "attn.proj"))
        h = rmsnorm(g, w, x, b + "norm2", vc.rms_norm_eps)
        gate = act(g, vc.hidden_act, linear(g, w, h, b + "mlp.gate_proj"))
        x = g.op("Add", x, linear(g, w, g.op("Mul", gate, linear(g, w, h, b + "mlp.up_proj")), b + "mlp.down_proj"))
    h = g.op("Reshape", rmsnorm(g, w, x, "visual.merger.ln_q", vc.rms_norm_eps), g.ints([-1, unit * d]))
    y = linear(g, w, act(g, "gelu", linear(g, w, h, "visual.merger.mlp.0")), "visual.merger.mlp.2")
    g.op("Identity", y, out="image_features")
    inputs = [_inp("pixel_values", _F, ["n_patches", k_in]), *rope_in, *_segment_inputs("window"),
              *_segment_inputs("frame")]
    outputs = [_inp("image_features", _F, ["n_vision_tokens", vc.out_hidden_size])]
    return g.model("edgevlm_qwen2_5_vl_vision", inputs, outputs)


def _qwen3_merger(g: GraphBuilder, w: BundleTensors, x: str, module: str, width: int, postshuffle: bool) -> str:
    """Qwen3-VL patch merger: ``(N, D)`` -> ``(N / 4, D_text)``; ``postshuffle``: LayerNorm over the
    concatenated ``4 D`` (the DeepStack mergers), else over ``D`` before concatenating."""
    if postshuffle:
        h = layernorm(g, w, g.op("Reshape", x, g.ints([-1, width])), module + ".norm", _QWEN3_LN_EPS)
    else:
        h = g.op("Reshape", layernorm(g, w, x, module + ".norm", _QWEN3_LN_EPS), g.ints([-1, width]))
    return linear(g, w, act(g, "gelu", linear(g, w, h, module + ".linear_fc1")), module + ".linear_fc2")


def build_qwen3_vl_vision_graph(w: BundleTensors, cfg) -> onnx.ModelProto:
    """Qwen3-VL's vision tower, merger and DeepStack mergers (contract: the module docstring)."""
    vc, g = cfg.vision, GraphBuilder()
    d, nh, hd, unit = vc.hidden_size, vc.num_heads, vc.head_dim, vc.spatial_merge_size ** 2
    k_in = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    x = _patch_embed(g, w, "visual.patch_embed.proj")  # (N, D)
    taps = g.op("Gather", g.weight(w.t["visual.pos_embed.weight"], "pos_table"), "pos_index", axis=0)  # (N, 4, D)
    pos = g.op("ReduceSum", g.op("Mul", taps, g.op("Unsqueeze", "pos_weight", g.ints([2]))), g.ints([1]), keepdims=0)
    x = g.op("Add", x, pos)
    cos, sin, rope_in = _rope_inputs(g)
    bias = g.op("Unsqueeze", "frame_bias", g.ints([1, 2]))
    outputs = [_inp("image_features", _F, ["n_vision_tokens", vc.out_hidden_size])]
    for i in range(vc.depth):
        b = f"visual.blocks.{i}."
        q, k, v = _qkv_rope(g, w, layernorm(g, w, x, b + "norm1", _QWEN3_LN_EPS), b + "attn.qkv", nh, hd, cos, sin)
        x = g.op("Add", x, linear(g, w, _segment_attention(g, q, k, v, "frame", bias, hd, d), b + "attn.proj"))
        h = layernorm(g, w, x, b + "norm2", _QWEN3_LN_EPS)
        x = g.op("Add", x, linear(g, w, act(g, vc.hidden_act, linear(g, w, h, b + "mlp.linear_fc1")),
                                  b + "mlp.linear_fc2"))
        if i in vc.deepstack_visual_indexes:
            k_ds = vc.deepstack_visual_indexes.index(i)
            y = _qwen3_merger(g, w, x, f"visual.deepstack_merger_list.{k_ds}", unit * d, postshuffle=True)
            g.op("Identity", y, out=f"deepstack.{k_ds}")
            outputs.append(_inp(f"deepstack.{k_ds}", _F, ["n_vision_tokens", vc.out_hidden_size]))
    g.op("Identity", _qwen3_merger(g, w, x, "visual.merger", unit * d, postshuffle=False), out="image_features")
    inputs = [_inp("pixel_values", _F, ["n_patches", k_in]), _inp("pos_index", _I, ["n_patches", 4]),
              _inp("pos_weight", _F, ["n_patches", 4]), *rope_in, *_segment_inputs("frame")]
    return g.model("edgevlm_qwen3_vl_vision", inputs, outputs)


def build_smolvlm_vision_graph(w: BundleTensors, cfg) -> onnx.ModelProto:
    """SmolVLM2's SigLIP tower + pixel-shuffle connector over tiles (contract: the module docstring)."""
    vc, g = cfg.vision, GraphBuilder()
    p, d, r = vc.patch_size, vc.hidden_size, cfg.scale_factor
    e = "vision_model."
    conv = g.op("Conv", "pixel_values", g.weight(w.t[e + "embeddings.patch_embedding.weight"], "patch_w"),
                g.const(w.f32(e + "embeddings.patch_embedding.bias"), "patch_b"),
                kernel_shape=[p, p], strides=[p, p])  # (N, D, h, w); border floored
    x = g.op("Transpose", g.op("Reshape", conv, g.ints([0, d, -1])), perm=[0, 2, 1])  # (N, h*w, D)
    x = g.op("Add", x, g.op("Gather", g.weight(w.t[e + "embeddings.position_embedding.weight"], "pos_table"),
                            "position_ids", axis=0))
    bias = g.op("Unsqueeze", "key_bias", g.ints([1, 2]))  # (N, 1, 1, h*w)
    for i in range(vc.num_hidden_layers):
        b = f"{e}encoder.layers.{i}."
        h = layernorm(g, w, x, b + "layer_norm1", vc.layer_norm_eps)
        q, k, v = (heads(g, linear(g, w, h, b + f"self_attn.{n}_proj"), vc.num_attention_heads, vc.head_dim)
                   for n in ("q", "k", "v"))
        y = merge_heads(g, attention(g, q, k, v, bias, vc.head_dim))
        x = g.op("Add", x, linear(g, w, y, b + "self_attn.out_proj"))
        h = layernorm(g, w, x, b + "layer_norm2", vc.layer_norm_eps)
        x = g.op("Add", x, linear(g, w, act(g, vc.hidden_act, linear(g, w, h, b + "mlp.fc1")), b + "mlp.fc2"))
    x = layernorm(g, w, x, e + "post_layernorm", vc.layer_norm_eps)
    # pixel shuffle (transformers' SmolVLMConnector.pixel_shuffle order) on the (h, w) grid of the conv
    rows = g.op("Slice", g.op("Shape", conv), g.ints([2]), g.ints([3]))
    x = g.op("Reshape", x, g.op("Concat", g.ints([0]), rows, g.ints([-1, d * r]), axis=0))  # (N, h, w/r, D r)
    x = g.op("Transpose", x, perm=[0, 2, 1, 3])  # (N, w/r, h, D r)
    x = g.op("Transpose", g.op("Reshape", x, g.ints([0, 0, -1, d * r * r])), perm=[0, 2, 1, 3])  # (N, h/r, w/r, D r^2)
    x = g.op("Reshape", x, g.ints([0, -1, d * r * r]))
    g.op("Identity", linear(g, w, x, "connector.modality_projection.proj"), out="image_features")
    inputs = [_inp("pixel_values", _F, ["n_tiles", vc.num_channels, "height", "width"]),
              _inp("position_ids", _I, ["n_tiles", "n_patches"]), _inp("key_bias", _F, ["n_tiles", "n_patches"])]
    outputs = [_inp("image_features", _F, ["n_tiles", "n_tile_tokens", cfg.text.hidden_size])]
    return g.model("edgevlm_smolvlm_vision", inputs, outputs)


def build_internvl_vision_graph(w: BundleTensors, cfg) -> onnx.ModelProto:
    """InternVL's InternViT + pixel shuffle + projector over tiles (contract: the module docstring)."""
    vc, g = cfg.vision, GraphBuilder()
    p, d, r, side = vc.patch_size, vc.hidden_size, cfg.scale_factor, vc.grid_side
    e = "vision_tower."

    def norm(x: str, module: str) -> str:
        if vc.norm_type == "rms_norm":
            return rmsnorm(g, w, x, module, vc.layer_norm_eps)
        return layernorm(g, w, x, module, vc.layer_norm_eps)

    conv = g.op("Conv", "pixel_values", g.weight(w.t[e + "embeddings.patch_embeddings.projection.weight"], "patch_w"),
                g.const(w.f32(e + "embeddings.patch_embeddings.projection.bias"), "patch_b"),
                kernel_shape=[p, p], strides=[p, p])  # (N, D, S, S)
    x = g.op("Transpose", g.op("Reshape", conv, g.ints([0, d, -1])), perm=[0, 2, 1])  # (N, S*S, D)
    n = g.op("Slice", g.op("Shape", x), g.ints([0]), g.ints([1]))
    cls = g.op("Expand", g.const(w.f32(e + "embeddings.cls_token"), "cls"), g.op("Concat", n, g.ints([1, d]), axis=0))
    x = g.op("Add", g.op("Concat", cls, x, axis=1), g.const(w.f32(e + "embeddings.position_embeddings"), "pos"))
    for i in range(cfg.feature_index):
        b = f"{e}encoder.layer.{i}."
        h = norm(x, b + "layernorm_before")
        q, k = linear(g, w, h, b + "attention.q_proj"), linear(g, w, h, b + "attention.k_proj")
        if vc.use_qk_norm:  # over the whole width, before the head split
            q = rmsnorm(g, w, q, b + "attention.q_norm", vc.qk_norm_eps)
            k = rmsnorm(g, w, k, b + "attention.k_norm", vc.qk_norm_eps)
        q, k, v = (heads(g, t, vc.num_attention_heads, vc.head_dim)
                   for t in (q, k, linear(g, w, h, b + "attention.v_proj")))
        y = linear(g, w, merge_heads(g, attention(g, q, k, v, None, vc.head_dim)), b + "attention.projection_layer")
        x = g.op("Add", x, g.op("Mul", y, g.const(w.f32(b + "lambda_1"), "ls")))
        h = linear(g, w, act(g, vc.hidden_act, linear(g, w, norm(x, b + "layernorm_after"), b + "mlp.fc1")),
                   b + "mlp.fc2")
        x = g.op("Add", x, g.op("Mul", h, g.const(w.f32(b + "lambda_2"), "ls")))
    if cfg.feature_index == vc.num_hidden_layers and not vc.use_mean_pooling:
        x = layernorm(g, w, x, e + "layernorm", vc.layer_norm_eps)
    x = g.op("Slice", x, g.ints([1]), g.ints([1 + side * side]), g.ints([1]))  # drop CLS: (N, S*S, D)
    # pixel shuffle (transformers' InternVLModel.pixel_shuffle order) on the S x S grid
    x = g.op("Transpose", g.op("Reshape", x, g.ints([0, side, side // r, d * r])), perm=[0, 2, 1, 3])
    x = g.op("Transpose", g.op("Reshape", x, g.ints([0, side // r, side // r, d * r * r])), perm=[0, 2, 1, 3])
    x = g.op("Reshape", x, g.ints([0, -1, d * r * r]))  # (N, (S/r)^2, D r^2)
    m = "multi_modal_projector."
    x = layernorm(g, w, x, m + "layer_norm", 1e-5)  # nn.LayerNorm's default eps
    x = linear(g, w, act(g, cfg.projector_hidden_act, linear(g, w, x, m + "linear_1")), m + "linear_2")
    g.op("Identity", x, out="image_features")
    inputs = [_inp("pixel_values", _F, ["n_tiles", vc.num_channels, vc.image_size, vc.image_size])]
    outputs = [_inp("image_features", _F, ["n_tiles", cfg.image_seq_len, cfg.text.hidden_size])]
    return g.model("edgevlm_internvl_vision", inputs, outputs)


def build_gemma3_vision_graph(w: BundleTensors, cfg) -> onnx.ModelProto:
    """Gemma 3's SigLIP tower + average-pool projector over whole images (contract: the module docstring)."""
    vc, g = cfg.vision, GraphBuilder()
    p, d, side, k = vc.patch_size, vc.hidden_size, vc.grid_side, cfg.pool_kernel
    e = "vision_tower."
    conv = g.op("Conv", "pixel_values", g.weight(w.t[e + "embeddings.patch_embedding.weight"], "patch_w"),
                g.const(w.f32(e + "embeddings.patch_embedding.bias"), "patch_b"),
                kernel_shape=[p, p], strides=[p, p])  # (N, D, S, S)
    x = g.op("Transpose", g.op("Reshape", conv, g.ints([0, d, -1])), perm=[0, 2, 1])  # (N, S*S, D)
    x = g.op("Add", x, g.weight(w.t[e + "embeddings.position_embedding.weight"], "pos_table"))
    for i in range(vc.num_hidden_layers):
        b = f"{e}encoder.layers.{i}."
        h = layernorm(g, w, x, b + "layer_norm1", vc.layer_norm_eps)
        q, kk, v = (heads(g, linear(g, w, h, b + f"self_attn.{n}_proj"), vc.num_attention_heads, vc.head_dim)
                    for n in ("q", "k", "v"))
        x = g.op("Add", x, linear(g, w, merge_heads(g, attention(g, q, kk, v, None, vc.head_dim)),
                                  b + "self_attn.out_proj"))
        h = layernorm(g, w, x, b + "layer_norm2", vc.layer_norm_eps)
        x = g.op("Add", x, linear(g, w, act(g, vc.hidden_act, linear(g, w, h, b + "mlp.fc1")), b + "mlp.fc2"))
    x = layernorm(g, w, x, e + "post_layernorm", vc.layer_norm_eps)
    grid = g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 1]), g.ints([0, d, side, side]))  # (N, D, S, S)
    pooled = g.op("AveragePool", grid, kernel_shape=[k, k], strides=[k, k])  # (N, D, S/k, S/k)
    x = g.op("Transpose", g.op("Reshape", pooled, g.ints([0, d, -1])), perm=[0, 2, 1])  # (N, mm_tokens, D)
    m = "multi_modal_projector."
    x = unit_offset_rmsnorm(g, w, x, m + "mm_soft_emb_norm", vc.layer_norm_eps)
    g.op("MatMul", x, g.weight(w.t[m + "mm_input_projection_weight"], "mm_proj"), out="image_features")
    inputs = [_inp("pixel_values", _F, ["n_images", vc.num_channels, vc.image_size, vc.image_size])]
    outputs = [_inp("image_features", _F, ["n_images", cfg.mm_tokens_per_image, cfg.text.hidden_size])]
    return g.model("edgevlm_gemma3_vision", inputs, outputs)


#: family name -> vision graph builder ``(tensors, config) -> ModelProto``
VISION_GRAPHS = {
    "qwen2_5_vl": build_qwen2_5_vl_vision_graph,
    "qwen3_vl": build_qwen3_vl_vision_graph,
    "smolvlm": build_smolvlm_vision_graph,
    "internvl": build_internvl_vision_graph,
    "gemma3": build_gemma3_vision_graph,
}
