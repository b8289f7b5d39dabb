"""SmolVLM / SmolVLM2 / Idefics3: SigLIP-style tower, pixel-shuffle connector, SmolLM2 (Llama) decoder.

The family of the smallest robots (Orin Nano class). Modules: :mod:`.config` (``config.json``),
:mod:`.vision` (tower + connector), :mod:`.model` (the :class:`~edgevlm.runtime.models.base.VLMModel`),
:mod:`.processor` (tiling, pixels and the row/column prompt). Images only: SmolVLM2's video mode
(frames as images with timestamps) is not implemented, so video requests are ``INVALID_REQUEST``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.smolvlm.config import MODEL_TYPES, SmolVLMConfig, parse_config

if TYPE_CHECKING:
    from edgevlm.runtime.loader import ModelFiles
    from edgevlm.runtime.models.smolvlm.model import SmolVLMModel
    from edgevlm.runtime.models.smolvlm.processor import SmolVLMProcessor

#: checkpoint tensor name -> our parameter name (first ``re.search`` match wins; None = not needed).
#: transformers 4.x and 5.x save SmolVLM / Idefics3 under the same names.
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"^(model\.)?vision_model\.embeddings\.position_ids$", None),
    (r"rotary_emb\.inv_freq$", None),
    (r"^model\.vision_model\.(.*)$", r"vision_model.\1"),
    (r"^model\.connector\.(.*)$", r"connector.\1"),
    (r"^model\.text_model\.(.*)$", r"language_model.\1"),
    (r"^lm_head\.(.*)$", r"language_model.lm_head.\1"),
)


def build_model(cfg: SmolVLMConfig) -> SmolVLMModel:
    # torch is imported when a model is built, not when the registry lists the families
    from edgevlm.runtime.models.smolvlm.model import SmolVLMModel

    return SmolVLMModel(cfg)


def make_processor(files: ModelFiles) -> SmolVLMProcessor:
    from edgevlm.runtime.models.smolvlm.processor import SmolVLMProcessor

    return SmolVLMProcessor.from_dir(files.model_dir, files.config, files.image_processor)


def read_image_config(model_dir: Path, cfg: SmolVLMConfig) -> Any:
    """The checkpoint's image-processor settings, as :func:`make_processor` reads them (torch-free)."""
    from edgevlm.runtime.models.smolvlm.processor import SmolVLMProcessor

    return SmolVLMProcessor.read_settings(model_dir, cfg)


FAMILY = ModelFamily(
    name="smolvlm",
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=build_model,
    make_processor=make_processor,
    read_image_config=read_image_config,
    supports_video=False,
    max_images=8,
    adaptive_vision=True,  # exit heads + pruning on the CLS-free ViT (edgevlm.runtime.adaptive)
)
