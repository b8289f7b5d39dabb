"""The Python SDK: ask an edgevlm daemon questions over MQTT v5 request/response.

    >>> with edgevlm.Client("localhost", 1883, "robot-1") as client:
    ...     answer = client.ask("How many red objects?", source="front", timeout_s=5)
    ...     print(answer.text, answer.stats.e2e_ms, answer.frame_ts)

Each request carries the client's own Response Topic (``<prefix>/<device_id>/response/<token>``)
and 16 random bytes of Correlation Data (MQTT v5 section 4.10); the reply is matched by those bytes,
so one client may be used by many threads at once. Wire errors are raised as the typed
exceptions of :mod:`edgevlm.errors` (``BUSY`` -> :class:`~edgevlm.errors.BusyError`, ...); no
reply within ``timeout_s`` (plus a small grace for the daemon's own deadline answer) raises
:class:`~edgevlm.errors.DeadlineExceededError`. A broker that cannot be reached raises the
built-in :class:`ConnectionError`.

Torch-free and OpenCV-free: numpy images are sent as PNG, encoded here with zlib.
"""

from __future__ import annotations

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
    parse_request,
    parse_response,
    request_topic,
    response_topic,
    status_topic,
)
from edgevlm.types import Answer

logger = logging.getLogger(__name__)

RESPONSE_GRACE_S = 1.0
"""Extra time the client waits beyond ``timeout_s`` for the daemon's own answer (s)."""

CORRELATION_DATA_BYTES = 16

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


@dataclass
class _Pending:
    event: threading.Event = field(default_factory=threading.Event)
    payload: bytes | None = None
    error: BaseException | None = None


