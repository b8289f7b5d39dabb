"""Qwen2.5-VL prompt and pixel preparation (transformers' ``Qwen2_5_VLProcessor``, without torchvision).

``prepare`` turns images and one optional video into a ``VisionInput`` with the Qwen layout
(:mod:`edgevlm.runtime.models.qwen_vl.preprocess`): items in prompt order, the images first, then
the video. ``expand_prompt`` replaces the pad token inside each ``<|vision_start|><|image_pad|><|vision_end|>``
(``<|video_pad|>`` for the video), which the hub's chat template renders per image / video content
part, by ``grid_t * grid_h * grid_w / merge_size**2`` copies.

Video timing (Qwen2.5-VL's absolute time M-RoPE): ``second_per_grid_t = temporal_patch_size / fps``,
``fps`` from the frames' timestamps (``(n - 1) / duration``, after frame sampling); without
timestamps 24 fps is assumed, as transformers does for frames without metadata (``VideoMetadata.sampled_fps``).

The resolution ladder: a rung ``resolution_px`` sets ``max_pixels = resolution_px ** 2`` per image /
video frame (and ``min_pixels`` to at most that): the area budget of ``smart_resize``, so the aspect
ratio is kept. ``None`` = the checkpoint processor's own ``min_pixels``/``max_pixels``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import torch

from edgevlm.errors import InvalidRequestError
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.models.qwen2_5_vl import read_image_config
from edgevlm.runtime.models.qwen2_5_vl.config import Qwen25VLConfig
from edgevlm.runtime.models.qwen_vl.preprocess import (
    QwenPixelConfig,
    frames_fps,
    prepare_image,
    prepare_video,
    sample_frame_indices,
)

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
DEFAULT_VIDEO_FPS = 24.0
_PAD = re.compile(re.escape(IMAGE_PAD) + "|" + re.escape(VIDEO_PAD))


class Qwen25VLProcessor:
    """Pixels and placeholder expansion of one Qwen2.5-VL checkpoint (see the module doc)."""

    def __init__(self, cfg: Qwen25VLConfig, image: QwenPixelConfig, video: QwenPixelConfig) -> None:
        self.cfg = cfg
        self.image = image
        self.video = video

    @classmethod
    def from_files(cls, files) -> Qwen25VLProcessor:
        """From a ``ModelFiles`` (``model_dir``, ``config``); ModelLoadError for bad processor files."""
        image, video = read_image_config(files.model_dir, files.config)
        return cls(files.config, image, video)

    def _rung(self, cfg: QwenPixelConfig, resolution_px: int | None) -> QwenPixelConfig:
        if resolution_px is None:
            return cfg
        if not isinstance(resolution_px, int) or resolution_px <= 0:
            raise InvalidRequestError(f"resolution_px must be a positive int, got {resolution_px!r}")
        area = resolution_px * resolution_px
        return replace(cfg, max_pixels=area, min_pixels=min(cfg.min_pixels, area))

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None, video_timestamps_s: list[float] | None = None) -> VisionInput:
        """Images (each ``(H, W, 3)`` uint8 RGB) and an optional video (frames + timestamps in s) ->
        ``VisionInput`` (``pixel_values`` ``(N_patches, C*tp*p*p)`` float32, ``grid_thw`` ``(N_items, 3)``,
        ``extras["second_per_grid_ts"]`` per item, ``extras["timestamps_s"]`` of the frames used).

        Raises:
            InvalidImageError: an image or frame that is not RGB uint8, is empty, or has an aspect
                ratio above 200:1.
            InvalidRequestError: bad video frames or timestamps.
        """
        pixels, grids, sizes, kinds, seconds = [], [], [], [], []
        image_cfg = self._rung(self.image, resolution_px)
        for image in images:
            px, grid, hw = prepare_image(image, image_cfg)
            pixels.append(px)
            grids.append(grid)
            sizes.append(hw)
            kinds.append("image")
            seconds.append(None)
        extras: dict = {}
        if video is not None:
            frames = list(video)
            fps = frames_fps(video_timestamps_s, len(frames))
            cfg = self._rung(self.video, resolution_px)
            if cfg.do_sample_frames:
                keep = sample_frame_indices(len(frames), video_fps=fps, cfg=cfg)
                frames = [frames[i] for i in keep]
                if video_timestamps_s is not None:
                    video_timestamps_s = [video_timestamps_s[i] for i in keep]
                    fps = frames_fps(video_timestamps_s, len(frames)) or fps
            px, grid, hw = prepare_video(frames, cfg)
            pixels.append(px)
            grids.append(grid)
            sizes.append(hw)
            kinds.append("video")
            seconds.append(cfg.temporal_patch_size / (fps or DEFAULT_VIDEO_FPS))
            extras["timestamps_s"] = list(video_timestamps_s) if video_timestamps_s is not None else None
        extras["second_per_grid_ts"] = seconds
        unit = self.cfg.vision.spatial_merge_size ** 2
        if pixels:
            pixel_values = torch.cat(pixels)
        else:
            row = 3 * self.image.temporal_patch_size * self.image.patch_size ** 2
            pixel_values = torch.zeros(0, row)
        grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
        return VisionInput(pixel_values=pixel_values, tokens_per_item=[t * h * w // unit for t, h, w in grids],
                           kinds=kinds, grid_thw=grid_thw, input_sizes_px=sizes, extras=extras)

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """``text`` with each image / video pad placeholder repeated ``tokens_per_item`` times, the
        placeholders matched to the items of their kind in order.

        Raises:
            InvalidRequestError: the placeholders do not match the items (count or kind), e.g. a
                prompt that itself contains ``<|image_pad|>``.
        """
        queues = {"image": [], "video": []}
        for kind, n in zip(vision.kinds, vision.tokens_per_item, strict=True):
            queues[kind].append(n)
        found = {IMAGE_PAD: 0, VIDEO_PAD: 0}
        for m in _PAD.finditer(text):
            found[m.group()] += 1
        if found[IMAGE_PAD] != len(queues["image"]) or found[VIDEO_PAD] != len(queues["video"]):
            raise InvalidRequestError(
                f"the prompt has {found[IMAGE_PAD]} image and {found[VIDEO_PAD]} video placeholders for "
                f"{len(queues['image'])} image(s) and {len(queues['video'])} video(s) "
                f"(a prompt must not contain {IMAGE_PAD} or {VIDEO_PAD} itself)"
            )
        counts = {IMAGE_PAD: iter(queues["image"]), VIDEO_PAD: iter(queues["video"])}
        return _PAD.sub(lambda m: m.group() * next(counts[m.group()]), text)
