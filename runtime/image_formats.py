"""Structural checks of encoded images, in Python, before any decoder sees the bytes.

:func:`inspect_image` identifies a JPEG, PNG, BMP or WebP file by its magic bytes, reads its size
from the header and walks its container, so that every bad file gets one precise error
(:class:`~edgevlm.errors.InvalidImageError`) whose message starts with one of:

* ``truncated <FMT> image: ...`` -- the data ends before the file does (a JPEG without its EOI
  marker, a PNG without IEND, a RIFF/BMP shorter than its header declares);
* ``corrupt <FMT> image: ...`` -- all the data is there but it is wrong: a PNG chunk whose CRC
  does not match (flipped bytes anywhere in the file), a JPEG marker where none may stand, a
  segment length that runs past the EOI marker at the end of the file, a size of zero;
* ``unsupported <FMT> image: ...`` / ``unsupported image format <NAME>: ...`` -- a valid file of a
  kind this runtime does not decode (GIF, TIFF, HEIF/AVIF, JPEG 2000, JPEG XL; hierarchical JPEG;
  BMP with embedded JPEG/PNG);
* ``unrecognised image data ...`` -- none of the above.

Catching corruption here also keeps the native decoders quiet: libpng prints ``libpng error: ...``
on stderr for a damaged PNG before OpenCV returns ``None``; a PNG that fails its CRC never gets
that far. (Damage inside a JPEG's entropy-coded data cannot be seen without decoding it: libjpeg
decodes such a file with a warning, see ``edgevlm.runtime.image``.)

A JPEG's EXIF block (APP1 ``Exif\\0\\0``) is checked as far as the orientation needs: the TIFF
header (byte order ``II``/``MM``, 42, the IFD0 offset), IFD0's entries within the segment, and the
Orientation tag (0x0112: one SHORT, 1 to 8). A problem there does not refuse the image: it is
reported in :attr:`ImageHeader.exif_problem` and the image is decoded without orientation.

Format references: JPEG ITU-T T.81 Annex B (marker segments, Table B.1 marker codes); PNG
specification 3rd edition, chapters 5 (chunk layout, CRC-32 over type and data) and 11 (IHDR);
BMP as documented for ``BITMAPINFOHEADER``; WebP container specification (RIFF, VP8/VP8L/VP8X
headers) and RFC 6386 section 9.1 (VP8 frame header); EXIF: CIPA DC-008 (Exif 2.32) section 4.5
and TIFF 6.0 section 2 (image file header, IFD entries).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from edgevlm.errors import InvalidImageError

__all__ = ["ImageHeader", "exif_problem", "inspect_image"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers carry the image size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_SOF_KIND = {
    0xC3: "lossless (SOF3)", 0xC9: "arithmetic-coded (SOF9)", 0xCA: "arithmetic-coded progressive (SOF10)",
    0xCB: "arithmetic-coded lossless (SOF11)",
}
_JPEG_HIERARCHICAL = {0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF}
# Markers without a length field: TEM, RSTn, SOI, EOI.
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xDA)}
# Markers that may follow entropy-coded data (T.81 B.2-B.6): EOI, SOS, DHT, DQT, DRI, DNL, DAC,
# DHP, EXP, COM, APPn, and SOFn (a hierarchical file's next frame).
_JPEG_AFTER_SCAN = {0xD9, 0xDA, 0xC4, 0xDB, 0xDD, 0xDC, 0xCC, 0xDE, 0xDF, 0xFE, *range(0xE0, 0xF0), *_JPEG_SOF}
_BMP_COMPRESSION = {1: "RLE8", 2: "RLE4", 4: "embedded JPEG (BI_JPEG)", 5: "embedded PNG (BI_PNG)"}


@dataclass(frozen=True)
class ImageHeader:
    """What :func:`inspect_image` read: ``fmt`` (``"jpeg"``, ``"png"``, ``"bmp"``, ``"webp"``),
    the size in px, and ``variant``, a note on an uncommon coding that a decoder may not support
    (``"arithmetic-coded (SOF9)"``, ``"12-bit samples"``, ``"RLE8"``), empty for the usual ones.
    ``exif_problem``: why a JPEG's EXIF block cannot be trusted for orientation (empty: no EXIF,
    or a well-formed one)."""

    fmt: str
    width_px: int
    height_px: int
    variant: str = ""
    exif_problem: str = ""

    @property
    def name(self) -> str:
        return {"jpeg": "JPEG", "png": "PNG", "bmp": "BMP", "webp": "WebP"}[self.fmt]


def _truncated(fmt: str, detail: str) -> InvalidImageError:
    return InvalidImageError(f"truncated {fmt} image: {detail}")


def _corrupt(fmt: str, detail: str) -> InvalidImageError:
    return InvalidImageError(f"corrupt {fmt} image: {detail}")


_EXIF_ORIENTATION_TAG = 0x0112
_TIFF_SHORT = 3


def exif_problem(tiff: bytes) -> str:
    """What is wrong with an EXIF block (the bytes after ``Exif\\0\\0``: a TIFF header and its
    IFDs) as far as its Orientation tag goes, or ``""`` when nothing is (see the module doc)."""
    n = len(tiff)
    if n < 8:
        return f"EXIF block of {n} bytes is shorter than its 8-byte TIFF header"
    order = tiff[:2]
    if order not in (b"II", b"MM"):
        return f"EXIF byte order {order!r} is neither b'II' nor b'MM'"
    e = "<" if order == b"II" else ">"
    magic, ifd0 = struct.unpack_from(e + "HI", tiff, 2)
    if magic != 42:
        return f"EXIF TIFF header says {magic}, not 42"
    if ifd0 < 8 or ifd0 + 2 > n:
        return f"EXIF IFD0 offset {ifd0} is outside the {n}-byte block"
    (count,) = struct.unpack_from(e + "H", tiff, ifd0)
    if ifd0 + 2 + 12 * count > n:
        return f"EXIF IFD0 declares {count} entries, more than the {n}-byte block holds"
    for i in range(count):
        tag, kind, values = struct.unpack_from(e + "HHI", tiff, ifd0 + 2 + 12 * i)
        if tag != _EXIF_ORIENTATION_TAG:
            continue
        if kind != _TIFF_SHORT or values != 1:
            return f"EXIF Orientation has type {kind} x {values} (one SHORT expected)"
        (value,) = struct.unpack_from(e + "H", tiff, ifd0 + 2 + 12 * i + 8)
        if not 1 <= value <= 8:
            return f"EXIF Orientation is {value} (1 to 8 expected)"
    return ""


def _jpeg(data: bytes) -> ImageHeader:
    """Walk a JPEG's marker segments (T.81 B.1.1) up to the EOI marker that ends the last scan
    (an EOI inside an EXIF thumbnail does not count). A segment that runs past the end is
    "truncated" unless the file ends with an EOI marker: then the length was damaged, "corrupt"."""
    n = len(data)
    ends_with_eoi = data.rstrip(b"\x00\r\n ").endswith(b"\xff\xd9")

    def past_end(detail: str) -> InvalidImageError:
        if ends_with_eoi:
            return _corrupt("JPEG", f"{detail}, but the file ends with an EOI marker (a damaged length)")
        return _truncated("JPEG", detail)

    pos = 2  # after SOI
    sof: tuple[int, int, int, int] | None = None  # marker, precision, width, height
    exif: str | None = None  # the problem of the first EXIF block ("" = fine), None = none seen
    in_scan = False
    while True:
        if in_scan:
            # Entropy-coded data: 0xFF is followed by a stuffed 0x00, an RSTn marker or fill bytes;
            # anything else is the next marker.
            while True:
                pos = data.find(b"\xff", pos)
                if pos < 0 or pos + 1 >= n:
                    raise past_end("the data ends inside the scan, before the EOI marker")
                nxt = data[pos + 1]
                if nxt == 0x00 or 0xD0 <= nxt <= 0xD7 or nxt == 0xFF:
                    pos += 1 if nxt == 0xFF else 2
                    continue
                if nxt not in _JPEG_AFTER_SCAN:
                    raise _corrupt("JPEG", f"marker 0xFF{nxt:02X} at byte {pos} cannot follow scan data")
                break
            in_scan = False
        if pos >= n:
            raise past_end("no EOI marker")
        if data[pos] != 0xFF:
            raise _corrupt("JPEG", f"expected a marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes before a marker
            pos += 1
        if pos >= n:
            raise past_end("no EOI marker")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI
            break
        if marker in _JPEG_STANDALONE:
            continue
        if pos + 2 > n:
            raise past_end(f"segment 0xFF{marker:02X} header cut off")
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2:
            raise _corrupt("JPEG", f"segment 0xFF{marker:02X} has length {length}")
        if pos + length > n:
            raise past_end(f"segment 0xFF{marker:02X} runs past the end of the data")
        if marker == 0xE1 and exif is None and data[pos + 2 : pos + 8] == b"Exif\x00\x00":
            exif = exif_problem(data[pos + 8 : pos + length])
        if marker in _JPEG_SOF and sof is None:
            if length < 8:
                raise _corrupt("JPEG", "short start-of-frame segment")
            precision, height, width = struct.unpack_from(">BHH", data, pos + 2)
            sof = (marker, precision, width, height)
        if marker == 0xDA:  # SOS: entropy-coded data follows the header
            if sof is None:
                raise _corrupt("JPEG", "scan before the start-of-frame segment")
            in_scan = True
        pos += length
    if sof is None:
        raise _corrupt("JPEG", "no start-of-frame segment")
    marker, precision, width, height = sof
    if marker in _JPEG_HIERARCHICAL:
        raise InvalidImageError(f"unsupported JPEG image: hierarchical coding (SOF{marker - 0xC0})")
    variant = ", ".join(
        v for v in (_JPEG_SOF_KIND.get(marker, ""), f"{precision}-bit samples" if precision != 8 else "") if v
    )
    return ImageHeader("jpeg", width, height, variant, exif or "")


def _png(data: bytes) -> ImageHeader:
    """Walk a PNG's chunks (PNG spec 5.3) up to IEND, checking each chunk's CRC-32."""
    n = len(data)
    pos = len(PNG_SIGNATURE)
    header: ImageHeader | None = None
    while True:
        if pos + 8 > n:
            raise _truncated("PNG", "the data ends before the IEND chunk")
        length, ctype = struct.unpack_from(">I4s", data, pos)
        name = ctype.decode("latin-1")
        if header is None:
            if ctype != b"IHDR" or length != 13:
                raise _corrupt("PNG", "the first chunk is not a 13-byte IHDR")
            if pos + 21 > n:
                raise _truncated("PNG", "IHDR chunk cut off")
            width, height = struct.unpack_from(">II", data, pos + 8)
            header = ImageHeader("png", width, height)
        end = pos + 12 + length  # length, type, data, CRC
        if end > n:
            raise _truncated("PNG", f"chunk {name!r} runs past the end of the data")
        (crc,) = struct.unpack_from(">I", data, end - 4)
        if zlib.crc32(data[pos + 4 : end - 4]) != crc:
            raise _corrupt("PNG", f"chunk {name!r} at byte {pos} fails its CRC check (damaged data)")
        if ctype == b"IEND":
            break
        pos = end
    return header


def _bmp(data: bytes) -> ImageHeader:
    """Read a BMP's info header; check that uncompressed pixel rows are all there."""
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
        raise _corrupt("BMP", f"unknown info header size {header_size}")
    height = abs(height)  # negative height = top-down rows
    if width <= 0 or height <= 0:
        raise _corrupt("BMP", f"size {width} x {height}")
    if bpp not in (1, 4, 8, 16, 24, 32):
        raise _corrupt("BMP", f"{bpp} bits per pixel")
    if compression in (4, 5):
        raise InvalidImageError(f"unsupported BMP image: {_BMP_COMPRESSION[compression]}")
    if compression in (0, 3, 6):  # BI_RGB, BI_BITFIELDS, BI_ALPHABITFIELDS
        row_bytes = ((bpp * width + 31) // 32) * 4
        if pixel_offset + row_bytes * height > n:
            raise _truncated("BMP", f"{n} bytes, the pixel rows need {pixel_offset + row_bytes * height}")
    elif compression not in _BMP_COMPRESSION:
        raise _corrupt("BMP", f"unknown compression {compression}")
    return ImageHeader("bmp", width, height, _BMP_COMPRESSION.get(compression, ""))


def _webp(data: bytes) -> ImageHeader:
    """Read a WebP's RIFF header and first image chunk."""
    n = len(data)
    (riff_size,) = struct.unpack_from("<I", data, 4)
    if 8 + riff_size > n:
        raise _truncated("WebP", f"{n} bytes, the RIFF header declares {8 + riff_size}")
    if n < 30:
        raise _truncated("WebP", "header cut off")
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: RFC 6386 9.1, 3-byte frame tag then start code 9d 01 2a
        if data[23:26] != b"\x9d\x01\x2a":
            raise _corrupt("WebP", "bad VP8 start code")
        w, h = struct.unpack_from("<HH", data, 26)
        return ImageHeader("webp", w & 0x3FFF, h & 0x3FFF)
    if chunk == b"VP8L":  # lossless: signature 0x2f, then 14-bit width-1 and height-1
        if data[20] != 0x2F:
            raise _corrupt("WebP", "bad VP8L signature")
        (bits,) = struct.unpack_from("<I", data, 21)
        return ImageHeader("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X":  # extended: flags byte (bit 1 = animation), 24-bit canvas width-1, height-1
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return ImageHeader("webp", w, h, "animated" if data[20] & 0x02 else "")
    raise _corrupt("WebP", f"unknown chunk {chunk!r}")


def _other_format(data: bytes) -> str | None:
    """The name of a well-known image format this runtime does not decode, from its magic bytes."""
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in (b"avif", b"avis"):
            return "AVIF"
        if brand in (b"heic", b"heix", b"hevc", b"heim", b"heis", b"mif1", b"msf1"):
            return "HEIF"
    if data[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or data[:4] == b"\xff\x4f\xff\x51":
        return "JPEG 2000"
    if data[:2] == b"\xff\x0a" or data[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n":
        return "JPEG XL"
    return None


def inspect_image(data: bytes) -> ImageHeader:
    """Identify an encoded image and check its structure, without decoding pixels.

    Args:
        data: the file's bytes.

    Returns:
        The :class:`ImageHeader` (format, size, variant).

    Raises:
        InvalidImageError: empty, unrecognised or unsupported format, truncated or corrupt
            (see the module docstring for the message of each).
    """
    if len(data) == 0:
        raise InvalidImageError("empty image data")
    if data[:3] == b"\xff\xd8\xff":
        header = _jpeg(data)
    elif data[:8] == PNG_SIGNATURE:
        header = _png(data)
    elif data[:2] == b"BM":
        header = _bmp(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        header = _webp(data)
    else:
        other = _other_format(data)
        if other is not None:
            raise InvalidImageError(f"unsupported image format {other}: expected JPEG, PNG, BMP or WebP")
        raise InvalidImageError(
            f"unrecognised image data ({len(data)} bytes starting {data[:8].hex()}): "
            "expected JPEG, PNG, BMP or WebP"
        )
    if header.width_px <= 0 or header.height_px <= 0:
        raise _corrupt(header.name, f"size {header.width_px} x {header.height_px}")
    return header
