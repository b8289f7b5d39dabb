"""Device profiles: what a bundle is built for and how the runtime runs on that device.

A profile is a YAML file under ``profiles/`` (``profiles/<name>.yaml``), validated by
:class:`Profile` (unknown keys are rejected, the error names the key path). The quantizer records
the target profile in a bundle's manifest; the daemon reads the default budget and the ladder.

Numbers in the shipped profiles come from vendor datasheets (memory bandwidth, memory size) and
from measurements stated in the closing notes of the issues that introduced them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from edgevlm.errors import ConfigError
from edgevlm.types import OperatingPoint
from edgevlm.validation import (
    DuplicateKeyError,
    StrictModel,
    first_error_message,
    load_yaml,
    read_json_model,
    yaml_error_message,
)

PROFILES_DIR_ENV = "EDGEVLM_PROFILES_DIR"


class WeightsConfig(StrictModel):

    scheme: Literal["W4A16", "bf16", "fp16", "fp32"] = Field(
        "W4A16", description="Decoder weight format: W4A16 (INT4 weights, 16-bit activations) or a float format."
    )
    group_size: Literal[32, 64, 128] = Field(128, description="INT4 group size along in_features.")
    method: Literal["awq", "rtn"] = Field("awq", description="INT4 quantization method.")
    vision: Literal["int4", "fp16", "bf16", "fp32"] = Field(
        "fp16", description="Vision encoder precision (int4 quantizes its linear layers too)."
    )


class FrontierPoint(StrictModel):
    """One measured operating point: its knobs, its accuracy on the demo evaluation set and its
    per-stage latency on the device that measured it (``edgevlm calibrate`` /
    :mod:`edgevlm.quantize.frontier`). The latency controller (``edgevlm.runtime.policy``) starts
    from these figures and then learns the live ones."""

    name: str = Field(min_length=1, max_length=64, description="Unique name, e.g. 'r256-x0.8-k0.5'.")
    resolution_px: int | None = Field(None, gt=0, description="Resolution-ladder rung (longer side, px).")
    exit_layer: int | None = Field(None, ge=1, description="Deepest vision block an exit may happen after.")
    exit_threshold: float | None = Field(None, ge=0.0, le=1.0, description="Exit-head confidence threshold.")
    keep_ratio: float | None = Field(None, gt=0.0, le=1.0, description="Fraction of vision tokens kept.")
    max_new_tokens: int | None = Field(None, gt=0, description="Cap on generated tokens at this point.")
    accuracy: float = Field(ge=0.0, le=1.0, description="Exact-match accuracy on the evaluation set (0..1).")
    vision_ms: float = Field(ge=0.0, description="Median vision encoder + projector time (ms).")
    prefill_ms: float = Field(ge=0.0, description="Median decoder prefill time (ms).")
    tpot_ms: float = Field(ge=0.0, description="Median time per output token after the first (ms).")
    e2e_ms: float | None = Field(None, ge=0.0, description="Mean end-to-end time over the evaluation set (ms).")
    worst_case_ms: float | None = Field(
        None, ge=0.0, description="vision + prefill + (min(24, max_new_tokens) - 1) x tpot: the controller's "
        "prediction for a request allowing 24 tokens (ms); the frontier's latency axis.",
    )
    exit_rate: float | None = Field(None, ge=0.0, le=1.0, description="Fraction of inputs that exited early.")

    def operating_point(self) -> OperatingPoint:
        """The knobs as an :class:`~edgevlm.types.OperatingPoint`."""
        return OperatingPoint(
            name=self.name, resolution_px=self.resolution_px, exit_layer=self.exit_layer,
            exit_threshold=self.exit_threshold, keep_ratio=self.keep_ratio, max_new_tokens=self.max_new_tokens,
        )


def _check_frontier(points: list[FrontierPoint], where: str) -> None:
    names = [p.name for p in points]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}: duplicate operating point names {dup}")
    for i, p in enumerate(points):
        if p.vision_ms + p.prefill_ms <= 0:
            # every point encodes an image and runs a prefill: all-zero figures are a hand edit, and the
            # controller would predict 0 ms and admit any budget, answering late until it learned better
            raise ValueError(f"{where}[{i}] ({p.name!r}): vision_ms + prefill_ms is 0: a measured point takes time")


class OperatingPointsConfig(StrictModel):
    """The latency/accuracy knobs measured for this device and the frontier the controller uses."""

    exit_blocks: list[int] = Field(
        default_factory=list,
        description="Vision blocks that get exit heads (`edgevlm calibrate --exit-blocks`); empty = "
        "calibrate's default (about 1/3 and 1/2 of the encoder depth).",
    )
    exit_thresholds: list[float] = Field(
        default_factory=lambda: [0.9, 0.75, 0.5],
        description="Exit-head confidence thresholds measured in the operating-point grid.",
    )
    keep_ratios: list[float] = Field(
        default_factory=lambda: [1.0, 0.5, 0.25],
        description="Vision-token keep ratios measured in the grid (1.0 = no pruning).",
    )
    max_new_tokens_caps: list[int] = Field(
        default_factory=lambda: [16],
        description="Token caps measured in the grid, besides no cap.",
    )
    frontier: list[FrontierPoint] = Field(
        default_factory=list,
        description="Pareto frontier measured on this device; empty = the model's or bundle's frontier.json.",
    )
    frontier_source: str = Field("", description="How and on what the frontier was measured.")

    @model_validator(mode="after")
    def _check(self) -> OperatingPointsConfig:
        if self.exit_blocks != sorted(set(self.exit_blocks)) or any(b < 1 for b in self.exit_blocks):
            raise ValueError("exit_blocks: must be ascending, distinct and >= 1")
        if any(not 0.0 <= t <= 1.0 for t in self.exit_thresholds):
            raise ValueError("exit_thresholds: must be in [0, 1]")
        if any(not 0.0 < r <= 1.0 for r in self.keep_ratios):
            raise ValueError("keep_ratios: must be in (0, 1]")
        if any(c <= 0 for c in self.max_new_tokens_caps):
            raise ValueError("max_new_tokens_caps: must be positive")
        _check_frontier(self.frontier, "frontier")
        return self


class FrontierFile(StrictModel):
    """``frontier.json`` beside a model or in a bundle, written by :mod:`edgevlm.quantize.frontier`."""

    format: Literal["edgevlm-frontier"] = Field("edgevlm-frontier", description="Magic string.")
    format_version: Literal[1] = Field(1, description="Format version.")
    created_utc: str = Field(description="ISO 8601 time of the measurement (UTC).")
    model: str = Field(description="Model folder measured.")
    device: str = Field(description="torch device, dtype and backend, e.g. 'cpu float32 torch'.")
    host: str = Field("", description="Machine description (platform, CPU threads, GPU name).")
    weights_fingerprint: str = Field(
        "", description="Fingerprint of the weights measured (edgevlm.runtime.exits.weights_fingerprint)."
    )
    eval_items: int = Field(gt=0, description="Evaluation items per grid point.")
    eval_seed: int = Field(description="Seed of the demo evaluation set.")
    grid: dict[str, list] = Field(default_factory=dict, description="The knob values measured.")
    points: list[FrontierPoint] = Field(description="Every measured grid point.")
    frontier: list[FrontierPoint] = Field(
        description="The Pareto frontier (accuracy vs latency) of all points, plus that of the full-depth points "
                    "(for models or backends without early exit).")

    @model_validator(mode="after")
    def _check(self) -> FrontierFile:
        if not self.frontier:
            raise ValueError("frontier: needs at least one point")
        _check_frontier(self.frontier, "frontier")
        return self


def latency_ms(p: FrontierPoint) -> float:
    """The frontier's latency of a point: ``worst_case_ms``, else ``e2e_ms``, else vision + prefill."""
    if p.worst_case_ms is not None:
        return p.worst_case_ms
    return p.e2e_ms if p.e2e_ms is not None else p.vision_ms + p.prefill_ms


