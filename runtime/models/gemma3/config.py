"""Gemma 3 configuration (Gemma 3 4B / 12B / 27B-it, ``Gemma3ForConditionalGeneration``), parsed from
``config.json`` (torch-free).

Serves ``model_type`` ``gemma3`` (transformers' ``Gemma3Config``): a SigLIP ``vision_config``
(``siglip_vision_model``: 896 px, patch 14, no CLS, no pooling head), a ``gemma3_text``
``text_config``, ``mm_tokens_per_image`` (the projector's average pool: 256 tokens per image),
``image_token_index`` (``<image_soft_token>``), ``boi_token_index`` / ``eoi_token_index``
(``<start_of_image>`` / ``<end_of_image>``) and the top-level ``tie_word_embeddings`` (default true).

The decoder is the shared one configured for Gemma 3 (:class:`~edgevlm.runtime.config.TextConfig`'s
Gemma fields): unit-offset RMSNorm, four norms per layer, q/k norm, embeddings scaled by
``sqrt(hidden_size)``, attention scale ``query_pre_attn_scalar ** -0.5``, GELU-tanh MLP
(``hidden_activation``), ``layer_types`` (sliding / full; legacy ``sliding_window_pattern``: every
6th layer full) with ``sliding_window``, RoPE per layer type: ``rope_parameters`` keyed by
``full_attention`` / ``sliding_attention`` (transformers 5) or the 4.x keys ``rope_theta`` +
``rope_scaling`` (full layers; linear factor 8 on 4B and up) and ``rope_local_base_freq`` (sliding
layers). Keys left out take the defaults of transformers 5.24's ``Gemma3TextConfig`` (the 1B-shaped
text defaults) and ``SiglipVisionConfig``. Anything the runtime cannot run raises
:class:`~edgevlm.errors.ModelLoadError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import (
    LAYER_TYPES,
    SUPPORTED_ACTIVATIONS,
    TextConfig,
    get_typed,
    parse_resolution_ladder,
    parse_text_config,
    token_id,
)
from edgevlm.runtime.models.blocks.siglip_config import SiglipVisionConfig, parse_siglip_vision_config

MODEL_TYPES = ("gemma3",)
TEXT_MODEL_TYPE = "gemma3_text"

#: transformers 5.24 ``Gemma3TextConfig`` defaults (the keys the decoder reads)
TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh",
}
#: ``Gemma3TextConfig.default_theta``: RoPE bases of the full and the sliding layers
GLOBAL_ROPE_THETA, LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0
#: ``Gemma3TextConfig``'s legacy ``sliding_window_pattern``: every 6th layer is a full one
SLIDING_WINDOW_PATTERN = 6


@dataclass(frozen=True)
class Gemma3Config:
    """A Gemma 3 checkpoint: SigLIP tower + average-pool / RMSNorm / matmul projector + Gemma 3 decoder."""

    vision: SiglipVisionConfig
    text: TextConfig
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    tie_word_embeddings: bool = True
    resolution_ladder: tuple[int, ...] = ()
    model_type: str = "gemma3"

    @property
    def video_token_id(self) -> None:
        return None

    @property
    def tokens_per_side(self) -> int:
        """Vision tokens per side of the pooled grid: ``sqrt(mm_tokens_per_image)`` (16)."""
        return round(self.mm_tokens_per_image ** 0.5)

    @property
    def pool_kernel(self) -> int:
        """Patches per side of one average-pool window: ``grid_side / tokens_per_side`` (64 / 16 = 4)."""
        return self.vision.grid_side // self.tokens_per_side

    @property
    def image_seq_len(self) -> int:
        """Vision tokens per image (``mm_tokens_per_image``)."""
        return self.mm_tokens_per_image

    @property
    def image_px(self) -> int:
        """Side of the square input the tower takes (``vision_config.image_size``)."""
        return self.vision.image_size

    @property
    def vision_blocks_needed(self) -> int:
        """ViT blocks one encoding runs (all of them: the last layer's output after ``post_layernorm``)."""
        return self.vision.num_hidden_layers

    @property
    def exit_geometry(self):
        """What the exit heads see (:class:`~edgevlm.runtime.models.base.ExitGeometry`): each image's
        per-patch states, no CLS; the adapter maps block k's states to the last block's, which
        ``post_layernorm`` and the projector read."""
        from edgevlm.runtime.models.base import ExitGeometry

        v = self.vision
        return ExitGeometry(vision_hidden_size=v.hidden_size, vision_blocks=v.num_hidden_layers,
                            feature_dim=v.hidden_size, grid_side=v.grid_side, has_cls_token=False,
                            text_hidden_size=self.text.hidden_size)


def _positive(value, key: str, w: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {w}{key} must be a positive number, got {value!r}")
    return float(value)


def _rope(tc: dict, w: str) -> tuple[dict, float]:
    """``(full layers' rope_parameters, sliding layers' RoPE base)`` from either layout."""
    params = tc.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(f"config.json: {w}rope_parameters must be an object")
    if params is not None and params and set(params) <= set(LAYER_TYPES):  # transformers 5: per layer type
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        for key, value in (("full_attention", full), ("sliding_attention", local)):
            if not isinstance(value, dict):
                raise ModelLoadError(f"config.json: {w}rope_parameters.{key} must be an object")
        full = {"rope_theta": tc.get("rope_theta", GLOBAL_ROPE_THETA), **full}
        local_theta = local.get("rope_theta", tc.get("rope_local_base_freq", LOCAL_ROPE_THETA))
        local_type = local.get("rope_type", local.get("type", "default"))
    else:  # transformers 4.x: rope_theta + rope_scaling for the full layers, rope_local_base_freq
        scaling = params or tc.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ModelLoadError(f"config.json: {w}rope_scaling must be an object or null, got {scaling!r}")
        full = dict(scaling)
        full.setdefault("rope_theta", tc.get("rope_theta", GLOBAL_ROPE_THETA))
        local_theta = tc.get("rope_local_base_freq", LOCAL_ROPE_THETA)
        local_type = "default"
    if local_type != "default":
        raise ModelLoadError(f"config.json: {w}rope_parameters.sliding_attention.rope_type {local_type!r} is not "
                             "supported (default)")
    return full, _positive(local_theta, "rope_parameters.sliding_attention.rope_theta", w)


def _layer_types(tc: dict, n_layers: int, w: str) -> tuple[str, ...]:
    kinds = tc.get("layer_types")
    if kinds is None:
        pattern = tc.get("sliding_window_pattern", tc.get("_sliding_window_pattern", SLIDING_WINDOW_PATTERN))
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ModelLoadError(f"config.json: {w}sliding_window_pattern must be a positive int, got {pattern!r}")
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers))
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_TYPES for k in kinds):
        raise ModelLoadError(f"config.json: {w}layer_types must list {n_layers} of {', '.join(LAYER_TYPES)} "
                             f"(num_hidden_layers), got {kinds!r}")
    return tuple(kinds)


