"""A prompt too long for the KV cache at the operating point the latency controller chose runs at the
most accurate cheaper point whose vision tokens leave it room (edgevlm.daemon.scheduler._fit_prompt);
only when none does is it refused INVALID_REQUEST, naming the fewest tokens. A point the controller did
not choose is refused as before.

The engine is the real :class:`edgevlm.runtime.Engine` on a tiny random checkpoint with a three-rung
ladder (128 / 64 / 32 px: 48 / 12 / 4 vision tokens for a 96x128 frame) and a 128-position KV cache;
the word-level tokenizer makes ``"red " * n`` a prompt of n + 5 text tokens. Requests go through a real
mosquitto and daemon (one at a time), and through the scheduler's batched paths (continuous
batching: a worker-prepared admission and prepare threads).
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from typing import Any

import numpy as np
import pytest

from edgevlm.client import encode_png
from edgevlm.daemon.budget import BudgetController
from edgevlm.daemon.scheduler import Job, Scheduler
from edgevlm.daemon.sources import SourceManager
from edgevlm.errors import PromptTooLongError
from edgevlm.protocol import parse_request
from edgevlm.runtime.policy import Controller, PointProfile
from edgevlm.types import OperatingPoint

REQUEST_TOPIC = "edgevlm/dev1/request"
LADDER = [128, 64, 32]
CAPACITY = 128
FITS_AT_64 = "red " * 90  # 95 text tokens: + 48 vision = 143 at r128 (too long), + 12 = 107 at r64
FITS_NOWHERE = "red " * 120  # 125 text tokens: + 4 vision = 129 at r32, the fewest
R64 = OperatingPoint(name="r64", resolution_px=64)


def _frame() -> np.ndarray:
    y, x = np.mgrid[0:96, 0:128]
    return np.stack([(x * 2) % 200, (y * 2) % 200, ((x + y) * 3) % 200], axis=-1).astype(np.uint8)


@pytest.fixture(scope="module")
def ladder_dir(tmp_path_factory):
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ladder3"), seed=0, image_size_px=128,
                                 resolution_ladder=LADDER)


@pytest.fixture(scope="module")
def ladder_engine(ladder_dir):
    from edgevlm.runtime import Engine

    return Engine.load(ladder_dir, device="cpu", max_seq_len=CAPACITY)


@pytest.fixture(scope="module")
def batch_ladder_engine(ladder_dir):
    from edgevlm.runtime import Engine

    return Engine.load(ladder_dir, device="cpu", max_seq_len=CAPACITY, backend_options={"max_batch_size": 4})


def _ask(raw, prompt: str, **extra) -> dict:
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    body = {"prompt": prompt, "image_b64": base64.b64encode(encode_png(_frame())).decode(), **extra}
    raw.publish(REQUEST_TOPIC, json.dumps(body).encode(), response_topic=reply, correlation=b"c")
    return json.loads(raw.wait_messages(reply, 1)[0].payload)


def test_the_sizes_this_test_relies_on(ladder_engine) -> None:
    counts = {r: ladder_engine.prepare(_frame(), FITS_AT_64, operating_point=OperatingPoint(name=f"r{r}",
                                                                                            resolution_px=r))
              for r in (64, 32)}
    assert [(r, p.n_vision, len(p.ids)) for r, p in counts.items()] == [(64, 12, 107), (32, 4, 99)]
    # the request pins the point (Engine.ask, `edgevlm ask --resolution`): refused, nothing re-chosen
    with pytest.raises(PromptTooLongError) as exc:
        ladder_engine.ask(_frame(), FITS_AT_64, operating_point=OperatingPoint(name="r128", resolution_px=128))
    assert exc.value.message == ("prompt is 143 tokens (95 text + 48 vision at 128x96 px); "
                                 "the KV cache holds 128 positions")
    assert (exc.value.tokens, exc.value.capacity, exc.value.vision_tokens) == (143, CAPACITY, 48)
    assert exc.value.code.value == "INVALID_REQUEST"


def test_a_prompt_too_long_at_the_top_rung_is_answered_at_the_rung_it_fits(start_daemon, raw_client,
                                                                           ladder_engine) -> None:
    daemon = start_daemon(engine=ladder_engine, controller={"default_budget_ms": 60000})
    assert [p.name for p in daemon.scheduler.controller.points] == ["r128", "r64", "r32"]  # measured at start-up
    raw = raw_client()
    short = _ask(raw, "red " * 3)
    assert short["ok"] and short["stats"]["operating_point"] == "r128"  # the controller's choice

    response = _ask(raw, FITS_AT_64)
    assert response["ok"], response
    stats = response["stats"]
    assert stats["operating_point"] == "r64"  # the most accurate rung it fits at (r32 fits too)
    assert (stats["input_width_px"], stats["input_height_px"], stats["vision_tokens"]) == (64, 48, 12)
    assert stats["prompt_tokens"] == 95 and stats["budget_ms"] == 60000 and stats["predicted_ms"] > 0
    assert response["text"] == ladder_engine.ask(_frame(), FITS_AT_64, max_new_tokens=4, operating_point=R64).text
    assert daemon.scheduler.counters.get("prompt_refits") == 1


def test_a_prompt_that_fits_no_point_is_invalid_request_naming_the_fewest_tokens(start_daemon, raw_client,
                                                                                 ladder_engine) -> None:
    start_daemon(engine=ladder_engine, controller={"default_budget_ms": 60000})
    response = _ask(raw_client(), FITS_NOWHERE)
    assert not response["ok"]
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert response["error"]["message"] == (
        "no operating point fits the prompt in the KV cache (tried 'r128', 'r64', 'r32'; the fewest tokens at "
        "'r32'): prompt is 129 tokens (125 text + 4 vision at 32x32 px); the KV cache holds 128 positions")
    assert response["error"]["details"] == {
        "reason": "prompt_too_long", "prompt_tokens": 129, "vision_tokens": 4, "max_seq_len": 128,
        "operating_point": "r32", "points_tried": ["r128", "r64", "r32"]}


def test_a_point_the_controller_did_not_choose_is_refused_as_before(start_daemon, raw_client,
                                                                    ladder_engine) -> None:
    # no controller: every request runs the model's default point (its 128 px tower), whatever fits lower
    daemon = start_daemon(engine=ladder_engine, controller={"enabled": False})
    assert daemon.scheduler.controller is None
    response = _ask(raw_client(), FITS_AT_64)
    assert response["error"]["code"] == "INVALID_REQUEST"
    assert response["error"]["message"] == ("prompt is 143 tokens (95 text + 48 vision at 128x96 px); "
                                            "the KV cache holds 128 positions")
    assert daemon.scheduler.counters.get("prompt_refits") == 0


class _Replies:
    def __init__(self) -> None:
        self.done = threading.Condition()
        self.by_id: dict[str, Any] = {}

    def reply_for(self, cid: str):
        def reply(resp: Any) -> None:
            with self.done:
                self.by_id[cid] = resp
                self.done.notify_all()
        return reply

    def wait(self, n: int, timeout_s: float = 60.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.by_id) >= n, timeout_s), self.by_id


def test_batched_admission_and_prepare_threads_take_the_rung_the_prompt_fits(batch_ladder_engine) -> None:
    # fixed latencies (ms): every point fits the 60 s budget, so the controller chooses r128
    points = [PointProfile(OperatingPoint(name=f"r{r}", resolution_px=r), 1.0 - i / 10, 5.0, 5.0, 1.0)
              for i, r in enumerate(LADDER)]
    sched = Scheduler(None, SourceManager([]), engine=batch_ladder_engine, queue_max_size=8, continuous_batching=True,
                      prepare_threads=2,
                      controller_factory=lambda _: BudgetController(Controller(points), default_budget_ms=60000))
    sched.start(30)
    replies = _Replies()
    image = encode_png(_frame())
    cases = {"worker": FITS_AT_64, "thread": FITS_AT_64, "short": "red " * 3, "nowhere": FITS_NOWHERE}
    try:
        with sched.paused():
            jobs = {cid: Job(request=parse_request({"prompt": p, "image_b64": base64.b64encode(image).decode(),
                                                    "max_new_tokens": 3, "correlation_id": cid}),
                             reply=replies.reply_for(cid), timeout_ms=60000) for cid, p in cases.items()}
            for job in jobs.values():
                assert sched.submit(job) and job.choice.point.name == "r128"
            # the first found the worker idle (prepared at its admission); the others went to a prepare thread
            assert jobs["worker"].prepared is None and all(j.prepared is not None for j in list(jobs.values())[1:])
            made = jobs["thread"].prepared.result(30)
            assert (made.point.name, made.request.n_vision, len(made.request.ids)) == ("r64", 12, 107)
        replies.wait(4)
    finally:
        sched.stop()
    expected = batch_ladder_engine.ask(_frame(), FITS_AT_64, max_new_tokens=3, operating_point=R64).text
    for cid in ("worker", "thread"):
        resp = replies.by_id[cid]
        assert resp.ok, resp
        assert (resp.stats.operating_point, resp.stats.vision_tokens, resp.text) == ("r64", 12, expected)
        assert [p.name for p, _ in jobs[cid].too_long] == ["r128"]
    assert replies.by_id["short"].ok and replies.by_id["short"].stats.operating_point == "r128"
    refused = replies.by_id["nowhere"]
    assert refused.error.code.value == "INVALID_REQUEST"
    assert refused.error.message.startswith("no operating point fits the prompt in the KV cache (tried 'r128', "
                                            "'r64', 'r32'; the fewest tokens at 'r32'): prompt is 129 tokens")
    assert sched.counters.get("prompt_refits") == 4 and sched.counters.get("responses_ok") == 3
