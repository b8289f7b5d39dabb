"""An MQTT test client shared by the daemon and deployment tests (``pythonpath = ["tests"]``)."""

from __future__ import annotations

import threading
from typing import Any


class RecordingClient:
    """A plain paho client (MQTT v5 or 3.1.1) that records every message per topic, for driving
    the daemon byte by byte. ``tls``: ``username``/``password`` and ``ca_certs``/``certfile``/``keyfile``."""

    def __init__(self, host: str, port: int, *, protocol: int = 5, client_id: str = "", **tls: Any) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._cond = threading.Condition()
        self.messages: dict[str, list[Any]] = {}
        self._acked: set[int] = set()
        proto = mqtt.MQTTv5 if protocol == 5 else mqtt.MQTTv311
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=proto, client_id=client_id)
        if tls.get("username"):
            self.client.username_pw_set(tls["username"], tls.get("password"))
        if tls.get("ca_certs"):
            self.client.tls_set(ca_certs=tls["ca_certs"], certfile=tls.get("certfile"), keyfile=tls.get("keyfile"))
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.connect(host, port)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self._cond:
            self.messages.setdefault(msg.topic, []).append(msg)
            self._cond.notify_all()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        with self._cond:
            self._acked.add(mid)
            self._cond.notify_all()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        _, mid = self.client.subscribe(topic, qos)
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self._acked, 10), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, *, response_topic: str | None = None,
                correlation: bytes | None = None, retain: bool = False, qos: int = 1,
                expiry_s: int | None = None) -> None:  # fmt: skip
        props = None
        if response_topic is not None or correlation is not None or expiry_s is not None:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.PUBLISH)
            if response_topic is not None:
                props.ResponseTopic = response_topic
            if correlation is not None:
                props.CorrelationData = correlation
            if expiry_s is not None:
                props.MessageExpiryInterval = expiry_s
        self.client.publish(topic, payload, qos=qos, retain=retain, properties=props).wait_for_publish(10)

    def wait_messages(self, topic: str, n: int = 1, timeout_s: float = 30.0) -> list[Any]:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.messages.get(topic, [])) >= n, timeout_s)
            got = list(self.messages.get(topic, []))
        assert ok, f"expected {n} message(s) on {topic}, got {len(got)}"
        return got

    def count(self, topic: str) -> int:
        with self._cond:
            return len(self.messages.get(topic, []))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
