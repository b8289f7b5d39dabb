"""Input sections of the daemon config: camera ``sources`` (V4L2, GStreamer, streams, video files,
Jetson CSI), microphones (``audio``) and label ``monitors`` (see :mod:`edgevlm.config`, which
re-exports them)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from edgevlm.types import MAX_RESOLUTION_PX
from edgevlm.validation import ConfigPath, StrictModel

SourceKind = Literal["v4l2", "gstreamer", "stream", "file", "csi"]

_V4L2_DEV_RE = re.compile(r"^/dev/video\d+$")
_STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://")


class CsiConfig(StrictModel):
    """A CSI camera on a Jetson, read through ``nvarguscamerasrc`` (the GStreamer pipeline is built
    from these fields and the source's ``width``/``height``/``fps``)."""

    sensor_id: int = Field(0, ge=0, le=15, description="nvarguscamerasrc sensor-id (CSI port).")
    sensor_mode: int | None = Field(
        None, ge=0, le=31, description="nvarguscamerasrc sensor-mode; None = chosen from size and fps."
    )
    flip_method: int = Field(
        0,
        ge=0,
        le=7,
        description="nvvidconv flip-method: 0 none, 1 rotate 90 counter-clockwise, 2 rotate 180, 3 rotate 90 "
        "clockwise, 4 horizontal flip, 5 upper-right diagonal, 6 vertical flip, 7 upper-left diagonal.",
    )


class SourceConfig(StrictModel):
    """One camera: a V4L2 index or /dev/videoN, a GStreamer pipeline (contains ' ! '), an RTSP/HTTP
    URL, a video file (played in a loop at its native fps), or a Jetson CSI camera (``csi:``)."""

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Name requests use."
    )
    uri: int | str | None = Field(
        None, description="V4L2 index, /dev/videoN, GStreamer pipeline, URL, or video file path (not with csi)."
    )
    csi: CsiConfig | None = Field(None, description="A Jetson CSI camera (instead of uri).")
    width: int | None = Field(
        None, gt=0, le=16384, description="Frame width requested from a V4L2/CSI camera (px); None = device "
        "default (CSI: 1280). On a GStreamer pipeline: the width its frames are scaled to (either capture "
        "path). Refused on a video file and a network stream (they would ignore it)."
    )
    height: int | None = Field(
        None, gt=0, le=16384, description="Frame height requested from a V4L2/CSI camera (px); None = device "
        "default (CSI: 720). On a GStreamer pipeline: the height its frames are scaled to. Refused where "
        "width is."
    )
    fps: float | None = Field(
        None, gt=0, le=1000, description="Pace of a video file (None = the file's native fps), or the frame "
        "rate requested from a V4L2/CSI camera (None = device default; CSI: 30). Refused on a network stream "
        "and a GStreamer pipeline (they run at their own rate and would ignore it)."
    )
    pixel_format: str = Field(
        "auto", description="V4L2 FOURCC to request (e.g. MJPG, YUYV); 'auto' = chosen from the device's "
        "capabilities (MJPG when YUYV cannot deliver the size and rate)."
    )
    capture: Literal["auto", "opencv", "subprocess"] = Field(
        "auto", description="How GStreamer/CSI pipelines are read: 'opencv' (OpenCV's GStreamer backend), "
        "'subprocess' (raw BGR frames from a gst-launch-1.0 ... ! fdsink process), 'auto' = opencv when "
        "OpenCV has GStreamer, else subprocess."
    )
    gst_launch: str = Field("gst-launch-1.0", min_length=1, description="gst-launch-1.0 executable (name or path).")
    open_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Longest wait for a camera/stream to open (s); then it is retried."
    )
    read_timeout_s: float = Field(
        5.0, gt=0, le=600, description="Longest wait for one frame (s); a stream silent for longer is reopened."
    )
    max_frame_age_s: float | None = Field(
        2.0, gt=0, description="A request is not answered from a frame older than this (s); None = any age."
    )
    frozen_after_s: float | None = Field(
        10.0, gt=0, le=86400, description="A live camera whose frames stay identical byte for byte this long "
        "is 'frozen' (a stuck pipeline; a real sensor's noise never repeats a frame) and requests on it get "
        "reason frozen_frame (s); None = never. Video files are not checked (they may hold stills)."
    )
    reopen_delay_s: float = Field(
        2.0, gt=0, le=3600, description="First delay before reopening a camera that failed or stopped (s); "
        "doubles on each failure up to reconnect_max_delay_s."
    )
    reconnect_max_delay_s: float = Field(
        30.0, gt=0, le=3600, description="Cap of the reopen backoff (s)."
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: int | str | None) -> int | str | None:
        if v is None:
            return v
        if isinstance(v, int):
            if v < 0:
                raise ValueError("a V4L2 index must be >= 0")
            return v
        v = v.strip()
        if not v:
            raise ValueError("must not be empty")
        if v.isdigit():
            return int(v)
        return v

    @field_validator("pixel_format")
    @classmethod
    def _fourcc(cls, v: str) -> str:
        if v.lower() == "auto":
            return "auto"
        if not re.fullmatch(r"[A-Za-z0-9 ]{4}", v):
            raise ValueError(f"expected 'auto' or a four-character code such as MJPG or YUYV, got {v!r}")
        return v.upper()

    @model_validator(mode="after")
    def _one_of(self) -> SourceConfig:
        if self.uri is None and self.csi is None:
            raise ValueError("uri: required key missing")
        if self.uri is not None and self.csi is not None:
            raise ValueError("csi: give either uri or csi, not both")
        if self.reconnect_max_delay_s < self.reopen_delay_s:
            raise ValueError("reconnect_max_delay_s: must be >= reopen_delay_s")
        ignored = _ignored_setting(self)
        if ignored is not None:
            raise ValueError(ignored)
        return self

    @property
    def kind(self) -> SourceKind:
        """What the source is: ``v4l2``, ``gstreamer``, ``stream`` (URL), ``file`` or ``csi``."""
        if self.csi is not None:
            return "csi"
        assert self.uri is not None  # checked by _one_of
        return source_kind(self.uri)


