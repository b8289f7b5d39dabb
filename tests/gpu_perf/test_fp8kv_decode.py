"""FP8 (e4m3) and INT4 KV caches in the fused decode step (runtime/kernels/decode_fused.py,
``Decoder._fused_decode``): the fp8 write of ``rope_kv_write`` against ``Fp8KVCache._store`` bit for bit,
``decode_attention`` over e4m3 bytes + scales against float64 attention over the dequantized cache, and the
fused step with fp8 / int4 caches against the layer loop, through Triton's CPU interpreter; argument
errors on CPU; the compiled kernels on a CUDA GPU (skipped without one).

Run: ``.venv/bin/python -m pytest -q tests/gpu_perf/test_fp8kv_decode.py``.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from gpu_perf.test_gemma3_decode_kernels import GEMMA_DECODER  # noqa: E402  (a tiny random Gemma 3 decoder)
from triton_support import needs_triton, run_interpreted  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8 = getattr(torch, "float8_e4m3fn", None)

#: e4m3 corner values for a value head whose amax is 448 (so its scale is exactly 1 and x / scale = x):
#: ties between two codes (17 -> 16, 19 -> 20, 1.0625 -> 1, 1.1875 -> 1.25: round half to even), subnormals
#: (multiples of 2**-9) and their ties (3 * 2**-10 -> 2 * 2**-9, 5 * 2**-10 -> 2 * 2**-9), values that flush
#: to zero or round up to the smallest subnormal, signed zero, the largest normal (448) and its neighbours.
CORNERS = [448.0, 17.0, 19.0, 1.0625, 1.1875, 3 * 2.0 ** -10, 5 * 2.0 ** -10, 2.0 ** -10, 0.001, 2.0 ** -11,
           -0.0, -19.0, -1.0625, 416.0, 432.0, -440.0, 2.0 ** -6 * 1.0625, 2.0 ** -6 * 0.99, 0.3, -7.5]

WRITE_ATTN_SCRIPT = """
    import json, sys, torch
    import edgevlm.runtime.kernels.decode_fused as df
    from edgevlm.runtime.decoder import rope_tables
    from edgevlm.runtime.kernels.decode_fused import attention_splits, decode_attention, rope_kv_write
    from edgevlm.runtime.kv_cache import Fp8KVCache, KVCache
    torch.manual_seed(0)
    CORNERS = json.loads(sys.argv[1])
    out = {"write": [], "attn": []}
    # --- the write: rope_kv_write into an fp8 cache == Fp8KVCache._store of the keys/values it rotates
    for dt, qk_norm in ((torch.float32, False), (torch.float16, True)):
        b, h, hkv, dh, s = 3, 4, 2, 32, 40
        cos, sin = (t.to(dt) for t in rope_tables(dh, s, 10000.0, "cpu"))
        qkv = torch.randn(b, (h + 2 * hkv) * dh) * torch.tensor([1e-3, 1.0, 300.0])[:, None]  # three magnitudes
        qkv[0, h * dh:(h + 1) * dh] = 0  # an all-zero key: the 2**-14 scale floor
        qkv[1, (h + 1) * dh:(h + 2) * dh] = 1e-6  # a tiny key: subnormal codes
        v0 = (h + hkv) * dh  # row 2's first value head: the corner values, amax 448 -> scale 1
        qkv[2, v0:v0 + dh] = torch.tensor(CORNERS + [0.0] * (dh - len(CORNERS)))
        qkv = qkv.to(dt)
        pos, rpos = torch.tensor([5, 39, 0]), torch.tensor([7, 39, 3])
        qn = (torch.randn(dh).to(dt), torch.randn(dh).to(dt)) if qk_norm else (None, None)
        ref16 = KVCache(b + 1, hkv, s, dh, dtype=dt, device="cpu")
        q16 = rope_kv_write(qkv, cos, sin, pos, ref16.k, ref16.v, h, hkv, rope_pos=rpos, q_norm=qn[0], k_norm=qn[1])
        f8 = Fp8KVCache(b + 1, hkv, s, dh, dtype=dt, device="cpu")
        q8 = rope_kv_write(qkv, cos, sin, pos, f8.k, f8.v, h, hkv, rope_pos=rpos, q_norm=qn[0], k_norm=qn[1],
                           k_scale=f8.k_scale, v_scale=f8.v_scale)
        ref = Fp8KVCache(b + 1, hkv, s, dh, dtype=dt, device="cpu")
        rows = torch.arange(b)
        ref.write(pos[:, None], ref16.k[rows, :, pos][:, :, None], ref16.v[rows, :, pos][:, :, None])
        same = {n: bool(torch.equal(getattr(f8, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)))
                for n in ("k", "v", "k_scale", "v_scale")}
        out["write"].append({"dtype": str(dt), "same": same, "q_same": bool(torch.equal(q8, q16)),
                             "corner_codes": f8.v[2, 0, 0].view(torch.uint8)[:len(CORNERS)].tolist(),
                             "corner_scale": float(f8.v_scale[2, 0, 0]),
                             "zero_key_scale": float(f8.k_scale[0, 0, 5]),
                             "untouched": bool((f8.k.view(torch.uint8)[3] == 0).all())})
    # --- attention over e4m3 bytes + scales vs float64 attention over the dequantized cache
    for native in (False, True):  # the bits decoding (any GPU) and the hardware conversion's path
        df.FP8_NATIVE = native
        for b, h, hkv, dh, s, kv_len, pos, dt, budget, win in [
                (1, 4, 4, 32, 64, 40, [17], torch.float32, 1, None),           # MHA, one split (no combine)
                (2, 8, 2, 32, 300, 300, [0, 299], torch.float32, None, None),  # GQA 4, 16 splits
                (2, 4, 4, 16, 300, 300, [7, 250], torch.float16, 16, None),    # MHA fp16, two splits
                (3, 8, 2, 32, 300, 300, [299, 0, 100], torch.float16, None, None),  # GQA fp16, 16 splits
                (2, 8, 2, 32, 300, 300, [7, 250], torch.float32, None, 20)]:   # GQA, a window, 16 splits
            c = Fp8KVCache(b + 1, hkv, s, dh, dtype=dt, device="cpu")
            # per position magnitudes from 1e-3 to 1e2 (scales from the 2**-14 floor to ~0.2): p x scale in fp16
            mag = 10 ** torch.empty(1, 1, s, 1).uniform_(-3, 2) if dt == torch.float16 else 1.0
            c.write(torch.arange(s), 3 * torch.randn(b + 1, hkv, s, dh) * mag, torch.randn(b + 1, hkv, s, dh) * mag)
            q = torch.randn(b, h, 1, dh).to(dt)
            y = decode_attention(q, c.k, c.v, torch.tensor(pos), kv_len, block_n=16, cta_budget=budget,
                                 k_scale=c.k_scale, v_scale=c.v_scale, window=win)
            k, v = c.read(b, s, torch.float64)  # exact: e4m3 x fp16 scale in float64
            rep = h // hkv
            refs = []
            for i in range(b):
                lo = 0 if win is None else max(0, pos[i] - win + 1)
                refs.append(torch.nn.functional.scaled_dot_product_attention(
                    q[i].double(), k[i, :, lo:pos[i] + 1].repeat_interleave(rep, 0),
                    v[i, :, lo:pos[i] + 1].repeat_interleave(rep, 0)))
            ref = torch.stack(refs)
            out["attn"].append({"native": native, "dtype": str(dt), "rep": rep, "window": win,
                                "splits": attention_splits(b, hkv, kv_len, 16, 16, budget or 528),
                                "rel": float((y.double() - ref).norm() / ref.norm()), "out_dtype": str(y.dtype)})
    print(json.dumps(out))
