"""Delivery over a real mosquitto broker: persistent sessions across broker and daemon restarts,
re-sent requests answered from the recent-answers cache instead of running twice, deadlines that
fire while a request waits (``timeout_ms`` and the MQTT v5 Message Expiry Interval, a SIGSTOPped
daemon), and requests that cannot be answered (wildcard or empty Response Topic, lone surrogates).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from mqtt_support import RecordingClient

REQUEST_TOPIC = "edgevlm/dev1/request"
PROMPT = "what colour is the circle ?"


def _png_body(encode_image, value: int = 90, **extra: Any) -> dict[str, Any]:
    import base64

    import numpy as np

    img = np.full((24, 32, 3), value, np.uint8)
    img[4:12, 8:20] = (200, 30, 40)
    return {"prompt": PROMPT, "image_b64": base64.b64encode(encode_image(img)).decode(), **extra}


def _publish(client: RecordingClient, payload: bytes, *, response_topic: str | None, correlation: bytes | None,
             expiry_s: int | None = None) -> None:  # fmt: skip
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    if response_topic is not None:
        props.ResponseTopic = response_topic
    if correlation is not None:
        props.CorrelationData = correlation
    if expiry_s is not None:
        props.MessageExpiryInterval = expiry_s
    client.client.publish(REQUEST_TOPIC, payload, qos=1, properties=props).wait_for_publish(10)


def _daemon(broker: Any, engine: Any, **mqtt: Any) -> Any:
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon

    cfg = DaemonConfig.model_validate({
        "mqtt": {"host": broker.host, "port": broker.port, "device_id": "dev1", "reconnect_min_delay_s": 0.2,
                 "reconnect_max_delay_s": 1.0, **mqtt},
        "defaults": {"max_new_tokens": 4, "timeout_ms": 60000},
        "metrics": {"listen": None},
        "tegrastats": {"enabled": False},
    })  # fmt: skip
    daemon = Daemon(cfg, engine=engine)
    daemon.start()
    return daemon


# ------------------------------------------------------------------ persistent sessions


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_persistent_session_keeps_requests_published_during_a_broker_restart(
    persistent_mosquitto, tiny_engine, encode_image, kill
) -> None:
    # The daemon reconnects 3 s after the restart; the requester is back at once and publishes
    # before it. mosquitto keeps (and persists) the daemon's session only because its CONNECT had
    # Clean Start 0: with Clean Start 1 the PUBACKs say "no matching subscribers" and all are lost.
    broker = persistent_mosquitto
    daemon = _daemon(broker, tiny_engine, session_expiry_s=3600, reconnect_min_delay_s=3.0,
                     reconnect_max_delay_s=3.0)  # fmt: skip
    requester = None
    try:
        assert daemon.wait_ready(15)
        time.sleep(3.0)  # autosave_interval 1 saves about every 2 s; a SIGKILL keeps only what was saved
        broker.restart(kill=kill)
        requester = RecordingClient(broker.host, broker.port)
        reply = f"test/replies/{uuid.uuid4().hex}"
        requester.subscribe(reply)
        for i in range(3):
            _publish(requester, json.dumps(_png_body(encode_image, 60 + 40 * i)).encode(), response_topic=reply,
                     correlation=b"c%d" % i)  # fmt: skip
        assert not daemon.wait_ready(0), "the daemon reconnected before the requests were published"
        answers = requester.wait_messages(reply, 3, timeout_s=30)
        assert sorted(m.properties.CorrelationData for m in answers) == [b"c0", b"c1", b"c2"]
        assert all(json.loads(m.payload)["ok"] for m in answers)
    finally:
        if requester is not None:
            requester.close()
        daemon.stop()


def test_next_daemon_answers_what_was_published_while_none_ran(mosquitto, tiny_engine, raw_client,
                                                              encode_image) -> None:  # fmt: skip
    first = _daemon(mosquitto, tiny_engine, session_expiry_s=600)
    assert first.wait_ready(15)
    first.stop()  # the session (subscription) stays on the broker for 600 s
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    _publish(raw, json.dumps(_png_body(encode_image)).encode(), response_topic=reply, correlation=b"while-down")
    second = _daemon(mosquitto, tiny_engine, session_expiry_s=600)
    try:
        msg = raw.wait_messages(reply, 1, timeout_s=30)[0]
        assert json.loads(msg.payload)["ok"] is True and msg.properties.CorrelationData == b"while-down"
    finally:
        second.stop()


# ------------------------------------------------------------------ duplicates


def test_resent_request_is_answered_from_the_cache_not_run_twice(start_daemon, raw_client, encode_image) -> None:
    daemon = start_daemon()
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    payload = json.dumps(_png_body(encode_image)).encode()
    _publish(raw, payload, response_topic=reply, correlation=b"\x00same")
    first = raw.wait_messages(reply, 1)[0]
    _publish(raw, payload, response_topic=reply, correlation=b"\x00same")
    second = raw.wait_messages(reply, 2)[1]
    assert second.payload == first.payload  # the same response, byte for byte (same ts: not re-run)
    assert second.properties.CorrelationData == b"\x00same"
    assert daemon.counters.get("responses_ok") == 1 and daemon.counters.get("duplicate_answered") == 1
    # the same Correlation Data with another payload is another request: it runs
    _publish(raw, json.dumps(_png_body(encode_image, 200)).encode(), response_topic=reply, correlation=b"\x00same")
    third = raw.wait_messages(reply, 3)[2]
    assert json.loads(third.payload)["ok"] is True and third.payload != first.payload
    assert daemon.counters.get("responses_ok") == 2
    # another requester (Response Topic) with the same Correlation Data is not a duplicate either
    other = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(other)
    _publish(raw, payload, response_topic=other, correlation=b"\x00same")
    raw.wait_messages(other, 1)
    assert daemon.counters.get("responses_ok") == 3
    metrics = daemon.metrics.exposition().decode()
    assert 'edgevlm_duplicate_requests_total{outcome="answered"} 1.0' in metrics


def test_in_flight_duplicate_is_not_run_twice(start_daemon, raw_client, encode_image) -> None:
    daemon = start_daemon()
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    payload = json.dumps(_png_body(encode_image)).encode()
    with daemon.scheduler.paused():
        for _ in range(3):
            _publish(raw, payload, response_topic=reply, correlation=b"dup")
        deadline = time.monotonic() + 10
        while daemon.counters.get("duplicate_in_flight") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert daemon.scheduler.queue_size() == 1
    raw.wait_messages(reply, 1)
    time.sleep(0.5)
    assert raw.count(reply) == 1
    assert daemon.counters.get("responses_ok") == 1 and daemon.counters.get("duplicate_in_flight") == 2


# ------------------------------------------------------------------ deadlines


def test_queued_request_expires_while_the_worker_is_busy(start_daemon, raw_client, encode_image) -> None:
    daemon = start_daemon()
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    with daemon.scheduler.paused():  # the worker takes nothing off the queue, as if busy
        sent = time.monotonic()
        for i in range(3):
            _publish(raw, json.dumps(_png_body(encode_image, timeout_ms=400)).encode(), response_topic=reply,
                     correlation=b"q%d" % i)  # fmt: skip
        answers = raw.wait_messages(reply, 3, timeout_s=10)
        took_s = time.monotonic() - sent
    for msg in answers:
        body = json.loads(msg.payload)
        assert body["error"]["code"] == "DEADLINE_EXCEEDED", body
        assert body["error"]["details"]["timeout_ms"] == 400
    assert took_s < 3.0  # answered when the deadline passed, not when the worker got to them


def test_message_expiry_interval_caps_the_deadline(start_daemon, raw_client, encode_image) -> None:
    daemon = start_daemon()
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    with daemon.scheduler.paused():
        sent = time.monotonic()
        _publish(raw, json.dumps(_png_body(encode_image, timeout_ms=60000)).encode(), response_topic=reply,
                 correlation=b"e", expiry_s=1)  # fmt: skip
        body = json.loads(raw.wait_messages(reply, 1, timeout_s=10)[0].payload)
        took_s = time.monotonic() - sent
    assert body["error"]["code"] == "DEADLINE_EXCEEDED"
    assert "Message Expiry Interval of 1000 ms" in body["error"]["message"]
    assert body["error"]["details"]["limit"] == "message_expiry"
    assert 0.9 < took_s < 3.0


def test_response_message_expiry_is_the_time_left_until_the_request_deadline(start_daemon, raw_client,
                                                                             encode_image) -> None:  # fmt: skip
    # read on the wire by the requester (mosquitto forwards the interval left, in whole seconds: one
    # less when its clock's second turns between storing and forwarding)
    from edgevlm.protocol import NO_DEADLINE_MS

    def expiry(msg: Any) -> int | None:
        return getattr(msg.properties, "MessageExpiryInterval", None)

    daemon = start_daemon()  # defaults.timeout_ms 60000
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    # a Message Expiry Interval of 10 s, held 2.3 s in the queue: 7.7 s left, rounded up
    with daemon.scheduler.paused():
        _publish(raw, json.dumps(_png_body(encode_image)).encode(), response_topic=reply, correlation=b"mei",
                 expiry_s=10)  # fmt: skip
        time.sleep(2.3)
    msg = raw.wait_messages(reply, 1)[0]
    assert json.loads(msg.payload)["ok"] is True and expiry(msg) in (7, 8)
    # timeout_ms alone (no Message Expiry Interval), and the daemon's default deadline
    _publish(raw, json.dumps(_png_body(encode_image, timeout_ms=20000)).encode(), response_topic=reply,
             correlation=b"timeout")  # fmt: skip
    assert expiry(raw.wait_messages(reply, 2)[1]) in (19, 20)
    default = json.dumps(_png_body(encode_image, 70)).encode()
    _publish(raw, default, response_topic=reply, correlation=b"default")
    assert expiry(raw.wait_messages(reply, 3)[2]) in (59, 60)
    # no deadline at all: no Message Expiry Interval, the broker keeps the answer for as long as it may
    forever = json.dumps(_png_body(encode_image, 120, timeout_ms=NO_DEADLINE_MS)).encode()
    _publish(raw, forever, response_topic=reply, correlation=b"forever")
    msg = raw.wait_messages(reply, 4)[3]
    assert json.loads(msg.payload)["ok"] is True and expiry(msg) is None
    # its re-send, answered from the recent-answers cache, has the re-send's own deadline
    _publish(raw, forever, response_topic=reply, correlation=b"forever", expiry_s=9)
    msg = raw.wait_messages(reply, 5)[4]
    assert msg.payload == raw.messages[reply][3].payload and expiry(msg) in (8, 9)
    assert daemon.counters.get("duplicate_answered") == 1
    # an invalid request's error: the Message Expiry Interval it arrived with is its only deadline
    _publish(raw, b"{not json", response_topic=reply, correlation=b"bad", expiry_s=6)
    msg = raw.wait_messages(reply, 6)[5]
    assert json.loads(msg.payload)["error"]["code"] == "INVALID_REQUEST" and expiry(msg) in (5, 6)
    _publish(raw, b"{not json", response_topic=reply, correlation=b"bad2")
    assert expiry(raw.wait_messages(reply, 7)[6]) is None


def test_stopped_daemon_does_not_run_requests_its_clients_gave_up_on(tmp_path: Path, mosquitto, tiny_model_dir,
                                                                     raw_client, encode_image) -> None:  # fmt: skip
    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1"},
           "model": {"path": str(tiny_model_dir)}, "defaults": {"max_new_tokens": 2},
           "metrics": {"listen": None}, "tegrastats": {"enabled": False}}  # fmt: skip
    (tmp_path / "daemon.yaml").write_text(yaml.safe_dump(cfg))
    run = ("import sys; from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; "
           "sys.exit(run(load_daemon_config(sys.argv[1])))")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", run, str(tmp_path / "daemon.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    raw = raw_client()
    raw.subscribe("edgevlm/dev1/status")
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    try:
        deadline = time.monotonic() + 120
        while not any(json.loads(m.payload).get("state") == "online" for m in raw.messages.get("edgevlm/dev1/status", [])):
            assert proc.poll() is None and time.monotonic() < deadline, "daemon did not come online"
            time.sleep(0.1)
        payload = json.dumps(_png_body(encode_image, timeout_ms=2000)).encode()
        proc.send_signal(signal.SIGSTOP)
        for i in range(3):  # broker delivers them into the stopped daemon's socket
            _publish(raw, payload, response_topic=reply, correlation=b"s%d" % i)
        time.sleep(4.0)
        proc.send_signal(signal.SIGCONT)
        answers = raw.wait_messages(reply, 3, timeout_s=30)
        codes = [json.loads(m.payload).get("error", {}).get("code", "OK") for m in answers]
        assert codes == ["DEADLINE_EXCEEDED"] * 3, codes
        time.sleep(1.0)  # a request read within ReceiptClock.grace_s of the stop's end counts as waiting
        _publish(raw, payload, response_topic=reply, correlation=b"after")  # served normally afterwards
        after = raw.wait_messages(reply, 4, timeout_s=30)[3]
        assert json.loads(after.payload)["ok"] is True, after.payload
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert b"did not run for" in out  # the stop was noticed and logged


# ------------------------------------------------------------------ unanswerable requests


@pytest.mark.parametrize("topic", ["resp/+/x", "#"])
def test_wildcard_response_topic_is_dropped_and_counted(start_daemon, raw_client, encode_image, caplog,
                                                        topic) -> None:  # fmt: skip
    import logging

    daemon = start_daemon()
    raw = raw_client()
    raw.subscribe("resp/#")
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.mqtt_bridge"):
        _publish(raw, json.dumps(_png_body(encode_image)).encode(), response_topic=topic, correlation=b"w")
        deadline = time.monotonic() + 10
        while daemon.counters.get("invalid_response_topic") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert daemon.counters.get("invalid_response_topic") == 1
    assert 'edgevlm_requests_dropped_total{reason="invalid_response_topic"} 1.0' in daemon.metrics.exposition().decode()
    assert [r.levelname for r in caplog.records if "Response Topic" in r.getMessage()] == ["WARNING"]
    assert raw.count("resp/#") == 0


def test_empty_response_topic_uses_the_reply_to_fallback(start_daemon, raw_client, encode_image) -> None:
    daemon = start_daemon()
    raw = raw_client()
    raw.subscribe("legacy/answers")
    body = _png_body(encode_image, reply_to="legacy/answers", correlation_id="r-1")
    _publish(raw, json.dumps(body).encode(), response_topic="", correlation=None)
    answer = json.loads(raw.wait_messages("legacy/answers", 1)[0].payload)
    assert answer["ok"] is True and answer["correlation_id"] == "r-1"
    # no reply_to either: dropped and counted
    _publish(raw, json.dumps(_png_body(encode_image)).encode(), response_topic="", correlation=None)
    deadline = time.monotonic() + 10
    while daemon.counters.get("no_reply_address") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 'edgevlm_requests_dropped_total{reason="no_reply_address"} 1.0' in daemon.metrics.exposition().decode()


def test_lone_surrogate_correlation_id_gets_a_typed_error(start_daemon, raw_client) -> None:
    start_daemon()
    raw = raw_client()
    raw.subscribe("legacy/answers")
    payload = b'{"prompt": "p", "source": "front", "reply_to": "legacy/answers", "correlation_id": "\\udc00"}'
    _publish(raw, payload, response_topic=None, correlation=None)
    answer = json.loads(raw.wait_messages("legacy/answers", 1)[0].payload)
    assert answer["error"]["code"] == "INVALID_REQUEST"
    assert answer["error"]["message"].startswith("correlation_id: contains a lone UTF-16 surrogate")
    # with a Response Topic the Correlation Data still matches it
    raw.subscribe("test/answers")
    _publish(raw, payload.replace(b'"reply_to": "legacy/answers", ', b""), response_topic="test/answers",
             correlation=b"sur")  # fmt: skip
    msg = raw.wait_messages("test/answers", 1)[0]
    assert msg.properties.CorrelationData == b"sur"
    assert json.loads(msg.payload)["error"]["details"]["path"] == "correlation_id"


@pytest.mark.parametrize("bad", ["legacy/\u0001answers", "legacy/answers\u0085", "legacy/\ufffe", "legacy/\udc00"],
                         ids=["c0-control", "c1-control", "non-character", "lone-surrogate"])
def test_reply_to_the_broker_would_refuse_keeps_the_daemon_connected(start_daemon, raw_client, wait_until,
                                                                     bad) -> None:  # fmt: skip
    # mosquitto closes a connection that publishes to a topic with a control character or a
    # non-character ("Malformed packet", MQTT v5 section 1.5.4). A 3.1.1 client's JSON reply_to used
    # to be published to as it was: the daemon was disconnected, and again at every reconnect as paho
    # re-sent the unacknowledged response, so one request took it off the broker for good. A lone
    # surrogate beside a valid Response Topic raised in the handler: a traceback and no answer.
    daemon = start_daemon()
    raw = raw_client()
    raw.subscribe("test/answers")
    body = {"prompt": "p", "source": "front", "reply_to": bad, "correlation_id": "c-1"}
    _publish(raw, json.dumps(body).encode(), response_topic=None, correlation=None)
    wait_until(lambda: daemon.counters.get("no_reply_address") == 1, timeout_s=5, what="no_reply_address == 1")
    # with a Response Topic too, the bad reply_to is the request's error, answered there
    _publish(raw, json.dumps(body).encode(), response_topic="test/answers", correlation=b"\x00rt")
    msg = raw.wait_messages("test/answers", 1, timeout_s=5)[0]
    error = json.loads(msg.payload)["error"]
    assert msg.properties.CorrelationData == b"\x00rt"
    assert error["code"] == "INVALID_REQUEST" and error["details"]["path"] == "reply_to", error
    # still connected and serving: a good request is answered, nothing was disconnected or raised
    _publish(raw, b'{"prompt": "p", "source": "nope"}', response_topic="test/answers", correlation=b"after")
    after = raw.wait_messages("test/answers", 2, timeout_s=5)[1]
    assert json.loads(after.payload)["error"]["code"] == "UNKNOWN_SOURCE"
    assert daemon.counters.get("mqtt_disconnects") == 0 and daemon.counters.get("mqtt_connects") == 1
    assert daemon.counters.get("handler_errors") == 0


def test_huge_integer_is_invalid_request_without_python_advice(start_daemon, raw_client) -> None:
    start_daemon()
    raw = raw_client()
    raw.subscribe("test/answers")
    payload = b'{"prompt": "p", "source": "front", "timeout_ms": ' + b"7" * 5000 + b"}"
    _publish(raw, payload, response_topic="test/answers", correlation=b"big")
    error = json.loads(raw.wait_messages("test/answers", 1)[0].payload)["error"]
    assert error["code"] == "INVALID_REQUEST"
    assert error["message"] == "$: a JSON integer has more than 4300 digits (no field takes a number that large)"
    assert "set_int_max_str_digits" not in error["message"]


def test_recent_answers_are_bounded_and_cover_the_json_fallback(start_daemon, raw_client, encode_image) -> None:
    daemon = start_daemon(mqtt={"dedup_cache_size": 2})
    legacy = raw_client(protocol=3)
    legacy.subscribe("legacy/answers")

    def ask(cid: str, n: int) -> dict:
        body = _png_body(encode_image, reply_to="legacy/answers", correlation_id=cid)
        legacy.publish(REQUEST_TOPIC, json.dumps(body).encode())
        return json.loads(legacy.wait_messages("legacy/answers", n)[n - 1].payload)

    first = ask("a", 1)
    assert ask("a", 2) == first and daemon.counters.get("responses_ok") == 1  # reply_to + correlation_id
    ask("b", 3)
    ask("c", 4)  # the cache holds 2: "a" is evicted
    assert daemon.counters.get("responses_ok") == 3
    again = ask("a", 5)
    assert again["ok"] is True and again["ts"] != first["ts"]  # ran again: no longer remembered
    assert daemon.counters.get("responses_ok") == 4 and len(daemon.bridge.recent_answers) == 2


def test_dedup_cache_size_must_be_a_positive_integer() -> None:
    from edgevlm.config import DaemonConfig
    from edgevlm.errors import ConfigError

    for bad in (0, "8", 2.0):
        with pytest.raises((ConfigError, ValueError), match="dedup_cache_size"):
            DaemonConfig.model_validate({"mqtt": {"dedup_cache_size": bad}})


def test_recent_answers_settle_keeps_an_answer_and_drops_a_busy_one() -> None:
    """One rule for both transports (the one-process bridge and the front processes): an answer is
    kept for re-sends, a BUSY answer is dropped so that a re-send runs again, and a key since taken
    by another payload is not touched."""
    from edgevlm.daemon.delivery import RecentAnswers
    from edgevlm.errors import BusyError
    from edgevlm.protocol import Response

    cache = RecentAnswers(8)
    ok = Response(ok=True, text="two", correlation_id="a")
    assert cache.claim(("t", b"a"), b"d1") == ("new", None)
    cache.settle(("t", b"a"), b"d1", ok)
    assert cache.claim(("t", b"a"), b"d1") == ("answered", ok)
    assert cache.claim(("t", b"b"), b"d1") == ("new", None)
    cache.settle(("t", b"b"), b"d1", Response.failure(BusyError("queue full"), "b"))
    assert cache.claim(("t", b"b"), b"d1") == ("new", None)  # dropped: the re-send runs
    assert cache.claim(("t", b"c"), b"d1") == ("new", None)
    assert cache.claim(("t", b"c"), b"d2") == ("new", None)  # the same key, another payload
    cache.settle(("t", b"c"), b"d1", ok)  # the first payload's answer does not land on the second
    assert cache.claim(("t", b"c"), b"d2") == ("in_flight", None)


def test_response_expiry_rounds_up_and_never_reaches_zero() -> None:
    from edgevlm.protocol import MAX_MESSAGE_EXPIRY_S, NO_DEADLINE_MS, response_expiry_s

    assert response_expiry_s(5000, 0.2) == 5  # 4.8 s left
    assert response_expiry_s(5000, 4.0) == 1
    assert response_expiry_s(1000, 5.0) == 1  # answered after the deadline: still sent, held for 1 s at most
    assert response_expiry_s(NO_DEADLINE_MS - 1, 0.0) == MAX_MESSAGE_EXPIRY_S
    assert response_expiry_s(NO_DEADLINE_MS, 0.0) is None and response_expiry_s(None, 0.0) is None