_SIZE_APPLIES = (
    "applies to V4L2/CSI cameras (the size requested from the device) and to a GStreamer pipeline "
    "(the size its frames are scaled to)"
)
_FPS_APPLIES = "applies to V4L2/CSI cameras (the rate requested from the device) and paces a video file"


def _ignored_setting(src: SourceConfig) -> str | None:
    """``'<key>: why'`` for the first of ``width`` / ``height`` / ``fps`` that is set on a source whose
    capture never uses it (so it would be silently ignored), else None. The one place this rule lives:
    ``width``/``height`` are used by V4L2 and CSI cameras and by a GStreamer pipeline on either capture
    path (``capture: auto`` picks one at run time; both scale the frames to them: ``opencv_pipeline`` and
    ``subprocess_pipeline`` in :mod:`edgevlm.daemon.capture_gst`); ``fps`` by V4L2 and CSI cameras and to
    pace a video file. A V4L2 camera takes ``width`` and ``height`` together (one alone is refused)."""
    kind = src.kind
    if kind == "v4l2" and (src.width is None) != (src.height is None):
        key, other = ("width", "height") if src.width is not None else ("height", "width")
        return (f"{key}: a V4L2 camera is asked for a frame size as width and height together, so {key} "
                f"alone would be ignored; set {other} too, or remove {key}")
    for key in ("width", "height"):
        if getattr(src, key) is None:
            continue
        if kind == "file":
            return f"{key}: a video file is decoded at its own size; {key} {_SIZE_APPLIES}; remove it"
        if kind == "stream":
            return f"{key}: a network stream is decoded at the size it is sent; {key} {_SIZE_APPLIES}; remove it"
    if src.fps is not None:
        if kind == "stream":
            return f"fps: a network stream arrives at its sender's rate; fps {_FPS_APPLIES}; remove it"
        if kind == "gstreamer":
            return (f"fps: a GStreamer pipeline runs at the framerate of its caps (set framerate=N/1 in them); "
                    f"fps {_FPS_APPLIES}; remove it")
    return None


