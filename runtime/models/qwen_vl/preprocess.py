"""Qwen-VL image and video preprocessing: ``smart_resize``, normalisation, patchify (Qwen2-VL and later).

Facts from transformers' Qwen2-VL image and video processors (``image_processing_pil_qwen2_vl.py``,
``video_processing_qwen2_vl.py``), which Qwen2.5-VL and Qwen3-VL reuse:

- ``smart_resize``: both sides become multiples of ``factor = patch_size * merge_size``, the area stays
  within ``[min_pixels, max_pixels]``, the aspect ratio is kept as closely as possible; an aspect
  ratio above 200 is refused.
- Images are resized with Pillow's bicubic filter on the uint8 image (transformers'
  ``Qwen2VLImageProcessorPil``, the backend it uses when torchvision is absent; its torchvision
  backend resamples with torch's antialiased bicubic instead and differs by a few levels of 255).
  Video frames are resized with torch's antialiased bicubic on uint8 (``torchvision``'s
  ``resize``, which the only Qwen2-VL video processor uses).
- Then ``x / 255``, ``(x - mean) / std`` per channel, and the patchify below.
- Patchify: frames ``(T, C, H, W)`` (an image is one frame repeated ``temporal_patch_size``
  times; a video with a frame count that is not a multiple of it repeats its last frame) become
  ``(grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size ** 2)`` rows in the order
  ``(t, h / merge, w / merge, merge_h, merge_w)``, each row laid out ``(C, T, p, p)``:
  the layout of the vision tower's Conv3d patch embedding; ``grid_thw = (grid_t, grid_h, grid_w)``
  in patches.
- Frame sampling (``Qwen2VLVideoProcessor.sample_frames``): with a target ``fps``, ``n = total /
  video_fps * fps`` clamped to ``[min_frames, min(max_frames, total)]`` and floored to a multiple
  of ``temporal_patch_size``; with ``num_frames``, rounded to a multiple of it; indices
  ``arange(0, total, total / n)``.

Processor settings are read from the checkpoint folder: ``processor_config.json`` (transformers 5:
nested ``image_processor`` / ``video_processor``), else ``preprocessor_config.json`` and
``video_preprocessor_config.json``; the video settings fall back to the image file's keys over
the video processor's defaults, as transformers' ``AutoVideoProcessor`` does.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

# Defaults of transformers' Qwen2VLImageProcessor / Qwen2VLVideoProcessor (OpenAI CLIP mean/std).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenPixelConfig:
    """One Qwen-VL image or video processor's settings (pixels are areas in px**2)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    # video only
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768

    @property
    def factor(self) -> int:
        """Side multiple after resizing: one merged patch (px)."""
        return self.patch_size * self.merge_size


#: transformers' Qwen2VLImageProcessor defaults (4 to 1280 merged patches).
IMAGE_DEFAULTS = QwenPixelConfig()
#: transformers' Qwen2VLVideoProcessor defaults (128 to 768 merged patches per frame).
VIDEO_DEFAULTS = QwenPixelConfig(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
#: transformers' Qwen3VLVideoProcessor class defaults (what a checkpoint's file leaves out).
QWEN3_VIDEO_DEFAULTS = QwenPixelConfig(
    min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16, temporal_patch_size=2, merge_size=2,
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), do_sample_frames=True, fps=2.0,
    min_frames=4, max_frames=768,
)


