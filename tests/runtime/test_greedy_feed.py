"""Greedy decoding with the next inputs kept on the device (``TorchBackend.greedy_step`` /
``greedy_tokens``, the engine's greedy loop and the continuous batcher's greedy steps): the same
tokens as one ``decode`` + ``argmax`` per token, whatever joins, ends early or parks in between.

CPU, float32, the tiny LLaVA checkpoint (``write_tiny_checkpoint``); the CUDA-graph form (feeding
graphs) is checked in ``tests/gpu_perf/test_cuda_graphs.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.runtime import Engine  # noqa: E402
from edgevlm.runtime.backends import Backend  # noqa: E402
from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest  # noqa: E402
from edgevlm.runtime.sampling import greedy_feed  # noqa: E402

PROMPTS = ("what is in front of me ?", "describe the scene", "is the path clear ?")


def _image(seed: int, h: int = 64, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def batched(tiny_dir):
    return Engine.load(tiny_dir, device="cpu", backend_options={"max_batch_size": 3})


def _prefill(engine: Engine, seed: int, prompt: str, row: int = 0) -> tuple[int, int]:
    """Prefill one request into cache row ``row``: ``(first greedy token, prompt length)``."""
    be = engine.backend
    prep = engine.prepare(_image(seed), prompt, max_new_tokens=8)
    ids = torch.tensor([prep.ids])
    feats = be.encode_image(prep.vision.pixel_values)
    embeds = be.embed(ids, feats)
    logits = be.prefill(embeds) if row == 0 else be.prefill_batch([embeds], [row])
    return int(logits[0].argmax()), len(prep.ids)


def _reference(engine: Engine, first: int, pos: int, n: int) -> list[int]:
    """``n`` greedy tokens by ``decode`` + ``argmax`` per token (the base class's loop)."""
    return list(Backend.greedy_tokens(engine.backend, first, pos, n))


def test_greedy_feed_writes_argmax_and_next_slot_in_place():
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [5.0, 0.0, 1.0, 5.0]])  # ties: the first index, as argmax
    tokens = torch.full((3, 1), -1, dtype=torch.long)
    positions = torch.tensor([4, 9, 100])
    greedy_feed(logits, tokens[:2], positions[:2])
    assert tokens.tolist() == [[1], [0], [-1]]
    assert positions.tolist() == [5, 10, 100]


