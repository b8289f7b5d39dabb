"""``scripts/system-deps.sh``: the one list of system packages that ``make test`` and ``make demo``
install. The real script runs under bash; ``id``, ``sudo``, ``apt-get`` and ``dpkg-query`` are
replaced by small PATH shims where a test needs another user or a package missing, and the apt-get
shim records its arguments instead of installing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "system-deps.sh"
TEST_PACKAGES = [
    "mosquitto", "mosquitto-clients", "make", "python3-venv", "systemd", "shellcheck", "openssl",
    "libportaudio2", "alsa-utils", "gstreamer1.0-tools", "gstreamer1.0-plugins-base",
]  # fmt: skip
DEMO_PACKAGES = ["mosquitto", "mosquitto-clients", "make", "python3-venv"]


def _shim(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _shims(tmp_path: Path, *, uid: int, sudo_ok: bool, installed: list[str] | None) -> Path:
    """A PATH folder: ``id -u`` prints ``uid``; ``sudo -n`` works or fails; ``apt-get`` appends its
    arguments to apt.log; ``dpkg-query`` reports ``installed`` (None: use the real one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    _shim(bin_dir, "id", f'[ "$1" = -u ] && echo {uid} && exit 0\nexec /usr/bin/id "$@"\n')
    _shim(bin_dir, "apt-get", f'echo "apt-get $*" >> {log}\n')
    if sudo_ok:
        _shim(bin_dir, "sudo", f'[ "$1" = -n ] && shift\necho "sudo $*" >> {log}.sudo\nexec "$@"\n')
    else:
        _shim(bin_dir, "sudo", 'echo "sudo: a password is required" >&2\nexit 1\n')
    if installed is not None:
        lines = "".join(f"echo '{p} ii '\n" for p in installed)
        _shim(bin_dir, "dpkg-query", lines)
    return bin_dir


def _run(bin_dir: Path | None, group: str = "test") -> subprocess.CompletedProcess[str]:
    path = os.environ.get("PATH", "/usr/bin:/bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{path}" if bin_dir else path}
    env.pop("EDGEVLM_SYSTEM_DEPS", None)
    return subprocess.run(["bash", str(SCRIPT), group], env=env, capture_output=True, text=True, timeout=60)


def _apt_log(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system")
def test_on_a_machine_set_up_by_make_test_the_check_runs_no_apt(tmp_path) -> None:
    # The real dpkg-query: everything is installed here, so apt-get and sudo are never called.
    bin_dir = _shims(tmp_path, uid=0, sudo_ok=True, installed=None)
    for group in ("test", "demo"):
        out = _run(bin_dir, group)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "" and out.stderr == ""
    assert _apt_log(tmp_path) == [] and not (tmp_path / "apt.log.sudo").exists()


def test_not_root_and_no_sudo_prints_the_exact_command_and_stops(tmp_path) -> None:
    have = [p for p in TEST_PACKAGES if p not in ("shellcheck", "libportaudio2")]
    out = _run(_shims(tmp_path, uid=1000, sudo_ok=False, installed=have))
    assert out.returncode == 1
    assert "missing system packages: shellcheck libportaudio2" in out.stderr
    assert "sudo apt-get update && sudo apt-get install -y shellcheck libportaudio2" in out.stderr
    assert _apt_log(tmp_path) == []


def test_as_root_installs_only_what_is_missing(tmp_path) -> None:
    have = [p for p in TEST_PACKAGES if p != "gstreamer1.0-tools"]
    out = _run(_shims(tmp_path, uid=0, sudo_ok=False, installed=have))
    assert out.returncode == 0, out.stderr
    assert _apt_log(tmp_path) == ["apt-get update", "apt-get install -y --no-install-recommends gstreamer1.0-tools"]
    assert "+ apt-get install -y --no-install-recommends gstreamer1.0-tools" in out.stdout


def test_with_passwordless_sudo_installs_through_sudo(tmp_path) -> None:
    out = _run(_shims(tmp_path, uid=1000, sudo_ok=True, installed=[]))
    assert out.returncode == 0, out.stderr
    assert _apt_log(tmp_path)[-1] == "apt-get install -y --no-install-recommends " + " ".join(TEST_PACKAGES)
    assert (tmp_path / "apt.log.sudo").read_text().splitlines()[-1].startswith("sudo apt-get install -y")
    assert "+ sudo -n apt-get update" in out.stdout


def test_the_demo_needs_only_the_broker_and_the_venv(tmp_path) -> None:
    out = _run(_shims(tmp_path, uid=1000, sudo_ok=False, installed=[]), "demo")
    assert out.returncode == 1
    assert f"sudo apt-get install -y {' '.join(DEMO_PACKAGES)}\n" in out.stderr


def test_an_unknown_group_is_a_usage_error(tmp_path) -> None:
    out = _run(None, "lint")
    assert out.returncode == 2 and "usage:" in out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_make_test_and_make_demo_check_the_packages_first() -> None:
    for target, group in (("test", "test"), ("demo", "demo")):
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ARGS")}
        out = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == f"scripts/system-deps.sh {group}", lines
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec make test" in ci and "apt-get install" not in ci and "libportaudio2" not in ci


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="not a Debian system")
def test_every_tool_the_suite_uses_comes_from_a_listed_package() -> None:
    # The files the tests execute or load, mapped to their package by dpkg itself.
    files = ["/usr/sbin/mosquitto", "/usr/bin/mosquitto_rr", "/usr/bin/mosquitto_passwd", "/usr/bin/openssl",
             "/usr/bin/systemd-analyze", "/usr/bin/shellcheck", "/usr/bin/gst-launch-1.0", "/usr/bin/aplay"]  # fmt: skip
    import ctypes.util

    portaudio = ctypes.util.find_library("portaudio")
    assert portaudio, "libportaudio2 is not installed"
    out = subprocess.run(["dpkg", "-S", *files, f"*/{portaudio}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    owners = {line.split(":")[0] for line in out.stdout.splitlines()}
    assert owners <= set(TEST_PACKAGES), owners - set(TEST_PACKAGES)
    assert {"mosquitto", "mosquitto-clients", "openssl", "systemd", "shellcheck", "gstreamer1.0-tools",
            "alsa-utils", "libportaudio2"} <= owners  # fmt: skip
    table = SCRIPT.read_text()
    assert all(f"\n{p} " in table for p in TEST_PACKAGES)
