"""``rope_decode_attention``: RoPE + KV write + split attention + combine of a decode step in one Triton kernel
(session 8 of issue 15). Against the two-kernel path (``rope_kv_write`` + ``decode_attention``) and float64:
in Triton's CPU interpreter where triton is installed, compiled on a CUDA GPU (skips without one)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_support import needs_triton, run_interpreted  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

INTERP_SCRIPT = """
    import json, torch
    from edgevlm.runtime.decoder import rope_tables
    from edgevlm.runtime.kernels.decode_fused import decode_attention, rope_decode_attention, rope_kv_write
    torch.manual_seed(0)
    out = []
    # (H, Hkv, Dh, kv_len, S, rows, q/k norm, unit offset, RoPE offset): plain heads, GQA 2 and 4 with q/k norm,
    # Gemma's unit-offset norm weights, a kv_len that is no multiple of the key block, 3 query heads per KV head
    for dtype in (torch.float32, torch.float16):
        for h, hkv, dh, kv_len, s, b, qkn, unit, shift in [(4, 4, 16, 70, 80, 3, False, False, False),
                                                           (8, 2, 32, 64, 64, 2, True, False, True),
                                                           (8, 4, 16, 129, 140, 2, True, True, False),
                                                           (6, 2, 16, 20, 32, 1, False, False, False)]:
            cos, sin = rope_tables(dh, 2 * s, 10000.0, "cpu")
            cos, sin = cos.to(dtype), sin.to(dtype)
            qkv = torch.randn(b, (h + 2 * hkv) * dh).to(dtype)
            kc, vc = torch.randn(b + 1, hkv, s, dh).to(dtype), torch.randn(b + 1, hkv, s, dh).to(dtype)
            pos = torch.tensor([0, kv_len - 1, kv_len // 2][:b])  # the first slot, the last, one inside
            rpos = pos + 7 if shift else None
            qn = torch.randn(dh).to(dtype) if qkn else None
            kn = torch.randn(dh).to(dtype) if qkn else None
            k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            q = rope_kv_write(qkv, cos, sin, pos, k1, v1, h, hkv, rope_pos=rpos, q_norm=qn, k_norm=kn,
                              unit_offset=unit)
            two = decode_attention(q, k1, v1, pos, kv_len, scale=0.3)
            rep = h // hkv
            ref = torch.stack([torch.nn.functional.scaled_dot_product_attention(
                q[i].double(), k1[i, :, : pos[i] + 1].double().repeat_interleave(rep, 0),
                v1[i, :, : pos[i] + 1].double().repeat_interleave(rep, 0), scale=0.3) for i in range(b)])
            # the second launch finds the per-head counters back at zero; the third leaves the combine to its kernel
            for launch, combine in ((0, True), (1, True), (2, False)):
                y = rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, kv_len, rope_pos=rpos, q_norm=qn,
                                          k_norm=kn, unit_offset=unit, scale=0.3, combine=combine)
                out.append({"dtype": str(dtype), "h": h, "hkv": hkv, "launch": launch,
                            "vs_two": float((y.double() - two.double()).norm() / two.double().norm()),
                            "vs_f64": float((y.double() - ref).norm() / ref.norm()),
                            "two_vs_f64": float((two.double() - ref).norm() / ref.norm()),
                            "k_diff": float((k1.double() - k2.double()).abs().max()),
                            "v_same": bool(torch.equal(v1, v2)), "shape": list(y.shape), "expect": [b, h, 1, dh],
                            "finite": bool(torch.isfinite(y).all())})
    # fewer splits when rows x KV heads fill the GPU: 2 and then 1 split (one CTA per head writes the output)
    import edgevlm.runtime.kernels.decode_fused as df
    for budget in (16, 4):
        df._cta_budget = lambda device, budget=budget: budget
        h, hkv, dh, kv_len, s, b = 8, 4, 16, 200, 256, 2
        cos, sin = rope_tables(dh, s, 10000.0, "cpu")
        qkv = torch.randn(b, (h + 2 * hkv) * dh)
        kc, vc = torch.randn(b, hkv, s, dh), torch.randn(b, hkv, s, dh)
        pos = torch.tensor([199, 70])
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        two = decode_attention(rope_kv_write(qkv, cos, sin, pos, k1, v1, h, hkv), k1, v1, pos, kv_len)
        for combine in (True, False):
            y = rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, kv_len, combine=combine)
            out.append({"dtype": "budget", "h": budget, "hkv": hkv, "launch": int(not combine), "expect": [b, h, 1, dh],
                        "vs_two": float((y - two).norm() / two.norm()), "vs_f64": 0.0, "two_vs_f64": 0.0,
                        "k_diff": float((k1 - k2).abs().max()), "v_same": bool(torch.equal(v1, v2)),
                        "shape": list(y.shape), "finite": bool(torch.isfinite(y).all())})
    print(json.dumps({"rows": out}))
