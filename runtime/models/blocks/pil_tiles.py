"""Pillow resize, tile normalisation, the resample / mean / std settings reader and the image-only request
check shared by the PIL processors (SmolVLM / Idefics3, InternVL, Gemma 3).

Both follow transformers' slow (PIL) image processors: resize a ``(H, W, 3)`` uint8 image with the
checkpoint's ``resample`` filter code (transformers' ``PILImageResampling``: the Pillow
``Image.Resampling`` value), then rescale by ``rescale_factor`` in float64 and normalise with the
checkpoint's mean / std in float32, tile by tile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError

#: Pillow resampling filters by their integer code (transformers' PILImageResampling)
PIL_FILTERS = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


def _triple(pre: dict, key: str, default: tuple[float, float, float], where: str) -> tuple[float, float, float]:
    value = pre.get(key, list(default))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
        raise ModelLoadError(f"{where}: {key} must be a list of 3 numbers, got {value!r}")
    return tuple(float(v) for v in value)


def read_pil_settings(pre: dict, defaults: Any, where: str) -> dict[str, Any]:
    """``resample`` (a :data:`PIL_FILTERS` code), ``image_mean`` and ``image_std`` (3 floats each; one
    number stands for all three channels) of an image-processor settings dict, as keyword arguments for
    the family's settings class; keys left out take ``defaults``' attributes.

    Raises:
        ModelLoadError: a ``resample`` that is no Pillow filter code, a mean / std that is not 3
            numbers, or a std holding 0; the message names the key (``where: key ...``).
    """
    resample = pre.get("resample", defaults.resample)
    if resample not in PIL_FILTERS:
        raise ModelLoadError(f"{where}: resample {resample!r} is not a Pillow filter code ({sorted(PIL_FILTERS)})")
    std = _triple(pre, "image_std", defaults.image_std, where)
    if any(s == 0 for s in std):
        raise ModelLoadError(f"{where}: image_std must not contain 0")
    return {"resample": resample, "image_mean": _triple(pre, "image_mean", defaults.image_mean, where),
            "image_std": std}


def check_image_request(model_type: str, video: Any, resolution_px: Any) -> None:
    """Refuse what an image-only processor cannot serve: a ``video`` (send the frames as images) and a
    ``resolution_px`` that is not a positive int (None = the checkpoint's own size).

    Raises:
        InvalidRequestError: either of the above, naming the field.
    """
    if video is not None:
        raise InvalidRequestError(f"video: {model_type} models take images only (send the frames as images)")
    if resolution_px is not None and (not isinstance(resolution_px, int) or resolution_px <= 0):
        raise InvalidRequestError(f"resolution_px must be a positive int, got {resolution_px!r}")


def check_rgb(image: Any) -> np.ndarray:
    """``image`` as a C-contiguous ``(H, W, 3)`` uint8 array (the same array when it already is).

    Raises:
        InvalidImageError: not an ``(H, W, 3)`` uint8 array, or one with a zero side.
    """
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise InvalidImageError(f"image must be an (H, W, 3) uint8 RGB array, got {getattr(image, 'shape', None)} "
                                f"{getattr(image, 'dtype', type(image).__name__)}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise InvalidImageError(f"image has zero size {image.shape[0]}x{image.shape[1]}")
    return np.ascontiguousarray(image)


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


class PilTileProcessor:
    """Base of the tiling processors (SmolVLM, InternVL): holds the family config ``cfg`` and the
    checkpoint's image-processor settings ``image_cfg`` (a frozen dataclass with ``resample``,
    ``do_rescale``, ``rescale_factor``, ``do_normalize``, ``image_mean``, ``image_std``), reads them
    from a checkpoint folder, and resizes / normalises tiles as transformers' PIL processors do.

    A subclass sets ``family_title`` (error messages) and ``read_config`` (``(settings dict, model_dir,
    cfg) -> image_cfg``, raising ``ModelLoadError`` naming the key) and adds its tiling and prompt
    expansion.
    """

    family_title: ClassVar[str] = ""
    read_config: ClassVar[Any] = None

    def __init__(self, cfg: Any, image_cfg: Any) -> None:
        self.cfg = cfg
        self.image_cfg = image_cfg

    @classmethod
    def read_settings(cls, model_dir: str | Path, cfg: Any, image_processor: dict | None = None) -> Any:
        """The checkpoint's ``image_cfg`` (``read_config``); ``image_processor`` = the loader's
        settings dict (None: read them from the folder the way the loader does). The family's
        ``read_image_config``, which ``edgevlm serve --check-config`` runs.

        Raises:
            ModelLoadError: a processor file that is not a JSON object, or a key ``read_config`` refuses.
        """
        from edgevlm.model_folder import read_image_processor

        model_dir = Path(model_dir)
        pre = image_processor if image_processor is not None else read_image_processor(model_dir)
        return cls.read_config(pre, model_dir, cfg)

    @classmethod
    def from_dir(cls, model_dir: str | Path, cfg: Any, image_processor: dict | None = None):
        """The processor of the checkpoint in ``model_dir`` (see :meth:`read_settings`)."""
        return cls(cfg, cls.read_settings(model_dir, cfg, image_processor))

    @property
    def image_mean(self) -> tuple[float, float, float]:
        return self.image_cfg.image_mean

    @property
    def image_std(self) -> tuple[float, float, float]:
        return self.image_cfg.image_std

    def _resize(self, image: np.ndarray, height: int, width: int) -> np.ndarray:
        """Pillow resize of a ``(H, W, 3)`` uint8 image with the checkpoint's filter."""
        return pil_resize(image, height, width, self.image_cfg.resample, self.family_title)

    def _normalize(self, tiles: list[np.ndarray]) -> np.ndarray:
        ic = self.image_cfg
        return normalize_tiles(tiles, do_rescale=ic.do_rescale, rescale_factor=ic.rescale_factor,
                               do_normalize=ic.do_normalize, image_mean=ic.image_mean, image_std=ic.image_std)
