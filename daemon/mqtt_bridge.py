"""MQTT v5 request/response front end of the daemon (paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``).

Shape follows paho's ``examples/server_rpc.py``: subscribe to the request topic in ``on_connect``
(so a reconnect re-subscribes), and in ``on_message`` answer on the request's *Response Topic*
with its *Correlation Data* (MQTT v5 section 4.10, request/response).

- Request topic ``<prefix>/<device_id>/request``, subscribed with *Retain Handling* 2 ("do not
  send retained messages at subscribe", MQTT v5 section 3.8.3.1), so a retained request left on the
  topic is never executed; a message that still arrives with the retain flag is dropped too.
- The reply echoes Correlation Data byte for byte (binary, non-UTF-8, NUL bytes are fine: it is
  an opaque binary property). Without a Response Topic the JSON fallback ``reply_to`` /
  ``correlation_id`` is used (MQTT 3.1.1 clients); with neither, the request is counted
  (``no_reply_address``), logged, and dropped.
- Status: ``<prefix>/<device_id>/status`` is a retained :class:`~edgevlm.protocol.StatusMessage`,
  "online" after every (re)connect, "offline" on a clean stop, and "offline" as the last will.
- paho's network thread only parses/validates and calls :meth:`Scheduler.submit` (non-blocking);
  inference runs on the scheduler's worker, which publishes the response (paho's publish is
  thread-safe).
- Reconnect: paho's loop thread reconnects with exponential backoff between
  ``reconnect_min_delay_s`` and ``reconnect_max_delay_s``; ``on_connect`` re-subscribes and
  re-publishes the status. Sessions start clean (nothing is replayed from a previous session).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from edgevlm.config import MqttConfig
from edgevlm.daemon.scheduler import Counters, Job, Scheduler
from edgevlm.errors import EdgeVLMError, InvalidRequestError
from edgevlm.protocol import (
    Response,
    StatusMessage,
    fallback_reply_address,
    is_valid_publish_topic,
    parse_json_object,
    parse_request,
    request_topic,
    status_topic,
)

logger = logging.getLogger(__name__)


def _paho() -> Any:
    import paho.mqtt.client as mqtt

    return mqtt


class MqttBridge:
    """Connects the scheduler to the broker.

    Args:
        config: broker settings and topic layout.
        scheduler: where accepted requests go.
        online_status: the retained "online" status payload (its ``ts`` is refreshed on each
            connect).
        counters: shared event counters (defaults to the scheduler's).
    """

    def __init__(
        self,
        config: MqttConfig,
        scheduler: Scheduler,
        online_status: StatusMessage,
        counters: Counters | None = None,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.counters = counters or scheduler.counters
        self.request_topic = request_topic(config.prefix, config.device_id)
        self.status_topic = status_topic(config.prefix, config.device_id)
        self._online = online_status
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self._client: Any = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Configure the client and start connecting in paho's loop thread (returns at once; the
        first connection is retried like a reconnect if the broker is not up yet)."""
        mqtt = _paho()
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        cfg = self.config
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=cfg.effective_client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=True,
        )
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password)
        if cfg.tls is not None:
            client.tls_set(
                ca_certs=str(cfg.tls.ca_certs) if cfg.tls.ca_certs else None,
                certfile=str(cfg.tls.certfile) if cfg.tls.certfile else None,
                keyfile=str(cfg.tls.keyfile) if cfg.tls.keyfile else None,
            )
            client.tls_insecure_set(cfg.tls.insecure)
        will = StatusMessage(state="offline", device_id=cfg.device_id).to_bytes()
        client.will_set(self.status_topic, will, qos=cfg.qos, retain=True)
        client.reconnect_delay_set(
            min_delay=cfg.reconnect_min_delay_s,  # type: ignore[arg-type]  # paho accepts float seconds
            max_delay=cfg.reconnect_max_delay_s,  # type: ignore[arg-type]
        )
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        connect_props = Properties(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = 0
        self._client = client
        client.connect_async(
            cfg.host, cfg.port, keepalive=cfg.keepalive_s, clean_start=True, properties=connect_props
        )
        client.loop_start()
        logger.info("MQTT: connecting to %s:%d as %s", cfg.host, cfg.port, cfg.effective_client_id)

    def wait_ready(self, timeout_s: float | None) -> bool:
        """Wait until connected and subscribed to the request topic."""
        return self._subscribed.wait(timeout_s)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publish the retained "offline" status, disconnect and stop paho's thread."""
        client = self._client
        if client is None:
            return
        self._stopping = True
        if self._connected.is_set():
            offline = StatusMessage(state="offline", device_id=self.config.device_id, ts=time.time())
            info = client.publish(self.status_topic, offline.to_bytes(), qos=self.config.qos, retain=True)
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError) as exc:
                logger.warning("MQTT: offline status not sent: %s", exc)
        client.disconnect()
        client.loop_stop()
        self._client = None
        self._connected.clear()
        self._subscribed.clear()
        logger.info("MQTT: disconnected")

    # ------------------------------------------------------------------ paho callbacks
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            logger.error("MQTT: connection refused: %s", reason_code)
            return
        from paho.mqtt.subscribeoptions import SubscribeOptions

        self._connected.set()
        self.counters.inc("mqtt_connects")
        logger.info("MQTT: connected; subscribing to %s", self.request_topic)
        options = SubscribeOptions(qos=self.config.qos, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND)
        client.subscribe(self.request_topic, options=options)
        online = self._online.model_copy(update={"ts": time.time()})
        client.publish(self.status_topic, online.to_bytes(), qos=self.config.qos, retain=True)

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        self.counters.inc("mqtt_connect_failures")
        logger.warning("MQTT: cannot connect to %s:%d; retrying", self.config.host, self.config.port)

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._connected.clear()
        self._subscribed.clear()
        if not self._stopping:
            self.counters.inc("mqtt_disconnects")
            logger.warning("MQTT: connection lost (%s); reconnecting", reason_code)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        failed = [rc for rc in reason_codes if rc.is_failure]
        if failed:
            logger.error("MQTT: subscription to %s refused: %s", self.request_topic, failed[0])
            return
        self._subscribed.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        try:
            self._handle(msg)
        except Exception:  # noqa: BLE001 - an exception here would stop paho's network loop
            self.counters.inc("handler_errors")
            logger.exception("MQTT: unexpected error while handling a request")

    # ------------------------------------------------------------------ requests
    def _handle(self, msg: Any) -> None:
        self.counters.inc("messages_received")
        if msg.retain:
            self.counters.inc("retained_ignored")
            logger.info("MQTT: ignoring a retained request on %s", msg.topic)
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation_data = getattr(props, "CorrelationData", None) if props is not None else None
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

        reply_to, correlation_id = fallback_reply_address(data) if data is not None else (None, None)
        topic = response_topic or reply_to
        if topic is None:
            self.counters.inc("no_reply_address")
            logger.warning(
                "MQTT: dropping a request with no Response Topic and no 'reply_to' field "
                "(MQTT 3.1.1 clients: add reply_to/correlation_id to the JSON)"
            )
            return

        def reply(response: Response) -> None:
            self._publish_reply(topic, correlation_data, response)

        if error is None and data is not None:
            try:
                request = parse_request(data)
            except InvalidRequestError as err:
                error = err
        if error is not None:
            self.counters.inc("requests_received")
            self.counters.inc(f"errors_{error.code.value}")
            logger.info("MQTT: invalid request: %s", error.message)
            reply(Response.failure(error, correlation_id))
            return
        timeout_ms = (
            request.timeout_ms if request.timeout_ms is not None else self.scheduler.defaults.timeout_ms
        )
        self.scheduler.submit(Job(request=request, reply=reply, timeout_ms=timeout_ms))

    def _publish_reply(self, topic: str, correlation_data: bytes | None, response: Response) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        client = self._client
        if client is None:
            self.counters.inc("responses_dropped")
            logger.warning("MQTT: stopped; response to %s dropped", topic)
            return
        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "application/json"
        if correlation_data is not None:
            props.CorrelationData = bytes(correlation_data)
        info = client.publish(topic, response.to_bytes(), qos=self.config.qos, retain=False, properties=props)
        self.counters.inc("responses_sent")
        if info.rc != 0:
            logger.warning("MQTT: response to %s queued while disconnected (rc=%s)", topic, info.rc)
