"""One MQTT front process of the daemon (``mqtt.front_processes`` >= 1): the loop it runs.

A front owns a broker connection (client id ``<client_id>-front<i>``) in the MQTT v5 shared
subscription ``$share/edgevlm-front/<prefix>/<device_id>/request`` (and the pool's, for a pool
member), so the broker hands each request to one front. It runs today's request checks unchanged
(:class:`~edgevlm.daemon.mqtt_bridge.MqttBridge`: retain flag, reply address, duplicates, payload
size, JSON, :func:`~edgevlm.daemon.admission.check_inline_image`, the deadline rule
:func:`edgevlm.protocol.request_timeout_ms` from the receipt here — ``time.monotonic()`` is one
clock for every process of a Linux host), decodes the inline image to ``(H, W, 3)`` uint8 RGB on
one of its decode threads (:func:`edgevlm.runtime.image.decode_image`; a corrupt file is answered
``INVALID_IMAGE`` from here), and hands the request without its file, plus the pixels, to the
daemon's process over its :class:`~edgevlm.daemon.front_link.FrontLink`. A source request goes
without pixels (the frames live in the daemon's process). The daemon's process schedules and runs
it and sends back the response's JSON, which the front publishes on the request's Response Topic
with its Correlation Data.

What the front counts reaches the daemon's metrics: its event counters as deltas every
:data:`EVENTS_FLUSH_S`, and each answer it makes itself (a refusal) as ``observe_answer``. The
daemon's process owns the retained status (the front sets no last will). The front exits when the
daemon's process tells it to (after answering what it holds ``BUSY``) or when the link closes
(the daemon's process is gone): never an orphan.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from edgevlm.config import DaemonConfig, DefaultsConfig
from edgevlm.daemon.front_link import FrontLink, LinkClosed
from edgevlm.daemon.metrics_common import EventCounters
from edgevlm.errors import EdgeVLMError, InternalError, shutting_down_error
from edgevlm.protocol import Request, Response, StatusMessage

logger = logging.getLogger(__name__)

SHARE_GROUP = "edgevlm-front"
"""Shared-subscription group of a daemon's front processes (per request topic, so per device)."""
EVENTS_FLUSH_S = 0.5
DECODE_THREADS = 2
"""Threads of a front that decode inline images (OpenCV releases the GIL while decoding)."""
FORWARDED_METRICS = frozenset({"observe_answer", "request_dropped", "duplicate_request"})
"""The :class:`~edgevlm.daemon.metrics.Metrics` calls a front forwards to the daemon's process."""


def front_client_id(config: DaemonConfig, index: int) -> str:
    """The broker client id of front ``index``: ``<mqtt client id>-front<index>``."""
    return f"{config.mqtt.effective_client_id}-front{index}"


class _LinkedMetrics:
    """The front bridge's ``metrics``: forwards the calls in :data:`FORWARDED_METRICS` to the
    daemon's process; an answer that came from the daemon's process was observed there already."""

    def __init__(self, link: FrontLink) -> None:
        self._link = link
        self.relaying = threading.local()  # set while a response from the daemon's process is published

    def observe_response(self, response: Response, received_monotonic: float, timeout_ms: int,
                         queue_depth: int | None = None) -> None:  # fmt: skip
        if getattr(self.relaying, "on", False):
            return
        code = "OK" if response.ok else (response.error.code.value if response.error else "INTERNAL")
        self._forward("observe_answer", (None, code))

    def request_dropped(self, reason: str) -> None:
        self._forward("request_dropped", (reason,))

    def duplicate_request(self, seen: str) -> None:
        self._forward("duplicate_request", (seen,))

    def set_queue_depth(self, depth: int) -> None:
        """The queue is in the daemon's process: nothing to report from here."""

    def _forward(self, method: str, args: tuple[Any, ...]) -> None:
        try:
            self._link.send(("metric", method, args))
        except LinkClosed:
            pass


