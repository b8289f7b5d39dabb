"""SmolVLM / Idefics3 preprocessing and prompt expansion, equal to transformers' ``SmolVLMProcessor``.

Image pipeline (the facts of transformers' ``SmolVLMImageProcessor`` PIL backend; Pillow does the
resampling because OpenCV's Lanczos is a fixed 8x8 kernel and cannot reproduce Pillow's
support-scaled, antialiased filters):

1. resize so the longest edge is ``size.longest_edge`` (up or down), the other side
   ``int(longest / aspect)`` rounded up to even, at least 1 px; then capped at 4096 px;
2. with ``do_image_splitting``: resize both sides up to multiples of ``max_image_size.longest_edge``
   (the tile side T; the short side from ``int(long / aspect)``), crop ``rows x cols`` tiles of
   ``T x T`` in raster order and append the whole image resized to ``T x T`` (the global image); an
   image that fits one tile is only the global image (rows = cols = 0). Without splitting every
   image is resized to ``T x T``;
3. every resize is Pillow on uint8 with the checkpoint's ``resample`` (SmolVLM: 1 = LANCZOS);
   then ``x * rescale_factor`` (float64 -> float32) and ``(x - mean) / std`` in float32, channels first.

Prompt (``get_image_prompt_string`` of transformers' processor): per tile
``<fake_token_around_image><row_{r}_col_{c}>`` + ``<image>`` x image_seq_len, a ``\\n`` after each
row, then ``\\n<fake_token_around_image><global-img>`` + ``<image>`` x image_seq_len +
``<fake_token_around_image>``; a single-tile image is only the global part (without the leading
``\\n``).

The resolution ladder's rungs replace ``size.longest_edge`` (how many tiles an image gets: the
family's budget knob); ``resolution_px=None`` is the checkpoint's own setting (parity).

Files read: the image processor's settings as the loader finds them (``processor_config.json``'s
nested ``image_processor``, what transformers 5 writes, else ``preprocessor_config.json``, the hub
layout); ``image_seq_len`` from ``processor_config.json`` (else from the model config).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
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
from edgevlm.runtime.models.smolvlm.config import SmolVLMConfig

logger = logging.getLogger(__name__)

MAX_IMAGE_SIDE_PX = 4096  # transformers' SmolVLM MAX_IMAGE_SIZE

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image-processor settings of a SmolVLM checkpoint (defaults: transformers' ``SmolVLMImageProcessor``)."""

    do_resize: bool = True
    longest_edge_px: int = 4 * 364
    tile_px: int = 364
    do_image_splitting: bool = True
    resample: int = 1
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_seq_len: int = 169


def _longest_edge(d: dict, key: str, default: int, where: str) -> int:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, dict) or not isinstance(value.get("longest_edge"), int) or value["longest_edge"] <= 0:
        raise ModelLoadError(f"{where}: {key} must be {{'longest_edge': positive int}}, got {value!r}")
    return value["longest_edge"]


