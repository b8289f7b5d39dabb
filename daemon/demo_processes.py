"""The demo's processes: find (or install) mosquitto, run a private broker, run the daemon.

Part of :mod:`edgevlm.daemon.demo` (``make demo`` / ``edgevlm demo``): the mosquitto look-up and
apt-get install, :class:`Broker` (a private mosquitto on a free loopback port),
:func:`daemon_config` and :class:`DaemonProcess` (``edgevlm serve`` in a subprocess). The
benchmarks use :func:`start_private_broker` and :func:`find_mosquitto` too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEVICE_ID = "demo"
SOURCE = "front"
APT_PACKAGES = ("mosquitto", "mosquitto-clients")
INSTALL_COMMAND = "sudo apt-get update && sudo apt-get install -y mosquitto mosquitto-clients"
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin", "/opt/homebrew/sbin", "/usr/local/opt/mosquitto/sbin")


class DemoError(Exception):
    """A step of the demo failed; the message says which and what to do."""


# ---------------------------------------------------------------------------------- mosquitto


def find_mosquitto(
    path: str | None = None, extra_dirs: Sequence[str] = _SBIN_DIRS
) -> tuple[str | None, str | None]:
    """Paths of the ``mosquitto`` broker and ``mosquitto_rr`` (None where missing). The broker
    usually lives in /usr/sbin, which is not on a normal user's PATH, so ``extra_dirs`` are tried."""
    search = os.pathsep.join([path if path is not None else os.environ.get("PATH", ""), *extra_dirs])
    return shutil.which("mosquitto", path=search), shutil.which("mosquitto_rr", path=search)


def _privilege_prefix() -> list[str] | None:
    """``[]`` as root, ``["sudo", "-n"]`` with passwordless sudo, else None."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo"):
        ok = subprocess.run(["sudo", "-n", "true"], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        if ok.returncode == 0:
            return ["sudo", "-n"]
    return None


def ensure_mosquitto(
    *, path: str | None = None, extra_dirs: Sequence[str] = _SBIN_DIRS, may_install: bool = True
) -> tuple[str, str]:
    """Return ``(mosquitto, mosquitto_rr)`` paths, installing Debian's packages if needed and allowed.

    Raises:
        DemoError: missing and cannot be installed here; the message holds the exact command.
    """
    broker, rr = find_mosquitto(path, extra_dirs)
    if broker and rr:
        return broker, rr
    missing = [p for p, have in zip(APT_PACKAGES, (broker, rr), strict=True) if not have]
    prefix = _privilege_prefix() if may_install else None
    if prefix is None or shutil.which("apt-get") is None:
        raise DemoError(
            f"{' and '.join(missing)} not installed; install with: {INSTALL_COMMAND} "
            "(other systems: the 'mosquitto' package of your distribution, or 'brew install mosquitto')"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *missing]):
        print(f"+ {' '.join(prefix + cmd)}", flush=True)
        res = subprocess.run(prefix + cmd, stdin=subprocess.DEVNULL, env=env)
        if res.returncode != 0:
            raise DemoError(f"'{' '.join(cmd)}' failed with status {res.returncode}; run: {INSTALL_COMMAND}")
    broker, rr = find_mosquitto(path, extra_dirs)
    if not (broker and rr):
        raise DemoError(f"mosquitto still not found after apt-get install; run: {INSTALL_COMMAND}")
    return broker, rr


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _stop(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, wait, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


BROKER_TUNING = "set_tcp_nodelay true\n"
"""mosquitto.conf lines every broker the project starts or ships sets: without ``set_tcp_nodelay``
the broker's Nagle algorithm holds a small PUBLISH behind its own unacknowledged PUBACK until the
peer's delayed ACK (40 ms on Linux) fires (RFC 896; RFC 1122 section 4.2.3.2)."""


class Broker:
    """A private mosquitto on 127.0.0.1:<free port> with a temporary config (no persistence).
    ``tuned=False`` leaves out :data:`BROKER_TUNING` (mosquitto's defaults, for benchmarks)."""

    def __init__(self, mosquitto: str, workdir: Path, *, tuned: bool = True) -> None:
        self.mosquitto, self.workdir = mosquitto, workdir
        self.tuned = tuned
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "mosquitto.log"

    def start(self, timeout_s: float = 10.0) -> Broker:
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.port = free_port()
            conf = self.workdir / "mosquitto.conf"
            conf.write_text(
                f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"
                + (BROKER_TUNING if self.tuned else "")
            )
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [self.mosquitto, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _port_open(self.port):
                    return self
                time.sleep(0.05)
            _stop(self.proc, 5)
        raise DemoError(f"mosquitto did not start on 127.0.0.1: {_tail(self.log_path, 3)}")

    def stop(self) -> int:
        return _stop(self.proc, 10) if self.proc else 0


# ------------------------------------------------------------------------------------ daemon


def start_private_broker(prefix: str, *, tuned: bool = True) -> Broker | None:
    """A private mosquitto on a free loopback port in a fresh temporary folder (benchmarks), or
    None when no mosquitto binary is installed. ``tuned``: see :class:`Broker`."""
    import tempfile

    mosquitto, _ = find_mosquitto()
    if mosquitto is None:
        return None
    return Broker(mosquitto, Path(tempfile.mkdtemp(prefix=prefix)), tuned=tuned).start()


def daemon_config(port: int, video: Path, model_dir: Path | None) -> dict[str, Any]:
    """The daemon config (a :class:`edgevlm.config.DaemonConfig` mapping) the demo runs."""
    return {
        "mqtt": {"host": "127.0.0.1", "port": port, "device_id": DEVICE_ID},
        # One intra-op thread: the camera's decoder thread and the broker share the CPU with it.
        "model": {"path": str(model_dir) if model_dir else None, "device": "cpu", "cpu_threads": 1},
        "sources": [{"name": SOURCE, "uri": str(video)}],
        "defaults": {"max_new_tokens": 32, "timeout_ms": 120000},
        # The demo checks answers, not budgets: a generous default budget keeps the latency
        # controller on the most accurate operating point even on a slow, busy CPU.
        "controller": {"default_budget_ms": 120000},
        "log_level": "INFO",
    }


class DaemonProcess:
    """``python -m edgevlm.cli serve --config FILE`` in a subprocess, logging to a file."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        import yaml

        self.config_path = workdir / "daemon.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        cmd = [sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        return self

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DemoError(
                f"the daemon exited with status {self.proc.returncode}; its log ends:\n{_tail(self.log_path)}"
            )

    def stop(self) -> int:
        return _stop(self.proc, 30) if self.proc else 0
