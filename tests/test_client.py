"""The SDK client: PNG encoding, argument checks, typed errors, concurrency, clean-up; against a
real daemon (tiny real engine) on a real mosquitto broker."""

from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import pytest

import edgevlm
from edgevlm.client import Client, encode_png, image_to_bytes
from edgevlm.errors import (
    BrokerUnreachableError,
    BusyError,
    ClientClosedError,
    DeadlineExceededError,
    InvalidImageError,
    InvalidRequestError,
    UnknownSourceError,
)

PROMPT = "how many red circles ?"


def _image(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(40, 56, 3), dtype=np.uint8)


# ------------------------------------------------------------------------------- PNG, offline


@pytest.mark.parametrize(
    "shape_dtype",
    [((5, 7, 3), np.uint8), ((5, 7), np.uint8), ((5, 7, 4), np.uint8), ((4, 3, 3), np.uint16), ((6, 2, 1), np.uint8)],
)
def test_encode_png_roundtrips_through_opencv(shape_dtype) -> None:
    import cv2

    shape, dtype = shape_dtype
    rng = np.random.default_rng(1)
    img = rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype, endpoint=True)
    back = cv2.imdecode(np.frombuffer(encode_png(img), np.uint8), cv2.IMREAD_UNCHANGED)
    assert back.dtype == dtype
    if img.ndim == 3 and img.shape[2] == 3:
        back = back[:, :, ::-1]  # OpenCV decodes to BGR
    elif img.ndim == 3 and img.shape[2] == 4:
        back = back[:, :, [2, 1, 0, 3]]
    np.testing.assert_array_equal(back.reshape(img.shape), img)


@pytest.mark.parametrize(
    "bad", [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4, 5), np.uint8), np.zeros((0, 4, 3), np.uint8)]
)
def test_encode_png_rejects_bad_arrays(bad) -> None:
    with pytest.raises(InvalidImageError):
        encode_png(bad)


def test_image_to_bytes(tmp_path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(b"\x89PNG fake")
    assert image_to_bytes(path) == b"\x89PNG fake"
    assert image_to_bytes(str(path)) == b"\x89PNG fake"
    assert image_to_bytes(bytearray(b"abc")) == b"abc"
    with pytest.raises(InvalidImageError, match="cannot read image file"):
        image_to_bytes(tmp_path / "missing.jpg")
    with pytest.raises(InvalidImageError, match="empty"):
        image_to_bytes(b"")
    with pytest.raises(InvalidImageError, match="numpy array, encoded image bytes or a file path"):
        image_to_bytes(42)  # type: ignore[arg-type]


def test_connection_refused_is_connection_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BrokerUnreachableError, match=f"127.0.0.1:{port}: connection refused") as info:
        Client("127.0.0.1", port, "dev1", connect_timeout_s=2)
    assert isinstance(info.value, ConnectionError)


class _NotABroker:
    """A real TCP listener on 127.0.0.1 that is not an MQTT broker: for each connection it reads what the
    client sends (kept in ``received``), then answers ``reply`` and closes; ``reply=None`` closes at once,
    without reading; ``silent`` reads and never answers (closed when the test ends)."""

    def __init__(self, reply: bytes | None, *, silent: bool = False) -> None:
        self.reply, self.silent = reply, silent
        self.received: list[bytes] = []
        self._held: list[socket.socket] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            if self.reply is None and not self.silent:
                conn.close()
                continue
            conn.settimeout(5)
            try:
                self.received.append(conn.recv(4096))
            except OSError:
                self.received.append(b"")
            if self.silent:
                self._held.append(conn)
                continue
            conn.sendall(self.reply)
            conn.close()

    def close(self) -> None:
        self._sock.close()
        for conn in self._held:
            conn.close()


HTTP_REPLY = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
SSH_REPLY = b"SSH-2.0-OpenSSH_9.2\r\nInvalid SSH identification string.\r\n"
TLS_ALERT = b"\x15\x03\x03\x00\x02\x02\x46"  # what a TLS port answers to bytes that are not a ClientHello


def _connect_error(server: _NotABroker, *, connect_timeout_s: float) -> tuple[BrokerUnreachableError, float]:
    """The error of a Client connecting to ``server`` (closed after), and how long it took (s)."""
    try:
        start = time.monotonic()
        with pytest.raises(BrokerUnreachableError) as info:
            Client("127.0.0.1", server.port, "dev1", connect_timeout_s=connect_timeout_s)
        return info.value, time.monotonic() - start
    finally:
        server.close()