"""


# PDL in the interpreter: the kernels' griddepcontrol calls become Python functions; WAIT_HOOK runs at each wait
PDL_IN_INTERPRETER = """
    import triton.language as tl
    import edgevlm.runtime.kernels.decode_fused as df
    WAIT_HOOK = []
    def fake_wait(*args, **kwargs):
        for hook in WAIT_HOOK:
            hook()
    tl.extra.cuda.gdc_wait = fake_wait
    tl.extra.cuda.gdc_launch_dependents = lambda *args, **kwargs: None
    df.pdl_ok = lambda device, rows: True
"""

KV_EARLY_SCRIPT = PDL_IN_INTERPRETER + """
    import json, torch
    torch.manual_seed(1)
    out = []
    # (H, Hkv, Dh, S, kv_len, positions, new slots, window, CTA budget): one key block per split, several blocks
    # per split (a small budget), the new slot away from the last position (a rolling cache), GQA 4, a window
    cases = [(4, 4, 16, 96, 80, [0, 79, 40], None, None, 1 << 20),
             (4, 4, 16, 96, 80, [0, 79, 40], None, None, 4),
             (8, 2, 32, 64, 64, [63, 17], [5, 17], None, 1 << 20),
             (8, 2, 32, 64, 64, [63, 17], [5, 17], None, 2),
             (8, 2, 16, 128, 128, [100, 127], None, 10, 1 << 20),
             (6, 2, 16, 40, 40, [39], None, None, 1)]
    for dtype in (torch.float32, torch.bfloat16):
        for h, hkv, dh, s, kv_len, pos, slots, window, budget in cases:
            b = len(pos)
            q = torch.randn(b, h, 1, dh).to(dtype)
            kc, vc = torch.randn(b, hkv, s, dh).to(dtype), torch.randn(b, hkv, s, dh).to(dtype)
            pos_t = torch.tensor(pos)
            slot_t = torch.tensor(slots if slots is not None else pos)
            ys = {}
            for early in (False, True):
                df.ATTENTION_KV_BEFORE_WAIT = early
                ys[early] = df.decode_attention(q, kc, vc, pos_t, kv_len, block_n=16, window=window,
                                                cta_budget=budget, new_slot=slot_t)
            ref = df.decode_attention(q, kc, vc, pos_t, kv_len, block_n=16, window=window, cta_budget=budget)
            out.append({"case": [h, hkv, s, kv_len, budget, str(dtype)], "same": bool(torch.equal(ys[True], ys[False])),
                        "same_as_no_slot": bool(torch.equal(ys[True], ref)),
                        "finite": bool(torch.isfinite(ys[True]).all())})
    print(json.dumps({"rows": out}))
