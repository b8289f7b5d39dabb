"""Qwen2.5-VL (``model_type: qwen2_5_vl``): native-resolution ViT with window attention and a 2x2 merger,
Qwen2 decoder with multimodal RoPE, images and video. ``FAMILY`` is its registry entry."""

from pathlib import Path
from typing import Any

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.qwen2_5_vl.config import parse_config
from edgevlm.runtime.models.qwen2_5_vl.weights import WEIGHT_RULES


def build_model(cfg: Any) -> Any:
    # torch is imported when a model is built, not when the registry lists the families
    from edgevlm.runtime.models.qwen2_5_vl.model import Qwen25VLModel

    return Qwen25VLModel(cfg)


def make_processor(files: Any) -> Any:
    from edgevlm.runtime.models.qwen2_5_vl.processor import Qwen25VLProcessor

    return Qwen25VLProcessor.from_files(files)


def read_image_config(model_dir: Path, cfg: Any) -> Any:
    """The ``(image, video)`` processor settings of a checkpoint folder (the processor class
    defaults under its files; torch-free). Raises ModelLoadError naming a bad key."""
    from edgevlm.runtime.models.qwen_vl.preprocess import read_pixel_configs

    v = cfg.vision
    return read_pixel_configs(model_dir, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                              merge_size=v.spatial_merge_size)


FAMILY = ModelFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=build_model,
    make_processor=make_processor,
    read_image_config=read_image_config,
    supports_video=True,
    adaptive_vision=True,  # exit heads + pruning on the CLS-free ViT (edgevlm.runtime.adaptive)
)
