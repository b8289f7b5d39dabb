"""MQTT front processes (``mqtt.front_processes``): the link, and a real daemon with two fronts on a
real mosquitto answering with the demo model on the CPU as the one-process daemon does."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from edgevlm import Client
from edgevlm.config import DaemonConfig
from edgevlm.daemon.front_link import FrontLink, LinkClosed


@pytest.fixture(scope="module")
def demo_engine():
    from edgevlm.runtime import demo

    if not (demo.model_dir() / "model.safetensors").is_file():
        pytest.skip(f"the demo model is not in {demo.model_dir()}")
    from edgevlm.runtime import Engine

    return Engine.load(None, device="cpu")


def _scenes(n: int) -> list[tuple[np.ndarray, str]]:
    """``n`` (frame, question) pairs from the demo's scene video."""
    import cv2

    from edgevlm.runtime import demo

    truth = json.loads(demo.scenes_json_path().read_text())
    cap = cv2.VideoCapture(str(demo.video_path()))
    frames = []
    ok, bgr = cap.read()
    while ok:
        frames.append(bgr[:, :, ::-1].copy())
        ok, bgr = cap.read()
    cap.release()
    items = []
    for seg in truth["segments"]:
        frame = frames[(seg["start_frame"] + seg["end_frame"]) // 2]
        items += [(frame, qa["question"]) for qa in seg["questions"][:2]]
        if len(items) >= n:
            return items[:n]
    return items


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_link_carries_meta_and_pixels_and_reports_a_closed_end() -> None:
    import threading

    a, b = FrontLink.pair()
    pixels = np.random.default_rng(0).integers(0, 256, (288, 384, 3), dtype=np.uint8)
    sender = threading.Thread(target=lambda: (a.send(("job", 7, None, 1.5, 1000, "timeout_ms", pixels.shape), pixels),
                                              a.send(("ready",))))  # more than the socket buffers: a reader needed
    sender.start()
    meta, payload = b.recv()
    assert meta == ("job", 7, None, 1.5, 1000, "timeout_ms", (288, 384, 3))
    assert np.array_equal(np.asarray(payload).reshape(meta[6]), pixels)
    assert b.recv() == (("ready",), None)
    sender.join(5)
    a.close()
    with pytest.raises(LinkClosed):
        b.recv()
    with pytest.raises(LinkClosed):
        a.send(("ready",))
    b.close()


def test_front_processes_config_defaults_to_auto_and_refuses_bad_counts() -> None:
    from edgevlm.config import parse_daemon_config
    from edgevlm.errors import ConfigError

    assert DaemonConfig().mqtt.front_processes == "auto"
    assert parse_daemon_config({"mqtt": {"front_processes": 3}}).mqtt.front_processes == 3
    with pytest.raises(ConfigError, match="front_processes"):
        parse_daemon_config({"mqtt": {"front_processes": 2}, "offload": {"pool": "p"}})
    for bad in (-1, 65, "4", True, 2.0, "many"):
        with pytest.raises(ConfigError, match="front_processes"):
            parse_daemon_config({"mqtt": {"front_processes": bad}})
    # auto with offload.pool is fine (it resolves to 0)
    assert parse_daemon_config({"offload": {"pool": "p"}}).mqtt.front_processes == "auto"


def test_auto_front_processes_only_for_a_batching_cuda_model() -> None:
    from edgevlm.config import parse_daemon_config
    from edgevlm.daemon.app import front_process_count

    cloud = {"model": {"device": "cuda"}, "profile": "h100"}  # the profile batches over 32 rows on CUDA
    assert front_process_count(parse_daemon_config(cloud), host_cpus=16)[0] == 4
    assert front_process_count(parse_daemon_config(cloud), host_cpus=64)[0] == 4
    assert front_process_count(parse_daemon_config(cloud), host_cpus=8)[0] == 2
    assert front_process_count(parse_daemon_config(cloud), host_cpus=3)[0] == 0
    off = {**cloud, "model": {"device": "cuda", "continuous_batching": False}}
    assert front_process_count(parse_daemon_config(off), host_cpus=16) == (
        0, "auto: not a CUDA model with continuous batching")
    assert front_process_count(parse_daemon_config({"model": {"device": "cuda"}, "profile": "jetson-agx-orin-64gb"}),
                               host_cpus=12)[0] == 0  # no batching on the Jetson profiles
    assert front_process_count(parse_daemon_config({}), host_cpus=16)[0] == 0  # a CPU model
    assert front_process_count(parse_daemon_config({**cloud, "offload": {"pool": "p"}}), host_cpus=16) == (
        0, "auto: offload.pool is set")
    assert front_process_count(parse_daemon_config({**cloud, "mqtt": {"front_processes": 1}}), host_cpus=16) == (
        1, "mqtt.front_processes")
    assert front_process_count(parse_daemon_config({**cloud, "mqtt": {"front_processes": 0}}), host_cpus=16)[0] == 0


def test_the_default_daemon_on_the_cpu_runs_in_one_process(start_daemon, demo_engine) -> None:
    daemon = start_daemon(engine=demo_engine, device_id="nine")
    assert daemon.config.mqtt.front_processes == "auto" and daemon.front_count == 0 and daemon.fronts is None


def _ask_all(host: str, port: int, device: str, items: list[tuple[np.ndarray, str]]) -> list[str]:
    with Client(host, port, device) as client:
        answers = [client.ask(q, image=frame, timeout_s=60) for frame, q in items]
    for a in answers:
        assert a.stats is not None and a.stats.e2e_ms > 0
    return [a.text for a in answers]


def _raw(raw, topic: str, body: dict | bytes, corr: bytes) -> dict:
    reply = f"test/replies/{corr.decode()}"
    raw.subscribe(reply)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    raw.publish(topic, payload, response_topic=reply, correlation=corr)
    msg = raw.wait_messages(reply, 1, timeout_s=30)[0]
    assert msg.properties.CorrelationData == corr
    return json.loads(msg.payload)


def test_two_fronts_answer_like_one_process_and_refuse_bad_input_from_the_front(
        start_daemon, mosquitto, demo_engine, raw_client, make_video, wait_until, encode_image) -> None:
    items = _scenes(4)
    defaults = {"max_new_tokens": 8, "timeout_ms": 60000}
    one = start_daemon(engine=demo_engine, device_id="one", defaults=defaults)
    expected = _ask_all(mosquitto.host, mosquitto.port, "one", items)
    one.stop()

    video = make_video(n_frames=6, size=(64, 48))
    daemon = start_daemon(engine=demo_engine, device_id="two", defaults=defaults, mqtt={"front_processes": 2},
                          sources=[{"name": "cam", "uri": str(video)}], metrics={"listen": None})
    assert daemon.fronts is not None and len(daemon.fronts.pids()) == 2
    assert _ask_all(mosquitto.host, mosquitto.port, "two", items) == expected

    raw = raw_client()
    topic = "edgevlm/two/request"
    # a corrupt JPEG whose header is fine: the front's decoder refuses it
    good = encode_image(items[0][0], ".jpg")
    corrupt = good[:200] + bytes(len(good) - 200)
    r = _raw(raw, topic, {"schema_version": 1, "prompt": "what?", "image_b64": base64.b64encode(corrupt).decode()},
             b"c1")
    assert r["ok"] is False and r["error"]["code"] == "INVALID_IMAGE"
    r = _raw(raw, topic, {"schema_version": 1, "prompt": "what?", "source": "cam", "max_new_tokens": "8"}, b"c2")
    assert r["ok"] is False and r["error"]["code"] == "INVALID_REQUEST"
    r = _raw(raw, topic, b"{not json", b"c3")
    assert r["ok"] is False and r["error"]["code"] == "INVALID_REQUEST"
    r = _raw(raw, topic, {"schema_version": 1, "prompt": "what?", "source": "nope"}, b"c4")
    assert r["ok"] is False and r["error"]["code"] == "UNKNOWN_SOURCE"  # from the daemon's process
    # a source request goes through a front without pixels; its frame is taken in the daemon's process
    r = _raw(raw, topic, {"schema_version": 1, "prompt": "what colour is it?", "source": "cam"}, b"c5")
    assert r["ok"] is True and r["frame"]["source"] == "cam" and r["stats"]["e2e_ms"] > 0

    # the fronts' counters reach the daemon's (one system): every request received, each refusal by code
    c = daemon.counters
    wait_until(lambda: c.get("responses_sent") >= len(items) + 5, 5, "the fronts' counters")
    assert c.get("errors_INVALID_IMAGE") == 1 and c.get("errors_UNKNOWN_SOURCE") == 1
    assert c.get("errors_INVALID_REQUEST") == 2
    assert c.get("requests_received") == len(items) + 5
    # and the metrics: every answer once, by code (the fronts' refusals forwarded, the rest observed here)
    wait_until(lambda: daemon.metrics.summary()["requests_total"] == len(items) + 5, 5, "the answers' metrics")
    assert daemon.metrics.summary()["requests"] == {**daemon.metrics.summary()["requests"], "OK": len(items) + 1,
                                                     "INVALID_IMAGE": 1, "INVALID_REQUEST": 2, "UNKNOWN_SOURCE": 1}


def test_killed_front_is_restarted_reload_works_and_shutdown_leaves_no_process(
        start_daemon, mosquitto, demo_engine, wait_until) -> None:
    items = _scenes(2)
    daemon = start_daemon(engine=demo_engine, device_id="three", mqtt={"front_processes": 2},
                          defaults={"max_new_tokens": 8, "timeout_ms": 60000})
    first = daemon.fronts.pids()
    os.kill(first[0], signal.SIGKILL)
    wait_until(lambda: daemon.fronts.restarts == 1 and daemon.fronts.ready(), 30, "the front's restart")
    assert daemon.counters.get("front_restarts") == 1
    pids = daemon.fronts.pids()
    assert pids[1] == first[1] and pids[0] != first[0]
    # several requests: the broker hands them to both fronts, the new one included
    texts = _ask_all(mosquitto.host, mosquitto.port, "three", items * 2)
    assert texts[:2] == texts[2:]
    # a hot reload swaps the engine in the daemon's process; the fronts keep serving
    result = daemon.reload.reload_now(None, "test")
    assert result.ok, result
    assert _ask_all(mosquitto.host, mosquitto.port, "three", items) == texts[:2]
    t0 = time.monotonic()
    daemon.stop()
    assert time.monotonic() - t0 < 15
    assert not any(_alive(pid) for pid in pids), "a front process outlived the daemon"


def test_a_request_held_by_a_killed_front_is_answered_through_the_clients_resend(
        start_daemon, mosquitto, demo_engine, wait_until) -> None:
    import threading

    frame, question = _scenes(1)[0]
    daemon = start_daemon(engine=demo_engine, device_id="four", mqtt={"front_processes": 2},
                          defaults={"max_new_tokens": 8, "timeout_ms": 60000})
    got: list = []
    with Client(mosquitto.host, mosquitto.port, "four", resend_interval_s=0.5) as client:
        with daemon.scheduler.paused():
            asker = threading.Thread(target=lambda: got.append(client.ask(question, image=frame, timeout_s=30)))
            asker.start()
            wait_until(lambda: daemon.scheduler.queue_size() == 1, 10, "the request in the queue")
            for pid in daemon.fronts.pids():  # whichever front holds it
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: daemon.fronts.restarts == 2 and daemon.fronts.ready(), 30, "the fronts' restart")
        asker.join(30)
    assert got and got[0].text == demo_engine.ask(frame, question, max_new_tokens=8).text


