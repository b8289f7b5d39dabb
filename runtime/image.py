"""Image decoding for the CLI, the daemon's inline images and the SDK's tests.

``decode_image(data)`` turns the bytes of a JPEG, PNG, BMP or WebP file into an ``(H, W, 3)`` uint8
RGB array, the input :meth:`edgevlm.runtime.Engine.ask` takes. Before OpenCV sees the bytes, the
container structure is checked in Python (:mod:`edgevlm.runtime.image_formats`):

* the format is recognised by its magic bytes (GIF, TIFF, HEIF/AVIF, JPEG 2000 and JPEG XL are
  named as unsupported, anything else is unrecognised);
* the image size is read from the header (JPEG SOFn segment, PNG IHDR, BMP info header, WebP
  VP8/VP8L/VP8X chunk) and checked against ``max_pixels`` *before* decoding, so a small file that
  claims a huge canvas (a decompression bomb) is never decoded;
* truncation is told apart from corruption: a JPEG must reach its EOI marker (an EOI inside an
  embedded EXIF thumbnail does not count), a PNG its IEND chunk, a RIFF/WebP file the size its
  RIFF header declares, an uncompressed BMP all its pixel rows ("truncated ..."); a PNG chunk
  whose CRC-32 does not match or a JPEG marker where none may stand is "corrupt ...". Older
  OpenCV releases decode a JPEG cut halfway into a partly grey image with only a warning on
  stderr; this check rejects it on every OpenCV version.

The native decoders write their own complaints to file descriptor 2 (libpng: ``libpng error:
...``; libjpeg: ``Corrupt JPEG data: ...`` for damage inside the entropy-coded data, which it
decodes anyway). Structural damage is refused before they run; :func:`native_stderr_captured`
keeps the rest off a terminal where one process decodes one image (the CLI). OpenCV's own log
lines are always silenced.

Pixel conversions:

* 16-bit samples (PNG) are scaled to 8 bits as ``round(v * 255 / 65535)`` (= ``round(v / 257)``),
  the full-range mapping of the PNG specification (section 13.12), not clipped;
* grey and grey+alpha are expanded to three equal channels; palette images are expanded by libpng;
* alpha (PNG, WebP) is composited over an opaque white background
  (:data:`ALPHA_BACKGROUND_RGB`), so transparent pixels look as they do in an image viewer;
  fully transparent pixels become white whatever colour they store;
* BMP and JPEG are decoded as colour directly: a 32-bit BMP's fourth byte is dropped (it is
  usually unused padding and often zero), and JPEG EXIF orientation is applied by OpenCV; a
  malformed EXIF block (:func:`edgevlm.runtime.image_formats.exif_problem`) is not used: the
  image is decoded without orientation and one WARNING names the problem. EXIF orientation in
  PNG/WebP is ignored.

Format references: see :mod:`edgevlm.runtime.image_formats`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edgevlm.errors import InvalidImageError
from edgevlm.runtime.image_formats import inspect_image

logger = logging.getLogger(__name__)

__all__ = [
    "ALPHA_BACKGROUND_RGB",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_PIXELS",
    "decode_image",
    "image_info",
    "load_image",
    "native_stderr_captured",
]

DEFAULT_MAX_PIXELS = 1 << 26
"""Largest decoded image accepted by default: 67,108,864 pixels (e.g. 8192 x 8192)."""

DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024
"""Largest image file :func:`load_image` reads by default, in bytes."""

ALPHA_BACKGROUND_RGB = (255, 255, 255)
"""Background that images with an alpha channel are composited over (opaque white)."""

_cv2_log_lock = threading.Lock()
_cv2_quiet_users = 0  # decodes in progress with OpenCV's log silenced (guarded by _cv2_log_lock)
_cv2_saved_level: int | None = None


def _cv2():
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - the runtime extra is installed in tests
        raise ImportError(
            "decoding images needs OpenCV: pip install 'edgevlm[runtime]' (or opencv-python-headless)"
        ) from exc
    return cv2


def image_info(data: bytes) -> tuple[str, int, int]:
    """Identify an encoded image and check that it is complete and intact, without decoding
    pixels (:func:`edgevlm.runtime.image_formats.inspect_image`).

    Args:
        data: the file's bytes.

    Returns:
        ``(format, width_px, height_px)`` with format one of ``"jpeg"``, ``"png"``, ``"bmp"``,
        ``"webp"``.

    Raises:
        InvalidImageError: unknown or unsupported format, truncated or corrupt file; the message
            starts with ``truncated``, ``corrupt``, ``unsupported`` or ``unrecognised``.
    """
    header = inspect_image(data)
    return header.fmt, header.width_px, header.height_px


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[list[str]]:
    """Redirect file descriptor 2 into a temporary file while the block runs, so that what the
    native decoders write there (libpng's ``libpng error: ...``, libjpeg's ``Corrupt JPEG data:
    ...``) does not reach the terminal. Yields a list that receives the captured lines when the
    block ends (also when it raises).

    The redirect is process-wide: use it only where no other thread writes to stderr meanwhile
    (the ``edgevlm ask`` command decodes its image before anything else starts). Python's
    ``sys.stderr`` is flushed before and after.
    """
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield lines
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                tmp.seek(0)
                text = tmp.read().decode("utf-8", errors="replace")
                lines.extend(line for line in text.splitlines() if line.strip())
    finally:
        os.close(saved)


def _imdecode(data: bytes, flags: int) -> np.ndarray | None:
    """cv2.imdecode with OpenCV's own log lines silenced (the caller raises a typed error instead)."""
    cv2 = _cv2()
    buf = np.frombuffer(data, dtype=np.uint8)
    cv_logging = getattr(getattr(cv2, "utils", None), "logging", None)
    if cv_logging is None:  # pragma: no cover - very old OpenCV
        return cv2.imdecode(buf, flags)
    with _cv2_quiet(cv_logging):
        return cv2.imdecode(buf, flags)