"""


# the new slot's key and value land at the wait, as the RoPE + KV write's do: NaN before it. One program per case
# (one row, one KV head, one split), so that no other program's wait puts the row in place first
POISON_SCRIPT = PDL_IN_INTERPRETER + """
    import json, torch
    torch.manual_seed(2)
    out = []
    # (H, S, position, new slot, window): the slot in the first block, in a later block (a rolling cache), with a
    # window, the first position
    for h, s, pos, slot, window in [(4, 64, 40, 40, None), (4, 64, 63, 5, None), (2, 64, 63, 60, 10),
                                    (1, 64, 0, 0, None)]:
        q = torch.randn(1, h, 1, 16)
        kc, vc = torch.randn(1, 1, s, 16), torch.randn(1, 1, s, 16)
        ref = df.decode_attention(q, kc, vc, torch.tensor([pos]), s, block_n=16, window=window, cta_budget=1)
        true_k, true_v = kc[0, 0, slot].clone(), vc[0, 0, slot].clone()
        kc[0, 0, slot], vc[0, 0, slot] = float("nan"), float("nan")
        waits = []
        def land(true_k=true_k, true_v=true_v, slot=slot):
            kc[0, 0, slot], vc[0, 0, slot] = true_k, true_v
            waits.append(1)
        WAIT_HOOK[:] = [land]
        df.ATTENTION_KV_BEFORE_WAIT = True
        y = df.decode_attention(q, kc, vc, torch.tensor([pos]), s, block_n=16, window=window, cta_budget=1,
                                new_slot=torch.tensor([slot]))
        out.append({"case": [h, s, pos, slot, window], "waits": len(waits), "same": bool(torch.equal(y, ref))})
    print(json.dumps({"rows": out}))
