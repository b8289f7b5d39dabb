"""Decode attention from the INT4 KV cache (runtime/kernels/int4kv_attention.py): argument checks,
and, through Triton's CPU interpreter, equality with dequantize + SDPA under decode_mask (GQA,
per-row positions, stale slots past a row's position, several cache slices, fp16 queries)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_support import needs_triton, run_interpreted  # noqa: E402


def test_rejects_bad_arguments():
    from edgevlm.runtime.kernels.int4kv_attention import int4kv_decode_attention
    from edgevlm.runtime.kv_cache import Int4KVCache

    cache = Int4KVCache(2, 2, 32, 16, dtype=torch.float32, device="cpu", group_size=8)
    pos = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="does not match"):
        int4kv_decode_attention(torch.randn(2, 4, 2, 16), cache, pos, 8)  # two tokens per row
    with pytest.raises(ValueError, match="does not match"):
        int4kv_decode_attention(torch.randn(2, 3, 1, 16), cache, pos, 8)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="does not match"):
        int4kv_decode_attention(torch.randn(3, 4, 1, 16), cache, torch.tensor([1, 2, 3]), 8)  # 3 rows > 2
    with pytest.raises(ValueError, match="block_s"):
        int4kv_decode_attention(torch.randn(2, 4, 1, 16), cache, pos, 8, block_s=24)
    with pytest.raises(ValueError, match="kv_len"):
        int4kv_decode_attention(torch.randn(2, 4, 1, 16), cache, pos, 33)
    with pytest.raises(ValueError, match="pos must be"):
        int4kv_decode_attention(torch.randn(2, 4, 1, 16), cache, torch.tensor([3]), 8)


def test_split_count():
    from edgevlm.runtime.kernels.int4kv_attention import n_splits_for

    assert n_splits_for(1, 32, 4096, 32) == 9  # 32 heads x 9 slices >= 264 programs
    assert n_splits_for(1, 32, 40, 32) == 2  # never more slices than blocks
    assert n_splits_for(64, 32, 4096, 32) == 1


@needs_triton
def test_matches_dequantize_and_sdpa_in_the_interpreter():
    got = run_interpreted("""
        import json, torch, torch.nn.functional as F
        from edgevlm.runtime.kv_cache import Int4KVCache, decode_mask
        from edgevlm.runtime.kernels.int4kv_attention import int4kv_decode_attention
        torch.manual_seed(0)
        out = {}
        cases = [(1, 4, 4, 40, 16, 8, 32, None, torch.float32), (3, 6, 2, 70, 32, 16, 64, 3, torch.float32),
                 (2, 4, 1, 20, 64, 64, 20, None, torch.float16), (2, 2, 2, 64, 16, 16, 48, 1, torch.float32)]
        for i, (b, h, hkv, s, dh, gs, kv_len, splits, dt) in enumerate(cases):
            cache = Int4KVCache(b + 1, hkv, s, dh, dtype=torch.float32, device="cpu", group_size=gs)
            cache.write(torch.arange(s), 3 * torch.randn(b + 1, hkv, s, dh), torch.randn(b + 1, hkv, s, dh))
            pos = torch.randint(0, kv_len, (b,))
            pos[0] = kv_len - 1
            q = torch.randn(b, h, 1, dh).to(dt)
            y = int4kv_decode_attention(q, cache, pos, kv_len, block_s=16, n_splits=splits)
            k, v = cache.read(b, kv_len, torch.float32)
            rep = h // hkv
            ref = F.scaled_dot_product_attention(q.float(), k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                 attn_mask=decode_mask(pos[:, None], kv_len))
            out[i] = [str(y.dtype), list(y.shape), float((y.float() - ref).abs().max()), float(ref.abs().max())]
        print(json.dumps(out))
    """)
    for i, (dtype, _shape, err, scale) in got.items():
        assert scale > 0.1, i
        assert err <= (2e-3 if dtype == "torch.float16" else 2e-5) * max(1.0, scale), (i, err)
    assert got["2"][0] == "torch.float16" and got["1"][1] == [3, 6, 1, 32]


@needs_triton
def test_fused_write_is_bit_exact_in_the_interpreter():
    """int4kv_write stores the same codes, scales and zeros as quantize_kv_int4 (ties included:
    round half to even), for shared and per-row positions and explicit cache rows."""
    got = run_interpreted("""
        import json, torch
        from edgevlm.runtime.kv_cache import Int4KVCache
        from edgevlm.runtime.kernels.int4kv_attention import int4kv_write
        torch.manual_seed(0)
        out = {}
        cases = [(2, 2, 16, 16, 8, False, None), (3, 2, 16, 32, 16, True, [2, 0, 1]), (1, 1, 8, 64, 64, False, None)]
        for i, (b, hkv, s, dh, gs, per_row, rows) in enumerate(cases):
            a = Int4KVCache(b, hkv, s, dh, dtype=torch.float32, device="cpu", group_size=gs)
            c = Int4KVCache(b, hkv, s, dh, dtype=torch.float32, device="cpu", group_size=gs)
            k, v = torch.randn(b, hkv, 1, dh) * 3, torch.randn(b, hkv, 1, dh)
            k[0, 0, 0, :4] = torch.tensor([0.0, 1.5, 3.0, 0.25])  # scale 0.2: (x - 0) / 0.2 has exact halves
            pos = torch.randint(0, s, (b, 1)) if per_row else torch.tensor([5])
            r = torch.tensor(rows) if rows else None
            a.write(pos, k, v, r)  # CPU: the torch path
            int4kv_write(c, pos, k, v, r)
            out[i] = [n for n in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
                      if not torch.equal(getattr(a, n), getattr(c, n))]
        print(json.dumps(out))
    """)
    assert got == {"0": [], "1": [], "2": []}


def test_fused_write_rejects_bad_shapes():
    from edgevlm.runtime.kernels.int4kv_attention import int4kv_write
    from edgevlm.runtime.kv_cache import Int4KVCache

    cache = Int4KVCache(2, 2, 8, 16, dtype=torch.float32, device="cpu", group_size=8)
    with pytest.raises(ValueError, match="do not match"):
        int4kv_write(cache, torch.tensor([0]), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16))
    with pytest.raises(ValueError, match="do not match"):
        int4kv_write(cache, torch.tensor([0]), torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    odd = Int4KVCache(1, 1, 8, 48, dtype=torch.float32, device="cpu", group_size=16)  # 3 groups
    with pytest.raises(ValueError, match="powers of two"):
        int4kv_write(odd, torch.tensor([0]), torch.randn(1, 1, 1, 48), torch.randn(1, 1, 1, 48))
    assert not odd._fused_write_ok(48)  # the cache then keeps the torch path
