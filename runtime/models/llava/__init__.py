"""The LLaVA family (``model_type: llava``): a CLIP or SigLIP tower, the 2-layer MLP projector and a
Llama / Mistral / Qwen2 / Llama-3 decoder (Liu et al., "Visual Instruction Tuning", 2023; the
llava-hf checkpoints of transformers' ``LlavaForConditionalGeneration``).

Files: :mod:`.config` (``config.json``), :mod:`.model` (modules and the weight-name map),
:mod:`.processor` (preprocessing and image-token expansion).
"""

from __future__ import annotations

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.llava.config import parse_config
from edgevlm.runtime.models.llava.model import OPTIONAL_PREFIXES, WEIGHT_RULES, LlavaModel
from edgevlm.runtime.models.llava.processor import make_processor

FAMILY = ModelFamily(
    name="llava",
    model_types=("llava",),
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=LlavaModel,
    make_processor=make_processor,
    supports_video=False,
    optional_prefixes=OPTIONAL_PREFIXES,
    adaptive_vision=True,
)

__all__ = ["FAMILY"]
