"""LLaVA configuration, parsed from a Hugging Face ``config.json`` (``model_type: llava``).

A vision tower — CLIP (``clip_vision_model``) or SigLIP (``siglip_vision_model``) — a 2-layer MLP
projector and a decoder of :data:`edgevlm.runtime.config.TEXT_MODEL_TYPES` (Llama, Mistral, Qwen2,
...). Reads the transformers 5.x and the legacy 4.x layouts (``image_token_index``). Keys a config
leaves out take the defaults of transformers' ``LlavaConfig`` and ``CLIPVisionConfig`` /
``SiglipVisionConfig``. Anything the runtime cannot run raises
:class:`~edgevlm.errors.ModelLoadError` naming the offending key.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import (
    SUPPORTED_ACTIVATIONS,
    TextConfig,
    get_typed,
    int_list,
    parse_resolution_ladder,
    parse_text_config,
    token_id,
)
from edgevlm.runtime.models.blocks.siglip_config import SiglipVisionConfig, parse_siglip_vision_config
from edgevlm.runtime.models.blocks.vit_config import ViTGeometry, parse_vit_geometry

#: vision tower model types a LLaVA checkpoint may have
VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")


@dataclass(frozen=True)
class VisionConfig(ViTGeometry):
    """CLIP ViT (``model_type: clip_vision_model``): a CLS token, ``pre_layrnorm``; defaults of
    transformers' ``CLIPVisionConfig``."""

    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5


@dataclass(frozen=True)
class LlavaConfig:
    """A LLaVA checkpoint: vision tower + 2-layer MLP projector + decoder, plus edgevlm extras."""

    vision: VisionConfig | SiglipVisionConfig
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
    def vision_has_cls(self) -> bool:
        """Whether the tower prepends a CLS token (CLIP) to its patch tokens (SigLIP does not)."""
        return isinstance(self.vision, VisionConfig)

    @property
    def cls_feature(self) -> bool:
        """Whether the first vision token fed to the decoder is the tower's CLS token ('full'
        selection of a CLIP tower): token pruning keeps it."""
        return self.vision_has_cls and self.vision_feature_select_strategy == "full"

    @property
    def video_token_id(self) -> None:
        return None

    def num_vision_tokens(self, height_px: int, width_px: int) -> int:
        """Vision tokens of one image fed to the encoder at ``height_px x width_px``: the patch grid
        (floored to the patch), plus the CLS token, minus the first token for the 'default'
        selection (transformers' ``get_image_features`` drops index 0 whatever the tower)."""
        p = self.vision.patch_size
        n = (height_px // p) * (width_px // p) + int(self.vision_has_cls)
        return n - int(self.vision_feature_select_strategy == "default")

    @property
    def vision_blocks_needed(self) -> int:
        """Encoder blocks that must run to produce every selected feature layer."""
        return max(self.vision_feature_indices)

    @property
    def exit_geometry(self):
        """What the exit heads see (:class:`~edgevlm.runtime.models.base.ExitGeometry`): the
        adapter maps block k's states to the projector input, D times the selected layers."""
        from edgevlm.runtime.models.base import ExitGeometry

        return ExitGeometry(vision_hidden_size=self.vision.hidden_size, vision_blocks=self.vision_blocks_needed,
                            feature_dim=self.vision.hidden_size * len(self.vision_feature_layer),
                            grid_side=self.vision.grid_side, has_cls_token=self.vision_has_cls,
                            text_hidden_size=self.text.hidden_size, cls_feature=self.cls_feature)


def _vision_config(vc: dict) -> VisionConfig | SiglipVisionConfig:
    w = "vision_config."
    model_type = vc.get("model_type", "clip_vision_model")
    if model_type not in VISION_MODEL_TYPES:
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported "
                             f"({', '.join(VISION_MODEL_TYPES)})")
    if model_type == "siglip_vision_model":  # image_size need not be a multiple of patch_size (floored)
        return parse_siglip_vision_config(vc, where=w)
    d = VisionConfig()
    cfg = VisionConfig(**parse_vit_geometry(vc, d, w))
    if cfg.image_size % cfg.patch_size:
        raise ModelLoadError(f"config.json: {w}image_size is not a multiple of patch_size")
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
    text = parse_text_config(raw["text_config"])
    image_token_id = token_id(raw, "image_token_id", raw.get("image_token_index", 32000), text.vocab_size)
    layers = int_list(raw.get("vision_feature_layer", -2), "vision_feature_layer")
    n_states = vision.num_hidden_layers + 1
    if not layers or any(not -n_states <= i < n_states for i in layers):
        raise ModelLoadError(f"config.json: vision_feature_layer {layers} is out of range for {n_states - 1} layers")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"config.json: vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
    act = get_typed(raw, "projector_hidden_act", "gelu", str, "")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: projector_hidden_act {act!r} is not supported")
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(raw["text_config"].get("tie_word_embeddings", False))
    ladder = parse_resolution_ladder(raw, (vision.image_size,), min_px=vision.patch_size)
    return LlavaConfig(
        vision=vision,
        text=text,
        image_token_id=image_token_id,
        projector_hidden_act=act,
        projector_bias=get_typed(raw, "multimodal_projector_bias", True, bool, ""),
        vision_feature_layer=tuple(layers),
        vision_feature_select_strategy=strategy,
        tie_word_embeddings=tie,
        resolution_ladder=ladder,
    )
