"""The inference scheduler: a bounded request queue and ONE worker thread that owns the engine.

paho's network thread only validates requests and calls :meth:`Scheduler.submit`, which never
blocks: a full queue answers ``BUSY`` at once, an unknown source answers ``UNKNOWN_SOURCE`` at
once. The worker thread loads (or adopts) the :class:`edgevlm.runtime.Engine`, dequeues requests
in FIFO order, answers ``DEADLINE_EXCEEDED`` for a request whose deadline passed while it waited,
decodes inline images (``edgevlm.runtime.image.decode_image``; or takes them decoded by a prepare
thread, see below), takes the newest frame of a
source, runs ``engine.ask`` and hands a :class:`~edgevlm.protocol.Response` to the job's reply
callback. Every exception becomes a typed wire error (unexpected ones ``INTERNAL``); the worker
never dies on a bad request.

Threads around the worker (``prepare_threads``; the daemon starts them for a CUDA model): a job with
an inline image submitted while the worker is busy is decoded on a prepare thread, and when the worker
batches, also run through ``engine.prepare`` (tokens, preprocessed pixels) for the operating point
chosen at submit, so the worker only runs the model; the batched worker takes only jobs whose
preparation is done (oldest first), and reuses it while the engine and the point are still those it
was made for. A job submitted to an idle worker is prepared by the worker itself (no thread hand-off on
the one-request path); a source request always is (its newest frame is taken when it runs). The
responses the worker makes while more work waits are built and published by one reply thread, in
order; the others, and every refusal on another thread, are sent at once. The request path, start to
end: transport (:mod:`~edgevlm.daemon.mqtt_bridge` or :mod:`~edgevlm.daemon.openai_api`: validate,
:func:`~edgevlm.daemon.admission.check_inline_image`, the deadline rule
:func:`edgevlm.protocol.request_timeout_ms`) -> :meth:`Scheduler.submit` (source, model, queue
bound, operating point) -> prepare thread -> worker (:meth:`Scheduler._begin`, then ``engine.ask`` or
the :class:`~edgevlm.daemon.batching.BatchWorker`) -> reply thread -> the job's reply function.

With a latency controller (:mod:`edgevlm.daemon.budget`), :meth:`Scheduler.submit` also picks the
request's operating point: the queue wait is predicted as the remaining predicted time of what
runs now plus the predicted service time of every queued request, and a request that even the
cheapest point cannot serve within its deadline (the shorter of its ``budget_ms`` and
``timeout_ms``, its ``timeout_ms`` when it gives no budget; see :mod:`edgevlm.daemon.budget`) is
answered ``DEADLINE_EXCEEDED`` at once, the message naming that field, with
``details.cheapest_predicted_ms``. The worker re-fits
the point to the budget left when it dequeues the request, runs it, feeds the measured stats back
and reports ``operating_point``, ``budget_ms`` and ``predicted_ms`` in the response stats. A prompt
that does not fit the KV cache at the point the controller chose (``Engine.prepare``'s
:class:`~edgevlm.errors.PromptTooLongError`) runs at the point that refit picks among the cheaper
ones with fewer vision tokens (the most accurate whose prompt fits, within the budget left; the
stats name it), wherever it is prepared (the worker, a prepare thread, a batched admission: one
rule, :meth:`Scheduler._fit_prompt`); when none fits it is answered ``INVALID_REQUEST`` naming the
fewest tokens of the points tried. Without a controller (the model's default point) it is refused as
``Engine.prepare`` refuses it. Monitors (:mod:`edgevlm.daemon.monitors`) run on the same worker,
only while no request waits.

Deadlines are measured on the monotonic clock from the moment the daemon received the request;
:func:`edgevlm.protocol.request_timeout_ms` is the one rule (``timeout_ms``, else ``defaults.timeout_ms``,
capped by the MQTT v5 Message Expiry Interval; :func:`edgevlm.protocol.deadline_s`: none for
:data:`~edgevlm.protocol.NO_DEADLINE_MS`). A queued
request whose deadline passes is answered ``DEADLINE_EXCEEDED`` at that moment by a small deadline
thread, whatever the worker is doing. A request already running when its deadline passes is
finished and answered (the work is done; the client decides).

Continuous batching (``continuous_batching=True`` and an engine with ``max_batch_size >= 2`` cache
rows; see :mod:`edgevlm.daemon.batching`): the worker takes as many requests off the queue as there
are free cache rows, prepares each as above (deadline check, image, operating point), and steps a
:class:`~edgevlm.daemon.batching.BatchWorker`: waiting requests join the running decode batch
between decode steps, prefilled in groups of ``prefill_token_budget`` tokens or more while the
measured prefill time stays within ``prefill_budget_ms``, and each request is answered as soon as
it finishes. Between steps, queued requests whose deadline passed
are answered ``DEADLINE_EXCEEDED`` at once. The predicted queue wait counts the free rows: zero
while a row is free, else the predicted work ahead divided by the rows. Monitors run only while
the batch and the queue are empty. On a CUDA backend the worker first runs one prefill group of
each rows bucket (1, 2, 4, ... rows; :meth:`~edgevlm.daemon.batching.BatchWorker.warm_up`), so that
the CUDA graphs are captured before the first request rather than inside the first groups of each
size (a capture stalls the running requests for 50-100 ms).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from edgevlm.config import DefaultsConfig
from edgevlm.daemon.metrics_common import EventCounters
from edgevlm.daemon.sources import CapturedFrame, SourceManager, evenly_spaced
from edgevlm.errors import (
    QUEUE_FULL,
    BusyError,
    ConfigError,
    DeadlineExceededError,
    EdgeVLMError,
    InternalError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    shutting_down_error,
)
from edgevlm.protocol import NO_DEADLINE_MS, Frame, Request, Response, deadline_s, request_timeout_ms  # noqa: F401 (the rule, re-exported)
from edgevlm.types import Answer

logger = logging.getLogger(__name__)

ReplyFn = Callable[[Response], None]
_T = TypeVar("_T")


class StartupCancelled(Exception):
    """A stop signal came while the daemon started (:meth:`Scheduler.start`'s ``cancel``,
    :meth:`edgevlm.daemon.app.Daemon.start`): what had started is stopped again, nothing is announced."""


HEARTBEAT_S = 1.0
"""Period of the idle worker's heartbeat (s)."""