def source_kind(uri: int | str) -> SourceKind:
    """Classify a source uri (see :class:`SourceConfig`)."""
    if isinstance(uri, int) or _V4L2_DEV_RE.match(uri):
        return "v4l2"
    if " ! " in uri or uri.rstrip().endswith("appsink"):
        return "gstreamer"
    if uri.lower().startswith(_STREAM_SCHEMES):
        return "stream"
    return "file"


class VadConfig(StrictModel):
    """Energy voice-activity detection on an audio source."""

    enabled: bool = Field(True, description="Publish voice_start/voice_end events.")
    frame_ms: int = Field(30, ge=10, le=100, description="Analysis frame (ms).")
    threshold_db: float = Field(
        12.0, gt=0, le=60, description="Speech: frame level this many dB above the tracked noise floor."
    )
    min_level_dbfs: float = Field(
        -50.0, ge=-120, le=0, description="Frames quieter than this (dBFS) are never speech."
    )
    start_ms: int = Field(90, ge=0, le=5000, description="Loud frames needed in a row to start a segment (ms).")
    hangover_ms: int = Field(300, ge=0, le=10000, description="Quiet time that ends a segment (ms).")


class AudioSourceConfig(StrictModel):
    """A microphone (PortAudio via sounddevice) or a WAV file played like one."""

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Name requests and topics use."
    )
    device: int | str | None = Field(
        None, description="PortAudio input device index or name (substring); None = the default input."
    )
    file: ConfigPath | None = Field(None, description="A WAV file to play in real time instead of a microphone.")
    loop: bool = Field(True, description="Play the WAV file in a loop; false = once, then the source is 'ended'.")
    sample_rate_hz: int = Field(16000, ge=4000, le=192000, description="Rate of the buffered audio (Hz).")
    device_rate_hz: int | None = Field(
        None, ge=4000, le=384000, description="Rate to open the device at; None = its native (default) rate."
    )
    device_channels: int | None = Field(
        None, ge=1, le=64, description="Channels to open; None = the device's own count (2 for virtual "
        "devices reporting more than 8). Audio is downmixed to mono."
    )
    block_ms: int = Field(20, ge=5, le=500, description="Capture block (ms).")
    buffer_s: float = Field(30.0, gt=0, le=3600, description="Length of the ring buffer of recent audio (s).")
    level_interval_s: float | None = Field(
        1.0, gt=0, le=3600, description="Period of level events (s); None = none."
    )
    vad: VadConfig = Field(default_factory=VadConfig, description="Voice-activity detection.")
    reopen_delay_s: float = Field(2.0, gt=0, le=3600, description="First delay before reopening a failed device (s).")
    reconnect_max_delay_s: float = Field(30.0, gt=0, le=3600, description="Cap of the reopen backoff (s).")

    @model_validator(mode="after")
    def _check(self) -> AudioSourceConfig:
        if self.file is not None and self.device is not None:
            raise ValueError("file: give either device or file, not both")
        return self


class MonitorConfig(StrictModel):
    """A continuous check of a camera: the vision encoder up to an exit classifier at a target rate,
    publishing ``<prefix>/<device_id>/events/<name>`` when the set of present labels changes."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Monitor name (topic level).")
    source: str = Field(min_length=1, description="Name of the camera source to watch.")
    labels: list[str] = Field(
        min_length=1, description="Exit-classifier labels to watch (e.g. 'red', 'large bottom'); see exits.json."
    )
    fps: float = Field(2.0, gt=0, le=60, description="Target frames per second (requests take priority).")
    threshold: float = Field(0.5, gt=0, lt=1, description="Label probability at which a label counts as present.")
    debounce_frames: int = Field(
        3, ge=1, le=1000, description="Frames in a row that must show a new state before it is published."
    )
    resolution_px: int | None = Field(
        None, gt=0, le=MAX_RESOLUTION_PX, description="Input resolution (longer side, px, at least the model's "
        "patch size); None = the lowest rung of the model's ladder."
    )
    exit_layer: int | None = Field(
        None, ge=1, description="Vision block whose classifier to use; None = the earliest classifier."
    )
