"""``edgevlm doctor``'s ``broker`` row: :func:`mqtt_probe`, a real MQTT v5 CONNECT/CONNACK exchange
with the broker. See :mod:`edgevlm.daemon.doctor`."""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import struct
import time
from typing import Any

from edgevlm.daemon.doctor_host import CheckResult, _fail, _ok, _warn

_CONNACK_REASONS = {
    0x80: "unspecified error", 0x81: "malformed packet", 0x82: "protocol error", 0x84: "unsupported protocol version",
    0x85: "client identifier not valid", 0x86: "bad user name or password", 0x87: "not authorized",
    0x88: "server unavailable", 0x89: "server busy", 0x8A: "banned", 0x8C: "bad authentication method",
    0x95: "packet too large", 0x97: "quota exceeded", 0x9F: "connection rate exceeded",
}  # fmt: skip


def _mqtt_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the server")
        buf += chunk
    return buf


DELAYED_ACK_SIGNATURE_MS = 30.0
"""A QoS 1 publish that comes back through the broker this late (median of the probes) carries the
signature of Nagle's algorithm in the broker meeting the client's delayed ACK (40 ms on Linux)."""

PUBLISH_PROBES = 5


def _read_packet(sock: socket.socket, expect: int | None = None) -> tuple[int, bytes]:
    """One MQTT control packet: ``(first byte, body)`` (spec §2.1, remaining length §1.5.5).
    With ``expect`` (a packet type), a first byte of another type is returned at once with an
    empty body (a server that is not an MQTT broker is named by its first byte)."""
    first = _recv_exact(sock, 1)[0]
    if expect is not None and first >> 4 != expect:
        return first, b""
    length, shift = 0, 0
    while True:
        byte = _recv_exact(sock, 1)[0]
        length += (byte & 0x7F) << shift
        if not byte & 0x80 or shift > 21:
            break
        shift += 7
    return first, _recv_exact(sock, length)


def _subscribe(sock: socket.socket, topic: str) -> None:
    sub = struct.pack("!H", 1) + _varint(0) + _mqtt_str(topic) + bytes([0x01])  # QoS 1, no options
    sock.sendall(bytes([0x82]) + _varint(len(sub)) + sub)
    while _read_packet(sock)[0] >> 4 != 9:  # SUBACK (spec §3.9)
        pass


def _publish(sock: socket.socket, topic: str, packet_id: int, payload: bytes) -> None:
    body = _mqtt_str(topic) + struct.pack("!H", packet_id) + _varint(0) + payload
    sock.sendall(bytes([0x32]) + _varint(len(body)) + body)  # PUBLISH, QoS 1 (spec §3.3)


def _await_publish(sock: socket.socket) -> None:
    """Read packets until a PUBLISH arrives; acknowledge it (PUBACK, spec §3.4)."""
    while True:
        first, data = _read_packet(sock)
        if first >> 4 == 3:
            if first & 0x06:
                tlen = struct.unpack("!H", data[:2])[0]
                sock.sendall(b"\x40\x02" + data[2 + tlen:4 + tlen])
            return


def request_response_ms(requester: socket.socket, responder: socket.socket, *, probes: int = PUBLISH_PROBES) -> float:
    """Median MQTT v5 request/response round trip (ms) through the broker between two connected
    sockets, the way edgevlm's SDK talks to the daemon but without its work-arounds: the requester
    publishes QoS 1 on a random request topic, the responder answers QoS 1 at once on a random
    response topic. ``TCP_NODELAY`` is set on both and delayed ACKs are left on, so a broker that
    keeps Nagle's algorithm on shows its stall (the answer held behind the request's PUBACK).

    Raises:
        ConnectionError, OSError: the broker closed a connection or did not answer in time.
    """
    for sock in (requester, responder):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req_topic, resp_topic = (f"edgevlm-doctor/{secrets.token_hex(6)}" for _ in range(2))
    _subscribe(responder, req_topic)
    _subscribe(requester, resp_topic)
    times = []
    for i in range(probes):
        t0 = time.perf_counter()
        _publish(requester, req_topic, 2 + i, b"q" * 64)
        _await_publish(responder)
        _publish(responder, resp_topic, 2 + i, b"a" * 64)
        _await_publish(requester)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2]


class _ProbeError(Exception):
    """A probe step failed; the message is the row's detail (after ``host:port: ``)."""


