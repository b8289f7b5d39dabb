"""The daemon's YAML configuration (``edgevlm serve --config FILE``), validated by pydantic.

Unknown keys are rejected; :func:`load_daemon_config` raises :class:`~edgevlm.errors.ConfigError`
with a one-line message that starts with the key path, e.g. ``mqtt.prot: unknown key`` or
``sources[1].uri: video file not found: /data/x.mp4``.

Example::

    mqtt:
      host: localhost
      port: 1883
      device_id: robot-1
    model:
      path: null          # null = the shipped demo model
    sources:
      - name: front
        uri: 0                              # V4L2 index
      - name: rear
        uri: /dev/video2                    # V4L2 device
      - name: dock
        uri: rtsp://10.0.0.5:8554/dock      # RTSP
      - name: sim
        uri: scenes.mp4                     # a video file, looped at its native fps
      - name: csi
        uri: "nvarguscamerasrc ! video/x-raw(memory:NVMM) ! nvvidconv ! video/x-raw,format=BGRx ! videoconvert ! appsink"
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edgevlm.errors import ConfigError
from edgevlm.protocol import (
    DEFAULT_PREFIX,
    MAX_NEW_TOKENS_LIMIT,
    NO_DEADLINE_MS,
    check_device_id,
    check_prefix,
)
from edgevlm.validation import first_error_message

SourceKind = Literal["v4l2", "gstreamer", "stream", "file", "csi"]

_V4L2_DEV_RE = re.compile(r"^/dev/video\d+$")
_STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://")


def _default_device_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "edgevlm"
    return host[:64]


class TlsConfig(BaseModel):
    """TLS towards the broker (paho's ``tls_set``)."""

    model_config = ConfigDict(extra="forbid")

    ca_certs: Path | None = Field(None, description="CA bundle (PEM); None = the system's trust store.")
    certfile: Path | None = Field(None, description="Client certificate (PEM) for mutual TLS.")
    keyfile: Path | None = Field(None, description="Client private key (PEM) for mutual TLS.")
    insecure: bool = Field(False, description="Skip the broker hostname check (testing only).")


class MqttConfig(BaseModel):
    """Broker connection and topic layout."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("localhost", min_length=1, description="Broker host name or IP address.")
    port: int = Field(1883, ge=1, le=65535, description="Broker TCP port.")
    prefix: str = Field(DEFAULT_PREFIX, description="Topic prefix: topics are <prefix>/<device_id>/...")
    device_id: str = Field(
        default_factory=_default_device_id,
        description="This device's id (one topic level); default: hostname.",
    )
    client_id: str | None = Field(
        None,
        max_length=128,
        description="MQTT client id; None = 'edgevlm-daemon-<device_id>' (unique per device, stable across "
        "restarts).",
    )
    keepalive_s: int = Field(30, ge=5, le=65535, description="MQTT keepalive interval (s).")
    qos: Literal[0, 1, 2] = Field(1, description="QoS of the request subscription, responses and status.")
    username: str | None = Field(None, description="Broker user name.")
    password: str | None = Field(None, description="Broker password (needs username).")
    tls: TlsConfig | None = Field(None, description="TLS settings; None = plain TCP.")
    reconnect_min_delay_s: float = Field(
        1.0, gt=0, le=3600, description="First delay before reconnecting after the connection is lost (s)."
    )
    reconnect_max_delay_s: float = Field(
        30.0, gt=0, le=3600, description="Cap of the exponential reconnect backoff (s)."
    )
    max_payload_bytes: int = Field(
        16 * 1024 * 1024, gt=0, description="Larger request payloads are refused with INVALID_REQUEST."
    )
    session_expiry_s: int = Field(
        0,
        ge=0,
        le=4294967295,
        description="MQTT v5 Session Expiry Interval (s). 0 = a clean session on every connect; > 0 keeps "
        "the request subscription and queued QoS>=1 requests across reconnects and (with a persistent "
        "broker) broker restarts, so requests published during an outage are answered afterwards; each "
        "start of the daemon still begins a clean session.",
    )

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return check_prefix(v)

    @field_validator("device_id")
    @classmethod
    def _device_id(cls, v: str) -> str:
        return check_device_id(v)

    @model_validator(mode="after")
    def _check(self) -> MqttConfig:
        if self.reconnect_max_delay_s < self.reconnect_min_delay_s:
            raise ValueError("reconnect_max_delay_s: must be >= reconnect_min_delay_s")
        if self.password is not None and self.username is None:
            raise ValueError("password: needs a username")
        return self

    @property
    def effective_client_id(self) -> str:
        return self.client_id or f"edgevlm-daemon-{self.device_id}"


class ModelConfig(BaseModel):
    """Which model the inference worker loads (``edgevlm.runtime.Engine.load``)."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(
        None, description="Model folder or engine bundle; None = the shipped demo model."
    )
    device: str = Field("cpu", description="torch device: 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Activation dtype; None = float32 on CPU, bfloat16 on CUDA."
    )
    backend: Literal["torch", "onnx", "tensorrt"] = Field(
        "torch", description="Inference backend: torch, onnx (ONNX Runtime; needs a bundle) or tensorrt."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="torch intra-op threads (process-wide); None = torch's default (one per core). On a "
        "robot whose CPU is shared with other processes, fewer threads than cores avoid OpenMP threads "
        "spinning against each other (measured: 1 thread 10x faster than 2 on a loaded 2-core machine).",
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        le=256,
        description="KV-cache rows of the torch backend (requests decoded together); None = the profile's "
        "runtime.max_batch_size on CUDA, 1 on CPU.",
    )
    continuous_batching: bool | None = Field(
        None,
        description="Decode concurrent requests together (waiting requests join the running decode batch "
        "between steps; edgevlm.daemon.batching); needs the torch backend and max_batch_size >= 2. None = the "
        "profile's runtime.continuous_batching on CUDA, off on CPU.",
    )
    prefill_token_budget: int | None = Field(
        None,
        ge=1,
        le=1048576,
        description="Padded tokens per batched prefill group (rows x longest prompt, vision tokens included); "
        "None = the profile's runtime.prefill_token_budget (1024).",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.match(r"^(cpu|cuda(:\d+)?)$", v):
            raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_batching(self) -> ModelConfig:
        if self.backend != "torch":
            for key in ("max_batch_size", "continuous_batching"):
                if getattr(self, key) not in (None, False):
                    raise ValueError(f"{key}: needs backend 'torch' (got {self.backend!r})")
        if self.continuous_batching and self.max_batch_size is not None and self.max_batch_size < 2:
            raise ValueError("continuous_batching: needs max_batch_size >= 2")
        if self.backend != "torch" and self.path is None:
            raise ValueError(
                f"backend: {self.backend!r} runs engine bundles only, and model.path is null (the shipped demo "
                "model, not a bundle): set model.path to a bundle built by `edgevlm quantize`, or use backend 'torch'"
            )
        if self.backend == "tensorrt" and not self.device.startswith("cuda"):
            raise ValueError(f"backend: 'tensorrt' needs a CUDA device (model.device is {self.device!r})")
        return self


class CsiConfig(BaseModel):
    """A CSI camera on a Jetson, read through ``nvarguscamerasrc`` (the GStreamer pipeline is built
    from these fields and the source's ``width``/``height``/``fps``)."""

    model_config = ConfigDict(extra="forbid")

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


class SourceConfig(BaseModel):
    """One camera: a V4L2 index or /dev/videoN, a GStreamer pipeline (contains ' ! '), an RTSP/HTTP
    URL, a video file (played in a loop at its native fps), or a Jetson CSI camera (``csi:``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Name requests use."
    )
    uri: int | str | None = Field(
        None, description="V4L2 index, /dev/videoN, GStreamer pipeline, URL, or video file path (not with csi)."
    )
    csi: CsiConfig | None = Field(None, description="A Jetson CSI camera (instead of uri).")
    width: int | None = Field(
        None, gt=0, le=16384, description="Frame width requested from a V4L2/CSI camera (px); None = device "
        "default (CSI: 1280). Also the raw frame width of a GStreamer subprocess pipeline."
    )
    height: int | None = Field(
        None, gt=0, le=16384, description="Frame height requested from a V4L2/CSI camera (px); None = device "
        "default (CSI: 720)."
    )
    fps: float | None = Field(
        None, gt=0, le=1000, description="Pace of a video file (None = the file's native fps), or the frame "
        "rate requested from a V4L2/CSI camera (None = device default; CSI: 30)."
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
        return self

    @property
    def kind(self) -> SourceKind:
        """What the source is: ``v4l2``, ``gstreamer``, ``stream`` (URL), ``file`` or ``csi``."""
        if self.csi is not None:
            return "csi"
        assert self.uri is not None  # checked by _one_of
        return source_kind(self.uri)


def source_kind(uri: int | str) -> SourceKind:
    """Classify a source uri (see :class:`SourceConfig`)."""
    if isinstance(uri, int) or _V4L2_DEV_RE.match(uri):
        return "v4l2"
    if " ! " in uri or uri.rstrip().endswith("appsink"):
        return "gstreamer"
    if uri.lower().startswith(_STREAM_SCHEMES):
        return "stream"
    return "file"


class DefaultsConfig(BaseModel):
    """Values used when a request leaves a field out."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(32, gt=0, le=MAX_NEW_TOKENS_LIMIT, description="Cap on generated tokens.")
    timeout_ms: int = Field(
        30000, gt=0, le=NO_DEADLINE_MS, description=f"Request deadline (ms); {NO_DEADLINE_MS} = no deadline."
    )


class LimitsConfig(BaseModel):
    """Limits on what a request may make the daemon decode (``mqtt.max_payload_bytes`` caps the
    whole payload)."""

    model_config = ConfigDict(extra="forbid")

    max_image_bytes: int = Field(
        10 * 1024 * 1024, gt=0, description="Largest inline image file (bytes after base64); more is INVALID_IMAGE."
    )
    max_image_pixels: int = Field(
        4096 * 4096,
        gt=0,
        description="Largest inline image width x height, read from the file header before decoding "
        "(a decompression bomb is INVALID_IMAGE, never decoded).",
    )


class MetricsConfig(BaseModel):
    """The Prometheus endpoint (``edgevlm.daemon.metrics``)."""

    model_config = ConfigDict(extra="forbid")

    listen: str | None = Field(
        "127.0.0.1:9108",
        description="HOST:PORT, [IPV6]:PORT or PORT (all interfaces) to serve /metrics on; None = no endpoint.",
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from edgevlm.daemon.metrics import parse_listen_address  # pure function; no prometheus import

        parse_listen_address(v)
        return v


class TelemetryConfig(BaseModel):
    """The JSON summary published on ``<prefix>/<device_id>/telemetry``."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float | None = Field(10.0, gt=0, le=86400, description="Publish period (s); None = off.")


class TegrastatsConfig(BaseModel):
    """Jetson telemetry from ``tegrastats`` (absent binary = off, logged once)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Read tegrastats when it is available.")
    interval_ms: int = Field(1000, gt=0, le=60000, description="tegrastats --interval (ms).")
    binary: str = Field("tegrastats", min_length=1, description="tegrastats executable (name or path).")
    log_path: Path | None = Field(
        None, description="Tail this tegrastats --logfile instead of running the binary."
    )
    temp_limit_c: float = Field(
        95.0, gt=0, le=150, description="A sensor at/above this counts as thermal throttling (deg C)."
    )
    reference_gpu_freq_mhz: int | None = Field(
        None, gt=0, description="Full GPU clock of the power mode (MHz); None = the highest clock seen."
    )


class ServiceConfig(BaseModel):
    """systemd integration and shutdown."""

    model_config = ConfigDict(extra="forbid")

    shutdown_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="On SIGTERM, how long the request in flight may run before it is "
        "answered BUSY and the daemon exits (keep below the unit's TimeoutStopSec=)."
    )
    worker_idle_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="An idle inference worker silent for longer counts as hung (s)."
    )
    worker_busy_timeout_s: float | None = Field(
        None, gt=0, le=86400, description="A single request running longer counts as a hung worker (s): the "
        "systemd watchdog pings stop. None = 2 x defaults.timeout_ms + 60 s (at most 1 h)."
    )


