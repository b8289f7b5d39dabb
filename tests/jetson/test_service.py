"""jetson/edgevlm.service: `systemd-analyze verify` prints no warning at all, and the unit says what it must."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "jetson" / "edgevlm.service"
DEFAULT_EXEC = "/opt/edgevlm/venv/bin/edgevlm"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)"
)


def lint(text: str, tmp_path: Path) -> str:
    """Run `systemd-analyze verify` on a copy of the unit whose ExecStart binary exists (a stand-in
    executable in tmp_path); return everything it printed (stdout + stderr) plus a non-zero status."""
    exe = tmp_path / "venv" / "bin" / "edgevlm"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    copy = tmp_path / "edgevlm.service"
    copy.write_text(text.replace(DEFAULT_EXEC, str(exe)))
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        out += f"\n(exit status {proc.returncode})"
    return out


def directives(text: str) -> dict[str, list[str]]:
    """{'Section.Key': [values...]} (keys may repeat in systemd units)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


@needs_systemd_analyze
def test_unit_verifies_without_any_warning(tmp_path):
    assert lint(UNIT.read_text(), tmp_path) == ""


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("[Service]\n", "[Service]\nWatchDogSec=10\n"), "Unknown key"),  # a typo
        (lambda t: t.replace("Restart=on-failure", "Restart=sometimes"), "restart specifier"),
        (lambda t: t.replace(DEFAULT_EXEC, "/nonexistent/edgevlm"), "not executable"),
    ],
)
def test_lint_catches_broken_units(tmp_path, edit, expected):
    # the lint must be able to fail: systemd-analyze exits 0 on unknown keys, only its output tells
    out = lint(edit(UNIT.read_text()), tmp_path)
    assert expected in out


def test_unit_contract():
    d = directives(UNIT.read_text())
    assert d["Service.Type"] == ["notify"]
    assert d["Service.NotifyAccess"] == ["main"]
    assert d["Service.ExecStart"] == [f"{DEFAULT_EXEC} serve --config /etc/edgevlm/config.yaml"]
    assert d["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["Service.Restart"] == ["on-failure"]
    assert re.fullmatch(r"\d+s?", d["Service.WatchdogSec"][0])
    assert int(d["Unit.StartLimitBurst"][0]) >= 1 and d["Unit.StartLimitIntervalSec"]
    assert d["Service.User"] == ["edgevlm"] and d["Service.Group"] == ["edgevlm"]
    assert set(d["Service.SupplementaryGroups"][0].split()) == {"video", "render", "audio"}
    assert d["Service.ConfigurationDirectory"] == ["edgevlm"] and d["Service.StateDirectory"] == ["edgevlm"]
    # hardening that keeps the devices reachable
    assert d["Service.PrivateDevices"] == ["no"]
    for forbidden in (
        "DeviceAllow",
        "DevicePolicy",
        "ProtectClock",
        "MemoryDenyWriteExecute",
        "PrivateUsers",
    ):
        assert f"Service.{forbidden}" not in d, forbidden
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "ProtectKernelModules": "yes",
        "RestrictSUIDSGID": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert d[f"Service.{key}"] == [value], key
    assert "AF_UNIX" in d["Service.RestrictAddressFamilies"][0]  # sd_notify needs it
    assert d["Install.WantedBy"] == ["multi-user.target"]


@needs_systemd_analyze
def test_unit_exposure_score(tmp_path):
    exe = tmp_path / "edgevlm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    copy = tmp_path / "edgevlm.service"
    copy.write_text(UNIT.read_text().replace(DEFAULT_EXEC, str(exe)))
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout)
    if proc.returncode != 0 and m is None:
        pytest.skip(f"this systemd-analyze has no offline security check: {proc.stderr.strip()[:200]}")
    assert m is not None, proc.stdout[-500:]
    assert float(m.group(1)) <= 3.0  # systemd rates <= 3.9 as "OK"
