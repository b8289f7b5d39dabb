"""edgevlm.runtime.image: every supported format and depth, and the bad inputs it must reject.

Files are encoded by OpenCV (the same library that decodes them). OpenCV cannot encode a
2-channel (grey+alpha) PNG, a 1-bit PNG or a palette PNG, so those are written by a small
spec-following PNG writer below (zlib + CRC, PNG specification chapter 5).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from edgevlm.errors import InvalidImageError  # noqa: E402
from edgevlm.runtime.image import (  # noqa: E402
    DEFAULT_MAX_PIXELS,
    decode_image,
    image_info,
    load_image,
)


def _scene(h: int = 48, w: int = 64) -> np.ndarray:
    """A smooth RGB test image (gradients + a red square) that survives lossy compression."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), np.full_like(x, 90)], axis=-1).astype(
        np.uint8
    )
    rgb[h // 4 : h // 2, w // 4 : w // 2] = (230, 20, 20)
    return rgb


def _encode(ext: str, img_cv: np.ndarray, params: list[int] | None = None) -> bytes:
    ok, buf = cv2.imencode(ext, img_cv, params or [])
    assert ok
    return buf.tobytes()


def _png(
    width: int, height: int, color_type: int, bit_depth: int, rows: list[bytes], **extra: bytes
) -> bytes:
    def chunk(ctype: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + ctype + body + struct.pack(">I", zlib.crc32(ctype + body))

    out = b"\x89PNG\r\n\x1a\n" + chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    )
    for ctype, body in extra.items():
        out += chunk(ctype.encode(), body)
    out += chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + r for r in rows)))
    return out + chunk(b"IEND", b"")


