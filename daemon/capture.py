"""Camera capture backends used by :mod:`edgevlm.daemon.sources`.

A backend opens one camera/stream and returns BGR ``uint8`` frames; every call may block, so the
source's supervisor runs it in a reader thread and abandons it on a timeout (:meth:`abort`
unblocks what can be unblocked).

- :class:`OpenCVCapture`: ``cv2.VideoCapture`` for V4L2 devices, video files, RTSP/HTTP streams
  (FFmpeg, with ``CAP_PROP_OPEN_TIMEOUT_MSEC`` / ``CAP_PROP_READ_TIMEOUT_MSEC``) and GStreamer
  pipelines when OpenCV is built with GStreamer (JetPack's OpenCV is, the PyPI wheels are not).
  V4L2: the pixel format is chosen from the device's capabilities (:func:`choose_pixel_format`)
  and set *before* size and rate (drivers validate size/rate against the current format), then
  the negotiated values are read back and logged.
- :class:`GstSubprocessCapture`: a ``gst-launch-1.0 -q <pipeline> ! fdsink fd=1`` child process
  writing raw BGR frames of a known size to a pipe; used where OpenCV lacks GStreamer.
- :func:`csi_pipeline`: the Jetson CSI pipeline (``nvarguscamerasrc ! nvvidconv ! BGRx !
  videoconvert ! BGR ! appsink``, NVIDIA's "Accelerated GStreamer" guide) built from config fields.

V4L2 structures and ioctl numbers follow ``linux/videodev2.h`` (VIDIOC_ENUM_FMT,
VIDIOC_ENUM_FRAMESIZES, VIDIOC_ENUM_FRAMEINTERVALS).
"""

from __future__ import annotations

import collections
import fcntl
import functools
import logging
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from edgevlm.config import SourceConfig

logger = logging.getLogger(__name__)

CSI_DEFAULT_WIDTH_PX = 1280
CSI_DEFAULT_HEIGHT_PX = 720
CSI_DEFAULT_FPS = 30.0


def _cv2() -> Any:
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("camera sources need OpenCV: pip install 'edgevlm[runtime]'") from exc
    return cv2


@functools.lru_cache(maxsize=1)
def opencv_has_gstreamer() -> bool:
    """Whether the installed OpenCV was built with the GStreamer video I/O backend."""
    try:
        info = _cv2().getBuildInformation()
    except ImportError:
        return False
    m = re.search(r"GStreamer:\s*(\w+)", info)
    return bool(m and m.group(1).upper() == "YES")


def capture_path(cfg: SourceConfig) -> str:
    """How a source is read: ``opencv-v4l2``, ``opencv-ffmpeg``, ``opencv-gstreamer`` or
    ``gst-launch-subprocess`` (for ``edgevlm doctor`` and the source state)."""
    kind = cfg.kind
    if kind == "v4l2":
        return "opencv-v4l2"
    if kind in ("file", "stream"):
        return "opencv-ffmpeg"
    if cfg.capture == "opencv" or (cfg.capture == "auto" and opencv_has_gstreamer()):
        return "opencv-gstreamer"
    return "gst-launch-subprocess"


# ----------------------------------------------------------------------------------- pipelines
def _framerate(fps: float) -> str:
    """GStreamer fraction for ``fps``: integers as N/1, NTSC rates (29.97, 59.94) as N*1000/1001."""
    if abs(fps - round(fps)) < 1e-6:
        return f"{round(fps)}/1"
    ntsc = round(fps * 1001 / 1000)
    if abs(fps - ntsc * 1000 / 1001) < 0.005:
        return f"{ntsc * 1000}/1001"
    frac = Fraction(fps).limit_denominator(1000)
    return f"{frac.numerator}/{frac.denominator}"


def csi_output_size(cfg: SourceConfig) -> tuple[int, int]:
    """``(width, height)`` of the frames a CSI source delivers (90-degree flips swap them)."""
    w, h = cfg.width or CSI_DEFAULT_WIDTH_PX, cfg.height or CSI_DEFAULT_HEIGHT_PX
    assert cfg.csi is not None
    return (h, w) if cfg.csi.flip_method in (1, 3, 5, 7) else (w, h)


