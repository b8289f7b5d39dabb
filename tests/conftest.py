"""Shared fixtures: a real mosquitto broker on a free loopback port, a tiny real engine, a daemon.

``mosquitto`` starts ``/usr/sbin/mosquitto`` with a generated config (anonymous, no persistence,
listening on 127.0.0.1 only), waits until the listener accepts TCP connections, and stops it at
teardown. :meth:`Broker.restart` stops it and starts it again on the same port (the reconnect
tests). No fake broker: MQTT tests need the mosquitto binary (``apt-get install mosquitto
mosquitto-clients``); without it they fail with that message.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

MOSQUITTO = os.environ.get("EDGEVLM_MOSQUITTO", "/usr/sbin/mosquitto")
BROKER_START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class Broker:
    """A mosquitto process on ``127.0.0.1:port`` (see the module doc)."""

    host = "127.0.0.1"

    def __init__(self, workdir: Path, *, persistence: bool = False) -> None:
        self.workdir = workdir
        self.persistence = persistence
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "mosquitto.log"
        self.starts = 0

    def start(self, port: int | None = None) -> None:
        if not (os.path.isfile(MOSQUITTO) and os.access(MOSQUITTO, os.X_OK)):
            pytest.fail(f"{MOSQUITTO} not found: apt-get install mosquitto mosquitto-clients", pytrace=False)
        fixed = port is not None
        last_error = ""
        for _ in range(5):
            use_port = port if fixed else _free_port()
            conf = self.workdir / "mosquitto.conf"
            lines = [
                f"listener {use_port} 127.0.0.1",
                "allow_anonymous true",
                *(["persistence true", f"persistence_location {workdir_db(self.workdir)}/", "autosave_interval 1"]
                  if self.persistence else ["persistence false"]),
                f"log_dest file {self.log_path}",
                "log_type error",
                "log_type warning",
                "log_type notice",
                "log_type information",
                "connection_messages true",
                "set_tcp_nodelay true",  # as every broker the project starts (daemon/demo_processes.py)
            ]
            if os.geteuid() == 0:
                lines.append("user root")  # mosquitto would otherwise drop to 'mosquitto' and lose the log file
            conf.write_text("\n".join(lines) + "\n")
            proc = subprocess.Popen(
                [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            deadline = time.monotonic() + BROKER_START_TIMEOUT_S
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if _accepts(self.host, use_port):
                    self.proc, self.port = proc, use_port
                    self.starts += 1
                    return
                time.sleep(0.02)
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate(timeout=5)
            last_error = err.decode(errors="replace").strip()[-500:]
            if not fixed:
                continue  # the port was taken in between: try another one
            if time.monotonic() < deadline:
                time.sleep(0.2)  # same port still held by the old process (TIME_WAIT): try again
        raise RuntimeError(f"mosquitto did not start: {last_error}")

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (a persistent broker saves its database), or SIGKILL with ``kill``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> None:
        """Stop the broker (SIGKILL with ``kill``), wait ``down_s``, start it again on the same port
        (clients see the connection drop; without ``persistence`` retained messages and sessions
        are gone)."""
        port = self.port
        self.stop(kill=kill)
        time.sleep(down_s)
        self.start(port=port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def workdir_db(workdir: Path) -> Path:
    path = workdir / "db"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def persistent_mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A mosquitto broker with persistence (sessions and queued messages survive a restart;
    autosaved every second)."""
    broker = Broker(tmp_path_factory.mktemp("mosquitto_persistent"), persistence=True)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A fresh mosquitto broker for one test."""
    broker = Broker(tmp_path_factory.mktemp("mosquitto"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight LLaVA checkpoint (``edgevlm.runtime.testing.write_tiny_checkpoint``)."""
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llava"), seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Any:
    """The real Engine on the tiny checkpoint (CPU, float32), loaded once per session."""
    from edgevlm.runtime import Engine

    return Engine.load(tiny_model_dir, device="cpu")


@pytest.fixture
def start_daemon(mosquitto: Broker, tiny_engine: Any) -> Iterator[Callable[..., Any]]:
    """Start an ``edgevlm.daemon.app.Daemon`` against the test broker; stopped at teardown.

    ``start_daemon(sources=[...], queue_max_size=..., engine=..., device_id=..., defaults=...,
    mqtt=dict(...), **other_sections)`` (e.g. ``http={"enabled": True, "port": 0}``) returns the started daemon, already subscribed to its request topic.
    """
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon

    started: list[Any] = []

    def _start(
        *,
        sources: list[dict[str, Any]] | None = None,
        queue_max_size: int = 4,
        engine: Any = None,
        device_id: str = "dev1",
        defaults: dict[str, Any] | None = None,
        mqtt: dict[str, Any] | None = None,
        wait: bool = True,
        **sections: Any,
    ) -> Any:
        cfg = DaemonConfig.model_validate(
            {
                "mqtt": {
                    "host": mosquitto.host,
                    "port": mosquitto.port,
                    "device_id": device_id,
                    "reconnect_min_delay_s": 0.2,
                    "reconnect_max_delay_s": 1.0,
                    **(mqtt or {}),
                },
                "sources": sources or [],
                "queue_max_size": queue_max_size,
                "defaults": defaults or {"max_new_tokens": 4, "timeout_ms": 60000},
                **sections,  # other config sections, e.g. http={...}
            }
        )
        daemon = Daemon(cfg, engine=engine if engine is not None else tiny_engine)
        daemon.start()
        started.append(daemon)
        if wait and not daemon.wait_ready(10.0):
            raise RuntimeError("daemon did not connect to the test broker within 10 s")
        return daemon

    yield _start
    for daemon in reversed(started):
        daemon.stop()


def _wait_until(condition: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    """``wait_until(condition, timeout_s=10, what="...")``: poll until ``condition()`` is truthy
    (returns its value) or fail the test with ``what`` after ``timeout_s``."""
    return _wait_until


def pytest_report_header(config: pytest.Config) -> str:
    found = shutil.which("mosquitto") or (MOSQUITTO if os.path.exists(MOSQUITTO) else None)
    return f"mosquitto: {found or 'NOT FOUND'}"
