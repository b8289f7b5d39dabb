"""edgevlm: edge deployment SDK and daemon for vision-language models.

``import edgevlm`` is light: it loads the SDK, the wire protocol and the schemas, never torch.
The runtime (``edgevlm.runtime``), the quantizer (``edgevlm.quantize``) and the daemon
(``edgevlm.daemon``) are imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "Client",
    "EdgeVLMError",
    "ErrorCode",
    "OperatingPoint",
    "Stats",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from edgevlm.client import Client
    from edgevlm.errors import EdgeVLMError, ErrorCode
    from edgevlm.types import Answer, OperatingPoint, Stats

_LAZY = {
    "Client": "edgevlm.client",
    "EdgeVLMError": "edgevlm.errors",
    "ErrorCode": "edgevlm.errors",
    "Answer": "edgevlm.types",
    "OperatingPoint": "edgevlm.types",
    "Stats": "edgevlm.types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'edgevlm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
