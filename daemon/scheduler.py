"""The inference scheduler: a bounded request queue and ONE worker thread that owns the engine.

paho's network thread only validates requests and calls :meth:`Scheduler.submit`, which never
blocks: a full queue answers ``BUSY`` at once, an unknown source answers ``UNKNOWN_SOURCE`` at
once. The worker thread loads (or adopts) the :class:`edgevlm.runtime.Engine`, dequeues requests
in FIFO order, answers ``DEADLINE_EXCEEDED`` for a request whose deadline passed while it waited,
decodes inline images (``edgevlm.runtime.image.decode_image``), takes the newest frame of a
source, runs ``engine.ask`` and hands a :class:`~edgevlm.protocol.Response` to the job's reply
callback. Every exception becomes a typed wire error (unexpected ones ``INTERNAL``); the worker
never dies on a bad request.

With a latency controller (:mod:`edgevlm.daemon.budget`), :meth:`Scheduler.submit` also picks the
request's operating point: the queue wait is predicted as the remaining predicted time of what
runs now plus the predicted service time of every queued request, and a request that even the
cheapest point cannot serve within its deadline (the shorter of its ``budget_ms`` and
``timeout_ms``, its ``timeout_ms`` when it gives no budget; see :mod:`edgevlm.daemon.budget`) is
answered ``DEADLINE_EXCEEDED`` at once, the message naming that field, with
``details.cheapest_predicted_ms``. The worker re-fits
the point to the budget left when it dequeues the request, runs it, feeds the measured stats back
and reports ``operating_point``, ``budget_ms`` and ``predicted_ms`` in the response stats. Monitors
(:mod:`edgevlm.daemon.monitors`) run on the same worker, only while no request waits.

Deadlines are measured on the monotonic clock from the moment the daemon received the request;
:func:`request_timeout_ms` is the one rule (``timeout_ms``, else ``defaults.timeout_ms``, capped by
the MQTT v5 Message Expiry Interval; :data:`~edgevlm.protocol.NO_DEADLINE_MS` = none). A queued
request whose deadline passes is answered ``DEADLINE_EXCEEDED`` at that moment by a small deadline
thread, whatever the worker is doing. A request already running when its deadline passes is
finished and answered (the work is done; the client decides).

Continuous batching (``continuous_batching=True`` and an engine with ``max_batch_size >= 2`` cache
rows; see :mod:`edgevlm.daemon.batching`): the worker takes as many requests off the queue as there
are free cache rows, prepares each as above (deadline check, image, operating point), and steps a
:class:`~edgevlm.daemon.batching.BatchWorker`: waiting requests join the running decode batch
between decode steps, prefilled in groups of at most ``prefill_token_budget`` tokens, and each
request is answered as soon as it finishes. Between steps, queued requests whose deadline passed
are answered ``DEADLINE_EXCEEDED`` at once. The predicted queue wait counts the free rows: zero
while a row is free, else the predicted work ahead divided by the rows. Monitors run only while
the batch and the queue are empty.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from edgevlm.config import DefaultsConfig
from edgevlm.daemon.scheduler_worker import (  # noqa: F401  (re-exported: constants of the worker)
    FRAME_WAIT_S,
    HEARTBEAT_S,
    SchedulerWorker,
)
from edgevlm.daemon.sources import SourceManager
from edgevlm.errors import (
    BusyError,
    DeadlineExceededError,
    EdgeVLMError,
    ModelLoadError,
)
from edgevlm.protocol import NO_DEADLINE_MS, Request, Response

logger = logging.getLogger(__name__)

ReplyFn = Callable[[Response], None]


class Counters:
    """Thread-safe named event counters (requests, errors by code, dropped requests...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: collections.Counter[str] = collections.Counter()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def request_timeout_ms(timeout_ms: int | None, default_timeout_ms: int, message_expiry_s: int | None = None) -> int:
    """The deadline rule, in one place: how long (ms, from the daemon's receipt) a request may take.

    The request's ``timeout_ms`` (``default_timeout_ms`` when it gives none), capped by the MQTT v5
    *Message Expiry Interval* it arrived with (OASIS MQTT 5.0 section 3.3.2.3.3: the broker forwards
    the interval *remaining*, so time spent queued in the broker is already taken off; the SDK sets it
    from ``timeout_s``). :data:`~edgevlm.protocol.NO_DEADLINE_MS` means no deadline. Every deadline
    check (queue expiry, dequeue, the latency controller's budget, the frame wait, batching) uses
    :attr:`Job.deadline_monotonic`, derived from this value only.
    """
    limit = default_timeout_ms if timeout_ms is None else timeout_ms
    if message_expiry_s is not None and message_expiry_s >= 0:
        limit = min(limit, max(1, int(message_expiry_s) * 1000))
    return limit


@dataclass
class Job:
    """One accepted request waiting for the worker.

    ``timeout_ms`` is the request's effective deadline from ``received_monotonic``
    (:func:`request_timeout_ms`); ``deadline_limit`` names what set it (``"timeout_ms"`` or
    ``"message_expiry"``), for the ``DEADLINE_EXCEEDED`` message.
    """

    request: Request
    reply: ReplyFn
    received_monotonic: float = field(default_factory=time.monotonic)
    timeout_ms: int = NO_DEADLINE_MS
    choice: Any = None  # edgevlm.daemon.budget.Choice made at submit time (controller on)
    deadline_limit: str = "timeout_ms"

    @property
    def deadline_monotonic(self) -> float | None:
        """Monotonic time (s) after which the request is answered ``DEADLINE_EXCEEDED`` instead of
        being run; None = no deadline."""
        if self.timeout_ms >= NO_DEADLINE_MS:
            return None
        return self.received_monotonic + self.timeout_ms / 1000.0

    def expired(self, now: float) -> bool:
        """Whether the deadline has passed at monotonic time ``now``."""
        deadline = self.deadline_monotonic
        return deadline is not None and now > deadline


class Scheduler(SchedulerWorker):
    """Bounded FIFO + one inference worker.

    Args:
        engine_loader: called ONCE on the worker thread to load the engine (``Engine.load(...)``).
        sources: the configured camera sources.
        queue_max_size: waiting requests beyond this are answered ``BUSY``.
        defaults: ``max_new_tokens`` / ``timeout_ms`` of requests that leave them out.
        counters: shared event counters.
        engine: an already loaded engine, adopted by the worker instead of calling ``engine_loader``.
        heartbeat: liveness of the worker loop (``edgevlm.daemon.sdnotify.Heartbeat``): beaten
            every ``HEARTBEAT_S`` while idle, ``busy()`` around each request.
        controller_factory: called once on the worker thread with the loaded engine; returns the
            :class:`~edgevlm.daemon.budget.BudgetController` (or None = no operating-point
            choice). With a controller, :meth:`submit` predicts the queue wait, picks the operating
            point within the request's budget and refuses at once (``DEADLINE_EXCEEDED`` with
            ``cheapest_predicted_ms``) what cannot fit; the worker runs the point and feeds back
            the measured stats.
        monitors: a :class:`~edgevlm.daemon.monitors.MonitorRunner` run by the worker whenever
            no request is waiting (requests always go first).
        continuous_batching: decode concurrent requests together when the engine has several
            KV-cache rows (see the module doc); with one row the worker runs ``engine.ask``.
        prefill_token_budget: padded tokens per batched prefill group.
    """

    def __init__(
        self,
        engine_loader: Callable[[], Any] | None,
        sources: SourceManager,
        *,
        queue_max_size: int = 4,
        defaults: DefaultsConfig | None = None,
        counters: Counters | None = None,
        engine: Any = None,
        heartbeat: Any = None,
        controller_factory: Callable[[Any], Any] | None = None,
        monitors: Any = None,
        continuous_batching: bool = False,
        prefill_token_budget: int = 1024,
    ) -> None:
        if engine_loader is None and engine is None:
            raise ValueError("give engine_loader or engine")
        self._engine_loader = engine_loader
        self._engine = engine
        self.sources = sources
        self.queue_max_size = queue_max_size
        self.defaults = defaults or DefaultsConfig()
        self.counters = counters or Counters()
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._paused = 0
        self._stopping = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._heartbeat = heartbeat
        self._controller_factory = controller_factory
        self.controller: Any = None  # BudgetController once the engine is loaded
        self.monitors = monitors
        self._running: tuple[float, float] | None = None  # (start monotonic, predicted service ms)
        self.continuous_batching = continuous_batching
        self.prefill_token_budget = prefill_token_budget
        self._batch: Any = None  # BatchWorker of the current engine while batching
        self._batch_rows = 1  # KV-cache rows the worker batches over (1 = no batching)
        self._active: dict[int, tuple[float, float]] = {}  # batched jobs: id -> (start, predicted service ms)
        self._expiry_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, load_timeout_s: float | None = None) -> None:
        """Start the worker and wait until it has loaded the engine.

        Raises:
            ModelLoadError: the engine could not be loaded (or did not load in time).
        """
        self._thread = threading.Thread(target=self._run, name="edgevlm-inference", daemon=True)
        self._thread.start()
        self._expiry_thread = threading.Thread(target=self._expire_queued, name="edgevlm-deadlines", daemon=True)
        self._expiry_thread.start()
        if not self._ready.wait(load_timeout_s):
            raise ModelLoadError(f"the model did not load within {load_timeout_s} s")
        if self._load_error is not None:
            err = self._load_error
            if isinstance(err, ModelLoadError):
                raise err
            raise ModelLoadError(f"cannot load the model: {type(err).__name__}: {err}") from err

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, answer the queued ones ``BUSY`` ("shutting down"), let the
        running one finish (up to ``timeout_s``) and stop the worker."""
        with self._cond:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in dropped:
            self._reply(
                job, Response.failure(BusyError("the daemon is shutting down"), job.request.correlation_id)
            )
        if self._expiry_thread is not None:
            self._expiry_thread.join(2.0)
            self._expiry_thread = None
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("inference worker still running after %.1f s; leaving it", timeout_s)
            self._thread = None

    @property
    def engine(self) -> Any:
        return self._engine

    def queue_size(self) -> int:
        with self._cond:
            return len(self._queue)

    def queued(self) -> list[Job]:
        """A snapshot of the waiting jobs, oldest first."""
        with self._cond:
            return list(self._queue)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the worker: while inside, it takes no new request off the queue (a running one
        finishes). Requests keep queueing and overflow as ``BUSY``. For maintenance and tests."""
        with self._cond:
            self._paused += 1
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Inside :meth:`paused`: wait until the request (or monitor tick) in progress, if any, has
        finished. Returns False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._cond:
                if self._running is None:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def replace_engine(self, engine: Any, controller: Any = None) -> Any:
        """Hot reload: make ``engine`` (and its latency ``controller``) the one the worker uses from
        the next request on; call inside :meth:`paused` after :meth:`wait_idle`. Queued requests
        keep their place (their operating point is refitted against the new controller when they
        run). Returns the previous engine.

        Raises:
            ConfigError: the configured monitors do not fit the new model (nothing is swapped).
        """
        if self.monitors is not None and engine is not None:
            try:
                self.monitors.attach(engine)
            except BaseException:
                if self._engine is not None:
                    self.monitors.attach(self._engine)  # back to the model still serving
                raise
        with self._cond:
            old, self._engine = self._engine, engine
            self.controller = controller
        return old

    # ------------------------------------------------------------------ network side
    def submit(self, job: Job) -> bool:
        """Enqueue a job without blocking. Answers at once (via ``job.reply``) and returns False
        for an unknown source (``UNKNOWN_SOURCE``), a full queue (``BUSY``) or a stopping daemon."""
        self.counters.inc("requests_received")
        req = job.request
        try:
            if req.source is not None:
                self.sources.get(req.source)
        except EdgeVLMError as err:
            self._fail(job, err)
            return False
        with self._cond:
            if self._stopping:
                full: BusyError | None = BusyError("the daemon is shutting down")
            elif len(self._queue) >= self.queue_max_size:
                full = BusyError(
                    f"queue full ({self.queue_max_size} waiting); retry later",
                    details={"queue_max_size": self.queue_max_size},
                )
            else:
                full = self._choose(job)  # DeadlineExceededError when no point fits, else None
                if full is None:
                    self._queue.append(job)
                    self._cond.notify_all()
        if full is not None:
            self._fail(job, full)
            return False
        return True

    def _expire_queued(self) -> None:
        """Deadline thread: answer ``DEADLINE_EXCEEDED`` for every queued request whose deadline
        passes while it waits, at that moment, whatever the worker is doing (a long request, a
        batch step, a hot reload, :meth:`paused`)."""
        while True:
            with self._cond:
                if self._stopping:
                    return
                now = time.monotonic()
                expired = [j for j in self._queue if j.expired(now)]
                for job in expired:
                    self._queue.remove(job)
                if not expired:
                    deadlines = [d for j in self._queue if (d := j.deadline_monotonic) is not None]
                    wait_s = HEARTBEAT_S if not deadlines else min(HEARTBEAT_S, max(0.0, min(deadlines) - now) + 0.001)
                    self._cond.wait(wait_s)
                    continue
            for job in expired:
                self.counters.inc("deadline_expired_queued")
                self._fail_deadline(job, now)

    def predicted_wait_ms(self) -> float:
        """Predicted wait of a request submitted now: the remaining predicted time of the running
        request (or monitor tick) plus the predicted service time of every queued request."""
        with self._cond:
            return self._predicted_wait_locked(time.monotonic())

    def _predicted_wait_locked(self, now: float) -> float:
        if self._batch_rows > 1:
            return self._predicted_batched_wait_locked(now)
        wait = 0.0
        if self._running is not None:
            started, service_ms = self._running
            wait += max(0.0, service_ms - (now - started) * 1000.0)
        for queued in self._queue:
            if queued.choice is not None:
                wait += queued.choice.service_ms
        return wait

    def _predicted_batched_wait_locked(self, now: float) -> float:
        """Batched: zero while a cache row is free for the request, else the predicted work ahead
        of it (running remainders + queued services) shared by the rows."""
        rows = self._batch_rows
        if len(self._active) + len(self._queue) < rows:
            return 0.0
        ahead = sum(max(0.0, ms - (now - t) * 1000.0) for t, ms in self._active.values())
        ahead += sum(q.choice.service_ms for q in self._queue if q.choice is not None)
        return ahead / rows

    def _choose(self, job: Job) -> DeadlineExceededError | None:
        """Pick the job's operating point (``_cond`` held). Returns the refusal, or None."""
        ctl = self.controller
        if ctl is None:
            return None
        req = job.request
        now = time.monotonic()
        # budget: what the choice plans for; deadline: past it the request is refused now (see
        # edgevlm.daemon.budget); timeout_ms stays the hard deadline, checked again at dequeue
        budget, deadline = ctl.budget_for(req.budget_ms, job.timeout_ms)
        planned_tokens = ctl.expected_tokens(req.prompt, req.max_new_tokens or self.defaults.max_new_tokens)
        try:
            job.choice = ctl.choose(budget, max_new_tokens=planned_tokens,
                                    queue_wait_ms=self._predicted_wait_locked(now), deadline_ms=deadline,
                                    requested_budget_ms=req.budget_ms)
        except DeadlineExceededError as err:
            self.counters.inc("deadline_refused")
            return err
        return None