def _apply_keys(base: QwenPixelConfig, d: dict, where: str) -> QwenPixelConfig:
    """``base`` with the keys of one processor dict applied (``size`` first, then ``min_pixels``/
    ``max_pixels``, which override it as the processor's ``__init__`` does)."""
    changes: dict = {}

    def num(key: str, value, typ=int):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        if not ok or (typ is int and value != int(value)):
            raise ModelLoadError(f"{where}: {key} must be a positive {typ.__name__}, got {value!r}")
        return typ(value)

    size = d.get("size")
    if isinstance(size, dict):
        if size.get("shortest_edge") is not None:
            changes["min_pixels"] = num("size.shortest_edge", size["shortest_edge"])
        if size.get("longest_edge") is not None:
            changes["max_pixels"] = num("size.longest_edge", size["longest_edge"])
    elif size is not None:
        raise ModelLoadError(f"{where}: size must be an object with shortest_edge/longest_edge, got {size!r}")
    for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                "min_frames", "max_frames"):
        if d.get(key) is not None:
            changes[key] = num(key, d[key])
    if d.get("num_frames") is not None:
        changes["num_frames"] = num("num_frames", d["num_frames"])
    if d.get("fps") is not None:
        changes["fps"] = num("fps", d["fps"], float)
    if d.get("rescale_factor") is not None:
        changes["rescale_factor"] = num("rescale_factor", d["rescale_factor"], float)
    if d.get("do_sample_frames") is not None:
        changes["do_sample_frames"] = bool(d["do_sample_frames"])
    for key in ("image_mean", "image_std"):
        value = d.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value] * 3
        if not (isinstance(value, list) and len(value) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ModelLoadError(f"{where}: {key} must be a list of 3 numbers, got {value!r}")
        if key == "image_std" and any(v <= 0 for v in value):
            raise ModelLoadError(f"{where}: image_std must be positive, got {value!r}")
        changes[key] = tuple(float(v) for v in value)
    for key in ("do_normalize", "do_rescale"):
        if d.get(key) is False:
            raise ModelLoadError(f"{where}: {key}: false is not supported (Qwen-VL checkpoints normalise)")
    cfg = replace(base, **changes)
    if cfg.min_pixels > cfg.max_pixels:
        raise ModelLoadError(f"{where}: min_pixels {cfg.min_pixels} is larger than max_pixels {cfg.max_pixels}")
    return cfg


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: top level must be a JSON object")
    return value


def read_pixel_configs(model_dir: str | Path, *, patch_size: int, temporal_patch_size: int, merge_size: int,
                       image_defaults: QwenPixelConfig = IMAGE_DEFAULTS,
                       video_defaults: QwenPixelConfig = VIDEO_DEFAULTS) -> tuple[QwenPixelConfig, QwenPixelConfig]:
    """The ``(image, video)`` processor settings of a Qwen-VL checkpoint folder (see the module doc).

    ``image_defaults`` / ``video_defaults``: the family's processor class defaults, under the keys
    the files set (Qwen2-VL's by default; Qwen3-VL's video processor differs). ``patch_size``,
    ``temporal_patch_size`` and ``merge_size`` are the vision config's: a processor file that
    disagrees with them raises ModelLoadError naming the key. A folder without any processor file
    gets the defaults and a logged warning.
    """
    model_dir = Path(model_dir)
    tower = QwenPixelConfig(patch_size=patch_size, temporal_patch_size=temporal_patch_size, merge_size=merge_size)
    image_base = replace(image_defaults, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                         merge_size=merge_size)
    video_base = replace(video_defaults, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                         merge_size=merge_size)
    nested = _read_json(model_dir / "processor_config.json") or {}
    image_d, image_where = nested.get("image_processor"), "processor_config.json: image_processor"
    video_d, video_where = nested.get("video_processor"), "processor_config.json: video_processor"
    if not isinstance(image_d, dict):
        image_d, image_where = _read_json(model_dir / "preprocessor_config.json"), "preprocessor_config.json"
    if not isinstance(video_d, dict):
        video_d, video_where = _read_json(model_dir / "video_preprocessor_config.json"), \
            "video_preprocessor_config.json"
    if image_d is None:
        logger.warning("%s has no processor_config.json or preprocessor_config.json: using the processor "
                       "defaults (mean %s, std %s, min_pixels %d, max_pixels %d)", model_dir,
                       image_base.image_mean, image_base.image_std, image_base.min_pixels, image_base.max_pixels)
        image_d, image_where = {}, "defaults"
    image = _apply_keys(image_base, image_d, image_where)
    if video_d is None:  # AutoVideoProcessor reads the image processor's file
        video_d, video_where = image_d, image_where
    video = _apply_keys(video_base, video_d, video_where)
    for cfg, where in ((image, image_where), (video, video_where)):
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(cfg, key) != getattr(tower, key):
                raise ModelLoadError(f"{where}: {key} {getattr(cfg, key)} differs from the vision config's "
                                     f"{getattr(tower, key)}")
    return image, video


def smart_resize(height_px: int, width_px: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's target size ``(height_px, width_px)``: multiples of ``factor``, area within
    ``[min_pixels, max_pixels]``, aspect ratio kept (rounding rules of transformers' ``smart_resize``).

    Raises:
        InvalidImageError: a side is not positive, or the aspect ratio is above 200 (transformers
            raises ``ValueError`` there).
    """
    if height_px <= 0 or width_px <= 0:
        raise InvalidImageError(f"image size must be positive, got {width_px}x{height_px} px")
    aspect = max(height_px, width_px) / min(height_px, width_px)
    if aspect > MAX_ASPECT_RATIO:
        raise InvalidImageError(
            f"image aspect ratio {aspect:.1f}:1 ({width_px}x{height_px} px) is above the "
            f"{MAX_ASPECT_RATIO}:1 that Qwen-VL processors accept"
        )
    h_bar = round(height_px / factor) * factor
    w_bar = round(width_px / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height_px * width_px) / max_pixels)
        h_bar = max(factor, math.floor(height_px / beta / factor) * factor)
        w_bar = max(factor, math.floor(width_px / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height_px * width_px))
        h_bar = math.ceil(height_px * beta / factor) * factor
        w_bar = math.ceil(width_px * beta / factor) * factor
    return h_bar, w_bar


def _check_rgb(image: np.ndarray, what: str) -> None:
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        shape = getattr(image, "shape", None)
        raise InvalidImageError(f"{what}: expected an (H, W, 3) uint8 RGB array, got {shape} "
                                f"{getattr(image, 'dtype', type(image).__name__)}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise InvalidImageError(f"{what}: empty image ({image.shape[1]}x{image.shape[0]} px)")


def resize_image(image: np.ndarray, height_px: int, width_px: int) -> np.ndarray:
    """Pillow bicubic resize of an ``(H, W, 3)`` uint8 RGB image to ``(height_px, width_px, 3)``
    uint8 (transformers' ``Qwen2VLImageProcessorPil``). Needs Pillow (the ``runtime`` extra)."""
    if image.shape[:2] == (height_px, width_px):
        return image
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("Qwen-VL image preprocessing needs Pillow: pip install 'edgevlm[runtime]'") from exc
    return np.array(Image.fromarray(image).resize((width_px, height_px), Image.BICUBIC))  # writable copy


def resize_frames(frames: np.ndarray, height_px: int, width_px: int):
    """Antialiased bicubic resize of uint8 frames ``(T, H, W, 3)`` -> torch uint8 ``(T, 3, h, w)``
    (torch's uint8 kernel, which torchvision's ``resize`` calls: transformers' video processor)."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # (T, 3, H, W) uint8
    if x.shape[-2:] == (height_px, width_px):
        return x
    return F.interpolate(x, size=(height_px, width_px), mode="bicubic", antialias=True, align_corners=False)


def normalize(frames, cfg: QwenPixelConfig):
    """uint8 ``(T, 3, H, W)`` torch tensor -> float32 ``(x * rescale_factor - mean) / std``, in the
    order of transformers' (rescale, then normalise, in float32)."""
    import torch

    x = frames.to(torch.float32) * cfg.rescale_factor
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(cfg.image_std, dtype=torch.float32)[:, None, None]
    return (x - mean) / std


def patchify(frames, cfg: QwenPixelConfig):
    """Float frames ``(T, C, H, W)`` (H, W multiples of ``cfg.factor``) -> ``(pixel_values
    (grid_t*grid_h*grid_w, C*tp*p*p) float32, (grid_t, grid_h, grid_w))``. A frame count that is
    not a multiple of ``temporal_patch_size`` repeats the last frame (transformers' video patchify)."""
    import torch

    t, c, h, w = frames.shape
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -t % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
        t += pad
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    # (gt, gh/m, gw/m, m_h, m_w, C, tp, p, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p).contiguous(), (gt, gh, gw)


def image_target_size(image: np.ndarray, cfg: QwenPixelConfig) -> tuple[int, int]:
    """``(height_px, width_px)`` the image is resized to; InvalidImageError for what cannot be."""
    _check_rgb(image, "image")
    return smart_resize(image.shape[0], image.shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)


def prepare_image(image: np.ndarray, cfg: QwenPixelConfig):
    """One ``(H, W, 3)`` uint8 RGB image -> ``(pixel_values (N, C*tp*p*p) float32, grid_thw (1, gh, gw),
    (h_px, w_px) fed to the encoder)``. Raises InvalidImageError (see :func:`smart_resize`)."""
    import torch

    h, w = image_target_size(image, cfg)
    resized = resize_image(image, h, w)  # (h, w, 3) uint8
    x = normalize(torch.from_numpy(np.ascontiguousarray(resized)).permute(2, 0, 1)[None], cfg)  # (1, 3, h, w)
    x = x.expand(cfg.temporal_patch_size, -1, -1, -1)  # an image is tp copies of one frame
    pixels, grid = patchify(x, cfg)
    return pixels, grid, (h, w)


def prepare_video(frames: list[np.ndarray], cfg: QwenPixelConfig):
    """Video frames (each ``(H, W, 3)`` uint8 RGB, all one size) -> ``(pixel_values, grid_thw,
    (h_px, w_px))`` like :func:`prepare_image` (every frame resized to one ``smart_resize`` size).

    Raises:
        InvalidRequestError: no frames, or frames of different sizes.
        InvalidImageError: a frame is not an RGB uint8 array or cannot be resized.
    """
    if not frames:
        raise InvalidRequestError("video: no frames")
    for i, f in enumerate(frames):
        _check_rgb(f, f"video frame {i}")
    if len({f.shape for f in frames}) != 1:
        raise InvalidRequestError(f"video: frames differ in size ({sorted({f.shape[:2] for f in frames})})")
    h, w = smart_resize(frames[0].shape[0], frames[0].shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)
    x = normalize(resize_frames(np.stack(frames), h, w), cfg)  # (T, 3, h, w)
    pixels, grid = patchify(x, cfg)
    return pixels, grid, (h, w)


def sample_frame_indices(total_frames: int, *, video_fps: float | None, cfg: QwenPixelConfig,
                         fps: float | None = None, num_frames: int | None = None) -> list[int]:
    """Indices of the frames to keep of ``total_frames`` (see the module doc; ``fps``/``num_frames``
    default to ``cfg``'s, and with neither every frame is kept). ``video_fps``: the frame rate of
    the frames given (needed with ``fps``).

    Raises:
        InvalidRequestError: both ``fps`` and ``num_frames``, ``fps`` without ``video_fps``, or
            more frames asked than there are.
    """
    if fps is not None and num_frames is not None:
        raise InvalidRequestError("video: fps and num_frames are mutually exclusive")
    if fps is None and num_frames is None:
        num_frames, fps = cfg.num_frames, cfg.fps
    tp = cfg.temporal_patch_size
    n: float | int | None = None
    if num_frames is not None:
        n = round(num_frames / tp) * tp
    elif fps is not None:
        if not video_fps:
            raise InvalidRequestError("video: sampling at an fps needs the frames' timestamps")
        max_frames = math.floor(min(cfg.max_frames, total_frames) / tp) * tp
        n = total_frames / video_fps * fps
        n = min(max(n, cfg.min_frames), max_frames, total_frames)
        n = math.floor(n / tp) * tp
    if n is None:
        return list(range(total_frames))
    if n > total_frames or n <= 0:
        raise InvalidRequestError(f"video: cannot sample {n} frames from {total_frames}")
    import torch

    return torch.arange(0, total_frames, total_frames / n).int().tolist()


def frames_fps(timestamps_s: list[float] | None, n_frames: int) -> float | None:
    """Frame rate of frames taken at ``timestamps_s`` (seconds, increasing): ``(n - 1) / duration``;
    None without timestamps or with fewer than two frames.

    Raises:
        InvalidRequestError: a count that differs from the frames', or timestamps that do not increase.
    """
    if timestamps_s is None:
        return None
    if len(timestamps_s) != n_frames:
        raise InvalidRequestError(f"video: {len(timestamps_s)} timestamps for {n_frames} frames")
    if any(b <= a for a, b in zip(timestamps_s[:-1], timestamps_s[1:], strict=True)):
        raise InvalidRequestError("video: frame timestamps must increase")
    if n_frames < 2:
        return None
    return (n_frames - 1) / (timestamps_s[-1] - timestamps_s[0])
