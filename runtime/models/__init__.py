"""The model registry: one folder per family, one line per family in :data:`FAMILIES`.

Each ``edgevlm.runtime.models.<family>`` exports ``FAMILY`` (a
:class:`~edgevlm.runtime.models.base.ModelFamily`); modules are imported only when a checkpoint
asks for them. See README.md, "How to add a family".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from edgevlm.errors import ModelLoadError

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import ModelFamily

#: family name -> module exporting ``FAMILY``
FAMILIES: dict[str, str] = {
    "llava": "edgevlm.runtime.models.llava",
    "internvl": "edgevlm.runtime.models.internvl",
    "gemma3": "edgevlm.runtime.models.gemma3",
    "qwen2_5_vl": "edgevlm.runtime.models.qwen2_5_vl",
    "qwen3_vl": "edgevlm.runtime.models.qwen3_vl",
    "smolvlm": "edgevlm.runtime.models.smolvlm",
}


def get_family(name: str) -> ModelFamily:
    """The registered family ``name``. Raises ``KeyError`` for an unknown name."""
    return importlib.import_module(FAMILIES[name]).FAMILY


def family_for(raw_config: dict) -> ModelFamily:
    """The family serving ``raw_config["model_type"]`` (a parsed ``config.json``).

    Raises:
        ModelLoadError: no registered family serves that model type; the one-line message names
            the supported families and their model types.
    """
    model_type = raw_config.get("model_type") if isinstance(raw_config, dict) else None
    families = [get_family(name) for name in FAMILIES]
    for family in families:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({', '.join(f.model_types)})" for f in families)
    raise ModelLoadError(f"config.json: model_type {model_type!r} is not supported; supported: {supported}")