"""


@needs_triton
def test_fp8_write_and_attention_in_the_interpreter():
    """The write: every byte and scale equal to ``Fp8KVCache._store`` of the rotated keys / values (fp32 and
    fp16, q/k norm, RoPE positions apart from the slots, a zero head at the 2**-14 floor, tiny values in
    subnormal codes, ties rounded to even); the queries equal the 16-bit cache's. The attention: within
    1e-5 (fp32) / 2e-3 (fp16) relative of float64 attention over the exactly dequantized cache, with 1, 2
    and 16 splits, GQA and MHA, a sliding window, decoding the bytes both ways."""
    res = run_interpreted(WRITE_ATTN_SCRIPT, json.dumps(CORNERS))
    assert len(res["write"]) == 2
    want = torch.tensor(CORNERS).to(FP8).view(torch.uint8).tolist()  # torch's rounding of the corner values
    assert want[:3] == [0x7E, 0x58, 0x5A] and want[5:7] == [2, 2]  # 448, 17 -> 16, 19 -> 20; subnormal ties
    for w in res["write"]:
        assert w["same"] == {"k": True, "v": True, "k_scale": True, "v_scale": True}, w
        assert w["q_same"] and w["untouched"], w
        assert w["corner_scale"] == 1.0 and w["corner_codes"] == want, w
        assert w["zero_key_scale"] == 2.0 ** -14
    assert [a["splits"] for a in res["attn"][:5]] == [1, 16, 2, 16, 16]
    assert len(res["attn"]) == 10
    for a in res["attn"]:
        assert a["out_dtype"] == a["dtype"]
        assert 0 < a["rel"] < (1e-5 if a["dtype"] == "torch.float32" else 2e-3), a


DECODE_SCRIPT = """
    import json, sys, torch
    from edgevlm.runtime.config import TextConfig
    from edgevlm.runtime.decoder import Decoder
    out = {}
    for case, kv in (("llama", "fp8_e4m3"), ("qwen", "fp8_e4m3"), ("qwen", "int4")):
        torch.manual_seed(0)
        qwen = case == "qwen"  # GQA, q/k norm, q/k/v bias and a per-row M-RoPE offset; llama: MHA
        cfg = TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2 if qwen else 4, head_dim=16,
                         rms_norm_eps=1e-5, qk_norm=qwen, qkv_bias=qwen, mrope_section=(2, 3, 3) if qwen else None)
        dec = Decoder(cfg)
        with torch.no_grad():
            for p in dec.parameters():
                p.normal_(0, 0.2)
        dec.setup_caches(2, 64, kv_cache_dtype=kv, int4_group_size=8)
        dec.fuse_projections()
        prompt = torch.randint(0, 97, (2, 9))
        logits, caches, calls = {}, {}, []
        step = dec._fused_decode
        dec._fused_decode = lambda *a, **k: calls.append(1) or step(*a, **k)  # count the fused steps
        enabled = []
        for fused in (False, True):
            enabled.append(dec.enable_fused_decode(fused))
            for layer in dec.layers:
                layer.self_attn.kv_cache.reset()
            with torch.no_grad():
                dec(dec.embed_tokens(prompt), torch.arange(9), prefill=True)
                steps, tok, pos = [], torch.tensor([[5], [11]]), torch.tensor([9, 9])
                for i in range(3):  # rows at different positions after step 2
                    steps.append(dec.decode_step(tok, pos, 32, torch.tensor([3, 7]) if qwen else 0))
                    tok = steps[-1].argmax(-1, keepdim=True)
                    pos = pos + torch.tensor([1, 2 if i >= 1 else 1])
            logits[fused] = torch.stack(steps).double()
            caches[fused] = {n: t.clone() for layer in dec.layers for n, t in layer.self_attn.kv_cache.named_buffers()}
        ref = logits[False]
        out[f"{case}-{kv}"] = {
            "enabled": enabled, "fused_steps": len(calls), "shape": list(logits[True].shape),
            "rel": float((logits[True] - ref).norm() / ref.norm()),
            "argmax_same": bool(torch.equal(logits[True].argmax(-1), ref.argmax(-1))),
            "cache_same": all(torch.equal(caches[True][n].view(torch.uint8), caches[False][n].view(torch.uint8))
                              for n in caches[True])}
    print(json.dumps(out))
