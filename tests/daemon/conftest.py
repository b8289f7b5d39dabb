"""Fixtures of the daemon tests: small video files written with OpenCV."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

# Distinct, codec-robust colours (RGB) for the frames of test videos: frame i has FRAME_COLOURS[i].
FRAME_COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


@pytest.fixture
def make_video(tmp_path: Path) -> Callable[..., Path]:
    """``make_video(n_frames=6, fps=10.0, size=(64, 48))`` writes an MPEG-4 file whose frame ``i``
    is filled with ``FRAME_COLOURS[i % 6]`` (RGB) and returns its path."""

    def _make(n_frames: int = 6, fps: float = 10.0, size: tuple[int, int] = (64, 48), name: str = "clip.mp4") -> Path:
        import cv2

        path = tmp_path / name
        w, h = size
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
        assert writer.isOpened(), "OpenCV cannot write mp4v"
        for i in range(n_frames):
            rgb = np.zeros((h, w, 3), np.uint8)
            rgb[:, :] = FRAME_COLOURS[i % len(FRAME_COLOURS)]
            writer.write(rgb[:, :, ::-1].copy())  # OpenCV writes BGR
        writer.release()
        return path

    return _make


def _colour_index(image: np.ndarray) -> int:
    mean = image.reshape(-1, 3).mean(axis=0)
    dists = [float(np.abs(mean - np.array(c)).sum()) for c in FRAME_COLOURS]
    return int(np.argmin(dists))


@pytest.fixture
def colour_index() -> Callable[[np.ndarray], int]:
    """``colour_index(rgb_image)``: which FRAME_COLOURS entry a frame shows (nearest mean colour)."""
    return _colour_index


class RawClient:
    """A plain paho client (MQTT v5 or 3.1.1) for driving the daemon byte by byte."""

    def __init__(self, host: str, port: int, *, protocol: int = 5) -> None:
        import threading

        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._cond = threading.Condition()
        self.messages: dict[str, list] = {}
        self._acked: set[int] = set()
        proto = mqtt.MQTTv5 if protocol == 5 else mqtt.MQTTv311
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=proto)
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.connect(host, port)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        with self._cond:
            self.messages.setdefault(msg.topic, []).append(msg)
            self._cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._cond:
            self._acked.add(mid)
            self._cond.notify_all()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        _, mid = self.client.subscribe(topic, qos)
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self._acked, 10), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, *, response_topic: str | None = None,
                correlation: bytes | None = None, retain: bool = False, qos: int = 1) -> None:
        props = None
        if response_topic is not None or correlation is not None:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.PUBLISH)
            if response_topic is not None:
                props.ResponseTopic = response_topic
            if correlation is not None:
                props.CorrelationData = correlation
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        info.wait_for_publish(10)

    def wait_messages(self, topic: str, n: int = 1, timeout_s: float = 30.0) -> list:
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


@pytest.fixture
def raw_client(mosquitto) -> Iterator[Callable[..., RawClient]]:
    """``raw_client(protocol=5)``: a connected :class:`RawClient` on the test broker."""
    clients: list[RawClient] = []

    def _make(protocol: int = 5) -> RawClient:
        c = RawClient(mosquitto.host, mosquitto.port, protocol=protocol)
        clients.append(c)
        return c

    yield _make
    for c in clients:
        c.close()


def encode(image: np.ndarray, ext: str = ".png") -> bytes:
    import cv2

    ok, buf = cv2.imencode(ext, image[:, :, ::-1].copy() if image.ndim == 3 else image)
    assert ok
    return buf.tobytes()


@pytest.fixture
def encode_image() -> Callable[..., bytes]:
    """``encode_image(rgb, ext=".png")``: an RGB uint8/uint16 array as image-file bytes (OpenCV)."""
    return encode
