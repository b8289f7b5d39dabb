"""Camera sources: one capture thread per configured source, keeping only the newest frame.

Each :class:`FrameSource` runs an OpenCV ``VideoCapture`` in its own thread and overwrites a
single *newest-frame slot* with every frame it reads, so a request always gets the most recent
frame and old frames never queue up (a slow consumer cannot make the camera fall behind).

- V4L2 (an index or ``/dev/videoN``): ``CAP_V4L2`` with a one-frame driver buffer.
- GStreamer pipeline: ``CAP_GSTREAMER`` (needs an OpenCV built with GStreamer, as on JetPack; the
  PyPI wheels are not).
- RTSP/HTTP URL: ``CAP_FFMPEG``.
- Video file: ``CAP_FFMPEG``, played in a loop and paced at its native fps (or ``fps`` from the
  config) so it behaves like a camera; each frame carries its media position ``pos_ms``.

A source that fails to open or stops delivering is reopened after ``reopen_delay_s``; the daemon
keeps running. Frames are converted to RGB uint8 ``(H, W, 3)``.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgevlm.config import SourceConfig
from edgevlm.errors import UnknownSourceError

logger = logging.getLogger(__name__)

_DEFAULT_FILE_FPS = 25.0
_MAX_LAG_S = 1.0  # a paced file that falls further behind than this re-anchors its clock


def _cv2() -> Any:
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("camera sources need OpenCV: pip install 'edgevlm[runtime]'") from exc
    return cv2


@dataclass(frozen=True)
class CapturedFrame:
    """One frame from a source.

    Attributes:
        source: source name.
        image: ``(H, W, 3)`` uint8 RGB.
        ts: capture timestamp, UNIX seconds (``time.time()`` when the frame was read/presented).
        pos_ms: media position in a video file (ms), None for live sources.
        index: frame index within the current loop of a video file, None for live sources.
        seq: frames delivered by this source so far (1 for the first), increasing.
    """

    source: str
    image: np.ndarray
    ts: float
    pos_ms: float | None
    index: int | None
    seq: int


def to_rgb(frame: np.ndarray) -> np.ndarray:
    """An OpenCV frame (BGR, BGRA or grey, uint8) as ``(H, W, 3)`` uint8 RGB."""
    cv2 = _cv2()
    if frame.ndim == 2:
        return cv2.cvtColor(frame, cv2.COLOR_GRAY2RGB)
    if frame.shape[2] == 4:
        return cv2.cvtColor(frame, cv2.COLOR_BGRA2RGB)
    if frame.shape[2] == 1:
        return cv2.cvtColor(frame[:, :, 0], cv2.COLOR_GRAY2RGB)
    return cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)


class FrameSource:
    """A capture thread for one :class:`~edgevlm.config.SourceConfig` with a newest-frame slot.

    Thread-safe: :meth:`latest` and :meth:`wait_for_frame` may be called from any thread.
    """

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self.name = config.name
        self.kind = config.kind
        self._cond = threading.Condition()
        self._latest: CapturedFrame | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.opens = 0
        self.open_failures = 0
        self.loops = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Start the capture thread (returns at once; frames arrive asynchronously)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"edgevlm-source-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the capture thread and release the device."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("source %s: capture thread did not stop within %.1f s", self.name, timeout_s)
            self._thread = None

    def latest(self) -> CapturedFrame | None:
        """The newest frame, or None if none was captured yet."""
        with self._cond:
            return self._latest

    def wait_for_frame(self, timeout_s: float | None, *, after_seq: int = 0) -> CapturedFrame | None:
        """Wait until a frame with ``seq > after_seq`` exists; returns it, or None on timeout/stop."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (self._latest is None or self._latest.seq <= after_seq) and not self._stop.is_set():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining if remaining is None else min(remaining, 1.0))
            return self._latest if self._latest is not None and self._latest.seq > after_seq else None

    # --------------------------------------------------------------- capture
    def _publish(self, bgr: np.ndarray, ts: float, pos_ms: float | None, index: int | None) -> None:
        rgb = to_rgb(bgr)
        with self._cond:
            self._seq += 1
            self._latest = CapturedFrame(self.name, rgb, ts, pos_ms, index, self._seq)
            self._cond.notify_all()

    def _open(self) -> Any:
        cv2 = _cv2()
        uri = self.config.uri
        if self.kind == "v4l2":
            api = cv2.CAP_V4L2 if sys.platform.startswith("linux") else cv2.CAP_ANY
            cap = cv2.VideoCapture(uri, api)
            if cap.isOpened():
                cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        elif self.kind == "gstreamer":
            cap = cv2.VideoCapture(str(uri), cv2.CAP_GSTREAMER)
        else:
            cap = cv2.VideoCapture(str(uri), cv2.CAP_FFMPEG)
        return cap

    def _run(self) -> None:
        delay_s = self.config.reopen_delay_s
        file_clock: float | None = None  # monotonic time at which the next loop's frame 0 is due
        while not self._stop.is_set():
            try:
                cap = self._open()
            except Exception as exc:  # noqa: BLE001 - a bad source must not kill the daemon
                cap = None
                self.last_error = f"{type(exc).__name__}: {exc}"
            if cap is None or not cap.isOpened():
                self.open_failures += 1
                if cap is not None:
                    cap.release()
                    self.last_error = f"cannot open {self.config.uri!r}"
                hint = " (is OpenCV built with GStreamer?)" if self.kind == "gstreamer" else ""
                log = logger.warning if self.open_failures == 1 else logger.debug
                log("source %s: %s%s; retrying every %.1f s", self.name, self.last_error, hint, delay_s)
                self._stop.wait(delay_s)
                continue
            self.opens += 1
            logger.info("source %s: opened %s (%s)", self.name, self.config.uri, self.kind)
            try:
                if self.kind == "file":
                    file_clock = self._play_file(cap, file_clock)
                    continue  # end of file: reopen at once and loop
                self._read_live(cap)
            except Exception as exc:  # noqa: BLE001
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.warning("source %s: capture error: %s", self.name, self.last_error)
            finally:
                cap.release()
            if not self._stop.is_set():
                logger.warning("source %s: stopped delivering; reopening in %.1f s", self.name, delay_s)
                self._stop.wait(delay_s)

    def _read_live(self, cap: Any) -> None:
        while not self._stop.is_set():
            ok, frame = cap.read()
            if not ok or frame is None:
                self.last_error = "read failed"
                return
            self._publish(frame, time.time(), None, None)

    def _play_file(self, cap: Any, clock: float | None) -> float | None:
        """Play one pass of the file paced at its fps; returns when it ends (or on stop) the
        monotonic time frame 0 of the next pass is due, so loops keep a steady cadence."""
        cv2 = _cv2()
        fps = self.config.fps or cap.get(cv2.CAP_PROP_FPS)
        if not fps or not math.isfinite(fps) or fps <= 0 or fps > 1000:
            fps = _DEFAULT_FILE_FPS
        period_s = 1.0 / fps
        t0 = time.monotonic() if clock is None else clock
        index = 0
        while not self._stop.is_set():
            ok, frame = cap.read()
            if not ok or frame is None:
                break
            pos_ms = cap.get(cv2.CAP_PROP_POS_MSEC)
            if not math.isfinite(pos_ms) or pos_ms < 0 or (pos_ms == 0 and index > 0):
                pos_ms = index * 1000.0 * period_s
            due = t0 + index * period_s
            now = time.monotonic()
            if now - due > _MAX_LAG_S:  # decoding slower than real time: re-anchor, don't burst
                t0 = now - index * period_s
            elif due > now and self._stop.wait(due - now):
                return None
            self._publish(frame, time.time(), float(pos_ms), index)
            index += 1
        if index == 0:
            self.last_error = "video file has no frames"
            raise RuntimeError(f"no frame could be read from {self.config.uri!r}")
        self.loops += 1
        return t0 + index * period_s


class SourceManager:
    """All configured sources by name."""

    def __init__(self, configs: list[SourceConfig]) -> None:
        self.sources: dict[str, FrameSource] = {c.name: FrameSource(c) for c in configs}

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    def get(self, name: str) -> FrameSource:
        """The source called ``name``; raises :class:`UnknownSourceError` naming the known ones."""
        try:
            return self.sources[name]
        except KeyError:
            known = ", ".join(sorted(self.sources)) or "none configured"
            raise UnknownSourceError(
                f"unknown source {name!r} (known: {known})",
                details={"source": name, "known": sorted(self.sources)},
            ) from None

    def start(self) -> None:
        for src in self.sources.values():
            src.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        for src in self.sources.values():
            src.stop(timeout_s)
