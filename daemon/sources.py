"""Camera sources: one supervised capture per configured camera, keeping only the newest frame.

Each :class:`FrameSource` overwrites a single *newest-frame slot* with every frame it reads, so a
request always gets the most recent frame and old frames never queue up. Capture backends
(:mod:`edgevlm.daemon.capture`: OpenCV for V4L2/files/RTSP/GStreamer, or a ``gst-launch-1.0``
subprocess) may block inside native code, so:

- A *reader thread* per attempt runs the backend's open and read calls; the source's *supervisor
  thread* watches it. No first frame within ``open_timeout_s``, or no frame for
  ``read_timeout_s``, and the supervisor abandons that attempt (aborting what can be aborted: a
  subprocess is killed; a stuck OpenCV call is left to return on its own and its thread then
  releases the device) and reconnects. A dead RTSP stream therefore never blocks for minutes.
  FFmpeg's own open/read timeouts (set to the same values) end the same way and are reported the
  same way: ``no frame within open_timeout_s=...`` and ``no frame for read_timeout_s=...`` (a
  stall), never as a failed open or the end of the stream.
- Reconnects back off exponentially from ``reopen_delay_s`` to ``reconnect_max_delay_s``; the
  backoff resets once a stream has delivered for a while. Video files loop: their end reopens at
  once (logged "opened" on the first open only).
- A live camera whose frames stay identical byte for byte for longer than ``frozen_after_s`` (a
  stuck pipeline resending one buffer; a real sensor's noise never repeats a frame exactly) is
  ``frozen`` until a different frame arrives; video files are not checked.
- State (``starting``, ``streaming``, ``frozen``, ``stalled``, ``reconnecting``, ``stopped``) changes are
  reported to a listener (the daemon publishes them retained on ``<prefix>/<device_id>/sources/
  <name>`` and counts them in the metrics).
- :meth:`FrameSource.frame_for_request` refuses a frame older than ``max_frame_age_s``: the
  request is answered with a typed error whose details say ``stale_frame`` and the frame's age;
  on a ``frozen`` camera the reason is ``frozen_frame``.
- A request about several recent frames (``frames`` / ``frames_s``, :meth:`FrameSource.recent_frames`)
  gets a contiguous clip: only frames of the newest frame's *run* (the frames read since the
  source last (re)connected; a video file's loops are one run). After an outage it therefore gets
  fewer frames than asked, never frames from before the outage (possibly minutes old) joined to
  new ones.

Frames are converted to RGB uint8 ``(H, W, 3)``; timestamps are UNIX seconds (``ts``) plus the
monotonic clock for age checks.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgevlm.config import SourceConfig
from edgevlm.daemon.capture import CaptureBackend, GstSubprocessCapture, capture_path, make_backend
from edgevlm.errors import InternalError, InvalidRequestError, UnknownSourceError
from edgevlm.protocol import MAX_REQUEST_FRAMES

logger = logging.getLogger(__name__)

_DEFAULT_FILE_FPS = 25.0
_MAX_LAG_S = 1.0  # a paced file that falls further behind than this re-anchors its clock
_STABLE_S = 10.0  # a stream that delivered this long resets the reconnect backoff
_FPS_WINDOW = 30

STARTING, STREAMING, FROZEN, STALLED = "starting", "streaming", "frozen", "stalled"
RECONNECTING, STOPPED = "reconnecting", "stopped"
SOURCE_STATES = (STARTING, STREAMING, FROZEN, STALLED, RECONNECTING, STOPPED)
_TIMEOUT_SHARE = 0.9  # a backend call that failed after this share of its timeout timed out

StateListener = Callable[["FrameSource", dict[str, Any]], None]


RECENT_FRAMES = MAX_REQUEST_FRAMES
"""Frames each source keeps (a ring) for requests about several recent frames (``frames`` /
``frames_s``)."""


def _cv2() -> Any:
    from edgevlm.daemon.capture import _cv2 as load

    return load()


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
        monotonic_s: ``time.monotonic()`` when the frame was read (for age checks).
        run: which connection of the source read it (1 for the first open that delivered; a
            reconnect after a failure or a stall starts a new run, a video file's loop does not).
    """

    source: str
    image: np.ndarray
    ts: float
    pos_ms: float | None
    index: int | None
    seq: int
    monotonic_s: float = 0.0
    run: int = 0

    def age_s(self) -> float:
        return max(0.0, time.monotonic() - self.monotonic_s)