FRAME_WAIT_S = 5.0
"""How long a request waits for a source's first frame (bounded by its deadline)."""

GATHER_S = 0.002
"""How long the batching worker waits for requests still being prepared to join an admission (s)."""

WARM_UP_IMAGE_PX = (288, 384)
"""``(height, width)`` of the grey image the batching worker's start-up warm-up asks about (a 4:3
camera frame, the demo's scenes): the vision graphs are captured per input geometry."""
WARM_UP_PROMPT = "what is in the image ?"


def _same_preparation(a: Any, b: Any) -> bool:
    """Whether operating points ``a`` and ``b`` prepare a request the same way: equal but for
    ``max_new_tokens`` (a token cap the controller lifted at dequeue)."""
    if a is None or b is None:
        return a is b
    # field by field: a pydantic model_copy per request cost ~5% of the inference thread at 300 answers/s
    return a is b or (type(a) is type(b) and all(
        getattr(a, name) == getattr(b, name) for name in type(a).model_fields if name != "max_new_tokens"))


def default_prepare_threads() -> int:
    """Threads that decode and prepare inline images off the inference thread: half the CPUs, 1..8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass
class _Prepared:
    """What a prepare thread made of an inline-image job before the worker takes it: the decoded
    image and, when the worker batches, ``engine.prepare``'s result (tokens, preprocessed pixels)
    for ``engine`` at ``point`` (reused only while both still hold at dequeue)."""

    image: Any  # (H, W, 3) uint8 RGB
    engine: Any = None
    point: Any = None
    request: Any = None  # edgevlm.runtime.engine.PreparedRequest
    done_monotonic: float = 0.0  # when the preparation ended (for the response's stages_ms)


@dataclass
class _Started:
    """A dequeued job being served: what :meth:`Scheduler._begin` resolved for it."""

    dequeued: float  # monotonic
    queue_ms: float
    image: Any  # (H, W, 3) uint8 RGB, or a list of them (a frames / frames_s request, oldest first)
    frame: CapturedFrame | None  # the (newest) source frame, None for an inline image
    max_new_tokens: int
    point: Any = None  # OperatingPoint chosen by the controller (None = the model's default)
    predicted_ms: float | None = None
    service_ms: float = 0.0  # predicted worker time (batched: for the queue-wait prediction)
    frames: list[CapturedFrame] | None = None  # a frames / frames_s request's frames, oldest first
    window_frames: int | None = None  # frames in a frames_s window sampled down to the model's limit
    prepared: _Prepared | None = None  # made by a prepare thread (inline images)

    @property
    def frame_timestamps_s(self) -> list[float] | None:
        """Times of several frames, seconds relative to the oldest (None for one image): a video
        file's media positions when they increase (one loop), else the capture clock."""
        if self.frames is None:
            return None
        pos = [f.pos_ms for f in self.frames]
        if None not in pos and all(b > a for a, b in zip(pos, pos[1:], strict=False)):
            return [(p - pos[0]) / 1e3 for p in pos]
        return [f.monotonic_s - self.frames[0].monotonic_s for f in self.frames]


def request_stages_ms(job: Job, started: _Started, stats: Any) -> dict[str, float]:
    """Where an answered request's time went, for its response's ``stats.stages_ms``: the end of each
    stage in ms after the daemon received it (``Job.received_monotonic``), in order:

    - ``queued``: the transport's checks done (paho's thread: parse, validation, image header) and
      the job in the queue;
    - ``prepared``: its inline image decoded (and, batching, ``Engine.prepare`` done) on a prepare
      thread (absent when the worker prepared it itself);
    - ``dequeued``: taken by the worker (= ``queue_ms``);
    - ``admitted``: batching, its prefill group began (the wait for a row and a group);
    - ``first_token``, ``done``: ``ttft_ms`` / ``e2e_ms`` after ``dequeued``;
    - ``replied``: its response made (on the reply thread), just before it is published.

    The rest of a client's round trip is outside the daemon's clock: the broker both ways, the
    daemon's socket before paho reads it, and the publish after ``replied``."""
    r = job.received_monotonic
    stages: dict[str, float] = {}
    if job.queued_monotonic is not None:
        stages["queued"] = round((job.queued_monotonic - r) * 1000.0, 3)
    if started.prepared is not None and started.prepared.done_monotonic:
        stages["prepared"] = round((started.prepared.done_monotonic - r) * 1000.0, 3)
    q = started.queue_ms
    stages["dequeued"] = round(q, 3)
    admit_ms = getattr(stats, "admit_ms", None)  # BatchWorker: ms from dequeue to its prefill group
    if admit_ms is not None:
        stages["admitted"] = round(q + admit_ms, 3)
    stages["first_token"] = round(q + stats.ttft_ms, 3)
    stages["done"] = round(q + stats.e2e_ms, 3)
    return stages


def sampling_kwargs(req: Request) -> dict[str, Any]:
    """The sampling knobs a request sets (``temperature``, ``top_p``, ``stop``, ``seed``), as
    keyword arguments of ``Engine.stream`` / ``BatchWorker.add``; unset ones are left out so the
    engine's defaults (greedy, no stop string) apply."""
    knobs = {"temperature": req.temperature, "top_p": req.top_p, "stop": req.stop, "seed": req.seed}
    return {k: v for k, v in knobs.items() if v is not None}


