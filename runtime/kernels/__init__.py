"""Triton GPU kernels of the runtime (optional: need ``triton`` and a CUDA device).

Modules here import triton lazily, inside functions, so importing ``edgevlm.runtime.kernels`` is
cheap and works without triton; :func:`triton_available` says whether the kernels can run.
Setting ``TRITON_INTERPRET=1`` before triton is imported runs them on CPU tensors through Triton's
interpreter (how the CPU tests check them; bf16 is not supported there, fp16/fp32 are).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)


def interpreter_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    """Whether triton is importable (checked once)."""
    return importlib.util.find_spec("triton") is not None


def kernels_usable(device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device`` (CUDA, or CPU in interpreter mode)."""
    if not triton_available():
        return False
    dev_type = getattr(device, "type", str(device).split(":")[0])
    return dev_type == "cuda" or (dev_type == "cpu" and interpreter_mode())