def pareto(points: list[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other point dominates (accuracy >= and latency <=, one of them strictly),
    sorted by latency (:func:`latency_ms`). Ties on both keep the first."""
    lat = latency_ms

    ordered = sorted(points, key=lambda p: (lat(p), -p.accuracy))
    out: list[FrontierPoint] = []
    best = -1.0
    for p in ordered:
        if p.accuracy > best:
            out.append(p)
            best = p.accuracy
    return out


def load_frontier(path: str | Path) -> FrontierFile:
    """Read and validate a ``frontier.json``.

    Raises:
        ConfigError: missing file, not JSON, or invalid (the message names the key).
    """
    return read_json_model(path, FrontierFile, error=ConfigError, not_found=f"frontier file not found: {path}")


class RuntimeConfig(StrictModel):
    """How the torch backend runs on the profile's device (GPU knobs; ignored on CPU).

    Measured on an H200 (``bench/gpu_suite.py``, ``bench/results/``): CUDA graphs make a decode
    step 5x faster than eager launches; the fused decode kernels cut a 7B INT4 step from 3.6 to
    2.9 ms; the fused stem halves the vision stem's time at batch 32."""

    cuda_graphs: bool = Field(True, description="Capture the decode step in CUDA graphs (per batch size and KV bucket).")
    fused_decode: bool = Field(
        True, description="Fused Triton decode-step kernels (add+RMSNorm, RoPE+KV write, SiLU*up); needs triton."
    )
    fused_vision_stem: bool = Field(
        False, description="Triton patch-embedding + first LayerNorm kernel in the vision encoder; needs triton."
    )
    int4_kernel: Literal["auto", "tinygemm", "triton", "dequant"] = Field(
        "auto", description="INT4 matmul kernels (edgevlm.runtime.int4.set_int4_kernel): auto = fastest measured."
    )
    max_batch_size: int = Field(1, ge=1, le=256, description="KV-cache rows: requests decoded together.")
    min_kv_bucket: int = Field(256, ge=16, description="Smallest attended KV length of a decode graph (positions).")
    continuous_batching: bool = Field(
        False,
        description="The daemon decodes concurrent requests together: waiting requests join the running decode "
        "batch between steps (edgevlm.daemon.batching); needs max_batch_size >= 2.",
    )
    prefill_token_budget: int = Field(
        1024, ge=1, le=1048576,
        description="Padded tokens (rows x longest prompt, vision tokens included) per batched prefill group; a "
        "longer prompt is prefilled alone.",
    )

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        if self.continuous_batching and self.max_batch_size < 2:
            raise ValueError("continuous_batching: needs max_batch_size >= 2")
        return self


class Profile(StrictModel):
    """One device profile (``profiles/<name>.yaml``)."""

    name: str = Field(description="Profile name; equals the file's stem.")
    description: str = Field("", description="Human-readable description of the target device.")
    device_class: Literal["jetson", "cloud", "cpu"] = Field(description="Kind of machine.")
    device: Literal["cpu", "cuda"] = Field(description="torch device the runtime uses.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Activation dtype.")
    backends: list[Literal["torch", "onnx", "tensorrt"]] = Field(
        description="Backends suited to this device, best first (torch, onnx = ONNX Runtime, tensorrt); the daemon runs the one its model.backend names."
    )
    memory_mb: int = Field(gt=0, description="Device memory available to the model (MB).")
    memory_bandwidth_gbps: float = Field(gt=0, description="Peak memory bandwidth (GB/s), datasheet.")
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="Weight quantization.")
    kv_cache_dtype: Literal["bf16", "fp16", "fp32", "int4", "fp8_e4m3"] = Field(
        "fp16", description="KV cache precision."
    )
    resolution_ladder_px: list[int] = Field(
        description="Resolution ladder (longer image side, px), largest first. Empty = the model's own."
    )
    default_budget_ms: int = Field(gt=0, description="Latency budget of a request that names none (ms).")
    max_new_tokens: int = Field(32, gt=0, description="Default cap on generated tokens.")
    operating_points: OperatingPointsConfig = Field(
        default_factory=OperatingPointsConfig,
        description="Early-exit / pruning / token-cap knobs to measure, and the frontier to use.",
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig, description="Torch-backend knobs on the GPU (graphs, kernels, batching)."
    )

    def backend_options(self, backend: str, device: str) -> dict:
        """Keyword arguments for ``Engine.load(..., backend_options=...)`` on ``device`` with
        ``backend``: the torch backend on CUDA gets this profile's runtime knobs and KV-cache
        precision; anything else gets ``{}`` (CPU keeps the model dtype's cache)."""
        if backend != "torch" or not device.startswith("cuda") or self.device != "cuda":
            return {}
        import importlib.util

        r = self.runtime
        # the fused stem is an explicit option of the backend (an error without triton): a profile
        # asks for it only where triton is installed; fused_decode is a no-op without triton
        stem = r.fused_vision_stem and importlib.util.find_spec("triton") is not None
        return {"cuda_graphs": r.cuda_graphs, "fused_decode": r.fused_decode,
                "fused_vision_stem": stem, "int4_kernel": r.int4_kernel,
                "max_batch_size": r.max_batch_size, "min_kv_bucket": r.min_kv_bucket,
                "kv_cache_dtype": self.kv_cache_dtype}

    @model_validator(mode="after")
    def _check(self) -> Profile:
        ladder = self.resolution_ladder_px
        if any(r <= 0 for r in ladder):
            raise ValueError("resolution_ladder_px: rungs must be positive")
        if ladder != sorted(ladder, reverse=True) or len(set(ladder)) != len(ladder):
            raise ValueError("resolution_ladder_px: rungs must be distinct and in descending order")
        if self.kv_cache_dtype == "fp8_e4m3" and self.device_class == "jetson":
            raise ValueError("kv_cache_dtype: fp8_e4m3 needs Hopper-class GPUs; Orin has no FP8")
        if not self.backends:
            raise ValueError("backends: name at least one backend")
        if ladder:
            off = [p.name for p in self.operating_points.frontier if p.resolution_px not in (None, *ladder)]
            if off:
                raise ValueError(f"operating_points.frontier: points {off} use a rung outside resolution_ladder_px")
        return self


def profiles_dir() -> Path:
    """The folder holding the profiles: ``$EDGEVLM_PROFILES_DIR`` if set, else the shipped
    ``edgevlm.profiles`` package data (the repository's ``profiles/``)."""
    import importlib.util
    import os

    env = os.environ.get(PROFILES_DIR_ENV)
    if env:
        return Path(env)
    spec = importlib.util.find_spec("edgevlm.profiles")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the shipped profiles (edgevlm.profiles) are not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load and validate a profile by name (``profiles/<name>.yaml``) or by file path.

    Raises:
        ConfigError: the file is missing, is not YAML, or does not validate (message names the key).
    """
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        if path.is_file():  # a file that is not a profile file: say so rather than "not found"
            raise ConfigError(f"profile {str(name_or_path)!r}: a profile file ends in .yaml or .yml (or give a "
                              "shipped profile's name)")
        path = profiles_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in profiles_dir().glob("*.yaml"))
        raise ConfigError(f"profile {str(name_or_path)!r} not found (known: {', '.join(known) or 'none'})")
    try:
        data = load_yaml(path.read_text())
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path}: {exc.message}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML{yaml_error_message(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {first_error_message(exc)}") from None
    if profile.name != path.stem:
        raise ConfigError(f"{path}: name: {profile.name!r} must equal the file name {path.stem!r}")
    return profile


def jetson_host(root: str | Path = "/") -> tuple[str | None, str | None]:
    """How this host shows it is a Jetson: ``(model, l4t_release)``, the device tree's model when it names a
    Jetson (``/proc/device-tree/model``: ``NVIDIA Jetson AGX Orin Developer Kit``) and the first line of
    ``/etc/nv_tegra_release`` (the Jetson Linux release: ``# R36 (release), REVISION: 4.3, ...``); each None
    where absent, both on a host that is not a Jetson. ``root``: the folder the paths are read under (``/``;
    ``edgevlm doctor --root`` and the tests give a host tree). Never raises (an unreadable file is absent)."""

    def read(rel: str) -> str | None:
        try:
            text = (Path(root) / rel).read_bytes().replace(b"\0", b"").decode(errors="replace").strip()
        except OSError:
            return None
        return text or None

    model = read("proc/device-tree/model")
    release = read("etc/nv_tegra_release")
    first = release.splitlines()[0] if release else None
    return (model if model and "jetson" in model.lower() else None), first


def profile_mismatch(profile: Profile, model_device: str, *, root: str | Path = "/") -> str | None:
    """Why ``profile`` does not fit the model's device or this host, as a one-line warning, else None. The
    one place this rule lives (the daemon config logs it when it loads: ``serve``, ``--check-config``,
    ``doctor``). A profile is rarely meant (a laptop trying a robot's config is allowed) when:

    - its ``device`` is not ``model_device``'s kind (an ``h100`` profile on a CPU model, ``cpu`` on CUDA);
    - it is a Jetson profile (``device_class: jetson``) on a CUDA model on a host that is not a Jetson, or a
      cloud profile on a Jetson (:func:`jetson_host` under ``root``): its memory size, runtime settings,
      default budget and frontier are another machine's.
    """
    device = "cuda" if model_device.startswith("cuda") else "cpu"
    if profile.device != device:
        unused = "GPU runtime settings are not used" if device == "cpu" else "runtime settings are CPU ones"
        return (
            f"profile: {profile.name!r} is a {profile.device} profile and model.device is {model_device!r}: "
            f"its {unused}, and its default budget and frontier were measured on another device"
        )
    if device != "cuda" or profile.device_class not in ("jetson", "cloud"):
        return None
    model, release = jetson_host(root)
    if profile.device_class == "jetson" and model is None and release is None:
        return (
            f"profile: {profile.name!r} is a Jetson profile and this host is not a Jetson (no "
            "/proc/device-tree/model naming one, no /etc/nv_tegra_release): its memory_mb, runtime settings, "
            "default budget and frontier were measured on a Jetson"
        )
    if profile.device_class == "cloud" and (model is not None or release is not None):
        return (
            f"profile: {profile.name!r} is a cloud GPU profile and this host is a Jetson "
            f"({model or release}): its memory_mb, runtime settings, default budget and frontier were "
            "measured on another device"
        )
    return None
