"""Qwen2.5-VL configuration, parsed from a Hugging Face ``config.json`` (``model_type: qwen2_5_vl``).

Reads the transformers 5.x layout (``text_config`` + ``vision_config``) and the hub's 4.x one (decoder
keys at the top level, ``rope_scaling: {"type": "mrope", "mrope_section": ...}``, ``in_chans``). Keys
left out take the defaults of transformers' ``Qwen2_5_VLVisionConfig`` / ``Qwen2_5_VLTextConfig``.
A key the runtime cannot run raises :class:`~edgevlm.errors.ModelLoadError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import (
    SUPPORTED_ACTIVATIONS,
    parse_resolution_ladder,
    parse_text_config,
)
from edgevlm.runtime.models.qwen_vl.config import QwenVLConfig, check_rotary_heads, vision_rope_theta
from edgevlm.runtime.models.qwen_vl.tokens import parse_vision_token_ids

#: transformers' ``Qwen2_5_VLTextConfig`` keys that are decoder keys (the 4.x top-level layout).
_LEGACY_TEXT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "use_sliding_window",
    "sliding_window", "max_window_layers", "rope_parameters", "rope_scaling", "rope_theta", "bos_token_id",
    "eos_token_id", "attention_dropout", "tie_word_embeddings",
)


@dataclass(frozen=True)
class Qwen25VisionConfig:
    """The Qwen2.5-VL ViT (``vision_config``); defaults of transformers' ``Qwen2_5_VLVisionConfig``."""

    depth: int = 32
    hidden_size: int = 3584
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 4
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6  # fixed in transformers' vision blocks and merger

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_units(self) -> int:
        """Window side in merged units (``window_size / patch_size / spatial_merge_size``)."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True)
class Qwen25VLConfig(QwenVLConfig):
    """A Qwen2.5-VL checkpoint: ViT + 2x2 patch merger + Qwen2 decoder with M-RoPE."""

    vision: Qwen25VisionConfig

    @property
    def exit_geometry(self):
        """What the exit heads see (:class:`~edgevlm.runtime.models.base.ExitGeometry`): per-patch
        states, no CLS; the adapter maps block k's states to the last block's, which the 2x2
        merger reads. No trained position grid: the heads' scale is relative to one attention
        window (``window_size / patch_size`` patches a side)."""
        from edgevlm.runtime.models.base import ExitGeometry

        v = self.vision
        return ExitGeometry(vision_hidden_size=v.hidden_size, vision_blocks=v.depth, feature_dim=v.hidden_size,
                            grid_side=max(1, v.window_size // v.patch_size), has_cls_token=False,
                            text_hidden_size=self.text.hidden_size)


def _int(d: dict, key: str, default: int, where: str, minimum: int = 1) -> int:
    value = d.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ModelLoadError(f"config.json: {where}{key} must be an int >= {minimum}, got {value!r}")
    return value


def _positive(d: dict, key: str, default: float, where: str) -> float:
    value = d.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {where}{key} must be a positive number, got {value!r}")
    return float(value)


def _vision_config(vc: dict) -> Qwen25VisionConfig:
    w = "vision_config."
    mt = vc.get("model_type", "qwen2_5_vl_vision")
    if mt not in ("qwen2_5_vl_vision", "qwen2_5_vl"):
        raise ModelLoadError(f"config.json: {w}model_type {mt!r} is not supported (qwen2_5_vl_vision)")
    d = Qwen25VisionConfig()
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(vc.get(key), list):
            raise ModelLoadError(f"config.json: {w}{key} must be one int (non-square patches are not supported)")
    cfg = Qwen25VisionConfig(
        depth=_int(vc, "depth", d.depth, w),
        hidden_size=_int(vc, "hidden_size", d.hidden_size, w),
        hidden_act=vc.get("hidden_act", d.hidden_act),
        intermediate_size=_int(vc, "intermediate_size", d.intermediate_size, w),
        num_heads=_int(vc, "num_heads", d.num_heads, w),
        in_channels=_int(vc, "in_channels", _int(vc, "in_chans", d.in_channels, w), w),
        patch_size=_int(vc, "patch_size", d.patch_size, w),
        spatial_merge_size=_int(vc, "spatial_merge_size", d.spatial_merge_size, w),
        temporal_patch_size=_int(vc, "temporal_patch_size", d.temporal_patch_size, w),
        tokens_per_second=_positive(vc, "tokens_per_second", d.tokens_per_second, w),
        window_size=_int(vc, "window_size", d.window_size, w),
        out_hidden_size=_int(vc, "out_hidden_size", d.out_hidden_size, w),
        fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes", d.fullatt_block_indexes) or ()),
        rope_theta=vision_rope_theta(vc, d.rope_theta, w),
    )
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_act {cfg.hidden_act!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    check_rotary_heads(cfg.hidden_size, cfg.num_heads, w)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.depth
               for i in cfg.fullatt_block_indexes):
        raise ModelLoadError(f"config.json: {w}fullatt_block_indexes {list(cfg.fullatt_block_indexes)} "
                             f"must be block indexes below depth {cfg.depth}")
    if cfg.window_units < 1:
        raise ModelLoadError(f"config.json: {w}window_size {cfg.window_size} is smaller than one merged patch "
                             f"({cfg.patch_size * cfg.spatial_merge_size} px)")
    return cfg


def _text_dict(raw: dict) -> tuple[dict, str]:
    tc = raw.get("text_config")
    if tc is None:  # transformers 4.x / hub layout: decoder keys at the top level
        tc, where = {k: raw[k] for k in _LEGACY_TEXT_KEYS if k in raw}, ""
    elif not isinstance(tc, dict):
        raise ModelLoadError("config.json: text_config must be an object")
    else:
        where = "text_config."
    mt = tc.get("model_type", "qwen2_5_vl_text")
    if mt not in ("qwen2_5_vl_text", "qwen2_5_vl"):
        raise ModelLoadError(f"config.json: {where}model_type {mt!r} is not supported (qwen2_5_vl_text)")
    tc = dict(tc, model_type="qwen2_5_vl_text")
    params = tc.get("rope_parameters", tc.get("rope_scaling"))
    if params is None:  # transformers' default_theta for this family, not Llama's 10000
        tc["rope_theta"] = tc.get("rope_theta", 1000000.0)
    return tc, where


def parse_config(raw: dict) -> Qwen25VLConfig:
    """Parse a Qwen2.5-VL ``config.json`` dict.

    Raises:
        ModelLoadError: another model type, a wrong type or value (the message names the key), no
            ``mrope_section``, or a feature the runtime does not implement.
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    if raw.get("model_type") != "qwen2_5_vl":
        raise ModelLoadError(f"config.json: model_type {raw.get('model_type')!r} is not supported (qwen2_5_vl)")
    vc = raw.get("vision_config")
    if not isinstance(vc, dict):
        raise ModelLoadError("config.json: missing key 'vision_config'")
    vision = _vision_config(vc)
    tc, where = _text_dict(raw)
    text = parse_text_config(tc, where)
    if text.mrope_section is None:
        raise ModelLoadError(f"config.json: {where}rope_parameters.mrope_section is missing (Qwen2.5-VL uses M-RoPE)")
    if text.mrope_interleaved:
        raise ModelLoadError(f"config.json: {where}rope_parameters.mrope_interleaved is not Qwen2.5-VL's layout")
    if text.sliding_window is not None:
        raise ModelLoadError(f"config.json: {where}use_sliding_window is not supported")
    if vision.out_hidden_size != text.hidden_size:
        raise ModelLoadError(f"config.json: vision_config.out_hidden_size {vision.out_hidden_size} differs from "
                             f"the decoder's hidden_size {text.hidden_size}")
    tokens = parse_vision_token_ids(raw, text.vocab_size)
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(tc.get("tie_word_embeddings", False))
    ladder = parse_resolution_ladder(raw, (), min_px=vision.patch_size)
    return Qwen25VLConfig(vision=vision, text=text, tie_word_embeddings=tie,
                          resolution_ladder=ladder, tokens=tokens)
