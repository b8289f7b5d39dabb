"""Qwen3-VL preprocessing and prompt expansion (images and video), on the shared Qwen-VL pieces.

Facts from transformers' ``Qwen3VLProcessor`` and ``Qwen3VLVideoProcessor`` (5.x); the resize,
normalisation and patchify rules are :mod:`edgevlm.runtime.models.qwen_vl.preprocess`'s:

* images: the checkpoint's image processor (``Qwen2VLImageProcessor`` settings, patch 16, merge 2:
  sides are multiples of 32 px), ``<|image_pad|>`` x ``grid_h * grid_w / 4`` inside the template's
  ``<|vision_start|>..<|vision_end|>``;
* video frames are sampled (``do_sample_frames``, default on at ``fps`` 2): ``n = int(total /
  video_fps * fps)`` clamped to ``[min_frames, min(max_frames, total)]``, indices
  ``round(linspace(0, total - 1, n))``;
* the video size rule counts the frames: :func:`video_target_size`;
* text timestamps: each temporal patch (``temporal_patch_size`` frames, the last frame repeated to
  fill it) is stamped with the mean time of its first and last frame, written ``<{t:.1f} seconds>``,
  and the template's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes, per temporal patch,
  ``<t seconds><|vision_start|><|video_pad|> x (grid_h * grid_w / 4)<|vision_end|>``: the template's own
  wrapper is replaced, not kept around the frames (transformers 4.57's ``Qwen3VLProcessor`` and 5.25+; 5.x
  releases before 5.25 kept it, one more ``<|vision_start|>..<|vision_end|>`` around all frames, a regression
  5.25 reverted). A bare ``<|video_pad|>`` becomes the frames' runs alone.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import replace

import numpy as np
import torch

from edgevlm.errors import InvalidImageError, InvalidRequestError
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.models.qwen3_vl.config import Qwen3VLConfig
from edgevlm.runtime.models.qwen_vl.preprocess import (
    MAX_ASPECT_RATIO,
    QwenPixelConfig,
    frames_fps,
    normalize,
    patchify,
    prepare_image,
    resize_frames,
)

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

#: transformers' fallback frame rate when a video comes without timestamps.
DEFAULT_VIDEO_FPS = 24.0


def video_target_size(num_frames: int, height_px: int, width_px: int, cfg: QwenPixelConfig) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: ``(height_px, width_px)`` multiples of ``cfg.factor`` with
    ``t * h * w`` (``t`` = frames rounded to a multiple of ``temporal_patch_size``) within
    ``[min_pixels, max_pixels]``; a side below one merged patch is first scaled up to it.

    Raises:
        InvalidRequestError: fewer frames than ``temporal_patch_size``.
        InvalidImageError: an aspect ratio above 200.
    """
    factor, tp = cfg.factor, cfg.temporal_patch_size
    if num_frames < tp:
        raise InvalidRequestError(f"video: {num_frames} frame(s); Qwen3-VL needs at least {tp}")
    h, w = height_px, width_px
    if h < factor or w < factor:
        scale = max(factor / h, factor / w)
        h, w = int(h * scale), int(w * scale)
    if max(h, w) / min(h, w) > MAX_ASPECT_RATIO:
        raise InvalidImageError(f"video frame aspect ratio {max(h, w) / min(h, w):.1f}:1 ({width_px}x{height_px} "
                                f"px) is above the {MAX_ASPECT_RATIO}:1 that Qwen-VL processors accept")
    h_bar, w_bar = round(h / factor) * factor, round(w / factor) * factor
    t_bar = round(num_frames / tp) * tp
    if t_bar * h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt(num_frames * h * w / cfg.max_pixels)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * h * w))
        h_bar = math.ceil(h * beta / factor) * factor
        w_bar = math.ceil(w * beta / factor) * factor
    return h_bar, w_bar


def sample_frames(total: int, video_fps: float, cfg: QwenPixelConfig) -> list[int]:
    """Indices of the frames Qwen3-VL keeps of ``total`` frames at ``video_fps`` (module doc)."""
    if not cfg.do_sample_frames:
        return list(range(total))
    n = cfg.num_frames
    if n is None and cfg.fps is not None:
        n = min(max(int(total / video_fps * cfg.fps), cfg.min_frames), cfg.max_frames, total)
    if n is None:
        n = min(max(total, cfg.min_frames), cfg.max_frames)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def patch_times_s(frame_times_s: list[float], temporal_patch_size: int) -> list[float]:
    """One time per temporal patch: the mean of its first and last frame's (last frame repeated)."""
    ts = list(frame_times_s)
    ts += [ts[-1]] * (-len(ts) % temporal_patch_size)
    return [(ts[i] + ts[i + temporal_patch_size - 1]) / 2 for i in range(0, len(ts), temporal_patch_size)]


def ladder_config(cfg: QwenPixelConfig, resolution_px: int | None, frames: int = 1) -> QwenPixelConfig:
    """The settings at a resolution-ladder rung: ``max_pixels = frames * resolution_px ** 2`` (the rule of
    Qwen2.5-VL's processor, per frame: Qwen3-VL's video budget spans all frames), ``min_pixels``
    lowered to fit; None = the checkpoint's own settings.

    Raises ``InvalidRequestError`` for a rung that is not a positive int."""
    if resolution_px is None:
        return cfg
    if not isinstance(resolution_px, int) or isinstance(resolution_px, bool) or resolution_px <= 0:
        raise InvalidRequestError(f"resolution_px must be a positive int, got {resolution_px!r}")
    area = frames * resolution_px * resolution_px
    return replace(cfg, max_pixels=area, min_pixels=min(cfg.min_pixels, area))


