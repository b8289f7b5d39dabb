"""``edgevlm doctor``'s building blocks: the :class:`CheckResult` row and its :class:`Verdict`, the
host view the checks read paths through (under ``root``), and the Jetson rows (``jetson``,
``power mode``, ``clocks``, ``tegrastats``). See :mod:`edgevlm.daemon.doctor`."""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any


class Verdict(str, Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class CheckResult:
    check: str
    verdict: Verdict
    detail: str

    def as_dict(self) -> dict[str, str]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d


def _ok(check: str, detail: str) -> CheckResult:
    return CheckResult(check, Verdict.OK, detail)


def _warn(check: str, detail: str) -> CheckResult:
    return CheckResult(check, Verdict.WARN, detail)


def _fail(check: str, detail: str) -> CheckResult:
    return CheckResult(check, Verdict.FAIL, detail)


@dataclass
class _Host:
    root: Path
    config: Any  # edgevlm.config.DaemonConfig | None
    jetson_model: str | None = None
    l4t: str | None = None

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def read(self, p: str) -> str | None:
        try:
            return self.path(p).read_bytes().replace(b"\0", b"").decode(errors="replace").strip()
        except OSError:
            return None

    @property
    def is_jetson(self) -> bool:
        return self.jetson_model is not None or self.l4t is not None

    @property
    def model_device(self) -> str:
        return self.config.model.device if self.config is not None else "cpu"

    @property
    def backend(self) -> str:
        return self.config.model.backend if self.config is not None else "torch"


# -- Jetson ---------------------------------------------------------------------------------------------
def _check_jetson(h: _Host) -> list[CheckResult]:
    if not h.is_jetson:
        return [_ok("jetson", "not a Jetson (Jetson checks skipped)")]
    return [_ok("jetson", f"{h.jetson_model or 'Jetson'}, {h.l4t or 'L4T release unknown'}")]


def _check_power_mode(h: _Host) -> CheckResult:
    nvpmodel = shutil.which("nvpmodel")
    if nvpmodel is None:
        if h.is_jetson:
            return _warn("power mode", "nvpmodel not found (sudo apt-get install nvidia-l4t-tools)")
        return _ok("power mode", "nvpmodel not present (not a Jetson)")
    try:
        proc = subprocess.run([nvpmodel, "-q"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _warn("power mode", f"nvpmodel -q failed: {exc}")
    m = re.search(r"NV Power Mode:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or m is None:
        return _warn(
            "power mode", f"nvpmodel -q: {(proc.stderr or proc.stdout).strip()[:200] or 'no answer'}"
        )
    rest = proc.stdout[m.end() :].split()
    mode_id = rest[0] if rest and rest[0].isdigit() else "?"
    return _ok("power mode", f"{m.group(1).strip()} (mode {mode_id})")


def _read_int(h: _Host, path: str) -> int | None:
    text = h.read(path)
    return int(text) if text and text.strip().lstrip("-").isdigit() else None


def _check_clocks(h: _Host) -> CheckResult:
    parts, warn = [], False
    for node in sorted(glob.glob(str(h.path("/sys/class/devfreq/*")))):
        name = Path(node).name
        if not re.search(r"gpu|gv11b|gp10b|ga10b|gb10b", name):
            continue
        rel = f"/sys/class/devfreq/{name}"
        cur, mx = _read_int(h, f"{rel}/cur_freq"), _read_int(h, f"{rel}/max_freq")
        gov = h.read(f"{rel}/governor") or "?"
        if cur is not None and mx:
            parts.append(f"GPU {cur // 1_000_000}/{mx // 1_000_000} MHz ({gov})")
            warn = warn or cur < 0.99 * mx
    cur, mx = (_read_int(h, f"/sys/devices/system/cpu/cpu0/cpufreq/scaling_{k}_freq") for k in ("cur", "max"))
    if cur is not None and mx:
        parts.append(f"CPU0 {cur // 1000}/{mx // 1000} MHz")
    if not parts:
        return _ok(
            "clocks", "no GPU devfreq or CPU cpufreq readings" + ("" if h.is_jetson else " (not a Jetson)")
        )
    detail = ", ".join(parts)
    if warn and h.is_jetson:
        return _warn(
            "clocks", f"{detail}: GPU not at its maximum clock; `sudo jetson_clocks` gives steadier latency"
        )
    return _ok("clocks", detail)


def _check_tegrastats(h: _Host) -> CheckResult:
    path = shutil.which("tegrastats")
    if path:
        return _ok("tegrastats", f"{path} (Jetson telemetry available)")
    if h.is_jetson:
        return _warn("tegrastats", "not found: no temperature/clock telemetry for the latency controller")
    return _ok("tegrastats", "not present (not a Jetson)")
