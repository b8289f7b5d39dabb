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

import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from edgevlm.config_http import HttpConfig
from edgevlm.config_mqtt import DefaultsConfig, LimitsConfig, MqttConfig, TlsConfig
from edgevlm.config_ray import OffloadConfig, RayConfig
from edgevlm.config_runtime import (
    ControllerConfig,
    MetricsConfig,
    ModelConfig,
    ReloadConfig,
    ServiceConfig,
    TegrastatsConfig,
    TelemetryConfig,
)
from edgevlm.config_sources import (
    AudioSourceConfig,
    CsiConfig,
    MonitorConfig,
    SourceConfig,
    SourceKind,
    VadConfig,
    source_kind,
)
from edgevlm.errors import ConfigError
from edgevlm.validation import (
    DuplicateKeyError,
    StrictModel,
    first_error_message,
    load_yaml,
    yaml_error_message,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AudioSourceConfig",
    "ControllerConfig",
    "CsiConfig",
    "DaemonConfig",
    "DefaultsConfig",
    "HttpConfig",
    "LimitsConfig",
    "MetricsConfig",
    "ModelConfig",
    "MonitorConfig",
    "MqttConfig",
    "OffloadConfig",
    "RayConfig",
    "ReloadConfig",
    "ServiceConfig",
    "SourceConfig",
    "SourceKind",
    "TegrastatsConfig",
    "TelemetryConfig",
    "TlsConfig",
    "VadConfig",
    "load_daemon_config",
    "parse_daemon_config",
    "read_config_file",
    "source_kind",
]


class DaemonConfig(StrictModel):
    """The whole daemon configuration."""

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
    http: HttpConfig = Field(default_factory=HttpConfig, description="OpenAI-compatible HTTP API (off by default).")
    ray: RayConfig = Field(default_factory=RayConfig, description="Replicas under Ray Serve (edgevlm serve-ray only).")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Forward to a pool what the edge cannot serve.")
    _source_file: Path | None = PrivateAttr(None)

    @property
    def source_file(self) -> Path | None:
        """The config file this was read from (:func:`load_daemon_config`; a SIGHUP reload reads its
        ``model.path`` again), None for a config built in code."""
        return self._source_file

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

    @model_validator(mode="after")
    def _fronts_and_offload(self) -> DaemonConfig:
        if self.mqtt.front_processes not in (0, "auto") and self.offload.pool is not None:
            # a front hands the daemon decoded pixels, not the image file the offload forwards ('auto'
            # resolves to 0 with offload.pool: edgevlm.daemon.app.front_process_count)
            raise ValueError("mqtt.front_processes: cannot be combined with offload.pool (set one of them)")
        return self


def _check_batching_rows(cfg: DaemonConfig) -> None:
    """``model.continuous_batching: true`` needs KV-cache rows to batch over: ``model.max_batch_size``,
    else the profile's ``runtime.max_batch_size`` for a CUDA model with a profile (what
    :func:`edgevlm.daemon.app.engine_loader` loads), else 1 row, with which the worker would only log a
    warning at start and serve one request at a time.

    Raises:
        ConfigError: batching asked for explicitly over fewer than 2 rows.
    """
    m = cfg.model
    if m.continuous_batching is not True or m.max_batch_size is not None:
        return  # an explicit max_batch_size < 2 is refused by the schema
    rows, source = 1, f"without it a model on {m.device!r} gets 1 row"
    if cfg.profile is not None and m.device.startswith("cuda"):
        from edgevlm.profile import load_profile

        # the rows load_engine gives the engine: the profile's backend options (a CUDA profile's runtime)
        options = load_profile(cfg.profile).backend_options(m.backend, m.device)
        if "max_batch_size" in options:
            rows = options["max_batch_size"]
            source = f"profile {cfg.profile}'s runtime.max_batch_size is {rows}"
        else:
            source = f"profile {cfg.profile} is not a CUDA profile, so a model on {m.device!r} gets 1 row"
    if rows < 2:
        raise ConfigError(f"model.continuous_batching: needs model.max_batch_size >= 2 (the KV-cache rows it "
                          f"batches over; {source})")