class Client:
    """MQTT v5 client of one edgevlm daemon (``device_id``).

    Args:
        host, port: the broker.
        device_id: the daemon's device id (its ``mqtt.device_id``).
        prefix: topic prefix (the daemon's ``mqtt.prefix``).
        username, password: broker credentials.
        tls: use TLS (with ``ca_certs`` / ``certfile`` / ``keyfile``; ``tls_insecure`` skips the
            hostname check).
        client_id: MQTT client id; default: ``edgevlm-client-<random>``.
        keepalive_s: MQTT keepalive (s).
        qos: QoS of requests and of the response subscription.
        connect_timeout_s: how long the constructor waits for the connection and subscription.

    Raises:
        ConnectionError: the broker is unreachable, refuses the connection, or does not answer
            within ``connect_timeout_s``.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 1883,
        device_id: str = "",
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
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos}")
        self.host, self.port, self.device_id, self.prefix, self.qos = host, port, device_id, prefix, qos
        self._connect_timeout_s = connect_timeout_s
        token = secrets.token_hex(8)
        try:
            self.request_topic = request_topic(prefix, device_id)
            self.status_topic = status_topic(prefix, device_id)
            self.response_topic = response_topic(prefix, device_id, token)
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

        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"edgevlm-client-{token}",
            protocol=mqtt.MQTTv5,
        )
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls:
            self._client.tls_set(ca_certs=ca_certs, certfile=certfile, keyfile=keyfile)
            self._client.tls_insecure_set(tls_insecure)
        self._client.reconnect_delay_set(1, 10)
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_socket_open = set_tcp_nodelay
        self._client.connect_timeout = connect_timeout_s
        try:
            self._client.connect(host, port, keepalive=keepalive_s, clean_start=True)
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"cannot connect to the MQTT broker at {host}:{port}: {exc}") from None
        self._client.loop_start()
        if not self._ready.wait(connect_timeout_s) or self._connect_error is not None:
            reason = self._connect_error or f"no answer within {connect_timeout_s} s"
            self.close()
            raise ConnectionError(f"MQTT broker at {host}:{port} refused the connection: {reason}")

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
            frames_s: ask about the frames of ``source`` from the last S seconds (the ``frames_s`` field).

        Returns:
            The :class:`~edgevlm.types.Answer`, with ``frame_ts``/``source``/``frame_pos_ms`` of the
            frame used for a source request.

        Raises:
            InvalidRequestError, InvalidImageError, UnknownSourceError, BusyError,
            DeadlineExceededError, InternalError: the daemon's wire error, or a local check.
            ConnectionError: the client was closed while waiting.
        """
        if self._closed:
            raise ConnectionError("the client is closed")
        if (source is None) == (image is None):
            raise InvalidRequestError("give exactly one of source= and image=")
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
        request = parse_request(body)  # local validation, same rules and messages as the daemon
        payload = request.model_dump_json(exclude_none=True).encode()
        return self._roundtrip(payload, timeout_s)

    def wait_online(self, timeout_s: float = 10.0) -> bool:
        """Wait until the daemon's retained status says "online"; returns whether it does."""
        deadline = time.monotonic() + timeout_s
        with self._status_cond:
            while self._status is None or self._status.state != "online":
                remaining = deadline - time.monotonic()
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
    def device_status(self) -> StatusMessage | None:
        """The daemon's last status seen (retained ``.../status``), or None."""
        with self._status_cond:
            return self._status

    def close(self) -> None:
        """Disconnect and stop the network thread; pending asks raise ``ConnectionError``
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending.values())
        for slot in pending:
            slot.error = ConnectionError("the client was closed while waiting for a response")
            slot.event.set()
        try:
            self._client.disconnect()
        finally:
            self._client.loop_stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
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
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        # After a reconnect the response topic must be subscribed again before a request goes out,
        # or its response could arrive before the subscription and be lost.
        wait_s = self._connect_timeout_s if timeout_s is None else min(timeout_s, self._connect_timeout_s)
        if not self._subscribed.wait(wait_s):
            raise ConnectionError(
                f"not connected to the MQTT broker at {self.host}:{self.port} (reconnecting)"
            )
        correlation = secrets.token_bytes(CORRELATION_DATA_BYTES)
        slot = _Pending()
        with self._lock:
            self._pending[correlation] = slot
        try:
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = self.response_topic
            props.CorrelationData = correlation
            props.ContentType = "application/json"
            info = self._client.publish(self.request_topic, payload, qos=self.qos, properties=props)
            if info.rc not in (0, 4):  # success, or queued while reconnecting (MQTT_ERR_NO_CONN)
                raise ConnectionError(f"cannot publish the request (paho rc={info.rc})")
            wait_s: float | None = None
            if timeout_s is not None and timeout_s + RESPONSE_GRACE_S < threading.TIMEOUT_MAX:
                wait_s = timeout_s + RESPONSE_GRACE_S
            if not slot.event.wait(wait_s):
                raise DeadlineExceededError(
                    f"no response from device {self.device_id!r} within {timeout_s} s "
                    f"(daemon status: {self._status.state if self._status else 'unknown'})",
                    details={"timeout_s": timeout_s, "local": True},
                )
        finally:
            with self._lock:
                self._pending.pop(correlation, None)
        if slot.error is not None:
            raise slot.error
        try:
            response = parse_response(slot.payload or b"")
        except EdgeVLMError as err:
            raise InternalError(f"malformed response from the daemon: {err.message}") from None
        return response.to_answer()

    # ------------------------------------------------------------------ paho callbacks
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._connect_error = str(reason_code)
            self._ready.set()
            return
        client.subscribe([(self.response_topic, self.qos), (self.status_topic, 1)])

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        failed = [rc for rc in reason_codes if rc.is_failure]
        if failed:
            self._connect_error = f"subscription refused: {failed[0]}"
        else:
            self._subscribed.set()
        self._ready.set()

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if not self._closed:
            logger.warning("edgevlm client: connection lost (%s); reconnecting", reason_code)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        try:
            if msg.topic == self.status_topic:
                self._on_status(msg.payload)
                return
            props = getattr(msg, "properties", None)
            correlation = getattr(props, "CorrelationData", None) if props is not None else None
            with self._lock:
                slot = self._pending.get(bytes(correlation)) if correlation is not None else None
            if slot is None:
                logger.debug("edgevlm client: dropping a response with unknown correlation data")
                return
            slot.payload = bytes(msg.payload)
            slot.event.set()
        except Exception:  # noqa: BLE001 - never kill paho's network thread
            logger.exception("edgevlm client: error while handling a message")

    def _on_status(self, payload: bytes) -> None:
        if not payload:
            status = None  # retained status cleared
        else:
            try:
                status = StatusMessage.model_validate_json(payload)
            except ValueError:
                logger.warning("edgevlm client: malformed status message ignored")
                return
        with self._status_cond:
            self._status = status
            self._status_cond.notify_all()