def parse_gemma3_text_config(tc: dict, w: str = "text_config.") -> TextConfig:
    """The decoder of a ``gemma3_text`` config dict (:class:`TextConfig` with the Gemma 3 fields).

    Raises:
        ModelLoadError: another ``model_type``, a key of the wrong type, logit soft-capping or
            bidirectional text attention (not Gemma 3's chat models), a RoPE type other than
            'default' on the sliding layers, or ``layer_types`` that do not list every layer.
    """
    model_type = tc.get("model_type", TEXT_MODEL_TYPE)
    if model_type != TEXT_MODEL_TYPE:
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported ({TEXT_MODEL_TYPE})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if tc.get(key) is not None:
            raise ModelLoadError(f"config.json: {w}{key} {tc[key]!r} is not supported (Gemma 3 has none; null only)")
    if tc.get("use_bidirectional_attention"):
        raise ModelLoadError(f"config.json: {w}use_bidirectional_attention true is not supported "
                             "(an encoder variant; the chat models are causal)")
    merged = {**TEXT_DEFAULTS, **{k: v for k, v in tc.items() if v is not None or k == "sliding_window"}}
    act = get_typed(merged, "hidden_activation", merged.get("hidden_act", TEXT_DEFAULTS["hidden_activation"]), str, w)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_activation {act!r} is not supported")
    full_rope, local_theta = _rope(tc, w)
    view = {k: v for k, v in merged.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta",
                                                          "sliding_window", "hidden_activation", "layer_types")}
    view.update(model_type="llama", hidden_act=act, rope_parameters=full_rope)
    base = parse_text_config(view, w)
    window = merged.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ModelLoadError(f"config.json: {w}sliding_window must be a positive int or null, got {window!r}")
    scalar = _positive(merged["query_pre_attn_scalar"], "query_pre_attn_scalar", w)
    return dataclasses.replace(
        base,
        qk_norm=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=base.hidden_size ** 0.5,
        attn_scale=scalar ** -0.5,
        sliding_window=None,  # the KV cache is not bounded: the window is the sliding layers' mask
        sliding_layer_window=window,
        layer_types=_layer_types(tc, base.num_hidden_layers, w),
        sliding_rope_theta=local_theta,
    )


