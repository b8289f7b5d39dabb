"""What the bench scripts share: the ``edgevlm`` package from an install, or from this checkout."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def use_package() -> None:
    """Make ``edgevlm.quantize`` importable: the installed package where there is one (the device's layout
    maps ``quantize/`` into it), else this checkout put first on ``sys.path``."""
    try:
        import edgevlm.quantize  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO))