@pytest.mark.parametrize(("reply", "said"), [
    (HTTP_REPLY, "it answered CONNECT with b'HTTP/1.1 400 Bad Request\\r\\nConten'..., not a CONNACK (an HTTP server?)"),
    (SSH_REPLY, "it answered CONNECT with b'SSH-2.0-OpenSSH_9.2\\r\\nInvalid SSH'..., not a CONNACK"),
    (TLS_ALERT, "it answered CONNECT with b'\\x15\\x03\\x03\\x00\\x02', not a CONNACK "
                "(a TLS port? connect with tls=True)"),
    (None, "it closed the connection during CONNECT, before a CONNACK"),
], ids=["http", "ssh", "tls", "close-at-once"])
def test_port_that_is_not_an_mqtt_broker_is_named_at_once(reply, said) -> None:
    """A port that is not an MQTT broker (an HTTP server, an SSH banner, a TLS port, one that accepts and
    closes) waited the whole connect timeout, logging "connection lost: Unspecified error; reconnecting"
    on every retry, then raised "MQTT broker at ... refused the connection: no answer within 10 s". Now the
    first connection's end raises BrokerUnreachableError naming the port and what it sent."""
    server = _NotABroker(reply)
    error, took = _connect_error(server, connect_timeout_s=10)
    assert str(error) == f"127.0.0.1:{server.port} did not answer as an MQTT broker: {said}"
    assert isinstance(error, ConnectionError) and "\n" not in str(error)
    assert took < 2.0, took  # the connection's end, not the 10 s timeout
    if reply is not None:  # the client did send an MQTT v5 CONNECT (packet type 1, "MQTT", level 5)
        assert server.received[0][:1] == b"\x10" and b"\x00\x04MQTT\x05" in server.received[0][:12]


def test_port_that_accepts_and_never_answers_is_named_at_the_connect_timeout() -> None:
    """An HTTP server that waits for a request line (python -m http.server) reads CONNECT and answers
    nothing: "no CONNACK within" the connect timeout, not "refused the connection"."""
    server = _NotABroker(None, silent=True)
    error, took = _connect_error(server, connect_timeout_s=0.5)
    assert str(error) == f"127.0.0.1:{server.port} did not answer as an MQTT broker: no CONNACK within 0.5 s"
    assert 0.5 <= took < 1.5, took


def test_not_a_broker_writes_nothing_on_stderr() -> None:
    """In a plain process (no logging set up) each failed connection printed "edgevlm client: connection
    lost: Unspecified error; reconnecting" on stderr (the logging module's last-resort handler) before the
    error: now only the error, as the program prints it."""
    import subprocess
    import sys

    http, closing = _NotABroker(HTTP_REPLY), _NotABroker(None)
    script = (
        "import sys\n"
        "from edgevlm import Client\n"
        "from edgevlm.errors import BrokerUnreachableError\n"
        "for port in sys.argv[1:]:\n"
        "    try:\n"
        "        Client('127.0.0.1', int(port), 'dev1', connect_timeout_s=5)\n"
        "    except BrokerUnreachableError as exc:\n"
        "        print(exc)\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(http.port), str(closing.port)],
                              capture_output=True, timeout=60)
    finally:
        http.close()
        closing.close()
    assert proc.stderr == b""
    assert proc.returncode == 0
    assert proc.stdout.decode().splitlines() == [
        f"127.0.0.1:{http.port} did not answer as an MQTT broker: it answered CONNECT with "
        "b'HTTP/1.1 400 Bad Request\\r\\nConten'..., not a CONNACK (an HTTP server?)",
        f"127.0.0.1:{closing.port} did not answer as an MQTT broker: it closed the connection during CONNECT, "
        "before a CONNACK",
    ]


@pytest.mark.parametrize("port", [0, 70000, -1, "1883", True])
def test_port_outside_1_65535_is_refused_by_name(port) -> None:
    """A port no socket can have used to read "connection refused (no broker listening on that port)"."""
    with pytest.raises(ValueError, match=r"^port must be an integer in 1\.\.65535, got "):
        Client("127.0.0.1", port, device_id="robot-1")


