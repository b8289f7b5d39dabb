"""edgevlm.runtime: the VLM inference runtime (PyTorch backend, later ONNX Runtime / TensorRT).

Importing this package is cheap and torch-free; :class:`Engine` (and torch with it) is imported on
first attribute access::

    from edgevlm.runtime import Engine
    engine = Engine.load(device="cpu")
    answer = engine.ask(image_rgb, "How many circles are there?")

Needs the ``runtime`` extra: ``pip install 'edgevlm[runtime]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgevlm.runtime.engine import Engine, Stream

__all__ = ["Engine", "Stream"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Stream"):
        try:
            from edgevlm.runtime import engine
        except ImportError as exc:
            if getattr(exc, "name", "") in ("torch", "safetensors", "tokenizers", "jinja2", "cv2"):
                raise ImportError(
                    f"edgevlm.runtime.{name} needs {exc.name}: pip install 'edgevlm[runtime]'"
                ) from exc
            raise
        return getattr(engine, name)
    raise AttributeError(f"module 'edgevlm.runtime' has no attribute {name!r}")