def test_greedy_feed_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        greedy_feed(torch.zeros(2, 5), torch.zeros(3, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        greedy_feed(torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def test_greedy_tokens_equal_decode_and_argmax_per_token(engine):
    first, pos = _prefill(engine, 1, PROMPTS[0])
    want = _reference(engine, first, pos, 12)
    first2, _ = _prefill(engine, 1, PROMPTS[0])
    assert first2 == first
    got = list(engine.backend.greedy_tokens(first, pos, 12))
    assert got == want
    assert len(set(want)) > 1  # a sequence that can tell a wrong feed from a right one


def test_a_greedy_stream_stopped_early_leaves_the_next_request_exact(engine):
    first_b, pos_b = _prefill(engine, 2, PROMPTS[1])
    want_b = _reference(engine, first_b, pos_b, 10)
    first_a, pos_a = _prefill(engine, 1, PROMPTS[0])
    stream = engine.backend.greedy_tokens(first_a, pos_a, 20)
    got_a = [next(stream), next(stream)]  # the consumer stops here (EOS, a stop string): one step ran ahead
    stream.close()
    assert got_a == _reference_after_prefill(engine, 1, PROMPTS[0], 2)
    first_b2, _ = _prefill(engine, 2, PROMPTS[1])
    assert first_b2 == first_b
    assert list(engine.backend.greedy_tokens(first_b, pos_b, 10)) == want_b


def _reference_after_prefill(engine, seed, prompt, n):
    first, pos = _prefill(engine, seed, prompt)
    return _reference(engine, first, pos, n)


def test_greedy_tokens_run_to_the_last_cache_slot_and_no_further(engine):
    be = engine.backend
    first, pos = _prefill(engine, 3, PROMPTS[2])
    n = be.max_seq_len - pos  # the last token feeds slot max_seq_len - 1
    want = _reference(engine, first, pos, n)
    _prefill(engine, 3, PROMPTS[2])
    assert list(be.greedy_tokens(first, pos, n)) == want
    with pytest.raises(ValueError, match="leaves the KV cache"):
        list(be.greedy_tokens(first, pos, n + 1))
    with pytest.raises(ValueError, match="leaves the KV cache"):  # the base class's loop says the same
        list(Backend.greedy_tokens(be, first, pos, n + 1))
    assert list(be.greedy_tokens(first, pos, 0)) == []


def test_greedy_step_refuses_rows_and_slots_outside_the_cache(batched):
    be = batched.backend
    with pytest.raises(ValueError, match="cache of 3 rows"):
        be.greedy_step(0)
    with pytest.raises(ValueError, match="cache of 3 rows"):
        be.greedy_step(4)
    with pytest.raises(ValueError, match="outside"):
        be.greedy_step(2, {2: (1, 0, 0)})  # row 2 of a 2-row step
    with pytest.raises(ValueError, match="outside"):
        be.greedy_step(2, {2: None})  # parking a row the step does not hold
    with pytest.raises(ValueError, match="outside"):
        be.greedy_step(1, {0: (1, be.max_seq_len, 0)})


def test_greedy_steps_with_rows_joining_and_parking_equal_single_requests(batched):
    """Row 0 runs 9 steps; row 1 joins at step 3 and parks after step 6; row 2 joins at step 5 into
    a 3-row step: every row's tokens equal its request decoded alone."""
    be = batched.backend
    refs = {}
    for row, seed in ((0, 1), (1, 2), (2, 3)):
        first, pos = _prefill(batched, seed, PROMPTS[row])
        refs[row] = (first, pos, _reference(batched, first, pos, 9))
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    _prefill(batched, 1, PROMPTS[0], row=0)
    live = {0: 0}  # row -> steps it has run
    pending = None
    for step in range(9):
        if step == 3:
            _prefill(batched, 2, PROMPTS[1], row=1)
            live[1] = 0
        if step == 5:
            _prefill(batched, 3, PROMPTS[2], row=2)
            live[2] = 0
        new = {}
        for row, done in live.items():
            if done == 0:
                new[row] = (refs[row][0], refs[row][1], 0)
        if step == 7:  # row 1 ended after 4 tokens: parked, row 0 and row 2 go on
            del live[1]
            new[1] = None
        n = max(live) + 1
        queued = be.greedy_step(n, new)
        if pending is not None:
            toks, rows = pending
            out = toks.tokens()
            for row in rows:
                got[row].append(out[row])
        pending = (queued, [r for r in live if r < n])
        for row in live:
            live[row] += 1
    toks, rows = pending
    out = toks.tokens()
    for row in rows:
        got[row].append(out[row])
    assert got[0] == refs[0][2][:9]
    assert got[1] == refs[1][2][:4]
    assert got[2] == refs[2][2][:4]


def _requests(engine, cases):
    reqs = []
    for i, (seed, prompt, n, on_token) in enumerate(cases):
        prep = engine.prepare(_image(seed), prompt, max_new_tokens=n)
        reqs.append(GenerationRequest(prep.ids, prep.vision.pixel_values, max_new_tokens=n, request_id=i,
                                      eos_token_ids=engine.eos_token_ids, on_token=on_token))
    return reqs


def test_batcher_greedy_steps_equal_one_at_a_time_with_early_ends_and_joins(batched, engine):
    """Three cache rows, four requests: one stops itself after 3 tokens (``on_token``, as a stop
    string does) while its next step is already queued, the fourth joins its row; the tokens of
    each equal ``Engine.ask`` of it alone (its budget, or the first 3 tokens)."""
    seen: list[int] = []

    def stop_after_three(token: int) -> bool:
        seen.append(token)
        return len(seen) >= 3

    cases = [(1, PROMPTS[0], 12, None), (2, PROMPTS[1], 10, stop_after_three), (3, PROMPTS[2], 12, None),
             (4, PROMPTS[0], 6, None)]
    batcher = ContinuousBatcher(batched.backend)
    results = batcher.run(_requests(batched, cases))
    assert batcher.joins >= 1 and max(r.batch_size for r in results) == 3
    for (seed, prompt, n, on_token), res in zip(cases, results, strict=True):
        want = engine.ask(_image(seed), prompt, max_new_tokens=n)
        ref = engine.backend  # the same tiny model, one request at a time
        first, pos = _prefill(engine, seed, prompt)
        tokens = [first] + _reference(engine, first, pos, n - 1)
        if on_token is not None:
            assert res.tokens == tokens[:3] and res.finish_reason == "stop"
        else:
            assert res.tokens == tokens[: len(res.tokens)]
            assert res.finish_reason == want.stats.finish_reason
            assert len(res.tokens) == want.stats.new_tokens
        assert ref is engine.backend


def test_batcher_row_ending_at_the_cache_end_beside_a_longer_one(tiny_dir):
    """A request whose budget ends at the last cache slot decodes beside one that runs on: the
    queued step computes nothing past the cache for it (its row is parked), and both answers equal
    their single runs."""
    engine = Engine.load(tiny_dir, device="cpu", max_seq_len=64, backend_options={"max_batch_size": 2})
    single = Engine.load(tiny_dir, device="cpu", max_seq_len=64)
    long_prompt = " ".join(["is the path clear ?"] * 6)
    cases = [(5, long_prompt, 500, None), (6, PROMPTS[1], 30, None)]
    reqs = _requests(engine, cases)
    budget_a = 64 - len(reqs[0].input_ids) + 1
    assert budget_a < 30 and len(reqs[1].input_ids) + 30 <= 64  # A's budget is capped by the cache, B's is not
    results = ContinuousBatcher(engine.backend).run(reqs)
    for (seed, prompt, n, _), res in zip(cases, results, strict=True):
        want = single.ask(_image(seed), prompt, max_new_tokens=n)
        first, pos = _prefill(single, seed, prompt)
        budget = min(n, single.backend.max_seq_len - pos + 1)
        tokens = [first] + _reference(single, first, pos, budget - 1)
        assert res.tokens == tokens[: len(res.tokens)]
        assert len(res.tokens) == want.stats.new_tokens and res.finish_reason == want.stats.finish_reason
    assert len(results[1].tokens) > budget_a or results[1].finish_reason == "stop"


def test_engine_greedy_answer_equals_the_decode_loop(engine):
    """``Engine.ask`` (greedy: the backend's greedy_tokens) gives the text of decode + argmax per token."""
    from edgevlm.runtime.slowdown import SlowdownBackend

    im = _image(7)
    fast = engine.ask(im, PROMPTS[0], max_new_tokens=10)
    inner = engine.backend
    engine.backend = SlowdownBackend(inner)  # a Backend without greedy_step: the base class's loop
    try:
        slow = engine.ask(im, PROMPTS[0], max_new_tokens=10)
    finally:
        engine.backend = inner
    assert fast.text == slow.text and fast.stats.new_tokens == slow.stats.new_tokens
    assert fast.stats.finish_reason == slow.stats.finish_reason


def test_a_row_fed_to_the_last_slot_is_parked_and_the_others_go_on(tiny_dir):
    """Row 1 is fed on (by contract a row without a request) until its slot would leave the cache:
    it is parked at slot 0 instead of writing past the cache, and row 0's tokens stay exact."""
    engine = Engine.load(tiny_dir, device="cpu", max_seq_len=64, backend_options={"max_batch_size": 2})
    be = engine.backend
    first0, pos0 = _prefill(engine, 1, PROMPTS[0])
    want = _reference(engine, first0, pos0, 64 - pos0)
    _prefill(engine, 1, PROMPTS[0], row=0)
    slot1 = 60
    got = [be.greedy_step(2, {0: (first0, pos0, 0), 1: (3, slot1, 0)}).tokens()[0]]
    for _ in range(64 - pos0 - 1):  # row 1 reaches slot 63, then would go to 64, 65, ...
        got.append(be.greedy_step(2).tokens()[0])
    assert got == want
    assert be._fed_slots[1] < slot1  # parked and fed on from slot 0


def test_a_queued_greedy_step_is_read_before_an_admission(tiny_dir, monkeypatch):
    """A's last token is on the device when B arrives: the step that admits B reads it first, so A's
    e2e does not include B's admission (vision encode + prefill), and the admission is measured
    without A's decode step. The clock moves only inside the vision encode (1 s per call)."""
    engine = Engine.load(tiny_dir, device="cpu", backend_options={"max_batch_size": 2})
    be = engine.backend
    now = [0.0]
    real = be.encode_images

    def slow_encode(*args, **kwargs):
        now[0] += 1.0
        return real(*args, **kwargs)

    monkeypatch.setattr(be, "encode_images", slow_encode)
    a, b = _requests(engine, [(1, PROMPTS[0], 3, None), (2, PROMPTS[1], 2, None)])
    batcher = ContinuousBatcher(be, clock=lambda: now[0])
    batcher.submit(a)
    assert batcher.step() == []  # A admitted (its first token), its second token's step queued
    assert batcher.step() == []  # the third token's step queued, the second read
    batcher.submit(b)
    done = batcher.step()  # A's last token is read before B's admission
    assert [r.request_id for r in done] == [0]
    res_a = done[0]
    assert len(res_a.tokens) == 3 and res_a.finish_reason == "length"
    assert res_a.e2e_s == 1.0  # A's own admission only
    while batcher.n_running or batcher.n_waiting:
        done += batcher.step()
    assert [r.request_id for r in done] == [0, 1]


def test_a_step_left_queued_by_the_last_answer_is_not_charged_to_the_next(engine, monkeypatch):
    """A greedy answer leaves its step queued past the last token for the device to finish alone
    (``Engine.ask`` does not wait for it); the next answer waits for it before its clock starts, as
    for another request holding the engine: neither its vision stage nor its e2e includes it. The
    engine's clock moves only when the device finishes that leftover step (1 s)."""
    import time

    import edgevlm.runtime.engine as engine_module
    from edgevlm.runtime.slowdown import SlowdownBackend

    now = [0.0]

    class Clock:  # the engine's ``time``: perf_counter is the fake clock
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def perf_counter() -> float:
            return now[0]

    class LeftoverStep(SlowdownBackend):  # a device that takes 1 s to finish what an answer left queued
        left = False

        def greedy_tokens(self, *args, **kwargs):
            try:
                yield from self.inner.greedy_tokens(*args, **kwargs)
            finally:
                self.left = True

        def synchronize(self) -> None:
            if self.left:
                now[0] += 1.0
                self.left = False
            self.inner.synchronize()

    monkeypatch.setattr(engine_module, "time", Clock())
    inner = engine.backend
    engine.backend = LeftoverStep(inner)
    try:
        first = engine.ask(_image(8), PROMPTS[1], max_new_tokens=4)
        assert engine.backend.left and first.stats.new_tokens > 1
        second = engine.ask(_image(8), PROMPTS[1], max_new_tokens=4)
    finally:
        engine.backend = inner
    assert second.text == first.text
    assert second.stats.vision_ms == 0.0 and second.stats.e2e_ms == 0.0, second.stats


def test_free_rows_stay_parked_near_slot_zero_while_others_decode(batched):
    """Request 1 stops after 2 tokens while requests 0 and 2 decode on for 40: its free row is
    parked near slot 0 (as ``decode_batch`` leaves free rows at slot 0) instead of being fed on behind
    the live rows, whose attention over its garbage keys would cost as much as a live row's; the
    live rows' tokens are exact."""
    be = batched.backend
    batcher = ContinuousBatcher(be)
    free_slots: list[int] = []
    ended = []

    was_free: set[int] = set()

    def watch(token: int) -> bool:  # at each token of request 0: the slots of rows free since the last one
        free = {row for row, run in enumerate(batcher._rows) if run is None}
        if free & was_free:
            free_slots.append(max(be._fed_slots[row] for row in free & was_free))
        was_free.clear()
        was_free.update(free)
        return False

    def stop_after_two(token: int) -> bool:
        ended.append(token)
        return len(ended) >= 2

    cases = [(1, PROMPTS[0], 40, watch), (2, PROMPTS[1], 40, stop_after_two), (3, PROMPTS[2], 40, None)]
    results = batcher.run(_requests(batched, cases))
    assert results[1].finish_reason == "stop" and len(results[1].tokens) == 2
    assert len(free_slots) > 25 and max(free_slots) <= be.PARKED_SLOTS, str(free_slots)
    for (seed, prompt, n, _), res in zip(cases, results, strict=True):
        first, pos = _prefill(batched, seed, prompt)
        assert res.tokens == ([first] + _reference(batched, first, pos, n - 1))[: len(res.tokens)]


def test_a_sampled_request_between_greedy_steps_leaves_the_greedy_rows_exact(batched):
    """A greedy request decodes on the device-fed steps; a sampled one joins while a greedy step is
    queued (host-fed steps for both from then on: the queued step is read first) and ends; the greedy
    one goes back to device-fed steps. Its tokens equal its request decoded alone."""
    from edgevlm.runtime.sampling import SamplingParams

    greedy, sampled = _requests(batched, [(1, PROMPTS[0], 30, None), (2, PROMPTS[1], 6, None)])
    sampled.params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    batcher = ContinuousBatcher(batched.backend)
    batcher.submit(greedy)
    for _ in range(5):
        assert batcher.step() == []
    assert batcher._pending is not None
    batcher.submit(sampled)
    done = []
    while batcher.n_running or batcher.n_waiting:
        done += batcher.step()
    by_id = {r.request_id: r for r in done}
    assert len(by_id[1].tokens) == 6 or by_id[1].finish_reason == "stop"
    first, pos = _prefill(batched, 1, PROMPTS[0])
    want = [first] + _reference(batched, first, pos, 29)
    assert by_id[0].tokens == want[: len(by_id[0].tokens)] and len(by_id[0].tokens) == 30


def test_an_admission_is_timed_without_the_steps_left_on_the_device(tiny_dir, monkeypatch):
    """Request A stops itself after 2 tokens with a greedy step queued past it, and the batcher goes
    idle; B's admission waits for that step before its clock starts: B's vision time holds only its
    own encode. A fake device: every queued greedy step takes 1 s, paid when the host waits for it."""
    engine = Engine.load(tiny_dir, device="cpu", backend_options={"max_batch_size": 2})
    be = engine.backend
    now, queued, count = [0.0], [], [0]
    real_step = be.greedy_step

    def wait_for(last: float) -> None:
        while queued and queued[0] <= last:
            queued.pop(0)
            now[0] += 1.0

    class Pending:
        def __init__(self, pending, k):
            self.pending, self.k = pending, k

        def tokens(self):
            wait_for(self.k)
            return self.pending.tokens()

    def step(*args, **kwargs):
        count[0] += 1
        queued.append(count[0])
        return Pending(real_step(*args, **kwargs), count[0])

    monkeypatch.setattr(be, "greedy_step", step)
    monkeypatch.setattr(be, "synchronize", lambda: wait_for(float("inf")))
    seen: list[int] = []
    a, b = _requests(engine, [(1, PROMPTS[0], 20, lambda t: seen.append(t) or len(seen) >= 2),
                              (2, PROMPTS[1], 2, None)])
    batcher = ContinuousBatcher(be, clock=lambda: now[0])
    done = batcher.run([a])
    assert done[0].finish_reason == "stop" and queued  # a step left on the device past A's end
    assert batcher.step() == []  # an idle step: nothing to read
    done = batcher.run([b])
    assert done[0].vision_s == 0.0 and done[0].queue_s == 1.0, done[0]