@pytest.mark.parametrize("which", ["ca_certs", "certfile"])
def test_tls_file_that_cannot_be_read_is_named(mosquitto, tmp_path, which) -> None:
    """A TLS file that is missing (or not a certificate) raised a bare ``FileNotFoundError: [Errno 2] No such
    file or directory`` (or an ``ssl.SSLError``) naming neither the argument nor the file; now the constructor's
    BrokerUnreachableError (a ConnectionError: "a TLS certificate failure") names both."""
    missing = tmp_path / "nope.crt"
    kw = {"ca_certs": str(missing)} if which == "ca_certs" else {"certfile": str(missing)}
    with pytest.raises(BrokerUnreachableError, match=rf"^cannot set up TLS for the MQTT broker at "
                                                      rf"{mosquitto.host}:{mosquitto.port}: {which} {missing}: "):
        Client(mosquitto.host, mosquitto.port, "dev1", tls=True, **kw)
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    with pytest.raises(BrokerUnreachableError, match=rf"ca_certs {garbage}: "):
        Client(mosquitto.host, mosquitto.port, "dev1", tls=True, ca_certs=str(garbage))


@pytest.mark.parametrize(("kw", "message"), [
    ({"keepalive_s": -1}, "keepalive_s must be an integer in 0..65535, got -1"),
    ({"keepalive_s": 1.5}, "keepalive_s must be an integer in 0..65535, got 1.5"),
    ({"connect_timeout_s": 0}, "connect_timeout_s must be a positive number, got 0"),
    ({"connect_timeout_s": float("nan")}, "connect_timeout_s must be a positive number, got nan"),
])
def test_bad_connection_arguments_are_refused_by_name(mosquitto, kw, message) -> None:
    """keepalive_s=-1 read "BrokerUnreachableError: cannot connect to the MQTT broker ...: ValueError: Keepalive
    must be >=0." (the broker was fine), connect_timeout_s=0 paho's "timeout must be a positive number"."""
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.") + "$") as info:
        Client(mosquitto.host, mosquitto.port, "dev1", **kw)
    assert not isinstance(info.value, ConnectionError)


def test_client_is_exported_lazily() -> None:
    assert edgevlm.Client is Client


# ---------------------------------------------------------------------------- against daemon


def test_ask_with_array_bytes_and_path(start_daemon, mosquitto, tiny_engine, tmp_path) -> None:
    start_daemon()
    img = _image(0)
    expected = tiny_engine.ask(img, PROMPT, max_new_tokens=5).text
    png = encode_png(img)
    path = tmp_path / "img.png"
    path.write_bytes(png)
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        assert client.wait_online(10)
        assert client.device_status is not None and client.device_status.device_id == "dev1"
        for image in (img, png, path, str(path)):
            answer = client.ask(PROMPT, image=image, timeout_s=30, max_new_tokens=5)
            assert isinstance(answer, edgevlm.Answer)
            assert answer.text == expected
            assert answer.stats.new_tokens >= 1 and answer.stats.e2e_ms > 0
            assert answer.source is None and answer.frame_ts is None


def test_client_without_device_id_asks_the_daemon_that_took_this_hosts_default(start_daemon, mosquitto,
                                                                                 tiny_engine) -> None:  # fmt: skip
    """Client(host, port) raised "device_id must be a non-empty topic level of [A-Za-z0-9_.-], got ''" although a
    daemon whose config gives no mqtt.device_id serves under this host's name: the two defaults are one now."""
    from edgevlm.config import MqttConfig

    host_default = MqttConfig().device_id  # what a daemon config without mqtt.device_id takes
    assert host_default == re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64]
    start_daemon(device_id=host_default)
    img = _image(2)
    with Client(mosquitto.host, mosquitto.port) as client:
        assert client.device_id == host_default and client.request_topic == f"edgevlm/{host_default}/request"
        assert client.wait_online(10) and client.device_status.device_id == host_default
        expected = tiny_engine.ask(img, PROMPT, max_new_tokens=4).text
        assert client.ask(PROMPT, image=img, timeout_s=30).text == expected
    with pytest.raises(InvalidRequestError, match=r"^device_id must be a non-empty topic level .*, got ''$"):
        Client(mosquitto.host, mosquitto.port, "")  # an empty one given is still a mistake, not the default


def test_numpy_scalars_and_a_single_stop_string_are_taken(start_daemon, mosquitto, tiny_engine) -> None:
    # was: max_new_tokens=np.int64(5) -> "max_new_tokens: Input should be a valid integer" (robot code computes
    # its knobs with NumPy), stop="." -> "stop: Input should be a valid list" (Engine.ask takes one string)
    start_daemon()
    img = _image(1)
    expected = tiny_engine.ask(img, PROMPT, max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop=["zz"])
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        answer = client.ask(PROMPT, image=img, timeout_s=np.float32(30), max_new_tokens=np.int64(5),
                            temperature=np.float32(0.7), top_p=np.float64(0.9), seed=np.uint32(3), stop="zz",
                            budget_ms=np.int32(60000))
    assert answer.text == expected.text
    assert answer.stats.new_tokens == expected.stats.new_tokens


