"""``service.shutdown_timeout_s`` against the systemd unit's ``TimeoutStopSec=``
(edgevlm.daemon.systemd_unit): a daemon whose shutdown is longer than the unit allows is SIGKILLed
mid-drain and loses the requests in flight. ``serve --check-config`` refuses such a config, ``serve``
warns at start; the unit's value is read from the unit file (the shipped jetson/edgevlm.service, as
install.sh installs it) and its drop-ins."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from process_support import reaped, stop

from edgevlm.cli import main
from edgevlm.config import parse_daemon_config
from edgevlm.daemon.systemd_unit import find_unit, parse_timespan_s, stop_timeout_problem, timeout_stop_s

UNIT = Path(__file__).resolve().parents[2] / "jetson" / "edgevlm.service"


def test_time_spans_are_read_as_systemd_reads_them() -> None:
    spans = ["30s", "1min 30s", "1min30s", "90", "500ms", "1.5s", "2h", "1d 2h 3min 4s 5ms"]
    expected = [30.0, 90.0, 90.0, 90.0, 0.5, 1.5, 7200.0, 93784.005]
    assert [parse_timespan_s(s) for s in spans] == pytest.approx(expected)
    assert parse_timespan_s("infinity") == math.inf
    for bad in ("", "30 parsecs", "s", "-5s"):
        with pytest.raises(ValueError, match="not a systemd time span"):
            parse_timespan_s(bad)
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:  # systemd's own reading of the same spans (microseconds)
        out = subprocess.run([analyze, "timespan", *spans], capture_output=True, text=True, timeout=30).stdout
        usec = [int(ln.split(":")[1]) for ln in out.splitlines() if ln.strip().startswith("μs:")]
        assert [u / 1e6 for u in usec] == pytest.approx(expected)


def test_the_unit_value_is_the_unit_file_and_its_drop_ins(tmp_path) -> None:
    assert timeout_stop_s(UNIT) == (30.0, "TimeoutStopSec=30s")  # the shipped unit
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    (lib / "edgevlm.service.d").mkdir(parents=True)
    (etc / "edgevlm.service.d").mkdir(parents=True)
    shutil.copy(UNIT, lib / "edgevlm.service")
    (lib / "edgevlm.service.d" / "10-slow.conf").write_text("[Service]\nTimeoutStopSec=2min\n")
    (lib / "edgevlm.service.d" / "20-mine.conf").write_text("[Service]\nTimeoutStopSec=45\n")
    reset = "[Unit]\nTimeoutStopSec=1\n[Service]\nTimeoutSec=\n"  # [Unit] is not where it counts
    (etc / "edgevlm.service.d" / "20-mine.conf").write_text(reset)
    unit, dropins = find_unit({}, dirs=(str(etc), str(lib)))
    # etc's 20-mine.conf masks lib's; applied in name order; an empty assignment resets to systemd's default
    assert unit == lib / "edgevlm.service"
    assert dropins == [lib / "edgevlm.service.d" / "10-slow.conf", etc / "edgevlm.service.d" / "20-mine.conf"]
    assert timeout_stop_s(unit, dropins) == (90.0, "systemd's default DefaultTimeoutStopSec=90s")
    assert timeout_stop_s(unit, dropins[:1]) == (120.0, "TimeoutStopSec=2min")
    # under systemd ($INVOCATION_ID) the unit this process runs in (its cgroup), not edgevlm.service
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/system.slice/edgevlm-cam2.service\n")
    (etc / "edgevlm-cam2.service").write_text("[Service]\nTimeoutStopSec=12s\n")
    assert find_unit({"INVOCATION_ID": "1f2e"}, dirs=(str(etc), str(lib)), cgroup=cgroup) == (
        etc / "edgevlm-cam2.service",
        [],
    )
    assert find_unit({}, dirs=(str(tmp_path / "none"),)) is None  # not installed: nothing to check
    cfg = parse_daemon_config({"service": {"shutdown_timeout_s": 10.0}})
    assert stop_timeout_problem(cfg, {"INVOCATION_ID": "1f2e"}, dirs=(str(etc),), cgroup=cgroup) == (
        f"service.shutdown_timeout_s: 10 s for the request in flight plus up to 5 s for the MQTT goodbye is "
        f"longer than the systemd unit allows (TimeoutStopSec=12s; {etc / 'edgevlm-cam2.service'}): systemd "
        "kills the daemon (SIGKILL) mid-drain and the requests in flight are never answered; set it to at "
        "most 7 s or raise TimeoutStopSec= (sudo systemctl edit edgevlm-cam2.service)"
    )
    assert stop_timeout_problem(cfg, {}, dirs=(str(tmp_path / "none"),)) is None


def _config(tmp_path: Path, shutdown_s: float) -> Path:
    path = tmp_path / "edgevlm.yaml"
    path.write_text(yaml.safe_dump({"mqtt": {"host": "127.0.0.1", "port": 1}, "metrics": {"listen": None},
                                    "service": {"shutdown_timeout_s": shutdown_s}}))  # fmt: skip
    return path


def test_check_config_refuses_a_shutdown_longer_than_the_unit_allows(tmp_path, monkeypatch, capsys) -> None:
    """Found by a new user: ``shutdown_timeout_s: 40`` under the shipped unit (``TimeoutStopSec=30s``) passed
    --check-config, and ``systemctl stop`` during a long request SIGKILLed the daemon mid-drain."""
    monkeypatch.setenv("EDGEVLM_UNIT_FILE", str(UNIT))
    assert main(["serve", "--check-config", str(_config(tmp_path, 40.0))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "edgevlm: error: service.shutdown_timeout_s: 40 s for the request in flight plus up to 5 s for "
        f"the MQTT goodbye is longer than the systemd unit allows (TimeoutStopSec=30s; {UNIT}): systemd "
        "kills the daemon (SIGKILL) mid-drain and the requests in flight are never answered; set it to at "
        "most 25 s or raise TimeoutStopSec= (sudo systemctl edit edgevlm.service)"
    ]
    assert main(["serve", "--check-config", str(_config(tmp_path, 25.0))]) == 0  # 25 + 5 fits in 30
    capsys.readouterr()
    # a drop-in that raises the unit's limit (what systemctl edit writes) makes room for it
    unit = tmp_path / "unit" / "edgevlm.service"
    (unit.parent / "edgevlm.service.d").mkdir(parents=True)
    shutil.copy(UNIT, unit)
    (unit.parent / "edgevlm.service.d" / "override.conf").write_text("[Service]\nTimeoutStopSec=1min\n")
    monkeypatch.setenv("EDGEVLM_UNIT_FILE", str(unit))
    assert main(["serve", "--check-config", str(_config(tmp_path, 40.0))]) == 0, capsys.readouterr().err


def test_serve_under_systemd_warns_once_at_start(tmp_path, mosquitto) -> None:
    """The daemon started by systemd ($INVOCATION_ID) with the same config: one WARNING at start, then it
    serves and stops cleanly (only a stop during a long request would lose it)."""
    cfg = {
        "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "stop1"},
        "metrics": {"listen": None},
        "tegrastats": {"enabled": False},
        "service": {"shutdown_timeout_s": 40.0},
    }
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "INVOCATION_ID": "0123456789abcdef", "EDGEVLM_UNIT_FILE": str(UNIT)}
    env.pop("NOTIFY_SOCKET", None)
    proc = subprocess.Popen([sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    seen: list[str] = []
    with reaped(proc):
        for raw in proc.stdout:
            seen.append(raw.decode(errors="replace"))
            if "ready: serving" in seen[-1]:
                break
        assert seen and "ready: serving" in seen[-1], "".join(seen)
        out, _ = stop(proc)
    text = "".join(seen) + out.decode(errors="replace")
    assert proc.returncode == 0, text
    warned = [ln for ln in text.splitlines() if "service.shutdown_timeout_s:" in ln]
    assert len(warned) == 1 and " WARNING " in warned[0], text
    assert warned[0].endswith(
        "to at most 25 s or raise TimeoutStopSec= (sudo systemctl edit edgevlm.service)"
    )
