"""The ``cv2.VideoCapture`` backend: V4L2 devices, video files, RTSP/HTTP streams (FFmpeg, with
``CAP_PROP_OPEN_TIMEOUT_MSEC`` / ``CAP_PROP_READ_TIMEOUT_MSEC``) and GStreamer pipelines when
OpenCV is built with GStreamer (JetPack's OpenCV is, the PyPI wheels are not; a pipeline's frames
are scaled to the source's ``width``/``height`` as on the gst-launch path:
:func:`~edgevlm.daemon.capture_gst.opencv_pipeline`).

V4L2: the pixel format is chosen from the device's capabilities
(:func:`edgevlm.daemon.v4l2.choose_pixel_format`) and set *before* size and rate (drivers
validate size/rate against the current format), then the negotiated values are read back and
logged.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

from edgevlm.config import SourceConfig
from edgevlm.daemon.capture_base import CaptureBackend, _cv2, capture_path
from edgevlm.daemon.capture_gst import opencv_pipeline
from edgevlm.daemon.v4l2 import choose_pixel_format, fourcc_int, fourcc_str, query_v4l2_caps

logger = logging.getLogger(__name__)

__all__ = ["OpenCVCapture"]


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
            cap = cv2.VideoCapture(opencv_pipeline(cfg), cv2.CAP_GSTREAMER, timeouts)
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

