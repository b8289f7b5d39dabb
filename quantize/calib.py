"""Calibration data for AWQ: (image, prompt[, answer]) samples.

* ``"demo"``: scenes from the demo model's seeded generator (:mod:`edgevlm.runtime.demo.scenes`),
  drawn from the *training* stream with a seed of their own, so the held-out evaluation set is
  never seen; each sample carries the exact answer (appended to the prompt during calibration, so
  decode-time activations are represented too).
* a folder: every ``*.jpg/*.jpeg/*.png/*.bmp/*.webp`` image (sorted by name) and a ``prompts.txt``
  beside them, one prompt per line (blank lines and ``#`` comments ignored); prompts are assigned
  to images round-robin. An optional answer follows a tab: ``prompt<TAB>answer``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgevlm.errors import ConfigError

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
PROMPTS_FILE = "prompts.txt"
DEMO_CALIB_SEED = 4242


@dataclass(frozen=True)
class CalibSample:
    """One calibration example: ``(H, W, 3)`` uint8 RGB image, a prompt, an optional answer."""

    image: np.ndarray
    prompt: str
    answer: str | None = None


def demo_samples(n: int, seed: int = DEMO_CALIB_SEED) -> list[CalibSample]:
    """``n`` scenes with one random question each from the demo generator's training stream."""
    from edgevlm.runtime.demo import scenes

    out = []
    for i in range(n):
        rng = scenes.rng_for(seed, scenes.DOMAIN_TRAIN, i)
        scene = scenes.generate_scene(rng)
        qa = scenes.sample_questions(scene, rng, 1)[0]
        image = scenes.render(scene, noise_rng=rng, noise_sigma=2.0)
        out.append(CalibSample(image, qa.question, qa.answer))
    return out


def check_folder(folder: str | Path) -> tuple[list[Path], list[tuple[str, str | None]]]:
    """Validate a calibration folder without decoding images: ``(image paths, (prompt, answer) pairs)``.

    Raises ConfigError: the folder is missing, has no images, or no usable ``prompts.txt``.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"calibration folder {root} " + ("is a file, not a folder" if root.exists() else "does not exist"))
    images = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not images:
        raise ConfigError(f"calibration folder {root} has no images ({', '.join(IMAGE_SUFFIXES)})")
    prompts_path = root / PROMPTS_FILE
    if not prompts_path.is_file():
        raise ConfigError(f"calibration folder {root} has no {PROMPTS_FILE} (one prompt per line)")
    pairs = []
    for ln in prompts_path.read_text(encoding="utf-8").splitlines():
        ln = ln.strip()
        if not ln or ln.startswith("#"):
            continue
        prompt, _, answer = ln.partition("\t")
        if prompt.strip():
            pairs.append((prompt.strip(), answer.strip() or None))
    if not pairs:
        raise ConfigError(f"{prompts_path} has no prompts")
    return images, pairs


def folder_samples(folder: str | Path, n: int | None = None) -> list[CalibSample]:
    """Samples from a folder of images plus ``prompts.txt`` (see the module docstring).

    Raises:
        ConfigError: the folder is missing, has no images or no usable prompts.
        edgevlm.errors.InvalidImageError: an image does not decode (the message names the file).
    """
    from edgevlm.runtime.image import load_image

    images, pairs = check_folder(folder)
    if n is not None:
        images = images[:n]
    return [CalibSample(load_image(p), *pairs[i % len(pairs)]) for i, p in enumerate(images)]


def load_samples(spec: str | Path, n: int) -> list[CalibSample]:
    """``spec`` = ``"demo"`` or a folder path; at most ``n`` samples (demo: exactly ``n``)."""
    if str(spec) == "demo":
        return demo_samples(n)
    return folder_samples(spec, n)
