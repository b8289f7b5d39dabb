"""Batched prefill/decode, token-budget grouping and continuous batching (CPU, float32)."""

from __future__ import annotations

import pytest

from tests.gpu_perf.conftest import make_prompt, rel_err, run_single

torch = pytest.importorskip("torch")


def test_decode_mask_shapes_and_values():
    from edgevlm.runtime.kv_cache import decode_mask

    m = decode_mask(torch.tensor([2]), 5)
    assert m.shape == (1, 1, 1, 5) and m[0, 0, 0].tolist() == [True, True, True, False, False]
    m = decode_mask(torch.tensor([[0], [3]]), 4)  # per-row positions
    assert m.shape == (2, 1, 1, 4)
    assert m[0, 0, 0].tolist() == [True, False, False, False] and m[1, 0, 0].tolist() == [True] * 4


def test_kv_bucket():
    from edgevlm.runtime.kv_cache import kv_bucket

    assert [kv_bucket(n, 4096) for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert kv_bucket(700, 768) == 768 and kv_bucket(3, 100, min_bucket=4) == 4


def test_plan_prefill_groups():
    from edgevlm.runtime.batching import plan_prefill_groups

    lengths = [300, 20, 250, 1500, 100, 90, 260]
    groups = plan_prefill_groups(lengths, 1024)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 1024 or len(g) == 1
        assert [lengths[i] for i in g] == sorted(lengths[i] for i in g)
    assert [3] in groups  # longer than the budget: alone
    assert groups[0] == [1, 5, 4, 2]  # 20, 90, 100, 250: 4 x 250 = 1000 <= 1024
    assert plan_prefill_groups([10] * 9, 1024, max_group_size=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    with pytest.raises(ValueError):
        plan_prefill_groups([10, 0], 1024)
    with pytest.raises(ValueError):
        plan_prefill_groups([10], 0)


def test_batched_prefill_and_decode_equal_single_requests(make_backend):
    single = make_backend()
    batched = make_backend(max_batch_size=4)
    prompts = [make_prompt(10 + i, n_text=3 + 5 * i, height_px=64 if i % 2 else 32) for i in range(3)]
    refs = [run_single(single, ids, px, 8) for ids, px in prompts]
    feats = batched.encode_images([px for _, px in prompts])
    for f, (_, px) in zip(feats, prompts, strict=True):
        assert rel_err(f, single.encode_image(px)) < 1e-5
    embeds = [batched.embed(torch.tensor([ids]), f) for (ids, _), f in zip(prompts, feats, strict=True)]
    rows = [2, 0, 1]  # any free rows
    first = batched.prefill_batch(embeds, rows)
    for i in range(3):
        assert rel_err(first[i : i + 1], refs[i][0][:1]) < 1e-5
    for step in range(8):
        by_row = {row: i for i, row in enumerate(rows)}
        toks = [refs[by_row[r]][1][step] for r in range(3)]
        pos = [len(prompts[by_row[r]][0]) + step for r in range(3)]
        out = batched.decode_batch(toks, pos)
        for r in range(3):
            i = by_row[r]
            assert rel_err(out[r : r + 1], refs[i][0][step + 1 : step + 2]) < 1e-5


def test_continuous_batcher_equals_single_requests(make_backend):
    from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest

    single = make_backend()
    reqs = []
    for i, (h, w, n_text) in enumerate([(64, 64, 5), (32, 64, 9), (64, 64, 3), (32, 32, 12), (64, 32, 7), (64, 64, 20)]):
        ids, px = make_prompt(30 + i, n_text, h, w)
        reqs.append(GenerationRequest(ids, px, max_new_tokens=4 + i, request_id=f"r{i}"))
    refs = [run_single(single, r.input_ids, r.pixel_values, r.max_new_tokens - 1)[1] for r in reqs]
    # EOS: stop request 5 at the token its greedy run makes third
    reqs[5].eos_token_ids = frozenset({refs[5][2]})
    stop_at = refs[5].index(refs[5][2])
    batcher = ContinuousBatcher(make_backend(max_batch_size=4), token_budget=48)
    results = batcher.run(reqs)
    assert [r.request_id for r in results] == [f"r{i}" for i in range(6)]
    for i, res in enumerate(results[:5]):
        assert res.tokens == refs[i] and res.finish_reason == "length"
    assert results[5].tokens == refs[5][:stop_at] and results[5].finish_reason == "stop"
    assert batcher.steps < sum(r.max_new_tokens for r in reqs)  # decode steps really were shared
    assert batcher.n_running == 0 and batcher.n_waiting == 0


def test_waiting_request_past_its_deadline_is_not_run(make_backend):
    from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest

    now = [100.0]
    batcher = ContinuousBatcher(make_backend(max_batch_size=1), clock=lambda: now[0])
    ids, px = make_prompt(1, 4)
    first = GenerationRequest(ids, px, max_new_tokens=6, request_id="a", deadline_s=100.2)  # most urgent
    late = GenerationRequest(ids, px, max_new_tokens=3, request_id="b", deadline_s=100.5)
    batcher.submit(first)
    batcher.submit(late)
    out = batcher.step()  # admits "a" (earliest deadline, the only row), "b" waits
    assert out == [] and batcher.n_running == 1 and batcher.n_waiting == 1
    now[0] = 101.0  # "a" is running: its deadline no longer applies; "b" never started
    out = batcher.step()
    assert [(r.request_id, r.finish_reason, r.tokens) for r in out] == [("b", "deadline", [])]
    rest = []
    while batcher.n_running:
        rest += batcher.step()
    assert [(r.request_id, r.finish_reason, len(r.tokens)) for r in rest] == [("a", "length", 6)]


def test_submit_rejects_what_cannot_run(make_backend):
    from edgevlm.errors import InvalidRequestError
    from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest

    batcher = ContinuousBatcher(make_backend(max_seq_len=40, max_batch_size=2))
    with pytest.raises(InvalidRequestError, match="KV cache"):
        batcher.submit(GenerationRequest([1] * 40))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        batcher.submit(GenerationRequest([1, 5, 6], max_new_tokens=0))
    with pytest.raises(ValueError, match="token_budget"):
        ContinuousBatcher(make_backend(), token_budget=0)


def test_batched_entry_points_reject_bad_rows(make_backend):
    be = make_backend(max_batch_size=2)
    e = be.embed(torch.tensor([[1, 5, 6]]), None)
    with pytest.raises(ValueError, match="cache rows"):
        be.prefill_batch([e], [2])
    with pytest.raises(ValueError, match="prompts"):
        be.prefill_batch([e, e], [0])
    with pytest.raises(ValueError, match="decode_batch"):
        be.decode_batch([5, 6, 7], [3, 3, 3])
    with pytest.raises(ValueError, match="positions"):
        be.decode_batch([5], [be.max_seq_len])
