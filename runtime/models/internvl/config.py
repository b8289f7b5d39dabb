"""InternVL configuration (InternVL3 / InternVL3.5 in the Hugging Face "-hf" layout), parsed from
``config.json`` (torch-free).

Serves ``model_type`` ``internvl`` (transformers' ``InternVLConfig``): an InternViT
``vision_config`` (``internvl_vision``: a CLS token, absolute position embeddings, layer scale,
LayerNorm or RMSNorm blocks, optional q/k RMSNorm), a ``text_config`` decoder (Qwen2 in InternVL3,
Qwen3 in InternVL3.5; Llama for InternLM-based ones), ``downsample_ratio`` (the pixel shuffle's,
0.5 = 2 x 2 patches per token), ``vision_feature_layer`` / ``vision_feature_select_strategy``,
``projector_hidden_act`` and ``image_token_id`` (``<IMG_CONTEXT>``). Keys left out take the
defaults of transformers 5.24's ``InternVLConfig`` / ``InternVLVisionConfig``; tied embeddings
follow the top-level ``tie_word_embeddings`` (default true), as ``InternVLForConditionalGeneration``
ties them. Anything the runtime cannot run raises :class:`~edgevlm.errors.ModelLoadError` naming
the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import (
    SUPPORTED_ACTIVATIONS,
    TextConfig,
    get_typed,
    parse_resolution_ladder,
    parse_text_config,
    token_id,
)
from edgevlm.runtime.models.blocks.vit_config import ViTGeometry, parse_vit_geometry

MODEL_TYPES = ("internvl",)
VISION_MODEL_TYPE = "internvl_vision"
NORM_TYPES = ("layer_norm", "rms_norm")


@dataclass(frozen=True)
class InternVisionConfig(ViTGeometry):
    """InternViT (``vision_config``), defaults of transformers' ``InternVLVisionConfig`` (InternViT-300M).

    ``image_size`` / ``patch_size`` are square (one int; a ``[h, w]`` pair must have equal sides).
    ``qk_norm_eps`` is the q/k RMSNorm's epsilon, which transformers fixes at 1e-6 whatever
    ``layer_norm_eps`` is.
    """

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    image_size: int = 448
    patch_size: int = 14
    hidden_act: str = "gelu"
    norm_type: str = "layer_norm"
    attention_bias: bool = False
    use_qk_norm: bool = False
    use_mean_pooling: bool = True
    qk_norm_eps: float = 1e-6


@dataclass(frozen=True)
class InternVLConfig:
    """An InternVL checkpoint: InternViT + pixel shuffle + MLP projector + decoder."""

    vision: InternVisionConfig
    text: TextConfig
    image_token_id: int = 151667
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int = -1
    vision_feature_select_strategy: str = "default"
    tie_word_embeddings: bool = True
    resolution_ladder: tuple[int, ...] = ()
    model_type: str = "internvl"

    @property
    def video_token_id(self) -> None:
        return None

    @property
    def scale_factor(self) -> int:
        """Patches merged per side by the pixel shuffle: ``int(1 / downsample_ratio)``."""
        return int(round(1 / self.downsample_ratio))

    @property
    def image_seq_len(self) -> int:
        """Vision tokens per tile: ``(grid_side / scale_factor)^2`` (256 for 448 px, patch 14)."""
        return (self.vision.grid_side // self.scale_factor) ** 2

    @property
    def feature_index(self) -> int:
        """``vision_feature_layer`` as an index into ``[embeddings, block_1, ..., block_L]``; -1 means
        the last block's output after the tower's final norm (``last_hidden_state``)."""
        return self.vision_feature_layer % (self.vision.num_hidden_layers + 1)

    @property
    def vision_blocks_needed(self) -> int:
        """ViT blocks one encoding runs."""
        return self.feature_index

    @property
    def tile_px(self) -> int:
        return self.vision.image_size

    @property
    def exit_geometry(self):
        """What the exit heads see (:class:`~edgevlm.runtime.models.base.ExitGeometry`): each tile's
        states, CLS first; the adapter maps block k's states to those of the feature block, which the
        final norm, the pixel shuffle and the projector read (the CLS token is not a vision token)."""
        from edgevlm.runtime.models.base import ExitGeometry

        v = self.vision
        return ExitGeometry(vision_hidden_size=v.hidden_size, vision_blocks=self.feature_index,
                            feature_dim=v.hidden_size, grid_side=v.grid_side, has_cls_token=True,
                            text_hidden_size=self.text.hidden_size)


def _square(value, key: str, default: int, w: str) -> int:
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ModelLoadError(f"config.json: {w}{key} {list(value)} is not square (only square tiles are supported)")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {w}{key} must be a positive int, got {value!r}")
    return value


def _vision_config(vc: dict) -> InternVisionConfig:
    w = "vision_config."
    model_type = vc.get("model_type", VISION_MODEL_TYPE)
    if model_type != VISION_MODEL_TYPE:
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported ({VISION_MODEL_TYPE})")
    d = InternVisionConfig()
    cfg = InternVisionConfig(
        **parse_vit_geometry(vc, d, w, image_size=_square(vc.get("image_size"), "image_size", d.image_size, w),
                             patch_size=_square(vc.get("patch_size"), "patch_size", d.patch_size, w)),
        norm_type=get_typed(vc, "norm_type", d.norm_type, str, w),
        attention_bias=get_typed(vc, "attention_bias", d.attention_bias, bool, w),
        use_qk_norm=get_typed(vc, "use_qk_norm", d.use_qk_norm, bool, w),
        use_mean_pooling=get_typed(vc, "use_mean_pooling", d.use_mean_pooling, bool, w),
    )
    if cfg.norm_type not in NORM_TYPES:
        raise ModelLoadError(f"config.json: {w}norm_type {cfg.norm_type!r} is not supported ({', '.join(NORM_TYPES)})")
    if cfg.image_size % cfg.patch_size:
        raise ModelLoadError(f"config.json: {w}image_size {cfg.image_size} is not a multiple of patch_size "
                             f"{cfg.patch_size}")
    if vc.get("use_absolute_position_embeddings", True) is not True:
        raise ModelLoadError(f"config.json: {w}use_absolute_position_embeddings false is not supported")
    if vc.get("use_mask_token", False):
        raise ModelLoadError(f"config.json: {w}use_mask_token is not supported (a pre-training option)")
    return cfg


def parse_config(raw: dict) -> InternVLConfig:
    """Parse an InternVL ``config.json`` dict.

    Raises:
        ModelLoadError: another ``model_type``, a malformed sub-config, a key of the wrong type, a
            ``downsample_ratio`` whose inverse is not an integer dividing the patch grid, an
            ``image_token_id`` outside the vocabulary, a ``vision_feature_layer`` out of range or a
            list of layers, an unknown select strategy or activation, or a decoder feature the
            runtime does not implement.
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(f"config.json: model_type {model_type!r} is not supported ({', '.join(MODEL_TYPES)})")
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key, {}), dict):
            raise ModelLoadError(f"config.json: {key} must be an object")
    vision = _vision_config(raw.get("vision_config") or {})
    tc = dict(raw.get("text_config") or {})
    tc.setdefault("model_type", "qwen2")  # InternVLConfig's default text config
    text = parse_text_config(tc)
    ratio = raw.get("downsample_ratio", 0.5)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise ModelLoadError(f"config.json: downsample_ratio must be a number in (0, 1], got {ratio!r}")
    scale = round(1 / ratio)
    if abs(scale * ratio - 1) > 1e-9 or vision.grid_side % scale:
        raise ModelLoadError(f"config.json: downsample_ratio {ratio} does not merge whole patches of the "
                             f"{vision.grid_side}x{vision.grid_side} grid (1 / ratio must be an integer dividing it)")
    image_token_id = token_id(raw, "image_token_id", 151667, text.vocab_size)
    layer = raw.get("vision_feature_layer", -1)
    n_states = vision.num_hidden_layers + 1
    if not isinstance(layer, int) or isinstance(layer, bool) or not -n_states <= layer < n_states:
        raise ModelLoadError(f"config.json: vision_feature_layer {layer!r} is not supported (one int in "
                             f"[-{n_states}, {n_states - 1}])")
    if layer % n_states == 0:
        raise ModelLoadError(f"config.json: vision_feature_layer {layer} selects the patch embeddings (no block)")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"config.json: vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
    if strategy == "full":
        raise ModelLoadError("config.json: vision_feature_select_strategy 'full' is not supported (the CLS token "
                             "does not fit the pixel shuffle's square grid)")
    act = get_typed(raw, "projector_hidden_act", "gelu", str, "")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: projector_hidden_act {act!r} is not supported")
    return InternVLConfig(
        vision=vision,
        text=text,
        image_token_id=image_token_id,
        downsample_ratio=float(ratio),
        projector_hidden_act=act,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        tie_word_embeddings=get_typed(raw, "tie_word_embeddings", True, bool, ""),
        resolution_ladder=parse_resolution_ladder(raw, (), min_px=vision.patch_size),
        model_type=model_type,
    )