def _connect(host: str, port: int, timeout_s: float, username: str | None, password: str | None,
             tls: Any) -> tuple[socket.socket, socket.socket, float]:
    """TCP (+ TLS) connect, MQTT 5.0 CONNECT (spec §3.1) with a random client id (never the
    daemon's, which would take its session over), read the CONNACK (§3.2). Returns ``(mqtt socket,
    raw socket, CONNACK round trip ms)``; raises :class:`_ProbeError` naming the reason."""
    flags = 0x02  # clean start
    payload = _mqtt_str(f"edgevlm-doctor-{secrets.token_hex(4)}")
    if username is not None:
        flags |= 0x80
        payload += _mqtt_str(username)
        if password is not None:
            flags |= 0x40
            payload += _mqtt_str(password)
    var = _mqtt_str("MQTT") + bytes([5, flags]) + struct.pack("!H", 10) + _varint(0)
    packet = bytes([0x10]) + _varint(len(var) + len(payload)) + var + payload
    t0 = time.perf_counter()
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise _ProbeError(f"cannot connect: {exc.strerror or exc}") from None
    try:
        sock: socket.socket = raw
        if tls is not None:
            ctx = ssl.create_default_context(cafile=str(tls.ca_certs) if tls.ca_certs else None)
            if tls.certfile:
                ctx.load_cert_chain(str(tls.certfile), str(tls.keyfile) if tls.keyfile else None)
            if tls.insecure:
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            sock = ctx.wrap_socket(raw, server_hostname=host)
        sock.settimeout(timeout_s)
        sock.sendall(packet)
        first, body = _read_packet(sock, expect=2)
        if first >> 4 != 2:
            raise _ProbeError(f"not an MQTT broker (first reply byte 0x{first:02x})")
        rtt_ms = (time.perf_counter() - t0) * 1000
        code = body[1] if len(body) >= 2 else 0xFF
        if len(body) == 2 and code in (1, 2, 3, 4, 5):  # an MQTT 3.1.1 CONNACK return code
            if code == 1:
                raise _ProbeError("the broker does not speak MQTT v5 (3.1.1 only)")
            raise _ProbeError(f"connection refused (MQTT 3.1.1 return code {code})")
        if code != 0:
            raise _ProbeError(f"CONNACK {_CONNACK_REASONS.get(code, f'reason 0x{code:02x}')}")
        return sock, raw, rtt_ms
    except ssl.SSLError as exc:
        raw.close()
        raise _ProbeError(f"TLS handshake failed: {exc.reason or exc}") from None
    except (OSError, ConnectionError) as exc:
        raw.close()
        raise _ProbeError(f"no MQTT answer: {exc}") from None
    except _ProbeError:
        raw.close()
        raise


def mqtt_probe(
    host: str,
    port: int,
    *,
    timeout_s: float = 3.0,
    username: str | None = None,
    password: str | None = None,
    tls: Any = None,
) -> CheckResult:
    """Connect to an MQTT broker twice (MQTT 5.0 CONNECT/CONNACK, random client ids), measure a
    QoS 1 request/response round trip between the two connections
    (:func:`request_response_ms`), disconnect.

    ``tls`` is a config object with ``ca_certs``, ``certfile``, ``keyfile``, ``insecure`` (or None).
    Returns a ``broker`` row: OK with the CONNACK and request/response times in ms; WARN when the
    round trip shows the delayed-ACK signature (:data:`DELAYED_ACK_SIGNATURE_MS`), naming the
    broker setting that removes it; FAIL naming the reason.
    """
    check, where = "broker", f"{host}:{port}"
    opened: list[socket.socket] = []
    try:
        sock, raw, rtt_ms = _connect(host, port, timeout_s, username, password, tls)
        opened.append(raw)
        secure = ", TLS" if tls is not None else ""
        summary = f"{where}: MQTT v5 CONNACK in {rtt_ms:.1f} ms{secure}"
        try:
            other, other_raw, _ = _connect(host, port, timeout_s, username, password, tls)
            opened.append(other_raw)
            rr_ms = request_response_ms(sock, other)
        except (_ProbeError, OSError, ConnectionError) as exc:  # e.g. an ACL that refuses the probe topics
            return _ok(check, f"{summary} (request/response round trip not measured: {exc})")
        for s in (sock, other):
            with contextlib.suppress(OSError):
                s.sendall(b"\xe0\x00")  # DISCONNECT, normal
        summary += f", QoS 1 request/response round trip {rr_ms:.1f} ms"
        if rr_ms >= DELAYED_ACK_SIGNATURE_MS:
            return _warn(check, f"{summary}: the delayed-ACK signature of Nagle's algorithm in the broker; add "
                         "'set_tcp_nodelay true' to mosquitto.conf (edgevlm's SDK and daemon avoid most of the "
                         "stall with TCP_QUICKACK on Linux; other clients of this broker do not)")
        return _ok(check, summary)
    except _ProbeError as exc:
        return _fail(check, f"{where}: {exc}")
    finally:
        for r in opened:
            r.close()
