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
from edgevlm.protocol import format_loc as _format_loc

SourceKind = Literal["v4l2", "gstreamer", "stream", "file"]

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
    backend: Literal["torch", "onnxruntime", "tensorrt"] = Field("torch", description="Inference backend.")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.match(r"^(cpu|cuda(:\d+)?)$", v):
            raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v


class SourceConfig(BaseModel):
    """One camera: a V4L2 index or /dev/videoN, a GStreamer pipeline (contains ' ! '), an RTSP/HTTP
    URL, or a video file (played in a loop at its native fps)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Name requests use."
    )
    uri: int | str = Field(
        description="V4L2 index, /dev/videoN, GStreamer pipeline, URL, or video file path."
    )
    fps: float | None = Field(
        None, gt=0, le=1000, description="Pace for video files (None = the file's native fps)."
    )
    reopen_delay_s: float = Field(
        2.0, gt=0, le=3600, description="Delay before reopening a camera that stopped delivering (s)."
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: int | str) -> int | str:
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

    @property
    def kind(self) -> SourceKind:
        """What the uri names: ``v4l2``, ``gstreamer``, ``stream`` (URL) or ``file``."""
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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Logging level.")

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
        return self


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    e = errors[0]
    path = _format_loc(e["loc"])
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    elif e["type"] == "missing":
        msg = "required key missing"
    else:
        msg = str(e["msg"]).removeprefix("Value error, ")
        # Model-level checks name the key themselves ("sources[1].name: ...").
        head = msg.split(": ", 1)[0]
        if ": " in msg and re.match(r"^[A-Za-z0-9_.\[\]]+$", head):
            sub, msg = msg.split(": ", 1)
            path = sub if path == "$" else f"{path}.{sub}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {msg}{more}"


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
        raise ConfigError(_first_error(exc)) from None
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
