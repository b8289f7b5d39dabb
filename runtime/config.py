"""Model configuration of the LLaVA family, parsed from a Hugging Face ``config.json`` (torch-free).

Reads both the transformers 5.x layout (``text_config.rope_parameters``) and the legacy 4.x one
(``text_config.rope_theta`` + ``rope_scaling``, ``image_token_index``). Keys a config leaves out take
the defaults of transformers' ``LlavaConfig``, ``CLIPVisionConfig`` and ``LlamaConfig`` (the values
below are copied from those classes' documented defaults). Anything the runtime cannot run raises
:class:`~edgevlm.errors.ModelLoadError` naming the offending key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from edgevlm.errors import ModelLoadError

logger = logging.getLogger(__name__)

#: Activation names accepted for the vision MLP and the projector (transformers' ACT2FN names).
SUPPORTED_ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new", "silu", "relu")


@dataclass(frozen=True)
class VisionConfig:
    """CLIP-style ViT (``model_type: clip_vision_model``)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_side(self) -> int:
        """Patches per side of the trained (square) position-embedding grid."""
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class TextConfig:
    """Llama-family decoder (``model_type: llama``)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LlavaConfig:
    """A LLaVA checkpoint: vision tower + 2-layer MLP projector + decoder, plus edgevlm extras."""

    vision: VisionConfig
    text: TextConfig
    image_token_id: int = 32000
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    vision_feature_layer: tuple[int, ...] = (-2,)
    vision_feature_select_strategy: str = "default"
    tie_word_embeddings: bool = False
    resolution_ladder: tuple[int, ...] = ()

    @property
    def vision_feature_indices(self) -> tuple[int, ...]:
        """``vision_feature_layer`` as non-negative indices into the hidden-state list
        ``[embeddings, block_1, ..., block_L]`` (transformers' ``hidden_states`` convention)."""
        n = self.vision.num_hidden_layers + 1
        return tuple(i % n for i in self.vision_feature_layer)

    @property
    def vision_blocks_needed(self) -> int:
        """Encoder blocks that must run to produce every selected feature layer."""
        return max(self.vision_feature_indices)


def _get(d: dict, key: str, default: Any, typ: type | tuple[type, ...], where: str) -> Any:
    value = d.get(key, default)
    if value is None:
        return default
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ModelLoadError(f"config.json: {where}{key} has type {type(value).__name__}, expected {typ}")
    return value


def _int_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ModelLoadError(f"config.json: {where} must be an int or a list of ints, got {value!r}")


def _rope_theta(tc: dict) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5.x) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = tc.get("rope_parameters")
    if params is None:
        params = dict(tc.get("rope_scaling") or {})
        params.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ModelLoadError("config.json: text_config.rope_parameters must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(
            f"config.json: text_config RoPE scaling type {rope_type!r} is not supported "
            "(the runtime implements rope_type 'default' only)"
        )
    theta = params.get("rope_theta", tc.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelLoadError(f"config.json: text_config rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _vision_config(vc: dict) -> VisionConfig:
    w = "vision_config."
    model_type = vc.get("model_type", "clip_vision_model")
    if model_type != "clip_vision_model":
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported (clip_vision_model)")
    d = VisionConfig()
    cfg = VisionConfig(
        hidden_size=_get(vc, "hidden_size", d.hidden_size, int, w),
        intermediate_size=_get(vc, "intermediate_size", d.intermediate_size, int, w),
        num_hidden_layers=_get(vc, "num_hidden_layers", d.num_hidden_layers, int, w),
        num_attention_heads=_get(vc, "num_attention_heads", d.num_attention_heads, int, w),
        num_channels=_get(vc, "num_channels", d.num_channels, int, w),
        image_size=_get(vc, "image_size", d.image_size, int, w),
        patch_size=_get(vc, "patch_size", d.patch_size, int, w),
        hidden_act=_get(vc, "hidden_act", d.hidden_act, str, w),
        layer_norm_eps=_get(vc, "layer_norm_eps", d.layer_norm_eps, float, w),
    )
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_act {cfg.hidden_act!r} is not supported")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ModelLoadError(f"config.json: {w}hidden_size is not a multiple of num_attention_heads")
    if cfg.image_size % cfg.patch_size:
        raise ModelLoadError(f"config.json: {w}image_size is not a multiple of patch_size")
    return cfg


def _text_config(tc: dict) -> TextConfig:
    w = "text_config."
    model_type = tc.get("model_type", "llama")
    if model_type != "llama":
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported (llama)")
    d = TextConfig()
    hidden = _get(tc, "hidden_size", d.hidden_size, int, w)
    heads = _get(tc, "num_attention_heads", d.num_attention_heads, int, w)
    cfg = TextConfig(
        vocab_size=_get(tc, "vocab_size", d.vocab_size, int, w),
        hidden_size=hidden,
        intermediate_size=_get(tc, "intermediate_size", d.intermediate_size, int, w),
        num_hidden_layers=_get(tc, "num_hidden_layers", d.num_hidden_layers, int, w),
        num_attention_heads=heads,
        num_key_value_heads=_get(tc, "num_key_value_heads", heads, int, w),
        head_dim=_get(tc, "head_dim", hidden // max(heads, 1), int, w),
        hidden_act=_get(tc, "hidden_act", d.hidden_act, str, w),
        max_position_embeddings=_get(tc, "max_position_embeddings", d.max_position_embeddings, int, w),
        rms_norm_eps=_get(tc, "rms_norm_eps", d.rms_norm_eps, float, w),
        rope_theta=_rope_theta(tc),
        attention_bias=_get(tc, "attention_bias", d.attention_bias, bool, w),
        mlp_bias=_get(tc, "mlp_bias", d.mlp_bias, bool, w),
        bos_token_id=tc.get("bos_token_id") if isinstance(tc.get("bos_token_id"), int) else None,
        eos_token_id=_int_list(tc.get("eos_token_id"), w + "eos_token_id"),
    )
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_act {cfg.hidden_act!r} is not supported")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelLoadError(f"config.json: {w}num_attention_heads is not a multiple of num_key_value_heads")
    if cfg.head_dim % 2:
        raise ModelLoadError(f"config.json: {w}head_dim must be even for RoPE")
    return cfg


def parse_config(raw: dict) -> LlavaConfig:
    """Parse a LLaVA ``config.json`` dict.

    Raises:
        ModelLoadError: not a LLaVA config, a missing sub-config, a wrong type, or a feature the
            runtime does not implement (RoPE scaling, another vision/text model type).
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    if raw.get("model_type") != "llava":
        raise ModelLoadError(f"config.json: model_type {raw.get('model_type')!r} is not supported (llava)")
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key), dict):
            raise ModelLoadError(f"config.json: missing key {key!r}")
    vision = _vision_config(raw["vision_config"])
    text = _text_config(raw["text_config"])
    image_token_id = raw.get("image_token_id", raw.get("image_token_index", 32000))
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < text.vocab_size:
        raise ModelLoadError(f"config.json: image_token_id {image_token_id!r} is not a token id of the vocabulary")
    layers = _int_list(raw.get("vision_feature_layer", -2), "vision_feature_layer")
    n_states = vision.num_hidden_layers + 1
    if not layers or any(not -n_states <= i < n_states for i in layers):
        raise ModelLoadError(f"config.json: vision_feature_layer {layers} is out of range for {n_states - 1} layers")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"config.json: vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
    act = _get(raw, "projector_hidden_act", "gelu", str, "")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: projector_hidden_act {act!r} is not supported")
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(raw["text_config"].get("tie_word_embeddings", False))
    extra = raw.get("edgevlm") or {}
    if not isinstance(extra, dict):
        raise ModelLoadError("config.json: edgevlm must be an object")
    ladder = extra.get("resolution_ladder") or [vision.image_size]
    if not isinstance(ladder, list) or not all(isinstance(r, int) and r > 0 for r in ladder):
        raise ModelLoadError(f"config.json: edgevlm.resolution_ladder must be a list of positive ints, got {ladder!r}")
    return LlavaConfig(
        vision=vision,
        text=text,
        image_token_id=image_token_id,
        projector_hidden_act=act,
        projector_bias=_get(raw, "multimodal_projector_bias", True, bool, ""),
        vision_feature_layer=tuple(layers),
        vision_feature_select_strategy=strategy,
        tie_word_embeddings=tie,
        resolution_ladder=tuple(sorted(set(ladder))),
    )
