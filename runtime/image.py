"""Image decoding for the CLI, the daemon's inline images and the SDK's tests.

``decode_image(data)`` turns the bytes of a JPEG, PNG, BMP or WebP file into an ``(H, W, 3)`` uint8
RGB array, the input :meth:`edgevlm.runtime.Engine.ask` takes. Before OpenCV sees the bytes, the
container structure is checked here, in Python:

* the format is recognised by its magic bytes (anything else is rejected);
* the image size is read from the header (JPEG SOFn segment, PNG IHDR, BMP info header, WebP
  VP8/VP8L/VP8X chunk) and checked against ``max_pixels`` *before* decoding, so a small file that
  claims a huge canvas (a decompression bomb) is never decoded;
* truncation is detected: a JPEG must reach its EOI marker (segments are walked by length and
  entropy-coded data scanned for the next marker, so an EOI inside an embedded EXIF thumbnail
  does not count), a PNG must reach its IEND chunk, a RIFF/WebP file must hold the size its RIFF
  header declares and an uncompressed BMP must hold all its pixel rows. Older OpenCV releases
  decode a JPEG cut halfway into a partly grey image with only a warning on stderr; this check
  rejects it on every OpenCV version.

Pixel conversions:

* 16-bit samples (PNG) are scaled to 8 bits as ``round(v * 255 / 65535)`` (= ``round(v / 257)``),
  the full-range mapping of the PNG specification (section 13.12), not clipped;
* grey and grey+alpha are expanded to three equal channels; palette images are expanded by libpng;
* alpha (PNG, WebP) is composited over an opaque white background
  (:data:`ALPHA_BACKGROUND_RGB`), so transparent pixels look as they do in an image viewer;
  fully transparent pixels become white whatever colour they store;
* BMP and JPEG are decoded as colour directly: a 32-bit BMP's fourth byte is dropped (it is
  usually unused padding and often zero), and JPEG EXIF orientation is applied by OpenCV.
  EXIF orientation in PNG/WebP is ignored.

Format references: JPEG ITU-T T.81 Annex B (marker segments); PNG specification 3rd edition,
chapters 5 and 11 (chunk layout, IHDR); BMP as documented for ``BITMAPINFOHEADER``; WebP container
specification (RIFF, VP8/VP8L/VP8X headers) and RFC 6386 section 9.1 (VP8 frame header).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import numpy as np

from edgevlm.errors import InvalidImageError

logger = logging.getLogger(__name__)

__all__ = [
    "ALPHA_BACKGROUND_RGB",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_PIXELS",
    "decode_image",
    "image_info",
    "load_image",
]

DEFAULT_MAX_PIXELS = 1 << 26
"""Largest decoded image accepted by default: 67,108,864 pixels (e.g. 8192 x 8192)."""

DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024
"""Largest image file :func:`load_image` reads by default, in bytes."""

ALPHA_BACKGROUND_RGB = (255, 255, 255)
"""Background that images with an alpha channel are composited over (opaque white)."""

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers carry the image size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# Markers without a length field: TEM, RSTn, SOI, EOI.
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xDA)}

_cv2_log_lock = threading.Lock()


def _cv2():
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - the runtime extra is installed in tests
        raise ImportError(
            "decoding images needs OpenCV: pip install 'edgevlm[runtime]' (or opencv-python-headless)"
        ) from exc
    return cv2


def _truncated(fmt: str, detail: str) -> InvalidImageError:
    return InvalidImageError(f"truncated {fmt} image: {detail}")


def _jpeg_info(data: bytes) -> tuple[int, int]:
    """Walk a JPEG's marker segments (T.81 B.1.1); return (width, height) from the SOFn segment.

    Raises InvalidImageError when a segment runs past the end or no EOI marker follows the scan(s).
    """
    n = len(data)
    pos = 2  # after SOI
    size: tuple[int, int] | None = None
    in_scan = False
    while True:
        if in_scan:
            # Entropy-coded data: 0xFF is followed by a stuffed 0x00 or an RSTn marker; anything
            # else (after optional 0xFF fill bytes) is the next marker.
            while True:
                pos = data.find(b"\xff", pos)
                if pos < 0 or pos + 1 >= n:
                    raise _truncated("JPEG", "the data ends inside the scan, before the EOI marker")
                nxt = data[pos + 1]
                if nxt == 0x00 or 0xD0 <= nxt <= 0xD7 or nxt == 0xFF:
                    pos += 1 if nxt == 0xFF else 2
                    continue
                break
            in_scan = False
        if pos >= n:
            raise _truncated("JPEG", "no EOI marker")
        if data[pos] != 0xFF:
            raise InvalidImageError(f"corrupt JPEG image: expected a marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes before a marker
            pos += 1
        if pos >= n:
            raise _truncated("JPEG", "no EOI marker")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI
            break
        if marker in _JPEG_STANDALONE:
            continue
        if pos + 2 > n:
            raise _truncated("JPEG", f"segment 0xFF{marker:02X} header cut off")
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2:
            raise InvalidImageError(f"corrupt JPEG image: segment 0xFF{marker:02X} has length {length}")
        if pos + length > n:
            raise _truncated("JPEG", f"segment 0xFF{marker:02X} runs past the end of the data")
        if marker in _JPEG_SOF and size is None:
            if length < 8:
                raise InvalidImageError("corrupt JPEG image: short start-of-frame segment")
            height, width = struct.unpack_from(">HH", data, pos + 3)
            size = (width, height)
        if marker == 0xDA:  # SOS: entropy-coded data follows the header
            if size is None:
                raise InvalidImageError("corrupt JPEG image: scan before the start-of-frame segment")
            in_scan = True
        pos += length
    if size is None:
        raise InvalidImageError("corrupt JPEG image: no start-of-frame segment")
    return size


def _png_info(data: bytes) -> tuple[int, int]:
    """Walk a PNG's chunks (PNG spec 5.3); return (width, height) from IHDR. Requires IEND."""
    n = len(data)
    pos = len(_PNG_SIGNATURE)
    size: tuple[int, int] | None = None
    while True:
        if pos + 8 > n:
            raise _truncated("PNG", "the data ends before the IEND chunk")
        length, ctype = struct.unpack_from(">I4s", data, pos)
        if size is None:
            if ctype != b"IHDR" or length < 13:
                raise InvalidImageError("corrupt PNG image: the first chunk is not IHDR")
            if pos + 16 > n:
                raise _truncated("PNG", "IHDR chunk cut off")
            size = struct.unpack_from(">II", data, pos + 8)
        end = pos + 12 + length  # length, type, data, CRC
        if end > n:
            raise _truncated("PNG", f"chunk {ctype.decode('latin-1')!r} runs past the end of the data")
        if ctype == b"IEND":
            break
        pos = end
    return size


