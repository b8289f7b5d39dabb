"""``edgevlm.daemon.app.run`` as a process: clean shutdown on SIGTERM (exit 0, retained
"offline"); exit 1 when the model does not load. (The last will: test_daemon_mqtt.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from process_support import reaped, stop

from edgevlm.config import DaemonConfig, load_daemon_config
from edgevlm.daemon.app import CUDA_HOST_THREADS, EXIT_STARTUP_FAILED, host_threads, run

STATUS_TOPIC = "edgevlm/proc1/status"
RUN = "import sys; from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; " \
      "sys.exit(run(load_daemon_config(sys.argv[1])))"  # fmt: skip


def _start_process(tmp_path: Path, mosquitto, model_dir: Path) -> subprocess.Popen:
    cfg = {
        "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "proc1"},
        "model": {"path": str(model_dir)},
        "defaults": {"max_new_tokens": 2},
    }
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    load_daemon_config(path)  # the file is valid
    return subprocess.Popen([sys.executable, "-c", RUN, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _sigterm_after_line(proc: subprocess.Popen, marker, delay_s: float) -> str:
    """Read ``proc``'s stdout until a line for which ``marker(line)`` is true (asserting it came), wait
    ``delay_s``, send SIGTERM and collect the rest; the process is killed if anything fails on the way. Returns
    everything it printed."""
    seen: list[bytes] = []
    with reaped(proc):
        while True:
            line = proc.stdout.readline()
            seen.append(line)
            if not line or marker(line):
                break
        assert line and marker(line), seen
        time.sleep(delay_s)
        out, _ = stop(proc)
    return b"".join(seen).decode(errors="replace") + out.decode(errors="replace")


def _states(watcher) -> list[dict]:
    return [json.loads(m.payload) for m in watcher.messages.get(STATUS_TOPIC, [])]


def test_sigterm_shuts_down_cleanly_with_offline_status(tmp_path, mosquitto, raw_client, tiny_model_dir) -> None:
    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    proc = _start_process(tmp_path, mosquitto, tiny_model_dir)
    with reaped(proc):
        watcher.wait_messages(STATUS_TOPIC, 1, timeout_s=120)
        assert _states(watcher)[0]["state"] == "online"
        out, _ = stop(proc)
    assert proc.returncode == 0, out.decode(errors="replace")
    watcher.wait_messages(STATUS_TOPIC, 2)
    offline = _states(watcher)[1]
    assert offline["state"] == "offline" and offline["ts"] > 0  # published by the daemon, not the will
    assert b"received SIGTERM" in out


# the model load made slow (a large model on a Jetson): it says when it starts, then sleeps
RUN_SLOW_LOAD = "import sys, time; import edgevlm.daemon.app as app; real = app.load_engine; " \
    "app.load_engine = lambda c, p: (print('LOADING', flush=True), time.sleep(120), real(c, p))[2]; " \
    "from edgevlm.config import load_daemon_config; sys.exit(app.run(load_daemon_config(sys.argv[1])))"  # fmt: skip


def test_sigterm_while_the_model_loads_stops_at_once_and_announces_nothing(tmp_path, mosquitto, raw_client,
                                                                            tiny_model_dir) -> None:
    """``systemctl stop`` during a long model load: the daemon stops within seconds (exit 0), never reports
    ready (no READY=1 to systemd: STOPPING=1 instead), never publishes the retained "online"."""
    import socket

    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    sock_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_path))
    notify.settimeout(0.2)
    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "proc1"},
           "model": {"path": str(tiny_model_dir)}}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-c", RUN_SLOW_LOAD, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "NOTIFY_SOCKET": str(sock_path)})
    try:
        with reaped(proc):
            before = [proc.stdout.readline() for _ in range(1)]
            while before[-1] and before[-1].strip() != b"LOADING" and len(before) < 200:
                before.append(proc.stdout.readline())
            assert before[-1].strip() == b"LOADING", before
            sent = time.monotonic()
            out, _ = stop(proc)
            took_s = time.monotonic() - sent
    finally:
        messages = []
        while True:
            try:
                messages.append(notify.recv(4096).decode())
            except OSError:
                break
        notify.close()
    text = b"".join(before).decode(errors="replace") + out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert took_s < 15, took_s  # the load goes on for 120 s in its own thread: not waited for
    assert "received SIGTERM" in text and "stopped during start-up" in text and "ready: serving" not in text
    assert any("STOPPING=1" in m for m in messages), messages
    assert not any("READY=1" in m for m in messages), messages
    time.sleep(0.5)
    assert STATUS_TOPIC not in watcher.messages  # no retained "online" (nor "offline": it never connected)


def test_edgevlm_serve_sigterm_during_the_real_model_load_exits_0_not_sigabrt(tmp_path, mosquitto) -> None:
    """``systemctl stop`` while ``edgevlm serve`` loads the model for real: the load (torch's import, the
    weights) is native code in the inference worker, which the start-up leaves running; the process must still
    end with exit 0, not abort in the interpreter's finalization ("terminate called without an active
    exception", SIGABRT: a failed unit and a core dump)."""

    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "proc1"}}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # 0.3 s after the line: inside the load (torch's import takes about a second)
    text = _sigterm_after_line(proc, lambda line: b"loading model" in line, 0.3)
    assert proc.returncode == 0, (proc.returncode, text)
    assert "terminate called" not in text, text
    assert "stopped during start-up" in text or "stopped; counters" in text, text