def test_a_resend_reaching_another_front_is_absorbed_not_run_twice(
        start_daemon, mosquitto, demo_engine, raw_client, encode_image, wait_until) -> None:
    # the broker hands a re-send (same Correlation Data, same payload) to any front of the shared
    # subscription: the one-process rule (absorbed while it runs, answered from the cache after) holds
    frame, question = _scenes(1)[0]
    daemon = start_daemon(engine=demo_engine, device_id="five", mqtt={"front_processes": 2},
                          defaults={"max_new_tokens": 8, "timeout_ms": 60000})
    raw = raw_client()
    reply = "test/replies/dup"
    raw.subscribe(reply)
    body = json.dumps({"schema_version": 1, "prompt": question,
                       "image_b64": base64.b64encode(encode_image(frame, ".png")).decode()}).encode()
    with daemon.scheduler.paused():
        for _ in range(4):  # round-robin: both fronts get copies
            raw.publish("edgevlm/five/request", body, response_topic=reply, correlation=b"d1")
        wait_until(lambda: daemon.counters.get("duplicate_in_flight") + daemon.scheduler.queue_size() >= 4
                   or daemon.scheduler.queue_size() > 1, 10, "the copies")
        time.sleep(0.3)
        assert daemon.scheduler.queue_size() == 1, "a re-send ran twice"
    msgs = raw.wait_messages(reply, 1, timeout_s=30)
    assert json.loads(msgs[0].payload)["ok"] is True
    wait_until(lambda: daemon.scheduler.queue_size() == 0, 10, "the queue drained")
    time.sleep(0.5)
    assert daemon.counters.get("requests_received") == 1
    # a later re-send, to whichever front, is answered from the cache (nothing runs again)
    for _ in range(2):
        raw.publish("edgevlm/five/request", body, response_topic=reply, correlation=b"d1")
    wait_until(lambda: daemon.counters.get("duplicate_answered") >= 1, 10, "the cached answers")
    time.sleep(0.5)
    assert daemon.counters.get("requests_received") == 1


