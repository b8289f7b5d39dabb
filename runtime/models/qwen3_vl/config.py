"""Qwen3-VL configuration, parsed from a Hugging Face ``config.json`` (torch-free).

Layout: transformers' ``Qwen3VLConfig`` (``model_type: qwen3_vl``) with a ``vision_config``
(``Qwen3VLVisionConfig``) and a ``text_config`` (``Qwen3VLTextConfig``: a Qwen3 decoder with per-head
q/k RMSNorm, an explicit ``head_dim`` and interleaved multimodal RoPE). Both RoPE spellings are read:
transformers 5.x ``rope_parameters`` and the 4.x ``rope_theta`` + ``rope_scaling`` that the hub's
Qwen3-VL checkpoints ship. Keys a config leaves out take the defaults of those transformers classes.
Anything the runtime cannot run raises :class:`~edgevlm.errors.ModelLoadError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import (
    SUPPORTED_ACTIVATIONS,
    TextConfig,
    get_typed,
    parse_resolution_ladder,
    parse_text_config,
)
from edgevlm.runtime.models.qwen_vl.config import QwenVLConfig, check_rotary_heads, vision_rope_theta
from edgevlm.runtime.models.qwen_vl.tokens import parse_vision_token_ids

MODEL_TYPES = ("qwen3_vl",)


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    """The Qwen3-VL ViT: Conv3d patches, learned position embeddings resampled to the grid, 2-D
    rotary attention, a 2x2 patch merger, DeepStack mergers after ``deepstack_visual_indexes``."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the square learned position-embedding grid (``sqrt(num_position_embeddings)``)."""
        return int(self.num_position_embeddings**0.5)

    @property
    def merged_patch_px(self) -> int:
        """Pixels per side of one vision token (``patch_size * spatial_merge_size``; 32 for Qwen3-VL)."""
        return self.patch_size * self.spatial_merge_size


@dataclass(frozen=True)
class Qwen3VLConfig(QwenVLConfig):
    """A Qwen3-VL checkpoint (the contract's family config: ``.text``, ``.image_token_id``, ...)."""

    vision: Qwen3VLVisionConfig

    @property
    def exit_geometry(self):
        """What the exit heads see (:class:`~edgevlm.runtime.models.base.ExitGeometry`): per-patch
        states, no CLS; the adapter maps block k's states to the last block's, which the merger
        (and the DeepStack mergers past k) read."""
        from edgevlm.runtime.models.base import ExitGeometry

        v = self.vision
        return ExitGeometry(vision_hidden_size=v.hidden_size, vision_blocks=v.depth, feature_dim=v.hidden_size,
                            grid_side=v.grid_side, has_cls_token=False, text_hidden_size=self.text.hidden_size)


def _int_tuple(value: Any, key: str) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ModelLoadError(f"config.json: {key} must be a list of ints, got {value!r}")


def _vision_config(vc: dict) -> Qwen3VLVisionConfig:
    w = "vision_config."
    d = Qwen3VLVisionConfig()
    model_type = vc.get("model_type", "qwen3_vl_vision")
    if model_type not in ("qwen3_vl_vision", "qwen3_vl"):  # the hub's configs say "qwen3_vl" here
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported (qwen3_vl_vision)")
    ints = {k: get_typed(vc, k, getattr(d, k), int, w) for k in (
        "depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings")}
    if any(v <= 0 for v in ints.values()):
        bad = next(k for k, v in ints.items() if v <= 0)
        raise ModelLoadError(f"config.json: {w}{bad} must be positive, got {ints[bad]}")
    cfg = Qwen3VLVisionConfig(
        **ints,
        hidden_act=get_typed(vc, "hidden_act", d.hidden_act, str, w),
        deepstack_visual_indexes=_int_tuple(vc.get("deepstack_visual_indexes", list(d.deepstack_visual_indexes)),
                                            w + "deepstack_visual_indexes"),
        rope_theta=vision_rope_theta(vc, d.rope_theta, w),
    )
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_act {cfg.hidden_act!r} is not supported")
    check_rotary_heads(cfg.hidden_size, cfg.num_heads, w)
    if cfg.grid_side**2 != cfg.num_position_embeddings:
        raise ModelLoadError(f"config.json: {w}num_position_embeddings {cfg.num_position_embeddings} is not a square")
    bad = [i for i in cfg.deepstack_visual_indexes if not 0 <= i < cfg.depth]
    if bad or len(set(cfg.deepstack_visual_indexes)) != len(cfg.deepstack_visual_indexes):
        raise ModelLoadError(
            f"config.json: {w}deepstack_visual_indexes {list(cfg.deepstack_visual_indexes)} must be distinct "
            f"block indexes below depth {cfg.depth}")
    return cfg


def _text_config(tc: dict) -> TextConfig:
    """The Qwen3 decoder through the shared parser; Qwen3-VL's M-RoPE must be the interleaved layout."""
    w = "text_config."
    model_type = tc.get("model_type", "qwen3_vl_text")
    if model_type != "qwen3_vl_text":
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported (qwen3_vl_text)")
    params = tc.get("rope_parameters")
    if params is None:  # transformers 4.x spelling, as the hub's Qwen3-VL checkpoints ship it
        params = tc.get("rope_scaling")
    params = params if isinstance(params, dict) else {}
    if "mrope_section" not in params:
        raise ModelLoadError(f"config.json: {w}rope_parameters.mrope_section is missing (Qwen3-VL uses M-RoPE)")
    if "rope_theta" not in params and "rope_theta" not in tc:
        tc = {**tc, "rope_theta": 500000.0}  # Qwen3VLTextConfig.default_theta
    text = parse_text_config(tc, w)
    if not text.mrope_interleaved or len(text.mrope_section) != 3:
        raise ModelLoadError(f"config.json: {w}rope_parameters must set mrope_interleaved true with a 3-axis "
                             f"mrope_section (Qwen3-VL's layout), got {params!r}")
    return text


def parse_config(raw: dict) -> Qwen3VLConfig:
    """Parse a Qwen3-VL ``config.json`` dict.

    Raises:
        ModelLoadError: not a Qwen3-VL config, a missing sub-config, a wrong type, or an option the
            runtime does not implement, with the offending key in the message.
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    if raw.get("model_type") not in MODEL_TYPES:
        raise ModelLoadError(f"config.json: model_type {raw.get('model_type')!r} is not supported (qwen3_vl)")
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key), dict):
            raise ModelLoadError(f"config.json: missing key {key!r}")
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(raw["text_config"].get("tie_word_embeddings", False))
    vision = _vision_config(raw["vision_config"])
    text = _text_config(raw["text_config"])
    if vision.out_hidden_size != text.hidden_size:
        raise ModelLoadError(
            f"config.json: vision_config.out_hidden_size {vision.out_hidden_size} != text_config.hidden_size "
            f"{text.hidden_size}")
    if len(vision.deepstack_visual_indexes) > text.num_hidden_layers:
        raise ModelLoadError("config.json: vision_config.deepstack_visual_indexes has more entries than decoder layers")
    tokens = parse_vision_token_ids(raw, text.vocab_size)
    ladder = parse_resolution_ladder(raw, (), min_px=vision.patch_size)
    return Qwen3VLConfig(vision=vision, text=text, tie_word_embeddings=tie,
                         resolution_ladder=ladder, tokens=tokens)
