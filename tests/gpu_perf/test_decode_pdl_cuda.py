"""Programmatic dependent launch (PDL) in the W4A16 decode step moves time, never a result (sm_90 GPUs).

A Qwen2-0.5B-shape decoder (the benches' ``small`` spec: hidden 896, 14 heads, 2 KV heads, 24 layers) with RTN
W4A16 linears, the fused Triton decode step and CUDA graphs: the graph captured with the library's default (PDL
for decode steps of at most ``pdl.MAX_ROWS`` rows) replays to the same logits, bit for bit, as the graph captured
with plain launches, on every replay, at each batch size of the default's range. Where the GPU has no PDL (older
than sm_90) the two captures are the same launches and the test checks only that.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_pdl_decode_graph_is_bit_identical_to_plain_launches():
    from edgevlm.quantize.bench_models import build_models, quantize_decoder_w4
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.kernels import decode_fused, pdl
    from edgevlm.runtime.kernels import w4a16_mma as mk

    if mk.mma_status("cuda", "reg") is not None:
        pytest.skip(f"W4A16 kernel unavailable: {mk.mma_status('cuda', 'reg')}")
    dev = torch.device("cuda")
    model, _, _ = build_models("small", device=dev, dtype=torch.bfloat16, max_seq_len=64, with_hf=False)
    model.setup_caches(1, 512)
    quantize_decoder_w4(model)
    be = TorchBackend(model, max_batch_size=8)
    assert be.graphs is not None and model.language_model.fused_decode
    gen = torch.Generator(device=dev).manual_seed(3)
    for layer in model.language_model.layers:
        layer.self_attn.kv_cache.k.normal_(generator=gen)
        layer.self_attn.kv_cache.v.normal_(generator=gen)
    position = 300
    kv_len = be.kv_len_for(position + 1)
    batches = (1, 4, 8)
    saved = (mk.PDL, decode_fused.PDL)

    def replays(b: int, n: int = 8) -> list:
        be.graphs.tokens[:b, 0].copy_(torch.arange(5, 5 + b, device=dev))  # (B_max, 1)
        be.graphs.positions[:b].copy_(torch.arange(position, position - b, -1, device=dev))
        return [be.graphs.replay(b, kv_len).float().clone() for _ in range(n)]

    try:
        mk.PDL = decode_fused.PDL = False
        be.graphs.reset()
        plain = {b: replays(b) for b in batches}
        mk.PDL = decode_fused.PDL = True
        be.graphs.reset()
        used = {b: decode_fused.pdl_ok(dev, b) and mk.pdl_ok(dev, b) for b in batches}
        with_pdl = {b: replays(b) for b in batches}
    finally:
        mk.PDL, decode_fused.PDL = saved
        be.graphs.reset()
    if torch.cuda.get_device_capability(dev) >= pdl.CAPABILITY and pdl.mode() == "auto":
        assert all(used.values()), used  # the default's range: every batch size here is <= MAX_ROWS
    for b in batches:
        ref = plain[b][0]
        assert torch.isfinite(ref).all()
        assert all(torch.equal(ref, o) for o in plain[b]), b
        assert all(torch.equal(ref, o) for o in with_pdl[b]), (b, float((with_pdl[b][0] - ref).abs().max()))
