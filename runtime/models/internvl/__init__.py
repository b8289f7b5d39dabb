"""InternVL (InternVL3, InternVL3.5 in the Hugging Face "-hf" layout): InternViT, pixel-shuffle MLP
projector, Qwen2 / Qwen3 decoder.

Modules: :mod:`.config` (``config.json``), :mod:`.vision` (tower + projector), :mod:`.model` (the
:class:`~edgevlm.runtime.models.base.VLMModel`), :mod:`.processor` (dynamic tiling, pixels and the
``<img>``/``<IMG_CONTEXT>``/``</img>`` prompt). Images only (several frames are several images);
InternVL's video mode (``Frame{i}:`` prompts) is not implemented, so video requests are
``INVALID_REQUEST``. Early exit and token pruning run through :mod:`edgevlm.runtime.adaptive`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.internvl.config import MODEL_TYPES, InternVLConfig, parse_config

if TYPE_CHECKING:
    from edgevlm.runtime.loader import ModelFiles
    from edgevlm.runtime.models.internvl.model import InternVLModel
    from edgevlm.runtime.models.internvl.processor import InternVLProcessor

#: checkpoint tensor name -> our parameter name (first ``re.search`` match wins; None = not needed).
#: transformers 5.x in memory and ``save_pretrained`` use the same names (``model.vision_tower.*``,
#: ``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.*``).
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"rotary_emb\.inv_freq$", None),
    (r"^(?:model\.)?vision_tower\.(.*)$", r"vision_tower.\1"),
    (r"^(?:model\.)?multi_modal_projector\.(.*)$", r"multi_modal_projector.\1"),
    (r"^(?:model\.)?language_model\.(?:model\.)?(.*)$", r"language_model.\1"),
    (r"^lm_head\.(.*)$", r"language_model.lm_head.\1"),
)


def build_model(cfg: InternVLConfig) -> InternVLModel:
    # torch is imported when a model is built, not when the registry lists the families
    from edgevlm.runtime.models.internvl.model import InternVLModel

    return InternVLModel(cfg)


def make_processor(files: ModelFiles) -> InternVLProcessor:
    from edgevlm.runtime.models.internvl.processor import InternVLProcessor

    return InternVLProcessor.from_dir(files.model_dir, files.config, files.image_processor)


def read_image_config(model_dir: Path, cfg: InternVLConfig) -> Any:
    """The checkpoint's image-processor settings, as :func:`make_processor` reads them (torch-free)."""
    from edgevlm.runtime.models.internvl.processor import InternVLProcessor

    return InternVLProcessor.read_settings(model_dir, cfg)


FAMILY = ModelFamily(
    name="internvl",
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=build_model,
    make_processor=make_processor,
    read_image_config=read_image_config,
    supports_video=False,
    max_images=8,
    adaptive_vision=True,  # exit heads + pruning on InternViT (edgevlm.runtime.adaptive)
)