@contextlib.contextmanager
def _cv2_quiet(cv_logging: Any) -> Iterator[None]:
    """OpenCV's (process-wide) log level silenced while at least one decode runs, restored when the
    last one ends. Decodes run in parallel (the lock guards only the level and the count): a
    daemon's prepare threads decode many JPEGs at once, and holding one lock around
    ``cv2.imdecode`` made them take turns."""
    global _cv2_quiet_users, _cv2_saved_level
    with _cv2_log_lock:
        if _cv2_quiet_users == 0:
            _cv2_saved_level = cv_logging.getLogLevel()
            cv_logging.setLogLevel(cv_logging.LOG_LEVEL_SILENT)
        _cv2_quiet_users += 1
    try:
        yield
    finally:
        with _cv2_log_lock:
            _cv2_quiet_users -= 1
            if _cv2_quiet_users == 0 and _cv2_saved_level is not None:
                cv_logging.setLogLevel(_cv2_saved_level)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.uint8:
        return x
    if x.dtype == np.uint16:
        return ((x.astype(np.uint32) + 128) // 257).astype(np.uint8)  # round(v * 255 / 65535)
    raise InvalidImageError(f"unsupported sample type {x.dtype}")


def _composite(color: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Composite uint8 ``color (H, W, C)`` over :data:`ALPHA_BACKGROUND_RGB` with uint8 ``alpha (H, W)``."""
    a = alpha.astype(np.uint16)[..., None]  # (H, W, 1)
    bg = np.asarray(ALPHA_BACKGROUND_RGB[: color.shape[2]], dtype=np.uint16)  # (C,)
    out = (color.astype(np.uint16) * a + bg * (255 - a) + 127) // 255  # max 65152 fits uint16
    return out.astype(np.uint8)


def decode_image(data: bytes | bytearray | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode a JPEG, PNG, BMP or WebP file to an RGB image.

    Args:
        data: the encoded file's bytes.
        max_pixels: largest ``width * height`` accepted, checked from the header before decoding.

    Returns:
        ``(H, W, 3)`` uint8 array, RGB channel order, C-contiguous. 16-bit samples are scaled to
        8 bits, grey is replicated to three channels, alpha is composited over white (see the
        module docstring).

    Raises:
        InvalidImageError: not bytes, empty, unknown format, truncated, corrupt, or larger than
            ``max_pixels``. The message is one line.
        ImportError: OpenCV is not installed (it comes with ``pip install 'edgevlm[runtime]'``).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidImageError(f"image data must be bytes, not {type(data).__name__}")
    data = bytes(data)
    header = inspect_image(data)
    fmt, width, height = header.fmt, header.width_px, header.height_px
    if width * height > max_pixels:
        raise InvalidImageError(
            f"{header.name} image is {width} x {height} = {width * height} pixels, "
            f"over the limit of {max_pixels}"
        )
    cv2 = _cv2()
    # JPEG: IMREAD_COLOR applies EXIF orientation and converts grey/CMYK. BMP: drop the 4th byte.
    flags = cv2.IMREAD_COLOR if fmt in ("jpeg", "bmp") else cv2.IMREAD_UNCHANGED
    if header.exif_problem:  # a malformed EXIF block: no orientation from it, said once
        logger.warning("JPEG image decoded without EXIF orientation: %s", header.exif_problem)
        flags |= cv2.IMREAD_IGNORE_ORIENTATION
    img = _imdecode(data, flags)
    if img is None or img.size == 0:
        if header.variant:
            raise InvalidImageError(f"unsupported {header.name} image: {header.variant} (OpenCV cannot decode it)")
        raise InvalidImageError(f"corrupt {header.name} image: the pixel data does not decode")
    img = _to_uint8(img)
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[:, :, 0]
    if img.ndim == 2:  # grey
        rgb = np.repeat(img[:, :, None], 3, axis=2)
    elif img.shape[2] == 2:  # grey + alpha
        grey = _composite(img[:, :, :1], img[:, :, 1])
        rgb = np.repeat(grey, 3, axis=2)
    elif img.shape[2] == 3:  # BGR
        if img.dtype == np.uint8 and img.flags.c_contiguous:
            return _cv2().cvtColor(img, _cv2().COLOR_BGR2RGB)  # the same bytes, ~30x faster than a strided copy
        rgb = img[:, :, ::-1]
    elif img.shape[2] == 4:  # BGRA
        rgb = _composite(img[:, :, 2::-1], img[:, :, 3])
    else:
        raise InvalidImageError(f"unsupported {header.name} image with {img.shape[2]} channels")
    return np.ascontiguousarray(rgb)


def load_image(
    path: str | os.PathLike[str],
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> np.ndarray:
    """Read and decode an image file; same result and rules as :func:`decode_image`.

    Raises:
        InvalidImageError: the file cannot be read (missing, a directory, no permission), is
            larger than ``max_file_bytes``, or does not decode.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        if size > max_file_bytes:
            raise InvalidImageError(f"image file {p} is {size} bytes, over the limit of {max_file_bytes}")
        data = p.read_bytes()
    except OSError as exc:
        reason = exc.strerror or exc.__class__.__name__
        raise InvalidImageError(f"cannot read image file {p}: {reason}") from exc
    try:
        return decode_image(data, max_pixels=max_pixels)
    except InvalidImageError as exc:
        raise InvalidImageError(f"{p}: {exc.message}", details=exc.details) from exc
