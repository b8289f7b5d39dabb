"""Gemma 3 (Gemma 3 4B / 12B / 27B-it, ``Gemma3ForConditionalGeneration``): SigLIP tower, average-pool
projector, Gemma 3 decoder (interleaved sliding-window / full attention).

Modules: :mod:`.config` (``config.json``), :mod:`.vision` (tower + projector), :mod:`.model` (the
:class:`~edgevlm.runtime.models.base.VLMModel`), :mod:`.processor` (896 px pixels and the
``<start_of_image>`` prompt). Images only (several frames are several images, up to 8); pan-and-scan
is not implemented. Early exit and token pruning run through :mod:`edgevlm.runtime.adaptive`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.gemma3.config import MODEL_TYPES, Gemma3Config, parse_config

if TYPE_CHECKING:
    from edgevlm.runtime.loader import ModelFiles
    from edgevlm.runtime.models.gemma3.model import Gemma3Model
    from edgevlm.runtime.models.gemma3.processor import Gemma3Processor

#: checkpoint tensor name -> our parameter name (first ``re.search`` match wins; None = not needed).
#: transformers 5 saves ``vision_tower.*``, ``multi_modal_projector.*`` and ``language_model.model.*``
#: (in memory ``model.``-prefixed); the hub's 4.x checkpoints ``vision_tower.vision_model.*``.
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"rotary_emb\.", None),
    (r"embeddings\.position_ids$", None),
    (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?head\.", None),  # a SigLIP pooling head: never run
    (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$", r"vision_tower.\1"),
    (r"^(?:model\.)?multi_modal_projector\.(.*)$", r"multi_modal_projector.\1"),
    (r"^(?:model\.)?language_model\.lm_head\.(.*)$", r"language_model.lm_head.\1"),
    (r"^(?:model\.)?language_model\.(?:model\.)?(.*)$", r"language_model.\1"),
    (r"^lm_head\.(.*)$", r"language_model.lm_head.\1"),
)


def build_model(cfg: Gemma3Config) -> Gemma3Model:
    # torch is imported when a model is built, not when the registry lists the families
    from edgevlm.runtime.models.gemma3.model import Gemma3Model

    return Gemma3Model(cfg)


def make_processor(files: ModelFiles) -> Gemma3Processor:
    from edgevlm.runtime.models.gemma3.processor import Gemma3Processor

    return Gemma3Processor.from_dir(files.model_dir, files.config, files.image_processor)


def read_image_config(model_dir: Path, cfg: Gemma3Config) -> Any:
    """The checkpoint's image-processor settings, as :func:`make_processor` reads them (torch-free)."""
    from edgevlm.runtime.models.gemma3.processor import Gemma3Processor

    return Gemma3Processor.read_settings(model_dir, cfg)


FAMILY = ModelFamily(
    name="gemma3",
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=build_model,
    make_processor=make_processor,
    read_image_config=read_image_config,
    supports_video=False,
    max_images=8,
    adaptive_vision=True,  # exit heads + pruning on the SigLIP tower (edgevlm.runtime.adaptive)
)