"""


@needs_triton
def test_fused_decode_with_fp8_and_int4_caches_matches_the_layer_loop_in_the_interpreter():
    """Three decode steps of a tiny random decoder (MHA; and GQA with q/k norm, bias and M-RoPE offsets) over
    an fp8 cache (the fp8 ``rope_kv_write`` + ``decode_attention``) and an int4 cache (RoPE into a one-slot
    buffer, ``int4kv_write``, ``int4kv_decode_attention``) give the layer loop's logits (its torch quantization
    and dequantize + SDPA; measured 2e-7 relative in fp32) and leave the same cache bytes."""
    res = run_interpreted(DECODE_SCRIPT)
    assert set(res) == {"llama-fp8_e4m3", "qwen-fp8_e4m3", "qwen-int4"}
    for case, r in res.items():
        assert r["enabled"] == [False, True] and r["fused_steps"] == 3 and r["shape"] == [3, 2, 97], case
        assert r["rel"] < 1e-5 and r["argmax_same"] and r["cache_same"], (case, r)


GEMMA_FP8_SCRIPT = GEMMA_DECODER + """
    out = {}
    for caches in ("ring", "full"):
        dec.setup_caches(2, 64, kv_cache_dtype="fp8_e4m3", window_caches=caches == "ring")
        dec.fuse_projections()
        res = {"enabled_off": dec.enable_fused_decode(False)}
        eager = run(5, 64)
        res["enabled_on"] = dec.enable_fused_decode(True)
        fused = run(5, 64)
        res["rel"] = rel(fused, eager)
        res["argmax_same"] = bool(torch.equal(fused.argmax(-1), eager.argmax(-1)))
        res["slots"] = [layer.self_attn.kv_cache.k.shape[2] for layer in dec.layers]
        out[caches] = res
    print(json.dumps(out))
