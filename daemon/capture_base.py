"""What every camera capture backend shares: the interface, OpenCV's import and how a source is
read (:func:`capture_path`). The backends: :mod:`edgevlm.daemon.capture_opencv`,
:mod:`edgevlm.daemon.capture_gst`; :func:`edgevlm.daemon.capture.make_backend` picks one.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import numpy as np

from edgevlm.config import SourceConfig

__all__ = ["CaptureBackend", "capture_path", "opencv_has_gstreamer"]


def _cv2() -> Any:
    """OpenCV, with its own console logging quieted (see :func:`_quiet_opencv`)."""
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("camera sources need OpenCV: pip install 'edgevlm[runtime]'") from exc
    _quiet_opencv(cv2)
    return cv2


@functools.lru_cache(maxsize=1)
def _quiet_opencv(cv2: Any) -> None:
    """OpenCV writes ``[ WARN:0@1.2] global cap_ffmpeg_impl.hpp ...`` lines straight to stderr,
    outside Python's logging, and its FFmpeg backend lets FFmpeg print its own (``[mov,mp4,...] moov
    atom not found`` for a truncated file, at every reopen). Capture reports what they say through
    logging itself (a timed-out open or read becomes the source's ``last_error`` and a WARNING), so
    both are silenced: OpenCV's through its API (``cv2.utils.logging.setLogLevel``), FFmpeg's with
    ``OPENCV_FFMPEG_LOGLEVEL=-8`` (AV_LOG_QUIET; OpenCV reads it when its FFmpeg backend first opens
    something, so before any capture; a value the user set is kept). At DEBUG on this logger both are
    kept for diagnosis."""
    debug = logging.getLogger(__name__).isEnabledFor(logging.DEBUG)
    if not debug:
        os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
    cv_logging = getattr(getattr(cv2, "utils", None), "logging", None)
    if cv_logging is None:  # pragma: no cover - OpenCV builds without the logging API
        return
    cv_logging.setLogLevel(cv_logging.LOG_LEVEL_WARNING if debug else cv_logging.LOG_LEVEL_SILENT)


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
