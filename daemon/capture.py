"""Camera capture backends used by :mod:`edgevlm.daemon.sources` (this module picks one and
re-exports the public names of the modules it is made of).

A backend opens one camera/stream and returns BGR ``uint8`` frames; every call may block, so the
source's supervisor runs it in a reader thread and abandons it on a timeout (:meth:`abort`
unblocks what can be unblocked).

- :class:`OpenCVCapture` (:mod:`~edgevlm.daemon.capture_opencv`): ``cv2.VideoCapture`` for V4L2 devices, video files, RTSP/HTTP streams
  (FFmpeg, with ``CAP_PROP_OPEN_TIMEOUT_MSEC`` / ``CAP_PROP_READ_TIMEOUT_MSEC``) and GStreamer
  pipelines when OpenCV is built with GStreamer (JetPack's OpenCV is, the PyPI wheels are not).
  V4L2: the pixel format is chosen from the device's capabilities (:func:`choose_pixel_format`)
  and set *before* size and rate (drivers validate size/rate against the current format), then
  the negotiated values are read back and logged.
- :class:`GstSubprocessCapture` (:mod:`~edgevlm.daemon.capture_gst`): a ``gst-launch-1.0 -q <pipeline> ! fdsink fd=1`` child process
  writing raw BGR frames of a known size to a pipe; used where OpenCV lacks GStreamer.
- :func:`csi_pipeline` (:mod:`~edgevlm.daemon.capture_gst`): the Jetson CSI pipeline (``nvarguscamerasrc ! nvvidconv ! BGRx !
  videoconvert ! BGR ! appsink``, NVIDIA's "Accelerated GStreamer" guide) built from config fields.

V4L2 capability probing is in :mod:`edgevlm.daemon.v4l2`; its structures and ioctl numbers follow ``linux/videodev2.h`` (VIDIOC_ENUM_FMT,
VIDIOC_ENUM_FRAMESIZES, VIDIOC_ENUM_FRAMEINTERVALS).
"""

from __future__ import annotations

from edgevlm.config import SourceConfig
from edgevlm.daemon.capture_base import CaptureBackend, _cv2, capture_path, opencv_has_gstreamer
from edgevlm.daemon.capture_gst import (
    CSI_DEFAULT_FPS,
    CSI_DEFAULT_HEIGHT_PX,
    CSI_DEFAULT_WIDTH_PX,
    GstSubprocessCapture,
    csi_output_size,
    csi_pipeline,
    opencv_pipeline,
    subprocess_pipeline,
)
from edgevlm.daemon.capture_opencv import OpenCVCapture
from edgevlm.daemon.v4l2 import (
    DeviceCaps,
    FrameMode,
    choose_pixel_format,
    fourcc_int,
    fourcc_str,
    query_v4l2_caps,
)

__all__ = [
    "CSI_DEFAULT_FPS",
    "CSI_DEFAULT_HEIGHT_PX",
    "CSI_DEFAULT_WIDTH_PX",
    "CaptureBackend",
    "DeviceCaps",
    "FrameMode",
    "GstSubprocessCapture",
    "OpenCVCapture",
    "_cv2",
    "capture_path",
    "choose_pixel_format",
    "csi_output_size",
    "csi_pipeline",
    "fourcc_int",
    "fourcc_str",
    "make_backend",
    "opencv_has_gstreamer",
    "opencv_pipeline",
    "query_v4l2_caps",
    "subprocess_pipeline",
]


def make_backend(cfg: SourceConfig) -> CaptureBackend:
    """The backend for a source (see :func:`capture_path`). Raises ValueError for a GStreamer
    pipeline read through gst-launch whose frame size is unknown."""
    if capture_path(cfg) == "gst-launch-subprocess":
        return GstSubprocessCapture(cfg)
    return OpenCVCapture(cfg)
