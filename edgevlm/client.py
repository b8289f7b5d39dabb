"""The Python SDK: ask an edgevlm daemon questions over MQTT v5 request/response.

    >>> with edgevlm.Client("localhost", 1883, "robot-1") as client:
    ...     answer = client.ask("How many red objects?", source="front", timeout_s=5)
    ...     print(answer.text, answer.stats.e2e_ms, answer.frame_ts)

Each request carries the client's own Response Topic (``<prefix>/<device_id>/response/<token>``)
and 16 random bytes of Correlation Data (MQTT v5 section 4.10); the reply is matched by those bytes,
so one client may be used by many threads at once. Wire errors are raised as the typed
exceptions of :mod:`edgevlm.errors` (``BUSY`` -> :class:`~edgevlm.errors.BusyError`, ...).

Delivery: a request whose answer has not come is published again, with the same payload and the
same Correlation Data, after every reconnect, when the daemon's retained status turns "online" again
(a restarted daemon), and after ``resend_interval_s``, doubling up to ``4 * resend_interval_s``
between periodic copies, until its deadline;
the daemon answers a repeat from its recent-answers cache (or ignores it while the first copy runs),
and the first answer is returned, later copies are dropped: exactly one answer per ``ask``. Every
copy carries the MQTT v5 *Message Expiry Interval* of the time left (whole seconds, rounded up), so
a broker or daemon that holds it longer drops it instead of running it after the caller gave up.
A daemon that stops cleanly (SIGTERM, a restart) answers what it still holds ``BUSY`` with
``details.reason`` ``"shutting_down"``: that answer is not delivered, the request is kept and re-sent when
the daemon says "online" again (as after a crash), until its deadline; a full queue's ``BUSY``
(``"queue_full"``) is raised at once. In pool mode every ``BUSY`` is retried on the pool.

``ask`` returns or raises within ``timeout_s`` (to a few ms): no answer by then raises
:class:`~edgevlm.errors.DeadlineExceededError` when the broker is connected, and
:class:`~edgevlm.errors.BrokerUnreachableError` (a :class:`ConnectionError`) naming the cause when
it is not; the constructor raises it too when the broker cannot be reached.

Torch-free and OpenCV-free: numpy images are sent as PNG, encoded here with zlib.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgevlm.errors import (
    SHUTTING_DOWN,
    BrokerUnreachableError,
    ClientClosedError,
    DeadlineExceededError,
    EdgeVLMError,
    InternalError,
    InvalidImageError,
    InvalidRequestError,
)
from edgevlm.protocol import (
    DEFAULT_PREFIX,
    NO_DEADLINE_MS,
    StatusMessage,
    default_device_id,
    parse_request,
    parse_response,
    pool_request_topic,
    pool_response_topic,
    request_topic,
    response_topic,
    status_filter,
    status_topic,
)
from edgevlm.types import Answer, plain_scalar

logger = logging.getLogger(__name__)

CORRELATION_DATA_BYTES = 16

RESEND_INTERVAL_S = 2.0
"""Default period (s) after which an unanswered request is published again."""

POOL_BUSY_RETRY_S = 0.05
"""Pool mode: a member's BUSY answer (queue full, shutting down) is not delivered; the request is
published again to the pool after this delay (the broker hands it to another member) until its
deadline."""

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_PREVIEW_BYTES = 32
"""How many bytes a server sent before (instead of) a CONNACK are quoted in the error that says it is
not an MQTT broker."""


# ------------------------------------------------------------------------------------------ PNG


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def encode_png(image: np.ndarray, *, level: int = 1) -> bytes:
    """Encode an image as PNG (W3C PNG specification, 2nd edition: IHDR/IDAT/IEND, filter 0).

    Args:
        image: ``(H, W)`` grey, ``(H, W, 1)`` grey, ``(H, W, 2)`` grey+alpha, ``(H, W, 3)`` RGB or
            ``(H, W, 4)`` RGBA; dtype uint8 (8-bit PNG) or uint16 (16-bit PNG).
        level: zlib compression level 0..9.

    Raises:
        InvalidImageError: unsupported shape or dtype, or an empty image.
    """
    arr = np.asarray(image)
    if arr.dtype not in (np.uint8, np.uint16):
        raise InvalidImageError(f"image array must be uint8 or uint16, got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 2, 3, 4):
        raise InvalidImageError(
            f"image array must be (H, W), (H, W, 1|2|3|4), got shape {tuple(image.shape)}"
        )
    h, w, c = arr.shape
    if h == 0 or w == 0 or h > 2**31 - 1 or w > 2**31 - 1:
        raise InvalidImageError(f"image array has an invalid size {w}x{h}")
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    bit_depth = 16 if arr.dtype == np.uint16 else 8
    raw = np.ascontiguousarray(arr.astype(">u2") if bit_depth == 16 else arr)
    rows = raw.view(np.uint8).reshape(h, w * c * (bit_depth // 8))
    scanlines = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1)  # filter type 0 per row
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    return (
        _PNG_SIGNATURE
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(scanlines.tobytes(), level))
        + _png_chunk(b"IEND", b"")
    )


def image_to_bytes(image: np.ndarray | bytes | bytearray | memoryview | str | os.PathLike[str]) -> bytes:
    """An image argument of :meth:`Client.ask` as encoded file bytes: a numpy array (RGB, see
    :func:`encode_png`), bytes of a JPEG/PNG/BMP/WebP file (sent as they are), or a file path.

    Raises:
        InvalidImageError: bad array, unreadable file, empty data, or another type.
    """
    if isinstance(image, np.ndarray):
        return encode_png(image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif isinstance(image, (str, os.PathLike)):
        try:
            data = Path(image).read_bytes()
        except OSError as exc:
            raise InvalidImageError(f"cannot read image file {str(image)!r}: {exc.strerror or exc}") from None
    else:
        raise InvalidImageError(
            f"image must be a numpy array, encoded image bytes or a file path, got {type(image).__name__}"
        )
    if not data:
        raise InvalidImageError("image data is empty")
    return data


# --------------------------------------------------------------------------------------- client


def set_tcp_nodelay(client: Any, userdata: Any, sock: Any) -> None:
    """paho ``on_socket_open`` callback: turn off Nagle's algorithm (``TCP_NODELAY``) on the MQTT
    socket. paho leaves it on; then a small packet written while an earlier one is unacknowledged
    (a PUBACK followed by a request or response) waits for the peer's delayed ACK, up to 40 ms on
    Linux, which is a fifth of a 200 ms latency budget (RFC 896; RFC 1122 section 4.2.3.2)."""
    import socket

    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not a TCP socket (e.g. a proxy or unix socket): keep it as is
        pass


def request_quick_ack(client: Any, *_: Any) -> None:
    """Acknowledge what was just received at once (Linux ``TCP_QUICKACK`` on ``client``'s socket):
    called from paho's ``on_publish`` (a PUBACK arrived) and ``on_message`` (a PUBLISH arrived),
    i.e. on paho's network thread right after the read.

    Why: a broker that keeps Nagle's algorithm on (mosquitto without ``set_tcp_nodelay true``)
    holds its next small PUBLISH to us (the answer, or the next request) while its previous small
    packet (the PUBACK of our publish) is unacknowledged, and Linux delays that ACK by 40 ms when
    we have nothing to send: every answer would wait 40 ms in the broker. Setting the option sends a
    pending delayed ACK now; it is not sticky (the kernel returns to delayed ACKs by itself), hence
    once per received packet. A no-op where the option does not exist (macOS, Windows) or the socket
    is not TCP. Extra arguments (paho's callback signature) are ignored."""
    import socket

    opt = getattr(socket, "TCP_QUICKACK", None)
    sock = client.socket() if client is not None else None
    if opt is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, 1)
    except (OSError, AttributeError, ValueError):  # closed, not TCP, or a TLS wrapper without it
        pass


def describe_connect_error(exc: BaseException | None) -> str:
    """Why a connection attempt to an MQTT broker failed, in a few words (a TLS certificate
    failure, a refusal, name resolution, a timeout named as such)."""
    import socket
    import ssl

    if exc is None:
        return "unknown cause"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed: {exc.verify_message or exc.reason} (check the CA certificates)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (no broker listening on that port)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror or exc})"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


