"""What the CLIP-style vision towers' configs share (torch-free): :class:`ViTGeometry`, the keys of a
ViT ``vision_config`` that LLaVA's CLIP, SigLIP (LLaVA, SmolVLM) and InternViT all read the same way,
and :func:`parse_vit_geometry`, the one reader of those keys. Each tower's config subclasses
:class:`ViTGeometry` with its own defaults and extra fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import SUPPORTED_ACTIVATIONS, get_typed


@dataclass(frozen=True)
class ViTGeometry:
    """A ViT tower's sizes: ``hidden_size`` (channels), ``num_attention_heads``, ``image_size`` /
    ``patch_size`` (px, square), MLP width, depth, input channels, activation, norm epsilon.
    Defaults: transformers' ``SiglipVisionConfig``; each tower's subclass sets its own."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_side(self) -> int:
        """Patches per side of the trained square position grid (``image_size`` floored to the patch)."""
        return self.image_size // self.patch_size


#: the integer keys of :class:`ViTGeometry`, each checked positive
_INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
             "image_size", "patch_size")


def parse_vit_geometry(vc: dict, defaults: ViTGeometry, where: str, **read: Any) -> dict[str, Any]:
    """The :class:`ViTGeometry` keys of a ``vision_config`` dict, as keyword arguments for the
    tower's config class; keys left out take ``defaults``' values, and a key in ``read`` (a value
    the caller read its own way, e.g. an ``[h, w]`` pair) is taken as it is.

    Raises:
        ModelLoadError: a key of the wrong type, an integer key that is not positive, an unsupported
            ``hidden_act`` or a ``hidden_size`` that is not a multiple of ``num_attention_heads``; the
            message names the key (``where`` + key).
    """
    out: dict[str, Any] = {}
    for f in fields(ViTGeometry):
        if f.name in read:
            out[f.name] = read[f.name]
            continue
        default = getattr(defaults, f.name)
        out[f.name] = get_typed(vc, f.name, default, type(default), where)
    if out["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {where}hidden_act {out['hidden_act']!r} is not supported")
    for key in _INT_KEYS:
        if out[key] <= 0:
            raise ModelLoadError(f"config.json: {where}{key} must be positive, got {out[key]}")
    if out["hidden_size"] % out["num_attention_heads"]:
        raise ModelLoadError(f"config.json: {where}hidden_size is not a multiple of num_attention_heads")
    return out
