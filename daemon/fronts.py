"""The daemon's front processes, seen from the daemon's process (``mqtt.front_processes`` >= 1).

:class:`FrontProcesses` starts N :func:`~edgevlm.daemon.front.front_main` processes (``spawn``), one
:class:`~edgevlm.daemon.front_link.FrontLink` each, and one reader thread per link that turns a
front's ``job`` message into a :class:`~edgevlm.daemon.scheduler.Job` (the request without its
file, the decoded pixels as ``Job.image``, the receipt time and deadline the front computed) and
submits it to the :class:`~edgevlm.daemon.scheduler.Scheduler` as the in-process bridge does. The
job's reply function observes the response in the daemon's metrics (as the bridge does) and sends
its JSON back to the front that received the request. A front's counter deltas and metric calls
are applied to the daemon's counters and metrics: one metrics system.

A supervisor thread restarts a front that exits (logged at WARNING, counted as ``front_restarts``;
a front that keeps exiting within :data:`STABLE_S` of its start is restarted after a delay doubling
from :data:`SUPERVISE_S` up to :data:`RESTART_BACKOFF_MAX_S`, not every :data:`SUPERVISE_S`);
the requests it held are lost with it, and the SDK's re-send (same Correlation Data) reaches another
front through the shared subscription. Since the broker hands a re-send to any front, duplicates are
also recognised here, across the fronts, by the key and payload digest each front sends with a job
(:class:`~edgevlm.daemon.delivery.RecentAnswers`, as the one-process bridge does): a re-send of a job
still queued or running waits for that job's response, one already answered gets it again; nothing
runs twice. :meth:`stop` tells every front to answer what it holds and
disconnect, waits for them, and kills any that do not exit in time.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgevlm.config import DaemonConfig
from edgevlm.daemon.delivery import DedupKey, RecentAnswers
from edgevlm.daemon.front import FORWARDED_METRICS, front_main
from edgevlm.daemon.front_link import FrontLink, LinkClosed
from edgevlm.daemon.metrics_common import EventCounters
from edgevlm.daemon.scheduler import Job, Scheduler
from edgevlm.errors import EdgeVLMError, InternalError
from edgevlm.protocol import Response

logger = logging.getLogger(__name__)

SUPERVISE_S = 0.2
"""How often the supervisor checks that every front process is alive (s)."""
RESTART_BACKOFF_MAX_S = 10.0
"""The longest delay before a front that keeps exiting soon after its start is started again (s)."""
STABLE_S = 30.0
"""A front that ran this long before it exited is restarted at once, its backoff reset (s)."""
STOP_JOIN_S = 10.0
"""How long :meth:`FrontProcesses.stop` waits for the fronts to exit before killing them (s)."""


@dataclass
class _Front:
    index: int
    process: Any
    link: FrontLink
    ready: bool = False
    reader: threading.Thread | None = None
    outstanding: dict[int, Callable[[Response], None]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # set once the supervisor found it dead: when it starts it again


class FrontProcesses:
    """N front processes feeding the scheduler (see the module doc).

    Args:
        config: the daemon's configuration.
        count: how many fronts (>= 1; ``mqtt.front_processes`` resolved by
            :func:`edgevlm.daemon.app.front_process_count`).
        scheduler: where the fronts' jobs go.
        counters: the daemon's event counters (the fronts' deltas are added to them).
        metrics: the daemon's :class:`~edgevlm.daemon.metrics.Metrics`, or None.
        on_ready: called (on a reader thread) whenever every front has subscribed.
        on_connection: called (on a reader thread) with ``(False, reason)`` when a front loses its
            broker connection (and is no longer ready until it has subscribed again: ``on_ready``).

    Raises:
        ValueError: ``count`` < 1.
    """

    def __init__(self, config: DaemonConfig, count: int, scheduler: Scheduler, counters: EventCounters,
                 metrics: Any = None, on_ready: Callable[[], None] | None = None,
                 on_connection: Callable[[bool, str], None] | None = None) -> None:  # fmt: skip
        if count < 1:
            raise ValueError(f"front processes: need at least 1, got {count}")
        self.config = config
        self.scheduler = scheduler
        self.counters = counters
        self.metrics = metrics
        self.on_ready = on_ready
        self.on_connection = on_connection
        self.count = count
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._fronts: list[_Front | None] = [None] * self.count
        self._stopping = False
        self._all_ready = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts = 0
        self._quick_exits = [0] * self.count  # per front: exits in a row within STABLE_S of a start
        self.recent_answers = RecentAnswers(config.mqtt.dedup_cache_size)
        self._waiters: dict[DedupKey, list[tuple[_Front, int]]] = {}  # in-flight key -> re-sends waiting on it

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the front processes and their supervisor (returns at once; :meth:`wait_ready`)."""
        for i in range(self.count):
            self._spawn(i)
        self._supervisor = threading.Thread(target=self._supervise, name="edgevlm-fronts", daemon=True)
        self._supervisor.start()
        logger.info("started %d MQTT front process(es)", self.count)

    def _spawn(self, index: int) -> None:
        ours, theirs = FrontLink.pair()
        process = self._ctx.Process(target=front_main, args=(index, self.config, theirs.sock),
                                    name=f"edgevlm-front{index}", daemon=True)  # fmt: skip
        process.start()
        theirs.close(shutdown=False)  # the child holds its own copy
        front = _Front(index, process, ours)
        front.reader = threading.Thread(target=self._read, args=(front,), name=f"edgevlm-front{index}-link",
                                        daemon=True)  # fmt: skip
        with self._lock:
            self._fronts[index] = front
            self._all_ready.clear()
        front.reader.start()

    def ready(self) -> bool:
        """Whether every front is subscribed to the request topics."""
        return self._all_ready.is_set()

    def wait_ready(self, timeout_s: float | None) -> bool:
        """Wait until every front is subscribed."""
        return self._all_ready.wait(timeout_s)

    def pids(self) -> list[int]:
        """The front processes' ids (for tests and the logs)."""
        with self._lock:
            return [f.process.pid for f in self._fronts if f is not None]

    def stop_accepting(self) -> None:
        """Tell every front to answer new requests ``BUSY`` (and leave the pool)."""
        for front in self._live():
            self._send(front, ("stop_accepting",))

    def fail_outstanding(self, err: EdgeVLMError) -> int:
        """Answer every job the fronts submitted that has no response yet with ``err``."""
        with self._lock:
            pending = [reply for f in self._fronts if f is not None for reply in f.outstanding.values()]
        for reply in pending:
            reply(Response.failure(err))
        return len(pending)

    def stop(self, message: str = "the daemon is shutting down") -> None:
        """Stop the fronts: each answers what it still holds ``BUSY`` (``message``), disconnects and
        exits; one that does not within :data:`STOP_JOIN_S` is killed. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if self._supervisor is not None:
            self._supervisor.join(2.0)
        fronts = self._live()
        for front in fronts:
            self._send(front, ("stop", message))
        deadline = time.monotonic() + STOP_JOIN_S
        for front in fronts:
            front.process.join(max(0.1, deadline - time.monotonic()))
            if front.process.is_alive():
                logger.warning("front %d did not exit in %.0f s; killing it", front.index, STOP_JOIN_S)
                front.process.kill()
                front.process.join(2.0)
            front.link.close()
            if front.reader is not None:
                front.reader.join(2.0)

    def _live(self) -> list[_Front]:
        with self._lock:
            return [f for f in self._fronts if f is not None]

    def _supervise(self) -> None:
        while True:
            time.sleep(SUPERVISE_S)
            with self._lock:
                if self._stopping:
                    return
                dead = [f for f in self._fronts if f is not None and not f.process.is_alive()]
            now = time.monotonic()
            for front in dead:
                if front.restart_at is None:  # found dead just now
                    quick = now - front.started < STABLE_S
                    k = self._quick_exits[front.index] = self._quick_exits[front.index] + 1 if quick else 0
                    delay_s = 0.0 if k <= 1 else min(RESTART_BACKOFF_MAX_S, SUPERVISE_S * 2 ** (k - 1))
                    front.restart_at = now + delay_s
                    logger.warning("front process %d (pid %s) exited with code %s; restarting it%s (%d request(s) "
                                   "it held are lost: clients re-send)", front.index, front.process.pid,
                                   front.process.exitcode, f" in {delay_s:.1f} s" if delay_s else "",
                                   len(front.outstanding))  # fmt: skip
                    front.link.close()
                    with self._lock:
                        front.ready = False
                        self._all_ready.clear()
                if now < front.restart_at:
                    continue
                with self._lock:
                    if self._stopping:
                        return
                self._spawn(front.index)
                self.restarts += 1
                self.counters.inc("front_restarts")

    # ------------------------------------------------------------------ link traffic
    def _read(self, front: _Front) -> None:
        while True:
            try:
                meta, payload = front.link.recv()
            except LinkClosed:
                return
            try:
                self._dispatch(front, meta, payload)
            except Exception:  # noqa: BLE001 - a bad message must not end the link
                logger.exception("front %d: handling a link message failed", front.index)

    def _dispatch(self, front: _Front, meta: tuple[Any, ...], payload: Any) -> None:
        kind = meta[0]
        if kind == "job":
            self._submit(front, meta, payload)
        elif kind == "events":
            for name, n in meta[1].items():
                self.counters.inc(name, n)
        elif kind == "metric":
            if self.metrics is not None and meta[1] in FORWARDED_METRICS:
                getattr(self.metrics, meta[1])(*meta[2])
        elif kind == "connection":  # ("connection", up, reason) from the front's broker connection
            if not meta[1]:
                with self._lock:
                    front.ready = False  # until it has subscribed again ("ready")
                    self._all_ready.clear()
                logger.warning("front %d lost its broker connection (%s)", front.index, meta[2])
                if self.on_connection is not None:
                    self.on_connection(False, f"front {front.index}: {meta[2]}")
        elif kind == "ready":
            with self._lock:  # set under the lock: another front's "connection" lost may clear it meanwhile
                front.ready = True
                everyone = all(f is not None and f.ready for f in self._fronts)
                if everyone:
                    self._all_ready.set()
            if everyone and self.on_ready is not None:
                self.on_ready()
        else:
            logger.warning("front %d: unknown link message %r", front.index, kind)

    def _submit(self, front: _Front, meta: tuple[Any, ...], payload: Any) -> None:
        import numpy as np

        _, job_id, request, received, timeout_ms, limit, shape, dedup = meta
        if dedup is not None:
            key, digest = dedup
            with self._lock:  # with the reply's answered/forget: a re-send never misses its answer
                seen, cached = self.recent_answers.claim(key, digest)
                if seen == "in_flight":
                    self._waiters.setdefault(key, []).append((front, job_id))
            if seen != "new":
                self.counters.inc(f"duplicate_{seen}")
                if self.metrics is not None:
                    self.metrics.duplicate_request(seen)
                if cached is not None:
                    self._send_reply(front, job_id, cached)
                return
        reply = self._reply_function(front, job_id, received, timeout_ms, dedup)
        try:
            image = None if shape is None else np.asarray(payload, dtype=np.uint8).reshape(shape)
            self.scheduler.submit(Job(request=request, reply=reply, received_monotonic=received, timeout_ms=timeout_ms,
                                      deadline_limit=limit, image=image))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - never an unanswered request (nor a key in flight for ever)
            logger.exception("front %d: submitting job %d failed", front.index, job_id)
            reply(Response.failure(InternalError(f"internal error: {type(exc).__name__}: {exc}"),
                                   request.correlation_id))  # fmt: skip
            return
        if self.metrics is not None:
            self.metrics.set_queue_depth(self.scheduler.queue_size())

    def _reply_function(self, front: _Front, job_id: int, received: float, timeout_ms: int,
                        dedup: tuple[DedupKey, bytes] | None = None) -> Callable[[Response], None]:  # fmt: skip
        """A once-only reply function: observe the response, send its JSON to ``front`` and to the
        fronts holding a re-send of it; remember it for later re-sends (a ``BUSY`` one is forgotten:
        a re-send runs again)."""
        done = threading.Lock()
        answered = [False]

        def reply(response: Response) -> None:
            with done:
                if answered[0]:
                    self.counters.inc("late_replies_dropped")
                    return
                answered[0] = True
            with self._lock:
                front.outstanding.pop(job_id, None)
                waiters = self._waiters.pop(dedup[0], []) if dedup is not None else []
                if dedup is not None:
                    self.recent_answers.settle(dedup[0], dedup[1], response)
            if self.metrics is not None:
                self.metrics.observe_response(response, received, timeout_ms, self.scheduler.queue_size())
            for target, target_job in [(front, job_id), *waiters]:
                self._send_reply(target, target_job, response)

        with self._lock:
            front.outstanding[job_id] = reply
        return reply

    def _send_reply(self, front: _Front, job_id: int, response: Response) -> None:
        """Send ``response``'s JSON to ``front`` as the answer to its job ``job_id``."""
        try:
            payload = response.to_bytes()
        except Exception as exc:  # noqa: BLE001 - never leave a request unanswered
            logger.error("a response cannot be serialized (%s); sending INTERNAL", exc)
            payload = Response.failure(InternalError(
                f"the response could not be serialized: {type(exc).__name__}"), response.correlation_id).to_bytes()
        try:
            front.link.send(("reply", job_id), payload)
        except LinkClosed:  # the front died: its client re-sends to another front
            self.counters.inc("responses_dropped")

    def _send(self, front: _Front, meta: tuple[Any, ...]) -> None:
        try:
            front.link.send(meta)
        except LinkClosed:
            pass