def test_model_that_does_not_load_exits_1(tmp_path, caplog) -> None:
    empty = tmp_path / "no_model"
    empty.mkdir()
    # The broker is never contacted: the model loads before MQTT starts.
    cfg = DaemonConfig.model_validate({"model": {"path": str(empty)}, "mqtt": {"port": 1, "device_id": "x"}})
    with caplog.at_level("ERROR"):
        assert run(cfg) == EXIT_STARTUP_FAILED
    assert "start-up failed" in caplog.text and str(empty) in caplog.text


def test_startup_failure_can_be_raised_instead_of_logged(tmp_path, caplog) -> None:
    """``edgevlm serve`` runs with ``raise_startup_errors``: it prints the failure as its own one
    line, so the daemon must not log it too."""
    from edgevlm.errors import ModelLoadError

    empty = tmp_path / "no_model"
    empty.mkdir()
    cfg = DaemonConfig.model_validate({"model": {"path": str(empty)}, "mqtt": {"port": 1, "device_id": "x"}})
    with caplog.at_level("INFO"):
        try:
            run(cfg, raise_startup_errors=True)
        except ModelLoadError as exc:
            assert exc.message == f"model folder {empty} has no config.json"
        else:
            raise AssertionError("run() returned instead of raising")
    assert not [r for r in caplog.records if r.levelno >= 30]  # no WARNING/ERROR: the caller reports it


def test_metrics_port_in_use_is_one_warning_and_mqtt_still_serves(
    mosquitto, raw_client, tiny_engine, caplog
) -> None:
    """The Prometheus port is taken (another exporter on 9108, say): one WARNING naming the
    config key and the port; the daemon still answers requests over MQTT."""
    import base64
    import socket

    import cv2
    import numpy as np

    from edgevlm.daemon.app import Daemon

    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    cfg = DaemonConfig.model_validate({
        "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "clash"},
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "defaults": {"max_new_tokens": 2, "timeout_ms": 60000},
    })
    image = np.zeros((48, 64, 3), np.uint8)
    image[10:30, 20:40] = (200, 30, 30)
    try:
        with caplog.at_level("INFO", logger="edgevlm"):
            daemon = Daemon(cfg, engine=tiny_engine)
            daemon.start()
            try:
                assert daemon.wait_ready(10.0)
                assert daemon.metrics.address is None  # no endpoint
                raw = raw_client()
                raw.subscribe("clash/replies")
                png = cv2.imencode(".png", image[:, :, ::-1])[1].tobytes()  # OpenCV encodes BGR
                body = {"prompt": "what is it?", "image_b64": base64.b64encode(png).decode()}
                raw.publish("edgevlm/clash/request", json.dumps(body).encode(), response_topic="clash/replies",
                            correlation=b"c1")
                response = json.loads(raw.wait_messages("clash/replies", 1, timeout_s=60)[0].payload)
            finally:
                daemon.stop()
    finally:
        blocker.close()
    assert response["ok"] is True, response
    assert response["text"] == tiny_engine.ask(image, "what is it?", max_new_tokens=2).text
    # (Other parts may warn about unrelated things, e.g. the budget controller about the profile.)
    problems = [r for r in caplog.records
                if r.levelno >= 30 and r.name in ("edgevlm.daemon.app", "edgevlm.daemon.metrics")]
    assert [r.getMessage() for r in problems] == [
        f"metrics.listen: cannot listen on 127.0.0.1 port {port} (Address already in use); the Prometheus "
        "endpoint is off, MQTT is served as usual (set metrics.listen to a free port, or null)"
    ]


