"""The request side of :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge`: parse, check, submit, reply.

:class:`MqttRequests` is a mixin of :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge` (it uses the
bridge's config, counters, scheduler, limits, metrics and publishing): a request message is checked
(retain flag, Response Topic, payload size, JSON, inline image limits) and submitted to the
scheduler, and its once-only reply function publishes the response on the request's reply address
(see the module doc of :mod:`edgevlm.daemon.mqtt_bridge`).

Duplicates: a request is identified by its reply address and Correlation Data (``reply_to`` +
``correlation_id`` for the JSON fallback). :class:`RecentAnswers` remembers the last
``mqtt.dedup_cache_size`` of them with a digest of their payload: a re-sent request (same address,
same Correlation Data, same payload) that is still queued or running is absorbed, and one already
answered gets the same response again (byte for byte) instead of running twice. The SDK re-sends
unanswered requests (see :mod:`edgevlm.client`), so this makes delivery exactly-once for the
application. A request without Correlation Data is never deduplicated.

Receipt time: :class:`ReceiptClock` notices when the daemon's own process was not running (SIGSTOP,
a paused VM) and dates the requests read right after that from when the stop began, since they
waited in the socket meanwhile; the deadline rule itself is
:func:`edgevlm.daemon.scheduler.request_timeout_ms`.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from edgevlm.daemon.scheduler import Job, request_timeout_ms
from edgevlm.errors import BusyError, EdgeVLMError, InternalError, InvalidImageError, InvalidRequestError
from edgevlm.protocol import (
    NO_DEADLINE_MS,
    Request,
    Response,
    fallback_reply_address,
    is_valid_publish_topic,
    parse_json_object,
    parse_request,
)

logger = logging.getLogger(__name__)

DedupKey = tuple[str, bytes]


class RecentAnswers:
    """Bounded map of recent requests (reply address + Correlation Data) to their response:
    None while the request is queued or running. Thread-safe; the oldest entry goes first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[DedupKey, tuple[bytes, Response | None]] = collections.OrderedDict()

    def claim(self, key: DedupKey, digest: bytes) -> tuple[str, Response | None]:
        """``("new", None)`` (now recorded as in flight), ``("in_flight", None)`` or
        ``("answered", response)``. A known key with another payload is a new request."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == digest:
                self._entries.move_to_end(key)
                return ("in_flight", None) if entry[1] is None else ("answered", entry[1])
            self._entries[key] = (digest, None)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)
            return "new", None

    def answered(self, key: DedupKey, digest: bytes, response: Response) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == digest:
                self._entries[key] = (digest, response)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class ReceiptClock:
    """Monotonic receipt times that survive the daemon's process being stopped.

    A ticker thread records the time every ``tick_s``; a gap longer than ``stall_s`` means the
    process did not run (SIGSTOP, a suspended VM or container). A message handled while such a gap
    is still open, or less than ``grace_s`` after it closed, waited in the socket: its receipt time
    is the last tick before the gap (the earliest it can have arrived unread), so a request whose
    client gave up meanwhile is not run.
    """

    def __init__(self, tick_s: float = 0.1, stall_s: float = 2.0, grace_s: float = 0.25) -> None:
        self.tick_s, self.stall_s, self.grace_s = tick_s, stall_s, grace_s
        self._last = time.monotonic()
        self._stall: tuple[float, float] | None = None
        self.stalls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._tick, name="edgevlm-receipt-clock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - self._last > self.stall_s:
                self._stall = (self._last, now)
                self.stalls += 1
                logger.warning("the daemon's process did not run for %.1f s (stopped?); requests read now are "
                               "dated from when it stopped", now - self._last)  # fmt: skip
            self._last = now

    def received(self) -> float:
        """The receipt time (monotonic s) of a message handled now."""
        now = time.monotonic()
        if self._thread is None:
            return now
        last = self._last
        if now - last > self.stall_s:
            return last
        stall = self._stall
        if stall is not None and now - stall[1] < self.grace_s:
            return stall[0]
        return now


class MqttRequests:
    """Request handling of :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge` (a mixin)."""

    # ------------------------------------------------------------------ requests
    @staticmethod
    def reply_address(msg: Any, data: dict[str, Any] | None) -> tuple[str | None, bytes | None, str | None]:
        """``(topic, correlation_data, correlation_id)`` to answer a message on: the Response Topic
        property, else the JSON fallback ``reply_to``."""
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation_data = getattr(props, "CorrelationData", None) if props is not None else None
        reply_to, correlation_id = fallback_reply_address(data) if data is not None else (None, None)
        return response_topic or reply_to, correlation_data, correlation_id

    def _drop(self, reason: str, message: str, *args: Any) -> None:
        """Count (counters and ``edgevlm_requests_dropped_total{reason}``) and log a request that
        cannot be answered."""
        self.counters.inc(reason)
        if self.metrics is not None:
            self.metrics.request_dropped(reason)
        logger.warning(message, *args)

    def _handle(self, msg: Any) -> None:
        received = self.receipt_clock.received()
        self.counters.inc("messages_received")
        if msg.retain:
            self.counters.inc("retained_ignored")
            logger.info("MQTT: ignoring a retained request on %s", msg.topic)
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        if response_topic == "":
            response_topic = None  # an empty Response Topic is no address: the JSON reply_to may give one
        if response_topic is not None and not is_valid_publish_topic(response_topic):
            self._drop("invalid_response_topic",
                       "MQTT: dropping a request whose Response Topic %r cannot be published to (a wildcard, "
                       "NUL or too long)", response_topic)  # fmt: skip
            return

        payload: bytes = msg.payload
        data: dict[str, Any] | None = None
        error: EdgeVLMError | None = None
        if len(payload) > self.config.max_payload_bytes:
            error = InvalidRequestError(
                f"$: payload of {len(payload)} bytes exceeds max_payload_bytes={self.config.max_payload_bytes}",
                details={"path": "$", "max_payload_bytes": self.config.max_payload_bytes},
            )
        else:
            try:
                data = parse_json_object(payload)
            except InvalidRequestError as err:
                error = err

        topic, correlation_data, correlation_id = self.reply_address(msg, data)
        if topic is None:
            self._drop("no_reply_address",
                       "MQTT: dropping a request with no Response Topic and no valid 'reply_to' field "
                       "(MQTT 3.1.1 clients: add reply_to/correlation_id to the JSON)")  # fmt: skip
            return

        key: DedupKey | None = None
        if correlation_data is not None:
            key = (topic, b"D" + bytes(correlation_data))
        elif correlation_id is not None:
            key = (topic, b"I" + correlation_id.encode())
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        if key is not None:
            seen, cached = self.recent_answers.claim(key, digest)
            if seen != "new":
                self.counters.inc(f"duplicate_{seen}")
                if self.metrics is not None:
                    self.metrics.duplicate_request(seen)
                if cached is not None:  # answered already: the same response again, nothing runs twice
                    logger.info("MQTT: re-sent request on %s answered from the recent-answers cache", topic)
                    self._publish_reply(topic, correlation_data, cached)
                else:
                    logger.info("MQTT: re-sent request on %s is already queued or running", topic)
                return

        request: Request | None = None
        if error is None and data is not None:
            try:
                request = parse_request(data)
                self._check_image(request)
            except (InvalidRequestError, InvalidImageError) as err:
                error = err
        expiry_s = getattr(props, "MessageExpiryInterval", None) if props is not None else None
        timeout_ms = NO_DEADLINE_MS
        limit = "timeout_ms"
        if request is not None and error is None:
            asked_ms = request.timeout_ms if request.timeout_ms is not None else self.scheduler.defaults.timeout_ms
            timeout_ms = request_timeout_ms(request.timeout_ms, self.scheduler.defaults.timeout_ms, expiry_s)
            if timeout_ms < asked_ms:
                limit = "message_expiry"
        reply = self._make_reply(topic, correlation_data, correlation_id, received, timeout_ms,
                                 None if key is None else (key, digest))  # fmt: skip
        if error is None and not self._accepting:
            error = BusyError("the daemon is shutting down")
        if error is not None:
            self.counters.inc("requests_received")
            self.counters.inc(f"errors_{error.code.value}")
            logger.info("MQTT: request refused: %s", error.message)
            reply(Response.failure(error, correlation_id))
            return
        assert request is not None
        self.scheduler.submit(Job(request=request, reply=reply, received_monotonic=received, timeout_ms=timeout_ms,
                                  deadline_limit=limit))  # fmt: skip
        if self.metrics is not None:
            self.metrics.set_queue_depth(self.scheduler.queue_size())

    def _check_image(self, request: Request) -> None:
        data = request.image_bytes
        if data is None:
            return
        limits = self.limits
        if len(data) > limits.max_image_bytes:
            raise InvalidImageError(
                f"inline image of {len(data)} bytes exceeds limits.max_image_bytes={limits.max_image_bytes}",
                details={"image_bytes": len(data), "max_image_bytes": limits.max_image_bytes},
            )
        from edgevlm.runtime.image import image_info  # header parse only: no pixel is decoded

        fmt, width, height = image_info(data)
        if width * height > limits.max_image_pixels:
            raise InvalidImageError(
                f"{fmt.upper()} image is {width} x {height} = {width * height} pixels, over "
                f"limits.max_image_pixels={limits.max_image_pixels} (not decoded)",
                details={"width_px": width, "height_px": height, "max_image_pixels": limits.max_image_pixels},
            )

    def _make_reply(
        self, topic: str, correlation_data: bytes | None, correlation_id: str | None, received: float,
        timeout_ms: int, dedup: tuple[DedupKey, bytes] | None = None,
    ) -> Callable[[Response], None]:
        """A once-only reply function for one request (tracked until answered; its response is
        remembered for re-sends when ``dedup`` gives its key and payload digest)."""
        with self._lock:
            self._next_id += 1
            key = self._next_id
        done = threading.Event()

        def reply(response: Response) -> None:
            with self._lock:
                if done.is_set():
                    self.counters.inc("late_replies_dropped")
                    return
                done.set()
                self._outstanding.pop(key, None)
            if response.correlation_id is None and correlation_id is not None:
                response = response.model_copy(update={"correlation_id": correlation_id})
            self._observe(response, received, timeout_ms)
            response = self._publish_reply(topic, correlation_data, response)
            if dedup is not None:
                self.recent_answers.answered(dedup[0], dedup[1], response)

        with self._lock:
            self._outstanding[key] = reply
        return reply

    def _observe(self, response: Response, received: float, timeout_ms: int) -> None:
        if self.metrics is None:
            return
        code = "OK" if response.ok else (response.error.code if response.error else "INTERNAL")
        late = timeout_ms < NO_DEADLINE_MS and time.monotonic() > received + timeout_ms / 1000.0
        self.metrics.observe_answer(response.stats, code, deadline_missed=late and response.ok)
        if response.stats is not None and response.stats.operating_point:
            self.metrics.set_operating_point(response.stats.operating_point)
        self.metrics.set_queue_depth(self.scheduler.queue_size())

    def _publish_reply(self, topic: str, correlation_data: bytes | None, response: Response) -> Response:
        """Publish ``response`` (or the error that replaces it when it cannot be serialized or is
        too large for the broker); returns the response actually sent."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from edgevlm.daemon.mqtt_bridge import PacketTooLargeError  # defined after this mixin's module

        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "application/json"
        if correlation_data is not None:
            props.CorrelationData = bytes(correlation_data)
        try:
            payload = response.to_bytes()
        except Exception as exc:  # noqa: BLE001 - never leave a request unanswered
            logger.error("MQTT: response to %s cannot be serialized (%s); sending INTERNAL", topic, exc)
            response = Response.failure(InternalError(f"the response could not be serialized: {type(exc).__name__}"))
            payload = response.to_bytes()
        try:
            info = self.publish(topic, payload, properties=props)
        except PacketTooLargeError as err:
            logger.warning("MQTT: response too large: %s; sending an error instead", err.message)
            response = Response.failure(
                InternalError(f"the response ({len(payload)} bytes) exceeds the broker's maximum packet size "
                              f"({err.details['max_packet_bytes']} bytes); ask for fewer tokens",
                              details={**err.details, "reason": "response_too_large"}),
                response.correlation_id,
            )  # fmt: skip
            try:
                info = self.publish(topic, response.to_bytes(), properties=props)
            except EdgeVLMError as err2:
                self.counters.inc("responses_dropped")
                logger.error("MQTT: response to %s dropped: %s", topic, err2.message)
                return response
        except InternalError:
            self.counters.inc("responses_dropped")
            logger.warning("MQTT: stopped; response to %s dropped", topic)
            return response
        self.counters.inc("responses_sent")
        if info is not None:
            self.track_publish(info.mid, topic)
        if info is not None and info.rc != 0:
            logger.warning("MQTT: response to %s queued while disconnected (rc=%s)", topic, info.rc)
        return response