"""


@needs_triton
def test_gemma3_fused_decode_over_fp8_caches_in_the_interpreter():
    """Gemma 3 (sliding / full layers, window 8 < the 13-token prompt) over fp8 caches: the sliding layers'
    8-slot rolling caches, and their window over full-length caches, in the fused step (5 steps past the
    window) give the layer loop's logits."""
    got = run_interpreted(GEMMA_FP8_SCRIPT, "float32")
    for caches, res in got.items():
        assert res["enabled_off"] is False and res["enabled_on"] is True
        assert res["slots"] == ([8, 64, 8] if caches == "ring" else [64, 64, 64])
        assert res["rel"] < 1e-5 and res["argmax_same"], (caches, res)
    assert set(got) == {"ring", "full"}


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8 dtypes")
def test_fp8_arguments_are_checked():
    from edgevlm.runtime.kernels.decode_fused import attention_config, decode_attention, rope_kv_write
    from edgevlm.runtime.kv_cache import Fp8KVCache

    c = Fp8KVCache(2, 2, 16, 16, dtype=torch.float32, device="cpu")
    q, pos, qkv = torch.zeros(2, 4, 1, 16), torch.tensor([3, 4]), torch.zeros(2, 8 * 16)
    cos = torch.zeros(16, 16)
    with pytest.raises(ValueError, match="needs k_scale"):
        decode_attention(q, c.k, c.v, pos, 8)  # no scales
    with pytest.raises(ValueError, match="needs v_scale"):
        decode_attention(q, c.k, c.v, pos, 8, k_scale=c.k_scale, v_scale=c.v_scale.float())  # fp32 scales
    with pytest.raises(ValueError, match="needs k_scale"):
        decode_attention(q, c.k, c.v, pos, 8, k_scale=c.k_scale[:, :, :8], v_scale=c.v_scale)  # too few positions
    with pytest.raises(ValueError, match="belong to a float8_e4m3fn cache"):
        decode_attention(q, torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16), pos, 8, k_scale=c.k_scale,
                         v_scale=c.v_scale)
    with pytest.raises(ValueError, match="both be float16/bfloat16/float32 or both float8_e4m3fn"):
        decode_attention(q, c.k, torch.zeros(2, 2, 16, 16), pos, 8)  # fp8 keys, fp32 values
    with pytest.raises(ValueError, match="both be float16"):
        decode_attention(q, c.k.view(torch.uint8), c.v.view(torch.uint8), pos, 8)  # raw bytes
    with pytest.raises(ValueError, match="block_n"):
        decode_attention(q, c.k, c.v, pos, 8, block_n=24, k_scale=c.k_scale, v_scale=c.v_scale)
    with pytest.raises(ValueError, match="needs k_scale"):
        rope_kv_write(qkv, cos, cos, pos, c.k, c.v, 4, 2)
    with pytest.raises(ValueError, match="belong to a float8_e4m3fn cache"):
        rope_kv_write(qkv, cos, cos, pos, torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16), 4, 2,
                      k_scale=c.k_scale, v_scale=c.v_scale)
    with pytest.raises(ValueError, match="kind must be one of"):
        attention_config("int8", 1)


