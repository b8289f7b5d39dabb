"""Gemma 3 on the fused Triton decode step (runtime/kernels/decode_fused.py) and the INT4 KV-cache
decode kernel (runtime/kernels/int4kv_attention.py), checked through Triton's CPU interpreter
(``TRITON_INTERPRET=1``; the CUDA paths run the same kernels, untested here on a GPU).

The decoder is a tiny random Gemma 3 text model parsed from a transformers-style ``text_config``
(three layers sliding / full / sliding, window 8 shorter than the 13-token prompt, the full layers'
RoPE linear-scaled and the sliding layers' own base, ``query_pre_attn_scalar`` 24, GQA, tanh-GELU,
unit-offset q/k and sandwich norms away from 0). Each case prefills two rows, then decodes 20 steps
with the rows at different positions, once with the kernels and once with the eager layer loop, and
compares the logits of every step.

Run: ``.venv/bin/python -m pytest -q tests/gpu_perf/test_gemma3_decode_kernels.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_support import REPO, needs_triton, run_interpreted  # noqa: E402

#: builds ``dec`` (a Gemma 3 Decoder with random weights) for the scripts below; argv[1] = dtype
GEMMA_DECODER = """
    import json, sys, torch
    from edgevlm.runtime.decoder import Decoder
    from edgevlm.runtime.models.gemma3.config import parse_gemma3_text_config
    torch.manual_seed(0)
    dtype = getattr(torch, sys.argv[1])
    tc = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
          "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}
    cfg = parse_gemma3_text_config(tc)
    dec = Decoder(cfg, tie_word_embeddings=True)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.3 if p.dim() < 2 else 0.2)
        dec.embed_tokens.weight.mul_(0.25)
    dec = dec.to(dtype).eval()
    PROMPT = torch.randint(0, 97, (2, 13))

    def run(n_steps, kv_len):
        '''Prefill both rows (13 tokens), then n_steps greedy steps; row 1 moves two slots per step
        after the second one. Returns the logits (n_steps, 2, V) in float64.'''
        for layer in dec.layers:
            layer.self_attn.kv_cache.reset()
        with torch.no_grad():
            dec(dec.embed_tokens(PROMPT), torch.arange(13), prefill=True)
            steps, tok, pos = [], torch.tensor([[5], [11]]), torch.tensor([13, 13])
            for i in range(n_steps):
                steps.append(dec.decode_step(tok, pos, kv_len).double())
                tok = steps[-1].argmax(-1, keepdim=True)
                pos = pos + torch.tensor([1, 2 if i >= 1 else 1])
        return torch.stack(steps)

    def rel(a, b):
        return float((a - b).norm() / b.norm())
"""


FUSED_SCRIPT = GEMMA_DECODER + """
    dec.setup_caches(2, 64, window_caches=sys.argv[2] == "ring")
    assert [layer.self_attn.kv_cache.k.shape[2] for layer in dec.layers] == ([8, 64, 8] if sys.argv[2] == "ring" else [64] * 3)
    dec.fuse_projections()
    res = {"enabled_off": dec.enable_fused_decode(False)}
    eager = run(20, 64)
    res["enabled_on"] = dec.enable_fused_decode(True)
    fused = run(20, 64)
    res["rel"] = rel(fused, eager)
    res["max_abs"] = float((fused - eager).abs().max())
    res["argmax_same"] = bool(torch.equal(fused.argmax(-1), eager.argmax(-1)))
    res["shape"] = list(fused.shape)
    print(json.dumps(res))
