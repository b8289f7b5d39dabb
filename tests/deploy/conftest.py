"""Fixtures of the deployment tests: a real sd_notify datagram socket, an MQTT watcher client, a
daemon factory on the real test broker (``tests/conftest.py``'s mosquitto) and the tiny engine."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mqtt_support import RecordingClient


class NotifySocket:
    """A bound ``AF_UNIX``/``SOCK_DGRAM`` socket standing in for systemd's notify socket."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.datagrams: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                return self.datagrams
            self.datagrams.append(data.decode())

    def lines(self) -> list[str]:
        return [line for d in self.drain() for line in d.split("\n")]

    def wait_for(self, line: str, timeout_s: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while line not in self.lines():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {line!r} on the notify socket; got {self.datagrams}")
        return self.lines()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    s = NotifySocket(tmp_path / "notify.sock")
    yield s
    s.close()


class Watcher(RecordingClient):
    """A paho MQTT v5 client recording every message per topic."""

    def __init__(self, host: str, port: int, **tls: Any) -> None:
        super().__init__(host, port, client_id=f"watcher-{uuid.uuid4().hex[:8]}", **tls)

    def wait(self, topic: str, n: int = 1, timeout_s: float = 30.0) -> list[Any]:
        return self.wait_messages(topic, n, timeout_s)

    def json(self, topic: str) -> list[dict[str, Any]]:
        with self._cond:
            return [json.loads(m.payload) for m in self.messages.get(topic, [])]

    def ask(self, device: str, payload: dict[str, Any], timeout_s: float = 60.0, *, correlation: bytes = b"c",
            response_prefix: str = "test/resp", raw: bool = False) -> Any:  # fmt: skip
        """Publish a request with a fresh response topic under ``response_prefix`` and return the
        parsed response (``raw``: the paho message)."""
        topic = f"{response_prefix}/{uuid.uuid4().hex}"
        self.subscribe(topic)
        self.publish(f"edgevlm/{device}/request", json.dumps(payload).encode(), response_topic=topic,
                     correlation=correlation)  # fmt: skip
        msg = self.wait(topic, 1, timeout_s)[0]
        return msg if raw else json.loads(msg.payload)


@pytest.fixture
def watcher(mosquitto: Any) -> Iterator[Callable[..., Watcher]]:
    """``watcher(port=None, **tls_and_login)``: a :class:`Watcher` on the test broker (or ``port``)."""
    made: list[Watcher] = []

    def _make(port: int | None = None, **kw: Any) -> Watcher:
        w = Watcher(mosquitto.host, port or mosquitto.port, **kw)
        made.append(w)
        return w

    yield _make
    for w in made:
        w.close()


class GatedEngine:
    """The real tiny engine behind a gate: once :attr:`armed` (after start-up, which may profile
    the engine), ``ask`` waits until :attr:`gate` is set (a request that hangs for as long as a
    test wants). ``entered`` is set when a request reaches it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.armed = False
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.model_dir = getattr(engine, "model_dir", None)

    def __getattr__(self, name: str) -> Any:  # resolution ladder, patch size, ... of the real engine
        return getattr(self.engine, name)

    def ask(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.entered.set()
            self.gate.wait()
        return self.engine.ask(*args, **kwargs)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def make_daemon(mosquitto: Any, tiny_engine: Any) -> Iterator[Callable[..., Any]]:
    """``make_daemon(config_overrides, engine=None, notify_socket=None, start=True, wait=True)``: a
    Daemon on the test broker (device ``dev1``, metrics off unless asked), stopped at teardown."""
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon

    started: list[Any] = []

    def _make(overrides: dict[str, Any] | None = None, *, engine: Any = None, notify_socket: str | None = "",
              start: bool = True, wait: bool = True) -> Any:  # fmt: skip
        base = {
            "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1",
                     "reconnect_min_delay_s": 0.1, "reconnect_max_delay_s": 0.5},  # fmt: skip
            "defaults": {"max_new_tokens": 3, "timeout_ms": 60000},
            "metrics": {"listen": None},
            "tegrastats": {"enabled": False},
        }
        cfg = DaemonConfig.model_validate(_merge(base, overrides or {}))
        daemon = Daemon(cfg, engine=engine if engine is not None else tiny_engine, notify_socket=notify_socket)
        started.append(daemon)
        if start:
            daemon.start()
            if wait and not daemon.wait_ready(15.0):
                raise RuntimeError("daemon did not connect to the test broker")
        return daemon

    yield _make
    for d in reversed(started):
        d.stop()


@pytest.fixture
def make_video(tmp_path: Path) -> Callable[..., Path]:
    """``make_video(n_frames, fps, size, colour)``: an MPEG-4 file of solid ``colour`` (RGB) frames."""

    def _make(n_frames: int = 10, fps: float = 10.0, size: tuple[int, int] = (64, 48),
              colour: tuple[int, int, int] = (255, 0, 0), name: str = "clip.mp4") -> Path:  # fmt: skip
        import cv2

        path = tmp_path / name
        w, h = size
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
        assert writer.isOpened()
        rgb = np.zeros((h, w, 3), np.uint8)
        rgb[:, :] = colour
        for _ in range(n_frames):
            writer.write(rgb[:, :, ::-1].copy())
        writer.release()
        return path

    return _make


@pytest.fixture
def gated() -> Iterator[Callable[[Any], GatedEngine]]:
    """``gated(engine)``: wrap a real engine in a :class:`GatedEngine`; every gate is opened at
    teardown so no worker thread stays blocked."""
    made: list[GatedEngine] = []

    def _make(engine: Any) -> GatedEngine:
        g = GatedEngine(engine)
        made.append(g)
        return g

    yield _make
    for g in made:
        g.gate.set()


def png_b64(value: int = 128, size: tuple[int, int] = (32, 32)) -> str:
    import base64

    import cv2

    ok, buf = cv2.imencode(".png", np.full((size[1], size[0], 3), value, np.uint8))
    assert ok
    return base64.b64encode(buf.tobytes()).decode()


@pytest.fixture
def image_b64() -> Callable[..., str]:
    """``image_b64(value=128, size=(32, 32))``: a grey PNG, base64."""
    return png_b64



class CustomBroker:
    """mosquitto processes with test-written configurations (TLS listeners, logins, ACLs, packet
    limits) on free loopback ports; all stopped at teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Any] = []

    def start(self, lines: list[str], *, name: str = "broker", listener: bool = True) -> int:
        """Start ``mosquitto -c`` with ``lines`` after a ``listener PORT 127.0.0.1`` line (left out
        with ``listener=False``; ``{port}`` in ``lines`` is replaced by the port). Returns the port."""
        import os
        import subprocess

        exe = os.environ.get("EDGEVLM_MOSQUITTO", "/usr/sbin/mosquitto")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = self.workdir / f"{name}.log"
        conf = [*([f"listener {port} 127.0.0.1"] if listener else []), *(ln.replace("{port}", str(port)) for ln in lines),
                "persistence false", f"log_dest file {log}", "log_type all"]  # fmt: skip
        if os.geteuid() == 0:
            conf.append("user root")
        path = self.workdir / f"{name}.conf"
        path.write_text("\n".join(conf) + "\n")
        proc = subprocess.Popen([exe, "-c", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"mosquitto failed: {proc.stderr.read().decode()[-800:]} {log.read_text()[-800:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return port
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("mosquitto did not start")

    def log(self, name: str = "broker") -> str:
        p = self.workdir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(10)
            if proc.stderr is not None:
                proc.stderr.close()


@pytest.fixture
def custom_broker(tmp_path: Path) -> Iterator[CustomBroker]:
    b = CustomBroker(tmp_path)
    yield b
    b.stop()
