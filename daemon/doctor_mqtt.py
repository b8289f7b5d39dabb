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

from edgevlm.daemon.doctor_host import CheckResult, _fail, _ok

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


def mqtt_probe(
    host: str,
    port: int,
    *,
    timeout_s: float = 3.0,
    username: str | None = None,
    password: str | None = None,
    tls: Any = None,
) -> CheckResult:
    """Connect to an MQTT broker, send an MQTT 5.0 CONNECT (spec §3.1) with a random client id
    (never the daemon's, which would take its session over), read the CONNACK (§3.2), disconnect.

    ``tls`` is a config object with ``ca_certs``, ``certfile``, ``keyfile``, ``insecure`` (or None).
    Returns a ``broker`` row: OK with the round trip in ms, or FAIL naming the reason.
    """
    check, where = "broker", f"{host}:{port}"
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
        return _fail(check, f"{where}: cannot connect: {exc.strerror or exc}")
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
        head = _recv_exact(sock, 2)
        if head[0] >> 4 != 2:
            return _fail(check, f"{where}: not an MQTT broker (first reply byte 0x{head[0]:02x})")
        length, shift, byte = 0, 0, head[1]
        while True:  # remaining length: variable byte integer (spec §1.5.5)
            length += (byte & 0x7F) << shift
            if not byte & 0x80 or shift > 21:
                break
            shift += 7
            byte = _recv_exact(sock, 1)[0]
        body = _recv_exact(sock, length)
        rtt_ms = (time.perf_counter() - t0) * 1000
        code = body[1] if len(body) >= 2 else 0xFF
        if length == 2 and code in (1, 2, 3, 4, 5):  # an MQTT 3.1.1 CONNACK return code
            if code == 1:
                return _fail(check, f"{where}: the broker does not speak MQTT v5 (3.1.1 only)")
            return _fail(check, f"{where}: connection refused (MQTT 3.1.1 return code {code})")
        if code != 0:
            return _fail(check, f"{where}: CONNACK {_CONNACK_REASONS.get(code, f'reason 0x{code:02x}')}")
        with contextlib.suppress(OSError):
            sock.sendall(b"\xe0\x00")  # DISCONNECT, normal
        secure = ", TLS" if tls is not None else ""
        return _ok(check, f"{where}: MQTT v5 CONNACK in {rtt_ms:.1f} ms{secure}")
    except ssl.SSLError as exc:
        return _fail(check, f"{where}: TLS handshake failed: {exc.reason or exc}")
    except (OSError, ConnectionError) as exc:
        return _fail(check, f"{where}: no MQTT answer: {exc}")
    finally:
        raw.close()
