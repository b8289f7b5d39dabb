"""SigLIP vision tower configuration (torch-free): :class:`SiglipVisionConfig` and its parser
:func:`parse_siglip_vision_config`, read by the families whose towers are SigLIP-style (LLaVA with a
SigLIP tower, SmolVLM) without importing the modules of :mod:`edgevlm.runtime.models.blocks.siglip`.
Defaults are those of transformers' ``SiglipVisionConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import get_typed
from edgevlm.runtime.models.blocks.vit_config import ViTGeometry, parse_vit_geometry


@dataclass(frozen=True)
class SiglipVisionConfig(ViTGeometry):
    """SigLIP vision tower hyper-parameters (defaults: transformers' ``SiglipVisionConfig``):
    :class:`~edgevlm.runtime.models.blocks.vit_config.ViTGeometry` plus the pooling head's switch."""

    vision_use_head: bool = True

    @property
    def num_positions(self) -> int:
        return self.grid_side**2


def parse_siglip_vision_config(
    vc: dict,
    *,
    model_types: tuple[str, ...] = ("siglip_vision_model",),
    where: str = "vision_config.",
    defaults: SiglipVisionConfig | None = None,
) -> SiglipVisionConfig:
    """Parse a SigLIP-style ``vision_config`` dict; keys left out take ``defaults`` (transformers'
    ``SiglipVisionConfig`` defaults when None).

    Raises:
        ModelLoadError: another ``model_type`` than ``model_types``, a key of the wrong type, an
            unsupported activation, or inconsistent sizes; the message names the key (``where`` + key).
    """
    if not isinstance(vc, dict):
        raise ModelLoadError(f"config.json: {where.rstrip('.')} must be an object")
    model_type = vc.get("model_type", model_types[0])
    if model_type not in model_types:
        raise ModelLoadError(
            f"config.json: {where}model_type {model_type!r} is not supported ({', '.join(model_types)})"
        )
    d = defaults or SiglipVisionConfig()
    cfg = SiglipVisionConfig(
        **parse_vit_geometry(vc, d, where),
        vision_use_head=get_typed(vc, "vision_use_head", d.vision_use_head, bool, where),
    )
    if cfg.image_size < cfg.patch_size:
        raise ModelLoadError(f"config.json: {where}image_size {cfg.image_size} is smaller than patch_size")
    return cfg