def csi_pipeline(cfg: SourceConfig, *, sink: str = "appsink") -> str:
    """The GStreamer pipeline of a CSI source (``cfg.csi``).

    ``sink="appsink"`` ends in ``appsink drop=true max-buffers=1 sync=false`` (OpenCV);
    ``sink="fdsink"`` ends in ``fdsink fd=1 sync=false`` (raw BGR on stdout for gst-launch-1.0).
    """
    if cfg.csi is None:
        raise ValueError(f"source {cfg.name} has no csi section")
    w, h = cfg.width or CSI_DEFAULT_WIDTH_PX, cfg.height or CSI_DEFAULT_HEIGHT_PX
    src = f"nvarguscamerasrc sensor-id={cfg.csi.sensor_id}"
    if cfg.csi.sensor_mode is not None:
        src += f" sensor-mode={cfg.csi.sensor_mode}"
    parts = [
        src,
        f"video/x-raw(memory:NVMM),width={w},height={h},framerate={_framerate(cfg.fps or CSI_DEFAULT_FPS)},"
        "format=NV12",
        f"nvvidconv flip-method={cfg.csi.flip_method}",
        "video/x-raw,format=BGRx",
        "videoconvert",
        "video/x-raw,format=BGR",
        _sink(sink),
    ]
    return " ! ".join(parts)


def _sink(sink: str) -> str:
    if sink == "appsink":
        return "appsink drop=true max-buffers=1 sync=false"
    if sink == "fdsink":
        return "fdsink fd=1 sync=false"
    raise ValueError(f"sink must be 'appsink' or 'fdsink', got {sink!r}")


_SIZE_RE = re.compile(r"\b(width|height)\s*=\s*(?:\(int\))?\s*(\d+)")


def subprocess_pipeline(cfg: SourceConfig) -> tuple[str, int, int]:
    """``(pipeline, width, height)`` for reading a ``gstreamer``/``csi`` source through gst-launch.

    A user pipeline's final ``appsink ...`` element is replaced by a conversion to BGR at a fixed
    size and ``fdsink fd=1``. The size is the config's ``width``/``height``, else the last
    ``width=``/``height=`` in the pipeline's caps.

    Raises:
        ValueError: the frame size cannot be known (set ``width`` and ``height``).
    """
    if cfg.kind == "csi":
        w, h = csi_output_size(cfg)
        return csi_pipeline(cfg, sink="fdsink"), w, h
    elements = [e.strip() for e in str(cfg.uri).split("!")]
    if elements and elements[-1].split()[0:1] == ["appsink"]:
        elements = elements[:-1]
    found: dict[str, int] = {}
    for e in elements:
        for key, value in _SIZE_RE.findall(e):
            found[key] = int(value)
    w, h = cfg.width or found.get("width"), cfg.height or found.get("height")
    if not w or not h:
        raise ValueError(
            f"source {cfg.name}: the frame size of {cfg.uri!r} is unknown; set width and height "
            "(needed to read raw frames from gst-launch-1.0)"
        )
    tail = ["videoconvert", "videoscale", f"video/x-raw,format=BGR,width={w},height={h}", _sink("fdsink")]
    return " ! ".join([*elements, *tail]), w, h


# ------------------------------------------------------------------------------ V4L2 formats
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


# ------------------------------------------------------------------------------------ backends
class CaptureBackend:
    """Interface of a capture backend (see the module doc)."""

    path = "?"

    def open(self) -> dict[str, Any]:
        """Open the device; returns what was negotiated (logged and published). Raises on failure."""
        raise NotImplementedError

    def read(self) -> np.ndarray | None:
        """The next frame (BGR/BGRA/grey ``uint8``), or None at the end of the stream."""
        raise NotImplementedError

    def position_ms(self) -> float | None:
        return None

    def fps_hint(self) -> float | None:
        return None

    def abort(self) -> None:
        """Unblock a pending :meth:`open`/:meth:`read` from another thread where possible."""

    def close(self) -> None:
        raise NotImplementedError