@dataclass
class Job:
    """One accepted request waiting for the worker.

    ``timeout_ms`` is the request's effective deadline from ``received_monotonic``
    (:func:`edgevlm.protocol.request_timeout_ms`); ``deadline_limit`` names what set it (``"timeout_ms"`` or
    ``"message_expiry"``), for the ``DEADLINE_EXCEEDED`` message.
    """

    request: Request
    reply: ReplyFn
    received_monotonic: float = field(default_factory=time.monotonic)
    timeout_ms: int = NO_DEADLINE_MS
    choice: Any = None  # edgevlm.daemon.budget.Choice made at submit time (controller on)
    deadline_limit: str = "timeout_ms"
    on_delta: Callable[[str], None] | None = None  # streaming: called with each text delta, on the worker
    prepared: Future | None = None  # inline image: its decode (and batched: engine.prepare) on a prepare thread
    refit: tuple[Any, float, float] | None = None  # (point, service ms, predicted ms) fixed at a first dequeue
    queued_monotonic: float | None = None  # when submit() queued it (the transport's checks were done)
    image: Any = None  # (H, W, 3) uint8 RGB decoded by a front process (edgevlm.daemon.front); the request has no file
    dedup: Any = None  # (key, payload digest) of the MQTT recent-answers cache (a front's re-sends, fronts.py)
    too_long: list[tuple[Any, PromptTooLongError]] = field(default_factory=list)  # points its prompt overflowed

    def ready(self) -> bool:
        """Whether the worker can take the job without waiting for its preparation."""
        return self.prepared is None or self.prepared.done()

    @property
    def deadline_monotonic(self) -> float | None:
        """Monotonic time (s) after which the request is answered ``DEADLINE_EXCEEDED`` instead of
        being run; None = no deadline."""
        after_s = deadline_s(self.timeout_ms)
        return None if after_s is None else self.received_monotonic + after_s

    def expired(self, now: float) -> bool:
        """Whether the deadline has passed at monotonic time ``now``."""
        deadline = self.deadline_monotonic
        return deadline is not None and now > deadline