def test_attention_config_table_and_splits(monkeypatch):
    from edgevlm.runtime.kernels import decode_fused as df

    monkeypatch.setitem(df.ATTENTION_CONFIGS, "fp8", ((4, df.AttentionConfig(block_n=32)),
                                                     (16, df.AttentionConfig(num_warps=8))))
    assert df.attention_config("fp8", 1).block_n == 32 and df.attention_config("fp8", 4).block_n == 32
    assert df.attention_config("fp8", 8).num_warps == 8 and df.attention_config("fp8", 64).num_warps == 8  # the last
    assert df.attention_config("16bit", 7) == df.AttentionConfig()
    # 609 keys in blocks of 64 -> 10 blocks -> 16 splits, halved to fit the budget
    assert df.attention_splits(1, 32, 609, 64, 16, 528) == 16
    assert df.attention_splits(8, 32, 609, 64, 16, 528) == 2
    assert df.attention_splits(32, 32, 609, 64, 16, 528) == 1
    assert df.attention_splits(8, 8, 609, 128, 16, 528) == 8


# ---- CUDA (compiled kernels); skipped without a GPU


@needs_cuda
@pytest.mark.skipif(FP8 is None, reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("native", [False, True])
def test_cuda_fp8_write_is_bit_exact_and_attention_matches_float64(native, monkeypatch):
    """Compiled: the fp8 write equals ``Fp8KVCache._store`` bit for bit (bf16 and fp16 activations), and
    attention over the e4m3 bytes (hardware conversion or bits) is within bf16 rounding of float64 over the
    dequantized cache, at 1 / 2 / 16 splits, MHA and GQA, with a window."""
    from edgevlm.runtime.decoder import rope_tables
    from edgevlm.runtime.kernels import decode_fused as df
    from edgevlm.runtime.kv_cache import Fp8KVCache, KVCache

    if native and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the e4m3 hardware conversion needs sm_89+")
    monkeypatch.setattr(df, "FP8_NATIVE", native)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        b, h, hkv, dh, s = 4, 32, 8, 128, 768
        cos, sin = (t.to(dt) for t in rope_tables(dh, s, 1e6, dev))
        qkv = (torch.randn(b, (h + 2 * hkv) * dh, device=dev, generator=gen)
               * torch.tensor([1e-3, 1.0, 30.0, 300.0], device=dev)[:, None]).to(dt)
        pos = torch.tensor([5, 767, 0, 300], device=dev)
        ref16 = KVCache(b, hkv, s, dh, dtype=dt, device=dev)
        df.rope_kv_write(qkv, cos, sin, pos, ref16.k, ref16.v, h, hkv)
        f8 = Fp8KVCache(b, hkv, s, dh, dtype=dt, device=dev)
        df.rope_kv_write(qkv, cos, sin, pos, f8.k, f8.v, h, hkv, k_scale=f8.k_scale, v_scale=f8.v_scale)
        ref = Fp8KVCache(b, hkv, s, dh, dtype=dt, device=dev)
        rows = torch.arange(b, device=dev)
        ref.write(pos[:, None], ref16.k[rows, :, pos][:, :, None], ref16.v[rows, :, pos][:, :, None])
        for n in ("k", "v", "k_scale", "v_scale"):
            assert torch.equal(getattr(f8, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)), (dt, n)
    for b, h, hkv, budget, win in [(1, 32, 32, None, None), (8, 32, 32, None, None), (32, 32, 8, None, None),
                                   (3, 32, 8, 1, None), (3, 32, 8, None, 100)]:
        s, kv_len, dh = 768, 768, 128
        c = Fp8KVCache(b, hkv, s, dh, dtype=torch.bfloat16, device=dev)
        c.write(torch.arange(s, device=dev), 3 * torch.randn(b, hkv, s, dh, device=dev, generator=gen),
                torch.randn(b, hkv, s, dh, device=dev, generator=gen))
        q = torch.randn(b, h, 1, dh, device=dev, generator=gen).to(torch.bfloat16)
        pos = torch.randint(0, kv_len, (b,), device=dev, generator=gen)
        pos[0] = kv_len - 1
        y = df.decode_attention(q, c.k, c.v, pos, kv_len, cta_budget=budget, k_scale=c.k_scale, v_scale=c.v_scale,
                                window=win)
        k, v = c.read(b, s, torch.float64)
        rep = h // hkv
        refs = []
        for i in range(b):
            p = int(pos[i])
            lo = 0 if win is None else max(0, p - win + 1)
            refs.append(torch.nn.functional.scaled_dot_product_attention(
                q[i].double(), k[i, :, lo:p + 1].repeat_interleave(rep, 0), v[i, :, lo:p + 1].repeat_interleave(rep, 0)))
        ref = torch.stack(refs)
        rel = float((y.double() - ref).norm() / ref.norm())
        assert y.dtype == torch.bfloat16 and rel < 1e-2, (b, hkv, budget, win, rel)


@needs_cuda
@pytest.mark.skipif(FP8 is None, reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("kv", ["fp8_e4m3", "int4"])
def test_cuda_fused_decode_over_quantized_caches_matches_the_layer_loop(kv):
    """bf16 on the GPU: 6 fused decode steps (eager, then replayed from a CUDA graph) over an fp8 / int4
    cache, fed the same tokens, give the layer loop's logits within bf16 rounding (and mostly its argmax)."""
    from edgevlm.runtime.config import TextConfig
    from edgevlm.runtime.decoder import Decoder

    torch.manual_seed(0)
    cfg = TextConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, qk_norm=True)
    dec = Decoder(cfg)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.1)
    dec = dec.to("cuda", torch.bfloat16).eval()
    dec.setup_caches(4, 256, kv_cache_dtype=kv, int4_group_size=32)
    dec.fuse_projections()
    prompt = torch.randint(0, 256, (4, 40), device="cuda")
    feed = torch.randint(0, 256, (6, 4, 1), device="cuda")  # the tokens of the 6 steps (teacher-forced)

    def run(fused: bool, graph: bool) -> torch.Tensor:
        dec.enable_fused_decode(fused)
        assert dec.fused_decode is fused
        with torch.no_grad():
            dec(dec.embed_tokens(prompt), torch.arange(40, device="cuda"), prefill=True)
            tok, pos = feed[0], torch.tensor([40, 40, 40, 40], device="cuda")
            steps = []
            if graph:
                g, ti, pi = torch.cuda.CUDAGraph(), tok.clone(), pos.clone()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    dec.decode_step(ti, pi, 256)  # warm-up (compiles), then restore the cache by a fresh prefill
                torch.cuda.current_stream().wait_stream(s)
                dec(dec.embed_tokens(prompt), torch.arange(40, device="cuda"), prefill=True)
                with torch.cuda.graph(g):
                    out = dec.decode_step(ti, pi, 256)
                dec(dec.embed_tokens(prompt), torch.arange(40, device="cuda"), prefill=True)
            for i in range(6):
                if graph:
                    ti.copy_(tok)
                    pi.copy_(pos)
                    g.replay()
                    logits = out.clone()
                else:
                    logits = dec.decode_step(tok, pos, 256)
                steps.append(logits.double())
                tok = feed[(i + 1) % 6]
                pos = pos + torch.tensor([1, 2, 1, 3], device="cuda")
        return torch.stack(steps)

    want = run(False, False)
    for graph in (False, True):
        got = run(True, graph)
        rel = float((got - want).norm() / want.norm())
        assert torch.isfinite(got).all() and rel < 3e-2, (graph, rel)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9, graph
