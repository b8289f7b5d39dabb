"""Pillow resize and tile normalisation shared by the tiling processors (SmolVLM / Idefics3, InternVL).

Both follow transformers' slow (PIL) image processors: resize a ``(H, W, 3)`` uint8 image with the
checkpoint's ``resample`` filter code (transformers' ``PILImageResampling``: the Pillow
``Image.Resampling`` value), then rescale by ``rescale_factor`` in float64 and normalise with the
checkpoint's mean / std in float32, tile by tile.
"""

from __future__ import annotations

import numpy as np

#: Pillow resampling filters by their integer code (transformers' PILImageResampling)
PIL_FILTERS = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


def pil_resize(image: np.ndarray, height: int, width: int, resample: int, family: str) -> np.ndarray:
    """``image`` ``(H, W, 3)`` uint8 resized to ``(height, width, 3)`` uint8 by Pillow with filter
    code ``resample`` (:data:`PIL_FILTERS`); the same array when the size already matches.

    Raises:
        ImportError: Pillow is missing (the message names ``family`` and the ``runtime`` extra).
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(f"{family} preprocessing needs Pillow: pip install 'edgevlm[runtime]'") from exc

    if image.shape[:2] == (height, width):
        return image  # Pillow's resize to the same size is a copy
    return np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling(resample)))


def normalize_tiles(tiles: list[np.ndarray], *, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                    image_mean: tuple[float, float, float], image_std: tuple[float, float, float]) -> np.ndarray:
    """``N`` tiles ``(T, T, 3)`` uint8 -> ``(N, 3, T, T)`` float32: ``x * rescale_factor`` (computed
    in float64, as transformers' ``rescale``) when ``do_rescale``, then ``(x - mean) / std`` per
    channel when ``do_normalize``."""
    x = np.stack(tiles).transpose(0, 3, 1, 2)  # (N, 3, T, T) uint8
    x = (x.astype(np.float64) * rescale_factor).astype(np.float32) if do_rescale else x.astype(np.float32)
    if do_normalize:
        mean = np.asarray(image_mean, dtype=np.float32)[None, :, None, None]
        std = np.asarray(image_std, dtype=np.float32)[None, :, None, None]
        x = (x - mean) / std
    return x