def test_ask_source_returns_frame_info(start_daemon, mosquitto, tmp_path) -> None:
    import cv2

    video = tmp_path / "v.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (32, 32))
    for i in range(4):
        writer.write(np.full((32, 32, 3), 60 * i, np.uint8))
    writer.release()
    daemon = start_daemon(sources=[{"name": "front", "uri": str(video), "fps": 40}])
    assert daemon.sources.get("front").wait_for_frame(10) is not None
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        answer = client.ask(PROMPT, source="front", timeout_s=None)
    assert answer.source == "front"
    assert answer.frame_ts is not None and answer.frame_pos_ms is not None
    assert answer.frame_pos_ms in (0.0, 100.0, 200.0, 300.0)


def test_local_argument_checks(start_daemon, mosquitto) -> None:
    start_daemon()
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        with pytest.raises(InvalidRequestError, match="exactly one of"):
            client.ask(PROMPT)
        with pytest.raises(InvalidRequestError, match="exactly one of"):
            client.ask(PROMPT, source="a", image=b"x")
        with pytest.raises(InvalidRequestError, match="timeout_s"):
            client.ask(PROMPT, source="a", timeout_s=-1)
        with pytest.raises(InvalidRequestError, match="^prompt: "):
            client.ask("", source="a")
        with pytest.raises(InvalidRequestError, match="^max_new_tokens: "):
            client.ask(PROMPT, source="a", max_new_tokens=0)


def test_wire_errors_are_typed_exceptions(start_daemon, mosquitto) -> None:
    start_daemon()
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        with pytest.raises(UnknownSourceError) as info:
            client.ask(PROMPT, source="nowhere", timeout_s=10)
        assert info.value.details["source"] == "nowhere"
        with pytest.raises(InvalidImageError):
            client.ask(PROMPT, image=b"\xff\xd8\xff\xe0 truncated jpeg", timeout_s=10)


def test_busy_and_local_deadline(start_daemon, mosquitto, tiny_engine) -> None:
    daemon = start_daemon(queue_max_size=1)
    img = _image(3)
    results: list[object] = []
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        with daemon.scheduler.paused():
            waiter = threading.Thread(target=lambda: results.append(client.ask(PROMPT, image=img, timeout_s=None)))
            waiter.start()
            while daemon.scheduler.queue_size() < 1:
                assert waiter.is_alive()
                waiter.join(0.005)
            with pytest.raises(BusyError, match="queue full"):
                client.ask(PROMPT, image=img, timeout_s=10)
        waiter.join(30)
        assert [getattr(r, "text", r) for r in results] == [tiny_engine.ask(img, PROMPT, max_new_tokens=4).text]
        # No answer at all within timeout_s (worker held): the client gives up by itself.
        with daemon.scheduler.paused():
            with pytest.raises(DeadlineExceededError) as info:
                client.ask(PROMPT, image=img, timeout_s=0.2)
            assert info.value.details["local"] is True
        # ...and the daemon, once released, answers DEADLINE_EXCEEDED to nobody; still serving.
        assert client.ask(PROMPT, image=img, timeout_s=30).text == results[0].text  # type: ignore[attr-defined]


def test_concurrent_asks_are_matched_by_correlation_data(start_daemon, mosquitto, tiny_engine) -> None:
    start_daemon(queue_max_size=16)
    images = [_image(10 + i) for i in range(6)]
    expected = [tiny_engine.ask(im, PROMPT, max_new_tokens=4).text for im in images]
    assert len(set(expected)) > 1  # different images give different answers, so a mix-up shows
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:

        def worker(i: int) -> None:
            try:
                got[i] = client.ask(PROMPT, image=images[i], timeout_s=60).text
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(images))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(len(images))] == expected


def test_context_manager_closes_the_connection(start_daemon, mosquitto, wait_until) -> None:
    start_daemon()
    with Client(mosquitto.host, mosquitto.port, "dev1", client_id="sdk-cm-test") as client:
        assert client.connected
        paho = client._client
    assert not paho.is_connected()
    assert paho._thread is None  # network thread stopped
    with pytest.raises(ClientClosedError, match="^the client is closed"):
        client.ask(PROMPT, source="x")
    client.close()  # idempotent
    # the broker writes its log line after it has processed the DISCONNECT: poll, don't race it
    wait_until(lambda: "Client sdk-cm-test disconnected" in mosquitto.log(), timeout_s=10,
               what="the broker logging the disconnect")


