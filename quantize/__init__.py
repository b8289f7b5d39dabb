"""edgevlm.quantize: W4A16 INT4 quantization (RTN, AWQ) and engine bundles.

``quantize_(model, Int4WeightOnlyConfig(...))`` quantizes an in-memory module
(:mod:`edgevlm.quantize.api`); ``build_bundle`` / ``edgevlm quantize`` turns a Hugging Face LLaVA
checkpoint folder into an engine bundle layer by layer (:mod:`edgevlm.quantize.build`). Importing
this package does not import torch; the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Int4WeightOnlyConfig",
    "build_bundle",
    "choose_group_size",
    "format_plan",
    "plan_module",
    "quantize_",
]

if TYPE_CHECKING:  # pragma: no cover
    from edgevlm.quantize.api import plan_module, quantize_
    from edgevlm.quantize.build import build_bundle
    from edgevlm.quantize.config import Int4WeightOnlyConfig
    from edgevlm.quantize.plan import choose_group_size, format_plan

_LAZY = {
    "quantize_": "edgevlm.quantize.api",
    "plan_module": "edgevlm.quantize.api",
    "build_bundle": "edgevlm.quantize.build",
    "Int4WeightOnlyConfig": "edgevlm.quantize.config",
    "choose_group_size": "edgevlm.quantize.plan",
    "format_plan": "edgevlm.quantize.plan",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'edgevlm.quantize' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