def parse_config(raw: dict) -> Gemma3Config:
    """Parse a Gemma 3 ``config.json`` dict.

    Raises:
        ModelLoadError: another ``model_type``, a malformed sub-config, a key of the wrong type, an
            ``mm_tokens_per_image`` that is not a square whose side divides the patch grid, a token
            id outside the vocabulary, or a decoder feature the runtime does not implement (see
            :func:`parse_gemma3_text_config`).
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(f"config.json: model_type {model_type!r} is not supported ({', '.join(MODEL_TYPES)})")
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key, {}), dict):
            raise ModelLoadError(f"config.json: {key} must be an object")
    vision = parse_siglip_vision_config(raw.get("vision_config") or {}, defaults=SiglipVisionConfig())
    if vision.vision_use_head:  # Gemma 3 reads last_hidden_state: a pooling head is never run
        vision = dataclasses.replace(vision, vision_use_head=False)
    if vision.image_size % vision.patch_size:
        raise ModelLoadError(f"config.json: vision_config.image_size {vision.image_size} is not a multiple of "
                             f"patch_size {vision.patch_size}")
    text = parse_gemma3_text_config(raw.get("text_config") or {})
    mm = get_typed(raw, "mm_tokens_per_image", 256, int, "")
    side = math.isqrt(mm) if mm > 0 else 0  # exact for any int (a 400-digit one overflows a float)
    if side < 1 or side * side != mm or vision.grid_side % side:
        raise ModelLoadError(f"config.json: mm_tokens_per_image {mm} is not a square whose side divides the "
                             f"{vision.grid_side}x{vision.grid_side} patch grid")
    ids = {}
    for key, alias, default in (("image_token_index", "image_token_id", 262144),
                                ("boi_token_index", "boi_token_id", 255999),
                                ("eoi_token_index", "eoi_token_id", 256000)):
        src = key if raw.get(key) is not None or raw.get(alias) is None else alias
        ids[key] = token_id(raw, src, default, text.vocab_size)
    return Gemma3Config(
        vision=vision,
        text=text,
        mm_tokens_per_image=mm,
        image_token_id=ids["image_token_index"],
        boi_token_id=ids["boi_token_index"],
        eoi_token_id=ids["eoi_token_index"],
        tie_word_embeddings=get_typed(raw, "tie_word_embeddings", True, bool, ""),
        resolution_ladder=parse_resolution_ladder(raw, (), min_px=vision.patch_size),
        model_type=model_type,
    )