def test_closed_client_raises_client_closed_not_broker_unreachable(start_daemon, mosquitto) -> None:
    """ask/request on a closed client raised a bare ConnectionError('the client is closed'), outside the SDK's
    typed errors; an ask waiting when another thread closed the client the same. Now ClientClosedError: an
    EdgeVLMError and still the ConnectionError the SDK documents, but not BrokerUnreachableError (the broker is
    reachable: a loop waiting for it to come back would wait for ever)."""
    daemon = start_daemon()
    client = Client(mosquitto.host, mosquitto.port, "dev1")
    with daemon.scheduler.paused():  # the ask waits for its answer while the client is closed
        closer = threading.Timer(0.3, client.close)
        closer.start()
        with pytest.raises(ClientClosedError) as waiting:
            client.ask(PROMPT, image=_image(2), timeout_s=30)
        closer.join()
    assert str(waiting.value) == "the client was closed while waiting for a response"
    for call in (lambda: client.ask(PROMPT, source="x"), lambda: client.request(b"{}")):
        with pytest.raises(ClientClosedError) as info:
            call()
        assert str(info.value) == "the client is closed (after close() or its with block): make a new Client"
        assert isinstance(info.value, ConnectionError) and isinstance(info.value, edgevlm.EdgeVLMError)
        assert not isinstance(info.value, BrokerUnreachableError)


def test_client_survives_broker_restart(start_daemon, mosquitto, tiny_engine, wait_until) -> None:
    daemon = start_daemon()
    img = _image(5)
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        first = client.ask(PROMPT, image=img, timeout_s=30).text
        mosquitto.restart()
        # The daemon's second connection is subscribed (its flag is cleared on the drop, set on
        # SUBACK). A request the client publishes before it noticed the drop is re-sent by paho after
        # its reconnect, behind its own re-subscription.
        wait_until(
            lambda: daemon.counters.get("mqtt_connects") == 2 and daemon.bridge.wait_ready(0) and client.connected,
            timeout_s=30,
            what="both to reconnect",
        )
        assert client.ask(PROMPT, image=img, timeout_s=30).text == first


@pytest.mark.parametrize("timeout_s", [0.3, 1.5])
def test_timeouts_are_exact(start_daemon, mosquitto, timeout_s) -> None:
    daemon = start_daemon()
    with Client(mosquitto.host, mosquitto.port, "dev1") as client, daemon.scheduler.paused():
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="daemon status: online"):
            client.ask(PROMPT, image=_image(1), timeout_s=timeout_s)
        took = time.monotonic() - start
    assert timeout_s <= took < timeout_s + 0.08, took


def test_broker_down_is_broker_unreachable_within_the_timeout(start_daemon, mosquitto) -> None:
    start_daemon()
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        assert client.wait_online(10)
        mosquitto.stop()
        start = time.monotonic()
        with pytest.raises(BrokerUnreachableError, match=f"broker at 127.0.0.1:{mosquitto.port} is unreachable") as info:
            client.ask(PROMPT, image=_image(1), timeout_s=1.0)
        took = time.monotonic() - start
        assert isinstance(info.value, ConnectionError) and "daemon status" not in str(info.value)
    assert 1.0 <= took < 1.1, took


@pytest.mark.parametrize("pool", [None, "gpu"])
def test_wait_online_is_false_while_the_broker_is_down_not_a_stale_online(start_daemon, mosquitto, wait_until,
                                                                          pool) -> None:  # fmt: skip
    """wait_online returned True, and device_status (pool_members) the last "online", while the broker was
    down: the status seen before the connection was lost, so a robot's health check read a daemon it
    could not reach as online. The status is known again once the broker sends it on the new connection."""
    start_daemon(device_id="m1", mqtt={"pool": pool} if pool else None)
    target = {"pool": pool} if pool else {"device_id": "m1"}
    with Client(mosquitto.host, mosquitto.port, **target) as client:
        assert client.wait_online(10) is True and client.device_status.state == "online"
        assert list(client.pool_members) == (["m1"] if pool else [])
        mosquitto.stop(kill=True)  # a crash: no last will is sent, the client's last status is "online"
        wait_until(lambda: not client.connected, timeout_s=10, what="the client to see the broker gone")
        start = time.monotonic()
        assert client.wait_online(0.3) is False
        assert 0.3 <= time.monotonic() - start < 0.5
        assert client.device_status is None and client.pool_members == {}
        mosquitto.start(port=mosquitto.port)
        assert client.wait_online(30) is True  # the daemon's "online" on the new connection
        assert client.connected and client.device_status.state == "online"
        assert list(client.pool_members) == (["m1"] if pool else [])


