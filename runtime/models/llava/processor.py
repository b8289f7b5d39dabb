"""LLaVA preprocessing and prompt expansion: what transformers' ``LlavaProcessor`` does, plus the
resolution ladder.

Two ways to size an image:

* ``resolution_px=None`` with a checkpoint that declares its image processor (``size`` in
  ``processor_config.json``'s ``image_processor`` — transformers 5 — or ``preprocessor_config.json``):
  exactly the checkpoint's processor at its default settings, so that answers match a transformers
  deployment. CLIP (``CLIPImageProcessor``): shortest edge to ``size.shortest_edge`` (the long side
  ``int(s * long / short)``, transformers' ``get_resize_output_image_size``), PIL resize with the
  config's ``resample`` (bicubic), center crop to ``crop_size`` (top/left ``(H - h) // 2``, zero
  padding when the image is smaller); SigLIP (``SiglipImageProcessor``): resize to
  ``size.height x size.width``. Then ``x * rescale_factor`` (in float64, as transformers) and
  ``(x - mean) / std`` in float32. A 480x640 frame at CLIP-336 is 336x448, cropped to 336x336.
* a resolution-ladder rung (``resolution_px`` set, or a checkpoint without a declared processor,
  e.g. the demo model): edgevlm's aspect-keeping resize (:func:`edgevlm.runtime.preprocess.preprocess`,
  the longer side = the rung, both sides multiples of the patch, OpenCV area / cubic filter), the
  whole field of view on a non-square patch grid. This is a deliberate difference from
  transformers (no crop: objects at the frame's edges stay visible) and what the daemon's latency
  controller picks among.

Normalisation comes from the same config (``image_mean`` / ``image_std``); a checkpoint without it
is logged as a WARNING and normalised with the tower's transformers defaults (CLIP's constants,
SigLIP's 0.5).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgevlm.errors import InvalidImageError, InvalidRequestError
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.models.llava.config import LlavaConfig
from edgevlm.runtime.preprocess import CLIP_MEAN, CLIP_STD, preprocess, resize_for_encoder

logger = logging.getLogger(__name__)

#: transformers' ``IMAGENET_STANDARD_MEAN`` / ``_STD``: SiglipImageProcessor's defaults
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
_PIL_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclass(frozen=True)
class ImageProcessorSpec:
    """The image-processor settings of a checkpoint that parity needs (transformers' names).

    ``size``: ``{"shortest_edge": s}`` or ``{"height": h, "width": w}``; ``crop_size``:
    ``{"height": h, "width": w}`` or None (no center crop); ``resample``: PIL filter number."""

    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    size: dict | None = None
    crop_size: dict | None = None
    resample: int = _PIL_BICUBIC
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def native(self) -> bool:
        """Whether the checkpoint declares how to size images (else the ladder is used)."""
        return self.size is not None


def _triple(value) -> tuple[float, float, float] | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value):
        return tuple(float(v) for v in value)
    return None


def _hw(value) -> dict | None:
    """A ``size`` / ``crop_size`` entry as transformers reads it (an int = a square)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value}
    if isinstance(value, dict):
        if isinstance(value.get("shortest_edge"), int):
            return {"shortest_edge": value["shortest_edge"]}
        if isinstance(value.get("height"), int) and isinstance(value.get("width"), int):
            return {"height": value["height"], "width": value["width"]}
    return None