class LinkedSubmitter:
    """What the front's :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge` submits jobs to, in place
    of the :class:`~edgevlm.daemon.scheduler.Scheduler` (which lives in the daemon's process).

    :meth:`submit` decodes the job's inline image on a decode thread and sends the job over the
    link; :meth:`deliver` hands the daemon's response to the job's reply function.

    Args:
        link: this front's end of the link.
        defaults: the daemon's request defaults (``defaults.timeout_ms`` for the deadline rule).
        counters: the front's event counters.
        metrics: the bridge's metrics forwarder (to mark responses relayed from the daemon).
        max_pixels: the decoder's pixel limit (``limits.max_image_pixels``).
    """

    def __init__(self, link: FrontLink, defaults: DefaultsConfig, counters: EventCounters,
                 metrics: _LinkedMetrics, max_pixels: int) -> None:  # fmt: skip
        self.link = link
        self.defaults = defaults
        self.counters = counters
        self._metrics = metrics
        self._max_pixels = max_pixels
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}  # job id -> (reply function, correlation_id)
        self._decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="edgevlm-front-decode")

    def queue_size(self) -> int:
        """Jobs sent to the daemon's process and not answered yet."""
        with self._lock:
            return len(self._pending)

    def submit(self, job: Any) -> bool:
        """Forward ``job`` (an :class:`~edgevlm.daemon.scheduler.Job`): an inline image is decoded
        on a decode thread first (paho's thread goes back to the socket). Returns True (a refusal
        is answered through ``job.reply``)."""
        if job.request.image_bytes is None:
            self._forward(job, None)
            return True
        try:
            self._decoders.submit(self._decode_and_forward, job)
        except RuntimeError:  # shutting down
            self._refuse(job, shutting_down_error())
        return True

    def _decode_and_forward(self, job: Any) -> None:
        from edgevlm.runtime.image import decode_image

        try:
            pixels = decode_image(job.request.image_bytes, max_pixels=self._max_pixels)
        except EdgeVLMError as err:
            self._refuse(job, err)
            return
        except Exception as exc:  # noqa: BLE001 - never an unanswered request
            logger.exception("front: decoding an inline image failed unexpectedly")
            self._refuse(job, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        self._forward(job, pixels)

    def _refuse(self, job: Any, err: EdgeVLMError) -> None:
        self.counters.inc("requests_received")
        self.counters.inc(f"errors_{err.code.value}")
        logger.info("front: request refused: %s: %s", err.code.value, err.message)
        job.reply(Response.failure(err, job.request.correlation_id))

    def _forward(self, job: Any, pixels: Any) -> None:
        job_id = next(self._ids)
        with self._lock:
            self._pending[job_id] = (job.reply, job.request.correlation_id)
        request = _without_image(job.request)
        shape = None if pixels is None else tuple(pixels.shape)
        try:
            self.link.send(("job", job_id, request, job.received_monotonic, job.timeout_ms, job.deadline_limit,
                            shape, job.dedup), None if pixels is None else _contiguous(pixels))  # fmt: skip
        except LinkClosed:
            with self._lock:
                self._pending.pop(job_id, None)
            self._refuse(job, shutting_down_error())

    def deliver(self, job_id: int, payload: Any) -> None:
        """Publish the daemon's response (JSON bytes) for ``job_id`` through its reply function."""
        with self._lock:
            entry = self._pending.pop(job_id, None)
        if entry is None:
            self.counters.inc("late_replies_dropped")
            return
        reply, correlation_id = entry
        try:
            response = Response.model_validate_json(bytes(payload))
        except Exception as exc:  # noqa: BLE001 - never an unanswered request
            logger.error("front: an unreadable response from the daemon's process (%s); sending INTERNAL", exc)
            reply(Response.failure(InternalError("internal error: unreadable response"), correlation_id))
            return
        self._metrics.relaying.on = True
        try:
            reply(response)
        finally:
            self._metrics.relaying.on = False

    def stop(self) -> None:
        """Stop the decode threads (a job still decoding is answered ``BUSY`` by the bridge)."""
        self._decoders.shutdown(wait=True, cancel_futures=True)


def _without_image(request: Request) -> Request:
    """``request`` without its image file (the pixels travel as the payload)."""
    if request.image_b64 is None:
        return request
    stripped = request.model_copy(update={"image_b64": None})
    stripped._image_bytes = None
    return stripped


def _contiguous(pixels: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(pixels)


class Front:
    """A front process's parts: the bridge, the submitter, the counter flusher, the link loop.

    Args:
        index: this front's number (0-based; its client id ends ``-front<index>``).
        config: the daemon's validated configuration.
        link: this front's end of the link.
    """

    def __init__(self, index: int, config: DaemonConfig, link: FrontLink) -> None:
        from edgevlm.daemon.mqtt_bridge import MqttBridge

        self.index = index
        self.link = link
        self.counters = EventCounters()
        self.metrics = _LinkedMetrics(link)
        self.submitter = LinkedSubmitter(link, config.defaults, self.counters, self.metrics,
                                         config.limits.max_image_pixels)  # fmt: skip
        mqtt = config.mqtt.model_copy(update={"client_id": front_client_id(config, index)})
        online = StatusMessage(state="online", device_id=mqtt.device_id, pool=mqtt.pool)  # not published
        self.bridge = MqttBridge(mqtt, self.submitter, online, self.counters, limits=config.limits,  # type: ignore[arg-type]
                                 metrics=self.metrics, on_ready=self._on_ready, on_connection=self._on_connection,
                                 share_group=SHARE_GROUP, announce=False)  # fmt: skip
        self._flushed: dict[str, int] = {}
        self._stop = threading.Event()

    def _on_ready(self) -> None:
        try:
            self.link.send(("ready",))
        except LinkClosed:
            pass

    def _on_connection(self, up: bool, reason: str) -> None:
        """Tell the daemon's process about a change of this front's broker connection (a lost one
        makes this front not ready there until it has subscribed again)."""
        try:
            self.link.send(("connection", up, reason))
        except LinkClosed:
            pass

    def _flush_events(self) -> None:
        now = self.counters.snapshot()
        delta = {k: v - self._flushed.get(k, 0) for k, v in now.items() if v != self._flushed.get(k, 0)}
        self._flushed = now
        if delta:
            self.link.send(("events", delta))

    def _flush_loop(self) -> None:
        while not self._stop.wait(EVENTS_FLUSH_S):
            try:
                self._flush_events()
            except LinkClosed:
                return

    def run(self) -> None:
        """Serve until told to stop or until the link closes."""
        self.bridge.start()
        flusher = threading.Thread(target=self._flush_loop, name="edgevlm-front-events", daemon=True)
        flusher.start()
        message = "the daemon is shutting down"
        try:
            while True:
                meta, payload = self.link.recv()
                kind = meta[0]
                if kind == "reply":
                    self.submitter.deliver(meta[1], payload)
                elif kind == "stop_accepting":
                    self.bridge.stop_accepting()
                elif kind == "stop":
                    message = meta[1]
                    break
                else:
                    logger.warning("front %d: unknown link message %r", self.index, kind)
        except LinkClosed:
            logger.info("front %d: the daemon's process closed the link; stopping", self.index)
        self._stop.set()
        self.bridge.stop_accepting()
        self.submitter.stop()
        failed = self.bridge.fail_outstanding(shutting_down_error(message))
        if failed:
            logger.warning("front %d: %d request(s) in flight answered BUSY", self.index, failed)
        flusher.join(1.0)  # before the last flush: two flushes at once would send one delta twice
        try:
            self._flush_events()
        except LinkClosed:
            pass
        self.bridge.stop(timeout_s=5.0)
        self.link.close()


def front_main(index: int, config: DaemonConfig, sock: Any) -> None:
    """Entry point of front process ``index`` (a ``spawn`` child of the daemon's process). It ignores
    SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C and systemd's stop reach the whole process group):
    the daemon's process stops it through the link, and a closed link (that process gone) stops it."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level,
                        format=f"%(asctime)s %(levelname)s front{index} %(name)s: %(message)s")  # fmt: skip
    started = time.monotonic()
    front = Front(index, config, FrontLink(sock))
    logger.debug("front %d: started in %.2f s", index, time.monotonic() - started)
    front.run()