def _bmp_info(data: bytes) -> tuple[int, int]:
    """Read a BMP's info header; return (width, height). Checks that uncompressed rows are all there."""
    n = len(data)
    if n < 26:
        raise _truncated("BMP", "header cut off")
    (pixel_offset,) = struct.unpack_from("<I", data, 10)
    (header_size,) = struct.unpack_from("<I", data, 14)
    if header_size == 12:  # BITMAPCOREHEADER
        width, height, _planes, bpp = struct.unpack_from("<hhHH", data, 18)
        compression = 0
    elif header_size >= 40:
        if n < 34:
            raise _truncated("BMP", "header cut off")
        width, height, _planes, bpp, compression = struct.unpack_from("<iiHHI", data, 18)
    else:
        raise InvalidImageError(f"corrupt BMP image: unknown info header size {header_size}")
    height = abs(height)  # negative height = top-down rows
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"corrupt BMP image: size {width} x {height}")
    if compression in (0, 3, 6) and bpp in (1, 4, 8, 16, 24, 32):  # BI_RGB, BI_BITFIELDS
        row_bytes = ((bpp * width + 31) // 32) * 4
        if pixel_offset + row_bytes * height > n:
            raise _truncated("BMP", f"{n} bytes, the pixel rows need {pixel_offset + row_bytes * height}")
    return width, height


def _webp_info(data: bytes) -> tuple[int, int]:
    """Read a WebP's RIFF header and first image chunk; return (width, height)."""
    n = len(data)
    (riff_size,) = struct.unpack_from("<I", data, 4)
    if 8 + riff_size > n:
        raise _truncated("WebP", f"{n} bytes, the RIFF header declares {8 + riff_size}")
    if n < 30:
        raise _truncated("WebP", "header cut off")
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: RFC 6386 9.1, 3-byte frame tag then start code 9d 01 2a
        if data[23:26] != b"\x9d\x01\x2a":
            raise InvalidImageError("corrupt WebP image: bad VP8 start code")
        w, h = struct.unpack_from("<HH", data, 26)
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L":  # lossless: signature 0x2f, then 14-bit width-1 and height-1
        if data[20] != 0x2F:
            raise InvalidImageError("corrupt WebP image: bad VP8L signature")
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended: 24-bit canvas width-1 and height-1
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return w, h
    raise InvalidImageError(f"corrupt WebP image: unknown chunk {chunk!r}")


def image_info(data: bytes) -> tuple[str, int, int]:
    """Identify an encoded image and check that it is complete, without decoding pixels.

    Args:
        data: the file's bytes.

    Returns:
        ``(format, width_px, height_px)`` with format one of ``"jpeg"``, ``"png"``, ``"bmp"``,
        ``"webp"``.

    Raises:
        InvalidImageError: unknown format, truncated or structurally corrupt file.
    """
    if len(data) == 0:
        raise InvalidImageError("empty image data")
    if data[:3] == b"\xff\xd8\xff":
        fmt, (w, h) = "jpeg", _jpeg_info(data)
    elif data[:8] == _PNG_SIGNATURE:
        fmt, (w, h) = "png", _png_info(data)
    elif data[:2] == b"BM":
        fmt, (w, h) = "bmp", _bmp_info(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        fmt, (w, h) = "webp", _webp_info(data)
    else:
        raise InvalidImageError(
            f"unrecognised image data ({len(data)} bytes starting {data[:8].hex()}): "
            "expected JPEG, PNG, BMP or WebP"
        )
    if w <= 0 or h <= 0:
        raise InvalidImageError(f"corrupt {fmt.upper()} image: size {w} x {h}")
    return fmt, w, h


def _imdecode(data: bytes, flags: int) -> np.ndarray | None:
    """cv2.imdecode with OpenCV's own log lines silenced (the caller raises a typed error instead)."""
    cv2 = _cv2()
    buf = np.frombuffer(data, dtype=np.uint8)
    cv_logging = getattr(getattr(cv2, "utils", None), "logging", None)
    if cv_logging is None:  # pragma: no cover - very old OpenCV
        return cv2.imdecode(buf, flags)
    with _cv2_log_lock:
        previous = cv_logging.getLogLevel()
        cv_logging.setLogLevel(cv_logging.LOG_LEVEL_SILENT)
        try:
            return cv2.imdecode(buf, flags)
        finally:
            cv_logging.setLogLevel(previous)


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
    fmt, width, height = image_info(data)
    if width * height > max_pixels:
        raise InvalidImageError(
            f"{fmt.upper()} image is {width} x {height} = {width * height} pixels, "
            f"over the limit of {max_pixels}"
        )
    cv2 = _cv2()
    # JPEG: IMREAD_COLOR applies EXIF orientation and converts grey/CMYK. BMP: drop the 4th byte.
    flags = cv2.IMREAD_COLOR if fmt in ("jpeg", "bmp") else cv2.IMREAD_UNCHANGED
    img = _imdecode(data, flags)
    if img is None or img.size == 0:
        raise InvalidImageError(f"corrupt {fmt.upper()} image: OpenCV cannot decode it")
    img = _to_uint8(img)
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[:, :, 0]
    if img.ndim == 2:  # grey
        rgb = np.repeat(img[:, :, None], 3, axis=2)
    elif img.shape[2] == 2:  # grey + alpha
        grey = _composite(img[:, :, :1], img[:, :, 1])
        rgb = np.repeat(grey, 3, axis=2)
    elif img.shape[2] == 3:  # BGR
        rgb = img[:, :, ::-1]
    elif img.shape[2] == 4:  # BGRA
        rgb = _composite(img[:, :, 2::-1], img[:, :, 3])
    else:
        raise InvalidImageError(f"unsupported {fmt.upper()} image with {img.shape[2]} channels")
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
