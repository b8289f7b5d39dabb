"""Helpers of the Triton kernel tests: run a script under Triton's CPU interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_interpreted(script: str, *args: str) -> dict:
    """Run ``script`` (with ``args`` as ``sys.argv[1:]``) in a fresh Python with ``TRITON_INTERPRET=1``
    (kernels on the CPU); return the JSON object its last stdout line prints. Fails the test with the
    script's stderr. The child starts in an empty temporary folder, not the repository root, where the
    top-level ``edgevlm/`` source folder would hide an installed package laid out as the wheel has it
    (``edgevlm.runtime`` is ``runtime/`` in the repository)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory(prefix="edgevlm-triton-") as cwd:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and _NUMPY_SCALAR_ERROR in proc.stderr and _numpy_refuses_array_scalars():
        pytest.skip("this Triton's CPU interpreter converts 1-element arrays with int(), which NumPy >= 2.5 "
                    "refuses (seen with Triton 3.6 + NumPy 2.5.2 on the H200 image); the compiled kernels "
                    "are tested on the GPU itself")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_NUMPY_SCALAR_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


def _numpy_refuses_array_scalars() -> bool:
    """NumPy 2.5 turned the deprecated ``int(array of ndim > 0)`` into a TypeError."""
    import numpy as np

    return tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 5)
