"""V4L2 capability probing: which pixel formats, sizes and frame rates a camera offers, and the
format to request for a wanted size and rate (MJPG when YUYV cannot carry it, e.g. 720p/30 on
USB 2.0). Used by :class:`edgevlm.daemon.capture_opencv.OpenCVCapture` and ``edgevlm doctor``.

Structures and ioctl numbers follow ``linux/videodev2.h`` (VIDIOC_ENUM_FMT,
VIDIOC_ENUM_FRAMESIZES, VIDIOC_ENUM_FRAMEINTERVALS).
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
from dataclasses import dataclass, field

__all__ = ["Capability", "DeviceCaps", "FrameMode", "capture_device_problem", "choose_pixel_format", "fourcc_int", "fourcc_str",
           "query_capability", "query_v4l2_caps"]

_V4L2_BUF_TYPE_VIDEO_CAPTURE = 1
_VIDIOC_ENUM_FMT = 0xC0405602  # _IOWR('V', 2, struct v4l2_fmtdesc), 64 bytes
_VIDIOC_ENUM_FRAMESIZES = 0xC02C564A  # _IOWR('V', 74, struct v4l2_frmsizeenum), 44 bytes
_VIDIOC_ENUM_FRAMEINTERVALS = 0xC034564B  # _IOWR('V', 75, struct v4l2_frmivalenum), 52 bytes
_DISCRETE = 1
_RAW_FORMATS = ("YUYV", "UYVY", "NV12", "YU12", "RGB3", "BGR3", "GREY")
_COMPRESSED_FORMATS = ("MJPG", "JPEG")


def fourcc_str(code: int) -> str:
    """A V4L2/OpenCV FOURCC integer as its four characters (little-endian)."""
    return struct.pack("<I", int(code) & 0xFFFFFFFF).decode("ascii", errors="replace").rstrip("\0 ")


def fourcc_int(text: str) -> int:
    return struct.unpack("<I", text.ljust(4).encode("ascii"))[0]


@dataclass(frozen=True)
class FrameMode:
    """One discrete size a pixel format offers, with its frame rates (fps)."""

    width: int
    height: int
    fps: tuple[float, ...] = ()


@dataclass
class DeviceCaps:
    """What a V4L2 capture device offers: FOURCC -> discrete frame modes."""

    formats: dict[str, list[FrameMode]] = field(default_factory=dict)


def _ioctl(fd: int, request: int, buf: bytes) -> bytes | None:
    try:
        return fcntl.ioctl(fd, request, buf)
    except OSError:
        return None


_VIDIOC_QUERYCAP = 0x80685600  # _IOR('V', 0, struct v4l2_capability), 104 bytes
_CAP_VIDEO_CAPTURE, _CAP_VIDEO_CAPTURE_MPLANE, _CAP_DEVICE_CAPS = 0x00000001, 0x00001000, 0x80000000
_CAP_META_CAPTURE = 0x00800000


@dataclass(frozen=True)
class Capability:
    """A device node's VIDIOC_QUERYCAP answer (``struct v4l2_capability``): driver and card names, and
    the node's capability bits (``device_caps`` where the driver sets V4L2_CAP_DEVICE_CAPS, else
    ``capabilities``)."""

    driver: str
    card: str
    caps: int

    @property
    def video_capture(self) -> bool:
        """Single- or multi-planar video capture (a camera's video node)."""
        return bool(self.caps & (_CAP_VIDEO_CAPTURE | _CAP_VIDEO_CAPTURE_MPLANE))

    @property
    def metadata_capture(self) -> bool:
        """Metadata capture (a UVC camera's second node)."""
        return bool(self.caps & _CAP_META_CAPTURE)


def query_capability(path: str | os.PathLike) -> Capability | None:
    """Ask the device node ``path`` VIDIOC_QUERYCAP. None when it cannot be opened (missing, no access)
    or not on Linux.

    Raises:
        OSError: the node opened but does not answer VIDIOC_QUERYCAP: not a V4L2 device (``/dev/null``).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        out = fcntl.ioctl(fd, _VIDIOC_QUERYCAP, bytes(104))
    finally:
        os.close(fd)
    caps, device_caps = struct.unpack_from("<II", out, 84)
    return Capability(driver=out[0:16].split(b"\0")[0].decode(errors="replace"),
                      card=out[16:48].split(b"\0")[0].decode(errors="replace"),
                      caps=device_caps if caps & _CAP_DEVICE_CAPS else caps)


def capture_device_problem(path: str) -> str | None:
    """Why the device node ``path`` is not a V4L2 video capture device, or None when it is (or when it
    cannot be asked: not Linux, not openable; the caller checks access). VIDIOC_QUERYCAP: a device that
    does not answer it is not V4L2 (``/dev/null``); one whose device caps hold metadata capture and no video
    capture is a UVC camera's metadata node (the ``/dev/videoN+1`` beside the camera's own)."""
    try:
        cap = query_capability(path)
    except OSError as exc:
        return f"{path} is not a V4L2 device (VIDIOC_QUERYCAP: {exc.strerror})"
    # only a metadata node is refused: a v4l2loopback device with exclusive_caps offers capture only once
    # its producer runs (a camera that comes up after the daemon)
    if cap is not None and not cap.video_capture and cap.metadata_capture:
        return (f"{path} ({cap.card or cap.driver}) is a camera's metadata node, not its video: no video capture "
                f"(device capabilities 0x{cap.caps:08x}); its video node is usually the one before it")
    return None


def query_v4l2_caps(device: str | int) -> DeviceCaps | None:
    """Enumerate a V4L2 device's pixel formats, discrete sizes and frame rates (ioctls of
    ``linux/videodev2.h``). Returns None where it cannot be asked (not Linux, no access)."""
    if not sys.platform.startswith("linux"):
        return None
    path = f"/dev/video{device}" if isinstance(device, int) else device
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return None
    caps = DeviceCaps()
    try:
        for i in range(64):
            out = _ioctl(fd, _VIDIOC_ENUM_FMT, struct.pack("<II", i, _V4L2_BUF_TYPE_VIDEO_CAPTURE) + bytes(56))
            if out is None:
                break
            pixfmt = struct.unpack_from("<I", out, 44)[0]  # index, type, flags, description[32]
            modes: list[FrameMode] = []
            for j in range(256):
                fs = _ioctl(fd, _VIDIOC_ENUM_FRAMESIZES, struct.pack("<III", j, pixfmt, 0) + bytes(32))
                if fs is None:
                    break
                kind, w, h = struct.unpack_from("<III", fs, 8)
                if kind != _DISCRETE:
                    break  # stepwise/continuous: any size; the driver adjusts what we set
                rates = []
                for k in range(64):
                    fi = _ioctl(fd, _VIDIOC_ENUM_FRAMEINTERVALS,
                                struct.pack("<IIIII", k, pixfmt, w, h, 0) + bytes(32))  # fmt: skip
                    if fi is None:
                        break
                    ikind, num, den = struct.unpack_from("<III", fi, 16)
                    if ikind != _DISCRETE:
                        break
                    if num:
                        rates.append(round(den / num, 3))  # an interval num/den s is den/num fps
                modes.append(FrameMode(w, h, tuple(sorted(set(rates), reverse=True))))
            caps.formats[fourcc_str(pixfmt)] = modes
    finally:
        os.close(fd)
    return caps


def choose_pixel_format(caps: DeviceCaps, width: int | None, height: int | None, fps: float | None) -> str | None:
    """The FOURCC to request for ``width`` x ``height`` at ``fps``.

    A raw format (YUYV...) when it delivers that size at that rate (no decode cost); otherwise a
    compressed one (MJPG) that does (USB 2.0 cameras carry 720p/30 only as MJPG: YUYV at
    1280x720x2 bytes x 30 fps exceeds the bus); otherwise the format reaching the highest rate at
    that size. None when no size is requested or no format offers it (the driver keeps its own).
    """
    if width is None or height is None:
        return None
    want = fps or 0.0
    best: tuple[float, str] | None = None
    for group in (_RAW_FORMATS, _COMPRESSED_FORMATS, tuple(caps.formats)):
        for fmt in group:
            for mode in caps.formats.get(fmt, []):
                if (mode.width, mode.height) != (width, height):
                    continue
                top = max(mode.fps, default=0.0)
                if top + 1e-6 >= want:
                    return fmt
                if best is None or top > best[0]:
                    best = (top, fmt)
    return best[1] if best else None