def test_a_job_the_daemon_cannot_submit_is_answered_internal_and_its_resend_too(start_daemon, demo_engine) -> None:
    # a job message that fails in the daemon's process (pixels that do not fill the shape) is answered
    # INTERNAL, not left unanswered with its key in flight (which would absorb every re-send)
    import threading

    from edgevlm.daemon.fronts import FrontProcesses, _Front
    from edgevlm.protocol import Request

    daemon = start_daemon(engine=demo_engine, device_id="six", defaults={"max_new_tokens": 4, "timeout_ms": 60000})
    fronts = FrontProcesses(daemon.config, 1, daemon.scheduler, daemon.counters)
    ours, theirs = FrontLink.pair()
    front = _Front(0, None, ours)
    threading.Thread(target=fronts._read, args=(front,), daemon=True).start()
    theirs.sock.settimeout(30)
    from edgevlm.daemon.front import _without_image

    png = base64.b64encode(bytes.fromhex("89504e470d0a1a0a")).decode()  # the front strips the file anyway
    request = _without_image(Request.model_validate({"schema_version": 1, "prompt": "what?", "correlation_id": "x1",
                                                     "image_b64": png}))
    dedup = (("test/replies/x", b"Dx1"), b"digest")
    pixels = np.zeros((32, 32, 3), np.uint8)
    theirs.send(("job", 1, request, time.monotonic(), 60000, "timeout_ms", (32, 32, 3), dedup), pixels[:5])
    meta, payload = theirs.recv()
    assert meta == ("reply", 1)
    r = json.loads(bytes(payload))
    assert r["ok"] is False and r["error"]["code"] == "INTERNAL" and r["correlation_id"] == "x1"
    # its re-send (another front) is answered from the recent answers, as the one-process bridge does
    theirs.send(("job", 2, request, time.monotonic(), 60000, "timeout_ms", (32, 32, 3), dedup), pixels)
    meta, again = theirs.recv()
    assert meta == ("reply", 2) and json.loads(bytes(again))["error"] == r["error"]
    # and a new request on the link runs
    fresh = (("test/replies/x", b"Dx2"), b"digest")
    theirs.send(("job", 3, request, time.monotonic(), 60000, "timeout_ms", (32, 32, 3), fresh), pixels)
    meta, payload = theirs.recv()
    assert meta == ("reply", 3) and json.loads(bytes(payload))["ok"] is True, bytes(payload)
    theirs.close()
    ours.close()


