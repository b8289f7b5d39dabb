"""Fixtures of the daemon tests: small video files written with OpenCV."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from mqtt_support import RecordingClient

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


class RawClient(RecordingClient):
    """A plain paho client (MQTT v5 or 3.1.1) for driving the daemon byte by byte."""


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
