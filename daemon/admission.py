"""What every transport (MQTT, the HTTP API) checks in a request before it is queued.

One place for the inline-image rule: an image file over ``limits.max_image_bytes``, or whose header
claims more than ``limits.max_image_pixels``, is refused with ``INVALID_IMAGE`` before a single pixel
is decoded (a decompression bomb never reaches the decoder). The header is parsed by
:func:`edgevlm.runtime.image.image_info` (JPEG SOF, PNG IHDR, BMP and WebP headers).
"""

from __future__ import annotations

from edgevlm.config import LimitsConfig
from edgevlm.errors import InvalidImageError
from edgevlm.protocol import Request


def check_inline_image(request: Request, limits: LimitsConfig) -> None:
    """Refuse an inline image that is too large, by bytes or by the pixels its header claims.

    Raises:
        InvalidImageError: over a limit (``details`` name the limit and the value), or a file
            whose header is not a supported image format.
    """
    data = request.image_bytes
    if data is None:
        return
    if len(data) > limits.max_image_bytes:
        raise InvalidImageError(
            f"inline image of {len(data)} bytes exceeds limits.max_image_bytes={limits.max_image_bytes}",
            details={"image_bytes": len(data), "max_image_bytes": limits.max_image_bytes},
        )
    from edgevlm.runtime.image import image_info  # header parse only: no pixel is decoded

    fmt, width, height = image_info(data)
    if width * height > limits.max_image_pixels:
        raise InvalidImageError(
            f"{fmt.upper()} image is {width} x {height} = {width * height} pixels, over "
            f"limits.max_image_pixels={limits.max_image_pixels} (not decoded)",
            details={"width_px": width, "height_px": height, "max_image_pixels": limits.max_image_pixels},
        )
