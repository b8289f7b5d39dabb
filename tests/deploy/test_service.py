"""The daemon as a systemd service: READY/STATUS/STOPPING/WATCHDOG on a real notify socket, bounded
shutdown, Prometheus endpoint, MQTT telemetry, retained source state, tegrastats feeding the metrics
and the latency controller."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from edgevlm.config import DaemonConfig
from edgevlm.daemon.app import MAX_BUSY_TIMEOUT_S, worker_busy_timeout_s
from edgevlm.daemon.budget import BudgetController
from edgevlm.runtime.policy import Controller, PointProfile
from edgevlm.types import OperatingPoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tegrastats"


def _statuses(lines: list[str]) -> list[str]:
    return [ln.removeprefix("STATUS=") for ln in lines if ln.startswith("STATUS=")]


def test_ready_only_after_engine_and_broker(mosquitto, make_daemon, notify_socket, wait_until) -> None:
    port = mosquitto.port
    mosquitto.stop()  # the broker is down while the daemon starts
    daemon = make_daemon(notify_socket=notify_socket.path, wait=False)
    lines = notify_socket.wait_for(f"STATUS=model loaded; connecting to the broker at 127.0.0.1:{port}")
    assert "READY=1" not in lines and not daemon.ready_sent.is_set()
    assert _statuses(lines)[:2] == ["starting camera sources", f"loading model {daemon.scheduler.engine.model_dir}"]

    mosquitto.start(port=port)
    notify_socket.wait_for("READY=1")
    ready = next(d for d in notify_socket.datagrams if d.startswith("READY=1"))
    assert ready == f"READY=1\nSTATUS=serving edgevlm/dev1/request on 127.0.0.1:{port}"
    assert daemon.wait_ready(5)

    # a broker restart gives STATUS lines, never a second READY
    mosquitto.restart()
    wait_until(lambda: any("broker connection lost" in s for s in _statuses(notify_socket.lines())),
               what="a connection-lost STATUS")  # fmt: skip
    wait_until(lambda: daemon.counters.get("mqtt_connects") == 2 and daemon.bridge.wait_ready(0), what="reconnect")
    wait_until(lambda: _statuses(notify_socket.lines())[-1].startswith("serving"), what="serving again")
    assert notify_socket.lines().count("READY=1") == 1

    daemon.stop()
    assert "STOPPING=1" in notify_socket.lines() and "STATUS=shutting down" in notify_socket.lines()


def test_watchdog_pings_stop_while_the_worker_hangs(make_daemon, notify_socket, watcher, tiny_engine, gated,
                                                    image_b64, monkeypatch, wait_until) -> None:  # fmt: skip
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # 0.1 s: a ping every 50 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    engine = gated(tiny_engine)
    daemon = make_daemon({"service": {"worker_busy_timeout_s": 0.3}}, engine=engine,
                         notify_socket=notify_socket.path)  # fmt: skip
    assert daemon.heartbeat.busy_timeout_s == 0.3
    engine.armed = True
    wait_until(lambda: notify_socket.lines().count("WATCHDOG=1") >= 3, what="watchdog pings")

    w = watcher()
    w.subscribe("resp/hang")
    w.publish("edgevlm/dev1/request", json.dumps({"prompt": "what?", "image_b64": image_b64()}).encode(),
              response_topic="resp/hang")  # fmt: skip
    assert engine.entered.wait(20)
    lines = notify_socket.wait_for("STATUS=inference worker unresponsive; waiting for the watchdog restart")
    pings_when_hung = lines.count("WATCHDOG=1")
    engine.gate.set()  # the request completes: the worker is alive again
    assert json.loads(w.wait("resp/hang")[0].payload)["ok"] is True
    wait_until(lambda: notify_socket.lines().count("WATCHDOG=1") > pings_when_hung + 2, what="pings resuming")


def test_busy_timeout_is_sized_from_the_request_timeouts() -> None:
    def cfg(**kw):
        return DaemonConfig.model_validate(kw)

    assert worker_busy_timeout_s(cfg(defaults={"timeout_ms": 30000})) == 120.0
    assert worker_busy_timeout_s(cfg(defaults={"timeout_ms": 9223372036854775807})) == MAX_BUSY_TIMEOUT_S
    assert worker_busy_timeout_s(cfg(service={"worker_busy_timeout_s": 7.5})) == 7.5


def test_shutdown_answers_in_flight_and_queued_requests_within_the_bound(
    make_daemon, watcher, tiny_engine, gated, image_b64, wait_until
) -> None:
    engine = gated(tiny_engine)
    daemon = make_daemon({"service": {"shutdown_timeout_s": 0.3}}, engine=engine)
    engine.armed = True
    w = watcher()
    w.subscribe("edgevlm/dev1/status")
    for name in ("a", "b"):
        w.subscribe(f"resp/{name}")
        w.publish("edgevlm/dev1/request", json.dumps({"prompt": "q", "image_b64": image_b64()}).encode(),
                  response_topic=f"resp/{name}", correlation=name.encode())  # fmt: skip
        if name == "a":
            assert engine.entered.wait(20)  # "a" runs (and hangs), "b" waits in the queue
    wait_until(lambda: daemon.scheduler.queue_size() == 1, what="b queued")
    assert daemon.bridge.outstanding() == 2

    daemon.stop()  # returns although "a" never finishes

    a, b = (json.loads(w.wait(f"resp/{n}")[0].payload) for n in ("a", "b"))
    assert b["error"] == {"code": "BUSY", "message": "the daemon is shutting down",
                          "details": {"reason": "shutting_down"}}  # the SDK re-sends it to the next daemon
    assert a["error"] == {"code": "BUSY", "details": {"reason": "shutting_down"},
                          "message": "the daemon is shutting down; the request did not finish within 0.3 s"}
    assert [m.properties.CorrelationData for m in (w.wait("resp/a")[0], w.wait("resp/b")[0])] == [b"a", b"b"]
    status = w.wait("edgevlm/dev1/status", 2)
    assert [json.loads(m.payload)["state"] for m in status] == ["online", "offline"]
    assert json.loads(status[1].payload)["ts"] > 0  # the daemon's own offline, not the will
    engine.gate.set()  # the abandoned request finishes late: its reply is dropped, not sent twice
    wait_until(lambda: daemon.counters.get("late_replies_dropped") == 1, what="the late reply")
    assert len(w.wait("resp/a")) == 1


def test_no_new_requests_once_stopping(make_daemon, watcher, image_b64) -> None:
    daemon = make_daemon()
    w = watcher()
    assert w.ask("dev1", {"prompt": "q", "image_b64": image_b64()})["ok"] is True
    daemon.bridge.stop_accepting()
    r = w.ask("dev1", {"prompt": "q", "image_b64": image_b64()})
    assert r["error"] == {"code": "BUSY", "message": "the daemon is shutting down",
                          "details": {"reason": "shutting_down"}}


def test_metrics_endpoint_telemetry_and_source_state(make_daemon, watcher, make_video, image_b64,
                                                     wait_until) -> None:  # fmt: skip
    video = make_video(fps=10.0)
    w = watcher()
    w.subscribe("edgevlm/dev1/telemetry")
    daemon = make_daemon({
        "metrics": {"listen": "127.0.0.1:0"},
        "telemetry": {"interval_s": 0.2},
        "sources": [{"name": "cam", "uri": str(video), "fps": 50}],
    })
    wait_until(lambda: daemon.sources.get("cam").latest() is not None, what="a first frame")
    ok = w.ask("dev1", {"prompt": "what?", "source": "cam"})
    assert ok["ok"] is True and ok["frame"]["source"] == "cam"
    bad = w.ask("dev1", {"prompt": "what?", "source": "cam", "timeout_ms": -1})
    assert bad["error"]["code"] == "INVALID_REQUEST"

    host, port = daemon.metrics.address
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    assert 'edgevlm_requests_total{code="OK"} 1.0' in text
    assert 'edgevlm_requests_total{code="INVALID_REQUEST"} 1.0' in text
    assert "edgevlm_ttft_seconds_count 1.0" in text
    assert 'edgevlm_source_state{source="cam",state="streaming"} 1.0' in text

    def summary():
        msgs = w.json("edgevlm/dev1/telemetry")
        return msgs and msgs[-1]["requests_total"] == 2 and msgs[-1]

    s = wait_until(summary, what="a telemetry summary with both requests")
    assert s["device_id"] == "dev1" and s["requests"]["OK"] == 1 and s["requests"]["INVALID_REQUEST"] == 1
    assert s["sources"]["cam"]["state"] == "streaming" and s["sources"]["cam"]["fps"] > 0

    late = watcher()  # retained: a subscriber arriving later still gets the source state
    late.subscribe("edgevlm/dev1/sources/+")
    state = json.loads(late.wait("edgevlm/dev1/sources/cam")[0].payload)
    assert state["name"] == "cam" and state["state"] == "streaming" and state["capture"] == "opencv-ffmpeg"
    assert state["schema_version"] == 1 and state["kind"] == "file"


def test_broken_source_reconnects_with_backoff_and_is_counted(make_daemon, watcher, tmp_path,
                                                              wait_until) -> None:  # fmt: skip
    bogus = tmp_path / "broken.mp4"
    bogus.write_bytes(b"not a video")
    w = watcher()
    w.subscribe("edgevlm/dev1/sources/bad")
    daemon = make_daemon({
        "metrics": {"listen": "127.0.0.1:0"},
        "sources": [{"name": "bad", "uri": str(bogus), "reopen_delay_s": 0.05, "reconnect_max_delay_s": 0.2}],
    })  # fmt: skip
    src = daemon.sources.get("bad")
    wait_until(lambda: src.reconnects >= 4, what="four reconnects")
    wait_until(lambda: len(w.json("edgevlm/dev1/sources/bad")) >= 3, what="state messages")
    states = w.json("edgevlm/dev1/sources/bad")
    assert {s["state"] for s in states} == {"reconnecting"}  # current state only: never got a frame
    assert states[0]["last_error"] == f"cannot open {str(bogus)!r}" and states[0]["frames"] == 0
    assert [s["open_failures"] for s in states] == sorted(s["open_failures"] for s in states)
    text = daemon.metrics.exposition().decode()
    count = next(float(ln.split()[-1]) for ln in text.splitlines()
                 if ln.startswith('edgevlm_source_reconnects_total{source="bad"}'))  # fmt: skip
    assert count >= 4
    assert 'edgevlm_source_state{source="bad",state="reconnecting"} 1.0' in text


def _hot_lines() -> tuple[str, str]:
    """A real Orin line with the GPU busy at 1300 MHz, then the same line throttled to 650 MHz."""
    line = (FIXTURES / "orin_r35.txt").read_text().splitlines()[0]
    assert "GR3D_FREQ 0%@611" in line
    return line.replace("GR3D_FREQ 0%@611", "GR3D_FREQ 99%@1300"), line.replace("GR3D_FREQ 0%@611", "GR3D_FREQ 99%@650")


def test_tegrastats_feed_metrics_and_the_controller_slowdown(make_daemon, tmp_path, wait_until) -> None:
    log = tmp_path / "tegrastats.log"
    log.write_text("")
    daemon = make_daemon({"tegrastats": {"enabled": True, "log_path": str(log), "interval_ms": 50},
                          "metrics": {"listen": "127.0.0.1:0"}})  # fmt: skip
    point = OperatingPoint(name="full")
    frontier = [PointProfile(point, accuracy=0.9, vision_ms=10, prefill_ms=10, tpot_ms=1)]
    controller = daemon.scheduler.controller = BudgetController(Controller(frontier), default_budget_ms=1000)
    before = controller.service_ms(point, 1)
    full, throttled = _hot_lines()
    with log.open("a") as f:
        f.write(full + "\n")
    wait_until(lambda: daemon.thermal is not None and daemon.thermal.gpu_freq_mhz == 1300, what="a sample")
    assert not daemon.thermal.throttled and controller.slowdown_hint == 1.0
    with log.open("a") as f:
        f.write(throttled + "\n")
    wait_until(lambda: daemon.thermal.throttled, what="throttling")
    assert daemon.thermal.slowdown_hint == 2.0 and controller.slowdown_hint == 2.0
    assert controller.service_ms(point, 1) == 2.0 * before
    text = daemon.metrics.exposition().decode()
    assert "edgevlm_jetson_throttled 1.0" in text and "edgevlm_jetson_gpu_freq_hertz 6.5e+08" in text
