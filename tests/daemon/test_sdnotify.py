"""sd_notify against real AF_UNIX datagram sockets (filesystem and abstract namespace)."""

from __future__ import annotations

import os
import socket
import threading
import uuid

import pytest

from edgevlm.daemon.sdnotify import Heartbeat, SystemdNotifier, Watchdog, watchdog_period_s


class _Receiver:
    """A bound datagram socket playing the service manager's side."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(5.0)

    def recv(self) -> str:
        return self.sock.recv(4096).decode()

    def recv_nowait(self) -> str | None:
        self.sock.setblocking(False)
        try:
            return self.sock.recv(4096).decode()
        except BlockingIOError:
            return None
        finally:
            self.sock.settimeout(5.0)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fs_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    rx = _Receiver(path)
    yield path, rx
    rx.close()


@pytest.fixture
def abstract_socket():
    name = f"edgevlm-test-{uuid.uuid4().hex}"
    rx = _Receiver(b"\0" + name.encode())
    yield "@" + name, rx
    rx.close()


def test_filesystem_socket_receives_each_state(fs_socket):
    path, rx = fs_socket
    n = SystemdNotifier(env={"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready(status="serving 2 sources")
    assert rx.recv() == "READY=1\nSTATUS=serving 2 sources"
    assert n.status("loading engine")
    assert rx.recv() == "STATUS=loading engine"
    assert n.watchdog()
    assert rx.recv() == "WATCHDOG=1"
    assert n.stopping()
    assert rx.recv() == "STOPPING=1"
    assert n.extend_timeout(90)
    assert rx.recv() == "EXTEND_TIMEOUT_USEC=90000000"
    n.close()


def test_abstract_socket(abstract_socket):
    name, rx = abstract_socket
    n = SystemdNotifier(env={"NOTIFY_SOCKET": name})
    assert n.ready()
    assert rx.recv() == "READY=1"
    assert n.stopping("draining 1 request")
    assert rx.recv() == "STOPPING=1\nSTATUS=draining 1 request"


def test_reads_notify_socket_from_process_environment(fs_socket, monkeypatch):
    path, rx = fs_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert SystemdNotifier().status("from os.environ")
    assert rx.recv() == "STATUS=from os.environ"


def test_reloading_carries_monotonic_usec(fs_socket):
    path, rx = fs_socket
    n = SystemdNotifier(path)
    assert n.reloading("new bundle")
    lines = rx.recv().split("\n")
    assert lines[0] == "RELOADING=1"
    assert lines[1].startswith("MONOTONIC_USEC=") and int(lines[1].split("=")[1]) > 0
    assert lines[2] == "STATUS=new bundle"


def test_newlines_in_status_cannot_inject_assignments(fs_socket):
    path, rx = fs_socket
    n = SystemdNotifier(path)
    assert n.status("bad\nREADY=1")
    assert rx.recv() == "STATUS=bad READY=1"


def test_unset_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = SystemdNotifier()
    assert not n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    assert SystemdNotifier(env={"NOTIFY_SOCKET": ""}).enabled is False


def test_missing_socket_returns_false_without_raising(tmp_path, caplog):
    n = SystemdNotifier(str(tmp_path / "nobody-listens.sock"))
    assert n.enabled
    assert n.ready() is False
    assert n.ready() is False  # logged once, still no exception
    assert sum("sd_notify" in r.message for r in caplog.records) == 1


def test_socket_that_went_away_returns_false(tmp_path):
    path = str(tmp_path / "n.sock")
    rx = _Receiver(path)
    n = SystemdNotifier(path)
    assert n.status("a")
    rx.close()
    os.unlink(path)
    assert n.status("b") is False


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # inherited from a parent
        ({"WATCHDOG_USEC": "abc"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "100", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_watchdog_period(env, expected):
    assert watchdog_period_s(env) == expected


def test_watchdog_interval_is_half_the_period(fs_socket):
    path, _ = fs_socket
    wd = Watchdog(SystemdNotifier(path), lambda: True, env={"WATCHDOG_USEC": "20000000"})
    assert wd.interval_s == 10.0 and wd.enabled


def test_watchdog_disabled_without_watchdog_usec(fs_socket):
    path, _ = fs_socket
    wd = Watchdog(SystemdNotifier(path), lambda: True, env={})
    assert not wd.enabled
    assert wd.start() is False


def test_watchdog_rejects_bad_interval(fs_socket):
    with pytest.raises(ValueError, match="interval_s"):
        Watchdog(SystemdNotifier(fs_socket[0]), lambda: True, interval_s=0)


def test_tick_pings_only_while_alive(fs_socket):
    path, rx = fs_socket
    alive = {"v": True}
    wd = Watchdog(SystemdNotifier(path), lambda: alive["v"], interval_s=1.0)
    assert wd.tick() is True
    assert rx.recv() == "WATCHDOG=1"
    alive["v"] = False
    assert wd.tick() is False
    # the first failure says why on STATUS=, and no WATCHDOG=1 is sent
    assert rx.recv().startswith("STATUS=inference worker unresponsive")
    assert wd.tick() is False
    assert rx.recv_nowait() is None
    alive["v"] = True
    assert wd.tick() is True
    assert rx.recv() == "WATCHDOG=1"
    assert wd.pings == 2


def test_tick_treats_a_raising_check_as_hung(fs_socket):
    path, rx = fs_socket

    def broken() -> bool:
        raise RuntimeError("boom")

    wd = Watchdog(SystemdNotifier(path), broken, interval_s=1.0)
    assert wd.tick() is False
    assert rx.recv().startswith("STATUS=")
    assert rx.recv_nowait() is None


def test_watchdog_thread_stops_pinging_when_the_worker_hangs(abstract_socket):
    name, rx = abstract_socket
    hung = threading.Event()
    wd = Watchdog(
        SystemdNotifier(name), lambda: not hung.is_set(), env={"WATCHDOG_USEC": "100000"}
    )  # 0.1 s period -> a ping every 0.05 s
    assert wd.interval_s == pytest.approx(0.05)
    assert wd.start() is True
    try:
        assert [rx.recv() for _ in range(3)] == ["WATCHDOG=1"] * 3
        hung.set()
        # drain until the STATUS line: after it, the thread never pings again
        while not rx.recv().startswith("STATUS="):
            pass
        rx.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            rx.recv()
    finally:
        wd.stop()
    assert wd._thread is None


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_heartbeat_idle_and_busy_limits():
    clock = _Clock()
    hb = Heartbeat(idle_timeout_s=5, busy_timeout_s=60, clock=clock)
    assert hb()
    clock.t += 4.9
    assert hb()
    clock.t += 0.2  # 5.1 s since the last beat with no request running: hung
    assert not hb()
    hb.beat()
    assert hb() and hb.age_s() == 0
    with hb.busy():
        clock.t += 59  # a long inference is not a hang
        assert hb()
        clock.t += 2  # but one running past busy_timeout_s is
        assert not hb()
    assert hb()  # the request finished: beat on exit
    clock.t += 6
    assert not hb()


def test_heartbeat_rejects_bad_timeouts():
    with pytest.raises(ValueError):
        Heartbeat(idle_timeout_s=0)
    with pytest.raises(ValueError):
        Heartbeat(busy_timeout_s=-1)


def test_heartbeat_drives_watchdog(fs_socket):
    path, rx = fs_socket
    clock = _Clock()
    hb = Heartbeat(idle_timeout_s=1, busy_timeout_s=10, clock=clock)
    wd = Watchdog(SystemdNotifier(path), hb, interval_s=0.5)
    assert wd.tick() and rx.recv() == "WATCHDOG=1"
    clock.t += 2
    assert not wd.tick()
    hb.beat()
    assert wd.tick()
