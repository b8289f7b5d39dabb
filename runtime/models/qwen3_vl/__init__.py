"""Qwen3-VL (and Cosmos-Reason2, built on it): ViT with DeepStack + Qwen3 decoder with interleaved M-RoPE.

``FAMILY`` is the registry entry (:mod:`edgevlm.runtime.models`): config parsing (:mod:`.config`), the
weight-name map (:data:`.weights.WEIGHT_RULES`), the model (:mod:`.model`, vision tower in :mod:`.vision`)
and the processor (:mod:`.processor`, on the shared :mod:`edgevlm.runtime.models.qwen_vl` pieces).
``qwen3_vl_moe`` (the mixture-of-experts decoders) is not served: the registry refuses it with the
list of supported families.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgevlm.runtime.models.base import ModelFamily
from edgevlm.runtime.models.qwen3_vl.config import MODEL_TYPES, Qwen3VLConfig, parse_config
from edgevlm.runtime.models.qwen3_vl.weights import WEIGHT_RULES


def build_model(cfg: Qwen3VLConfig) -> Any:
    # torch is imported when a model is built, not when the registry lists the families
    from edgevlm.runtime.models.qwen3_vl.model import Qwen3VLModel

    return Qwen3VLModel(cfg)


def make_processor_for_folder(model_dir: str | Path, cfg: Qwen3VLConfig) -> Any:
    """The processor of a checkpoint folder: its image and video processor files over the defaults
    of the processor classes Qwen3-VL names (``Qwen2VLImageProcessor``, ``Qwen3VLVideoProcessor``).
    Raises ModelLoadError naming a bad key."""
    from edgevlm.runtime.models.qwen3_vl.processor import Qwen3VLProcessor

    image, video = read_image_config(model_dir, cfg)
    return Qwen3VLProcessor(cfg, image, video)


def read_image_config(model_dir: str | Path, cfg: Qwen3VLConfig) -> Any:
    """The ``(image, video)`` processor settings of a checkpoint folder (torch-free; see
    :func:`make_processor_for_folder`)."""
    from edgevlm.runtime.models.qwen_vl.preprocess import QWEN3_VIDEO_DEFAULTS, read_pixel_configs

    v = cfg.vision
    return read_pixel_configs(model_dir, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                              merge_size=v.spatial_merge_size, video_defaults=QWEN3_VIDEO_DEFAULTS)


def _make_processor(files: Any) -> Any:
    return make_processor_for_folder(files.model_dir, files.config)


FAMILY = ModelFamily(
    name="qwen3_vl",
    model_types=MODEL_TYPES,
    parse_config=parse_config,
    weight_rules=WEIGHT_RULES,
    build_model=build_model,
    make_processor=_make_processor,
    read_image_config=read_image_config,
    supports_video=True,
    vision_state_free=False,  # DeepStack features stashed by encode_vision for prefill
    adaptive_vision=True,  # exit heads + pruning on the CLS-free ViT (edgevlm.runtime.adaptive)
)