def test_unanswered_request_is_resent_until_answered_and_answered_once(start_daemon, mosquitto, tiny_engine) -> None:
    # The daemon holds the request (worker paused) while the client re-sends it every 0.2 s: the
    # copies are absorbed, the engine runs it once, and ask returns one answer.
    daemon = start_daemon()
    img = _image(4)
    with Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=0.2) as client:
        got: list[object] = []
        with daemon.scheduler.paused():
            t = threading.Thread(target=lambda: got.append(client.ask(PROMPT, image=img, timeout_s=30)))
            t.start()
            deadline = time.monotonic() + 20
            while daemon.counters.get("duplicate_in_flight") < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        t.join(30)
        assert [a.text for a in got] == [tiny_engine.ask(img, PROMPT, max_new_tokens=4).text]  # type: ignore[attr-defined]
        assert client.resends >= 3
    assert daemon.counters.get("responses_ok") == 1


def test_a_request_asked_while_the_broker_is_down_is_resent_periodically_once_sent(start_daemon, mosquitto,
                                                                                     tiny_engine, wait_until) -> None:  # fmt: skip
    """An ask made while the broker was down was sent on the reconnect and then never again: its wait slept to the
    deadline, so a first copy lost (a daemon not yet back on a restarted broker) ended in DeadlineExceededError
    although the daemon was online again. Here the worker holds the request: the periodic copies reach it."""
    daemon = start_daemon()
    img = _image(9)
    with Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=0.2) as client:
        assert client.wait_online(10)
        got: list[object] = []
        with daemon.scheduler.paused():
            mosquitto.stop(kill=True)
            wait_until(lambda: not client.connected, timeout_s=10, what="the client to see the broker gone")
            t = threading.Thread(target=lambda: got.append(client.ask(PROMPT, image=img, timeout_s=30)))
            t.start()
            mosquitto.start(port=mosquitto.port)
            wait_until(lambda: daemon.scheduler.queue_size() == 1, timeout_s=15, what="the first copy queued")
            # 0.2, 0.4, 0.8 s after it: 3 copies, absorbed while it waits (at most 1 from the reconnect itself)
            copies = lambda: daemon.counters.get("duplicate_in_flight")  # noqa: E731
            wait_until(lambda: copies() >= 4, timeout_s=5, what="periodic copies")
        t.join(30)
        assert [a.text for a in got] == [tiny_engine.ask(img, PROMPT, max_new_tokens=4).text]  # type: ignore[attr-defined]
    assert daemon.counters.get("responses_ok") == 1


def test_a_request_sent_before_the_daemon_is_back_on_a_restarted_broker_is_resent_when_it_says_online(
    start_daemon, mosquitto, tiny_engine, wait_until
) -> None:
    """The broker restarts; the client is back first and sends the request, which no daemon is subscribed to
    receive. The daemon's "online" when it is back (live, not the retained one) now sends it again; it was
    taken for no news (the client's last status was an "online" from before the restart), so with the
    periodic copies off the ask waited to its deadline."""
    daemon = start_daemon(mqtt={"reconnect_min_delay_s": 3.0, "reconnect_max_delay_s": 3.0})  # client: 1 s
    img = _image(10)
    with Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=None) as client:
        assert client.wait_online(10)
        got: list[object] = []
        mosquitto.stop(kill=True)
        wait_until(lambda: not client.connected, timeout_s=10, what="the client to see the broker gone")
        start = time.monotonic()
        t = threading.Thread(target=lambda: got.append(client.ask(PROMPT, image=img, timeout_s=15)))
        t.start()
        mosquitto.start(port=mosquitto.port)
        wait_until(lambda: client.connected, timeout_s=10, what="the client back")
        assert not daemon.bridge.wait_ready(0)  # its copy went out with no daemon subscribed
        t.join(20)
        assert [a.text for a in got] == [tiny_engine.ask(img, PROMPT, max_new_tokens=4).text]  # type: ignore[attr-defined]
        assert time.monotonic() - start < 10 and client.resends == 1
    assert daemon.counters.get("responses_ok") == 1