def _busy_reason(payload: bytes) -> str | None:
    """None when a response payload is not a ``BUSY`` error, else its ``details.reason`` (``"shutting_down"``,
    ``"queue_full"``; ``""`` when it gives none, as a daemon before it did). Read leniently: anything else is
    not BUSY."""
    try:
        error = json.loads(payload).get("error") or {}
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("code") != "BUSY":
        return None
    details = error.get("details")
    reason = details.get("reason") if isinstance(details, dict) else None
    return reason if isinstance(reason, str) else ""


@dataclass
class _Pending:
    """One request waiting for its answer: what to publish again, and the answer slot."""

    payload: bytes
    correlation: bytes
    deadline: float | None  # monotonic; None = no deadline
    event: threading.Event = field(default_factory=threading.Event)
    response: bytes | None = None
    error: BaseException | None = None
    sends: int = 0
    last_sent: float = 0.0
    shutting_down: bool = False  # the daemon answered BUSY "shutting_down": kept for the daemon back online


def tls_files_problem(ca_certs: str | None, certfile: str | None, keyfile: str | None) -> tuple[str, str] | None:
    """Why these TLS files cannot be used, as ``(argument, "<file>: <reason>")`` (``("ca_certs", "/x.crt: No such
    file or directory")``), or None: each is readable, ``ca_certs`` holds PEM certificates and ``certfile`` (with
    ``keyfile``) a certificate and its private key. The SDK's constructor and the daemon's start-up checks
    (``mqtt.tls``) use it."""
    import ssl

    for name, path in (("ca_certs", ca_certs), ("certfile", certfile), ("keyfile", keyfile)):
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                return name, f"{path}: {exc.strerror or exc}"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_certs is not None:
        try:
            ctx.load_verify_locations(ca_certs)
        except (ssl.SSLError, ValueError) as exc:
            return "ca_certs", f"{ca_certs}: not a PEM CA certificate ({exc})"
    if certfile is not None:
        try:
            ctx.load_cert_chain(certfile, keyfile)
        except (ssl.SSLError, ValueError) as exc:
            with_key = f" with keyfile {keyfile}" if keyfile is not None else ""
            return "certfile", f"{certfile}: cannot load the certificate and its key{with_key} ({exc})"
    return None


