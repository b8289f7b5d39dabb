"""A pool of daemons behind one mosquitto (MQTT v5 shared subscription), with members dying mid-load.

Three real ``edgevlm serve`` processes (the tiny checkpoint, CPU) join pool ``gpu``; three SDK clients
in pool mode (``Client(pool="gpu")``) ask 60 questions about different images, closed loop. After
the load is under way one member is killed with SIGKILL and another stopped with SIGTERM. Every
question must get exactly one answer (the SDK returns once per ``ask``), equal to ``Engine.ask`` on
the same image: 0 lost, 0 answered twice to the application. The members' retained statuses carry
the pool; the killed one's last will turns it offline.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgevlm.client import Client

pytestmark = pytest.mark.slow

PROMPT = "what is in the picture ?"


def _image(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, size=(32, 48, 3), dtype=np.uint8)


@pytest.fixture
def members(mosquitto, tiny_model_dir, tmp_path):
    from edgevlm.daemon.demo_processes import DaemonProcess

    procs = []
    for i in range(3):
        work = tmp_path / f"m{i}"
        work.mkdir()
        cfg = {
            "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": f"m{i}", "pool": "gpu",
                     "reconnect_min_delay_s": 0.2, "reconnect_max_delay_s": 1.0},
            "model": {"path": str(tiny_model_dir), "device": "cpu", "cpu_threads": 1},
            "queue_max_size": 8,
            "defaults": {"max_new_tokens": 4, "timeout_ms": 120000},
            "metrics": {"listen": None},
            "service": {"shutdown_timeout_s": 5},
            "log_level": "INFO",
        }
        procs.append(DaemonProcess(cfg, work).start())
    yield procs
    for p in procs:
        p.stop()


def _log(p) -> str:
    return Path(p.log_path).read_text(errors="replace")


def test_pool_loses_nothing_when_members_die(mosquitto, members, tiny_engine) -> None:
    with Client(mosquitto.host, mosquitto.port, pool="gpu", resend_interval_s=1.0) as watcher:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            online = {d for d, s in watcher.pool_members.items() if s.state == "online"}
            if online == {"m0", "m1", "m2"}:
                break
            for p in members:
                p.check_alive()
            time.sleep(0.2)
        assert online == {"m0", "m1", "m2"}, watcher.pool_members
        assert all(s.pool == "gpu" for s in watcher.pool_members.values())

        answers: dict[int, str] = {}
        errors: list[BaseException] = []
        clients = [Client(mosquitto.host, mosquitto.port, pool="gpu", resend_interval_s=1.0) for _ in range(3)]

        def load(c: Client, ids: range) -> None:
            for i in ids:
                try:
                    answers[i] = c.ask(PROMPT, image=_image(i), max_new_tokens=4, timeout_s=60).text
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    errors.append(exc)

        threads = [threading.Thread(target=load, args=(c, range(k * 20, k * 20 + 20))) for k, c in enumerate(clients)]
        try:
            for t in threads:
                t.start()
            while len(answers) < 10 and time.monotonic() < deadline:
                time.sleep(0.01)
            members[0].proc.send_signal(signal.SIGKILL)  # dies with requests in flight
            members[1].proc.send_signal(signal.SIGTERM)  # leaves the pool, finishes or hands back its work
            for t in threads:
                t.join(180)
        finally:
            resends = sum(c.resends for c in clients)
            busy_retries = sum(c.busy_retries for c in clients)
            for c in clients:
                c.close()
        assert not errors, errors
        assert sorted(answers) == list(range(60))  # 0 lost; ask returns once per question: 0 twice
        for i, text in answers.items():
            assert text == tiny_engine.ask(_image(i), PROMPT, max_new_tokens=4).text
        assert members[1].proc.wait(30) == 0  # the SIGTERM'd member shut down cleanly
        assert "left pool 'gpu'" in _log(members[1])
        assert "as a member of pool 'gpu', $share/gpu/edgevlm/pools/gpu/request" in _log(members[2])
        while time.monotonic() < deadline and watcher.pool_members.get("m0", None) is not None \
                and watcher.pool_members["m0"].state != "offline":
            time.sleep(0.1)
        states = {d: s.state for d, s in watcher.pool_members.items()}
        assert states == {"m0": "offline", "m1": "offline", "m2": "online"}, states
        assert resends + busy_retries >= 1  # the killed member's requests were sent again
