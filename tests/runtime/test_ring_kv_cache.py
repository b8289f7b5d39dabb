"""Rolling (ring) KV caches of Gemma 3's sliding layers (runtime/kv_cache.py, runtime/decoder.py),
on the CPU in fp32: the slot layout of a prefill (right-padded rows, prompts shorter and longer than
the window) and a decoder with ring caches against the same decoder with full-length caches, for a
right-padded batched prefill and 24 decode steps with the rows at different positions, in every
KV precision.

Run: ``.venv/bin/python -m pytest -q tests/runtime/test_ring_kv_cache.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_ring_layout_keeps_each_rows_last_window_positions():
    from edgevlm.runtime.kv_cache import KVCache

    cache = KVCache(3, 1, 4, 2, dtype=torch.float32, device="cpu", ring=True)
    t = 7
    k = torch.arange(t, dtype=torch.float32)[None, None, :, None].expand(3, 1, t, 2) + 100 * torch.arange(3.0)[
        :, None, None, None]  # value = position + 100 * row
    cache.write(torch.arange(t), k, k.clone(), rows=torch.tensor([2, 0, 1]), lengths=torch.tensor([7, 3, 6]))
    held = cache.k[:, 0, :, 0]  # (rows, slots)
    # input row 0 -> cache row 2, length 7: positions 3..6 in slots 3, 0, 1, 2
    assert held[2].tolist() == [4.0, 5.0, 6.0, 3.0]
    # input row 1 -> cache row 0, length 3: positions 0..2 in slots 0..2 (slot 3 not yet written)
    assert held[0, :3].tolist() == [100.0, 101.0, 102.0]
    # input row 2 -> cache row 1, length 6: positions 2..5
    assert held[1].tolist() == [204.0, 205.0, 202.0, 203.0]
    cache.write(torch.tensor([[7], [3], [6]]), k[:, :, :1] * 0 - 1, k[:, :, :1] * 0 - 1)  # decode: slot p % 4
    assert cache.k[0, 0, 3, 0] == -1 and cache.k[1, 0, 3, 0] == -1 and cache.k[2, 0, 2, 0] == -1
    with pytest.raises(ValueError, match="one token per row or a prefill"):
        cache.write(torch.tensor([[1, 2], [1, 2], [1, 2]]), k[:, :, :2], k[:, :, :2])


def _gemma_decoder(seed: int = 0):
    from edgevlm.runtime.decoder import Decoder
    from edgevlm.runtime.models.gemma3.config import parse_gemma3_text_config

    torch.manual_seed(seed)
    tc = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 24,
          "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                               "sliding_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
          "max_position_embeddings": 4096}
    dec = Decoder(parse_gemma3_text_config(tc), tie_word_embeddings=True)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.3 if p.dim() < 2 else 0.2)
        dec.embed_tokens.weight.mul_(0.25)
    return dec.eval()


def _run(dec, window_caches: bool, kv: str | None) -> torch.Tensor:
    """Right-padded batched prefill of rows of 4 and 15 tokens (window 6), image blocks on row 1,
    then 24 decode steps (kv_len bucket 64; the rows 11 positions apart); the logits ``(25, 2, V)``."""
    dec.setup_caches(3, 64, kv_cache_dtype=kv, int4_group_size=16, window_caches=window_caches)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (2, 15), generator=g)
    lengths = torch.tensor([4, 15])
    blocks = torch.full((2, 15), -1)
    blocks[1, 3:11] = 0  # one image of 8 tokens: bidirectional within the block
    with torch.no_grad():
        out = [dec.prefill_batch(dec.embed_tokens(prompt), lengths, torch.tensor([2, 0]), image_blocks=blocks)]
        pos = torch.tensor([15, 4])
        tok = torch.stack([out[0][1], out[0][0]]).argmax(-1, keepdim=True)
        for layer in dec.layers:  # cache row 2 (row 0's prompt) -> row 1, so decode rows are 0..1
            for buf in layer.self_attn.kv_cache.buffers():
                buf[1] = buf[2]
        for _ in range(24):
            logits = dec.decode_step(tok, pos, 64)
            out.append(logits.flip(0))
            tok = logits.argmax(-1, keepdim=True)
            pos = pos + 1
    return torch.stack(out).double()


@pytest.mark.parametrize("kv", [None, "int4", "fp8_e4m3"])
def test_ring_caches_give_the_logits_of_full_length_caches(kv):
    """fp32 caches: equal up to summation order (measured 4.6e-7 of the largest logit; fp8 4.0e-7). Quantized
    caches store the same per-token codes, but the ~1e-7 differences of the keys' summation order
    can flip a 4-bit code at a rounding boundary (measured 1.1e-4 for int4), hence 1e-3."""
    dec = _gemma_decoder()
    full = _run(dec, False, kv)
    ring = _run(dec, True, kv)
    assert [layer.self_attn.kv_cache.k.shape[2] for layer in dec.layers] == [6, 64, 6, 6]
    assert float(full.std()) > 0.1
    err = float((ring - full).abs().max() / full.abs().max())
    assert err <= (1e-5 if kv is None else 1e-3), err
