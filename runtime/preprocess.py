"""Image preprocessing for ViT vision encoders: resize to a resolution-ladder rung, normalise.

Unlike CLIP's processor (shortest side to ``image_size``, then a centre crop), edgevlm keeps the
whole field of view: the image is resized so that its *longer* side is ``resolution_px`` and both
sides are rounded to a multiple of the patch size, so non-square camera frames give non-square
patch grids (the encoder interpolates its position embeddings, see ``vision.py``).
The training script of the demo model uses exactly this function, so train and serve match.

Torch-free: numpy + OpenCV only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# CLIP's normalisation constants (openai/clip-vit-large-patch14 preprocessor_config.json).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def target_size(width_px: int, height_px: int, resolution_px: int, patch_px: int) -> tuple[int, int]:
    """Size ``(width_px, height_px)`` an image is resized to for a ladder rung.

    The longer side becomes ``resolution_px`` (rounded to a multiple of ``patch_px``), the shorter
    side keeps the aspect ratio and is rounded to the nearest multiple of ``patch_px`` (at least one
    patch). Raises ``ValueError`` for non-positive sizes.
    """
    if width_px <= 0 or height_px <= 0 or resolution_px <= 0 or patch_px <= 0:
        raise ValueError(
            f"sizes must be positive (got {width_px}x{height_px}, rung {resolution_px}, patch {patch_px})"
        )
    long_px = max(patch_px, int(round(resolution_px / patch_px)) * patch_px)
    scale = long_px / max(width_px, height_px)

    def _round(side: int) -> int:
        return max(patch_px, int(round(side * scale / patch_px)) * patch_px)

    if width_px >= height_px:
        return long_px, _round(height_px)
    return _round(width_px), long_px


def resize_for_encoder(image_rgb: np.ndarray, resolution_px: int, patch_px: int) -> np.ndarray:
    """Resize one RGB image to a ladder rung (see :func:`target_size`), still uint8: the first half
    of :func:`preprocess`, for callers that normalise elsewhere (the batched GPU path normalises a
    whole batch on the device: 4x fewer bytes to copy than float32).

    Args:
        image_rgb: ``(H, W, 3)`` uint8 RGB image.
        resolution_px: ladder rung, the longer side after resizing (pixels).
        patch_px: the encoder's patch size (pixels).

    Returns:
        ``(H', W', 3)`` uint8 array (``image_rgb`` itself when the size is already right).

    Raises:
        ValueError: the array is not ``(H, W, 3)`` uint8.
    """
    import cv2

    if image_rgb.ndim != 3 or image_rgb.shape[2] != 3 or image_rgb.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got {image_rgb.shape} {image_rgb.dtype}")
    h, w = image_rgb.shape[:2]
    tw, th = target_size(w, h, resolution_px, patch_px)
    if (tw, th) != (w, h):
        # INTER_AREA averages when shrinking (no aliasing of small objects); cubic when enlarging.
        interp = cv2.INTER_AREA if tw * th < w * h else cv2.INTER_CUBIC
        image_rgb = cv2.resize(image_rgb, (tw, th), interpolation=interp)
    return image_rgb


def preprocess(
    image_rgb: np.ndarray,
    resolution_px: int,
    patch_px: int,
    mean: tuple[float, float, float] = CLIP_MEAN,
    std: tuple[float, float, float] = CLIP_STD,
) -> np.ndarray:
    """Resize and normalise one RGB image for the vision encoder.

    Args:
        image_rgb: ``(H, W, 3)`` uint8 RGB image.
        resolution_px: ladder rung, the longer side after resizing (pixels).
        patch_px: the encoder's patch size (pixels).
        mean, std: per-channel normalisation on the 0..1 scale.

    Returns:
        ``(3, H', W')`` float32 array, ``H'`` and ``W'`` multiples of ``patch_px``
        (see :func:`target_size`): ``(x / 255 - mean) / std`` of :func:`resize_for_encoder`'s pixels,
        in this order, in float32 (a device normalising the uint8 pixels the same way gets the
        same numbers).

    Raises:
        ValueError: the array is not ``(H, W, 3)`` uint8.
    """
    return normalize_for_encoder(resize_for_encoder(image_rgb, resolution_px, patch_px), mean, std)


def pixel_norm(value: Any) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """``(mean, std)`` of uint8 pixels normalised later (per channel, 0..1 scale; any sequences of numbers)
    as tuples of three floats: hashable, so images can be grouped and forwards cached by its value.

    Raises:
        ValueError: None, another shape, a non-number, or a std that is not positive.
    """
    try:
        mean, std = (tuple(float(v) for v in part) for part in value)
    except (TypeError, ValueError):
        mean = std = ()
    if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
        raise ValueError(f"pixel normalisation must be (3 means, 3 positive stds) on the 0..1 scale, got {value!r}")
    return mean, std  # type: ignore[return-value]


def normalize_for_encoder(image_rgb: np.ndarray, mean: tuple[float, float, float] = CLIP_MEAN,
                          std: tuple[float, float, float] = CLIP_STD) -> np.ndarray:
    """The second half of :func:`preprocess`: ``(H, W, 3)`` uint8 RGB (already resized) -> ``(3, H, W)``
    float32 ``(x / 255 - mean) / std`` per channel (0..1 scale), in this order, in float32."""
    x = image_rgb.astype(np.float32) * (1.0 / 255.0)  # (H, W, 3)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))  # (3, H, W)
