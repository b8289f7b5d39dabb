"""The Triton W4A16 kernels and the fused decode-step kernels: argument checks everywhere; numerics
through Triton's CPU interpreter when triton is installed (fp32; bf16 and speed are checked on the
GPU by bench/gpu_suite.py and bench/w4a16_tune.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_support import REPO, needs_triton, run_interpreted  # noqa: E402,F401


def test_w4a16_rejects_bad_shapes():
    from edgevlm.runtime.int4 import quantize_int4
    from edgevlm.runtime.kernels.w4a16 import dequantize_w4, w4a16_gemv, w4a16_gemv1

    qw = quantize_int4(torch.randn(16, 256), 128)
    with pytest.raises(ValueError, match=r"x must be \(M, 256\)"):
        w4a16_gemv(torch.randn(2, 128), qw.qweight, qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match="multiple of group_size"):
        w4a16_gemv(torch.randn(2, 256), qw.qweight, qw.scales, qw.zeros, 96)
    with pytest.raises(ValueError, match="scales/zeros must be"):
        w4a16_gemv(torch.randn(2, 256), qw.qweight, qw.scales[:, :1].contiguous(), qw.zeros, 128)
    with pytest.raises(ValueError, match="contiguous uint8"):
        dequantize_w4(qw.qweight.to(torch.int32), qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match="one row of 256"):
        w4a16_gemv1(torch.randn(2, 256), qw.qweight, qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match="powers of two"):
        w4a16_gemv1(torch.randn(1, 256), qw.qweight, qw.scales, qw.zeros, 128, config=(8, 3, 1, 4))
    with pytest.raises(ValueError, match="BLOCK_K=64 must be a multiple"):
        w4a16_gemv(torch.randn(1, 256), qw.qweight, qw.scales, qw.zeros, 128, config=(1, 16, 64, 1, 4))


def test_decode_kernels_reject_bad_shapes():
    from edgevlm.runtime.kernels.decode_fused import add_rms_norm, rope_kv_write, silu_mul

    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"expected \(R, 2I\)"):
        silu_mul(torch.randn(2, 7))
    cache = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="does not match"):
        rope_kv_write(torch.randn(1, 100), torch.ones(8, 16), torch.ones(8, 16), torch.tensor([0]), cache, cache, 4, 2)
    odd = torch.zeros(1, 2, 8, 12)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rope_kv_write(torch.randn(1, 96), torch.ones(8, 12), torch.ones(8, 12), torch.tensor([0]), odd, odd, 4, 2)
    qkv, tab = torch.randn(1, 128), torch.ones(16, 16)
    with pytest.raises(ValueError, match=r"P >= S"):
        rope_kv_write(qkv, torch.ones(4, 16), torch.ones(4, 16), torch.tensor([0]), cache, cache, 4, 2)
    with pytest.raises(ValueError, match="rope_pos must be"):
        rope_kv_write(qkv, tab, tab, torch.tensor([0]), cache, cache, 4, 2, rope_pos=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="both be"):
        rope_kv_write(qkv, tab, tab, torch.tensor([0]), cache, cache, 4, 2, q_norm=torch.ones(16))


def test_int4_execution_paths_on_cpu():
    from edgevlm.runtime.int4 import Int4Linear, set_int4_kernel

    mod = Int4Linear.from_linear(torch.nn.Linear(256, 32), 128)
    cpu = torch.device("cpu")
    set_int4_kernel(mod, "tinygemm")
    assert mod.execution_path(1, cpu) in ("cpu_for_cpu", "dequant")
    set_int4_kernel(mod, "dequant")
    assert mod.execution_path(1, cpu) == "dequant"
    with pytest.raises(ValueError, match="kernel must be one of"):
        set_int4_kernel(mod, "marlin")


W4A16_SCRIPT = """
    import json, torch
    from edgevlm.runtime.int4 import Int4Linear, quantize_int4, dequantize_int4, set_int4_kernel
    from edgevlm.runtime.kernels.w4a16 import w4a16_gemv, w4a16_gemv1, dequantize_w4
    torch.manual_seed(0)
    out = {"gemv": [], "dequant_exact": [], "linear": []}
    # K = 4288 is not a multiple of BLOCK_K; 192 is 1.5 x 128; groups 32/64/128; split-K 1/2/4
    for n, k, g in [(40, 384, 128), (24, 4288, 32), (64, 192, 64), (17, 512, 128)]:
        w = torch.randn(n, k)
        qw = quantize_int4(w, g)
        ref_w = dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
        b = torch.randn(n)
        for m in (1, 3, 5):
            x = torch.randn(m, k)
            ref = x.double() @ ref_w.T + b.double()
            for cfg in (None, (1, 16, 256, 1, 4), (4, 8, 256, 4, 4), (2, 16, 512, 2, 4)):
                if cfg is not None and cfg[2] % g:
                    continue
                y = w4a16_gemv(x, qw.qweight, qw.scales, qw.zeros, g, b, config=cfg)
                out["gemv"].append([n, k, g, m, str(cfg), float((y.double() - ref).norm() / ref.norm()),
                                    list(y.shape)])
        x1 = torch.randn(1, k)
        ref1 = x1.double() @ ref_w.T + b.double()
        for cfg in (None, (8, 1, 1, 4), (16, 2, 2, 4), (4, 4, 4, 2)):
            y = w4a16_gemv1(x1, qw.qweight, qw.scales, qw.zeros, g, b, config=cfg)
            out["gemv"].append([n, k, g, 1, "gemv1 " + str(cfg), float((y.double() - ref1).norm() / ref1.norm()),
                                [y.shape[0], y.shape[1]]])
        out["dequant_exact"].append(bool(torch.equal(
            dequantize_w4(qw.qweight, qw.scales, qw.zeros, g, torch.float32),
            dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float32))))
        lin = Int4Linear.from_int4(qw, b)
        set_int4_kernel(lin, "triton")
        for bsz, m in ((1, 1), (2, 1), (2, 12)):
            x = torch.randn(bsz, m, k)
            path = lin.execution_path(bsz * m, x.device)
            y = lin(x)
            ref = (x.double() @ ref_w.T + b.double())
            out["linear"].append([path, float((y.double() - ref).norm() / ref.norm()), list(y.shape)])
    print(json.dumps(out))