class VadConfig(BaseModel):
    """Energy voice-activity detection on an audio source."""

    model_config = ConfigDict(extra="forbid")

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


class AudioSourceConfig(BaseModel):
    """A microphone (PortAudio via sounddevice) or a WAV file played like one."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Name requests and topics use."
    )
    device: int | str | None = Field(
        None, description="PortAudio input device index or name (substring); None = the default input."
    )
    file: Path | None = Field(None, description="A WAV file to play in real time instead of a microphone.")
    loop: bool = Field(True, description="Play the WAV file in a loop.")
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


class ReloadConfig(BaseModel):
    """Hot reload of the engine (SIGHUP, or a new bundle in ``watch_dir``)."""

    model_config = ConfigDict(extra="forbid")

    watch_dir: Path | None = Field(
        None, description="Folder of engine bundles / model folders; a new complete one is loaded."
    )
    poll_interval_s: float = Field(2.0, gt=0, le=3600, description="How often watch_dir is scanned (s).")
    settle_s: float = Field(
        2.0, ge=0, le=3600, description="A new folder must be unchanged this long before it is loaded (s)."
    )
    strategy: Literal["auto", "side_by_side", "drain_and_swap"] = Field(
        "auto", description="side_by_side: load the new engine while the old one serves; drain_and_swap: "
        "stop serving, free the old one, load the new one; auto = side_by_side when memory allows."
    )
    memory_factor: float = Field(
        1.5, ge=1.0, le=10, description="auto: a new engine needs this x its weight bytes of free memory."
    )
    load_test: bool = Field(True, description="Answer one test question with the new engine before switching.")


class ControllerConfig(BaseModel):
    """The latency controller (``edgevlm.runtime.policy``): per request, the most accurate operating
    point predicted to finish within the request's budget."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="Choose an operating point per request; false = every request runs the model's default."
    )
    default_budget_ms: int | None = Field(
        None, gt=0, description="Budget of a request without budget_ms (ms); None = the profile's default_budget_ms."
    )
    frontier: Path | None = Field(
        None,
        description="frontier.json to use; None = the model's frontier.json, else the profile's frontier, else "
        "one point per resolution rung measured at start-up.",
    )
    alpha: float = Field(0.3, gt=0, le=1, description="EWMA weight of a new latency measurement.")
    headroom: float = Field(0.9, gt=0, le=1, description="Fraction of the budget a prediction may use.")
    step_up_after: int = Field(
        3, ge=1, le=1000, description="Requests in a row with room to spare before stepping up one point."
    )
    step_up_margin: float = Field(
        0.8, gt=0, le=1, description="Extra headroom the point above must show to count towards a step up."
    )