def test_answer_lost_in_a_broker_restart_is_recovered_by_the_resend(start_daemon, mosquitto, tiny_engine,
                                                                     wait_until) -> None:  # fmt: skip
    # The answer is published while the client is still reconnecting (nobody subscribed): lost on
    # the wire. The client re-sends on reconnect; the daemon answers from its recent-answers cache.
    daemon = start_daemon()
    img = _image(6)
    with Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=None) as client:
        got: list[object] = []
        with daemon.scheduler.paused():
            t = threading.Thread(target=lambda: got.append(client.ask(PROMPT, image=img, timeout_s=60)))
            t.start()
            wait_until(lambda: daemon.scheduler.queue_size() == 1, what="the request queued")
            mosquitto.restart()
            wait_until(lambda: daemon.bridge.wait_ready(0), timeout_s=20, what="the daemon to reconnect")
            client_back_first = client.connected
        t.join(60)
        assert [a.text for a in got] == [tiny_engine.ask(img, PROMPT, max_new_tokens=4).text]  # type: ignore[attr-defined]
        assert 1 <= client.resends <= 2  # on its reconnect (and when the status turned online again)
    assert daemon.counters.get("responses_ok") == 1  # never run twice
    if not client_back_first:  # the usual order: the daemon reconnects in 0.2 s, the client in 1 s
        # every copy that arrived after the answer was answered from the cache (1 or 2 copies)
        assert 1 <= daemon.counters.get("duplicate_answered") <= client.resends


def test_request_held_by_a_daemon_that_died_is_resent_when_it_is_back_online(start_daemon, mosquitto, tiny_engine,
                                                                             wait_until) -> None:  # fmt: skip
    # The first daemon takes the request and goes away without answering (its last will says
    # offline); the client stays connected and re-sends when the next daemon's status says online.
    first = start_daemon(device_id="dev1", mqtt={"session_expiry_s": 0})
    img = _image(8)
    with Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=None) as client:
        assert client.wait_online(10)
        got: list[object] = []
        with first.scheduler.paused():
            t = threading.Thread(target=lambda: got.append(client.ask(PROMPT, image=img, timeout_s=60)))
            t.start()
            wait_until(lambda: first.scheduler.queue_size() == 1, what="the request queued")
            first.bridge._client.loop_stop()  # the daemon stops talking to the broker: no answer, no DISCONNECT
            first.bridge._client.socket().close()
            wait_until(lambda: client.device_status is not None and client.device_status.state == "offline",
                       timeout_s=60, what="the last will")  # fmt: skip
            second = start_daemon(device_id="dev1")
            t.join(60)
        assert [a.text for a in got] == [tiny_engine.ask(img, PROMPT, max_new_tokens=4).text]  # type: ignore[attr-defined]
        assert client.resends == 1 and client.connected
    assert second.counters.get("responses_ok") == 1


# the daemon as a process whose requests are slow: it says when one is taken (QUEUED <queue size>) and when
# one starts (RUNNING), then runs it after SLOW_S, so a second one waits in the queue while the first runs
SLOW_S = 1.5
RUN_SLOW_REQUESTS = (
    "import sys, time; from edgevlm.daemon.scheduler import Scheduler; submit, generate = Scheduler.submit, "
    "Scheduler._generate; Scheduler.submit = lambda self, job: (taken := submit(self, job), print('QUEUED' "
    "if taken else 'REFUSED', self.queue_size(), flush=True))[0]; "
    "Scheduler._generate = lambda self, job, started: "
    f"(print('RUNNING', flush=True), time.sleep({SLOW_S}), generate(self, job, started))[2]; "
    "from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; "
    "sys.exit(run(load_daemon_config(sys.argv[1])))"
)