"""


@needs_triton
def test_w4a16_kernels_match_float64_in_the_interpreter():
    res = run_interpreted(W4A16_SCRIPT)
    assert len(res["gemv"]) >= 46
    for n, k, g, m, cfg, err, shape in res["gemv"]:
        assert shape == [m, n]
        assert err < 1e-5, (n, k, g, m, cfg, err)
    assert res["dequant_exact"] == [True] * 4
    paths = [p for p, _, _ in res["linear"]]
    assert paths == ["triton_gemv1", "triton_gemv", "triton_dequant"] * 4
    for _, err, shape in res["linear"]:
        assert err < 1e-5 and len(shape) == 3


DECODE_SCRIPT = """
    import json, torch
    from edgevlm.runtime.config import TextConfig
    from edgevlm.runtime.decoder import Decoder
    torch.manual_seed(0)
    import sys
    qwen = sys.argv[1] == "qwen"  # q/k norm, q/k/v bias and a per-row M-RoPE offset (Qwen-VL decoders)
    cfg = TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                     qk_norm=qwen, qkv_bias=qwen, mrope_section=(2, 3, 3) if qwen else None)
    dec = Decoder(cfg)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.2)
    dec.setup_caches(2, 64)
    dec.fuse_projections()
    prompt = torch.randint(0, 97, (2, 9))
    res = {}
    logits = {}
    caches = {}
    for fused in (False, True):
        res[f"enabled_{fused}"] = dec.enable_fused_decode(fused)
        for layer in dec.layers:
            layer.self_attn.kv_cache.reset()
        with torch.no_grad():
            dec(dec.embed_tokens(prompt), torch.arange(9), prefill=True)
            steps = []
            tok = torch.tensor([[5], [11]])
            pos = torch.tensor([9, 9])
            for i in range(4):  # rows at different positions after step 2
                off = torch.tensor([3, 7]) if qwen else 0  # RoPE position = slot + offset
                steps.append(dec.decode_step(tok, pos, 32, off))
                tok = steps[-1].argmax(-1, keepdim=True)
                pos = pos + torch.tensor([1, 2 if i >= 1 else 1])
        logits[fused] = torch.stack(steps)
        caches[fused] = torch.stack([layer.self_attn.kv_cache.k for layer in dec.layers])
    ref = logits[False].double()
    res["rel"] = float((logits[True].double() - ref).norm() / ref.norm())
    res["argmax_same"] = bool(torch.equal(logits[True].argmax(-1), logits[False].argmax(-1)))
    res["kcache_max_diff"] = float((caches[True] - caches[False]).abs().max())
    res["shape"] = list(logits[True].shape)
    print(json.dumps(res))
