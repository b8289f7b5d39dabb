"""The LLaVA family (``model_type: llava``): a CLIP or SigLIP tower, the 2-layer MLP projector and a
Llama / Mistral / Qwen2 / Llama-3 decoder (Liu et al., "Visual Instruction Tuning", 2023; the
llava-hf checkpoints of transformers' ``LlavaForConditionalGeneration``).

Files: :mod:`.config` (``config.json``), :mod:`.model` (modules and the weight-name map),
:mod:`.processor` (preprocessing and image-token expansion).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.llava.config import parse_config
from edgevlm.runtime.models.llava.weights import OPTIONAL_PREFIXES, WEIGHT_RULES


def build_model(cfg: Any) -> Any:
    # torch is imported when a model is built, not when the registry lists the families
    from edgevlm.runtime.models.llava.model import LlavaModel

    return LlavaModel(cfg)


def make_processor(files: Any) -> Any:
    from edgevlm.runtime.models.llava.processor import make_processor as make

    return make(files)


def read_image_config(model_dir: Path, cfg: Any) -> Any:
    from edgevlm.runtime.models.llava.processor import read_image_config as read

    return read(model_dir, cfg)


FAMILY = ModelFamily(
    name="llava",
    model_types=("llava",),
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=build_model,
    make_processor=make_processor,
    read_image_config=read_image_config,
    supports_video=False,
    optional_prefixes=OPTIONAL_PREFIXES,
    adaptive_vision=True,
    batched_pixels=True,
    int4_vision=True,
)

__all__ = ["FAMILY"]