def evenly_spaced(frames: list[CapturedFrame], n: int) -> list[CapturedFrame]:
    """``n`` of ``frames`` (oldest first) evenly spaced over them, the oldest and the newest kept
    (``n`` >= 2; ``n`` = 1: the newest), in order, no frame twice: how a ``frames_s`` window is
    sampled down to the frames a model takes. Fewer than ``n`` frames are returned as they are.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"evenly_spaced: n must be >= 1, got {n}")
    if len(frames) <= n:
        return list(frames)
    if n == 1:
        return [frames[-1]]
    last = len(frames) - 1
    return [frames[round(i * last / (n - 1))] for i in range(n)]


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


class _Attempt:
    """One open+read attempt run by a reader thread."""

    def __init__(self, backend: CaptureBackend) -> None:
        self.backend = backend
        self.opened = threading.Event()
        self.done = threading.Event()
        self.abandoned = False
        self.eof = False
        self.stalled = False  # the backend's own read timeout ended the stream
        self.loop_reopen = False  # reopened at the end of a video file (logged once, not per loop)
        self.first = False  # the source's first attempt (its open is logged at INFO)
        self.recovering = False  # an attempt after a failed one (its first frame is logged at INFO)
        self.frames = 0
        self.error: str | None = None
        self.thread: threading.Thread | None = None


class FrameSource:
    """A supervised capture for one :class:`~edgevlm.config.SourceConfig` (see the module doc).

    Thread-safe: :meth:`latest`, :meth:`wait_for_frame`, :meth:`frame_for_request` and
    :meth:`info` may be called from any thread.
    """

    def __init__(self, config: SourceConfig, *, listener: StateListener | None = None) -> None:
        self.config = config
        self.name = config.name
        self.kind = config.kind
        self.listener = listener
        self._cond = threading.Condition()
        self._latest: CapturedFrame | None = None
        self._recent: collections.deque[CapturedFrame] = collections.deque(maxlen=RECENT_FRAMES)
        self._seq = 0
        self._run = 0  # the current run (CapturedFrame.run): +1 at an attempt's first frame, loops excepted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._attempt: _Attempt | None = None
        self._frame_times: collections.deque[float] = collections.deque(maxlen=_FPS_WINDOW)
        self._state_lock = threading.RLock()
        self.state = STOPPED
        self.state_since = time.time()
        self.opens = 0
        self.open_failures = 0
        self.reconnects = 0
        self.stalls = 0
        self.loops = 0
        self.abandoned_threads = 0
        self.last_error: str | None = None
        self.negotiated: dict[str, Any] = {}
        self._same_since: float | None = None  # monotonic time of the first of the identical frames
        self._down_warned = False  # a failure was logged at WARNING and no recovery at INFO since
        self.frozen_checked = self.kind != "file" and config.frozen_after_s is not None

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Start the supervisor (returns at once; frames arrive asynchronously)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._set_state(STARTING)
        self._thread = threading.Thread(target=self._supervise, name=f"edgevlm-source-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop capturing and release the device."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        attempt = self._attempt
        if attempt is not None:
            attempt.abandoned = True
            attempt.backend.abort()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("source %s: capture thread did not stop within %.1f s", self.name, timeout_s)
            self._thread = None
        self._set_state(STOPPED)

    def latest(self) -> CapturedFrame | None:
        """The newest frame (any age), or None if none was captured yet."""
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
                self._cond.wait(1.0 if remaining is None else min(remaining, 1.0))
            return self._latest if self._latest is not None and self._latest.seq > after_seq else None

    def frame_for_request(self, wait_s: float, seq: int | None = None) -> CapturedFrame:
        """The newest frame if it is fresh (``max_frame_age_s``), else wait up to ``wait_s`` for a
        fresh one (not at all while the camera is ``reconnecting`` or ``stalled``: the single
        inference worker must not wait on a camera that is down). With ``seq`` (a request's
        ``frame_seq``): that frame, :meth:`frame_by_seq`.

        Raises:
            InvalidRequestError: ``seq`` is a frame the source does not hold (:meth:`frame_by_seq`).
            InternalError: no frame yet (details ``reason: no_frame``), only a frame that is too
                old (``reason: stale_frame``, with ``frame_age_s``, ``max_frame_age_s`` and the
                source ``state``), or a ``frozen`` camera (``reason: frozen_frame``, with
                ``frozen_for_s`` and ``frozen_after_s``); the message says which.
        """
        if seq is not None:
            return self.frame_by_seq(seq)
        self._check_frozen()
        max_age = self.config.max_frame_age_s
        if self.state in (RECONNECTING, STALLED):
            wait_s = 0.0  # the camera is down: answer now rather than hold the worker
        deadline = time.monotonic() + max(0.0, wait_s)
        frame = self.latest()
        while True:
            if frame is not None and (max_age is None or frame.age_s() <= max_age):
                return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            frame = self.wait_for_frame(remaining, after_seq=frame.seq if frame is not None else 0)
            if frame is None:
                break
        frame = self.latest()
        details: dict[str, Any] = {"source": self.name, "state": self.state}
        if frame is None:
            details["reason"] = "no_frame"
            raise InternalError(
                f"source {self.name!r} has not delivered a frame ({self.last_error or 'no frame yet'})",
                details=details,
            )
        age = frame.age_s()
        details.update(reason="stale_frame", frame_age_s=round(age, 3), max_frame_age_s=max_age)
        raise InternalError(
            f"source {self.name!r}: newest frame is {age:.1f} s old (max_frame_age_s={max_age}); "
            f"camera {self.state}" + (f": {self.last_error}" if self.last_error else ""),
            details=details,
        )

    def frame_by_seq(self, seq: int) -> CapturedFrame:
        """The frame numbered ``seq`` while the ring (:data:`RECENT_FRAMES`) still holds it: a
        ``frame_seq`` request (another question about the frame of an earlier answer).

        Raises:
            InvalidRequestError: the source holds no such frame (details ``reason: frame_gone`` with
                ``oldest_seq`` / ``newest_seq``, None before the first frame).
        """
        with self._cond:
            frame = next((f for f in self._recent if f.seq == seq), None)
            if frame is None and self._latest is not None and self._latest.seq == seq:
                frame = self._latest
            oldest = self._recent[0].seq if self._recent else None
            newest = self._latest.seq if self._latest is not None else None
        if frame is None:
            raise InvalidRequestError(
                f"frame_seq {seq}: source {self.name!r} no longer holds that frame (it keeps its last "
                f"{RECENT_FRAMES}: {oldest}..{newest})" if newest is not None and seq <= newest else
                f"frame_seq {seq}: source {self.name!r} has not delivered that frame (newest: {newest})",
                details={"reason": "frame_gone", "source": self.name, "frame_seq": seq,
                         "oldest_seq": oldest, "newest_seq": newest})  # fmt: skip
        return frame

    def recent_frames(self, wait_s: float, *, count: int | None = None,
                      window_s: float | None = None) -> list[CapturedFrame]:
        """Several recent frames for one request, oldest first, ending with the frame
        :meth:`frame_for_request` returns: the last ``count`` frames (fewer while the source has
        delivered fewer), or those captured within ``window_s`` seconds before the newest one (the
        newest :data:`RECENT_FRAMES` of them). The ring holds the last :data:`RECENT_FRAMES` frames
        (RGB arrays shared, not copied).

        A clip is contiguous: only frames of the newest one's run (:attr:`CapturedFrame.run`) are
        used, so after the camera reconnected a request gets the frames read since, fewer than
        ``count`` if need be (as before the source has delivered ``count``), never frames from
        before the outage (only the newest frame's age is checked against ``max_frame_age_s``).
        A video file's loops are one run.

        Raises:
            InternalError: as :meth:`frame_for_request` (no / stale / frozen newest frame).
        """
        newest = self.frame_for_request(wait_s)
        with self._cond:
            ring = [f for f in self._recent if f.seq <= newest.seq and f.run == newest.run]
        if count is not None:
            return ring[-count:]
        if window_s is None:
            return [newest]
        return [f for f in ring if newest.monotonic_s - f.monotonic_s <= window_s]

    def _check_frozen(self) -> None:
        if self.state != FROZEN:
            return
        with self._cond:
            since = self._same_since
        frozen_for = 0.0 if since is None else time.monotonic() - since
        raise InternalError(
            f"source {self.name!r}: camera frozen: the same frame for {frozen_for:.1f} s "
            f"(frozen_after_s={self.config.frozen_after_s})",
            details={"source": self.name, "state": FROZEN, "reason": "frozen_frame",
                     "frozen_for_s": round(frozen_for, 3), "frozen_after_s": self.config.frozen_after_s},
        )  # fmt: skip

    def fps(self) -> float | None:
        """Frames per second delivered over the last few frames (None before two frames)."""
        with self._cond:
            times = list(self._frame_times)
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        if time.monotonic() - times[-1] > self.config.read_timeout_s:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    def info(self) -> dict[str, Any]:
        """The source's published state (JSON-safe)."""
        frame = self.latest()
        fps = self.fps()
        return {
            "name": self.name,
            "kind": self.kind,
            "capture": capture_path(self.config),
            "state": self.state,
            "since": round(self.state_since, 3),
            "fps": None if fps is None else round(fps, 3),
            "frame_age_s": None if frame is None else round(frame.age_s(), 3),
            "frames": self._seq,
            "reconnects": self.reconnects,
            "stalls": self.stalls,
            "open_failures": self.open_failures,
            "last_error": self.last_error,
            "negotiated": dict(self.negotiated),
        }

    # --------------------------------------------------------------- state
    def _set_state(self, state: str, *, event: str | None = None) -> None:
        with self._state_lock:  # reader and supervisor threads both report
            if state == self.state and event is None:
                return
            self.state, self.state_since = state, time.time()
            if self.listener is not None:
                try:
                    self.listener(self, {**self.info(), "event": event or state})
                except Exception:  # noqa: BLE001 - a publishing problem must not stop capture
                    logger.exception("source %s: state listener failed", self.name)

    def _publish(self, bgr: np.ndarray, ts: float, pos_ms: float | None, index: int | None,
                 attempt: _Attempt) -> None:
        rgb = to_rgb(bgr)
        now = time.monotonic()
        frozen_for: float | None = None
        with self._cond:
            if self.frozen_checked:  # the previous RGB frame is a fresh array (never a reused buffer)
                prev = None if self._latest is None else self._latest.image
                if prev is not None and prev.shape == rgb.shape and np.array_equal(prev, rgb):
                    if self._same_since is None:
                        self._same_since = self._latest.monotonic_s
                    frozen_for = now - self._same_since
                else:
                    self._same_since = None
            self._seq += 1
            if attempt.frames == 0 and not attempt.loop_reopen:  # a (re)connect: frames before are another run
                self._run += 1
            self._latest = CapturedFrame(self.name, rgb, ts, pos_ms, index, self._seq, now, self._run)
            self._recent.append(self._latest)
            self._frame_times.append(now)
            self._cond.notify_all()
        if self.frozen_checked:
            self._frozen_state(frozen_for)

    def _frozen_state(self, frozen_for: float | None) -> None:
        """Enter ``frozen`` once identical frames last past ``frozen_after_s``; leave it on the
        first different frame."""
        limit = self.config.frozen_after_s
        if frozen_for is not None and limit is not None and frozen_for > limit and self.state == STREAMING:
            self.last_error = f"the same frame for {frozen_for:.1f} s (frozen_after_s={limit})"
            logger.warning("source %s: camera frozen: %s", self.name, self.last_error)
            self._set_state(FROZEN, event="frozen")
        elif frozen_for is None and self.state == FROZEN:
            logger.info("source %s: frames change again; no longer frozen", self.name)
            self._set_state(STREAMING, event="unfrozen")
    # --------------------------------------------------------------- supervisor
    def _supervise(self) -> None:
        failures = 0  # consecutive failed attempts (backoff exponent)
        file_clock: list[float | None] = [None]
        looped = False  # the next attempt reopens a video file at its end
        while not self._stop.is_set():
            try:
                backend = make_backend(self.config)
            except Exception as exc:  # noqa: BLE001 - e.g. unknown frame size: keep retrying, logged
                attempt = None
                self.last_error = f"{type(exc).__name__}: {exc}"
            else:
                attempt = _Attempt(backend)
                attempt.loop_reopen, looped = looped, False
                attempt.first = self.opens == 0 and self.open_failures == 0 and self.reconnects == 0
                attempt.recovering = self.reconnects > 0 and not attempt.loop_reopen
                self._attempt = attempt
                attempt.thread = threading.Thread(
                    target=self._reader, args=(attempt, file_clock), name=f"edgevlm-reader-{self.name}", daemon=True
                )
                attempt.thread.start()
                streamed_s = self._watch(attempt)
                if self._stop.is_set():
                    self._retire(attempt)
                    break
                if attempt.eof and self.kind == "file" and attempt.frames > 0:
                    self._retire(attempt)
                    self.loops += 1
                    failures = 0
                    looped = True
                    continue  # end of the video file: loop at once
                if streamed_s >= _STABLE_S:
                    failures = 0
                self._retire(attempt)
            if attempt is None or attempt.frames == 0:
                self.open_failures += 1
            failures += 1
            delay = min(self.config.reconnect_max_delay_s, self.config.reopen_delay_s * 2 ** (failures - 1))
            log = logger.warning if failures == 1 else logger.debug
            self._down_warned = self._down_warned or failures == 1
            hint = ""
            if self.kind in ("gstreamer", "csi") and capture_path(self.config) == "gst-launch-subprocess":
                hint = " (read through gst-launch-1.0: OpenCV lacks GStreamer)"
            log("source %s: %s%s; reconnecting in %.2f s", self.name, self.last_error, hint, delay)
            self._set_state(RECONNECTING, event="reconnecting")
            if self._stop.wait(delay):
                break
            self.reconnects += 1
        self._attempt = None

    def _watch(self, attempt: _Attempt) -> float:
        """Supervise one attempt until it ends, stalls or times out; returns how long it streamed."""
        cfg = self.config
        started = time.monotonic()
        first_frame_at: float | None = None
        seen = 0
        last_progress = started
        while not self._stop.is_set():
            if attempt.done.wait(0.05):
                break
            now = time.monotonic()
            if attempt.frames != seen:
                seen, last_progress = attempt.frames, now
                if first_frame_at is None:
                    first_frame_at = now
            if first_frame_at is None and now - started > cfg.open_timeout_s:
                self.last_error = f"no frame within open_timeout_s={cfg.open_timeout_s} s"
                self._abandon(attempt)
                break
            if first_frame_at is not None and now - last_progress > cfg.read_timeout_s:
                self.stalls += 1
                self.last_error = f"no frame for read_timeout_s={cfg.read_timeout_s} s"
                self._set_state(STALLED, event="stalled")
                self._abandon(attempt)
                break
        if attempt.done.is_set() and not attempt.abandoned and not self._stop.is_set() and attempt.error:
            self.last_error = attempt.error
            if attempt.stalled:  # the backend's own read timeout fired first
                self.stalls += 1
                logger.warning("source %s: %s; abandoning the capture", self.name, self.last_error)
                self._set_state(STALLED, event="stalled")
        return 0.0 if first_frame_at is None else time.monotonic() - first_frame_at

    def _abandon(self, attempt: _Attempt) -> None:
        attempt.abandoned = True
        attempt.backend.abort()
        logger.warning("source %s: %s; abandoning the capture", self.name, self.last_error)

    def _retire(self, attempt: _Attempt) -> None:
        attempt.abandoned = True
        attempt.backend.abort()
        if attempt.thread is not None:
            attempt.thread.join(1.0)
            if attempt.thread.is_alive():  # stuck in native code: it releases the device when it returns
                self.abandoned_threads += 1
                logger.warning("source %s: a capture call is still blocked (%d so far); leaving it",
                               self.name, self.abandoned_threads)  # fmt: skip

    # --------------------------------------------------------------- reader thread
    def _reader(self, attempt: _Attempt, file_clock: list[float | None]) -> None:
        backend = attempt.backend
        cfg = self.config
        opening = time.monotonic()
        try:
            self.negotiated = backend.open()
            attempt.opened.set()
            if attempt.abandoned:
                return
            # INFO once: the first open (a retry's is DEBUG, as its warning is after the first failure; the
            # source coming back is logged when it delivers), never per loop of a video file
            log = logger.info if attempt.first else logger.debug
            log("source %s: opened %s (%s)", self.name, cfg.uri or "csi", backend.path)
            if self.kind == "file":
                file_clock[0] = self._play_file(attempt, file_clock[0])
            else:
                while not attempt.abandoned and not self._stop.is_set():
                    reading = time.monotonic()
                    frame = backend.read()
                    # FFmpeg's read timeout fires inside a read that may still return the frames the
                    # decoder holds; the reads after it fail at once, like the end of a stream
                    if time.monotonic() - reading >= _TIMEOUT_SHARE * cfg.read_timeout_s:
                        attempt.stalled = True
                    if frame is None:
                        attempt.eof = True
                        break
                    if attempt.abandoned:
                        break
                    self._publish(frame, time.time(), None, None, attempt)
                    self._delivered(attempt)
            if attempt.eof and attempt.frames == 0 and self.kind == "file":
                attempt.error = "video file has no frames"
            elif attempt.stalled and attempt.frames == 0:
                attempt.stalled = False  # opened but never delivered: a failed open, not a stall
                attempt.error = f"opened, but no frame within read_timeout_s={cfg.read_timeout_s} s"
            elif attempt.stalled:
                attempt.error = f"no frame for read_timeout_s={cfg.read_timeout_s} s"
            elif attempt.eof and self.kind != "file":
                attempt.error = "read failed (end of stream)"
                if isinstance(backend, GstSubprocessCapture) and backend.error_text():
                    attempt.error += f": {backend.error_text()}"
        except Exception as exc:  # noqa: BLE001 - a bad source must not kill the daemon
            if isinstance(exc, OSError) and str(exc).startswith("cannot open"):
                attempt.error = str(exc)
                if not attempt.opened.is_set() and \
                        time.monotonic() - opening >= _TIMEOUT_SHARE * cfg.open_timeout_s:  # FFmpeg's open timeout
                    attempt.error = f"no frame within open_timeout_s={cfg.open_timeout_s} s ({exc})"
            else:
                attempt.error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                backend.close()
            except Exception:  # noqa: BLE001
                logger.debug("source %s: close failed", self.name, exc_info=True)
            attempt.done.set()

    def _delivered(self, attempt: _Attempt) -> None:
        attempt.frames += 1
        if attempt.frames == 1:
            self.opens += 1
            if attempt.recovering:  # INFO for the outage whose first failure was a WARNING, else DEBUG
                log = logger.info if self._down_warned else logger.debug
                log("source %s: streaming again (%s; reconnect %d)", self.name, attempt.backend.path, self.reconnects)
                self._down_warned = False
            self._set_state(STREAMING)

    def _play_file(self, attempt: _Attempt, clock: float | None) -> float | None:
        """Play one pass of the file paced at its fps; returns the monotonic time frame 0 of the
        next pass is due, so loops keep a steady cadence."""
        backend = attempt.backend
        fps = self.config.fps or backend.fps_hint()
        if not fps or not math.isfinite(fps) or fps <= 0 or fps > 1000:
            fps = _DEFAULT_FILE_FPS
        period_s = 1.0 / fps
        t0 = time.monotonic() if clock is None else clock
        index = 0
        while not self._stop.is_set() and not attempt.abandoned:
            frame = backend.read()
            if frame is None:
                break
            pos_ms = backend.position_ms()
            if pos_ms is None or not math.isfinite(pos_ms) or pos_ms < 0 or (pos_ms == 0 and index > 0):
                pos_ms = index * 1000.0 * period_s
            due = t0 + index * period_s
            now = time.monotonic()
            if now - due > _MAX_LAG_S:  # decoding slower than real time: re-anchor, don't burst
                t0 = now - index * period_s
            elif due > now and self._stop.wait(due - now):
                return None
            self._publish(frame, time.time(), round(float(pos_ms), 3), index, attempt)  # ms, 1 us resolution
            self._delivered(attempt)
            index += 1
        attempt.eof = True
        return t0 + index * period_s if index else None


class SourceManager:
    """All configured sources by name; ``listener`` gets every source's state changes."""

    def __init__(self, configs: list[SourceConfig], *, listener: StateListener | None = None) -> None:
        self.sources: dict[str, FrameSource] = {c.name: FrameSource(c, listener=listener) for c in configs}

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    def set_listener(self, listener: StateListener | None) -> None:
        for src in self.sources.values():
            src.listener = listener

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

    def infos(self) -> dict[str, dict[str, Any]]:
        return {name: src.info() for name, src in self.sources.items()}