class MonitorConfig(BaseModel):
    """A continuous check of a camera: the vision encoder up to an exit classifier at a target rate,
    publishing ``<prefix>/<device_id>/events/<name>`` when the set of present labels changes."""

    model_config = ConfigDict(extra="forbid")

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
        None, gt=0, description="Input resolution (longer side, px); None = the lowest rung of the model's ladder."
    )
    exit_layer: int | None = Field(
        None, ge=1, description="Vision block whose classifier to use; None = the earliest classifier."
    )


class DaemonConfig(BaseModel):
    """The whole daemon configuration."""

    model_config = ConfigDict(extra="forbid")

    mqtt: MqttConfig = Field(default_factory=MqttConfig, description="Broker connection and topics.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model the worker loads.")
    sources: list[SourceConfig] = Field(default_factory=list, description="Camera sources.")
    queue_max_size: int = Field(
        4, ge=1, le=10000, description="Requests waiting for the worker; more are answered BUSY."
    )
    defaults: DefaultsConfig = Field(default_factory=DefaultsConfig, description="Request defaults.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        description="Logging level of `edgevlm serve`. INFO by default (unlike the other commands, which log "
        "only warnings without -v): a service logs its start-up, broker connections and camera state to the "
        "journal. -v / -vv on the command line override it with INFO / DEBUG.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request decoding limits.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus endpoint.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="MQTT telemetry summary.")
    tegrastats: TegrastatsConfig = Field(default_factory=TegrastatsConfig, description="Jetson telemetry.")
    service: ServiceConfig = Field(default_factory=ServiceConfig, description="systemd watchdog and shutdown.")
    audio: list[AudioSourceConfig] = Field(default_factory=list, description="Microphones and WAV sources.")
    reload: ReloadConfig = Field(default_factory=ReloadConfig, description="Hot reload of the engine.")
    profile: str | None = Field(
        None, description="Device profile name (profiles/<name>.yaml) or YAML path; None = 'cpu' for a CPU model."
    )
    controller: ControllerConfig = Field(default_factory=ControllerConfig, description="Latency controller.")
    monitors: list[MonitorConfig] = Field(default_factory=list, description="Continuous label monitors.")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _unique_sources(self) -> DaemonConfig:
        seen: set[str] = set()
        for i, src in enumerate(self.sources):
            if src.name in seen:
                raise ValueError(f"sources[{i}].name: duplicate source name {src.name!r}")
            seen.add(src.name)
        names: set[str] = set()
        for i, mic in enumerate(self.audio):
            if mic.name in names:
                raise ValueError(f"audio[{i}].name: duplicate audio source name {mic.name!r}")
            names.add(mic.name)
        monitors: set[str] = set()
        for i, mon in enumerate(self.monitors):
            if mon.name in monitors:
                raise ValueError(f"monitors[{i}].name: duplicate monitor name {mon.name!r}")
            monitors.add(mon.name)
            if mon.source not in seen:
                raise ValueError(f"monitors[{i}].source: unknown source {mon.source!r} (sources: {sorted(seen)})")
        return self


def parse_daemon_config(data: Any, *, base_dir: Path | None = None) -> DaemonConfig:
    """Validate a config mapping. Relative video-file paths and model paths resolve against
    ``base_dir`` (the config file's folder; default: the working directory); a video file that
    does not exist is an error.

    Raises:
        ConfigError: one line naming the key path.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"$: expected a mapping at the top level, got {type(data).__name__}")
    try:
        cfg = DaemonConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(first_error_message(exc)) from None
    base = base_dir or Path.cwd()
    if cfg.model.path is not None and not cfg.model.path.is_absolute():
        cfg.model.path = (base / cfg.model.path).resolve()
    for i, src in enumerate(cfg.sources):
        if src.kind != "file":
            continue
        path = Path(str(src.uri)).expanduser()
        if not path.is_absolute():
            path = (base / path).resolve()
        if not path.is_file():
            raise ConfigError(f"sources[{i}].uri: video file not found: {path}")
        src.uri = str(path)
    if cfg.controller.frontier is not None:
        fr = cfg.controller.frontier.expanduser()
        cfg.controller.frontier = fr if fr.is_absolute() else (base / fr).resolve()
        if not cfg.controller.frontier.is_file():
            raise ConfigError(f"controller.frontier: file not found: {cfg.controller.frontier}")
    if cfg.profile is not None:
        from edgevlm.profile import load_profile

        prof = Path(cfg.profile).expanduser()
        if prof.suffix in (".yaml", ".yml") and not prof.is_absolute():
            cfg.profile = str((base / prof).resolve())
        try:
            load_profile(cfg.profile)
        except ConfigError as exc:
            raise ConfigError(f"profile: {exc.message}") from None
    for i, mic in enumerate(cfg.audio):
        if mic.file is None:
            continue
        path = mic.file.expanduser()
        path = path if path.is_absolute() else (base / path).resolve()
        if not path.is_file():
            raise ConfigError(f"audio[{i}].file: WAV file not found: {path}")
        mic.file = path
    if cfg.reload.watch_dir is not None:
        wd = cfg.reload.watch_dir.expanduser()
        cfg.reload.watch_dir = wd if wd.is_absolute() else (base / wd).resolve()
    tls = cfg.mqtt.tls
    if tls is not None:
        for key in ("ca_certs", "certfile", "keyfile"):
            value = getattr(tls, key)
            if value is None:
                continue
            value = value.expanduser()
            value = value if value.is_absolute() else (base / value).resolve()
            if not value.is_file():
                raise ConfigError(f"mqtt.tls.{key}: file not found: {value}")
            setattr(tls, key, value)
    return cfg


def load_daemon_config(path: str | Path) -> DaemonConfig:
    """Read and validate a daemon config YAML file.

    Raises:
        ConfigError: missing/unreadable file, YAML syntax error (with line and column), or a
            validation error; the one-line message starts with the key path
            (``mqtt.prot: unknown key``); ``details["file"]`` names the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}", details={"file": str(path)}) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}", details={"file": str(path)}) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"$: YAML syntax error{where}: {problem}", details={"file": str(path)}) from None
    try:
        return parse_daemon_config(data, base_dir=path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(exc.message, details={"file": str(path)}) from None
