"""GStreamer pipelines and the ``gst-launch-1.0`` subprocess backend.

- :func:`csi_pipeline`: the Jetson CSI pipeline (``nvarguscamerasrc ! nvvidconv ! BGRx !
  videoconvert ! BGR ! appsink``, NVIDIA's "Accelerated GStreamer" guide) built from config
  fields; OpenCV's GStreamer backend reads it, or gst-launch with an ``fdsink`` at its end.
- :func:`opencv_pipeline` / :func:`subprocess_pipeline`: what each path runs for a source; both scale a
  user pipeline's frames to the source's ``width``/``height`` when it sets them.
- :class:`GstSubprocessCapture`: a ``gst-launch-1.0 -q <pipeline> ! fdsink fd=1`` child process
  writing raw BGR frames of a known size to a pipe; used where OpenCV lacks GStreamer.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shlex
import shutil
import subprocess
import threading
from fractions import Fraction
from typing import Any

import numpy as np

from edgevlm.config import SourceConfig
from edgevlm.daemon.capture_base import CaptureBackend

logger = logging.getLogger(__name__)

__all__ = [
    "GstSubprocessCapture",
    "csi_output_size",
    "csi_pipeline",
    "opencv_pipeline",
    "subprocess_pipeline",
]

CSI_DEFAULT_WIDTH_PX = 1280
CSI_DEFAULT_HEIGHT_PX = 720
CSI_DEFAULT_FPS = 30.0


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


def _sink(sink: str, *, sync: bool = False) -> str:
    if sink == "appsink":
        return f"appsink drop=true max-buffers=1 sync={str(sync).lower()}"
    if sink == "fdsink":
        return f"fdsink fd=1 sync={str(sync).lower()}"
    raise ValueError(f"sink must be 'appsink' or 'fdsink', got {sink!r}")


_SIZE_RE = re.compile(r"\b(width|height)\s*=\s*(?:\(int\))?\s*(\d+)")
_SYNC_RE = re.compile(r"\bsync\s*=\s*(?:\(boolean\))?\s*(\w+)", re.IGNORECASE)


def _appsink_sync(appsink: str | None) -> bool:
    """Whether the user's ``appsink ...`` element renders buffers on the pipeline clock: its ``sync=``
    property, else appsink's default (true, as every GStreamer base sink), which is what OpenCV's GStreamer
    backend runs the same pipeline with. A non-live source (``videotestsrc``, ``filesrc ! decodebin``) is
    paced to its framerate by it; with ``sync=false`` such a pipeline produces frames as fast as it can."""
    m = _SYNC_RE.search(appsink or "")
    if m is None:
        return True
    return m.group(1).lower() not in ("false", "0", "no", "off")


def _user_pipeline(cfg: SourceConfig) -> tuple[list[str], str | None, int | None, int | None]:
    """A ``gstreamer`` source's pipeline split into its elements, its final ``appsink ...`` element (None
    if it has none; not in the elements) and the frame size it is scaled to: the config's ``width`` /
    ``height``, else the last ``width=`` / ``height=`` in the pipeline's caps (None where neither says)."""
    elements = [e.strip() for e in str(cfg.uri).split("!")]
    appsink = None
    if elements and elements[-1].split()[0:1] == ["appsink"]:
        appsink, elements = elements[-1], elements[:-1]
    found: dict[str, int] = {}
    for e in elements:
        for key, value in _SIZE_RE.findall(e):
            found[key] = int(value)
    return elements, appsink, cfg.width or found.get("width"), cfg.height or found.get("height")


def _scale_to(w: int | None, h: int | None) -> list[str]:
    """The elements that convert a pipeline's frames to BGR at ``w`` x ``h`` (a size left None is
    negotiated by ``videoscale``, which keeps the aspect ratio)."""
    size = "".join(f",{key}={value}" for key, value in (("width", w), ("height", h)) if value)
    return ["videoconvert", "videoscale", f"video/x-raw,format=BGR{size}"]


def subprocess_pipeline(cfg: SourceConfig) -> tuple[str, int, int]:
    """``(pipeline, width, height)`` for reading a ``gstreamer``/``csi`` source through gst-launch.

    A user pipeline's final ``appsink ...`` element is replaced by a conversion to BGR at a fixed
    size and ``fdsink fd=1`` with the appsink's ``sync`` (default true, appsink's own: a non-live source
    such as ``videotestsrc`` is paced to its framerate as OpenCV's GStreamer backend paces it, instead of
    producing frames as fast as a core allows). The size is the config's ``width``/``height``, else the
    last ``width=``/``height=`` in the pipeline's caps.

    Raises:
        ValueError: the frame size cannot be known (set ``width`` and ``height``).
    """
    if cfg.kind == "csi":
        w, h = csi_output_size(cfg)
        return csi_pipeline(cfg, sink="fdsink"), w, h
    elements, appsink, w, h = _user_pipeline(cfg)
    if not w or not h:
        raise ValueError(
            f"source {cfg.name}: the frame size of {cfg.uri!r} is unknown; set width and height "
            "(needed to read raw frames from gst-launch-1.0)"
        )
    tail = [*_scale_to(w, h), _sink("fdsink", sync=_appsink_sync(appsink))]
    return " ! ".join([*elements, *tail]), w, h


def opencv_pipeline(cfg: SourceConfig) -> str:
    """The pipeline OpenCV's GStreamer backend opens for a ``gstreamer``/``csi`` source.

    A CSI source's is :func:`csi_pipeline` (its size is in its caps). A user pipeline is opened as written,
    unless the source sets ``width`` / ``height``: then, as on the gst-launch path
    (:func:`subprocess_pipeline`), its frames are converted to BGR and scaled to that size
    (``videoconvert ! videoscale ! video/x-raw,format=BGR,width=W,height=H``) before its final
    ``appsink ...`` element (kept as written; ``appsink`` is added when the pipeline has none), so the
    size a source asks for holds whichever path ``capture: auto`` picks on the host.
    """
    if cfg.kind == "csi":
        return csi_pipeline(cfg)
    if cfg.width is None and cfg.height is None:
        return str(cfg.uri)
    elements, appsink, w, h = _user_pipeline(cfg)
    return " ! ".join([*elements, *_scale_to(w, h), appsink or "appsink"])


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
        self._drain: threading.Thread | None = None

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
        self._drain = threading.Thread(target=self._drain_stderr, name=f"gst-stderr-{self.cfg.name}", daemon=True)
        self._drain.start()
        # DEBUG: the source logs its (re)opens, once at INFO; a camera down for hours reopens every few seconds
        logger.debug("source %s: reading %dx%d BGR from %s", self.cfg.name, self.width, self.height, shlex.join(cmd))
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

    def error_text(self, wait_s: float = 1.0) -> str:
        """Why gst-launch ended: its exit status when not 0 and its last stderr lines. Called once its
        stdout has ended, so the child is exiting: it and the stderr reader are waited for (up to
        ``wait_s`` each), or a failure's reason (``erroneous pipeline: no element "x"``) would be read
        before the reader thread had it, and missing from the error on some attempts."""
        proc, drain = self.proc, self._drain
        status = None
        if proc is not None:
            try:
                status = proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                status = None
        if drain is not None and status is not None:
            drain.join(wait_s)
        text = " | ".join(line for line in self._stderr if line)[-400:]
        if status:  # not None, not 0
            exited = f"{os.path.basename(self.cfg.gst_launch)} exited with status {status}"
            return f"{exited}: {text}" if text else exited
        return text

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