class Scheduler:
    """Bounded FIFO + one inference worker.

    Args:
        engine_loader: called ONCE on the worker thread to load the engine (``Engine.load(...)``).
        sources: the configured camera sources.
        queue_max_size: waiting requests beyond this are answered ``BUSY``.
        defaults: ``max_new_tokens`` / ``timeout_ms`` of requests that leave them out.
        counters: the daemon's event counters (:class:`~edgevlm.daemon.metrics_common.EventCounters`,
            exported by the metrics).
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
        prefill_token_budget: padded tokens per batched prefill group, at least.
        prefill_budget_ms: a group grows past ``prefill_token_budget`` while its measured vision
            encode + prefill time is predicted within this many ms (the stall it costs the running
            decodes; :data:`edgevlm.runtime.batching.DEFAULT_PREFILL_BUDGET_MS`); None = tokens only.
        prepare_threads: threads that decode inline images (and, batching, run ``engine.prepare``:
            tokenisation and preprocessing) while the request waits, so the inference thread
            only runs the model; 0 = all on the worker; None = :func:`default_prepare_threads`
            (the daemon gives 0 for a CPU model, whose compute needs the cores).
    """

    def __init__(
        self,
        engine_loader: Callable[[], Any] | None,
        sources: SourceManager,
        *,
        queue_max_size: int = 4,
        defaults: DefaultsConfig | None = None,
        counters: EventCounters | None = None,
        engine: Any = None,
        heartbeat: Any = None,
        controller_factory: Callable[[Any], Any] | None = None,
        monitors: Any = None,
        continuous_batching: bool = False,
        prefill_token_budget: int = 1024,
        prefill_budget_ms: float | None = 30.0,
        prepare_threads: int | None = None,
    ) -> None:
        if engine_loader is None and engine is None:
            raise ValueError("give engine_loader or engine")
        self._engine_loader = engine_loader
        self._engine = engine
        self.sources = sources
        self.queue_max_size = queue_max_size
        self.defaults = defaults or DefaultsConfig()
        self.counters = counters or EventCounters()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # the deadline thread's own condition on the same lock: woken by new jobs and stop, not by every
        # finished preparation (hundreds a second under load)
        self._expiry_cond = threading.Condition(lock)
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
        self.prefill_budget_ms = prefill_budget_ms
        self.offloader: Any = None  # edgevlm.daemon.offload.Offloader, set by the daemon (offload.pool)
        self.model_id: str | None = None  # the model served, for requests naming a 'model' (set by the daemon)
        self._batch: Any = None  # BatchWorker of the current engine while batching
        self._batch_rows = 1  # KV-cache rows the worker batches over (1 = no batching)
        self.warm_up_groups: list[int] = []  # group sizes of the last batched warm-up (CUDA graphs)
        self._active: dict[int, tuple[float, float]] = {}  # batched jobs: id -> (start, predicted service ms)
        self._expiry_thread: threading.Thread | None = None
        self.prepare_threads = default_prepare_threads() if prepare_threads is None else prepare_threads
        self._prepare_pool: ThreadPoolExecutor | None = None
        self._reply_pool: ThreadPoolExecutor | None = None  # one thread: responses built and sent in order

    # ------------------------------------------------------------------ lifecycle
    def start(self, load_timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        """Start the worker and wait until it has loaded the engine.

        ``cancel``: set (by a stop signal) while the engine loads, the wait ends within 0.1 s with
        :class:`StartupCancelled`; the load itself goes on in the worker thread (a daemon thread) until
        :meth:`stop` or the process ends.

        Raises:
            ModelLoadError: the engine could not be loaded (or did not load in time).
            ConfigError: the loaded engine cannot serve a config key (a monitor's label it has no classifier for).
            StartupCancelled: ``cancel`` was set before the engine had loaded.
        """
        if self.prepare_threads > 0:
            self._prepare_pool = ThreadPoolExecutor(self.prepare_threads, thread_name_prefix="edgevlm-prepare")
        self._reply_pool = ThreadPoolExecutor(1, thread_name_prefix="edgevlm-reply")
        self._thread = threading.Thread(target=self._run, name="edgevlm-inference", daemon=True)
        self._thread.start()
        self._expiry_thread = threading.Thread(target=self._expire_queued, name="edgevlm-deadlines", daemon=True)
        self._expiry_thread.start()
        deadline = None if load_timeout_s is None else time.monotonic() + load_timeout_s
        while not self._ready.is_set():
            if cancel is not None and cancel.is_set():
                raise StartupCancelled("stopped while the model loaded")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ModelLoadError(f"the model did not load within {load_timeout_s} s")
            self._ready.wait(0.1 if left is None else min(0.1, left))
        if self._load_error is not None:
            err = self._load_error
            if isinstance(err, (ModelLoadError, ConfigError)):  # a config key the loaded model cannot serve: named
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
            self._expiry_cond.notify_all()
        for job in dropped:
            if job.prepared is not None:
                job.prepared.cancel()
            self._reply(
                job, Response.failure(shutting_down_error(), job.request.correlation_id)
            )
        if self._expiry_thread is not None:
            self._expiry_thread.join(2.0)
            self._expiry_thread = None
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("inference worker still running after %.1f s; leaving it", timeout_s)
            self._thread = None
        for pool in (self._prepare_pool, self._reply_pool):  # the replies made so far go out first
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=pool is self._prepare_pool)
        self._prepare_pool = self._reply_pool = None

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
        # a frames / frames_s request stays here (the offload sends one inline image)
        several = req.frames is not None or req.frames_s is not None
        offload = None if several else self.offloader
        if req.model is not None and self.model_id is not None and req.model != self.model_id:
            if offload is not None and offload.cfg.on_unknown_model and offload.available(req.model):
                offload.submit(job, "unknown_model")
                return True
            self._fail(job, InvalidRequestError(
                f"model: {req.model!r} is not served here (this daemon serves {self.model_id!r})",
                details={"path": "model", "served": self.model_id}))
            return False
        with self._cond:
            if self._stopping:
                full: EdgeVLMError | None = shutting_down_error()
            elif len(self._queue) >= self.queue_max_size:
                full = BusyError(
                    f"queue full ({self.queue_max_size} waiting); retry later",
                    details={"reason": QUEUE_FULL, "queue_max_size": self.queue_max_size},
                )
            else:
                full = self._choose(job)  # DeadlineExceededError when no point fits, else None
                if full is None:
                    job.queued_monotonic = time.monotonic()
                    self._schedule_prepare(job)
                    self._queue.append(job)
                    self._cond.notify_all()
                    self._expiry_cond.notify()
        if (isinstance(full, DeadlineExceededError) and offload is not None and offload.cfg.on_budget_miss
                and offload.available()):  # the cheapest point misses the budget here: the pool may not
            offload.submit(job, "budget_miss")
            return True
        if full is not None:
            self._fail(job, full)
            return False
        return True

    def _schedule_prepare(self, job: Job) -> None:
        """Start an inline-image job's preparation on a prepare thread (``_cond`` held) when the
        worker is busy, so that it overlaps the running work; the worker is woken when it is done.
        An idle worker prepares the job itself (no thread hand-off on the latency path). A source
        request is resolved by the worker (its newest frame is taken when it runs)."""
        pool = self._prepare_pool
        if pool is None or (job.request.image_bytes is None and job.image is None) or not self._busy_locked():
            return
        try:
            job.prepared = pool.submit(self._prepare_inline, job)
        except RuntimeError:  # the pool is shutting down: the worker (or stop) deals with the job
            return
        job.prepared.add_done_callback(self._wake_worker)

    def _busy_locked(self) -> bool:
        """Whether the worker has work besides a newly submitted job (``_cond`` held, or a hint)."""
        batch = self._batch
        return bool(self._queue) or self._running is not None or (batch is not None and not batch.idle)

    def _wake_worker(self, _: Future) -> None:
        with self._cond:
            self._cond.notify_all()

    def _prepare_inline(self, job: Job) -> _Prepared:
        """Decode a job's inline image and, when the worker batches, run ``engine.prepare`` for the
        operating point chosen at submit (any thread; raises the typed errors the worker reports)."""
        from edgevlm.runtime.image import decode_image

        req = job.request
        prepared = _Prepared(job.image if job.image is not None else decode_image(req.image_bytes))
        batch, engine = self._batch, self._engine
        if batch is not None and batch.engine is engine and engine is not None:
            point = job.refit[0] if job.refit is not None else job.choice.point if job.choice is not None else None
            max_new_tokens = req.max_new_tokens or self.defaults.max_new_tokens
            prepared.request, fit = self._fit_prompt(job, point, max_new_tokens, lambda op: engine.prepare(
                prepared.image, req.prompt, operating_point=op, max_new_tokens=max_new_tokens, uint8_pixels=True,
                **sampling_kwargs(req)))
            if fit is not None:  # the prompt fits at a cheaper point only: the worker runs that one
                job.refit, point = fit, fit[0]
            prepared.engine, prepared.point = engine, point
        prepared.done_monotonic = time.monotonic()
        return prepared

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
                    if job.prepared is not None:
                        job.prepared.cancel()
                if not expired:
                    deadlines = [d for j in self._queue if (d := j.deadline_monotonic) is not None]
                    wait_s = HEARTBEAT_S if not deadlines else min(HEARTBEAT_S, max(0.0, min(deadlines) - now) + 0.001)
                    self._expiry_cond.wait(wait_s)
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

    def _choose(self, job: Job) -> EdgeVLMError | None:
        """Pick the job's operating point (``_cond`` held). Returns the refusal (DeadlineExceededError; an
        InvalidRequestError when no point can run its frames), or None."""
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
                                    requested_budget_ms=req.budget_ms, deadline_limit=job.deadline_limit,
                                    kinds=self._vision_kinds(req))
        except DeadlineExceededError as err:
            self.counters.inc("deadline_refused")
            return err
        except InvalidRequestError as err:  # no point of the controller can run its frames
            return err
        return None

    def _vision_kinds(self, req: Request) -> list[str]:
        """The vision items the engine makes of the request's frames (``Engine.vision_kinds``), for the
        controller to pass over the points they cannot take: an inline image or one source frame is one
        image; ``frames: N`` N frames (up to the model's limit: more is refused anyway), ``frames_s``
        several (its window's count is known when it runs; one frame then is one image)."""
        count = req.frames if req.frames is not None else 2 if req.frames_s is not None else 1
        vision_kinds = getattr(self._engine, "vision_kinds", None)
        if count == 1 or vision_kinds is None:
            return ["image"]
        return vision_kinds(max(1, min(count, int(getattr(self._engine, "max_frames", count)))))

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        if self._engine is None:
            try:
                self._engine = self._engine_loader()  # type: ignore[misc]  # checked in __init__
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                self._load_error = exc
                self._ready.set()
                return
        try:
            if self._controller_factory is not None:
                self.controller = self._controller_factory(self._engine)
            if self.monitors is not None:
                self.monitors.attach(self._engine)
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._load_error = exc
            self._ready.set()
            return
        batching = self._batching_engine() is not None  # before ready: submit() predicts with the rows
        self._ready.set()
        if batching:
            self._run_batched()
            return
        self._run_single()

    def _wait_locked(self, idle: Callable[[], bool]) -> None:
        """Wait on the condition (held) while ``idle()`` and not stopping, beating the heartbeat
        every ``HEARTBEAT_S``; return early when a monitor is due."""
        while not self._stopping and idle():
            if self._heartbeat is not None:
                self._heartbeat.beat()
            due = self.monitors.next_due() if self.monitors is not None and not self._paused else None
            now = time.monotonic()
            if due is not None and due <= now:
                return
            self._cond.wait(HEARTBEAT_S if due is None else min(HEARTBEAT_S, due - now))

    def _run_single(self) -> None:
        while True:
            with self._cond:
                self._wait_locked(lambda: self._paused or not self._queue)
                if self._stopping:
                    return
                if self._paused or not self._queue:
                    self._running = (time.monotonic(), self.monitors.tick_ms())
                    job = None
                else:
                    job = self._queue.popleft()
                    self._running = (time.monotonic(), job.choice.service_ms if job.choice is not None else 0.0)
            if job is None:  # a monitor is due and no request waits: monitors yield to requests
                try:
                    self.monitors.run_due(self._engine)
                finally:
                    with self._cond:
                        self._running = None
                continue
            try:
                if self._heartbeat is not None:
                    with self._heartbeat.busy():
                        self._process(job)
                else:
                    self._process(job)
            finally:
                with self._cond:
                    self._running = None

    def _process(self, job: Job) -> None:
        started = self._begin(job)
        if started is None:
            return
        ok, answer = self._guarded(job, "inference", lambda: self._generate(job, started))
        if ok:
            self._complete(job, started, answer)

    def _generate(self, job: Job, started: _Started) -> Answer:
        """Run one request on the engine; a streaming job gets each text delta as it is made."""
        req = job.request
        kwargs = {"max_new_tokens": started.max_new_tokens, **sampling_kwargs(req)}
        if started.frames is not None:
            kwargs["frame_timestamps_s"] = started.frame_timestamps_s
        if getattr(self._engine, "vision_cache", None) is not None:
            if started.frame is not None:
                # a source frame is named by its seq: the vision cache needs no pixel hash
                seqs = tuple(f.seq for f in started.frames) if started.frames is not None else (started.frame.seq,)
                kwargs["vision_key"] = ("source", started.frame.source, seqs)
            elif req.image_bytes is not None:
                # an inline image by its file's hash: a JPEG is ~60x smaller than its pixels (1080p: ~0.2
                # vs ~7 ms of hashing on a 2-core x86 CPU)
                kwargs["vision_key"] = ("inline", hashlib.blake2b(req.image_bytes, digest_size=16).hexdigest())

        def run(point: Any) -> Answer:  # the prompt is checked against the KV cache before the first token
            if job.on_delta is None:
                return self._engine.ask(started.image, req.prompt, operating_point=point, **kwargs)
            stream = self._engine.stream(started.image, req.prompt, operating_point=point, **kwargs)
            for delta in stream:
                job.on_delta(delta)
            return stream.answer

        answer, fit = self._fit_prompt(job, started.point, started.max_new_tokens, run)
        if fit is not None:
            started.point, started.service_ms, started.predicted_ms = fit
        return answer

    def _guarded(self, job: Job, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, fn())``; or, when ``fn`` raises, ``(False, None)`` after answering ``job`` with
        the typed error (an unexpected exception becomes INTERNAL, logged: never a dead daemon)."""
        try:
            return True, fn()
        except EdgeVLMError as err:
            self._fail(job, err)
        except Exception as exc:  # noqa: BLE001 - never a dead daemon
            logger.exception("%s failed with an unexpected error", what)
            self._fail(job, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
        return False, None

    def _begin(self, job: Job) -> _Started | None:
        """Dequeue-time work of a job: the deadline check, its image, and (with a controller) its
        operating point refitted to the budget left. Answers the job and returns None on failure."""
        dequeued = time.monotonic()
        queue_ms = (dequeued - job.received_monotonic) * 1000.0
        deadline = job.deadline_monotonic
        req = job.request
        if job.expired(dequeued):
            self._fail_deadline(job, dequeued)
            return None
        try:
            prepared = job.prepared.result() if job.prepared is not None else None  # raises its typed error
            if prepared is not None:
                image, frame, frames, window = prepared.image, None, None, None
            elif job.image is not None:  # decoded by a front process
                image, frame, frames, window = job.image, None, None, None
            else:
                image, frame, frames, window = self._resolve_image(req, deadline)
            started = _Started(dequeued, queue_ms, image, frame, req.max_new_tokens or self.defaults.max_new_tokens,
                               frames=frames, window_frames=window, prepared=prepared)
            if job.refit is not None:  # dequeued before, and prepared again for the point chosen then
                started.point, started.service_ms, started.predicted_ms = job.refit
            elif job.choice is not None and self.controller is not None:
                # the wait may differ from the prediction: refit the point to the budget left
                fit = self._refit(job, started.max_new_tokens)
                if fit is None:
                    raise self._no_point_fits(job)
                started.point, started.service_ms, started.predicted_ms = fit
        except EdgeVLMError as err:
            self._fail(job, err)
            return None
        except Exception as exc:  # noqa: BLE001 - never a dead daemon
            logger.exception("request preparation failed with an unexpected error")
            self._fail(job, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
            return None
        return started

    def _refit(self, job: Job, max_new_tokens: int) -> tuple[Any, float, float] | None:
        """The job's point refitted to the budget it has left now (:meth:`~edgevlm.daemon.budget.
        BudgetController.refit`), passing over the points its prompt did not fit at: ``(point,
        predicted service ms, predicted ms)``, the last the prediction at submit while the point is
        the one chosen then. None when no point is left."""
        ctl = self.controller
        elapsed_ms = (time.monotonic() - job.received_monotonic) * 1000.0
        planned_tokens = ctl.expected_tokens(job.request.prompt, max_new_tokens)
        fit = ctl.refit(job.choice, job.choice.budget_ms - elapsed_ms, max_new_tokens=planned_tokens,
                        too_long=[p for p, _ in job.too_long], kinds=self._vision_kinds(job.request))
        if fit is None:
            return None
        point, service_ms = fit
        return point, service_ms, job.choice.predicted_ms if point == job.choice.point else elapsed_ms + service_ms

    def _fit_prompt(self, job: Job, point: Any, max_new_tokens: int,
                    attempt: Callable[[Any], _T]) -> tuple[_T, tuple[Any, float, float] | None]:
        """``attempt(point)`` (``Engine.prepare``, itself or in ``Engine.ask`` / ``BatchWorker.add``);
        when the prompt does not fit the KV cache at a point the controller chose, ``attempt`` again
        at the job's point refitted without it and the points with as many vision tokens
        (:meth:`_refit`), until one fits. The one rule of the three prepare paths (the worker, a
        prepare thread, a batched admission). Returns the result and the refit ``(point, service ms,
        predicted ms)`` it ran at (None: at ``point``).

        Raises:
            PromptTooLongError: at a point the controller did not choose (none: the model's default),
                as raised; when no point fits, naming the fewest tokens of the points tried.
        """
        fit = None
        while True:
            try:
                return attempt(point), fit
            except PromptTooLongError as err:
                if job.choice is None or self.controller is None or point is None:
                    raise
                job.too_long.append((point, err))
                fit = self._refit(job, max_new_tokens)
                if fit is None:
                    raise self._no_point_fits(job) from None
                logger.info("prompt of %d tokens does not fit the KV cache at %s: trying %s", err.tokens, point.name,
                            fit[0].name)
                self.counters.inc("prompt_refits")
                point = fit[0]

    @staticmethod
    def _no_point_fits(job: Job) -> PromptTooLongError:
        """The refusal of a prompt that fits the KV cache at none of the points tried: the fewest tokens."""
        point, err = min(job.too_long, key=lambda t: t[1].tokens)
        names = [p.name for p, _ in job.too_long]
        tried = ", ".join(map(repr, names)) + (f"; the fewest tokens at {point.name!r}" if len(names) > 1 else "")
        return PromptTooLongError(f"no operating point fits the prompt in the KV cache (tried {tried}): {err.message}",
                                  tokens=err.tokens, capacity=err.capacity, vision_tokens=err.vision_tokens,
                                  details={"operating_point": point.name, "points_tried": names})

    def _complete(self, job: Job, started: _Started, answer: Answer) -> None:
        """Answer a job that ran: stats, controller feedback, the response."""
        req = job.request
        point = started.point
        try:
            answer.stats.queue_ms = started.queue_ms
            if started.window_frames is not None:
                answer.stats.window_frames = started.window_frames
            answer.stats.stages_ms = request_stages_ms(job, started, answer.stats)
            if point is not None:
                self.controller.observe(point, answer.stats, prompt=req.prompt)
                answer.stats.budget_ms = round(job.choice.budget_ms, 3)
                answer.stats.predicted_ms = round(started.predicted_ms, 3)
        except Exception as exc:  # noqa: BLE001 - never a dead daemon
            logger.exception("answering failed with an unexpected error")
            self._fail(job, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        self._send(job, lambda: self._success(job, started, answer))
        if point is not None:  # the worker's time around the engine call: decode, frame, reply
            self.controller.observe_overhead((time.monotonic() - started.dequeued) * 1000.0 - answer.stats.e2e_ms)

    def _success(self, job: Job, started: _Started, answer: Answer) -> Response:
        """The wire response of a job that ran (on the reply thread)."""
        req = job.request
        try:
            wire_frame = None
            if started.frame is not None:
                f = started.frame
                several = started.frames is not None
                wire_frame = Frame(source=f.source, ts=f.ts, pos_ms=f.pos_ms, index=f.index, seq=f.seq,
                                   frames=len(started.frames) if several else None,
                                   first_ts=started.frames[0].ts if several else None)
            stages = getattr(answer.stats, "stages_ms", None)
            if stages is not None:  # the response is made now, on the reply thread
                stages["replied"] = round((time.monotonic() - job.received_monotonic) * 1000.0, 3)
            response = Response.success(answer, wire_frame, req.correlation_id)
        except Exception as exc:  # noqa: BLE001 - never a dead daemon
            logger.exception("answering failed with an unexpected error")
            err = InternalError(f"internal error: {type(exc).__name__}: {exc}")
            self.counters.inc(f"errors_{err.code.value}")
            return Response.failure(err, req.correlation_id)
        self.counters.inc("responses_ok")
        return response

    def _fail_deadline(self, job: Job, now: float) -> None:
        queue_ms = (now - job.received_monotonic) * 1000.0
        limit = ("the request's Message Expiry Interval" if job.deadline_limit == "message_expiry"
                 else "deadline")  # fmt: skip
        self._fail(
            job,
            DeadlineExceededError(
                f"{limit} of {job.timeout_ms} ms passed after {queue_ms:.0f} ms in the queue",
                details={"timeout_ms": job.timeout_ms, "queue_ms": round(queue_ms, 3), "limit": job.deadline_limit},
            ),
        )

    # ------------------------------------------------------------------ continuous batching
    def _batching_engine(self) -> Any:
        """The BatchWorker for the current engine (rebuilt after a hot reload), or None when the
        worker runs one request at a time."""
        from edgevlm.daemon.batching import BatchWorker, batch_rows

        engine = self._engine
        if not self.continuous_batching or engine is None:
            return None
        if self._batch is not None and self._batch.engine is engine:
            return self._batch
        rows = batch_rows(engine)
        if rows < 2:
            logger.warning("continuous batching is on but the engine has %d KV-cache row(s) and/or no batched "
                           "entry points (backend %s): one request at a time", rows,
                           getattr(engine, "backend_name", "?"))
            self._batch, self._batch_rows = None, 1
            return None
        self._batch = BatchWorker(engine, self.prefill_token_budget, self.prefill_budget_ms)
        self._batch_rows = rows
        logger.info("continuous batching: %d KV-cache rows, prefill groups of >= %d tokens within %s ms",
                    rows, self.prefill_token_budget, self.prefill_budget_ms)
        self._warm_up(self._batch)
        return self._batch

    def _warm_up(self, batch: Any) -> None:
        """With CUDA graphs (a CUDA backend), capture the batched path's graphs for every rows bucket
        now (:meth:`BatchWorker.warm_up`), before requests come: at start-up, and for a hot-reloaded
        engine before it serves. A failure is logged and the worker serves anyway (a shape it
        missed is captured when first used, as without the warm-up)."""
        if not getattr(batch.engine.backend, "cuda_graphs", False):
            return
        import numpy as np

        t0 = time.monotonic()
        point = None  # the controller's choice with its default budget and no queue: what serving starts at
        if self.controller is not None:
            try:
                point = self.controller.choose(self.controller.default_budget_ms, max_new_tokens=2,
                                               queue_wait_ms=0.0).point
            except EdgeVLMError as err:  # no point fits the default budget: warm the model's default
                logger.info("batched warm-up at the model's default point: %s", err.message)
        try:
            sizes = batch.warm_up(np.full((*WARM_UP_IMAGE_PX, 3), 128, dtype=np.uint8), WARM_UP_PROMPT,
                                  operating_point=point)
        except Exception:  # noqa: BLE001 - a warm-up must never keep the daemon from serving
            logger.exception("batched warm-up failed; its CUDA graphs are captured when first used")
            return
        self.warm_up_groups = sizes
        logger.info("batched warm-up at %s: prefill groups of %s requests in %.0f ms (CUDA graphs captured)",
                    getattr(point, "name", "the default point"), sizes, (time.monotonic() - t0) * 1000.0)

    def _run_batched(self) -> None:
        while True:
            batch = self._batching_engine()
            if batch is None:  # a hot reload brought an engine that cannot batch
                self._run_single()
                return
            with self._cond:
                self._wait_locked(lambda batch=batch: batch.idle and (self._paused or not self._any_ready_locked()))
                if self._stopping and batch.idle:
                    return
                if batch.idle and batch.engine is not self._engine:
                    continue  # a hot reload swapped the engine while we waited: batch on the new one
                jobs: list[Job] = []
                if not self._paused and not self._stopping:
                    self._gather_locked(batch.free_slots())
                    jobs = self._take_ready_locked(batch.free_slots())
                now = time.monotonic()
                if batch.idle and not jobs and self._queue and not self._paused and not self._stopping:
                    self._cond.wait(0.002)  # only jobs still being prepared: their completion wakes us
                    continue
                monitor_tick = batch.idle and not jobs
                if monitor_tick:
                    self._running = (now, self.monitors.tick_ms() if self.monitors is not None else 0.0)
                else:
                    self._running = (now, 0.0)
            if monitor_tick:
                try:
                    if self.monitors is not None:
                        self.monitors.run_due(self._engine)
                finally:
                    with self._cond:
                        self._running = None
                continue
            for job in jobs:
                self._admit(batch, job)
            if not batch.idle:
                self._step(batch)
            if self._heartbeat is not None:
                self._heartbeat.beat()
            with self._cond:
                if batch.idle:
                    self._running = None

    def _gather_locked(self, free: int) -> None:
        """Before an admission (``_cond`` held): while some queued jobs are ready and others are still
        on a prepare thread, wait up to :data:`GATHER_S` for those, so that one admission (one vision
        batch, one prefill) takes them together. An admission's host work is nearly the same for 2
        requests as for 20 (kernel launches), and under load that work, not the GPU, bounds the
        answers per second; a lone request (nothing being prepared) is never held."""
        until = time.monotonic() + GATHER_S
        while not self._stopping and not self._paused:
            ready = sum(1 for job in self._queue if job.ready())
            if ready == 0 or ready >= free or ready == len(self._queue):
                return
            left = until - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _any_ready_locked(self) -> bool:
        return any(job.ready() for job in self._queue)

    def _take_ready_locked(self, limit: int) -> list[Job]:
        """Up to ``limit`` queued jobs whose preparation is done, oldest first (``_cond`` held)."""
        if limit <= 0:
            return []
        taken: list[Job] = []
        keep: collections.deque[Job] = collections.deque()
        for job in self._queue:
            if len(taken) < limit and job.ready():
                taken.append(job)
            else:
                keep.append(job)
        self._queue = keep
        return taken

    def _admit(self, batch: Any, job: Job) -> None:
        started = self._begin(job)
        if started is None:
            return
        pre = started.prepared  # engine.prepare done on a prepare thread, if still for this engine and point
        ready = None
        if pre is not None and pre.request is not None and pre.engine is batch.engine:
            if _same_preparation(pre.point, started.point):
                # the refit at most lifted the point's token cap: the request keeps the point it was prepared for
                started.point, ready = pre.point, pre.request
            elif self._prepare_again(job, started):
                return  # back in the queue, prepared for the refitted point on a prepare thread
        ok, done = self._guarded(job, "request preparation", lambda: self._fit_prompt(
            job, started.point, started.max_new_tokens, lambda op: batch.add(
                (job, started), started.image, job.request.prompt, max_new_tokens=started.max_new_tokens,
                operating_point=op, deadline_s=job.deadline_monotonic, on_delta=job.on_delta,
                prepared=ready if op is started.point else None, **sampling_kwargs(job.request))))
        if not ok:
            return
        if done[1] is not None:  # the prompt fits at a cheaper point only
            started.point, started.service_ms, started.predicted_ms = done[1]
        with self._cond:
            self._active[id(job)] = (started.dequeued, started.service_ms)
        self.counters.inc("batched_requests")

    def _prepare_again(self, job: Job, started: _Started) -> bool:
        """The refit at dequeue changed a prepared job's point: prepare it again for that point on a
        prepare thread and put it back at the head of the queue (the worker goes on with the others).
        False when it cannot (no prepare thread, stopping, or done once already)."""
        pool = self._prepare_pool
        if pool is None or job.refit is not None:
            return False
        job.refit = (started.point, started.service_ms, started.predicted_ms)
        with self._cond:
            if self._stopping:
                return False
            try:
                job.prepared = pool.submit(self._prepare_inline, job)
            except RuntimeError:  # shutting down
                return False
            job.prepared.add_done_callback(self._wake_worker)
            self._queue.appendleft(job)
            self._expiry_cond.notify()
        self.counters.inc("prepared_again")
        return True

    def _step(self, batch: Any) -> None:
        joins = batch.batcher.joins
        try:
            if self._heartbeat is not None:
                with self._heartbeat.busy():
                    finished = batch.step()
            else:
                finished = batch.step()
        except Exception as exc:  # noqa: BLE001 - never a dead daemon: fail the batch, keep serving
            logger.exception("batched inference step failed; answering its %d request(s) INTERNAL", batch.n_active)
            err = InternalError(f"internal error: {type(exc).__name__}: {exc}")
            finished = [(tag, err) for tag in batch.abort()]
        if batch.batcher.joins > joins:
            self.counters.inc("batch_joins", batch.batcher.joins - joins)
        for (job, started), answer in finished:
            with self._cond:
                self._active.pop(id(job), None)
            if answer is None:
                self._fail_deadline(job, time.monotonic())
            elif isinstance(answer, EdgeVLMError):
                self._fail(job, answer)
            else:
                self._complete(job, started, answer)

    def _resolve_image(self, req: Request, deadline: float | None
                       ) -> tuple[Any, CapturedFrame | None, list[CapturedFrame] | None, int | None]:
        """``(image or list of frames' images, newest source frame, the frames of a frames /
        frames_s request, the frames of a frames_s window that was sampled down)``.

        ``frames_s`` is a time window: when it holds more frames than the model takes in one request
        (``Engine.max_frames``: a family without video takes ``max_images``, e.g. 8) and the model
        takes several, the window is sampled to that many frames evenly spaced in it, the oldest and
        the newest kept (:func:`~edgevlm.daemon.sources.evenly_spaced`; as video VLM serving samples
        a clip's frames); the window's count is returned for ``stats.window_frames``. ``frames: N`` is
        a count the caller chose, sent as asked (the engine refuses more than its limit, naming it), as
        is any window for a one-image model."""
        if req.image_bytes is not None:
            from edgevlm.runtime.image import decode_image

            return decode_image(req.image_bytes), None, None, None
        assert req.source is not None  # guaranteed by Request validation
        src = self.sources.get(req.source)
        wait_s = FRAME_WAIT_S if deadline is None else max(0.0, min(FRAME_WAIT_S, deadline - time.monotonic()))
        # a fresh frame (max_frame_age_s), else InternalError with reason no_frame / stale_frame
        if req.frames is not None or req.frames_s is not None:
            frames = src.recent_frames(wait_s, count=req.frames, window_s=req.frames_s)
            limit = getattr(self._engine, "max_frames", None)  # None: an engine without a frame limit
            window = None
            if req.frames_s is not None and limit is not None and 2 <= limit < len(frames):
                window, frames = len(frames), evenly_spaced(frames, limit)
            return [f.image for f in frames], frames[-1], frames, window
        frame = src.frame_for_request(wait_s, req.frame_seq)
        return frame.image, frame, None, None

    def _fail(self, job: Job, err: EdgeVLMError) -> None:
        self.counters.inc(f"errors_{err.code.value}")
        logger.info("request failed: %s: %s", err.code.value, err.message)
        self._reply(job, Response.failure(err, job.request.correlation_id))

    def _reply(self, job: Job, response: Response) -> None:
        self._send(job, lambda: response)

    def _send(self, job: Job, make: Callable[[], Response]) -> None:
        """Hand ``make()``'s response to the job's reply function: from the inference thread on the
        reply thread (in order; serialising and publishing stay off the inference thread), from
        any other thread (an early refusal, the deadline thread, shutdown) at once, on it."""
        pool = self._reply_pool
        if pool is not None and threading.current_thread() is self._thread and self._more_work():
            try:
                pool.submit(self._deliver, job, make)
                return
            except RuntimeError:  # shut down meanwhile
                pass
        self._deliver(job, make)

    def _more_work(self) -> bool:
        """Whether the worker has more to do right now (then a reply is sent by the reply thread)."""
        batch = self._batch
        return bool(self._queue) or (batch is not None and not batch.idle)

    @staticmethod
    def _deliver(job: Job, make: Callable[[], Response]) -> None:
        try:
            job.reply(make())
        except Exception:  # noqa: BLE001 - a failed publish must not kill the worker
            logger.exception("could not send a response")
