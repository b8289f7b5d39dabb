"""SmolVLM / Idefics3 model configuration, parsed from a Hugging Face ``config.json`` (torch-free).

Serves ``model_type`` ``smolvlm`` (SmolVLM, SmolVLM2) and ``idefics3`` (Idefics3, the same layout):
a SigLIP-style ``vision_config`` (``smolvlm_vision`` / ``idefics3_vision``), a Llama ``text_config``
(SmolLM2 / Llama-3), ``scale_factor`` (the pixel-shuffle connector's) and ``image_token_id``. Keys left
out take the defaults of transformers' ``SmolVLMConfig`` / ``Idefics3Config`` and their vision configs
(the values below are those classes' documented defaults). Anything the runtime cannot run raises
:class:`~edgevlm.errors.ModelLoadError` naming the key.

Tied embeddings follow transformers 5: the top-level ``tie_word_embeddings`` decides (a
``text_config.tie_word_embeddings`` alone does not tie ``lm_head`` in ``SmolVLMForConditionalGeneration``).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import TextConfig, get_typed, parse_resolution_ladder, parse_text_config, token_id
from edgevlm.runtime.models.blocks.siglip_config import SiglipVisionConfig, parse_siglip_vision_config

MODEL_TYPES = ("smolvlm", "idefics3")
VISION_MODEL_TYPES = ("smolvlm_vision", "idefics3_vision")

#: transformers' SmolVLMVisionConfig / Idefics3VisionConfig defaults (no pooling head)
_VISION_DEFAULTS = SiglipVisionConfig(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=16, image_size=224, patch_size=32,
                                      hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False)
#: SmolVLMConfig's default image_token_id / scale_factor, per model_type
_DEFAULT_IMAGE_TOKEN_ID = {"smolvlm": 128257, "idefics3": 128257}
_DEFAULT_SCALE_FACTOR = {"smolvlm": 2, "idefics3": 2}


@dataclass(frozen=True)
class SmolVLMConfig:
    """A SmolVLM checkpoint: SigLIP-style tower + pixel-shuffle connector + Llama decoder."""

    vision: SiglipVisionConfig
    text: TextConfig
    scale_factor: int = 2
    image_token_id: int = 128257
    video_token_id: int | None = None
    tie_word_embeddings: bool = False
    resolution_ladder: tuple[int, ...] = ()
    model_type: str = "smolvlm"

    @property
    def image_seq_len(self) -> int:
        """Vision tokens per tile: ``(image_size / patch_size)^2 / scale_factor^2`` (transformers'
        ``SmolVLMModel.image_seq_len``)."""
        return self.vision.num_positions // (self.scale_factor**2)

    @property
    def vision_blocks_needed(self) -> int:
        """ViT blocks one encoding runs (all of them)."""
        return self.vision.num_hidden_layers

    @property
    def exit_geometry(self):
        """What the exit heads see (:class:`~edgevlm.runtime.models.base.ExitGeometry`): per-patch
        states of each tile, no CLS; the adapter maps block k's states to the last block's, which
        the post-layernorm and the pixel-shuffle connector read."""
        from edgevlm.runtime.models.base import ExitGeometry

        v = self.vision
        return ExitGeometry(vision_hidden_size=v.hidden_size, vision_blocks=v.num_hidden_layers,
                            feature_dim=v.hidden_size, grid_side=v.grid_side, has_cls_token=False,
                            text_hidden_size=self.text.hidden_size)

    @property
    def tile_px(self) -> int:
        """Side of one square tile the encoder takes (``vision_config.image_size``)."""
        return self.vision.image_size


def parse_config(raw: dict) -> SmolVLMConfig:
    """Parse a SmolVLM / Idefics3 ``config.json`` dict.

    Raises:
        ModelLoadError: another ``model_type``, a missing or malformed sub-config, a key of the wrong
            type, a ``scale_factor`` that does not divide the patch grid, an ``image_token_id`` outside
            the vocabulary, or a text feature the runtime does not implement (RoPE scaling).
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(f"config.json: model_type {model_type!r} is not supported ({', '.join(MODEL_TYPES)})")
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key, {}), dict):
            raise ModelLoadError(f"config.json: {key} must be an object")
    vision = parse_siglip_vision_config(raw.get("vision_config") or {}, model_types=VISION_MODEL_TYPES,
                                        defaults=_VISION_DEFAULTS)
    if vision.vision_use_head:
        vision = SiglipVisionConfig(**{**vision.__dict__, "vision_use_head": False})
    # an image_size that is not a multiple of the patch (SmolVLM2-2.2B: 384 px, patch 14) is floored to
    # whole patches (27 x 27), as transformers' Idefics3 vision embeddings do (vision.grid_side)
    tc = dict(raw.get("text_config") or {})
    tc.setdefault("model_type", "llama")
    tc.setdefault("rms_norm_eps", 1e-5)  # SmolVLMConfig builds its default text config with this eps
    text = parse_text_config(tc)
    scale = get_typed(raw, "scale_factor", _DEFAULT_SCALE_FACTOR[model_type], int, "")
    if scale <= 0 or vision.grid_side % scale:
        raise ModelLoadError(
            f"config.json: scale_factor {scale} does not divide the {vision.grid_side}x{vision.grid_side} patch grid "
            "(vision_config.image_size / patch_size)"
        )
    image_token_id = token_id(raw, "image_token_id", _DEFAULT_IMAGE_TOKEN_ID[model_type], text.vocab_size)
    ladder = parse_resolution_ladder(raw, (), min_px=vision.patch_size)
    return SmolVLMConfig(
        vision=vision,
        text=text,
        scale_factor=scale,
        image_token_id=image_token_id,
        tie_word_embeddings=get_typed(raw, "tie_word_embeddings", False, bool, ""),
        resolution_ladder=ladder,
        model_type=model_type,
    )
