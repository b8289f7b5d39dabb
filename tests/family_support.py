"""Tiny random checkpoints of the Qwen2.5-VL, Qwen3-VL, SmolVLM and InternVL families for the batching, KV
cache and CUDA-graph tests (``pythonpath = ["tests"]``), written by the family tests' own builders
(``tests/models/test_<family>.py``: transformers' model classes + ``save_pretrained``), plus the
requests those tests send: three per family with different images, prompts and token budgets (a
video for the Qwen families, two images for SmolVLM and InternVL)."""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path

import numpy as np

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm", "internvl")
_MODELS = Path(__file__).resolve().parent / "models"
_BUILDERS = {  # family -> (test module, builder function)
    "qwen2_5_vl": ("test_qwen2_5_vl.py", "write_tiny_qwen2_5_vl"),
    "qwen3_vl": ("test_qwen3_vl.py", "write_tiny_qwen3_vl"),
    "smolvlm": ("test_smolvlm.py", "build_checkpoint"),
    "internvl": ("test_internvl.py", "build_checkpoint"),
    # written on request only (not in FAMILIES: the shared batching / exit / quantize tests assert the
    # four families' own specifics; Gemma 3's live in tests/models/test_gemma3.py)
    "gemma3": ("test_gemma3.py", "build_checkpoint"),
}


@cache
def load_test_module(file: str):
    """A family test module loaded by path (pytest's importlib mode gives it no importable name)."""
    spec = importlib.util.spec_from_file_location(f"family_support_{file[:-3]}", _MODELS / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_checkpoint(family: str, folder: Path) -> Path:
    """Write ``family``'s tiny checkpoint into ``folder`` (created) and return it. With
    ``EDGEVLM_FAMILY_CKPTS`` set (a folder holding one written checkpoint per family, e.g. carried
    to a GPU machine whose transformers differs), its ``<family>`` subfolder is returned instead."""
    ready = os.environ.get("EDGEVLM_FAMILY_CKPTS")
    if ready and (Path(ready) / family / "config.json").is_file():
        return Path(ready) / family
    file, name = _BUILDERS[family]
    folder.mkdir(parents=True, exist_ok=True)
    getattr(load_test_module(file), name)(folder)
    return folder


def image(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth gradient with noise: ``(h, w, 3)`` uint8 (away from greedy ties)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x + y) % 256], -1)
    return np.clip(img + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)


def requests(family: str) -> list[tuple[object, str, int]]:
    """Three ``(image or frames, prompt, max_new_tokens)`` of different vision, prompt and budget."""
    several = [image(70, 100, 5 + i) for i in range(4)]  # Qwen: one video; SmolVLM, InternVL: take two images
    third = several if family.startswith("qwen") else several[:2]
    return [
        (image(120, 200, 1), "how many shapes are there?", 7),
        (image(64, 64, 2), "describe the scene.", 4),
        (third, "what is happening in this video? is the red circle on the left?", 9),
    ]