def test_host_threads_one_for_a_cuda_model_unless_configured() -> None:
    def cfg(**model: object) -> DaemonConfig:
        return DaemonConfig.model_validate({"model": model})

    assert host_threads(cfg()) is None  # CPU: torch's default pool
    assert host_threads(cfg(device="cuda")) == CUDA_HOST_THREADS == 1
    assert host_threads(cfg(device="cuda:1", cpu_threads=4)) == 4
    assert host_threads(cfg(cpu_threads=2)) == 2


def test_serve_names_the_monitor_not_the_model_when_a_monitor_cannot_run_on_the_loaded_model(tmp_path) -> None:
    """A check that only the loaded model can answer (its exit heads dropped at load: calibrated for other
    weights) fails the start-up naming the monitors key, one line, exit 2; it read "model: cannot load ... on
    cpu: cannot load the model: ConfigError: monitors: ..." although the model had loaded."""
    import shutil

    from edgevlm.runtime.demo import model_dir

    model = tmp_path / "model"
    shutil.copytree(model_dir(), model)
    exits = json.loads((model / "exits.json").read_text())
    exits["weights_fingerprint"] = "0" * 64  # retrained weights: the loader drops the heads, with an ERROR
    (model / "exits.json").write_text(json.dumps(exits))
    cfg = {"mqtt": {"host": "127.0.0.1", "port": 1, "device_id": "proc1"}, "metrics": {"listen": None},
           "model": {"path": str(model)},
           "sources": [{"name": "front", "uri": str(Path(model_dir()).parent / "media" / "scenes.mp4")}],
           "monitors": [{"name": "m", "source": "front", "labels": ["red"]}]}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("edgevlm: error: ")]
    assert done.returncode == 2 and errors == [
        "edgevlm: error: monitors: the model has no exit classifier (run `edgevlm calibrate` on it)"], done.stderr


# `edgevlm serve` whose hot reload is slow native work (a large model's load on a Jetson): torch, not a sleep
RUN_SLOW_RELOAD = "import sys, torch; import edgevlm.daemon.app as app; real = app.load_engine; calls = [0]\n" \
    "def slow(c, p):\n" \
    "    calls[0] += 1\n" \
    "    if calls[0] > 1:\n" \
    "        print('RELOADING', flush=True); a = torch.ones(2000, 2000)\n" \
    "        for _ in range(2000): a = (a @ a) * 1e-4\n" \
    "    return real(c, p)\n" \
    "app.load_engine = slow\n" \
    "from edgevlm.cli import main; sys.exit(main(['serve', '--config', sys.argv[1]]))\n"  # fmt: skip


def test_sigterm_during_a_slow_hot_reload_exits_0_not_sigabrt(tmp_path, mosquitto, raw_client, tiny_model_dir) -> None:
    """``systemctl stop`` while a hot reload (SIGHUP) loads the new engine: the shutdown waits 5 s for the reload
    thread and leaves it inside native code; the process must still exit 0, not abort in the interpreter's
    finalization ("terminate called without an active exception", SIGABRT)."""

    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "proc1"},
           "model": {"path": str(tiny_model_dir)}, "metrics": {"listen": None}}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-c", RUN_SLOW_RELOAD, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        watcher.wait_messages(STATUS_TOPIC, 1, timeout_s=120)
        proc.send_signal(signal.SIGHUP)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    text = _sigterm_after_line(proc, lambda line: line.strip() == b"RELOADING", 0.5)
    assert proc.returncode == 0, (proc.returncode, text[-3000:])
    assert "terminate called" not in text and "stopped; counters" in text, text[-3000:]
