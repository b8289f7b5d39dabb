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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgevlm.errors import ConfigError

PROFILES_DIR_ENV = "EDGEVLM_PROFILES_DIR"


class WeightsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scheme: Literal["W4A16", "bf16", "fp16", "fp32"] = Field(
        "W4A16", description="Decoder weight format: W4A16 (INT4 weights, 16-bit activations) or a float format."
    )
    group_size: Literal[32, 64, 128] = Field(128, description="INT4 group size along in_features.")
    method: Literal["awq", "rtn"] = Field("awq", description="INT4 quantization method.")
    vision: Literal["int4", "fp16", "bf16", "fp32"] = Field(
        "fp16", description="Vision encoder precision (int4 quantizes its linear layers too)."
    )


class Profile(BaseModel):
    """One device profile (``profiles/<name>.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Profile name; equals the file's stem.")
    description: str = Field("", description="Human-readable description of the target device.")
    device_class: Literal["jetson", "cloud", "cpu"] = Field(description="Kind of machine.")
    device: Literal["cpu", "cuda"] = Field(description="torch device the runtime uses.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Activation dtype.")
    backends: list[Literal["torch", "onnxruntime", "tensorrt"]] = Field(
        description="Backends in order of preference; the first one available is used."
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
        return self


def _error_path(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    return f"{loc}: {msg}"


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
        path = profiles_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in profiles_dir().glob("*.yaml"))
        raise ConfigError(f"profile {str(name_or_path)!r} not found (known: {', '.join(known) or 'none'})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_error_path(exc)}") from None
    if profile.name != path.stem:
        raise ConfigError(f"{path}: name: {profile.name!r} must equal the file name {path.stem!r}")
    return profile