# --- formats that decode ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ext", "params", "tol"),
    [
        (".png", [], 0.0),
        (".bmp", [], 0.0),
        (".webp", [cv2.IMWRITE_WEBP_QUALITY, 101], 0.0),  # lossless
        (".webp", [cv2.IMWRITE_WEBP_QUALITY, 90], 6.0),  # lossy VP8
        (".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95], 4.0),
        (".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95, cv2.IMWRITE_JPEG_PROGRESSIVE, 1], 4.0),
    ],
)
def test_rgb_formats_decode_to_rgb(ext: str, params: list[int], tol: float) -> None:
    rgb = _scene()
    data = _encode(ext, rgb[:, :, ::-1].copy(), params)
    out = decode_image(data)
    assert out.shape == (48, 64, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    err = np.abs(out.astype(int) - rgb.astype(int)).mean()
    assert err <= tol, f"{ext}: mean abs error {err}"
    # Channel order is RGB: the square is red, not blue.
    r, g, b = out[18, 22].astype(int)
    assert r > 200 and b < 60


def test_image_info_reads_header_sizes() -> None:
    bgr = _scene(37, 91)[:, :, ::-1].copy()
    assert image_info(_encode(".jpg", bgr)) == ("jpeg", 91, 37)
    assert image_info(_encode(".png", bgr)) == ("png", 91, 37)
    assert image_info(_encode(".bmp", bgr)) == ("bmp", 91, 37)
    assert image_info(_encode(".webp", bgr, [cv2.IMWRITE_WEBP_QUALITY, 80])) == ("webp", 91, 37)
    assert image_info(_encode(".webp", bgr, [cv2.IMWRITE_WEBP_QUALITY, 101])) == ("webp", 91, 37)
    bgra = np.dstack([bgr, np.full(bgr.shape[:2], 128, np.uint8)])
    assert image_info(_encode(".webp", bgra, [cv2.IMWRITE_WEBP_QUALITY, 101]))[1:] == (91, 37)


def test_any_size_including_1x1_and_odd() -> None:
    one = _encode(".png", np.array([[[10, 20, 30]]], np.uint8))
    assert decode_image(one).tolist() == [[[30, 20, 10]]]
    tall = _encode(".jpg", np.zeros((601, 3, 3), np.uint8))
    assert decode_image(tall).shape == (601, 3, 3)


def test_16bit_png_is_scaled_not_clipped() -> None:
    levels = np.array([0, 257, 32896, 51400, 65535], np.uint16)  # -> 0, 1, 128, 200, 255
    grey16 = np.tile(levels, (3, 1))
    out = decode_image(_encode(".png", grey16))
    assert out.dtype == np.uint8
    assert out[0, :, 0].tolist() == [0, 1, 128, 200, 255]
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()

    bgr16 = np.zeros((2, 2, 3), np.uint16)
    bgr16[..., 2] = 40000  # R
    bgr16[..., 1] = 1000  # G
    out = decode_image(_encode(".png", bgr16))
    assert out[0, 0].tolist() == [round(40000 / 257), round(1000 / 257), 0]  # [156, 4, 0]


def test_16bit_rgba_png_scaled_then_composited() -> None:
    bgra16 = np.zeros((1, 2, 4), np.uint16)
    bgra16[0, 0] = (0, 0, 65535, 65535)  # opaque red
    bgra16[0, 1] = (0, 0, 65535, 0)  # fully transparent red -> white background
    out = decode_image(_encode(".png", bgra16))
    assert out.tolist() == [[[255, 0, 0], [255, 255, 255]]]


def test_grey_png_and_jpeg() -> None:
    grey = _scene()[:, :, 1].copy()
    out = decode_image(_encode(".png", grey))
    assert out.shape == (48, 64, 3)
    assert (out == grey[:, :, None]).all()
    out = decode_image(_encode(".jpg", grey, [cv2.IMWRITE_JPEG_QUALITY, 98]))
    assert np.abs(out[..., 0].astype(int) - grey).mean() < 3.0


def test_rgba_png_and_webp_composited_over_white() -> None:
    bgra = np.zeros((2, 3, 4), np.uint8)
    bgra[..., :3] = (0, 0, 200)  # red 200 in BGR
    bgra[..., 3] = [[255, 128, 0], [255, 255, 255]]
    expected_half = [(200 * 128 + 255 * 127 + 127) // 255, (255 * 127 + 127) // 255]  # R, G/B
    for ext, params in ((".png", []), (".webp", [cv2.IMWRITE_WEBP_QUALITY, 101])):
        out = decode_image(_encode(ext, bgra, params))
        assert out.shape == (2, 3, 3)
        assert out[0, 0].tolist() == [200, 0, 0]
        assert out[0, 1].tolist() == [expected_half[0], expected_half[1], expected_half[1]]
        assert out[0, 2].tolist() == [255, 255, 255]


def test_grey_alpha_png_8_and_16_bit() -> None:
    rows8 = [bytes([100, 255, 100, 0, 200, 128])]
    out = decode_image(_png(3, 1, 4, 8, rows8))
    half = (200 * 128 + 255 * 127 + 127) // 255
    assert out[0, :, 0].tolist() == [100, 255, half]
    assert (out[..., 0] == out[..., 2]).all()
    rows16 = [struct.pack(">6H", 257 * 100, 65535, 0, 0, 65535, 65535)]
    out = decode_image(_png(3, 1, 4, 16, rows16))
    assert out[0, :, 0].tolist() == [100, 255, 255]


def test_one_bit_and_palette_png() -> None:
    out = decode_image(_png(8, 1, 0, 1, [bytes([0b10100000])]))
    assert out[0, :, 0].tolist() == [255, 0, 255, 0, 0, 0, 0, 0]
    palette = _png(2, 1, 3, 8, [bytes([0, 1])], PLTE=bytes([255, 0, 0, 0, 0, 255]), tRNS=bytes([255, 0]))
    assert decode_image(palette).tolist() == [[[255, 0, 0], [255, 255, 255]]]


def test_32bit_bmp_fourth_byte_is_dropped() -> None:
    bgra = np.zeros((2, 2, 4), np.uint8)
    bgra[..., 2] = 200  # red; alpha byte 0 (unused padding in most 32-bit BMPs)
    out = decode_image(_encode(".bmp", bgra))
    assert out.tolist() == [[[200, 0, 0]] * 2] * 2


def test_jpeg_with_trailing_bytes_after_eoi_is_accepted() -> None:
    data = _encode(".jpg", _scene()[:, :, ::-1].copy()) + b"\x00" * 16 + b"camera-trailer"
    assert decode_image(data).shape == (48, 64, 3)


def test_bytearray_and_memoryview_accepted() -> None:
    data = _encode(".png", _scene())
    assert (decode_image(bytearray(data)) == decode_image(memoryview(data))).all()


def test_load_image_reads_files(tmp_path) -> None:
    path = tmp_path / "x.webp"
    path.write_bytes(_encode(".webp", _scene()[:, :, ::-1].copy(), [cv2.IMWRITE_WEBP_QUALITY, 101]))
    assert (load_image(path) == _scene()).all()
    assert (load_image(str(path)) == _scene()).all()


# --- bad input ---------------------------------------------------------------------------------


def _raises_one_line(data, match: str) -> str:
    with pytest.raises(InvalidImageError, match=match) as info:
        decode_image(data)
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("progressive", [False, True])
def test_truncated_jpeg_rejected(progressive: bool) -> None:
    params = [cv2.IMWRITE_JPEG_PROGRESSIVE, 1] if progressive else []
    data = _encode(".jpg", _scene(120, 160)[:, :, ::-1].copy(), params)
    _raises_one_line(data[: len(data) // 2], "truncated JPEG")
    _raises_one_line(data[:-2], "truncated JPEG")  # only the EOI marker missing
    _raises_one_line(data[:4], "truncated JPEG")


def test_truncated_jpeg_with_exif_thumbnail_rejected() -> None:
    """A complete JPEG inside an APP1 segment has its own EOI; it must not count as the file's."""
    thumb = _encode(".jpg", np.zeros((8, 8, 3), np.uint8))
    main = _encode(".jpg", _scene(120, 160)[:, :, ::-1].copy())
    body = b"Exif\x00\x00" + thumb
    app1 = b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body
    data = main[:2] + app1 + main[2:]
    assert decode_image(data).shape == (120, 160, 3)
    assert image_info(data) == ("jpeg", 160, 120)
    cut = len(main[:2] + app1) + (len(main) - 2) // 2
    _raises_one_line(data[:cut], "truncated JPEG")


def test_truncated_png_webp_bmp_rejected() -> None:
    bgr = _scene(120, 160)[:, :, ::-1].copy()
    for ext, params, fmt in (
        (".png", [], "PNG"),
        (".webp", [cv2.IMWRITE_WEBP_QUALITY, 80], "WebP"),
        (".bmp", [], "BMP"),
    ):
        data = _encode(ext, bgr, params)
        _raises_one_line(data[: len(data) // 2], f"truncated {fmt}")
        _raises_one_line(data[:-1], f"truncated {fmt}")


@pytest.mark.parametrize(
    "data",
    [b"garbage bytes, not an image" * 10, b"\x00" * 64, bytes(range(256))],
)
def test_garbage_rejected(data: bytes) -> None:
    _raises_one_line(data, "unrecognised image data")


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b"GIF89a" + b"\x00" * 40, "GIF"),
        (b"GIF87a" + b"\x00" * 40, "GIF"),
        (b"II*\x00" + b"\x00" * 40, "TIFF"),
        (b"MM\x00*" + b"\x00" * 40, "TIFF"),
        (b"\x00\x00\x00\x1cftypavif" + b"\x00" * 40, "AVIF"),
        (b"\x00\x00\x00\x18ftypheic" + b"\x00" * 40, "HEIF"),
        (b"\x00\x00\x00\x0cjP  \r\n\x87\n" + b"\x00" * 40, "JPEG 2000"),
        (b"\xff\x0a" + b"\x00" * 40, "JPEG XL"),
    ],
)
def test_known_unsupported_formats_are_named(data: bytes, name: str) -> None:
    assert _raises_one_line(data, "unsupported") == f"unsupported image format {name}: expected JPEG, PNG, BMP or WebP"


def _flip_middle(data: bytes, n: int = 40, mask: int = 0x5A) -> bytes:
    """``n`` bytes XORed with ``mask`` in the middle of the file: nothing is missing, it is damaged."""
    out = bytearray(data)
    mid = len(out) // 2
    for i in range(mid, mid + n):
        out[i] ^= mask
    return bytes(out)


def test_png_with_flipped_bytes_is_corrupt_and_libpng_stays_quiet(capfd) -> None:
    rng = np.random.default_rng(0)
    data = _encode(".png", (rng.random((64, 80, 3)) * 255).astype(np.uint8))
    bad = _flip_middle(data)
    idat = data.index(b"IDAT") - 4  # the chunk starts at its length field
    assert _raises_one_line(bad, "corrupt PNG") == (
        f"corrupt PNG image: chunk 'IDAT' at byte {idat} fails its CRC check (damaged data)"
    )
    # Refused before libpng runs: nothing ("libpng error: bad adaptive filter value") on fd 2.
    assert capfd.readouterr().err == ""


def _jpeg_scan_start(data: bytes) -> int:
    """Byte offset of the first entropy-coded byte (after the SOS segment) of a baseline JPEG."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + struct.unpack_from(">H", data, sos + 2)[0]


def test_jpeg_with_flipped_bytes_is_corrupt_not_truncated() -> None:
    rng = np.random.default_rng(0)
    data = _encode(".jpg", (rng.random((64, 80, 3)) * 255).astype(np.uint8))
    msg = _raises_one_line(_flip_middle(data), "corrupt JPEG")  # the file still ends with EOI
    assert "truncated" not in msg
    # A reserved marker inside the scan data: named with its offset.
    pos = _jpeg_scan_start(data) + 10
    bad = data[:pos] + b"\xff\x02" + data[pos:]
    assert _raises_one_line(bad, "corrupt JPEG") == (
        f"corrupt JPEG image: marker 0xFF02 at byte {pos} cannot follow scan data"
    )
    # A damaged segment length that runs past the end, in a file that ends with its EOI marker.
    dqt = data.index(b"\xff\xdb")
    bad = data[: dqt + 2] + b"\xff\xf0" + data[dqt + 4 :]
    assert _raises_one_line(bad, "corrupt JPEG") == (
        "corrupt JPEG image: segment 0xFFDB runs past the end of the data, but the file ends with an "
        "EOI marker (a damaged length)"
    )
    # The same file cut before its end is truncated, whatever the damage.
    _raises_one_line(bad[: len(bad) // 2], "truncated JPEG")


def test_jpeg_entropy_damage_decodes_and_the_cli_capture_keeps_stderr_clean(capfd) -> None:
    """Damage inside the entropy-coded data has no structure to check: libjpeg decodes it with
    a warning on fd 2; :func:`native_stderr_captured` takes that warning off the terminal."""
    from edgevlm.runtime.image import native_stderr_captured

    data = _encode(".jpg", _scene(120, 160)[:, :, ::-1].copy(), [cv2.IMWRITE_JPEG_QUALITY, 95])
    start, end = _jpeg_scan_start(data), len(data) - 2
    body = bytearray(data[start:end])
    for i in range(len(body) // 3, len(body) // 2):  # no 0xFF made or unmade, stuffed 0xFF00 kept
        if body[i] != 0xFF and body[i - 1] != 0xFF and body[i] ^ 0x33 != 0xFF:
            body[i] ^= 0x33
    bad = data[:start] + bytes(body[: len(body) // 2]) + data[end:]  # the scan also ends early
    with native_stderr_captured() as lines:
        img = decode_image(bad)
    assert img.shape == (120, 160, 3)
    assert any("Corrupt JPEG data" in line for line in lines), lines
    assert capfd.readouterr().err == ""


def test_native_stderr_captured_restores_fd_2(capfd) -> None:
    import os

    from edgevlm.runtime.image import native_stderr_captured

    with pytest.raises(InvalidImageError):
        with native_stderr_captured() as lines:
            os.write(2, b"libfoo error: one\nlibfoo error: two\n")
            decode_image(b"")
    assert lines == ["libfoo error: one", "libfoo error: two"]
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_unsupported_jpeg_and_bmp_variants() -> None:
    data = _encode(".jpg", _scene()[:, :, ::-1].copy())
    sof = data.index(b"\xff\xc0")
    hierarchical = data[: sof + 1] + b"\xc5" + data[sof + 2 :]
    assert _raises_one_line(hierarchical, "unsupported") == "unsupported JPEG image: hierarchical coding (SOF5)"
    bmp = bytearray(_encode(".bmp", _scene()[:, :, ::-1].copy()))
    struct.pack_into("<I", bmp, 30, 4)  # biCompression = BI_JPEG
    assert _raises_one_line(bytes(bmp), "unsupported") == "unsupported BMP image: embedded JPEG (BI_JPEG)"


def test_empty_and_wrong_type_rejected() -> None:
    _raises_one_line(b"", "empty image data")
    _raises_one_line("not bytes", "must be bytes")  # type: ignore[arg-type]
    _raises_one_line(np.zeros((4, 4, 3), np.uint8), "must be bytes")  # type: ignore[arg-type]


def test_corrupt_png_body_rejected() -> None:
    """Structurally complete (IHDR..IEND) but the compressed pixel data is garbage."""
    data = _png(4, 4, 2, 8, [b"\x00" * 12] * 4)
    start = data.index(b"IDAT") + 4
    broken = data[:start] + b"\x13\x37" * 8 + data[start + 16 :]
    _raises_one_line(broken, "corrupt PNG image: chunk 'IDAT' .* fails its CRC check")


def test_png_with_valid_crc_but_bad_pixel_data_is_corrupt() -> None:
    """A CRC that matches garbage (a writer bug, not damage in transit): the decoder refuses it."""
    rows = [b"\x09" + b"\x00" * 12] * 4  # filter type 9 does not exist (PNG spec 9.2)
    data = _png(4, 4, 2, 8, [])
    idat = zlib.compress(b"".join(rows))
    chunk = struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
    start = data.index(b"IDAT") - 4
    end = data.index(b"IEND") - 4
    bad = data[:start] + chunk + data[end:]
    assert _raises_one_line(bad, "corrupt PNG") == "corrupt PNG image: the pixel data does not decode"


def test_decompression_bomb_rejected_before_decoding() -> None:
    # A 100000 x 100000 PNG header with a tiny body: refused from the header, never decoded.
    bomb = _png(100_000, 100_000, 2, 8, [b""])
    msg = _raises_one_line(bomb, "over the limit")
    assert "100000 x 100000" in msg and str(DEFAULT_MAX_PIXELS) in msg
    # The limit is a parameter; a real image just over it is refused, just under it decodes.
    data = _encode(".jpg", _scene(48, 64)[:, :, ::-1].copy())
    with pytest.raises(InvalidImageError, match="over the limit"):
        decode_image(data, max_pixels=48 * 64 - 1)
    assert decode_image(data, max_pixels=48 * 64).shape == (48, 64, 3)


def test_load_image_errors(tmp_path) -> None:
    with pytest.raises(InvalidImageError, match="cannot read image file .*missing.png"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(InvalidImageError, match="Is a directory"):
        load_image(tmp_path)
    bad = tmp_path / "bad.jpg"
    data = _encode(".jpg", _scene()[:, :, ::-1].copy())
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidImageError, match=r"bad\.jpg: truncated JPEG"):
        load_image(bad)
    with pytest.raises(InvalidImageError, match="over the limit of 10"):
        load_image(bad, max_file_bytes=10)


def _with_exif(jpeg: bytes, tiff: bytes) -> bytes:
    body = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


def _tiff(orientation: int, *, order: bytes = b"II", kind: int = 3, magic: int = 42, ifd0: int = 8,
          count: int = 1) -> bytes:  # fmt: skip
    e = "<" if order == b"II" else ">"
    entry = struct.pack(e + "HHI", 0x0112, kind, 1) + struct.pack(e + "HH", orientation, 0)
    return order + struct.pack(e + "HI", magic, ifd0) + struct.pack(e + "H", count) + entry + b"\x00" * 4


@pytest.mark.parametrize(
    ("tiff", "problem"),
    [
        (_tiff(6, order=b"XX"), "EXIF byte order b'XX' is neither b'II' nor b'MM'"),
        (_tiff(6, magic=43), "EXIF TIFF header says 43, not 42"),
        (_tiff(6, ifd0=4000), "EXIF IFD0 offset 4000 is outside the 26-byte block"),
        (_tiff(6, count=500), "EXIF IFD0 declares 500 entries, more than the 26-byte block holds"),
        (_tiff(6, kind=4), "EXIF Orientation has type 4 x 1 (one SHORT expected)"),
        (_tiff(9), "EXIF Orientation is 9 (1 to 8 expected)"),
        (b"\xff\xd8\xff", "EXIF block of 3 bytes is shorter than its 8-byte TIFF header"),
    ],
)
def test_jpeg_with_malformed_exif_decodes_without_orientation_and_warns_once(tiff, problem, caplog) -> None:
    import logging

    main = _encode(".jpg", _scene(120, 160)[:, :, ::-1].copy())
    caplog.set_level(logging.WARNING, logger="edgevlm.runtime.image")
    img = decode_image(_with_exif(main, tiff))
    assert img.shape == (120, 160, 3)  # not rotated
    assert np.abs(img.astype(int) - decode_image(main).astype(int)).max() == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "edgevlm.runtime.image"]
    assert warnings == [f"JPEG image decoded without EXIF orientation: {problem}"]


@pytest.mark.parametrize("order", [b"II", b"MM"])
def test_jpeg_with_valid_exif_orientation_is_rotated_silently(order, caplog) -> None:
    import logging

    main = _encode(".jpg", _scene(120, 160)[:, :, ::-1].copy())
    caplog.set_level(logging.WARNING, logger="edgevlm.runtime.image")
    img = decode_image(_with_exif(main, _tiff(6, order=order)))  # 6: rotate 90 degrees clockwise
    assert img.shape == (160, 120, 3)
    assert np.abs(img.astype(int) - np.rot90(decode_image(main), k=-1).astype(int)).max() == 0
    assert not [r for r in caplog.records if r.name == "edgevlm.runtime.image"]


def test_concurrent_decodes_run_in_parallel_equal_bytes_and_restore_the_log_level() -> None:
    """The daemon's prepare threads decode at once: the OpenCV log level is silenced while any decode
    runs and restored after the last; every thread gets the same RGB bytes as a lone decode."""
    import threading

    import cv2

    from edgevlm.runtime import image as image_mod

    rng = np.random.default_rng(7)
    bgr = rng.integers(0, 256, (288, 384, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    data = buf.tobytes()
    want = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1]
    level = cv2.utils.logging.getLogLevel()
    results: list[np.ndarray] = []
    inside: list[int] = []
    real_imdecode = cv2.imdecode
    barrier = threading.Barrier(4)

    levels: list[int] = []

    def slow_imdecode(*args, **kwargs):  # every thread inside cv2.imdecode at once, or the barrier breaks
        inside.append(image_mod._cv2_quiet_users)
        levels.append(cv2.utils.logging.getLogLevel())
        barrier.wait(timeout=10)
        return real_imdecode(*args, **kwargs)

    cv2.imdecode = slow_imdecode
    try:
        threads = [threading.Thread(target=lambda: results.append(decode_image(data))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        cv2.imdecode = real_imdecode
    assert len(results) == 4 and not barrier.broken
    assert max(inside) >= 2  # decodes overlapped (one lock around imdecode would have deadlocked the barrier)
    assert levels == [cv2.utils.logging.LOG_LEVEL_SILENT] * 4  # every decode ran with OpenCV's log silenced
    for rgb in results:
        assert rgb.flags.c_contiguous and rgb.dtype == np.uint8
        np.testing.assert_array_equal(rgb, want)
    assert image_mod._cv2_quiet_users == 0
    assert cv2.utils.logging.getLogLevel() == level
