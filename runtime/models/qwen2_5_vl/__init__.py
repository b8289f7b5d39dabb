"""Qwen2.5-VL (``model_type: qwen2_5_vl``): native-resolution ViT with window attention and a 2x2 merger,
Qwen2 decoder with multimodal RoPE, images and video. ``FAMILY`` is its registry entry."""

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.qwen2_5_vl.config import parse_config
from edgevlm.runtime.models.qwen2_5_vl.model import WEIGHT_RULES, Qwen25VLModel
from edgevlm.runtime.models.qwen2_5_vl.processor import Qwen25VLProcessor

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=Qwen25VLModel,
    make_processor=Qwen25VLProcessor.from_files,
    supports_video=True,
)