def test_a_start_that_fails_at_the_broker_connection_leaves_no_front_process(mosquitto, demo_engine, tmp_path) -> None:
    # the daemon's own connection cannot be set up (a CA file that is not there): start raises, and the
    # fronts it started are stopped with it (were: left running, their supervisor restarting them)
    from edgevlm.daemon.app import Daemon

    cfg = DaemonConfig.model_validate({"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "seven",
                                                "front_processes": 2,
                                                "tls": {"ca_certs": str(tmp_path / "missing-ca.pem")}}})
    daemon = Daemon(cfg, engine=demo_engine)
    with pytest.raises(Exception):  # noqa: B017,PT011 - paho's own error for the missing file
        daemon.start()
    pids = daemon.fronts.pids()
    time.sleep(1.0)  # the supervisor would have restarted a front by now
    try:
        assert daemon.fronts.restarts == 0 and not any(_alive(pid) for pid in pids), "front processes left running"
    finally:
        daemon.fronts.stop()


def test_a_front_that_keeps_exiting_is_restarted_after_a_growing_delay(start_daemon, demo_engine, wait_until) -> None:
    # a front that dies soon after each start (a crash at start-up) is not restarted every 0.2 s for ever
    from edgevlm.daemon.fronts import SUPERVISE_S

    daemon = start_daemon(engine=demo_engine, device_id="eight", mqtt={"front_processes": 1})
    for n in range(1, 5):
        pid = daemon.fronts.pids()[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda n=n: daemon.fronts.restarts == n, 30, f"restart {n}")
        took = time.monotonic() - t0
    # the 4th exit in a row: restarted 0.2 * 2**3 s after it was found dead
    assert took >= SUPERVISE_S * 2 ** 3, took
    wait_until(daemon.fronts.ready, 30, "the restarted front")