class Qwen3VLProcessor:
    """Images / video -> :class:`VisionInput` (``pixel_values`` ``(N_patches, 3*2*16*16)`` float32,
    ``grid_thw`` ``(N_items, 3)`` int64, images first then the video, as the prompt orders them) and
    the expanded prompt text."""

    def __init__(self, cfg: Qwen3VLConfig, image: QwenPixelConfig, video: QwenPixelConfig) -> None:
        self.cfg = cfg
        self.image = image
        self.video = video

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None, video_timestamps_s: list[float] | None = None) -> VisionInput:
        """``images``: ``(H, W, 3)`` uint8 RGB; ``video``: frames of one clip (same size), with their
        capture times in seconds (None: transformers' 24 fps is assumed). ``resolution_px``: a
        max_pixels rung (:func:`ladder_config`) for the images and, per frame, the video.

        Raises:
            InvalidImageError: an image or frame that is not RGB uint8, or an aspect ratio above 200.
            InvalidRequestError: a bad video (no frames, frames of different sizes, one frame,
                timestamps that do not match or do not increase), or a rung that is not a positive int.
        """
        pixels, grids, sizes, kinds, tokens = [], [], [], [], []
        image_cfg = ladder_config(self.image, resolution_px)
        merge2 = self.image.merge_size**2
        for image in images:
            px, grid, size = prepare_image(image, image_cfg)
            pixels.append(px)
            grids.append(grid)
            sizes.append(size)
            kinds.append("image")
            tokens.append(grid[0] * grid[1] * grid[2] // merge2)
        extras: dict = {}
        if video is not None:
            px, grid, size, times = self._prepare_video(video, video_timestamps_s, resolution_px)
            pixels.append(px)
            grids.append(grid)
            sizes.append(size)
            kinds.append("video")
            tokens.append(grid[0] * grid[1] * grid[2] // merge2)
            extras["patch_times_s"] = [times]
        if not pixels:
            return VisionInput(pixel_values=torch.zeros(0, 3 * 2 * 16 * 16), tokens_per_item=[], kinds=[],
                               grid_thw=torch.zeros(0, 3, dtype=torch.int64), input_sizes_px=[], extras=extras)
        return VisionInput(pixel_values=torch.cat(pixels), tokens_per_item=tokens, kinds=kinds,
                           grid_thw=torch.tensor(grids, dtype=torch.int64), input_sizes_px=sizes, extras=extras)

    def _prepare_video(self, frames: list[np.ndarray], timestamps_s: list[float] | None,
                       resolution_px: int | None):
        if not frames:
            raise InvalidRequestError("video: no frames")
        for i, f in enumerate(frames):
            if not isinstance(f, np.ndarray) or f.ndim != 3 or f.shape[2] != 3 or f.dtype != np.uint8 \
                    or 0 in f.shape:
                raise InvalidImageError(f"video frame {i}: expected a non-empty (H, W, 3) uint8 RGB array, got "
                                        f"{getattr(f, 'shape', None)} {getattr(f, 'dtype', type(f).__name__)}")
        if len({f.shape for f in frames}) != 1:
            raise InvalidRequestError(f"video: frames differ in size ({sorted({f.shape[:2] for f in frames})})")
        fps = frames_fps(timestamps_s, len(frames))
        if fps is None:
            if timestamps_s is None:
                logger.warning("video without frame timestamps: assuming %.0f fps, as transformers does",
                               DEFAULT_VIDEO_FPS)
            fps = DEFAULT_VIDEO_FPS
        keep = sample_frames(len(frames), fps, self.video)
        times = [(timestamps_s[i] - timestamps_s[0]) if timestamps_s is not None else i / fps for i in keep]
        cfg = ladder_config(self.video, resolution_px, frames=len(keep))
        h, w = video_target_size(len(keep), frames[0].shape[0], frames[0].shape[1], cfg)
        x = normalize(resize_frames(np.stack([frames[i] for i in keep]), h, w), cfg)  # (T, 3, h, w) float32
        px, grid = patchify(x, cfg)
        return px, grid, (h, w), patch_times_s(times, cfg.temporal_patch_size)

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """Replace the template's ``<|image_pad|>`` / ``<|video_pad|>`` (one per item, in order) by
        each item's token run (module doc).

        Raises ``InvalidRequestError`` when the placeholders do not match ``vision.kinds``."""
        placeholder = re.compile("|".join(map(re.escape, (VISION_START + VIDEO_TOKEN + VISION_END, IMAGE_TOKEN,
                                                          VIDEO_TOKEN))))  # the wrapped video first: it is replaced whole
        kinds = [("image" if m.group() == IMAGE_TOKEN else "video") for m in placeholder.finditer(text)]
        if kinds != list(vision.kinds):
            raise InvalidRequestError(f"prompt has vision placeholders {kinds} but the input has {list(vision.kinds)}")
        merge2 = self.image.merge_size**2
        times = iter(vision.extras.get("patch_times_s", []))
        runs = []
        for kind, (_, h, w), n in zip(vision.kinds, vision.grid_thw.tolist(), vision.tokens_per_item, strict=True):
            per_frame = h * w // merge2
            if kind == "image":
                runs.append(IMAGE_TOKEN * n)  # t * per_frame, or fewer after token pruning
                continue
            stamps = next(times)
            runs.append("".join(f"<{s:.1f} seconds>{VISION_START}{VIDEO_TOKEN * per_frame}{VISION_END}"
                                for s in stamps))
        it = iter(runs)
        return placeholder.sub(lambda m: next(it), text)