def parse_daemon_config(data: Any, *, base_dir: Path | None = None, warn: bool = True) -> DaemonConfig:
    """Validate a config mapping. Relative video-file paths and model paths resolve against
    ``base_dir`` (the config file's folder; default: the working directory); a video file that
    does not exist is an error. ``warn``: log what is allowed but rarely meant (a profile made for
    another device or host); False when the file is read again (a reload), so it is said once.

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
    if cfg.model.path is not None:
        cfg.model.path = cfg.model.path.expanduser()  # ~/models/x, as every other path of the file
        if not cfg.model.path.is_absolute():
            cfg.model.path = (base / cfg.model.path).resolve()
    for i, src in enumerate(cfg.sources):
        if src.kind != "file":
            continue
        path = Path(str(src.uri)).expanduser()
        if not path.is_absolute():
            path = (base / path).resolve()
        if path.is_dir():
            raise ConfigError(f"sources[{i}].uri: {path} is a folder, not a video file")
        if path.exists() and not path.is_file():  # /dev/null, a FIFO: not 'not found'
            raise ConfigError(f"sources[{i}].uri: {path} is not a regular file, not a video file (a V4L2 camera "
                              "is /dev/videoN or its index)")
        if not path.is_file():
            raise ConfigError(f"sources[{i}].uri: video file not found: {path}")
        src.uri = str(path)
    if cfg.controller.frontier is not None:
        fr = cfg.controller.frontier.expanduser()
        cfg.controller.frontier = fr if fr.is_absolute() else (base / fr).resolve()
        if not cfg.controller.frontier.is_file():
            raise ConfigError(f"controller.frontier: file not found: {cfg.controller.frontier}")
    if cfg.profile is not None:
        from edgevlm.profile import load_profile, profile_mismatch

        prof = Path(cfg.profile).expanduser()
        if prof.suffix in (".yaml", ".yml") and not prof.is_absolute():
            cfg.profile = str((base / prof).resolve())
        try:
            profile = load_profile(cfg.profile)
        except ConfigError as exc:
            raise ConfigError(f"profile: {exc.message}") from None
        mismatch = profile_mismatch(profile, cfg.model.device)  # allowed, but rarely meant
        if mismatch is not None and warn:
            logger.warning("%s", mismatch)
    _check_batching_rows(cfg)
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


def read_config_file(path: str | Path) -> Any:
    """The parsed YAML of a daemon config file, not validated (:func:`load_daemon_config` validates it;
    ``edgevlm doctor`` reads the ``mqtt`` section of a config that does not validate).

    Raises:
        ConfigError: missing/unreadable file, YAML syntax error (with line and column) or a duplicate
            key; ``details["file"]`` names the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}", details={"file": str(path)}) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}", details={"file": str(path)}) from None
    try:
        data = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"$: {exc.message}", details={"file": str(path)}) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"$: YAML syntax error{yaml_error_message(exc)}", details={"file": str(path)}) from None
    return data


def load_daemon_config(path: str | Path, *, warn: bool = True) -> DaemonConfig:
    """Read and validate a daemon config YAML file (``warn``: see :func:`parse_daemon_config`).

    Raises:
        ConfigError: missing/unreadable file, YAML syntax error (with line and column), or a
            validation error; the one-line message starts with the key path
            (``mqtt.prot: unknown key``); ``details["file"]`` names the file.
    """
    path = Path(path)
    data = read_config_file(path)
    try:
        cfg = parse_daemon_config(data, base_dir=path.resolve().parent, warn=warn)
    except ConfigError as exc:
        raise ConfigError(exc.message, details={"file": str(path)}) from None
    cfg._source_file = path.resolve()
    return cfg
