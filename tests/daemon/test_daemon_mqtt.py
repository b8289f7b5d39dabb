"""The daemon over a real mosquitto broker: request/response, the inputs that must be handled,
BUSY / DEADLINE_EXCEEDED, retained requests, status and reconnects.

The engine is the real :class:`edgevlm.runtime.Engine` on a tiny random checkpoint: answers are
gibberish but deterministic (greedy), so every ok response is checked against ``engine.ask`` on
the same image.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
import uuid

import numpy as np
import pytest

from edgevlm.protocol import NO_DEADLINE_MS

REQUEST_TOPIC = "edgevlm/dev1/request"
STATUS_TOPIC = "edgevlm/dev1/status"
PROMPT = "what colour is the circle ?"


def _scene() -> np.ndarray:
    """A dark 48x64 RGB test image (a diagonal gradient and a block)."""
    y, x = np.mgrid[0:48, 0:64]
    img = np.stack([(x * 2) % 120, (y * 2) % 120, ((x + y) * 3) % 120], axis=-1).astype(np.uint8)
    img[10:30, 20:40] = (110, 20, 30)
    return img


def _body(image_bytes: bytes, **extra) -> dict:
    return {"prompt": PROMPT, "image_b64": base64.b64encode(image_bytes).decode(), **extra}


def _roundtrip(raw, body: dict | bytes, *, correlation: bytes | None = b"corr", reply: str | None = None) -> tuple:
    reply = reply or f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    raw.publish(REQUEST_TOPIC, payload, response_topic=reply, correlation=correlation)
    msg = raw.wait_messages(reply, 1)[0]
    return json.loads(msg.payload), msg


def _expected(engine, image: np.ndarray, max_new_tokens: int = 4) -> str:
    return engine.ask(image, PROMPT, max_new_tokens=max_new_tokens).text


# --------------------------------------------------------------------------- request/response


def test_mosquitto_rr_drives_the_daemon(start_daemon, mosquitto, tiny_engine, raw_client, encode_image) -> None:
    start_daemon()
    img = _scene()
    spy = raw_client()
    spy.subscribe("rr/replies")  # sees the reply too, with its properties
    body = json.dumps(_body(encode_image(img)))
    out = subprocess.run(
        ["mosquitto_rr", "-h", mosquitto.host, "-p", str(mosquitto.port), "-V", "mqttv5",
         "-t", REQUEST_TOPIC, "-e", "rr/replies", "-D", "publish", "correlation-data", "rr-42",
         "-m", body, "-W", "30"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    response = json.loads(out.stdout)
    assert response["ok"] is True, response
    assert response["text"] == _expected(tiny_engine, img)
    assert response["stats"]["new_tokens"] >= 1 and response["stats"]["vision_tokens"] == 12
    stages = response["stats"]["stages_ms"]  # one request at a time: engine.ask, no prefill group to wait for
    assert list(stages) == ["queued", "dequeued", "first_token", "done", "replied"], stages
    assert all(0 <= a <= b for a, b in zip(list(stages.values()), list(stages.values())[1:], strict=False)), stages
    msg = spy.wait_messages("rr/replies", 1)[0]
    assert msg.properties.CorrelationData == b"rr-42"


def test_binary_correlation_data_is_echoed_byte_for_byte(start_daemon, raw_client, encode_image) -> None:
    start_daemon()
    raw = raw_client()
    image = encode_image(_scene())
    for corr in (b"\x00", b"\xff\xfe\x00\x80binary\x00\xc3\x28", bytes(range(256))):
        response, msg = _roundtrip(raw, _body(image), correlation=corr)
        assert response["ok"] is True
        assert msg.properties.CorrelationData == corr
        assert msg.properties.ContentType == "application/json"
        assert msg.properties.PayloadFormatIndicator == 1  # UTF-8 text (MQTT v5 3.3.2.3.2); was absent
        assert msg.payload.decode("utf-8")  # and it is


def test_request_without_correlation_data_is_answered_without_it(start_daemon, raw_client, encode_image) -> None:
    start_daemon()
    response, msg = _roundtrip(raw_client(), _body(encode_image(_scene())), correlation=None)
    assert response["ok"] is True
    assert not hasattr(msg.properties, "CorrelationData")


def test_mqtt311_fallback_reply_to_and_correlation_id(start_daemon, raw_client, tiny_engine, encode_image) -> None:
    start_daemon()
    legacy = raw_client(protocol=3)
    legacy.subscribe("legacy/replies")
    img = _scene()
    body = _body(encode_image(img), reply_to="legacy/replies", correlation_id="req-\u00e9-42")
    legacy.publish(REQUEST_TOPIC, json.dumps(body).encode())
    response = json.loads(legacy.wait_messages("legacy/replies", 1)[0].payload)
    assert response["ok"] is True
    assert response["correlation_id"] == "req-\u00e9-42"
    assert response["text"] == _expected(tiny_engine, img)
    # An invalid request with the fallback address is answered there too.
    legacy.publish(REQUEST_TOPIC, b'{"prompt": 7, "reply_to": "legacy/replies", "correlation_id": "bad-1"}')
    response = json.loads(legacy.wait_messages("legacy/replies", 2)[1].payload)
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert response["correlation_id"] == "bad-1"


def test_request_with_no_reply_address_is_counted_and_daemon_keeps_running(
    start_daemon, raw_client, encode_image, wait_until
) -> None:
    daemon = start_daemon()
    legacy = raw_client(protocol=3)
    legacy.publish(REQUEST_TOPIC, json.dumps(_body(encode_image(_scene()))).encode())
    legacy.publish(REQUEST_TOPIC, b"{not json")
    wait_until(lambda: daemon.counters.get("no_reply_address") == 2, what="no_reply_address == 2")
    assert daemon.counters.get("responses_ok") == 0
    response, _ = _roundtrip(raw_client(), _body(encode_image(_scene())))
    assert response["ok"] is True


def test_retained_request_is_not_executed(start_daemon, raw_client, encode_image) -> None:
    raw = raw_client()
    raw.subscribe("retained/replies")
    raw.publish(
        REQUEST_TOPIC,
        json.dumps(_body(encode_image(_scene()))).encode(),
        response_topic="retained/replies",
        correlation=b"old",
        retain=True,
    )
    daemon = start_daemon()
    # A live request after it: FIFO on one connection and one worker, so had the retained request
    # been executed, its answer would be there before this one.
    response, _ = _roundtrip(raw, _body(encode_image(_scene())), correlation=b"live")
    assert response["ok"] is True
    assert raw.count("retained/replies") == 0
    assert daemon.counters.get("requests_received") == 1


# ----------------------------------------------------------------------------- bad inputs


def test_timeout_ms_int64_max_means_no_deadline(start_daemon, raw_client, tiny_engine, encode_image) -> None:
    daemon = start_daemon()
    img = _scene()
    raw = raw_client()
    with daemon.scheduler.paused():
        reply = "test/replies/nodeadline"
        raw.subscribe(reply)
        raw.publish(REQUEST_TOPIC, json.dumps(_body(encode_image(img), timeout_ms=NO_DEADLINE_MS)).encode(),
                    response_topic=reply, correlation=b"x")  # fmt: skip
        job = _wait_queued(daemon)
        assert job.timeout_ms == 9223372036854775807 and job.deadline_monotonic is None
    response = json.loads(raw.wait_messages(reply, 1)[0].payload)
    assert response["ok"] is True and response["text"] == _expected(tiny_engine, img)


@pytest.mark.parametrize("value", ["-1", "-9223372036854775808", "1.5", "2.0", '"100"', "9223372036854775808"])
def test_bad_timeout_ms_is_invalid_request(start_daemon, raw_client, encode_image, value: str) -> None:
    start_daemon()
    body = json.dumps(_body(encode_image(_scene())))[:-1] + f', "timeout_ms": {value}}}'
    response, _ = _roundtrip(raw_client(), body.encode())
    assert response["ok"] is False
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert response["error"]["details"]["path"] == "timeout_ms"


@pytest.mark.parametrize("field", ["timeout_ms", "budget_ms", "seed", "frame_seq"])
def test_an_integer_past_int64_is_refused_naming_its_field(start_daemon, raw_client, field: str) -> None:
    """frame_seq took any integer (2**63, 10**30): past the README's rule that a value above 2**63 - 1 is
    refused, it reached the source and was answered 'has not delivered that frame'."""
    start_daemon()
    extra = {"temperature": 0.5} if field == "seed" else {}
    body = {"prompt": PROMPT, "source": "front", **extra, field: 2**63}
    response, _ = _roundtrip(raw_client(), body)
    assert response["ok"] is False and response["error"]["code"] == "INVALID_REQUEST"
    assert response["error"]["details"]["path"] == field
    assert response["error"]["message"] == f"{field}: Input should be less than or equal to 9223372036854775807"
    body[field] = 2**63 - 1  # the largest is taken: refused further on, not by the field's type
    response, _ = _roundtrip(raw_client(), body)
    assert response["error"].get("details", {}).get("path") != field


def test_truncated_jpeg_is_invalid_image(start_daemon, raw_client, encode_image) -> None:
    start_daemon()
    jpeg = encode_image(_scene(), ".jpg")
    response, _ = _roundtrip(raw_client(), _body(jpeg[: len(jpeg) // 2]))
    assert response["ok"] is False and response["error"]["code"] == "INVALID_IMAGE"
    response, _ = _roundtrip(raw_client(), _body(b"definitely not an image"))
    assert response["error"]["code"] == "INVALID_IMAGE"


def test_16bit_png_is_scaled_not_clipped(start_daemon, raw_client, tiny_engine, encode_image) -> None:
    start_daemon()
    img8 = _scene()
    img16 = img8.astype(np.uint16) * 257  # the same picture on the 16-bit scale
    png16 = encode_image(img16, ".png")
    assert png16[24] == 16  # IHDR bit depth: really a 16-bit PNG
    white = np.full_like(img8, 255)
    expected = _expected(tiny_engine, img8)
    assert expected != _expected(tiny_engine, white)  # so clipping to white would be caught
    response, _ = _roundtrip(raw_client(), _body(png16))
    assert response["ok"] is True and response["text"] == expected


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        (b'{"prompt": "p", "source": ', "$"),
        (b"\x00\x01\x02", "$"),
        (b"[]", "$"),
        (b'{"prompt": ["p"], "source": "cam"}', "prompt"),
        (b'{"prompt": "p", "source": "cam", "max_new_tokens": "8"}', "max_new_tokens"),
        (b'{"prompt": "p", "source": "cam", "colour": "red"}', "colour"),
        (b'{"source": "cam"}', "prompt"),
    ],
)
def test_malformed_and_wrong_shape_payloads(start_daemon, raw_client, encode_image, payload: bytes, path: str) -> None:
    start_daemon()
    raw = raw_client()
    response, _ = _roundtrip(raw, payload)
    assert response["ok"] is False
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert response["error"]["details"]["path"] == path
    assert response["error"]["message"].startswith(f"{path}: ")
    response, _ = _roundtrip(raw, _body(encode_image(_scene())))  # still serving
    assert response["ok"] is True


def test_duplicate_key_is_invalid_request_naming_the_key(start_daemon, raw_client, encode_image) -> None:
    # was: served, the last "prompt" silently winning
    start_daemon()
    raw = raw_client()
    body = json.dumps(_body(encode_image(_scene())))
    payload = body[:-1].encode() + b', "prompt": "what shape is it?"}'
    response, msg = _roundtrip(raw, payload)
    assert response["ok"] is False and msg.properties.CorrelationData == b"corr"
    assert response["error"] == {
        "code": "INVALID_REQUEST",
        "message": '$: malformed JSON: duplicate key "prompt" (a name may appear only once in an object)',
        "details": {"path": "$", "errors": [{"path": "$", "message": 'duplicate key "prompt"'}]},
    }
    response, _ = _roundtrip(raw, body.encode())  # the same request without the second "prompt": served
    assert response["ok"] is True


def test_oversized_payload_is_invalid_request(start_daemon, raw_client) -> None:
    start_daemon(mqtt={"max_payload_bytes": 1000})
    response, _ = _roundtrip(raw_client(), _body(b"x" * 2000))
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert "max_payload_bytes" in response["error"]["message"]


def test_prompt_too_long_for_the_kv_cache_is_invalid_request(start_daemon, raw_client, encode_image) -> None:
    start_daemon()
    response, _ = _roundtrip(raw_client(), {**_body(encode_image(_scene())), "prompt": "red " * 600})
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert "KV cache" in response["error"]["message"]


# ------------------------------------------------------------------------------- scheduling


def _wait_queued(daemon, n: int = 1):
    deadline = time.monotonic() + 10
    while daemon.scheduler.queue_size() < n:
        assert time.monotonic() < deadline, "request never reached the queue"
        time.sleep(0.005)
    return daemon.scheduler.queued()[n - 1]


def test_full_queue_answers_busy(start_daemon, raw_client, tiny_engine, encode_image) -> None:
    daemon = start_daemon(queue_max_size=2)
    img = _scene()
    raw = raw_client()
    raw.subscribe("q/replies")
    with daemon.scheduler.paused():
        for i in range(4):
            raw.publish(REQUEST_TOPIC, json.dumps(_body(encode_image(img))).encode(),
                        response_topic="q/replies", correlation=bytes([i]))  # fmt: skip
        busy = raw.wait_messages("q/replies", 2)  # answered at once, while the worker is held
        assert daemon.scheduler.queue_size() == 2
    for msg in busy:
        body = json.loads(msg.payload)
        assert body["error"]["code"] == "BUSY"
        assert body["error"]["details"] == {"reason": "queue_full", "queue_max_size": 2}
    assert sorted(m.properties.CorrelationData for m in busy) == [b"\x02", b"\x03"]
    done = raw.wait_messages("q/replies", 4)[2:]
    assert sorted(m.properties.CorrelationData for m in done) == [b"\x00", b"\x01"]
    expected = _expected(tiny_engine, img)
    assert all(json.loads(m.payload)["text"] == expected for m in done)
    assert daemon.counters.get("errors_BUSY") == 2


def test_request_past_its_deadline_while_queued(start_daemon, raw_client, encode_image) -> None:
    # answered DEADLINE_EXCEEDED when the deadline passes in the queue, not when the worker gets to
    # it: here the worker takes nothing off the queue until both answers are in
    daemon = start_daemon()
    raw = raw_client()
    raw.subscribe("d/replies")
    image = encode_image(_scene())
    with daemon.scheduler.paused():
        raw.publish(REQUEST_TOPIC, json.dumps(_body(image, timeout_ms=20)).encode(),
                    response_topic="d/replies", correlation=b"late")  # fmt: skip
        raw.publish(REQUEST_TOPIC, json.dumps(_body(image, timeout_ms=NO_DEADLINE_MS)).encode(),
                    response_topic="d/replies", correlation=b"patient")  # fmt: skip
        first = raw.wait_messages("d/replies", 1)[0]
        deadline = time.monotonic() + 10  # the patient request may reach the queue after the late answer
        while daemon.scheduler.queue_size() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert daemon.scheduler.queue_size() == 1  # the patient one still waits
    msgs = raw.wait_messages("d/replies", 2)
    assert first.properties.CorrelationData == b"late"
    by_corr = {m.properties.CorrelationData: json.loads(m.payload) for m in msgs}
    assert by_corr[b"late"]["error"]["code"] == "DEADLINE_EXCEEDED"
    assert by_corr[b"late"]["error"]["details"]["timeout_ms"] == 20
    assert by_corr[b"late"]["error"]["details"]["queue_ms"] >= 20
    assert by_corr[b"patient"]["ok"] is True


# ---------------------------------------------------------------------------------- sources


def test_source_request_reports_the_frame(start_daemon, raw_client, make_video, colour_index, wait_until) -> None:
    path = make_video(n_frames=6, fps=10.0)
    daemon = start_daemon(sources=[{"name": "cam", "uri": str(path), "fps": 50}])
    wait_until(lambda: daemon.sources.get("cam").latest() is not None, what="a first frame")
    before = time.time()
    response, _ = _roundtrip(raw_client(), {"prompt": PROMPT, "source": "cam"})
    assert response["ok"] is True and response["text"]
    frame = response["frame"]
    assert frame["source"] == "cam"
    assert 0 <= frame["index"] < 6 and abs(frame["pos_ms"] - 100.0 * frame["index"]) < 1.0
    assert before - 5 < frame["ts"] <= response["ts"]


def test_unknown_source(start_daemon, raw_client, make_video) -> None:
    start_daemon(sources=[{"name": "cam", "uri": str(make_video())}])
    response, _ = _roundtrip(raw_client(), {"prompt": PROMPT, "source": "rear"})
    assert response["error"]["code"] == "UNKNOWN_SOURCE"
    assert response["error"]["details"] == {"source": "rear", "known": ["cam"]}


def test_source_without_frames_is_internal_error_not_a_hang(start_daemon, raw_client, tmp_path, encode_image) -> None:
    bogus = tmp_path / "broken.mp4"
    bogus.write_bytes(b"not a video")
    start_daemon(sources=[{"name": "broken", "uri": str(bogus), "reopen_delay_s": 0.05}])
    raw = raw_client()
    response, _ = _roundtrip(raw, {"prompt": PROMPT, "source": "broken", "timeout_ms": 300})
    assert response["error"]["code"] == "INTERNAL"
    assert response["error"]["details"]["reason"] == "no_frame"
    response, _ = _roundtrip(raw, _body(encode_image(_scene())))
    assert response["ok"] is True


# ------------------------------------------------------------------------ status, reconnect


def test_status_online_retained_and_offline_on_stop(start_daemon, raw_client) -> None:
    daemon = start_daemon()
    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    first = watcher.wait_messages(STATUS_TOPIC, 1)[0]
    assert first.retain  # a late subscriber gets it: retained
    status = json.loads(first.payload)
    assert status["state"] == "online" and status["device_id"] == "dev1" and status["schema_version"] == 1
    daemon.stop()
    status = json.loads(watcher.wait_messages(STATUS_TOPIC, 2)[1].payload)
    assert status["state"] == "offline"


def test_reconnects_after_broker_restart(start_daemon, mosquitto, raw_client, encode_image, wait_until) -> None:
    daemon = start_daemon()
    assert daemon.counters.get("mqtt_connects") == 1
    mosquitto.restart()  # drops every connection; nothing persisted (retained status gone too)
    wait_until(lambda: daemon.counters.get("mqtt_connects") == 2 and daemon.bridge.connected,
               timeout_s=30, what="the daemon to reconnect")  # fmt: skip
    wait_until(lambda: daemon.bridge.wait_ready(0), timeout_s=10, what="the re-subscription")
    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    assert json.loads(watcher.wait_messages(STATUS_TOPIC, 1)[0].payload)["state"] == "online"
    response, _ = _roundtrip(watcher, _body(encode_image(_scene())))
    assert response["ok"] is True
    assert daemon.counters.get("mqtt_disconnects") >= 1


def test_connection_loss_publishes_the_will_then_online_again(start_daemon, raw_client, wait_until) -> None:
    import socket

    daemon = start_daemon()
    watcher = raw_client()
    watcher.subscribe(STATUS_TOPIC)
    watcher.wait_messages(STATUS_TOPIC, 1)
    # Cut the TCP connection under paho (no DISCONNECT packet): to the broker this is a crash.
    daemon.bridge._client.socket().shutdown(socket.SHUT_RDWR)
    msgs = watcher.wait_messages(STATUS_TOPIC, 3, timeout_s=30)
    states = [json.loads(m.payload) for m in msgs]
    assert states[1] == {"schema_version": 1, "state": "offline", "device_id": "dev1", "sources": []}  # the will
    assert states[2]["state"] == "online" and states[2]["ts"] > 0  # after the reconnect
    wait_until(lambda: daemon.bridge.wait_ready(0), what="the re-subscription")
    response, _ = _roundtrip(watcher, {"prompt": PROMPT, "source": "nope"})
    assert response["error"]["code"] == "UNKNOWN_SOURCE"  # served again


def test_daemon_started_before_the_broker_connects_when_it_comes_up(start_daemon, mosquitto, raw_client) -> None:
    port = mosquitto.port
    mosquitto.stop()
    daemon = start_daemon(wait=False)
    assert not daemon.wait_ready(0.3)
    mosquitto.start(port=port)
    assert daemon.wait_ready(30)
    assert daemon.counters.get("mqtt_connect_failures") >= 1
    response, _ = _roundtrip(raw_client(), {"prompt": PROMPT, "source": "nope"})
    assert response["error"]["code"] == "UNKNOWN_SOURCE"


def test_a_port_that_is_not_an_mqtt_broker_is_logged_as_a_failed_connect(start_daemon, caplog, wait_until) -> None:
    """mqtt.port pointing at something that answers the CONNECT with bytes that are not MQTT (an HTTP server,
    a TLS listener): each attempt is logged as a failed connect that says so, not as a lost connection of "the
    broker stopped or crashed" (no connection had been made), and the daemon keeps retrying."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve_http() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=serve_http, daemon=True)
    thread.start()
    try:
        with caplog.at_level("WARNING", logger="edgevlm.daemon.mqtt_bridge"):
            daemon = start_daemon(wait=False, mqtt={"port": port})
            wait_until(lambda: "cannot connect to 127.0.0.1" in caplog.text, timeout_s=20, what="a failed connect")
            assert not daemon.wait_ready(0.1)
    finally:
        stop.set()
        thread.join(5)
        server.close()
    line = next(r.getMessage() for r in caplog.records if "cannot connect to" in r.getMessage())
    assert line.startswith(f"MQTT: cannot connect to 127.0.0.1:{port}: the connection closed before the broker's "
                           "CONNACK"), line
    assert "not an MQTT broker" in line or "MQTT broker" in line, line
    assert "stopped or crashed" not in caplog.text, caplog.text
