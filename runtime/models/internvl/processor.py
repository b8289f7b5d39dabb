"""InternVL preprocessing and prompt expansion, equal to transformers' ``InternVLProcessor`` with
``GotOcr2ImageProcessorPil`` (the backend transformers uses without torchvision; the hub's
``GotOcr2ImageProcessorFast`` resizes with torch's antialiased bicubic instead of Pillow's, a
difference of a few uint8 levels at some pixels).

Image pipeline (InternVL's dynamic tiling, Chen et al., "How Far Are We to GPT-4V? InternVL 1.5",
2024, as ``GotOcr2ImageProcessor.crop_image_to_patches`` runs it):

1. with ``crop_to_patches`` (``InternVLProcessor`` turns it on by default) and ``max_patches > 1``:
   among the grids ``cols x rows`` with ``min_patches <= cols * rows <= max_patches`` (sorted by
   tile count), pick the one whose aspect ``cols / rows`` is closest to the image's ``W / H``; on a
   tie the later (more tiles) grid wins when the image area exceeds half the grid's pixel area.
   Resize the image to ``(rows * T, cols * T)``, crop the tiles in raster order and, when there is
   more than one, append the whole image resized to ``T x T`` (the thumbnail);
2. otherwise the image is resized to ``T x T`` (``do_resize``), one tile;
3. every resize is Pillow on uint8 with the checkpoint's ``resample`` (InternVL: 3 = BICUBIC); then
   ``x * rescale_factor`` (float64 -> float32) and ``(x - mean) / std`` in float32, channels first.

Prompt: each image's ``<IMG_CONTEXT>`` placeholder (what the hub's chat template renders for an
image part) becomes ``<img>`` + ``<IMG_CONTEXT>`` x (``image_seq_length`` x tiles) + ``</img>``.

The resolution ladder's rungs set the tile budget: ``max_patches = max(1, (rung // T)^2)`` (a rung
below one tile gives the single resized tile); ``resolution_px=None`` is the checkpoint's own
setting (parity).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from edgevlm.errors import InvalidRequestError, ModelLoadError
from edgevlm.model_folder import read_json
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.models.blocks.pil_tiles import (
    PilTileProcessor,
    check_image_request,
    check_rgb,
    read_pil_settings,
)
from edgevlm.runtime.models.internvl.config import InternVLConfig

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<IMG_CONTEXT>"
START_IMAGE_TOKEN = "<img>"
END_IMAGE_TOKEN = "</img>"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image-processor settings of an InternVL checkpoint (defaults: the hub's InternVL3-hf
    ``preprocessor_config.json``, and ``InternVLProcessor``'s ``crop_to_patches=True``)."""

    tile_px: int = 448
    do_resize: bool = True
    resample: int = 3
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STD
    crop_to_patches: bool = True
    min_patches: int = 1
    max_patches: int = 12
    image_seq_len: int = 256


def read_image_processor_config(pre: dict | None, model_dir: Path, cfg: InternVLConfig) -> ImageProcessorConfig:
    """The checkpoint's settings from ``pre`` (the loader's image-processor dict) and
    ``image_seq_length`` from ``processor_config.json``. ``pre`` None: the defaults above with the
    encoder's tile size, and a logged warning.

    Raises:
        ModelLoadError: a malformed key, a ``size`` that is not the encoder's square
            ``vision_config.image_size``, or an ``image_seq_length`` that disagrees with the model.
    """
    where = "image processor config"
    d = ImageProcessorConfig(tile_px=cfg.tile_px, image_seq_len=cfg.image_seq_len)
    if not isinstance(pre, dict):
        logger.warning("%s has no preprocessor_config.json or processor_config.json image_processor: using "
                       "InternVL's defaults (%d px tiles, ImageNet mean/std, up to %d tiles)", model_dir,
                       d.tile_px, d.max_patches)
        pre = {}

    def typed(key: str, default, typ):
        value = pre.get(key, default)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
            raise ModelLoadError(f"{where}: {key} must be {typ.__name__}, got {value!r}")
        return value

    size = pre.get("size", {"height": d.tile_px, "width": d.tile_px})
    if not isinstance(size, dict) or size.get("height") != size.get("width") or size.get("height") != cfg.tile_px:
        raise ModelLoadError(f"{where}: size {size!r} is not the encoder's {cfg.tile_px}x{cfg.tile_px} px tile "
                             "(vision_config.image_size)")
    pil = read_pil_settings(pre, d, where)
    min_patches, max_patches = typed("min_patches", d.min_patches, int), typed("max_patches", d.max_patches, int)
    if not 1 <= min_patches <= max_patches:
        raise ModelLoadError(f"{where}: min_patches {min_patches} / max_patches {max_patches} must satisfy "
                             "1 <= min_patches <= max_patches")
    proc = read_json(Path(model_dir) / "processor_config.json", required=False)
    seq_len = proc.get("image_seq_length", cfg.image_seq_len) if isinstance(proc, dict) else cfg.image_seq_len
    if seq_len != cfg.image_seq_len:
        raise ModelLoadError(f"processor_config.json: image_seq_length {seq_len!r} disagrees with config.json "
                             f"((image_size / patch_size * downsample_ratio)^2 = {cfg.image_seq_len})")
    return ImageProcessorConfig(
        **pil,
        tile_px=cfg.tile_px,
        do_resize=typed("do_resize", d.do_resize, bool),
        do_rescale=typed("do_rescale", d.do_rescale, bool),
        rescale_factor=typed("rescale_factor", d.rescale_factor, float),
        do_normalize=typed("do_normalize", d.do_normalize, bool),
        # InternVLProcessor's images_kwargs default (crop_to_patches=True) wins over the image
        # processor's saved class default unless the checkpoint's processor config says otherwise
        crop_to_patches=True,
        min_patches=min_patches,
        max_patches=max_patches,
        image_seq_len=seq_len,
    )