class OpenCVCapture(CaptureBackend):
    """``cv2.VideoCapture`` (see the module doc)."""

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg
        self.cap: Any = None
        self.path = capture_path(cfg)

    def open(self) -> dict[str, Any]:
        cv2 = _cv2()
        cfg = self.cfg
        timeouts = [
            cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(cfg.open_timeout_s * 1000),
            cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(cfg.read_timeout_s * 1000),
        ]  # fmt: skip
        if cfg.kind == "v4l2":
            api = cv2.CAP_V4L2 if sys.platform.startswith("linux") else cv2.CAP_ANY
            cap = cv2.VideoCapture(cfg.uri, api)
        elif cfg.kind in ("gstreamer", "csi"):
            pipeline = csi_pipeline(cfg) if cfg.kind == "csi" else str(cfg.uri)
            cap = cv2.VideoCapture(pipeline, cv2.CAP_GSTREAMER, timeouts)
        else:
            cap = cv2.VideoCapture(str(cfg.uri), cv2.CAP_FFMPEG, timeouts)
        self.cap = cap
        if not cap.isOpened():
            raise OSError(f"cannot open {cfg.uri!r}")
        if cfg.kind == "v4l2":
            return self._negotiate_v4l2(cap)
        return {"path": self.path}

    def _negotiate_v4l2(self, cap: Any) -> dict[str, Any]:
        cv2 = _cv2()
        cfg = self.cfg
        fmt = cfg.pixel_format if cfg.pixel_format != "auto" else None
        if fmt is None and cfg.width and cfg.height:
            caps = query_v4l2_caps(cfg.uri)  # type: ignore[arg-type]  # v4l2 uri is int or /dev path
            fmt = choose_pixel_format(caps, cfg.width, cfg.height, cfg.fps) if caps else None
        # Order matters: drivers check size and rate against the current pixel format.
        if fmt is not None:
            cap.set(cv2.CAP_PROP_FOURCC, fourcc_int(fmt))
        if cfg.width and cfg.height:
            cap.set(cv2.CAP_PROP_FRAME_WIDTH, cfg.width)
            cap.set(cv2.CAP_PROP_FRAME_HEIGHT, cfg.height)
        if cfg.fps:
            cap.set(cv2.CAP_PROP_FPS, cfg.fps)
        cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        got = {
            "path": self.path,
            "pixel_format": fourcc_str(int(cap.get(cv2.CAP_PROP_FOURCC))),
            "width": int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
            "height": int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            "fps": round(float(cap.get(cv2.CAP_PROP_FPS)), 3),
        }
        wanted = (fmt, cfg.width, cfg.height, cfg.fps)
        logger.info("source %s: requested %s, negotiated %s", cfg.name, wanted, got)
        return got

    def read(self) -> np.ndarray | None:
        ok, frame = self.cap.read()
        return frame if ok and frame is not None else None

    def position_ms(self) -> float | None:
        return float(self.cap.get(_cv2().CAP_PROP_POS_MSEC))

    def fps_hint(self) -> float | None:
        return float(self.cap.get(_cv2().CAP_PROP_FPS))

    def close(self) -> None:
        if self.cap is not None:
            self.cap.release()
            self.cap = None


class GstSubprocessCapture(CaptureBackend):
    """Raw BGR frames from a ``gst-launch-1.0`` child process (see the module doc)."""

    path = "gst-launch-subprocess"

    def __init__(self, cfg: SourceConfig) -> None:
        self.cfg = cfg
        self.pipeline, self.width, self.height = subprocess_pipeline(cfg)
        self.frame_bytes = self.width * self.height * 3
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        self._lock = threading.Lock()
        self._aborted = False

    def open(self) -> dict[str, Any]:
        exe = shutil.which(self.cfg.gst_launch) or self.cfg.gst_launch
        if not os.path.isfile(exe):
            raise FileNotFoundError(
                f"{self.cfg.gst_launch} not found (apt-get install gstreamer1.0-tools) and OpenCV lacks GStreamer"
            )
        cmd = [exe, "-q", *shlex.split(self.pipeline)]
        with self._lock:
            if self._aborted:
                raise OSError("aborted")
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, bufsize=0,
            )  # fmt: skip
        threading.Thread(target=self._drain_stderr, name=f"gst-stderr-{self.cfg.name}", daemon=True).start()
        logger.info("source %s: reading %dx%d BGR from %s", self.cfg.name, self.width, self.height, shlex.join(cmd))
        return {"path": self.path, "width": self.width, "height": self.height, "pid": self.proc.pid}

    def _drain_stderr(self) -> None:
        proc = self.proc
        if proc is None or proc.stderr is None:
            return
        try:
            for line in proc.stderr:
                self._stderr.append(line.decode(errors="replace").strip())
        except (OSError, ValueError):  # closed by close() while reading
            return

    def read(self) -> np.ndarray | None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        buf = bytearray()
        while len(buf) < self.frame_bytes:
            chunk = proc.stdout.read(self.frame_bytes - len(buf))
            if not chunk:
                return None
            buf += chunk
        return np.frombuffer(bytes(buf), np.uint8).reshape(self.height, self.width, 3)

    def error_text(self) -> str:
        """The child's last stderr lines (why gst-launch failed)."""
        return " | ".join(line for line in self._stderr if line)[-400:]

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(2.0)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def make_backend(cfg: SourceConfig) -> CaptureBackend:
    """The backend for a source (see :func:`capture_path`). Raises ValueError for a GStreamer
    pipeline read through gst-launch whose frame size is unknown."""
    if capture_path(cfg) == "gst-launch-subprocess":
        return GstSubprocessCapture(cfg)
    return OpenCVCapture(cfg)