"""


@needs_triton
@pytest.mark.parametrize("dtype,caches", [("float32", "ring"), ("float32", "full"), ("float16", "ring")])
def test_fused_decode_step_equals_the_eager_gemma3_decoder_in_the_interpreter(dtype, caches):
    """20 decode steps past the sliding window (row 1 reaches slot 51), both kinds of layer: the
    fused step (unit-offset norms, sandwich norms folded into the residual adds, tanh-GELU, the
    ``query_pre_attn_scalar`` scale, the sliding layers' RoPE tables, and their window over a
    full-length cache or their 8-slot rolling cache) gives the eager decoder's logits (measured fp32
    3.4e-7 relative, fp16 1.3e-3)."""
    res = run_interpreted(FUSED_SCRIPT, dtype, caches)
    assert res["enabled_off"] is False and res["enabled_on"] is True
    assert res["shape"] == [20, 2, 97]
    assert res["rel"] < (1e-5 if dtype == "float32" else 5e-3), res
    if dtype == "float32":
        assert res["argmax_same"]


KERNELS_SCRIPT = """
    import json, math, torch, torch.nn.functional as F
    from edgevlm.runtime.kernels.decode_fused import add_rms_norm, decode_attention, gated_act, rope_kv_write
    torch.manual_seed(0)
    out = {}
    # tanh-GELU gate vs torch
    gu = torch.randn(3, 2 * 1500) * 4
    ref = F.gelu(gu[:, :1500].double(), approximate="tanh") * gu[:, 1500:].double()
    out["gelu"] = float((gated_act(gu, "gelu_pytorch_tanh").double() - ref).abs().max() / ref.abs().max())
    # unit-offset sandwich norm: x + norm(delta) * (1 + wd), then norm * (1 + w)
    x, dl, w, wd = torch.randn(3, 80), torch.randn(3, 80) * 5, torch.randn(80), torch.randn(80)
    def unorm(t, wt, eps):
        return t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + eps) * (1 + wt.double())
    s, y = add_rms_norm(x, dl, w, 1e-6, unit_offset=True, delta_weight=wd, delta_eps=1e-5)
    s_ref = x.double() + unorm(dl, wd, 1e-5)
    out["sandwich"] = [float((s.double() - s_ref).abs().max()), float((y.double() - unorm(s_ref, w, 1e-6)).abs().max())]
    # unit-offset q/k norms before RoPE
    b, h, hkv, dh, S = 2, 4, 2, 16, 12
    qkv, qw, kw = torch.randn(b, (h + 2 * hkv) * dh), torch.randn(dh), torch.randn(dh)
    pos = torch.tensor([3, 9])
    ang = pos[:, None].double() * (1.0 / 10000 ** (torch.arange(0, dh, 2).double() / dh))
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    table_c = torch.zeros(S, dh); table_s = torch.zeros(S, dh)
    table_c[pos], table_s[pos] = cos.float(), sin.float()
    kc, vc = torch.zeros(b, hkv, S, dh), torch.zeros(b, hkv, S, dh)
    q = rope_kv_write(qkv, table_c, table_s, pos, kc, vc, h, hkv, q_norm=qw, k_norm=kw, norm_eps=1e-6,
                      unit_offset=True)
    qr = unorm(qkv[:, : h * dh].view(b, h, dh), qw, 1e-6)
    rot = torch.cat([-qr[..., dh // 2:], qr[..., : dh // 2]], -1)
    q_ref = qr * cos[:, None] + rot * sin[:, None]
    out["qk_norm"] = float((q[:, :, 0].double() - q_ref).abs().max())
    # attention with a scale and a sliding window over a full-length cache
    rel = []
    for b, h, hkv, dh, s, kv_len, pos, window, scale, dtype in [
            (2, 4, 2, 16, 64, 48, [47, 20], 8, 24 ** -0.5, torch.float32),
            (3, 8, 2, 32, 300, 300, [299, 3, 150], 40, 0.3, torch.float32),
            (2, 4, 4, 16, 200, 200, [199, 70], 64, 0.2, torch.float16),
            (1, 4, 2, 16, 64, 64, [30], None, 0.5, torch.float32)]:
        q = torch.randn(b, h, 1, dh).to(dtype)
        k = torch.randn(b, hkv, s, dh).to(dtype)
        v = torch.randn(b, hkv, s, dh).to(dtype)
        y = decode_attention(q, k, v, torch.tensor(pos), kv_len, block_n=16, scale=scale, window=window)
        refs = []
        for i in range(b):
            lo = 0 if window is None else max(0, pos[i] - window + 1)
            kk = k[i, :, lo : pos[i] + 1].double().repeat_interleave(h // hkv, 0)
            vv = v[i, :, lo : pos[i] + 1].double().repeat_interleave(h // hkv, 0)
            refs.append(F.scaled_dot_product_attention(q[i].double(), kk, vv, scale=scale))
        ref = torch.stack(refs)
        rel.append([float((y.double() - ref).norm() / ref.norm()), str(dtype)])
    out["attn"] = rel
    print(json.dumps(out))
"""


@needs_triton
def test_gemma3_kernel_switches_match_float64_in_the_interpreter():
    """Each Gemma switch of the fused kernels on its own against a float64 reference: tanh-GELU
    gate, unit-offset sandwich norm + add + norm, unit-offset q/k norms before RoPE, and the
    attention scale and sliding window (splits entirely before the window, windows longer than the
    position, fp16)."""
    res = run_interpreted(KERNELS_SCRIPT)
    assert res["gelu"] < 1e-6
    assert max(res["sandwich"]) < 1e-5
    assert res["qk_norm"] < 1e-5
    for err, dtype in res["attn"]:
        assert err < (1e-5 if dtype == "torch.float32" else 2e-3), res["attn"]


def test_fused_kernels_reject_bad_gemma_arguments():
    from edgevlm.runtime.kernels.decode_fused import add_rms_norm, decode_attention, gated_act

    with pytest.raises(ValueError, match="not one of"):
        gated_act(torch.randn(2, 8), "relu")
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-6, delta_weight=torch.ones(4))
    q, cache = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="window must be"):
        decode_attention(q, cache, cache, torch.tensor([0]), 8, window=0)


INT4_KERNEL_SCRIPT = """
    import json, torch, torch.nn.functional as F
    from edgevlm.runtime.decoder import sliding_decode_mask
    from edgevlm.runtime.kv_cache import Int4KVCache, decode_mask
    from edgevlm.runtime.kernels.int4kv_attention import int4kv_decode_attention
    torch.manual_seed(0)
    out = {}
    cases = [(2, 4, 2, 70, 16, 8, 64, 24 ** -0.5, 8, None, torch.float32),
             (3, 6, 2, 90, 32, 16, 90, 0.3, 20, 3, torch.float32),
             (2, 4, 1, 40, 64, 64, 40, 0.2, 70, None, torch.float16),
             (1, 4, 2, 64, 16, 16, 48, 0.5, None, 2, torch.float32)]
    for i, (b, h, hkv, s, dh, gs, kv_len, scale, window, splits, dt) in enumerate(cases):
        cache = Int4KVCache(b + 1, hkv, s, dh, dtype=torch.float32, device="cpu", group_size=gs)
        cache.write(torch.arange(s), 3 * torch.randn(b + 1, hkv, s, dh), torch.randn(b + 1, hkv, s, dh))
        pos = torch.randint(0, kv_len, (b,))
        pos[0] = kv_len - 1
        q = torch.randn(b, h, 1, dh).to(dt)
        y = int4kv_decode_attention(q, cache, pos, kv_len, block_s=16, n_splits=splits, scale=scale, window=window)
        k, v = cache.read(b, kv_len, torch.float64)
        mask = decode_mask(pos[:, None], kv_len) if window is None else sliding_decode_mask(pos[:, None], kv_len, window)
        rep = h // hkv
        ref = F.scaled_dot_product_attention(q.double(), k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=mask, scale=scale)
        out[i] = [str(y.dtype), float((y.double() - ref).abs().max()), float(ref.abs().max())]
    print(json.dumps(out))
"""


@needs_triton
def test_int4kv_kernel_takes_a_scale_and_a_window_in_the_interpreter():
    """The INT4 KV-cache decode kernel with Gemma 3's ``query_pre_attn_scalar ** -0.5`` and a
    sliding window (shorter than the position, longer than the cache, none) equals dequantize +
    SDPA under :func:`sliding_decode_mask` / ``decode_mask`` (GQA, several slices, fp16 queries)."""
    got = run_interpreted(INT4_KERNEL_SCRIPT)
    for i, (dtype, err, scale) in got.items():
        assert scale > 0.1, i
        assert err <= (2e-3 if dtype == "torch.float16" else 2e-5) * max(1.0, scale), (i, err)


INT4_DECODER_SCRIPT = GEMMA_DECODER + """
    dec.setup_caches(2, 64, kv_cache_dtype="int4", int4_group_size=8, window_caches=sys.argv[2] == "ring")
    res = {}
    for kernel in (False, True):
        for layer in dec.layers:
            layer.self_attn.int4kv_kernel = kernel
        res[str(kernel)] = run(20, 64)
    res = {"rel": rel(res["True"], res["False"]), "argmax_same": bool(torch.equal(res["True"].argmax(-1),
                                                                                res["False"].argmax(-1))),
           "windows": [layer.self_attn.window for layer in dec.layers],
           "scale": dec.layers[0].self_attn.scale}
    print(json.dumps(res))
"""


@needs_triton
@pytest.mark.parametrize("caches", ["ring", "full"])
def test_gemma3_decodes_from_the_int4_cache_codes_in_the_interpreter(caches):
    """A Gemma 3 decoder over an INT4 KV cache: the kernel path (attention straight from the codes
    with the ``query_pre_attn_scalar`` scale and, on sliding layers, the window over a full-length
    cache or the slots of their rolling cache) gives the logits of the dequantize + SDPA path over 20
    decode steps past the window."""
    res = run_interpreted(INT4_DECODER_SCRIPT, "float32", caches)
    assert res["windows"] == [8, None, 8] and abs(res["scale"] - 24 ** -0.5) < 1e-12
    assert 0 < res["rel"] < 3e-5, res  # measured 6.2e-6 (fp32 sums in another order; 0 = kernel not run)
    assert res["argmax_same"]


def test_int4kv_kernel_rejects_a_bad_scale_or_window():
    from edgevlm.runtime.kernels.int4kv_attention import int4kv_decode_attention
    from edgevlm.runtime.kv_cache import Int4KVCache

    cache = Int4KVCache(1, 2, 32, 16, dtype=torch.float32, device="cpu", group_size=8)
    q, pos = torch.randn(1, 4, 1, 16), torch.tensor([3])
    with pytest.raises(ValueError, match="window must be"):
        int4kv_decode_attention(q, cache, pos, 8, window=0)
    with pytest.raises(ValueError, match="scale must be"):
        int4kv_decode_attention(q, cache, pos, 8, scale=-1.0)


ENGINE_SCRIPT = """
    import json, sys, tempfile
    from pathlib import Path
    sys.path[:0] = [sys.argv[1] + "/tests", sys.argv[1] + "/tests/models"]  # argv[1]: the repository
    import torch
    from test_gemma3 import QUESTION, _image, _single_run, build_checkpoint
    from edgevlm.runtime import Engine
    ckpt = build_checkpoint(Path(tempfile.mkdtemp()) / "gemma3")
    base = Engine.load(ckpt)
    fused = Engine.load(ckpt, backend_options={"fuse_projections": True, "fused_decode": True})
    dec = fused.backend.model.language_model
    calls = []
    step = dec._fused_decode
    dec._fused_decode = lambda *a, **k: calls.append(1) or step(*a, **k)  # count the fused steps taken
    prep = base.prepare(_image(100, 150, seed=1), QUESTION, max_new_tokens=20)
    want, tokens = _single_run(base, prep, 18)
    got, got_tokens = _single_run(fused, prep, 18)
    print(json.dumps({"fused": dec.fused_decode, "ring": [layer.self_attn.kv_cache.ring for layer in dec.layers],
                      "prompt": len(prep.ids), "fused_steps": len(calls), "tokens_same": tokens == got_tokens,
                      "rel": float((got.double() - want.double()).norm() / want.double().norm())}))
"""


@needs_triton
def test_engine_serves_gemma3_through_the_fused_decode_step_in_the_interpreter():
    """The tiny Gemma 3 checkpoint of tests/models/test_gemma3.py through ``Engine`` with the torch
    backend's ``fused_decode`` (its CUDA default) on rolling caches: 18 decode steps after a
    40-token prompt (window 8) give the plain engine's logits and tokens (measured ~3e-7)."""
    res = run_interpreted(ENGINE_SCRIPT, str(REPO))
    assert res["fused"] is True and res["ring"] == [True, False, True] and res["prompt"] > 32
    assert res["fused_steps"] == 18
    assert res["tokens_same"] and res["rel"] < 1e-5, res