def test_a_request_queued_when_the_daemon_gets_sigterm_is_resent_to_the_restarted_daemon(
    start_daemon, mosquitto, tiny_engine, tiny_model_dir, tmp_path, wait_until
) -> None:
    """``systemctl restart edgevlm``: the daemon answers what is still queued BUSY "shutting down"; the SDK
    raised that BusyError, while after a ``kill -9`` it re-sends the request to the restarted daemon: a clean
    restart was worse for clients than a crash. Now the BUSY says ``details.reason`` ``shutting_down`` and the
    SDK keeps the request, re-sent when the next daemon's status says "online"."""
    import subprocess
    import sys

    import yaml
    from process_support import reaped, stop

    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1"},
           "model": {"path": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
           "defaults": {"max_new_tokens": 4, "timeout_ms": 60000}}  # fmt: skip
    (tmp_path / "daemon.yaml").write_text(yaml.safe_dump(cfg))
    images = [_image(20), _image(21)]
    expected = [tiny_engine.ask(im, PROMPT, max_new_tokens=4).text for im in images]
    got: dict[int, object] = {}

    def ask(i: int) -> None:
        try:
            got[i] = client.ask(PROMPT, image=images[i], timeout_s=30).text
        except Exception as exc:  # noqa: BLE001 - asserted below
            got[i] = exc

    proc = subprocess.Popen([sys.executable, "-c", RUN_SLOW_REQUESTS, str(tmp_path / "daemon.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    with reaped(proc), Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=None) as client:
        lines: list[bytes] = []

        def read_until(marker: bytes) -> None:
            while not lines or not lines[-1].startswith(marker):
                lines.append(proc.stdout.readline())
                assert lines[-1], b"".join(lines).decode(errors="replace")

        assert client.wait_online(60)
        running = threading.Thread(target=ask, args=(0,))
        running.start()
        read_until(b"RUNNING")
        queued = threading.Thread(target=ask, args=(1,))
        queued.start()
        read_until(b"QUEUED 1")  # waits behind the running one
        out, _ = stop(proc)
        assert proc.returncode == 0, out.decode(errors="replace")
        running.join(10)
        assert got == {0: expected[0]}  # the running one finished within service.shutdown_timeout_s
        wait_until(lambda: client.device_status is not None and client.device_status.state == "offline",
                   what="the daemon's offline")  # fmt: skip
        assert queued.is_alive() and client.shutdown_busy_held == 1  # BUSY shutting_down (before it), kept
        restarted = start_daemon(device_id="dev1")
        queued.join(20)
        assert got == {0: expected[0], 1: expected[1]}  # not a BusyError
        assert client.resends == 1  # re-sent once, on the restarted daemon's "online"
    assert restarted.counters.get("responses_ok") == 1


def test_a_busy_shutting_down_is_kept_to_the_deadline_and_a_full_queue_busy_raised_at_once(
    start_daemon, mosquitto
) -> None:
    """A full queue's BUSY (``details.reason`` ``queue_full``) still raises BusyError at once; a request the
    daemon answers BUSY ``shutting_down`` waits for it to be back online, and when it is not back by the
    deadline, the DeadlineExceededError says so."""
    daemon = start_daemon(queue_max_size=1)
    img = _image(22)
    with Client(mosquitto.host, mosquitto.port, "dev1", resend_interval_s=None) as client:
        got: list[object] = []
        with daemon.scheduler.paused():
            asked = lambda: got.append(_raised(client.ask, PROMPT, image=img, timeout_s=2))  # noqa: E731
            waiter = threading.Thread(target=asked)
            waiter.start()
            while daemon.scheduler.queue_size() < 1:
                assert waiter.is_alive()
                waiter.join(0.005)
            start = time.monotonic()
            with pytest.raises(BusyError, match="^queue full") as info:
                client.ask(PROMPT, image=img, timeout_s=10)
            assert time.monotonic() - start < 1.0
            assert info.value.details == {"reason": "queue_full", "queue_max_size": 1}
            daemon.stop()  # answers the queued one BUSY shutting_down
            waiter.join(5)
        assert client.shutdown_busy_held == 1
        [err] = got
        assert isinstance(err, DeadlineExceededError), err
        assert str(err) == ("no response from device 'dev1' within 2 s (daemon status: offline; request "
                            "sent 1 time(s); it answered BUSY: shutting down, and was not back online in time)")
        assert err.details["shutting_down"] is True


def _raised(fn, *args, **kwargs) -> object:
    """``fn(*args, **kwargs)``, or the exception it raised."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the caller asserts it
        return exc


def test_wait_online_timeout_nan_none_and_inf_neither_hang_nor_crash(mosquitto) -> None:
    """wait_online(float("nan")) waited for ever on a daemon that was not online (NaN <= 0 is False, and the
    condition's wait(nan) never returns), wait_online(float("inf")) raised OverflowError and wait_online(None)
    a TypeError from deep inside, while its docstring said "never raises". Now NaN (or a string) is refused by
    name, None and inf wait until the status says online, and the client stays usable."""
    import subprocess

    with Client(mosquitto.host, mosquitto.port, "nobody-here") as client:
        for bad in (float("nan"), "5", True):
            with pytest.raises(InvalidRequestError, match=r"^timeout_s must be a number of seconds or None, got "):
                client.wait_online(bad)
        start = time.monotonic()
        assert client.wait_online(0) is False and client.wait_online(-1) is False
        assert client.wait_online(0.2) is False
        assert time.monotonic() - start < 1.0
        status = '{"schema_version": 1, "state": "online", "device_id": "nobody-here"}'
        threading.Timer(0.3, subprocess.run, (["mosquitto_pub", "-h", mosquitto.host, "-p", str(mosquitto.port),
                                               "-t", "edgevlm/nobody-here/status", "-m", status, "-q", "1"],),
                        {"check": True}).start()
        for forever in (None, float("inf"), 1e30):
            done: list[bool] = []
            waiter = threading.Thread(target=lambda f=forever, out=done: out.append(client.wait_online(f)),
                                      daemon=True)
            waiter.start()
            waiter.join(5)
            assert done == [True], forever
