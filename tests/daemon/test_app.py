"""``edgevlm.daemon.app.run`` as a process: clean shutdown on SIGTERM (exit 0, retained
"offline"); exit 1 when the model does not load. (The last will: test_daemon_mqtt.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from edgevlm.config import DaemonConfig, load_daemon_config
from edgevlm.daemon.app import EXIT_STARTUP_FAILED, run

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


def _states(watcher) -> list[dict]:
    return [json.loads(m.payload) for m in watcher.messages.get(STATUS_TOPIC, [])]


def test_sigterm_shuts_down_cleanly_with_offline_status(tmp_path, mosquitto, raw_client, tiny_model_dir) -> None:
    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    proc = _start_process(tmp_path, mosquitto, tiny_model_dir)
    try:
        watcher.wait_messages(STATUS_TOPIC, 1, timeout_s=120)
        assert _states(watcher)[0]["state"] == "online"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out.decode(errors="replace")
    watcher.wait_messages(STATUS_TOPIC, 2)
    offline = _states(watcher)[1]
    assert offline["state"] == "offline" and offline["ts"] > 0  # published by the daemon, not the will
    assert b"received SIGTERM" in out


def test_model_that_does_not_load_exits_1(tmp_path, caplog) -> None:
    empty = tmp_path / "no_model"
    empty.mkdir()
    # The broker is never contacted: the model loads before MQTT starts.
    cfg = DaemonConfig.model_validate({"model": {"path": str(empty)}, "mqtt": {"port": 1, "device_id": "x"}})
    with caplog.at_level("ERROR"):
        assert run(cfg) == EXIT_STARTUP_FAILED
    assert "start-up failed" in caplog.text and str(empty) in caplog.text
