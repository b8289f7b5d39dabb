"""The request side of :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge`: parse, check, submit, reply.

:class:`MqttRequests` is a mixin of :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge` (it uses the
bridge's config, counters, scheduler, limits, metrics and publishing): a request message is checked
(retain flag, Response Topic, payload size, JSON, inline image limits) and submitted to the
scheduler, and its once-only reply function publishes the response on the request's reply address
(see the module doc of :mod:`edgevlm.daemon.mqtt_bridge`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from edgevlm.daemon.admission import check_inline_image
from edgevlm.daemon.scheduler import Job
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

    def _handle(self, msg: Any) -> None:
        self.counters.inc("messages_received")
        if msg.retain:
            self.counters.inc("retained_ignored")
            logger.info("MQTT: ignoring a retained request on %s", msg.topic)
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        if response_topic is not None and not is_valid_publish_topic(response_topic):
            self.counters.inc("invalid_response_topic")
            logger.warning(
                "MQTT: dropping a request whose Response Topic %r cannot be published to", response_topic
            )
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
            self.counters.inc("no_reply_address")
            logger.warning(
                "MQTT: dropping a request with no Response Topic and no 'reply_to' field "
                "(MQTT 3.1.1 clients: add reply_to/correlation_id to the JSON)"
            )
            return

        request: Request | None = None
        if error is None and data is not None:
            try:
                request = parse_request(data)
                check_inline_image(request, self.limits)
            except (InvalidRequestError, InvalidImageError) as err:
                error = err
        timeout_ms = NO_DEADLINE_MS
        if request is not None and error is None:
            timeout_ms = request.timeout_ms if request.timeout_ms is not None else self.scheduler.defaults.timeout_ms
        reply = self._make_reply(topic, correlation_data, correlation_id, timeout_ms)
        if error is None and not self._accepting:
            error = BusyError("the daemon is shutting down")
        if error is not None:
            self.counters.inc("requests_received")
            self.counters.inc(f"errors_{error.code.value}")
            logger.info("MQTT: request refused: %s", error.message)
            reply(Response.failure(error, correlation_id))
            return
        assert request is not None
        self.scheduler.submit(Job(request=request, reply=reply, timeout_ms=timeout_ms))
        if self.metrics is not None:
            self.metrics.set_queue_depth(self.scheduler.queue_size())

    def _make_reply(
        self, topic: str, correlation_data: bytes | None, correlation_id: str | None, timeout_ms: int
    ) -> Callable[[Response], None]:
        """A once-only reply function for one request (tracked until answered)."""
        received = time.monotonic()
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
            self._publish_reply(topic, correlation_data, response)

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

    def _publish_reply(self, topic: str, correlation_data: bytes | None, response: Response) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from edgevlm.daemon.mqtt_bridge import PacketTooLargeError  # defined after this mixin's module

        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "application/json"
        if correlation_data is not None:
            props.CorrelationData = bytes(correlation_data)
        payload = response.to_bytes()
        try:
            info = self.publish(topic, payload, properties=props)
        except PacketTooLargeError as err:
            logger.warning("MQTT: response too large: %s; sending an error instead", err.message)
            small = Response.failure(
                InternalError(f"the response ({len(payload)} bytes) exceeds the broker's maximum packet size "
                              f"({err.details['max_packet_bytes']} bytes); ask for fewer tokens",
                              details={**err.details, "reason": "response_too_large"}),
                response.correlation_id,
            )  # fmt: skip
            try:
                info = self.publish(topic, small.to_bytes(), properties=props)
            except EdgeVLMError as err2:
                self.counters.inc("responses_dropped")
                logger.error("MQTT: response to %s dropped: %s", topic, err2.message)
                return
        except InternalError:
            self.counters.inc("responses_dropped")
            logger.warning("MQTT: stopped; response to %s dropped", topic)
            return
        self.counters.inc("responses_sent")
        if info.rc != 0:
            logger.warning("MQTT: response to %s queued while disconnected (rc=%s)", topic, info.rc)
