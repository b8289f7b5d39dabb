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
