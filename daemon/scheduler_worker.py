"""The worker side of :class:`~edgevlm.daemon.scheduler.Scheduler`: the inference thread's loops.

:class:`SchedulerWorker` is a mixin of :class:`~edgevlm.daemon.scheduler.Scheduler` (it uses the
scheduler's queue, condition and engine state): loading the engine, serving one request at a time
or stepping a continuous batch, monitors while no request waits, and answering every job (see the
module doc of :mod:`edgevlm.daemon.scheduler`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgevlm.daemon.sources import CapturedFrame
from edgevlm.errors import DeadlineExceededError, EdgeVLMError, InternalError
from edgevlm.protocol import Frame, Request, Response
from edgevlm.types import Answer

if TYPE_CHECKING:
    from edgevlm.daemon.scheduler import Job

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Period of the idle worker's heartbeat (s)."""

FRAME_WAIT_S = 5.0
"""How long a request waits for a source's first frame (bounded by its deadline)."""


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


class SchedulerWorker:
    """The inference worker thread of :class:`~edgevlm.daemon.scheduler.Scheduler` (a mixin)."""

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
        extra: dict[str, Any] = {}
        if started.frames is not None:
            extra["frame_timestamps_s"] = started.frame_timestamps_s
        if started.frame is not None and getattr(self._engine, "vision_cache", None) is not None:
            # a source frame is named by its seq: the vision cache needs no pixel hash
            seqs = tuple(f.seq for f in started.frames) if started.frames is not None else (started.frame.seq,)
            extra["vision_key"] = ("source", started.frame.source, seqs)
        ok, answer = self._guarded(job, "inference", lambda: self._engine.ask(
            started.image, job.request.prompt, max_new_tokens=started.max_new_tokens, operating_point=started.point,
            **extra))
        if ok:
            self._complete(job, started, answer)

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
        if deadline is not None and dequeued > deadline:
            self._fail_deadline(job, dequeued)
            return None
        try:
            image, frame, frames = self._resolve_image(req, deadline)
            started = _Started(dequeued, queue_ms, image, frame, req.max_new_tokens or self.defaults.max_new_tokens,
                               frames=frames)
            if job.choice is not None and self.controller is not None:
                # the wait may differ from the prediction: refit the point to the budget left
                elapsed_ms = (time.monotonic() - job.received_monotonic) * 1000.0
                planned_tokens = self.controller.expected_tokens(req.prompt, started.max_new_tokens)
                started.point, started.service_ms = self.controller.refit(
                    job.choice, job.choice.budget_ms - elapsed_ms, max_new_tokens=planned_tokens)
                # the prediction the point was chosen on: at submit, or now if the refit changed it
                started.predicted_ms = (job.choice.predicted_ms if started.point == job.choice.point
                                        else elapsed_ms + started.service_ms)
        except EdgeVLMError as err:
            self._fail(job, err)
            return None
        except Exception as exc:  # noqa: BLE001 - never a dead daemon
            logger.exception("request preparation failed with an unexpected error")
            self._fail(job, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
            return None
        return started

    def _complete(self, job: Job, started: _Started, answer: Answer) -> None:
        """Answer a job that ran: stats, controller feedback, the response."""
        req = job.request
        try:
            answer.stats.queue_ms = started.queue_ms
            point = started.point
            if point is not None:
                self.controller.observe(point, answer.stats, prompt=req.prompt)
                answer.stats.budget_ms = round(job.choice.budget_ms, 3)
                answer.stats.predicted_ms = round(started.predicted_ms, 3)
            wire_frame = None
            if started.frame is not None:
                f = started.frame
                several = started.frames is not None
                wire_frame = Frame(source=f.source, ts=f.ts, pos_ms=f.pos_ms, index=f.index,
                                   frames=len(started.frames) if several else None,
                                   first_ts=started.frames[0].ts if several else None)
            response = Response.success(answer, wire_frame, req.correlation_id)
        except Exception as exc:  # noqa: BLE001 - never a dead daemon
            logger.exception("answering failed with an unexpected error")
            self._fail(job, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        self.counters.inc("responses_ok")
        self._reply(job, response)
        if point is not None:  # the worker's time around the engine call: decode, frame, reply
            self.controller.observe_overhead((time.monotonic() - started.dequeued) * 1000.0 - answer.stats.e2e_ms)

    def _fail_deadline(self, job: Job, now: float) -> None:
        queue_ms = (now - job.received_monotonic) * 1000.0
        self._fail(
            job,
            DeadlineExceededError(
                f"deadline of {job.timeout_ms} ms passed after {queue_ms:.0f} ms in the queue",
                details={"timeout_ms": job.timeout_ms, "queue_ms": round(queue_ms, 3)},
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
        self._batch = BatchWorker(engine, self.prefill_token_budget)
        self._batch_rows = rows
        logger.info("continuous batching: %d KV-cache rows, prefill groups of <= %d tokens",
                    rows, self.prefill_token_budget)
        return self._batch

    def _run_batched(self) -> None:
        while True:
            batch = self._batching_engine()
            if batch is None:  # a hot reload brought an engine that cannot batch
                self._run_single()
                return
            with self._cond:
                self._wait_locked(lambda batch=batch: batch.idle and (self._paused or not self._queue))
                if self._stopping and batch.idle:
                    return
                now = time.monotonic()
                expired = [j for j in self._queue if j.deadline_monotonic is not None and now > j.deadline_monotonic]
                for j in expired:
                    self._queue.remove(j)
                jobs: list[Job] = []
                if not self._paused and not self._stopping:
                    while self._queue and len(jobs) < batch.free_slots():
                        jobs.append(self._queue.popleft())
                monitor_tick = batch.idle and not jobs and not expired
                if monitor_tick:
                    self._running = (now, self.monitors.tick_ms() if self.monitors is not None else 0.0)
                else:
                    self._running = (now, 0.0)
            for job in expired:
                self._fail_deadline(job, now)
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

    def _admit(self, batch: Any, job: Job) -> None:
        started = self._begin(job)
        if started is None:
            return
        ok, _ = self._guarded(job, "request preparation", lambda: batch.add(
            (job, started), started.image, job.request.prompt, max_new_tokens=started.max_new_tokens,
            operating_point=started.point, deadline_s=job.deadline_monotonic))
        if not ok:
            return
        with self._cond:
            self._active[id(job)] = (started.dequeued, started.service_ms)
        self.counters.inc("batched_requests")

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
                       ) -> tuple[Any, CapturedFrame | None, list[CapturedFrame] | None]:
        """``(image or list of frames' images, newest source frame, the frames of a frames /
        frames_s request)``."""
        if req.image_bytes is not None:
            from edgevlm.runtime.image import decode_image

            return decode_image(req.image_bytes), None, None
        assert req.source is not None  # guaranteed by Request validation
        src = self.sources.get(req.source)
        wait_s = FRAME_WAIT_S if deadline is None else max(0.0, min(FRAME_WAIT_S, deadline - time.monotonic()))
        # a fresh frame (max_frame_age_s), else InternalError with reason no_frame / stale_frame
        if req.frames is not None or req.frames_s is not None:
            frames = src.recent_frames(wait_s, count=req.frames, window_s=req.frames_s)
            return [f.image for f in frames], frames[-1], frames
        frame = src.frame_for_request(wait_s)
        return frame.image, frame, None

    def _fail(self, job: Job, err: EdgeVLMError) -> None:
        self.counters.inc(f"errors_{err.code.value}")
        logger.info("request failed: %s: %s", err.code.value, err.message)
        self._reply(job, Response.failure(err, job.request.correlation_id))

    def _reply(self, job: Job, response: Response) -> None:
        try:
            job.reply(response)
        except Exception:  # noqa: BLE001 - a failed publish must not kill the worker
            logger.exception("could not send a response")
