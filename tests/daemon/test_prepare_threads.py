"""The scheduler's prepare threads and reply thread (edgevlm.daemon.scheduler).

While the inference worker is busy, an inline image is decoded (and, batching, tokenised and
preprocessed by ``Engine.prepare``) on a prepare thread, and the responses of a busy worker are
serialised and sent by the reply thread. The answers must be those of ``engine.ask``; a job whose
image fails to decode on a prepare thread is answered ``INVALID_IMAGE`` and the others run.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

import numpy as np
import pytest

from edgevlm.client import encode_png
from edgevlm.daemon.scheduler import Job, Scheduler
from edgevlm.daemon.sources import SourceManager
from edgevlm.protocol import parse_request

PROMPTS = ["what colour is the circle ?", "how many shapes are there ?", "describe the scene ."]


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)


def _corrupt_png(image: np.ndarray) -> bytes:
    """A PNG whose header is valid but whose IDAT data are zeroed (it fails its CRC when decoded)."""
    data = bytearray(encode_png(image))
    i = data.find(b"IDAT")
    n = int.from_bytes(data[i - 4:i], "big")
    data[i + 6:i + 4 + n] = bytes(n - 2)
    return bytes(data)


class _Replies:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.by_id: dict[str, tuple[Any, str]] = {}

    def reply_for(self, cid: str):
        def reply(resp: Any) -> None:
            with self.done:
                self.by_id[cid] = (resp, threading.current_thread().name)
                self.done.notify_all()
        return reply

    def wait(self, n: int, timeout_s: float = 60.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.by_id) >= n, timeout_s), self.by_id


def _job(replies: _Replies, cid: str, image_bytes: bytes, prompt: str, max_new_tokens: int) -> Job:
    req = parse_request({"prompt": prompt, "image_b64": base64.b64encode(image_bytes).decode(),
                         "max_new_tokens": max_new_tokens, "correlation_id": cid})
    return Job(request=req, reply=replies.reply_for(cid), timeout_ms=60000)


@pytest.fixture(scope="module")
def batch_engine(tiny_model_dir):
    from edgevlm.runtime import Engine

    return Engine.load(tiny_model_dir, device="cpu", backend_options={"max_batch_size": 4})


def test_batched_jobs_are_prepared_off_the_worker_and_answer_like_engine_ask(batch_engine) -> None:
    sched = Scheduler(None, SourceManager([]), engine=batch_engine, queue_max_size=8, continuous_batching=True,
                      prepare_threads=2)
    sched.start(30)
    replies = _Replies()
    cases = [(_image(i), PROMPTS[i], n) for i, n in enumerate((2, 5, 8))]
    try:
        with sched.paused():
            jobs = [_job(replies, f"c{i}", encode_png(im), p, n) for i, (im, p, n) in enumerate(cases)]
            for job in jobs:
                assert sched.submit(job)
            # the first found the worker idle; the others were handed to a prepare thread
            assert jobs[0].prepared is None and all(j.prepared is not None for j in jobs[1:])
            for job, (im, p, n) in zip(jobs[1:], cases[1:], strict=True):
                made = job.prepared.result(30)
                assert np.array_equal(made.image, im)  # decoded there
                assert made.request.ids == batch_engine.prepare(im, p, max_new_tokens=n).ids  # and tokenised
        replies.wait(3)
    finally:
        sched.stop()
    for i, (im, p, n) in enumerate(cases):
        resp, _ = replies.by_id[f"c{i}"]
        assert resp.ok, resp
        assert resp.text == batch_engine.ask(im, p, max_new_tokens=n).text
    # the shortest finished while the others still decoded: its response went out on the reply thread
    assert replies.by_id["c0"][1].startswith("edgevlm-reply")
    # where each request's time went (stats.stages_ms, ms after receipt, in order): the two prepared on a
    # prepare thread say when that ended; the first, prepared by the worker itself, has no such stage
    order = ["queued", "prepared", "dequeued", "admitted", "first_token", "done", "replied"]
    for i in range(3):
        stats = replies.by_id[f"c{i}"][0].stats
        stages = stats.stages_ms
        assert list(stages) == [k for k in order if k != "prepared" or i > 0], stages
        values = list(stages.values())
        assert all(0 <= a <= b for a, b in zip(values, values[1:], strict=False)), stages
        assert stages["dequeued"] == round(stats.queue_ms, 3)
        assert stages["done"] == pytest.approx(stats.queue_ms + stats.e2e_ms, abs=0.01)
    assert sched.counters.get("responses_ok") == 3 and sched.counters.get("batched_requests") == 3


def test_an_image_that_fails_to_decode_on_a_prepare_thread_is_answered_invalid_image(tiny_engine) -> None:
    sched = Scheduler(None, SourceManager([]), engine=tiny_engine, queue_max_size=8, prepare_threads=1)
    sched.start(30)
    replies = _Replies()
    good = _image(7)
    try:
        with sched.paused():
            first = _job(replies, "ok1", encode_png(good), PROMPTS[0], 3)
            bad = _job(replies, "bad", _corrupt_png(_image(8)), PROMPTS[1], 3)
            last = _job(replies, "ok2", encode_png(good), PROMPTS[2], 3)
            for job in (first, bad, last):
                assert sched.submit(job)
            assert bad.prepared is not None and last.prepared is not None
        replies.wait(3)
    finally:
        sched.stop()
    resp, _ = replies.by_id["bad"]
    assert not resp.ok and resp.error.code.value == "INVALID_IMAGE"
    assert "fails its CRC check" in resp.error.message
    for cid, prompt in (("ok1", PROMPTS[0]), ("ok2", PROMPTS[2])):
        ok, _ = replies.by_id[cid]
        assert ok.ok and ok.text == tiny_engine.ask(good, prompt, max_new_tokens=3).text
    assert sched.counters.get("errors_INVALID_IMAGE") == 1 and sched.counters.get("responses_ok") == 2


def test_no_prepare_threads_prepares_everything_on_the_worker(tiny_engine) -> None:
    sched = Scheduler(None, SourceManager([]), engine=tiny_engine, queue_max_size=8, prepare_threads=0)
    sched.start(30)
    replies = _Replies()
    try:
        with sched.paused():
            jobs = [_job(replies, f"c{i}", encode_png(_image(i)), PROMPTS[i], 2) for i in range(2)]
            for job in jobs:
                assert sched.submit(job)
            assert all(j.prepared is None for j in jobs)
        replies.wait(2)
    finally:
        sched.stop()
    for i in range(2):
        resp, _ = replies.by_id[f"c{i}"]
        assert resp.text == tiny_engine.ask(_image(i), PROMPTS[i], max_new_tokens=2).text


def test_a_job_whose_point_changes_at_dequeue_is_prepared_again_off_the_worker(batch_engine, tmp_path,
                                                                                monkeypatch) -> None:
    """At submit the first job holds the only waiting place, so the second is predicted to run at once
    at the big point; after 0.6 s in the queue its 1000 ms budget only fits the small point: the refit
    changes it, and the job goes back to a prepare thread instead of being prepared on the worker."""
    import json

    from edgevlm.config import parse_daemon_config
    from edgevlm.daemon.budget import build_controller
    from edgevlm.types import OperatingPoint

    big = {"name": "big", "resolution_px": 64, "accuracy": 0.9, "vision_ms": 300.0, "prefill_ms": 100.0,
           "tpot_ms": 10.0}
    small = {"name": "small", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 20.0, "prefill_ms": 20.0,
             "tpot_ms": 10.0}
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps({"created_utc": "2025-01-01T00:00:00+00:00", "model": "tiny", "device": "cpu",
                                "eval_items": 1, "eval_seed": 1000, "points": [big, small],
                                "frontier": [big, small]}))
    cfg = parse_daemon_config({"controller": {"frontier": str(path)}})
    sched = Scheduler(None, SourceManager([]), engine=batch_engine, queue_max_size=8, continuous_batching=True,
                      prepare_threads=1, controller_factory=lambda eng: build_controller(cfg, eng, batched=True))
    sched.start(60)
    worker_prompts: list[str] = []
    prepare = batch_engine.prepare

    def spy(image: Any, prompt: str, **kwargs: Any) -> Any:  # which thread prepares what (the real prepare)
        if threading.current_thread().name == "edgevlm-inference":
            worker_prompts.append(prompt)
        return prepare(image, prompt, **kwargs)

    monkeypatch.setattr(batch_engine, "prepare", spy)
    replies = _Replies()
    image = _image(3)
    try:
        with sched.paused():
            first = _job(replies, "first", encode_png(image), PROMPTS[0], 3)
            second = _job(replies, "second", encode_png(image), PROMPTS[1], 3)
            second.request = second.request.model_copy(update={"budget_ms": 1000})
            for job in (first, second):
                assert sched.submit(job)
            assert second.choice.point.name == "big" and second.prepared is not None
            second.prepared.result(30)
            threading.Event().wait(0.6)
        replies.wait(2)
    finally:
        sched.stop()
    resp, _ = replies.by_id["second"]
    assert resp.ok and resp.stats.operating_point == "small"
    ref = batch_engine.ask(image, PROMPTS[1], max_new_tokens=3,
                           operating_point=OperatingPoint(name="small", resolution_px=32))
    assert resp.text == ref.text
    assert sched.counters.get("prepared_again") == 1
    assert PROMPTS[1] not in worker_prompts  # prepared twice, both times on the prepare thread
    assert worker_prompts == [PROMPTS[0]]  # the first job found the worker idle: prepared there


def test_a_lifted_token_cap_keeps_the_preparation() -> None:
    from edgevlm.daemon.scheduler import _same_preparation
    from edgevlm.types import OperatingPoint

    capped = OperatingPoint(name="r64-t16", resolution_px=64, max_new_tokens=16)
    assert _same_preparation(capped, capped.model_copy(update={"max_new_tokens": 48}))
    assert _same_preparation(capped, capped.model_copy(update={"max_new_tokens": None}))
    assert not _same_preparation(capped, capped.model_copy(update={"resolution_px": 32}))
    assert not _same_preparation(capped, capped.model_copy(update={"keep_ratio": 0.5}))
    assert _same_preparation(None, None) and not _same_preparation(capped, None)


def test_an_admission_waits_briefly_for_jobs_still_being_prepared(tiny_engine, monkeypatch) -> None:
    """``_gather_locked``: with one job ready and another still on a prepare thread, the worker waits
    (up to GATHER_S) until that one is ready too; with nothing being prepared, or nothing ready yet,
    or as many ready as free rows, it does not wait at all."""
    import time
    from concurrent.futures import Future

    from edgevlm.daemon import scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "GATHER_S", 5.0)
    sched = Scheduler(None, SourceManager([]), engine=tiny_engine, queue_max_size=8, prepare_threads=0)
    replies = _Replies()
    png = encode_png(_image(1))
    ready, pending = (_job(replies, c, png, PROMPTS[0], 2) for c in ("ready", "pending"))
    pending.prepared = Future()
    pending.prepared.add_done_callback(sched._wake_worker)
    sched._queue.extend([ready, pending])

    def finish() -> None:
        time.sleep(0.2)
        pending.prepared.set_result(None)

    threading.Thread(target=finish, daemon=True).start()
    t0 = time.monotonic()
    with sched._cond:
        sched._gather_locked(free=4)
    waited = time.monotonic() - t0
    assert pending.ready() and 0.15 < waited < 4.0  # woken by the preparation's completion, not the timeout
    # no wait: as many ready as free rows / nothing ready yet / nothing being prepared
    late = _job(replies, "late", png, PROMPTS[1], 2)
    late.prepared = Future()
    sched._queue.append(late)
    cases = [(2, [ready, pending, late]), (4, [late])]
    for free, queue in cases:
        sched._queue.clear()
        sched._queue.extend(queue)
        t0 = time.monotonic()
        with sched._cond:
            sched._gather_locked(free=free)
        assert time.monotonic() - t0 < 0.1, (free, len(queue))
    late.prepared.set_result(None)
    t0 = time.monotonic()
    with sched._cond:
        sched._gather_locked(free=4)
    assert time.monotonic() - t0 < 0.1