def image_processor_spec(raw: dict | None, cfg: LlavaConfig, model_dir: Path | str = "") -> ImageProcessorSpec:
    """Read the parity settings from an image-processor dict (``ModelFiles.image_processor``; None
    when the checkpoint has none). Missing normalisation is a logged WARNING (tower defaults)."""
    raw = raw or {}
    defaults = (CLIP_MEAN, CLIP_STD) if cfg.vision_has_cls else (SIGLIP_MEAN, SIGLIP_STD)
    mean, std = _triple(raw.get("image_mean")), _triple(raw.get("image_std"))
    if mean is None or std is None:
        logger.warning(
            "%s: no image_mean/image_std in processor_config.json or preprocessor_config.json: normalising "
            "with the %s tower's defaults %s / %s (add the checkpoint's processor config if it differs)",
            model_dir, "CLIP" if cfg.vision_has_cls else "SigLIP", defaults[0], defaults[1])
        mean, std = mean or defaults[0], std or defaults[1]
    size = _hw(raw.get("size")) if raw.get("do_resize", True) else None
    crop = _hw(raw.get("crop_size")) if raw.get("do_center_crop", False) else None
    if crop is not None and "shortest_edge" in crop:
        crop = None
    resample = raw.get("resample", _PIL_BICUBIC)
    factor = raw.get("rescale_factor", 1 / 255)
    return ImageProcessorSpec(
        image_mean=mean, image_std=std, size=size, crop_size=crop,
        resample=resample if isinstance(resample, int) and not isinstance(resample, bool) else _PIL_BICUBIC,
        rescale_factor=float(factor) if isinstance(factor, (int, float)) else 1 / 255,
        do_rescale=bool(raw.get("do_rescale", True)), do_normalize=bool(raw.get("do_normalize", True)),
    )


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """``(H, W, C)`` -> ``(height, width, C)``: transformers' ``center_crop`` (zero-padded when smaller)."""
    h, w = x.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[top:top + height, left:left + width]
    nh, nw = max(height, h), max(width, w)
    padded = np.zeros((nh, nw, x.shape[2]), x.dtype)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded[tp:tp + h, lp:lp + w] = x
    top, left = top + tp, left + lp
    return padded[max(0, top):min(nh, top + height), max(0, left):min(nw, left + width)]


def hf_preprocess(image_rgb: np.ndarray, spec: ImageProcessorSpec) -> np.ndarray:
    """One ``(H, W, 3)`` uint8 RGB image -> ``(3, H', W')`` float32, as the checkpoint's transformers
    image processor (PIL backend) does at its default settings (see the module docstring)."""
    from PIL import Image

    x = image_rgb
    if spec.size is not None:
        h, w = x.shape[:2]
        if "shortest_edge" in spec.size:
            s = spec.size["shortest_edge"]
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(s * long / short)
            th, tw = (new_long, s) if w <= h else (s, new_long)
        else:
            th, tw = spec.size["height"], spec.size["width"]
        x = np.asarray(Image.fromarray(x).resize((tw, th), resample=spec.resample))
    if spec.crop_size is not None:
        x = _center_crop(x, spec.crop_size["height"], spec.crop_size["width"])
    y = (x.astype(np.float64) * spec.rescale_factor).astype(np.float32) if spec.do_rescale else x.astype(np.float32)
    if spec.do_normalize:
        y = (y - np.asarray(spec.image_mean, np.float32)) / np.asarray(spec.image_std, np.float32)
    return np.ascontiguousarray(y.transpose(2, 0, 1))  # (3, H', W')


def image_token_string(model_dir: Path, image_token_id: int) -> str:
    """The image placeholder's text: the added token with ``image_token_id`` in ``tokenizer.json``
    (``"<image>"`` when it is not an added token)."""
    try:
        data = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "<image>"
    for tok in data.get("added_tokens") or []:
        if isinstance(tok, dict) and tok.get("id") == image_token_id and isinstance(tok.get("content"), str):
            return tok["content"]
    return "<image>"


