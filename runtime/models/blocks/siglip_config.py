"""SigLIP vision tower configuration (torch-free): :class:`SiglipVisionConfig` and its parser
:func:`parse_siglip_vision_config`, read by the families whose towers are SigLIP-style (LLaVA with a
SigLIP tower, SmolVLM) without importing the modules of :mod:`edgevlm.runtime.models.blocks.siglip`.
Defaults are those of transformers' ``SiglipVisionConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import SUPPORTED_ACTIVATIONS, get_typed


@dataclass(frozen=True)
class SiglipVisionConfig:
    """SigLIP vision tower hyper-parameters (defaults: transformers' ``SiglipVisionConfig``)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    vision_use_head: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_side(self) -> int:
        """Patches per side of the trained square position grid (``image_size`` floored to the patch)."""
        return self.image_size // self.patch_size

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
        hidden_size=get_typed(vc, "hidden_size", d.hidden_size, int, where),
        intermediate_size=get_typed(vc, "intermediate_size", d.intermediate_size, int, where),
        num_hidden_layers=get_typed(vc, "num_hidden_layers", d.num_hidden_layers, int, where),
        num_attention_heads=get_typed(vc, "num_attention_heads", d.num_attention_heads, int, where),
        num_channels=get_typed(vc, "num_channels", d.num_channels, int, where),
        image_size=get_typed(vc, "image_size", d.image_size, int, where),
        patch_size=get_typed(vc, "patch_size", d.patch_size, int, where),
        hidden_act=get_typed(vc, "hidden_act", d.hidden_act, str, where),
        layer_norm_eps=get_typed(vc, "layer_norm_eps", d.layer_norm_eps, float, where),
        vision_use_head=get_typed(vc, "vision_use_head", d.vision_use_head, bool, where),
    )
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {where}hidden_act {cfg.hidden_act!r} is not supported")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "patch_size", "image_size",
                "intermediate_size", "num_channels"):
        if getattr(cfg, key) <= 0:
            raise ModelLoadError(f"config.json: {where}{key} must be positive, got {getattr(cfg, key)}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ModelLoadError(f"config.json: {where}hidden_size is not a multiple of num_attention_heads")
    if cfg.image_size < cfg.patch_size:
        raise ModelLoadError(f"config.json: {where}image_size {cfg.image_size} is smaller than patch_size")
    return cfg