"""


ATTN_SCRIPT = """
    import json, torch
    from edgevlm.runtime.kernels.decode_fused import decode_attention
    torch.manual_seed(0)
    out = []
    # budget: CTAs aimed for (None: the device's); 1 and 4 force one split (no combine) and two splits
    for b, h, hkv, dh, s, kv_len, pos, dtype, budget in [
            (1, 4, 2, 16, 64, 40, [17], torch.float32, None),
            (2, 8, 2, 32, 300, 300, [0, 299], torch.float32, None),
            (3, 4, 4, 16, 2048, 1100, [1099, 5, 640], torch.float16, None),
            (2, 8, 2, 32, 300, 300, [0, 299], torch.float32, 1),
            (3, 4, 4, 16, 2048, 1100, [1099, 5, 640], torch.float16, 1),
            (2, 8, 2, 32, 300, 300, [7, 250], torch.float32, 8)]:
        q = torch.randn(b, h, 1, dh).to(dtype)
        k = torch.randn(b + 1, hkv, s, dh).to(dtype)
        v = torch.randn(b + 1, hkv, s, dh).to(dtype)
        y = decode_attention(q, k, v, torch.tensor(pos), kv_len, block_n=16 if dh == 16 else 32, cta_budget=budget)
        rep = h // hkv
        ref = torch.stack([torch.nn.functional.scaled_dot_product_attention(
            q[i].double(), k[i, :, : pos[i] + 1].double().repeat_interleave(rep, 0),
            v[i, :, : pos[i] + 1].double().repeat_interleave(rep, 0)) for i in range(b)])
        out.append([float((y.double() - ref).norm() / ref.norm()), bool(torch.isfinite(y).all()), str(dtype)])
    print(json.dumps({"rel": out}))
"""


@needs_triton
def test_decode_attention_matches_float64_in_the_interpreter():
    """GQA (rep 2 and 4) and plain heads, rows at different positions, a kv_len that is not a
    multiple of the key block, positions 0 and kv_len - 1; fp32 and fp16; the keys in up to 16
    splits, in two, and in one (the output written without the combine kernel)."""
    res = run_interpreted(ATTN_SCRIPT)
    assert len(res["rel"]) == 6
    for err, finite, dtype in res["rel"]:
        assert finite and err < (1e-5 if dtype == "torch.float32" else 2e-3), (err, dtype)


def test_decode_attention_rejects_bad_shapes():
    from edgevlm.runtime.kernels.decode_fused import decode_attention

    q, cache = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(q, cache, cache, torch.tensor([0]), 9)  # kv_len past the cache
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(torch.zeros(1, 3, 1, 16), cache, cache, torch.tensor([0]), 8)  # 3 heads over 2
    with pytest.raises(ValueError, match="one dtype"):
        decode_attention(q.half(), cache, cache, torch.tensor([0]), 8)


@needs_triton
@pytest.mark.parametrize("case", ["llama", "qwen"])
def test_fused_decode_step_matches_the_layer_loop_in_the_interpreter(case):
    res = run_interpreted(DECODE_SCRIPT, case)
    assert res["enabled_False"] is False and res["enabled_True"] is True
    assert res["shape"] == [4, 2, 97]
    assert res["rel"] < 1e-5
    assert res["argmax_same"]
    assert res["kcache_max_diff"] < 1e-5  # rotated keys written at the same positions


def test_fused_decode_stays_off_without_its_conditions():
    from edgevlm.runtime.config import TextConfig
    from edgevlm.runtime.decoder import Decoder

    cfg = TextConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    dec = Decoder(cfg)
    dec.setup_caches(1, 16)
    assert dec.enable_fused_decode() is False  # projections not fused (and no CUDA / interpreter here)
    assert dec.fused_decode is False