"""


@needs_triton
def test_the_new_slot_is_read_after_the_wait_in_the_interpreter():
    """Under PDL (griddepcontrol stubbed in Triton's interpreter) the new slot holds NaN until the wait writes its
    key and value, as the previous kernel's writes become visible there: the output equals the plain kernel's, so
    nothing of that slot was read before the wait; the old slots read before it are the ones the kernel uses."""
    rows = run_interpreted(POISON_SCRIPT)["rows"]
    assert len(rows) == 4
    for row in rows:
        assert row["waits"] == 1 and row["same"], row


@needs_triton
def test_old_keys_read_before_the_wait_give_the_same_bits_in_the_interpreter():
    """decode_attention with ``new_slot`` and ATTENTION_KV_BEFORE_WAIT under PDL (stubbed in the interpreter): the
    first key block read without the new slot's row, that row read after the wait and put in place: bit-identical
    to the plain kernel, with one or several key blocks per split, a new slot that is not the last position, GQA
    and a window."""
    rows = run_interpreted(KV_EARLY_SCRIPT)["rows"]
    assert len(rows) == 12
    for row in rows:
        assert row["same"] and row["same_as_no_slot"] and row["finite"], row


def test_new_slot_must_be_one_int64_per_row():
    from edgevlm.runtime.kernels.decode_fused import decode_attention

    q, cache, pos = torch.zeros(2, 4, 1, 16), torch.zeros(2, 2, 8, 16), torch.tensor([3, 4])
    for bad in (torch.tensor([3]), torch.tensor([3.0, 4.0]), torch.tensor([[3], [4]])):
        with pytest.raises(ValueError, match="new_slot must be"):
            decode_attention(q, cache, cache, pos, 8, new_slot=bad)


@needs_triton
def test_one_kernel_equals_rope_kv_write_and_decode_attention_in_the_interpreter():
    rows = run_interpreted(INTERP_SCRIPT)["rows"]
    assert len(rows) == 28  # 8 cases x 3 launches (the last with the combine kernel), 2 budgets x 2
    for r in rows:
        assert r["finite"] and r["v_same"], r
        assert r["shape"] == r["expect"], r
        fp32 = r["dtype"] in ("torch.float32", "budget")
        assert r["vs_two"] < (1e-6 if fp32 else 1e-3), r  # the same function (fp32: rounding only)
        assert r["vs_f64"] < (1e-5 if fp32 else 2e-3), r
        assert r["k_diff"] < (1e-5 if fp32 else 1e-2), r  # rotated keys at the slot (norm sums in another order)


def test_rope_decode_attention_rejects_bad_shapes():
    from edgevlm.runtime.kernels.decode_fused import rope_decode_attention

    cache, tab = torch.zeros(1, 2, 8, 16), torch.ones(16, 16)
    qkv, pos = torch.randn(1, 128), torch.tensor([0])
    with pytest.raises(ValueError, match="does not match"):
        rope_decode_attention(torch.randn(1, 100), tab, tab, pos, cache, cache, 4, 2, 8)
    with pytest.raises(ValueError, match="1 <= kv_len <= S"):
        rope_decode_attention(qkv, tab, tab, pos, cache, cache, 4, 2, 9)
    with pytest.raises(ValueError, match="qkv's dtype"):
        rope_decode_attention(qkv.half(), tab, tab, pos, cache, cache, 4, 2, 8)
    with pytest.raises(ValueError, match="rope_pos must be"):
        rope_decode_attention(qkv, tab, tab, pos, cache, cache, 4, 2, 8, rope_pos=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="both be"):
        rope_decode_attention(qkv, tab, tab, pos, cache, cache, 4, 2, 8, q_norm=torch.ones(16))


def test_switch_is_read_at_import(monkeypatch):
    import importlib

    from edgevlm.runtime.kernels import decode_fused

    try:
        monkeypatch.setenv("EDGEVLM_DECODE_FUSED_ATTENTION", "1")
        assert importlib.reload(decode_fused).FUSED_ATTENTION is True
        monkeypatch.setenv("EDGEVLM_DECODE_FUSED_ATTENTION", "0")
        assert importlib.reload(decode_fused).FUSED_ATTENTION is False
        monkeypatch.delenv("EDGEVLM_DECODE_FUSED_ATTENTION")  # off unless asked for: measured slower (session 8)
        assert importlib.reload(decode_fused).FUSED_ATTENTION is False
    finally:
        monkeypatch.undo()
        importlib.reload(decode_fused)


@needs_triton
@pytest.mark.parametrize("case", ["llama", "qwen"])
def test_fused_step_with_the_one_kernel_attention_matches_the_layer_loop(case, monkeypatch):
    """EDGEVLM_DECODE_FUSED_ATTENTION=1: the fused step with rope_decode_attention (the default three-kernel
    path is checked by test_w4a16_and_decode_kernels' own fused-step test)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_decode_kernel_tests",
                                                  Path(__file__).with_name("test_w4a16_and_decode_kernels.py"))
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    DECODE_SCRIPT = other.DECODE_SCRIPT
    monkeypatch.setenv("EDGEVLM_DECODE_FUSED_ATTENTION", "1")
    res = run_interpreted(DECODE_SCRIPT, case)
    assert res["enabled_True"] is True and res["shape"] == [4, 2, 97]
    assert res["rel"] < 1e-5 and res["argmax_same"] and res["kcache_max_diff"] < 1e-5


def _case(h, hkv, dh, s, b, qkn, dtype, dev, seed):
    from edgevlm.runtime.decoder import rope_tables

    g = torch.Generator(device=dev).manual_seed(seed)
    cos, sin = rope_tables(dh, s, 10000.0, dev)
    qkv = torch.randn(b, (h + 2 * hkv) * dh, device=dev, generator=g).to(dtype)
    kc = torch.randn(b, hkv, s, dh, device=dev, generator=g).to(dtype)
    vc = torch.randn(b, hkv, s, dh, device=dev, generator=g).to(dtype)
    qn = torch.randn(dh, device=dev, generator=g).to(dtype) if qkn else None
    kn = torch.randn(dh, device=dev, generator=g).to(dtype) if qkn else None
    return cos.to(dtype), sin.to(dtype), qkv, kc, vc, qn, kn


@needs_cuda
@pytest.mark.parametrize("h,hkv,qkn", [(32, 32, False), (32, 8, True), (16, 2, False)])
@pytest.mark.parametrize("b", [1, 8])
def test_cuda_one_kernel_matches_the_two_kernels_and_float64(h, hkv, qkn, b):
    """bf16, head dim 128, a 768-slot bucket with rows at different positions (0, 608, 767, ...); three launches
    give the same bits (the per-head counters reset), the slot's key / value written as the two kernels do."""
    from edgevlm.runtime.kernels import decode_fused as df

    dev = torch.device("cuda")
    dh, s, kv_len = 128, 1024, 768
    cos, sin, qkv, kc, vc, qn, kn = _case(h, hkv, dh, s, b, qkn, torch.bfloat16, dev, seed=b * 100 + h + hkv)
    pos = torch.tensor([608, 0, 767, 300, 64, 63, 1, 700][:b], device=dev)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = df.rope_kv_write(qkv, cos, sin, pos, k1, v1, h, hkv, q_norm=qn, k_norm=kn)
    two = df.decode_attention(q, k1, v1, pos, kv_len)
    rep = h // hkv
    ref = torch.stack([torch.nn.functional.scaled_dot_product_attention(
        q[i].double(), k1[i, :, : pos[i] + 1].double().repeat_interleave(rep, 0),
        v1[i, :, : pos[i] + 1].double().repeat_interleave(rep, 0)) for i in range(b)])
    outs = [df.rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, kv_len, q_norm=qn, k_norm=kn)
            for _ in range(3)]
    torch.cuda.synchronize()
    y = outs[0]
    assert y.shape == (b, h, 1, dh) and torch.isfinite(y).all()
    assert all(torch.equal(y, o) for o in outs[1:])
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2  # bf16 output rounding
    assert float((y.double() - two.double()).norm() / two.double().norm()) < 5e-3
    assert torch.equal(v1, v2)
    # the slot's rotated key: equal up to one bf16 rounding step (the compiler may contract x1 c - x2 s differently)
    assert bool(((k1.float() - k2.float()).abs() <= k1.float().abs() * 2 ** -7 + 1e-6).all())
    assert int(df._counters(b * hkv, dev).abs().sum()) == 0


