"""What the bench scripts share: the ``edgevlm`` package from an install, or from this checkout; the W4A16
layer shapes they time; the JSON line that ends their output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHAPES = {  # a decoder layer's four linears, name: (N out, K in): LLaVA-1.5-7B, Qwen3-VL-8B, Qwen3-VL-2B
    "7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008),
    "qwen8b.qkv": (6144, 4096), "qwen8b.o": (4096, 4096), "qwen8b.gate_up": (24576, 4096),
    "qwen8b.down": (4096, 12288),
    "qwen2b.qkv": (4096, 2048), "qwen2b.o": (2048, 2048), "qwen2b.gate_up": (12288, 2048),
    "qwen2b.down": (2048, 6144),
}


def use_package() -> None:
    """Make ``edgevlm.quantize`` importable: the installed package where there is one (the device's layout
    maps ``quantize/`` into it), else this checkout put first on ``sys.path``."""
    try:
        import edgevlm.quantize  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO))


def print_result(result: dict, out: str = "") -> None:
    """The result as the one JSON line a benchmark ends with (after its table), also written to ``out``
    when given."""
    line = json.dumps(result)
    if out:
        Path(out).write_text(line + "\n")
    print(line)
