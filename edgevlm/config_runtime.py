"""Engine and operations sections of the daemon config: ``model``, ``metrics``, ``telemetry``,
``tegrastats``, ``service``, ``reload`` and ``controller`` (see :mod:`edgevlm.config`, which
re-exports them)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from edgevlm.validation import ConfigPath, StrictModel

FLOAT32_BACKENDS: dict[str, str] = {
    "onnx": "its graphs compute in float32",
    "tensorrt": "its engines' precision is fixed when the bundle is built; float32 in and out",
}
"""Backends whose precision a ``dtype`` cannot change, with the reason (the ``--dtype`` / ``model.dtype``
error says it)."""


def backend_settings_error(backend: str, device: str, dtype: str | None) -> tuple[str, str] | None:
    """The one rule for which device and activation dtype a backend runs with, shared by ``edgevlm ask``
    (``--device`` / ``--dtype``), the daemon config (``model.device`` / ``model.dtype``) and
    ``Engine.load``: ``tensorrt`` needs a CUDA device; ``onnx`` and ``tensorrt``
    (:data:`FLOAT32_BACKENDS`) take ``dtype`` unset or ``"float32"`` only (a 16-bit dtype would be
    silently ignored).

    Args:
        backend: ``"torch"``, ``"onnx"`` or ``"tensorrt"``.
        device: torch device string (``"cpu"``, ``"cuda"``, ``"cuda:N"``).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or None (the device's default).

    Returns:
        None when the combination runs, else ``(setting, reason)``: the setting to change
        (``"device"`` or ``"dtype"``) and a one-line reason that names the value given.
    """
    if backend == "tensorrt" and not device.startswith("cuda"):
        return "device", f"backend {backend!r} needs a CUDA device, got {device!r}"
    if backend in FLOAT32_BACKENDS and dtype not in (None, "float32"):
        return "dtype", (f"backend {backend!r} runs float32 only ({FLOAT32_BACKENDS[backend]}), got {dtype!r}; "
                         "use float32 or leave it unset")
    return None


class ModelConfig(StrictModel):
    """Which model the inference worker loads (``edgevlm.runtime.Engine.load``)."""

    path: ConfigPath | None = Field(
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
        description="torch intra-op threads (process-wide); None = torch's default (one per core) on CPU, 1 for "
        "a CUDA model (its host-side tensor ops are small; edgevlm.daemon.app.CUDA_HOST_THREADS). On a "
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

    vision_cache_mb: float = Field(
        64.0,
        ge=0,
        le=1048576,
        allow_inf_nan=False,
        description="Per-frame vision cache in MiB (LRU; 0 = off): several questions about one frame run the "
        "vision encoder once per (frame, operating point). A source frame is named by its sequence number, an "
        "inline image by the hash of its file; an exit_threshold point keeps the frame's encoder walk instead "
        "(edgevlm.runtime.Engine.set_vision_cache). Not used by continuous batching (which encodes each group's "
        "images in one batch), pruned exit points or Qwen3-VL. 64 MiB holds ~13 LLaVA-1.5 frames (576 x 4096 bf16).",
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
        refused = backend_settings_error(self.backend, self.device, self.dtype)
        if refused is not None:
            raise ValueError("{}: {}".format(*refused))
        return self


def parse_listen_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:9108"``, ``"[::1]:9108"``, ``":9108"`` (all interfaces) or ``"9108"`` ->
    ``(host, port)``. Port 0 asks the kernel for a free port.

    Raises:
        ValueError: not of these forms, or the port is outside 0..65535.
    """
    text = str(address).strip()
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^:\[\]\s]*)):(\d{1,5})|(\d{1,5})", text)
    if m is None:
        raise ValueError(f"metrics listen address {address!r}: expected HOST:PORT, [IPV6]:PORT or PORT")
    host = m.group(1) or m.group(2) or "0.0.0.0"
    port = int(m.group(3) or m.group(4))
    if port > 65535:
        raise ValueError(f"metrics listen address {address!r}: port {port} is not in 0..65535")
    return host, port


class MetricsConfig(StrictModel):
    """The Prometheus endpoint (``edgevlm.daemon.metrics``)."""

    listen: str | None = Field(
        "127.0.0.1:9108",
        description="HOST:PORT, [IPV6]:PORT or PORT (all interfaces) to serve /metrics on; None = no endpoint.",
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parse_listen_address(v)
        return v


class TelemetryConfig(StrictModel):
    """The JSON summary published on ``<prefix>/<device_id>/telemetry``."""

    interval_s: float | None = Field(10.0, gt=0, le=86400, description="Publish period (s); None = off.")


class TegrastatsConfig(StrictModel):
    """Jetson telemetry from ``tegrastats`` (absent binary = off, logged once)."""

    enabled: bool = Field(True, description="Read tegrastats when it is available.")
    interval_ms: int = Field(1000, gt=0, le=60000, description="tegrastats --interval (ms).")
    binary: str = Field("tegrastats", min_length=1, description="tegrastats executable (name or path).")
    log_path: ConfigPath | None = Field(
        None, description="Tail this tegrastats --logfile instead of running the binary."
    )
    temp_limit_c: float = Field(
        95.0, gt=0, le=150, description="A sensor at/above this counts as thermal throttling (deg C)."
    )
    reference_gpu_freq_mhz: int | None = Field(
        None, gt=0, description="Full GPU clock of the power mode (MHz); None = the highest clock seen."
    )


class ServiceConfig(StrictModel):
    """systemd integration and shutdown."""

    shutdown_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="On SIGTERM, how long the request in flight may run before it is "
        "answered BUSY and the daemon exits (s). With up to 5 s for the MQTT goodbye it must fit in the systemd "
        "unit's TimeoutStopSec= (serve --check-config refuses it otherwise, serve warns)."
    )
    worker_idle_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="An idle inference worker silent for longer counts as hung (s)."
    )
    worker_busy_timeout_s: float | None = Field(
        None, gt=0, le=86400, description="A single request running longer counts as a hung worker (s): the "
        "systemd watchdog pings stop. None = 2 x defaults.timeout_ms + 60 s (at most 1 h)."
    )


class ReloadConfig(StrictModel):
    """Hot reload of the engine (SIGHUP, or a new bundle in ``watch_dir``)."""

    watch_dir: ConfigPath | None = Field(
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


class ControllerConfig(StrictModel):
    """The latency controller (``edgevlm.runtime.policy``): per request, the most accurate operating
    point predicted to finish within the request's budget."""

    enabled: bool = Field(
        True, description="Choose an operating point per request; false = every request runs the model's default."
    )
    default_budget_ms: int | None = Field(
        None, gt=0, description="Budget of a request without budget_ms (ms); None = the profile's default_budget_ms."
    )
    frontier: ConfigPath | None = Field(
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
