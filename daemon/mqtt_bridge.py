"""MQTT v5 request/response front end of the daemon (paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``).

Shape follows paho's ``examples/server_rpc.py``: subscribe to the request topic in ``on_connect``
(so a reconnect re-subscribes), and in ``on_message`` answer on the request's *Response Topic*
with its *Correlation Data* (MQTT v5 section 4.10, request/response).

- Request topic ``<prefix>/<device_id>/request``, subscribed with *Retain Handling* 2 ("do not
  send retained messages at subscribe", MQTT v5 section 3.8.3.1), so a retained request left on the
  topic is never executed; a message that still arrives with the retain flag is dropped too.
- The reply echoes Correlation Data byte for byte. Without a Response Topic the JSON fallback
  ``reply_to`` / ``correlation_id`` is used (MQTT 3.1.1 clients); with neither, the request is
  counted (``no_reply_address``), logged, and dropped.
- Status: ``<prefix>/<device_id>/status`` is a retained :class:`~edgevlm.protocol.StatusMessage`,
  "online" after every (re)connect, "offline" on a clean stop, and "offline" as the last will.
  Other retained state (camera sources, reload results) is re-published after a reconnect.
- Limits: a payload over ``mqtt.max_payload_bytes`` is ``INVALID_REQUEST``; an inline image over
  ``limits.max_image_bytes`` or whose header claims more than ``limits.max_image_pixels`` is
  ``INVALID_IMAGE`` before anything is decoded (a decompression bomb never reaches the decoder).
- The broker's *Maximum Packet Size* (CONNACK property, MQTT v5 section 3.2.2.3.6) is honoured:
  a publish that would exceed it raises :class:`PacketTooLargeError` instead of being sent (the
  broker would drop the connection); a response that is too large is replaced by a small error
  response saying so.
- Reconnect: paho's loop thread reconnects with exponential backoff between
  ``reconnect_min_delay_s`` and ``reconnect_max_delay_s``, but resets it after every successful
  CONNACK, so two daemons with one client id would kick each other off in a tight loop. A
  connection closed less than ``FLAP_S`` after it was made doubles the delay across such
  disconnects up to the cap; a connection that lasts ``FLAP_S`` resets it. Every disconnect is
  logged with its cause (:func:`describe_disconnect`): the DISCONNECT reason the broker sent (0x8E
  "session taken over", 0x98 "administrative action", ...) or, with none, that the connection broke
  (a crashed broker or the network). Only 0x8E is logged as a takeover by another client with the
  same client id; quick closes without any DISCONNECT that repeat are logged naming the client id
  as the likely cause (mosquitto before 2.0.12 closes a connection taken over that way), and quick
  closes with another reason with that reason. A connection attempt that fails logs why (refused,
  unreachable, TLS certificate verification, ...).
- ``session_expiry_s > 0``: every CONNECT, the first included, has Clean Start 0 and that Session
  Expiry Interval, so the broker keeps the request subscription and queues QoS>=1 requests while
  the daemon is disconnected, crashed or restarting, and the next daemon process resumes the
  session and answers them. mosquitto (2.0) writes a session to its persistence file only when its
  CONNECT had Clean Start 0, so a session begun with Clean Start 1 vanishes in a broker restart
  and requests published before the daemon reconnects have no subscriber (PUBACK reason 0x10 "no
  matching subscribers") and are discarded. ``0`` starts a clean session on every connect.
- Responses are published at ``mqtt.qos``, with the Message Expiry Interval of the time left until
  the request's deadline (:func:`~edgevlm.protocol.response_expiry_s`; none without a deadline); a PUBACK with a failure reason code (an ACL refusal:
  0x87 "not authorized") is logged as a warning with the topic and counted
  (``response_refused``).
- Duplicates: a re-sent request (same reply address, Correlation Data and payload) is absorbed
  while it runs and answered from the recent-answers cache afterwards
  (:class:`~edgevlm.daemon.delivery.RecentAnswers`); its receipt time comes from
  :class:`~edgevlm.daemon.delivery.ReceiptClock` and its deadline from
  :func:`~edgevlm.protocol.request_timeout_ms` (``timeout_ms`` capped by the Message
  Expiry Interval).
- Shutdown: :meth:`stop_accepting` answers new requests ``BUSY``; :meth:`fail_outstanding`
  answers every request still without a response (bounded shutdown), a late worker reply to such
  a request is dropped.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from edgevlm.client import describe_connect_error, request_quick_ack, set_tcp_nodelay
from edgevlm.config import LimitsConfig, MqttConfig
from edgevlm.daemon.admission import check_inline_image
from edgevlm.daemon.delivery import RECEIVE_MAXIMUM, DedupKey, ReceiptClock, RecentAnswers, payload_digest
from edgevlm.daemon.metrics_common import EventCounters
from edgevlm.daemon.scheduler import Job, Scheduler
from edgevlm.errors import (
    EdgeVLMError,
    InternalError,
    InvalidImageError,
    InvalidRequestError,
    shutting_down_error,
)
from edgevlm.protocol import (
    NO_DEADLINE_MS,
    Request,
    Response,
    StatusMessage,
    fallback_reply_address,
    is_valid_publish_topic,
    parse_json_object,
    parse_request,
    pool_request_topic,
    pool_subscription,
    request_subscription,
    request_timeout_ms,
    request_topic,
    response_expiry_s,
    status_topic,
)

logger = logging.getLogger(__name__)

SESSION_TAKEN_OVER = 0x8E  # DISCONNECT reason code, MQTT v5 section 3.14.2.1
FLAP_S = 10.0  # a connection closed sooner than this after CONNACK counts as flapping

MessageHandler = Callable[[Any], None]


def _paho() -> Any:
    import paho.mqtt.client as mqtt

    return mqtt


def describe_disconnect(reason_code: Any, from_broker: bool, reason_string: str | None, lived_s: float,
                        quick_in_row: int, client_id: str, device_id: str) -> tuple[int, str]:  # fmt: skip
    """``(logging level, message)`` for a lost connection, naming its real cause.

    Args:
        reason_code: paho's reason code (a DISCONNECT reason code when ``from_broker``).
        from_broker: the broker sent a DISCONNECT packet (else the connection just closed).
        reason_string: the DISCONNECT's Reason String property, if any.
        lived_s: seconds the connection lasted after its CONNACK.
        quick_in_row: connections in a row closed sooner than :data:`FLAP_S` after they were made,
            this one included (0 when this one lasted longer).
        client_id, device_id: named when another client with the same client id is the cause.

    Only DISCONNECT 0x8E (Session taken over, MQTT v5 section 3.14.2.1) is called a takeover. A
    connection closed without a DISCONNECT soon after it was made, a second time in a row or more,
    names the client id as the likely cause: mosquitto before 2.0.12 closes a connection taken over
    without sending 0x8E. Any other quick close is logged with its own reason, never as a takeover.
    """
    if from_broker:
        cause = f"the broker sent DISCONNECT: {reason_code}"
        if reason_string:
            cause += f" ({reason_string})"
    else:
        cause = f"the connection broke without a DISCONNECT from the broker ({reason_code}: the broker " \
                "stopped or crashed, or the network failed)"  # fmt: skip
    same_id = f"the same client id {client_id!r} (another daemon with device_id {device_id!r}?)"
    in_row = f", {quick_in_row} times in a row" if quick_in_row >= 2 else ""
    if from_broker and getattr(reason_code, "value", None) == SESSION_TAKEN_OVER:
        return logging.ERROR, f"session taken over by another client with {same_id}{in_row} ({cause})"
    if not quick_in_row:
        return logging.WARNING, f"connection lost: {cause}"
    closed = f"connection closed {lived_s:.1f} s after it was made{in_row}"
    if quick_in_row >= 2 and not from_broker:
        return logging.ERROR, (f"{closed}: {cause}; another client with {same_id} would do this "
                               "(mosquitto before 2.0.12 closes the connection it replaces without a DISCONNECT)")  # fmt: skip
    return logging.WARNING, f"{closed}: {cause}"


class PacketTooLargeError(InternalError):
    """A publish would exceed the broker's Maximum Packet Size (``details``: sizes)."""