@needs_cuda
def test_cuda_one_kernel_in_a_cuda_graph_replays_like_eager():
    """The kernel captured once and replayed with new inputs (positions, qkv) gives the eager result each time."""
    from edgevlm.runtime.kernels import decode_fused as df

    dev = torch.device("cuda")
    h, hkv, dh, s, b = 32, 32, 128, 1024, 2
    cos, sin, qkv, kc, vc, _, _ = _case(h, hkv, dh, s, b, False, torch.bfloat16, dev, seed=5)
    pos = torch.tensor([610, 3], device=dev)
    k2, v2 = kc.clone(), vc.clone()
    df.rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, 768)  # warm-up (compile, counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = df.rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, 768)
    for step in range(4):
        qkv.copy_(torch.randn(qkv.shape, device=dev).to(qkv.dtype))
        pos.copy_(torch.tensor([611 + step, 4 + step], device=dev))
        graph.replay()
        k3, v3 = k2.clone(), v2.clone()
        eager = df.rope_decode_attention(qkv, cos, sin, pos, k3, v3, h, hkv, 768)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(k2, k3) and torch.equal(v2, v3)


def test_counter_buffers_outlive_a_larger_request():
    """A CUDA graph captured with the counters of a small batch keeps their address: a later, larger batch gets
    a new buffer, and the old one stays allocated (freeing it made replays write freed memory: an illegal
    address on the H200 once batch 32 followed graphs of batch 1 and 8)."""
    from edgevlm.runtime.kernels import decode_fused as df

    dev = torch.device("cpu")
    df._COUNTERS.pop(dev, None)
    small = df._counters(64, dev)
    assert df._counters(200, dev) is small  # fits: the same buffer
    big = df._counters(1024, dev)
    assert big.numel() >= 1024 and big is not small
    assert any(t is small for t in df._COUNTERS_KEPT) and any(t is big for t in df._COUNTERS_KEPT)
    assert df._counters(8, dev) is big  # the largest serves every later request


