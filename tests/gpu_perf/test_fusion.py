"""Fused q/k/v and gate/up projections: exact, no extra memory, originals keep working (CPU)."""

from __future__ import annotations

import pytest

from tests.gpu_perf.conftest import make_prompt, rel_err, run_single

torch = pytest.importorskip("torch")


def test_fuse_linears_dense_is_exact_and_shares_storage():
    from edgevlm.runtime.decoder import fuse_linears

    torch.manual_seed(0)
    mods = [torch.nn.Linear(64, n, bias=True) for n in (64, 32, 32)]
    x = torch.randn(3, 5, 64)
    before = [m(x) for m in mods]
    fused = fuse_linears(mods)
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    for m, b in zip(mods, before, strict=True):  # the originals are views into the fused weights
        assert torch.equal(m(x), b)
        assert m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def test_fuse_linears_int4_is_exact():
    from edgevlm.runtime.decoder import fuse_linears
    from edgevlm.runtime.int4 import Int4Linear

    torch.manual_seed(1)
    mods = [Int4Linear.from_linear(torch.nn.Linear(256, n, bias=False), 128) for n in (128, 64, 64)]
    x = torch.randn(2, 256)
    before = torch.cat([m(x) for m in mods], dim=-1)
    fused = fuse_linears(mods)
    assert isinstance(fused, Int4Linear) and fused.out_features == 256
    assert rel_err(fused(x), before) < 1e-6
    assert rel_err(mods[1](x), before[:, 128:192]) < 1e-6


def test_fuse_linears_refuses_mixed_modules():
    from edgevlm.runtime.decoder import fuse_linears
    from edgevlm.runtime.int4 import Int4Linear

    dense = torch.nn.Linear(128, 128, bias=False)
    assert fuse_linears([dense, Int4Linear.from_linear(torch.nn.Linear(128, 128, bias=False), 128)]) is None
    assert fuse_linears([dense, torch.nn.Linear(128, 64, bias=True)]) is None


@pytest.mark.parametrize("kv", [None, "int4"])
def test_fused_decoder_equals_unfused(make_backend, kv):
    ids, px = make_prompt(8, 10)
    ref_logits, ref_tokens = run_single(make_backend(kv_cache_dtype=kv), ids, px, 10)
    be = make_backend(kv_cache_dtype=kv, fuse_projections=True)
    layer = be.model.language_model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    logits, tokens = run_single(be, ids, px, 10, forced=ref_tokens[:-1])
    assert rel_err(logits, ref_logits) < 1e-5 and tokens == ref_tokens


def test_decoder_weight_bytes_counts_fused_storage_once(make_backend):
    from edgevlm.quantize.bench_models import decoder_weight_bytes

    plain = decoder_weight_bytes(make_backend().model)
    assert decoder_weight_bytes(make_backend(fuse_projections=True).model) == plain