def _varint_len(n: int) -> int:
    size = 1
    while n >= 128:
        n //= 128
        size += 1
    return size


def publish_packet_size(topic: str, payload: bytes, qos: int, properties: Any = None) -> int:
    """Size in bytes of the MQTT v5 PUBLISH packet (fixed header included, MQTT v5 section 3.3)."""
    props = properties.pack() if properties is not None else b"\x00"
    remaining = 2 + len(topic.encode()) + (2 if qos else 0) + len(props) + len(payload)
    return 1 + _varint_len(remaining) + remaining



def response_properties(correlation_data: bytes | None, expiry_s: int | None = None) -> Any:
    """The MQTT v5 PUBLISH properties of a response (the request topic's and the audio features
    topic's): Content Type ``application/json``, Payload Format Indicator 1 (the payload is UTF-8 text,
    MQTT v5 section 3.3.2.3.2, so a client or bridge may treat it as text), the request's
    Correlation Data, byte for byte (none when the request had none), and the Message Expiry
    Interval ``expiry_s`` (seconds; :func:`~edgevlm.protocol.response_expiry_s`, the time left until
    the request's deadline; none when None: the request has no deadline)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    props.ContentType = "application/json"
    props.PayloadFormatIndicator = 1
    if correlation_data is not None:
        props.CorrelationData = bytes(correlation_data)
    if expiry_s is not None:
        props.MessageExpiryInterval = expiry_s
    return props


def message_deadline_ms(msg: Any) -> int:
    """The deadline (ms from receipt, :func:`~edgevlm.protocol.request_timeout_ms`) of a message
    whose own ``timeout_ms`` is not known (an invalid request, a re-send answered from the
    recent-answers cache, an audio features request): the MQTT v5 Message Expiry Interval it
    arrived with, or :data:`~edgevlm.protocol.NO_DEADLINE_MS` without one."""
    props = getattr(msg, "properties", None)
    expiry_s = getattr(props, "MessageExpiryInterval", None) if props is not None else None
    return request_timeout_ms(NO_DEADLINE_MS, NO_DEADLINE_MS, expiry_s)


class MqttBridge:
    """Connects the scheduler to the broker: a request message is checked (retain flag, Response
    Topic, duplicates, payload size, JSON, inline image limits) and submitted to the scheduler, and
    its once-only reply function publishes the response on the request's reply address.

    Args:
        config: broker settings and topic layout.
        scheduler: where accepted requests go.
        online_status: the retained "online" status payload (its ``ts`` is refreshed on each
            connect).
        counters: shared event counters (defaults to the scheduler's).
        limits: inline image limits (default :class:`~edgevlm.config.LimitsConfig`).
        metrics: an :class:`edgevlm.daemon.metrics.Metrics` counting every answered request.
        on_ready: called (on paho's thread) after every successful (re)subscription.
        on_connection: called with ``True``/``False`` and a reason when the connection comes up
            or is lost.
        serve_requests: subscribe the request topics (the device's and the pool's); False for the
            daemon's own connection when front processes take them (``mqtt.front_processes``).
        share_group: subscribe the device's request topic as the shared subscription
            ``$share/<share_group>/...`` (a front process; the pool's is shared already).
        announce: own the retained status (the last will "offline", "online" on connect,
            "offline" at stop); False for a front process (the daemon's process owns it).
    """

    def __init__(
        self,
        config: MqttConfig,
        scheduler: Scheduler,
        online_status: StatusMessage,
        counters: EventCounters | None = None,
        *,
        limits: LimitsConfig | None = None,
        metrics: Any = None,
        on_ready: Callable[[], None] | None = None,
        on_connection: Callable[[bool, str], None] | None = None,
        serve_requests: bool = True,
        share_group: str | None = None,
        announce: bool = True,
    ) -> None:
        self.config = config
        self.serve_requests = serve_requests
        self.announce = announce
        self.scheduler = scheduler
        self.counters = counters or scheduler.counters
        self.limits = limits or LimitsConfig()
        self.metrics = metrics
        self.on_ready = on_ready
        self.on_connection = on_connection
        self.request_topic = request_topic(config.prefix, config.device_id)
        self.request_filter = (request_subscription(config.prefix, config.device_id, share_group)
                               if share_group is not None else self.request_topic)
        # a pool member also takes requests from the pool's topic, through a shared subscription
        self.pool_topic = pool_request_topic(config.prefix, config.pool) if config.pool else None
        self.pool_subscription = (pool_subscription(config.prefix, config.pool, config.pool_group or config.pool)
                                  if config.pool else None)
        self.status_topic = status_topic(config.prefix, config.device_id)
        # a pool member watches the members' statuses: a pool request for a model another member
        # serves is handed to that member (members of one pool may serve different models)
        self.peer_status_filter = f"{config.prefix}/+/status" if config.pool and serve_requests else None
        self._peers: dict[str, StatusMessage] = {}
        self._online = online_status
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self._client: Any = None
        self._stopping = False
        self._accepting = True
        self._lock = threading.Lock()
        self._outstanding: dict[int, Callable[[Response], None]] = {}
        self._next_id = 0
        self._retained: dict[str, bytes] = {}
        self._handlers: dict[str, MessageHandler] = {}
        self.max_packet_bytes: int | None = None
        self.quick_closes = 0  # connections in a row closed sooner than FLAP_S after they were made
        self.backoff_delays_s: list[float] = []  # the reconnect delay after each of them
        self._connected_at = 0.0
        self._connack_seen = False  # a CONNACK (accepting or refusing) came on the current connection
        self._sub_mids: set[int] = set()
        self.recent_answers = RecentAnswers(config.dedup_cache_size)
        self.receipt_clock = ReceiptClock()
        self._reply_mids: dict[int, str] = {}  # mid of a response publish -> its topic, until its PUBACK

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
        if self.announce:
            will = StatusMessage(state="offline", device_id=cfg.device_id, pool=cfg.pool).to_bytes()
            client.will_set(self.status_topic, will, qos=cfg.qos, retain=True)
        self._set_delays(cfg.reconnect_min_delay_s, cfg.reconnect_max_delay_s, client)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_socket_open = set_tcp_nodelay  # responses not held back by Nagle's algorithm
        connect_props = Properties(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = cfg.session_expiry_s
        connect_props.ReceiveMaximum = RECEIVE_MAXIMUM  # bounds what can wait in our socket (delivery.py)
        self._client = client
        client.connect_async(
            cfg.host,
            cfg.port,
            keepalive=cfg.keepalive_s,
            # a kept session is resumed, also from a previous run of the daemon; Clean Start 0 from the
            # first CONNECT on, or mosquitto does not persist the session across its own restarts
            clean_start=cfg.session_expiry_s == 0,
            properties=connect_props,
        )
        self.receipt_clock.start()
        client.loop_start()
        logger.info("MQTT: connecting to %s:%d as %s%s", cfg.host, cfg.port, cfg.effective_client_id,
                    " (TLS)" if cfg.tls is not None else "")  # fmt: skip

    @staticmethod
    def _set_delays(min_s: float, max_s: float, client: Any) -> None:
        client.reconnect_delay_set(min_delay=min_s, max_delay=max_s)  # paho accepts float seconds

    def wait_ready(self, timeout_s: float | None) -> bool:
        """Wait until connected and subscribed to the request topic."""
        return self._subscribed.wait(timeout_s)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stop_accepting(self) -> None:
        """From now on, new requests are answered ``BUSY`` ("shutting down"). A pool member first
        leaves the pool (unsubscribes its shared subscription), so the broker hands the pool's
        requests to the other members instead."""
        self.leave_pool()
        self._accepting = False

    def leave_pool(self, timeout_s: float = 2.0) -> bool:
        """Unsubscribe from the pool's shared subscription and wait (up to ``timeout_s``) for the
        broker's UNSUBACK; the device's own request topic stays. Returns whether the broker
        confirmed it (False when not a member or not connected)."""
        client = self._client
        if (self.pool_subscription is None or not self.serve_requests or client is None
                or not self._connected.is_set()):
            return False
        done = threading.Event()
        previous = client.on_unsubscribe

        def on_unsubscribe(*_: Any) -> None:
            done.set()

        client.on_unsubscribe = on_unsubscribe
        try:
            client.unsubscribe(self.pool_subscription)
            left = done.wait(timeout_s)
        finally:
            client.on_unsubscribe = previous
        logger.info("MQTT: left pool %r%s", self.config.pool, "" if left else " (no UNSUBACK in time)")
        return left

    def outstanding(self) -> int:
        """Accepted requests that have not been answered yet."""
        with self._lock:
            return len(self._outstanding)

    def fail_outstanding(self, err: EdgeVLMError) -> int:
        """Answer every request still without a response with ``err``; returns how many."""
        with self._lock:
            pending = list(self._outstanding.values())
        for reply in pending:
            reply(Response.failure(err))
        return len(pending)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publish the retained "offline" status, disconnect and stop paho's thread."""
        client = self._client
        if client is None:
            return
        self._stopping = True
        if self._connected.is_set() and self.announce:
            offline = StatusMessage(state="offline", device_id=self.config.device_id, ts=time.time(),
                                    pool=self.config.pool)
            info = client.publish(self.status_topic, offline.to_bytes(), qos=self.config.qos, retain=True)
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError) as exc:
                logger.warning("MQTT: offline status not sent: %s", exc)
        client.disconnect()
        client.loop_stop()
        self.receipt_clock.stop()
        self._client = None
        self._connected.clear()
        self._subscribed.clear()
        logger.info("MQTT: disconnected")

    # ------------------------------------------------------------------ publishing
    def publish(self, topic: str, payload: bytes, *, retain: bool = False, properties: Any = None,
                qos: int | None = None) -> Any:  # fmt: skip
        """Publish (queued by paho while disconnected). Retained payloads are remembered and sent
        again after a reconnect.

        Raises:
            PacketTooLargeError: the packet exceeds the broker's Maximum Packet Size.
            InternalError: the bridge is stopped.
        """
        qos = self.config.qos if qos is None else qos
        limit = self.max_packet_bytes
        if limit is not None:
            size = publish_packet_size(topic, payload, qos, properties)
            if size > limit:
                self.counters.inc("publish_too_large")
                raise PacketTooLargeError(
                    f"a {size}-byte message on {topic} exceeds the broker's maximum packet size of {limit} bytes",
                    details={"packet_bytes": size, "max_packet_bytes": limit, "topic": topic},
                )
        if retain:
            self._retained[topic] = payload
        client = self._client
        if client is None:
            if retain:  # not started yet: sent on connect
                return None
            raise InternalError("MQTT bridge is stopped")
        return client.publish(topic, payload, qos=qos, retain=retain, properties=properties)

    def publish_safe(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        """:meth:`publish`, logging instead of raising (telemetry, events, source state)."""
        try:
            self.publish(topic, payload, retain=retain)
        except EdgeVLMError as err:
            logger.warning("MQTT: not published on %s: %s", topic, err.message)
            return False
        return True

    def update_online(self, **fields: Any) -> None:
        """Change fields of the "online" status (e.g. ``model`` after a reload) and re-publish it."""
        self._online = self._online.model_copy(update=fields)
        if self._connected.is_set():
            online = self._online.model_copy(update={"ts": time.time()})
            self.publish_safe(self.status_topic, online.to_bytes(), retain=True)

    def add_handler(self, topic: str, handler: MessageHandler) -> None:
        """Also subscribe to ``topic`` (on every connect) and pass its messages to ``handler``
        (on paho's thread: keep it short). Call before :meth:`start`."""
        self._handlers[topic] = handler

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

    def drop_request(self, reason: str, message: str, *args: Any) -> None:
        """Count (counters and ``edgevlm_requests_dropped_total{reason}``) and log a request that
        cannot be answered (also one of an :meth:`add_handler` topic). The counter goes last: whoever
        sees it has the log line and the metric too."""
        logger.warning(message, *args)
        if self.metrics is not None:
            self.metrics.request_dropped(reason)
        self.counters.inc(reason)

    def _handle(self, msg: Any) -> None:
        received = self.receipt_clock.received(getattr(msg, "qos", 1))
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
            self.drop_request("invalid_response_topic",
                              "MQTT: dropping a request whose Response Topic %r cannot be published to (a wildcard, "
                              "a control character, a non-character, NUL or too long)", response_topic)  # fmt: skip
            return

        payload: bytes = msg.payload
        digest = payload_digest(payload)
        prop_correlation = getattr(props, "CorrelationData", None) if props is not None else None
        if response_topic is not None and prop_correlation is not None:
            # the address is in the properties: a re-send is recognised before any JSON is parsed
            if self._duplicate((response_topic, b"D" + bytes(prop_correlation)), digest, response_topic,
                               prop_correlation, received, message_deadline_ms(msg)):  # fmt: skip
                return
            early_key: DedupKey | None = (response_topic, b"D" + bytes(prop_correlation))
        else:
            early_key = None
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
            self.drop_request("no_reply_address",
                              "MQTT: dropping a request with no Response Topic and no valid 'reply_to' field "
                              "(MQTT 3.1.1 clients: add reply_to/correlation_id to the JSON)")  # fmt: skip
            return

        key = early_key
        if key is None:
            if correlation_data is not None:
                key = (topic, b"D" + bytes(correlation_data))
            elif correlation_id is not None:
                key = (topic, b"I" + correlation_id.encode())
            if key is not None and self._duplicate(key, digest, topic, correlation_data, received,
                                                   message_deadline_ms(msg)):  # fmt: skip
                return

        request: Request | None = None
        if error is None and data is not None:
            try:
                request = parse_request(data)
                check_inline_image(request, self.limits)
            except (InvalidRequestError, InvalidImageError) as err:
                error = err
        expiry_s = getattr(props, "MessageExpiryInterval", None) if props is not None else None
        timeout_ms = message_deadline_ms(msg)  # an invalid request's (its own timeout_ms is not known)
        limit = "timeout_ms"
        if request is not None and error is None:
            asked_ms = request_timeout_ms(request.timeout_ms, self.scheduler.defaults.timeout_ms)
            timeout_ms = request_timeout_ms(request.timeout_ms, self.scheduler.defaults.timeout_ms, expiry_s)
            if timeout_ms < asked_ms:
                limit = "message_expiry"
        if (request is not None and error is None and self._accepting and msg.topic == self.pool_topic
                and self._forward_to_member(msg, request, key, digest)):
            return
        reply = self._make_reply(topic, correlation_data, correlation_id, received, timeout_ms,
                                 None if key is None else (key, digest))  # fmt: skip
        if error is None and not self._accepting:
            error = shutting_down_error()
        if error is not None:
            self.counters.inc("requests_received")
            self.counters.inc(f"errors_{error.code.value}")
            logger.info("MQTT: request refused: %s", error.message)
            reply(Response.failure(error, correlation_id))
            return
        assert request is not None
        self.scheduler.submit(Job(request=request, reply=reply, received_monotonic=received, timeout_ms=timeout_ms,
                                  deadline_limit=limit, dedup=None if key is None else (key, digest)))  # fmt: skip
        if self.metrics is not None:
            self.metrics.set_queue_depth(self.scheduler.queue_size())

    def _forward_to_member(self, msg: Any, request: Request, key: DedupKey | None, digest: bytes) -> bool:
        """A pool request whose ``model`` is not served here but by another online member of the pool:
        publish it unchanged (payload, Response Topic, Correlation Data, Message Expiry) to that member's
        own request topic, which answers the requester directly. Returns whether it was forwarded. Only
        requests from the pool's topic are forwarded (a member's device topic is never), so nothing loops."""
        wanted, served = request.model, self.scheduler.model_id
        if wanted is None or served is None or wanted == served:
            return False
        with self._lock:
            members = sorted(d for d, s in self._peers.items()
                             if s.state == "online" and s.pool == self.config.pool and s.model_id == wanted)
        if not members:
            return False  # nobody serves it: the scheduler refuses it (or offloads it) as before
        member = random.choice(members)
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)
        src = getattr(msg, "properties", None)
        for name in ("ResponseTopic", "CorrelationData", "MessageExpiryInterval", "PayloadFormatIndicator",
                     "ContentType", "UserProperty"):
            value = getattr(src, name, None) if src is not None else None
            if value is not None and value != "":
                setattr(props, name, value)
        try:
            self.publish(request_topic(self.config.prefix, member), msg.payload, properties=props)
        except EdgeVLMError as err:
            logger.warning("MQTT: could not hand a request for model %r to pool member %r: %s", wanted, member,
                           err.message)
            return False
        if key is not None:
            self.recent_answers.forget(key, digest)  # a re-send that comes back here is handed on again
        logger.info("MQTT: pool request for model %r (served here: %r) handed to member %r", wanted, served, member)
        self.counters.inc("forwarded_to_member")
        return True

    def _on_peer_status(self, msg: Any) -> None:
        device = msg.topic.split("/")[-2]
        status: StatusMessage | None = None
        if msg.payload:
            try:
                status = StatusMessage.model_validate_json(msg.payload)
            except ValueError:
                logger.debug("MQTT: malformed status on %s ignored", msg.topic)
        with self._lock:
            if status is None or device == self.config.device_id:
                self._peers.pop(device, None)
            else:
                self._peers[device] = status

    def _duplicate(self, key: DedupKey, digest: bytes, topic: str, correlation_data: bytes | None,
                   received: float, timeout_ms: int) -> bool:  # fmt: skip
        """Record a request in the recent-answers cache; for a re-send of one already there, answer
        it from the cache (or absorb it while it runs) and return True. ``received``/``timeout_ms``:
        the re-send's receipt and deadline (its Message Expiry Interval), for the cached answer's."""
        seen, cached = self.recent_answers.claim(key, digest)
        if seen == "new":
            return False
        self.counters.inc(f"duplicate_{seen}")
        if self.metrics is not None:
            self.metrics.duplicate_request(seen)
        if cached is not None:  # answered already: the same response again, nothing runs twice
            logger.debug("MQTT: re-sent request on %s answered from the recent-answers cache", topic)
            self._publish_reply(topic, correlation_data, cached, received, timeout_ms)
        else:
            logger.debug("MQTT: re-sent request on %s is already queued or running", topic)
        return True

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
            response = self._publish_reply(topic, correlation_data, response, received, timeout_ms)
            if dedup is not None:
                self.recent_answers.settle(dedup[0], dedup[1], response)

        with self._lock:
            self._outstanding[key] = reply
        return reply

    def _observe(self, response: Response, received: float, timeout_ms: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_response(response, received, timeout_ms, self.scheduler.queue_size())

    def _publish_reply(self, topic: str, correlation_data: bytes | None, response: Response, received: float,
                       timeout_ms: int) -> Response:  # fmt: skip
        """Publish ``response`` (or the error that replaces it when it cannot be serialized or is
        too large for the broker) with the Message Expiry Interval of the time left until the
        request's deadline (``timeout_ms`` from ``received``, monotonic s); returns the response
        actually sent."""
        expiry_s = response_expiry_s(timeout_ms, time.monotonic() - received)
        props = response_properties(correlation_data, expiry_s)
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

    # ------------------------------------------------------------------ paho callbacks
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._connack_seen = True
        if reason_code.is_failure:
            logger.error("MQTT: connection refused by %s:%d: %s", self.config.host, self.config.port, reason_code)
            self.counters.inc("mqtt_connect_refused")  # after the log line (tests wait on the counter)
            return
        from paho.mqtt.subscribeoptions import SubscribeOptions

        self.max_packet_bytes = getattr(properties, "MaximumPacketSize", None) if properties else None
        self._connected.set()
        self._connected_at = time.monotonic()
        if self.backoff_delays_s and self.backoff_delays_s[-1] != self.config.reconnect_min_delay_s:
            # back to the normal backoff; a further quick close raises it again (see _on_disconnect)
            self._set_delays(self.config.reconnect_min_delay_s, self.config.reconnect_max_delay_s, client)
        self.counters.inc("mqtt_connects")
        logger.info("MQTT: connected%s; subscribing to %s%s",
                    f" (broker max packet {self.max_packet_bytes} B)" if self.max_packet_bytes else "",
                    self.request_filter if self.serve_requests else
                    f"{self.request_topic}'s other topics (the front processes take its requests)",
                    f" and, as a member of pool {self.config.pool!r}, {self.pool_subscription}"
                    if self.pool_subscription is not None and self._accepting else "")  # fmt: skip
        options = SubscribeOptions(qos=self.config.qos, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND)
        topics = []
        if self.serve_requests:
            topics.append((self.request_filter, options))
            if self.pool_subscription is not None and self._accepting:
                topics.append((self.pool_subscription, SubscribeOptions(qos=self.config.qos)))
        topics += [(t, SubscribeOptions(qos=self.config.qos, retainHandling=2)) for t in self._handlers]
        if self.peer_status_filter is not None:  # the retained statuses too (retain handling 0)
            topics.append((self.peer_status_filter, SubscribeOptions(qos=self.config.qos)))
        if topics:
            _, mid = client.subscribe(topics)
            self._sub_mids.add(mid)
        if self.announce:
            online = self._online.model_copy(update={"ts": time.time()})
            self.publish_safe(self.status_topic, online.to_bytes(), retain=True)
        if not topics:  # nothing to subscribe (front processes take the requests): ready now
            self._subscribed.set()
            if self.on_ready is not None:
                self.on_ready()
        for topic, payload in list(self._retained.items()):
            if topic != self.status_topic:
                self.publish_safe(topic, payload, retain=True)
        if self.on_connection is not None:
            self.on_connection(True, "connected")

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        cause = describe_connect_error(sys.exc_info()[1])  # paho calls this inside its `except OSError`
        logger.warning("MQTT: cannot connect to %s:%d: %s; retrying", self.config.host, self.config.port, cause)
        self.counters.inc("mqtt_connect_failures")

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        connack, self._connack_seen = self._connack_seen, False
        self._connected.clear()
        self._subscribed.clear()
        if self._stopping:
            return
        cfg = self.config
        if not connack and not getattr(flags, "is_disconnect_packet_from_server", False):
            # closed before any CONNACK: not a lost connection, a failed connect (what answered is not MQTT)
            logger.warning("MQTT: cannot connect to %s:%d: the connection closed before the broker's CONNACK "
                           "(%s): is that port an MQTT broker's, and plain or TLS (mqtt.tls) as that listener "
                           "expects? retrying", cfg.host, cfg.port, reason_code)  # fmt: skip
            self.counters.inc("mqtt_connect_failures")
            if self.on_connection is not None:
                self.on_connection(False, str(reason_code))
            return
        self.counters.inc("mqtt_disconnects")
        lived_s = time.monotonic() - self._connected_at
        from_broker = bool(getattr(flags, "is_disconnect_packet_from_server", False))
        taken_over = from_broker and getattr(reason_code, "value", None) == SESSION_TAKEN_OVER
        reason_string = getattr(properties, "ReasonString", None) if properties is not None else None
        if taken_over or lived_s < FLAP_S:
            # two daemons with one client id would kick each other off in a tight loop: back off
            self.quick_closes += 1
            delay = min(cfg.reconnect_max_delay_s, cfg.reconnect_min_delay_s * 2 ** (self.quick_closes - 1))
            self.backoff_delays_s.append(delay)
            self._set_delays(delay, max(delay, cfg.reconnect_max_delay_s), client)
            level, message = describe_disconnect(reason_code, from_broker, reason_string, lived_s, self.quick_closes,
                                                 cfg.effective_client_id, cfg.device_id)  # fmt: skip
            logger.log(level, "MQTT: %s; reconnecting in %.1f s", message, delay)
            self.counters.inc("mqtt_quick_disconnects")
            if taken_over:
                self.counters.inc("mqtt_session_taken_over")
        else:
            self.quick_closes = 0
            level, message = describe_disconnect(reason_code, from_broker, reason_string, lived_s, 0,
                                                 cfg.effective_client_id, cfg.device_id)  # fmt: skip
            logger.log(level, "MQTT: %s; reconnecting", message)
        if self.on_connection is not None:
            self.on_connection(False, str(reason_code))

    def track_publish(self, mid: int, topic: str) -> None:
        """Remember the topic of a response publish until its PUBACK (to name it if refused)."""
        with self._lock:
            self._reply_mids[mid] = topic
            while len(self._reply_mids) > 4096:  # PUBACKs lost with a connection: forget the oldest
                self._reply_mids.pop(next(iter(self._reply_mids)))

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        request_quick_ack(client)  # a PUBACK was read: ACK it now, so the broker sends the next request at once
        with self._lock:
            topic = self._reply_mids.pop(mid, None)
        if reason_code is not None and getattr(reason_code, "is_failure", False) and topic is not None:
            reason = str(reason_code)
            if properties is not None and getattr(properties, "ReasonString", None):
                reason += f" ({properties.ReasonString})"
            logger.warning("MQTT: the broker refused the response on %s: PUBACK reason 0x%02X %s (check its ACL)",
                           topic, reason_code.value, reason)  # fmt: skip
            if self.metrics is not None:
                self.metrics.request_dropped("response_refused")
            self.counters.inc("response_refused")  # last: whoever sees it has the log line and the metric

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        failed = [rc for rc in reason_codes if rc.is_failure]
        if failed:
            self.counters.inc("mqtt_subscribe_refused")
            logger.error("MQTT: subscription refused: %s (check the broker's ACL)", failed[0])
            if reason_codes[0].is_failure:
                return
        self._subscribed.set()
        if self.on_ready is not None:
            self.on_ready()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        request_quick_ack(client)
        try:
            handler = self._handlers.get(msg.topic)
            if handler is not None:
                handler(msg)
            elif self.peer_status_filter is not None and _is_status_topic(msg.topic, self.config.prefix):
                self._on_peer_status(msg)
            else:
                self._handle(msg)
        except Exception:  # noqa: BLE001 - an exception here would stop paho's network loop
            self.counters.inc("handler_errors")
            logger.exception("MQTT: unexpected error while handling a message on %s", msg.topic)


def _is_status_topic(topic: str, prefix: str) -> bool:
    """Whether ``topic`` is ``<prefix>/<device_id>/status`` (a daemon's retained status)."""
    return topic.startswith(prefix + "/") and topic.endswith("/status") and topic.count("/") == prefix.count("/") + 2