def test_a_front_that_loses_the_broker_is_not_ready_until_it_has_subscribed_again(
        start_daemon, mosquitto, demo_engine, wait_until) -> None:
    # READY (and fronts.ready()) follow every front's broker connection, not only its first subscription
    frame, question = _scenes(1)[0]
    lost: list[str] = []
    daemon = start_daemon(engine=demo_engine, device_id="ten", mqtt={"front_processes": 2, "reconnect_min_delay_s": 0.2,
                                                                     "reconnect_max_delay_s": 0.5},
                          defaults={"max_new_tokens": 8, "timeout_ms": 60000})
    report = daemon.fronts.on_connection  # the daemon's (systemd status): still called
    daemon.fronts.on_connection = lambda up, reason: (lost.append(reason), report(up, reason))
    assert daemon.fronts.ready()
    mosquitto.stop()
    wait_until(lambda: not daemon.fronts.ready(), 15, "the fronts to report the lost broker")
    wait_until(lambda: {r.split(":")[0] for r in lost} == {"front 0", "front 1"}, 15, "both fronts' reports")
    mosquitto.start(port=mosquitto.port)
    wait_until(daemon.fronts.ready, 30, "the fronts to subscribe again")
    with Client(mosquitto.host, mosquitto.port, "ten") as client:
        assert client.ask(question, image=frame, timeout_s=60).text == demo_engine.ask(frame, question,
                                                                                     max_new_tokens=8).text


def test_a_front_that_loses_the_broker_while_another_subscribes_again_leaves_the_fronts_not_ready() -> None:
    # front 0 subscribes again ("ready") while front 1's reader thread reports that front 1 lost the
    # broker: whatever the interleaving, fronts.ready() ends False until front 1 has subscribed again
    # (READY / the systemd status follow it). Front 1's report runs the moment front 0's handler first
    # lets go of the lock: it was lost when front 0's handler set "all ready" after the lock.
    import threading

    from edgevlm.daemon.fronts import FrontProcesses, _Front
    from edgevlm.daemon.metrics_common import EventCounters

    readies: list[bool] = []
    fronts = FrontProcesses(DaemonConfig(), 2, None, EventCounters(),  # type: ignore[arg-type]
                            on_ready=lambda: readies.append(fronts.ready()))  # fmt: skip
    zero, one = _Front(0, None, None), _Front(1, None, None)  # type: ignore[arg-type]
    fronts._fronts[:] = [zero, one]
    for front in (zero, one):
        fronts._dispatch(front, ("ready",), None)
    assert fronts.ready() and readies == [True]
    fronts._dispatch(zero, ("connection", False, "keepalive timeout"), None)
    assert not fronts.ready()

    lock = fronts._lock

    class Interleaved:
        pending = [lambda: fronts._dispatch(one, ("connection", False, "broker closed it"), None)]

        def __enter__(self) -> None:
            lock.acquire()

        def __exit__(self, *exc: object) -> None:
            lock.release()
            while self.pending:  # on its own thread, as front 1's reader runs it
                reader = threading.Thread(target=self.pending.pop())
                reader.start()
                reader.join(5)

    fronts._lock = Interleaved()  # type: ignore[assignment]
    fronts._dispatch(zero, ("ready",), None)
    assert (zero.ready, one.ready) == (True, False)
    assert not fronts.ready() and not fronts.wait_ready(0.05)
    fronts._dispatch(one, ("ready",), None)
    assert fronts.ready() and readies[-1] is True