def read_image_processor_config(pre: dict | None, model_dir: Path, cfg: SmolVLMConfig) -> ImageProcessorConfig:
    """The checkpoint's image-processor settings from ``pre`` (the loader's
    :attr:`~edgevlm.runtime.loader.ModelFiles.image_processor`: ``processor_config.json``'s
    ``image_processor`` or ``preprocessor_config.json``), and ``image_seq_len`` from
    ``processor_config.json`` in ``model_dir``.

    ``pre`` None gets transformers' class defaults with ``max_image_size`` = the encoder's tile size,
    and a logged warning. Raises :class:`ModelLoadError` naming a malformed key, or an
    ``image_seq_len`` / ``max_image_size`` that disagrees with the model config.
    """
    where = "image processor config"
    proc = read_json(Path(model_dir) / "processor_config.json", required=False)
    d = ImageProcessorConfig(tile_px=cfg.tile_px, image_seq_len=cfg.image_seq_len)
    if not isinstance(pre, dict):
        logger.warning("%s has no preprocessor_config.json or processor_config.json image_processor: using "
                       "SmolVLMImageProcessor's defaults (longest edge %d px, tiles %d px, mean/std 0.5)",
                       model_dir, d.longest_edge_px, d.tile_px)
        pre = {}

    def flag(key: str, default: bool) -> bool:
        value = pre.get(key, default)
        if not isinstance(value, bool):
            raise ModelLoadError(f"{where}: {key} must be true or false, got {value!r}")
        return value

    pil = read_pil_settings(pre, d, where)
    factor = pre.get("rescale_factor", d.rescale_factor)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ModelLoadError(f"{where}: rescale_factor must be a number, got {factor!r}")
    seq_len = (proc or {}).get("image_seq_len", cfg.image_seq_len) if isinstance(proc, dict) else cfg.image_seq_len
    if seq_len != cfg.image_seq_len:
        raise ModelLoadError(
            f"processor_config.json: image_seq_len {seq_len!r} disagrees with config.json "
            f"((image_size / patch_size)^2 / scale_factor^2 = {cfg.image_seq_len})"
        )
    tile = _longest_edge(pre, "max_image_size", d.tile_px, where)
    if tile != cfg.tile_px:
        raise ModelLoadError(f"{where}: max_image_size.longest_edge {tile} is not the encoder's "
                             f"vision_config.image_size {cfg.tile_px}")
    return ImageProcessorConfig(
        **pil,
        do_resize=flag("do_resize", d.do_resize),
        longest_edge_px=_longest_edge(pre, "size", d.longest_edge_px, where),
        tile_px=tile,
        do_image_splitting=flag("do_image_splitting", d.do_image_splitting),
        do_rescale=flag("do_rescale", d.do_rescale),
        rescale_factor=float(factor),
        do_normalize=flag("do_normalize", d.do_normalize),
        image_seq_len=seq_len,
    )


def longest_edge_size(height: int, width: int, longest_edge_px: int) -> tuple[int, int]:
    """``(H, W)`` with the longest side scaled to ``longest_edge_px`` (the other ``int(...)``, rounded
    up to even, at least 1), then scaled down so neither side exceeds 4096 px."""
    aspect = width / height
    if width >= height:
        width = longest_edge_px
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge_px
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE_PX:
        width, height = MAX_IMAGE_SIDE_PX, int(MAX_IMAGE_SIDE_PX / aspect)
    elif height > width and height > MAX_IMAGE_SIDE_PX:
        height, width = MAX_IMAGE_SIDE_PX, int(MAX_IMAGE_SIDE_PX * aspect)
    return max(height, 1), max(width, 1)


def tile_grid_size(height: int, width: int, tile_px: int) -> tuple[int, int]:
    """``(H, W)`` resized up to multiples of ``tile_px`` (the long side first, the short one from
    ``int(long / aspect)``), as transformers' ``resize_for_vision_encoder``."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile_px) * tile_px
        height = math.ceil(int(width / aspect) / tile_px) * tile_px
    else:
        height = math.ceil(height / tile_px) * tile_px
        width = math.ceil(int(height * aspect) / tile_px) * tile_px
    return max(height, tile_px), max(width, tile_px)  # never 0 (an int() rounding to 0 px)


def image_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The token string one image expands to (see the module docstring)."""
    run = IMAGE_TOKEN * image_seq_len
    glob = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{run}{FAKE_IMAGE_TOKEN}"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join(
        "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return grid + "\n" + glob


@dataclass
class Tiles:
    """One image after preprocessing: ``pixel_values`` ``(rows * cols + 1 | 1, 3, T, T)`` float32,
    the tile grid (0, 0 = global image only) and the size fed to the splitter ``(H, W)`` px."""

    pixel_values: np.ndarray
    rows: int
    cols: int
    resized_px: tuple[int, int] = (0, 0)
    extras: dict = field(default_factory=dict)