@lru_cache(maxsize=64)
def tile_grid(height: int, width: int, tile_px: int, min_patches: int, max_patches: int) -> tuple[int, int]:
    """``(cols, rows)`` of the tiling of an ``height x width`` image (step 1 of the module docstring;
    transformers' ``get_optimal_tiled_canvas``)."""
    grids = sorted(((c, r) for c in range(1, max_patches + 1) for r in range(1, max_patches + 1)
                    if min_patches <= c * r <= max_patches), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile_px * tile_px * c * r:
            best = (c, r)
    return best


class InternVLProcessor(PilTileProcessor):
    """:class:`~edgevlm.runtime.models.base.Processor` of the InternVL family."""

    family_title = "InternVL"
    read_config = staticmethod(read_image_processor_config)

    def preprocess_image(self, image: np.ndarray, max_patches: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
        """One ``(H, W, 3)`` uint8 RGB image -> ``(tiles (N, 3, T, T) float32, (H', W') px resized to)``.

        Raises:
            InvalidImageError: not an ``(H, W, 3)`` uint8 array, or an empty one.
        """
        image = check_rgb(image)
        ic, t = self.image_cfg, self.image_cfg.tile_px
        max_patches = ic.max_patches if max_patches is None else max_patches
        if ic.crop_to_patches and max_patches > 1:
            cols, rows = tile_grid(image.shape[0], image.shape[1], t, min(ic.min_patches, max_patches), max_patches)
            canvas = self._resize(image, rows * t, cols * t)
            tiles = [canvas[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
            if len(tiles) > 1:
                tiles.append(self._resize(image, t, t))
            return self._normalize(tiles), (rows * t, cols * t)
        if ic.do_resize:
            image = self._resize(image, t, t)
        return self._normalize([image]), image.shape[:2]

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None,
                video_timestamps_s: list[float] | None = None) -> VisionInput:
        """Images (each ``(H, W, 3)`` uint8 RGB) -> :class:`VisionInput` with ``pixel_values``
        ``(N_tiles_total, 3, T, T)`` float32 (each image's tiles then its thumbnail, images in order),
        ``tokens_per_item`` = ``image_seq_len`` x tiles per image. ``resolution_px`` sets the tile
        budget (see the module docstring; None = the checkpoint's).

        Raises:
            InvalidImageError: an image that is not a non-empty ``(H, W, 3)`` uint8 array.
            InvalidRequestError: ``video`` given (this family serves images only), or a
                non-positive ``resolution_px``.
        """
        import torch

        check_image_request(self.cfg.model_type, video, resolution_px)
        t, seq = self.image_cfg.tile_px, self.image_cfg.image_seq_len
        budget = None if resolution_px is None else max(1, (resolution_px // t) ** 2)
        per_image = [self.preprocess_image(img, budget) for img in images]
        pixel_values = (torch.from_numpy(np.concatenate([p for p, _ in per_image])) if per_image
                        else torch.zeros(0, 3, t, t))
        return VisionInput(
            pixel_values=pixel_values,
            tokens_per_item=[seq * len(p) for p, _ in per_image],
            kinds=["image"] * len(per_image),
            input_sizes_px=[tuple(int(v) for v in size) for _, size in per_image],
            extras={"tiles": [len(p) for p, _ in per_image]},
            token_groups=[seq] * int(pixel_values.shape[0]),
        )

    # -- prompt ----------------------------------------------------------------------------------

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """Replace the i-th ``<IMG_CONTEXT>`` of the rendered chat template by
        ``<img>`` + ``<IMG_CONTEXT>`` x image i's vision tokens + ``</img>``.

        Raises:
            InvalidRequestError: the template holds a different number of placeholders than images.
        """
        parts = text.split(IMAGE_TOKEN)
        if len(parts) - 1 != len(vision.tokens_per_item):
            raise InvalidRequestError(f"prompt has {len(parts) - 1} {IMAGE_TOKEN} placeholders for "
                                      f"{len(vision.tokens_per_item)} images")
        out = [parts[0]]
        for n, rest in zip(vision.tokens_per_item, parts[1:], strict=True):
            out.append(f"{START_IMAGE_TOKEN}{IMAGE_TOKEN * n}{END_IMAGE_TOKEN}")
            out.append(rest)
        return "".join(out)