class Client:
    """MQTT v5 client of one edgevlm daemon (``device_id``).

    Args:
        host, port: the broker.
        device_id: the daemon's device id (its ``mqtt.device_id``); None (the default, without ``pool``):
            this host's default, the one a daemon on this host whose config gives none takes
            (:func:`~edgevlm.protocol.default_device_id`: the host name).
        prefix: topic prefix (the daemon's ``mqtt.prefix``).
        username, password: broker credentials.
        tls: use TLS (with ``ca_certs`` / ``certfile`` / ``keyfile``; ``tls_insecure`` skips the
            hostname check).
        client_id: MQTT client id; default: ``edgevlm-client-<random>``.
        keepalive_s: MQTT keepalive (s).
        qos: QoS of requests and of the response subscription.
        connect_timeout_s: how long the constructor waits for the connection and subscription.
        resend_interval_s: an unanswered request is published again (same Correlation Data) this
            long after it was sent, then after twice, then four times as long (the cap), until its
            deadline; also at once after every reconnect and when the daemon comes back online.
            None = only after reconnects and daemon restarts.
        pool: ask any member of this pool (the daemons with ``mqtt.pool``) instead of one device:
            requests go to ``<prefix>/pools/<pool>/request``, which the broker hands to one member
            (MQTT v5 shared subscription); a member that dies mid-request is covered by the
            re-sends, a member's BUSY answer is retried on the pool (:data:`POOL_BUSY_RETRY_S`),
            and each answer reaches the application once. Give ``device_id`` or ``pool``.

    Raises:
        BrokerUnreachableError: (a ``ConnectionError``) the broker is unreachable, refuses the
            connection, or does not answer within ``connect_timeout_s``; the message names the cause.
            A port that is not an MQTT broker (it closes the connection during CONNECT, or answers
            something other than a CONNACK, e.g. an HTTP server) is named as such as soon as the
            connection ends: ``"<host>:<port> did not answer as an MQTT broker: it answered CONNECT
            with b'HTTP/1.1 400 ...'..., not a CONNACK (an HTTP server?)"``; nothing is logged
            while the constructor runs (its error says it all).
        ValueError: ``port`` outside 1..65535, ``qos`` not 0/1/2, ``keepalive_s`` outside 0..65535,
            ``connect_timeout_s`` not > 0, both ``device_id`` and ``pool``.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 1883,
        device_id: str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        ca_certs: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        tls_insecure: bool = False,
        client_id: str | None = None,
        keepalive_s: int = 30,
        qos: int = 1,
        connect_timeout_s: float = 10.0,
        resend_interval_s: float | None = RESEND_INTERVAL_S,
        pool: str | None = None,
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos}")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:  # else "connection refused"
            raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
        if isinstance(keepalive_s, bool) or not isinstance(keepalive_s, int) or not 0 <= keepalive_s <= 65535:
            raise ValueError(f"keepalive_s must be an integer in 0..65535, got {keepalive_s!r}")
        if isinstance(connect_timeout_s, bool) or not isinstance(connect_timeout_s, (int, float)) \
                or not 0 < connect_timeout_s < float("inf"):
            raise ValueError(f"connect_timeout_s must be a positive number, got {connect_timeout_s!r}")
        if device_id is None and pool is None:  # the daemon's own default on this host
            device_id = default_device_id()
        self.host, self.port, self.device_id, self.prefix, self.qos = host, port, device_id or "", prefix, qos
        self._connect_timeout_s = connect_timeout_s
        if resend_interval_s is not None and not resend_interval_s > 0:
            raise ValueError(f"resend_interval_s must be > 0 or None, got {resend_interval_s!r}")
        self.resend_interval_s = resend_interval_s
        self.resends = 0  # requests published again (reconnects and re-send intervals)
        self.duplicates_dropped = 0  # answers to a request already answered (or given up on)
        self.busy_retries = 0  # pool mode: BUSY answers not delivered, the request sent to the pool again
        self.shutdown_busy_held = 0  # device mode: BUSY "shutting_down" kept, re-sent when back online
        self._disconnected_at: float | None = None
        self._disconnect_cause = ""
        token = secrets.token_hex(8)
        if pool is not None and device_id:
            raise ValueError("give a device_id or a pool, not both")
        self.pool = pool
        self._target = f"pool {pool!r}" if pool is not None else f"device {device_id!r}"
        self._members: dict[str, StatusMessage] = {}  # pool mode: device id -> its last status
        try:
            if pool is None:
                self.request_topic = request_topic(prefix, device_id)
                self.status_topic = status_topic(prefix, device_id)
                self.response_topic = response_topic(prefix, device_id, token)
            else:  # any member of the pool (shared subscription); every daemon's status is watched
                self.request_topic = pool_request_topic(prefix, pool)
                self.status_topic = status_filter(prefix)
                self.response_topic = pool_response_topic(prefix, pool, token)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._status_cond = threading.Condition()
        self._status: StatusMessage | None = None
        self._ready = threading.Event()
        self._subscribed = threading.Event()
        self._connect_error: str | None = None
        self._closed = False
        self._constructing = True  # the constructor's error names the cause: nothing is logged until it returns
        self._loop_ended = False  # the network thread was told to end from inside (a failed first connection)
        self._connack = False  # whether the current connection has had its CONNACK
        self._preamble = bytearray()  # the bytes the server sent on this connection before any CONNACK

        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"edgevlm-client-{token}",
            protocol=mqtt.MQTTv5,
        )
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls:
            problem = tls_files_problem(ca_certs, certfile, keyfile)
            if problem is not None:  # paho's own error names neither the argument nor the file
                raise BrokerUnreachableError(f"cannot set up TLS for the MQTT broker at {host}:{port}: "
                                             f"{problem[0]} {problem[1]}", details={"host": host, "port": port})
            self._client.tls_set(ca_certs=ca_certs, certfile=certfile, keyfile=keyfile)
            self._client.tls_insecure_set(tls_insecure)
        self._client.reconnect_delay_set(1, 10)
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_disconnect = self._on_disconnect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_message = self._on_message
        self._client.on_publish = request_quick_ack  # PUBACK of a request read: ACK it now (see there)
        self._client.on_socket_open = self._on_socket_open
        self._record_preamble()
        self._client.connect_timeout = connect_timeout_s
        try:
            self._client.connect(host, port, keepalive=keepalive_s, clean_start=True)
        except (ConnectionResetError, BrokenPipeError):  # accepted, then closed while CONNECT was written
            raise BrokerUnreachableError(self._not_a_broker(), details={"host": host, "port": port}) from None
        except (OSError, ValueError) as exc:
            raise BrokerUnreachableError(
                f"cannot connect to the MQTT broker at {host}:{port}: {describe_connect_error(exc)}",
                details={"host": host, "port": port},
            ) from None
        self._client.loop_start()
        if not self._ready.wait(connect_timeout_s) or self._connect_error is not None:
            if self._connect_error is not None:
                message = self._connect_error
            elif not self._connack:  # connected over TCP, then silence: e.g. an HTTP server waiting for a line
                message = f"{host}:{port} did not answer as an MQTT broker: no CONNACK within {connect_timeout_s} s"
            else:
                message = (f"the MQTT broker at {host}:{port} did not acknowledge the response subscription "
                           f"within {connect_timeout_s} s")
            self.close()
            raise BrokerUnreachableError(message, details={"host": host, "port": port})
        self._constructing = False

    # ------------------------------------------------------------------ public API
    def ask(
        self,
        prompt: str,
        *,
        source: str | None = None,
        image: Any = None,
        timeout_s: float | None = 30.0,
        max_new_tokens: int | None = None,
        budget_ms: int | None = None,
        frames: int | None = None,
        frames_s: float | None = None,
        model: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        frame_seq: int | None = None,
    ) -> Answer:
        """Ask a question about the newest frame of ``source`` or about ``image``.

        Args:
            prompt: the question.
            source: a camera name configured in the daemon.
            image: ``(H, W, 3)`` uint8 RGB numpy array, encoded image bytes, or a file path.
            timeout_s: deadline (s) from the daemon's receipt; None = no deadline.
            max_new_tokens: cap on generated tokens (None = the daemon's default).
            budget_ms: latency budget for operating-point selection.
            frames: ask about the last N frames of ``source`` (1..32; the request's ``frames`` field).
            frames_s: ask about the frames of ``source`` from the last S seconds (the ``frames_s`` field;
                a window of more frames than the model takes is sampled evenly to its limit, see
                ``Answer.stats.window_frames``).
            model: the model to answer with (the ``model`` field; a daemon that does not serve it
                forwards the request to its offload pool, else refuses it).
            temperature: sampling temperature, 0 to 2 (None = the daemon's default, 0: greedy).
            top_p: nucleus sampling mass in (0, 1], with ``temperature`` > 0.
            stop: up to 4 non-empty strings (or one string); the answer ends before the first of them.
            seed: sampling seed, an integer in ``[0, 2**63 - 1]``, with ``temperature`` > 0.
            frame_seq: ask about this frame of ``source`` (an earlier answer's ``frame_seq``) while the
                daemon still holds it (the source's last 32 frames): several questions about one frame.

        Numbers may be NumPy scalars (``np.int64``, ``np.float32``; :func:`edgevlm.types.plain_scalar`).

        Returns:
            The :class:`~edgevlm.types.Answer`, with ``frame_ts``/``source``/``frame_pos_ms``/``frame_seq``
            of the frame used for a source request.

        Raises:
            InvalidRequestError, InvalidImageError, UnknownSourceError, BusyError,
            DeadlineExceededError, InternalError: the daemon's wire error, or a local check. BusyError:
                a full queue (``details["reason"]`` ``"queue_full"``); a daemon shutting down is waited
                for (the request is re-sent when it is back online), then DeadlineExceededError.
            BrokerUnreachableError: (a ``ConnectionError``) no answer within ``timeout_s`` and the
                broker is not connected; the message names the cause.
            ClientClosedError: (a ``ConnectionError``, not a ``BrokerUnreachableError``) the client was
                closed before the call or while it waited.
        """
        self._check_open()
        if (source is None) == (image is None):
            raise InvalidRequestError("give exactly one of source= and image=")
        timeout_s, max_new_tokens, budget_ms, frames, frames_s, temperature, top_p, seed, frame_seq = map(
            plain_scalar, (timeout_s, max_new_tokens, budget_ms, frames, frames_s, temperature, top_p, seed, frame_seq))
        if isinstance(stop, str):  # one stop string, as Engine.ask and the OpenAI API take it
            stop = [stop]
        timeout_ms = self._timeout_ms(timeout_s)
        body: dict[str, Any] = {"prompt": prompt, "timeout_ms": timeout_ms}
        if source is not None:
            body["source"] = source
        else:
            import base64

            body["image_b64"] = base64.b64encode(image_to_bytes(image)).decode("ascii")
        if max_new_tokens is not None:
            body["max_new_tokens"] = max_new_tokens
        if budget_ms is not None:
            body["budget_ms"] = budget_ms
        if frames is not None:
            body["frames"] = frames
        if frames_s is not None:
            body["frames_s"] = frames_s
        if frame_seq is not None:
            body["frame_seq"] = frame_seq
        if model is not None:
            body["model"] = model
        sampling = {"temperature": temperature, "top_p": top_p, "stop": stop, "seed": seed}
        body.update({k: v for k, v in sampling.items() if v is not None})
        request = parse_request(body)  # local validation, same rules and messages as the daemon
        payload = request.model_dump_json(exclude_none=True).encode()
        return self._roundtrip(payload, timeout_s)

    def request(self, payload: bytes, *, timeout_s: float | None = 30.0) -> Answer:
        """Send an already encoded request payload (the wire JSON, see the README's topic contract)
        as it is, with the delivery of :meth:`ask` (re-sends, Message Expiry, exactly one answer);
        for tools that speak the wire format, and for sending what :meth:`ask` would refuse locally.

        Raises:
            The same errors as :meth:`ask`; the daemon's verdict on a malformed payload (e.g.
            :class:`~edgevlm.errors.InvalidRequestError`).
            TypeError: ``payload`` is not bytes (e.g. a dict or str: encode the JSON first).
        """
        self._check_open()
        if not isinstance(payload, (bytes, bytearray, memoryview)):  # bytes(a dict) fails obscurely
            raise TypeError(f"payload must be the encoded request JSON (bytes), got {type(payload).__name__}")
        self._timeout_ms(timeout_s)  # the same check of timeout_s as ask
        return self._roundtrip(bytes(payload), timeout_s)

    def wait_online(self, timeout_s: float | None = 10.0) -> bool:
        """Wait until the daemon's retained status says "online" (pool mode: any member's);
        returns whether it does (False on timeout: no daemon online is not an exception). The
        status is only known while the client is connected: after a lost broker connection it waits
        for the reconnect and the status the broker then sends (a status seen before is stale).

        Args:
            timeout_s: how long to wait (s); 0 or less checks once; None or ``inf`` waits for ever.

        Raises:
            InvalidRequestError: ``timeout_s`` is not a number (NaN, a string, a bool).
        """
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or math.isnan(timeout_s)):
            raise InvalidRequestError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
        forever = timeout_s is None or timeout_s >= threading.TIMEOUT_MAX
        deadline = None if forever else time.monotonic() + timeout_s
        with self._status_cond:
            while self._status is None or self._status.state != "online":
                remaining = threading.TIMEOUT_MAX if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._status_cond.wait(remaining)
            return True

    @property
    def connected(self) -> bool:
        """Whether the client is connected and subscribed to its response topic (it reconnects
        on its own after a broker restart)."""
        return self._subscribed.is_set()

    @property
    def pool_members(self) -> dict[str, StatusMessage]:
        """Pool mode: each member's last retained status (device id -> status), online or not, seen on
        the current broker connection (empty while it is lost)."""
        with self._status_cond:
            return dict(self._members)

    @property
    def device_status(self) -> StatusMessage | None:
        """The daemon's last status seen on the current broker connection (retained ``.../status``),
        or None: none seen yet, or the connection is lost (what was seen before may be stale)."""
        with self._status_cond:
            return self._status

    def close(self) -> None:
        """Disconnect and stop the network thread (idempotent); pending asks, and any later ``ask`` or
        ``request``, raise :class:`~edgevlm.errors.ClientClosedError` (a ``ConnectionError``)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for slot in pending:
            slot.error = ClientClosedError(
                "the client was closed while waiting for a response", details={"local": True}
            )
            slot.event.set()
        try:
            self._client.disconnect()
        finally:
            if not self._loop_ended:  # else it is ending by itself (joining it races paho's clean-up)
                self._client.loop_stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError(
                "the client is closed (after close() or its with block): make a new Client",
                details={"local": True},
            )

    @staticmethod
    def _timeout_ms(timeout_s: float | None) -> int:
        if timeout_s is None:
            return NO_DEADLINE_MS
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidRequestError(f"timeout_s must be a positive number or None, got {timeout_s!r}")
        if math.isinf(timeout_s) or timeout_s * 1000 >= NO_DEADLINE_MS:
            return NO_DEADLINE_MS
        return max(1, math.ceil(timeout_s * 1000))

    def _roundtrip(self, payload: bytes, timeout_s: float | None) -> Answer:
        start = time.monotonic()
        deadline = None if timeout_s is None or math.isinf(timeout_s) else start + timeout_s
        slot = _Pending(payload=payload, correlation=secrets.token_bytes(CORRELATION_DATA_BYTES), deadline=deadline)
        with self._lock:
            self._pending[slot.correlation] = slot
        try:
            # sent now if the response topic is subscribed; else by _on_subscribe once reconnected
            # (a request must not go out before its answer can be received)
            if self._subscribed.is_set():
                self._send(slot)
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait_s = None if deadline is None else deadline - now
                if self.resend_interval_s is not None:
                    # not sent yet (no broker connection): _on_subscribe sends it, and its re-sends are
                    # timed from then, so look again within an interval rather than sleep to the deadline
                    due = slot.last_sent + self._resend_after_s(slot) - now if slot.sends else self.resend_interval_s
                    wait_s = due if wait_s is None else min(wait_s, due)
                if slot.event.wait(None if wait_s is None else max(0.0, min(wait_s, threading.TIMEOUT_MAX))):
                    break
                if (self.resend_interval_s is not None and self._subscribed.is_set() and slot.sends
                        and time.monotonic() - slot.last_sent >= self._resend_after_s(slot)):  # fmt: skip
                    self._send(slot, resend=True)
        finally:
            with self._lock:
                self._pending.pop(slot.correlation, None)
        if slot.error is not None:
            raise slot.error
        if slot.response is None:
            raise self._timeout_error(timeout_s, slot)
        try:
            response = parse_response(slot.response)
        except EdgeVLMError as err:
            raise InternalError(f"malformed response from the daemon: {err.message}") from None
        return response.to_answer()

    def _resend_after_s(self, slot: _Pending) -> float:
        """Time after the last copy before the next periodic one: the interval, doubling with each
        copy up to four times it (a request waiting in a long queue is not re-sent every interval)."""
        assert self.resend_interval_s is not None
        return self.resend_interval_s * 2 ** min(2, max(0, slot.sends - 1))

    def _resend_all(self) -> None:
        with self._lock:
            pending = [p for p in self._pending.values() if not p.event.is_set()]
        for slot in pending:  # what was sent before the outage may be lost: send it again
            self._send(slot, resend=slot.sends > 0)

    def _timeout_error(self, timeout_s: float | None, slot: _Pending) -> EdgeVLMError:
        if not self._subscribed.is_set():
            since = self._disconnected_at
            how_long = f" for {time.monotonic() - since:.1f} s" if since is not None else ""
            cause = self._disconnect_cause or "not connected"
            return BrokerUnreachableError(
                f"no response from {self._target} within {timeout_s} s: the MQTT broker at "
                f"{self.host}:{self.port} is unreachable{how_long} ({cause})",
                details={"timeout_s": timeout_s, "local": True, "sends": slot.sends},
            )
        state = self._status.state if self._status else "unknown"
        stopped = "; it answered BUSY: shutting down, and was not back online in time" \
            if slot.shutting_down else ""  # fmt: skip
        return DeadlineExceededError(
            f"no response from {self._target} within {timeout_s} s "
            f"(daemon status: {state}; request sent {slot.sends} time(s){stopped})",
            details={"timeout_s": timeout_s, "local": True, "sends": slot.sends,
                     "shutting_down": slot.shutting_down},
        )

    def _send(self, slot: _Pending, *, resend: bool = False) -> None:
        """Publish (again) one pending request, with the Message Expiry Interval of the time left."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        now = time.monotonic()
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.response_topic
        props.CorrelationData = slot.correlation
        props.ContentType = "application/json"
        if slot.deadline is not None:
            left_s = slot.deadline - now
            if left_s <= 0:
                return
            props.MessageExpiryInterval = min(4294967295, max(1, math.ceil(left_s)))
        with self._lock:
            if slot.event.is_set() or self._pending.get(slot.correlation) is not slot:
                return
            slot.sends += 1
            slot.last_sent = now
        if resend:
            self.resends += 1
        info = self._client.publish(self.request_topic, slot.payload, qos=self.qos, properties=props)
        if info.rc not in (0, 4):  # success, or queued while reconnecting (MQTT_ERR_NO_CONN)
            logger.warning("edgevlm client: cannot publish a request (paho rc=%s); re-sent on reconnect", info.rc)

    def _record_preamble(self) -> None:
        """Keep the first bytes paho reads on a connection until its CONNACK (:attr:`_preamble`), so that
        a server that is not an MQTT broker can be named with what it sent (``b'HTTP/1.1 400 ...'``).
        paho has no public hook for received bytes: its socket read is wrapped where it exists (a paho
        without it only loses the quote in that message)."""
        recv = getattr(self._client, "_sock_recv", None)
        if not callable(recv):
            return

        def recording_recv(bufsize: int) -> bytes:
            data = recv(bufsize)
            if not self._connack and len(self._preamble) < _PREVIEW_BYTES + 1:
                self._preamble += data[: _PREVIEW_BYTES + 1 - len(self._preamble)]
            return data

        self._client._sock_recv = recording_recv

    def _not_a_broker(self) -> str:
        """Why a connection closed before its CONNACK, in one line: the server is not an MQTT broker
        (quoting what it sent instead) or closed the connection during CONNECT."""
        where = f"{self.host}:{self.port} did not answer as an MQTT broker"
        got = bytes(self._preamble)
        if not got:
            return f"{where}: it closed the connection during CONNECT, before a CONNACK"
        quoted = repr(got[:_PREVIEW_BYTES]) + ("..." if len(got) > _PREVIEW_BYTES else "")
        hint = ""
        if got.startswith(b"HTTP/"):
            hint = " (an HTTP server?)"
        elif got[0] in (0x15, 0x16) and got[1:2] == b"\x03":  # a TLS alert or handshake record
            hint = " (a TLS port? connect with tls=True)"
        return f"{where}: it answered CONNECT with {quoted}, not a CONNACK{hint}"

    # ------------------------------------------------------------------ paho callbacks
    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        self._connack = False  # a new connection (the first, or a reconnect): its CONNACK is still to come
        self._preamble.clear()
        set_tcp_nodelay(client, userdata, sock)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._connack = True
        if reason_code.is_failure:
            self._connect_error = f"the MQTT broker at {self.host}:{self.port} refused the connection: {reason_code}"
            self._disconnect_cause = f"the broker refused the connection: {reason_code}"
            self._ready.set()
            return
        client.subscribe([(self.response_topic, self.qos), (self.status_topic, 1)])

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        import sys

        self._disconnect_cause = f"cannot reconnect: {describe_connect_error(sys.exc_info()[1])}"

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        failed = [rc for rc in reason_codes if rc.is_failure]
        if failed:
            self._connect_error = (f"the MQTT broker at {self.host}:{self.port} refused the response "
                                   f"subscription: {failed[0]}")
            self._ready.set()
            return
        self._disconnected_at = None
        self._disconnect_cause = ""
        self._subscribed.set()
        self._ready.set()
        self._resend_all()

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._subscribed.clear()
        # unknown until the broker sends it again: wait_online must not say a stale "online"
        with self._status_cond:
            self._status = None
            self._members.clear()
            self._status_cond.notify_all()
        if self._disconnected_at is None:
            self._disconnected_at = time.monotonic()
        from_broker = bool(getattr(flags, "is_disconnect_packet_from_server", False))
        if from_broker:
            cause = f"the broker sent DISCONNECT: {reason_code}"
        elif not self._connack:  # closed before its CONNACK: not an MQTT broker, or one dropping us in CONNECT
            cause = self._not_a_broker()
        else:
            cause = f"connection lost: {reason_code}"
        if self._connect_error is None or not self._constructing:  # keep the broker's refusal as the cause
            self._disconnect_cause = cause
        if self._constructing:
            if self._connect_error is None and not self._ready.is_set():  # fail now, not at the timeout
                self._connect_error = cause if not self._connack else (
                    f"the MQTT broker at {self.host}:{self.port} closed the connection before it acknowledged "
                    f"the response subscription ({cause})")
                self._loop_ended = True
                client.loop_stop()  # from the network thread: it ends now instead of sleeping to reconnect
                self._ready.set()
            logger.debug("edgevlm client: %s (while connecting)", cause)
        elif not self._closed:
            logger.warning("edgevlm client: %s; reconnecting", self._disconnect_cause)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        request_quick_ack(client)
        try:
            if msg.topic == self.status_topic or (self.pool is not None and msg.topic.endswith("/status")):
                self._on_status(msg.payload, msg.topic, retained=bool(msg.retain))
                return
            props = getattr(msg, "properties", None)
            correlation = getattr(props, "CorrelationData", None) if props is not None else None
            with self._lock:
                slot = self._pending.get(bytes(correlation)) if correlation is not None else None
                first = slot is not None and not slot.event.is_set()
                busy = _busy_reason(msg.payload) if first else None
                if busy is not None and self.pool is not None and (
                        slot.deadline is None or time.monotonic() + POOL_BUSY_RETRY_S < slot.deadline):
                    self.busy_retries += 1  # another member may have room: try the pool again
                    retry = threading.Timer(POOL_BUSY_RETRY_S, self._send, (slot,), {"resend": True})
                    retry.daemon = True
                    retry.start()
                    return
                if busy == SHUTTING_DOWN and self.pool is None:
                    # a clean stop (SIGTERM, a restart): the daemon's "offline" follows, and its "online"
                    # when it is back re-sends the request (_on_status), as after a crash; else the deadline
                    # ends the wait
                    self.shutdown_busy_held += 1
                    slot.shutting_down = True
                    return
                if first:
                    slot.response = bytes(msg.payload)
                    slot.event.set()
                else:
                    self.duplicates_dropped += 1
            if not first:
                logger.debug("edgevlm client: dropping a response that is a duplicate or has unknown correlation data")
        except Exception:  # noqa: BLE001 - never kill paho's network thread
            logger.exception("edgevlm client: error while handling a message")

    def _on_status(self, payload: bytes, topic: str = "", *, retained: bool = False) -> None:
        if not payload:
            status = None  # retained status cleared
        else:
            try:
                status = StatusMessage.model_validate_json(payload)
            except ValueError:
                logger.warning("edgevlm client: malformed status message ignored")
                return
        with self._status_cond:
            if self.pool is not None:  # keep the members of our pool; the status is the best of them
                device = topic.rsplit("/", 2)[-2] if topic.count("/") >= 2 else ""
                if status is not None and status.pool == self.pool:
                    self._members[device] = status
                else:
                    self._members.pop(device, None)
                online = [m for m in self._members.values() if m.state == "online"]
                status = online[0] if online else next(iter(self._members.values()), None)
            previous, self._status = self._status, status
            self._status_cond.notify_all()
        if (status is not None and status.state == "online" and self._subscribed.is_set()
                and (previous.state == "offline" if previous is not None else not retained)):  # fmt: skip
            # the daemon restarted (its last will said offline): what it held in memory is gone; or, status
            # unknown since our reconnect, it says online live (not the retained one): it has just connected,
            # after our copies went out on the reconnect, when it was not subscribed to receive them
            self._resend_all()