class LlavaProcessor:
    """LLaVA's :class:`~edgevlm.runtime.models.base.Processor`: images in, ``(N_img, 3, H, W)``
    pixels and N x the image token per image out."""

    def __init__(self, cfg: LlavaConfig, spec: ImageProcessorSpec, image_token: str) -> None:
        self.cfg = cfg
        self.spec = spec
        self.image_token = image_token

    @property
    def image_mean(self) -> tuple[float, float, float]:
        return self.spec.image_mean

    @property
    def image_std(self) -> tuple[float, float, float]:
        return self.spec.image_std

    def preprocess_image(self, image_rgb: np.ndarray, resolution_px: int | None = None) -> np.ndarray:
        """``(H, W, 3)`` uint8 -> ``(3, H', W')`` float32: the checkpoint's processor for
        ``resolution_px=None`` (when it declares one), else the aspect-keeping ladder rung
        (``resolution_px`` or the tower's ``image_size``)."""
        if resolution_px is None and self.spec.native:
            return hf_preprocess(image_rgb, self.spec)
        rung = resolution_px or self.cfg.vision.image_size
        return preprocess(image_rgb, rung, self.cfg.vision.patch_size, self.spec.image_mean, self.spec.image_std)

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None,
                video_timestamps_s: list[float] | None = None, uint8_pixels: bool = False) -> VisionInput:
        """See :class:`~edgevlm.runtime.models.base.Processor`. ``uint8_pixels``: where the ladder
        rung applies (not the checkpoint's own processor), ``pixel_values`` are the resized images
        ``(N_img, H, W, 3)`` uint8, normalised later with :attr:`image_mean` / :attr:`image_std`
        (the batched GPU encoder does it on the device); else ``(N_img, 3, H, W)`` float32. Raises
        InvalidRequestError for video or no image, InvalidImageError for images that come out at
        different sizes."""
        import torch

        if video is not None:
            raise InvalidRequestError("LLaVA models take images, not video")
        if not images:
            raise InvalidRequestError("LLaVA needs at least one image")
        if uint8_pixels and not (resolution_px is None and self.spec.native):
            rung = resolution_px or self.cfg.vision.image_size
            arrays = [resize_for_encoder(im, rung, self.cfg.vision.patch_size) for im in images]  # (H, W, 3)
            sizes = [a.shape[:2] for a in arrays]
        else:
            arrays = [self.preprocess_image(im, resolution_px) for im in images]  # (3, H, W)
            sizes = [(a.shape[1], a.shape[2]) for a in arrays]
        if len(set(sizes)) != 1:
            raise InvalidImageError(f"the images resize to different sizes {sorted(set(sizes))}: "
                                    "give images of one aspect ratio")
        return VisionInput(pixel_values=torch.from_numpy(np.stack(arrays)),  # (N_img, 3, H, W) | (N_img, H, W, 3)
                           tokens_per_item=[self.cfg.num_vision_tokens(h, w) for h, w in sizes],
                           kinds=["image"] * len(arrays), input_sizes_px=sizes)

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """Each image placeholder of the rendered ``text`` -> that image's vision tokens' count of
        placeholders (``LlavaProcessor``'s expansion). Raises InvalidRequestError when the
        placeholders are not one per image (the prompt itself held the image token)."""
        parts = text.split(self.image_token)
        n = len(vision.tokens_per_item)
        if len(parts) - 1 != n:
            found = len(parts) - 1
            raise InvalidRequestError(
                f"the prompt must not contain the image token {self.image_token!r} "
                f"(found {found - n} in the prompt)" if found > n else
                f"the chat template rendered {found} image placeholder(s) for {n} image(s)")
        out = [parts[0]]
        for count, part in zip(vision.tokens_per_item, parts[1:], strict=True):
            out.append(self.image_token * count + part)
        return "".join(out)


def read_image_config(model_dir: Path, cfg: LlavaConfig) -> ImageProcessorSpec:
    """The checkpoint's image-processor settings as :func:`make_processor` reads them (the family's
    ``read_image_config``; torch-free)."""
    from edgevlm.model_folder import read_image_processor

    return image_processor_spec(read_image_processor(Path(model_dir)), cfg, model_dir)


def make_processor(files) -> LlavaProcessor:
    """The processor of a LLaVA checkpoint (:class:`~edgevlm.runtime.loader.ModelFiles`)."""
    cfg = files.config
    spec = image_processor_spec(files.image_processor, cfg, files.model_dir)
    return LlavaProcessor(cfg, spec, image_token_string(files.model_dir, cfg.image_token_id))