class SmolVLMProcessor(PilTileProcessor):
    """:class:`~edgevlm.runtime.models.base.Processor` of the SmolVLM family."""

    family_title = "SmolVLM"
    read_config = staticmethod(read_image_processor_config)

    def preprocess_image(self, image: np.ndarray, longest_edge_px: int | None = None) -> Tiles:
        """One ``(H, W, 3)`` uint8 RGB image -> its tiles (see the module docstring).

        Raises:
            InvalidImageError: not an ``(H, W, 3)`` uint8 array, or an empty one.
        """
        image = check_rgb(image)
        ic = self.image_cfg
        if ic.do_resize:
            h, w = longest_edge_size(image.shape[0], image.shape[1], longest_edge_px or ic.longest_edge_px)
            image = self._resize(image, h, w)
        t = ic.tile_px
        if not ic.do_image_splitting:
            return Tiles(self._normalize([self._resize(image, t, t)]), 0, 0, (t, t))
        h, w = tile_grid_size(image.shape[0], image.shape[1], t)
        image = self._resize(image, h, w)
        if h <= t and w <= t:
            return Tiles(self._normalize([image]), 0, 0, (h, w))
        rows, cols = h // t, w // t
        tiles = [image[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
        tiles.append(self._resize(image, t, t))
        return Tiles(self._normalize(tiles), rows, cols, (h, w))

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None,
                video_timestamps_s: list[float] | None = None) -> VisionInput:
        """Images (each ``(H, W, 3)`` uint8 RGB) -> :class:`VisionInput` with ``pixel_values``
        ``(N_tiles_total, 3, T, T)`` float32 (every image's tiles then its global image, images in
        order), ``extras["rows"]``/``extras["cols"]`` per image. ``resolution_px`` replaces the
        longest-edge size (None = the checkpoint's).

        Raises:
            InvalidImageError: an image that is not a non-empty ``(H, W, 3)`` uint8 array.
            InvalidRequestError: ``video`` given (this family serves images only), or a
                non-positive ``resolution_px``.
        """
        import torch

        check_image_request(self.cfg.model_type, video, resolution_px)
        per_image = [self.preprocess_image(img, resolution_px) for img in images]
        seq = self.image_cfg.image_seq_len
        pixel_values = (torch.from_numpy(np.concatenate([p.pixel_values for p in per_image]))
                        if per_image else torch.zeros(0, 3, self.image_cfg.tile_px, self.image_cfg.tile_px))
        return VisionInput(
            pixel_values=pixel_values,
            tokens_per_item=[seq * len(p.pixel_values) for p in per_image],
            kinds=["image"] * len(per_image),
            input_sizes_px=[p.resized_px for p in per_image],
            extras={"rows": [p.rows for p in per_image], "cols": [p.cols for p in per_image]},
            token_groups=[seq] * int(pixel_values.shape[0]),  # token pruning: each tile keeps its share
        )

    # -- prompt ----------------------------------------------------------------------------------

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """Replace the i-th ``<image>`` of the rendered chat template by image i's token string.

        Raises:
            InvalidRequestError: the template holds a different number of ``<image>`` placeholders
                than there are images.
        """
        parts = text.split(IMAGE_TOKEN)
        rows, cols = vision.extras.get("rows", []), vision.extras.get("cols", [])
        if len(parts) - 1 != len(rows):
            raise InvalidRequestError(f"prompt has {len(parts) - 1} {IMAGE_TOKEN} placeholders for {len(rows)} images")
        out = [parts[0]]
        for i, rest in enumerate(parts[1:]):
            tiles = rows[i] * cols[i] + 1 if rows[i] or cols[i] else 1
            seq = vision.tokens_per_item[i] // tiles  # image_seq_len, or fewer after token pruning
            out.append(image_prompt(rows[i], cols[i], seq))
            out.append(rest)
        return "".join(out)