@needs_cuda
def test_cuda_graph_replays_after_a_larger_batch_took_new_counters():
    from edgevlm.runtime.kernels import decode_fused as df

    dev = torch.device("cuda")
    h, hkv, dh, s = 32, 32, 128, 1024
    cos, sin, qkv, kc, vc, _, _ = _case(h, hkv, dh, s, 2, False, torch.bfloat16, dev, seed=7)
    pos = torch.tensor([600, 5], device=dev)
    k2, v2 = kc.clone(), vc.clone()
    df.rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, 768)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = df.rope_decode_attention(qkv, cos, sin, pos, k2, v2, h, hkv, 768)
    cos_b, sin_b, qkv_b, kc_b, vc_b, _, _ = _case(h, hkv, dh, s, 32, False, torch.bfloat16, dev, seed=8)
    df.rope_decode_attention(qkv_b, cos_b, sin_b, torch.full((32,), 300, device=dev), kc_b, vc_b, h, hkv, 768)
    graph.replay()
    k3, v3 = kc.clone(), vc.clone()
    eager = df.rope_decode_attention(qkv, cos, sin, pos, k3, v3, h, hkv, 768)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@needs_cuda
@pytest.mark.parametrize("h,hkv,dh,s,b,window,ring", [(32, 32, 128, 768, 1, None, False),
                                                      (32, 8, 128, 4096, 4, None, False),
                                                      (8, 4, 256, 1024, 2, 100, False),
                                                      (16, 16, 64, 512, 3, None, True)])
def test_cuda_old_keys_before_the_wait_are_bit_identical_over_graph_replays(h, hkv, dh, s, b, window, ring,
                                                                            monkeypatch):
    """Under PDL (``EDGEVLM_PDL=on``), ``rope_kv_write`` then ``decode_attention(new_slot=)`` with
    ATTENTION_KV_BEFORE_WAIT on and off, captured in one CUDA graph and replayed 100 times with the positions moving
    (a rolling cache wraps): every replay gives the same bits both ways and the same caches."""
    from edgevlm.runtime.kernels import decode_fused as df

    monkeypatch.setenv("EDGEVLM_PDL", "on")
    monkeypatch.setattr(df, "PDL", True)
    dev = torch.device("cuda")
    if not df.pdl_ok(dev, b):
        pytest.skip("no programmatic dependent launch here (sm_90+ and a Triton with gdc_wait)")
    cos, sin, qkv, kc, vc, _, _ = _case(h, hkv, dh, 4 * s, b, False, torch.bfloat16, dev, seed=11)
    kc, vc = kc[:, :, :s].contiguous(), vc[:, :, :s].contiguous()
    caches = [(kc.clone(), vc.clone()), (kc.clone(), vc.clone())]
    pos = torch.tensor([(3 * s + 5 if ring else s // 2) + 7 * i for i in range(b)], device=dev)

    def step():
        slot = pos % s if ring else pos
        key_pos = pos.clamp(max=s - 1) if ring else pos
        ys = []
        for early, (k, v) in zip((False, True), caches, strict=True):
            monkeypatch.setattr(df, "ATTENTION_KV_BEFORE_WAIT", early)
            q = df.rope_kv_write(qkv, cos, sin, slot, k, v, h, hkv, rope_pos=pos)
            ys.append(df.decode_attention(q, k, v, key_pos, s, window=window, new_slot=slot))
        return ys

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = step()
    differ = 0
    for _ in range(100):
        qkv.normal_()
        graph.replay()
        differ += int(not torch.equal(ys[0], ys[1]))
        pos += 1
    torch.cuda.synchronize()
    assert differ == 0
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.isfinite(ys[1]).all()
