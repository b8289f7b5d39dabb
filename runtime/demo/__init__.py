"""The shipped demo VLM: seeded scene generator, training and evaluation scripts, weights and video.

``model_dir()`` is the folder of the shipped Hugging Face-format LLaVA checkpoint (the runtime's
default model), ``video_path()`` the bundled scene video and ``scenes_json_path()`` its sidecar
ground truth (see :mod:`edgevlm.runtime.demo.video`). Importing this package loads nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def model_dir() -> Path:
    """Folder of the shipped demo model (``config.json``, ``model.safetensors``, tokenizer files)."""
    return _HERE / "model"


def video_path() -> Path:
    """The bundled scene video (``media/scenes.mp4``, MPEG-4 Part 2 in MP4, 384x288, 10 fps)."""
    return _HERE / "media" / "scenes.mp4"


def scenes_json_path() -> Path:
    """Sidecar of :func:`video_path`: per segment ``start_ms``/``end_ms`` and questions with answers."""
    return _HERE / "media" / "scenes.json"


__all__ = ["model_dir", "scenes_json_path", "video_path"]
