"""KV cache precisions (16-bit, INT4 group-wise, FP8 e4m3) on CPU against the float cache."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_perf.conftest import make_prompt, rel_err, run_single

torch = pytest.importorskip("torch")


def test_int4_roundtrip_is_within_half_a_step():
    from edgevlm.runtime.kv_cache import dequantize_kv_int4, quantize_kv_int4

    x = torch.randn(2, 3, 5, 128) * torch.linspace(0.1, 8.0, 128)  # channels of very different ranges
    codes, scale, zero = quantize_kv_int4(x, 64)
    assert codes.shape == (2, 3, 5, 64) and codes.dtype == torch.uint8
    assert scale.shape == zero.shape == (2, 3, 5, 2) and scale.dtype == torch.float16
    back = dequantize_kv_int4(codes, scale, zero, 64, torch.float32)
    step = scale.float().repeat_interleave(64, dim=-1)
    # half a quantisation step, plus fp16 rounding of the zero point
    assert ((back - x).abs() <= step / 2 + zero.float().abs().repeat_interleave(64, -1) * 2**-10 + 1e-6).all()
    gauss = torch.randn(4, 2, 16, 128)
    back = dequantize_kv_int4(*quantize_kv_int4(gauss, 64), 64, torch.float32)
    assert 0.05 < rel_err(back, gauss) < 0.12  # uniform 4-bit over ~5 sigma: step/sqrt(12) ~ 0.1 sigma


def test_int4_constant_group_is_exact_and_finite():
    from edgevlm.runtime.kv_cache import dequantize_kv_int4, quantize_kv_int4

    x = torch.full((1, 1, 2, 64), 0.5)
    back = dequantize_kv_int4(*quantize_kv_int4(x, 64), 64, torch.float32)
    assert torch.equal(back, x)


def test_bytes_per_token_and_the_3_5x_goal():
    from edgevlm.runtime.kv_cache import kv_bytes_per_token

    # Llama-2-7B: 32 layers x 32 KV heads x 128 channels
    bf16 = kv_bytes_per_token("bf16", 32, 32, 128)
    assert bf16 == 2 * 32 * 32 * 128 * 2 == 524288
    assert kv_bytes_per_token("int4", 32, 32, 128) == 2 * 32 * 32 * (64 + 8)
    assert bf16 / kv_bytes_per_token("int4", 32, 32, 128) >= 3.5
    assert kv_bytes_per_token("fp8_e4m3", 32, 32, 128) == 2 * 32 * 32 * 130


@pytest.mark.parametrize("kv", ["bf16", "int4", "fp8_e4m3"])
def test_cache_objects_report_their_size(make_backend, kv):
    from edgevlm.runtime.kv_cache import kv_bytes_per_token

    be = make_backend(kv_cache_dtype=kv)
    caches = [layer.self_attn.kv_cache for layer in be.model.language_model.layers]
    assert {c.kv_cache_dtype for c in caches} == {"16-bit" if kv == "bf16" else kv}
    assert sum(c.bytes_per_token() for c in caches) == kv_bytes_per_token(kv, len(caches), 2, 32)


@pytest.mark.parametrize(("kv", "max_rel"), [("int4", 0.08), ("fp8_e4m3", 0.03), ("bf16", 0.005)])
def test_quantized_cache_logits_close_to_the_float_cache(make_backend, kv, max_rel):
    ids, px = make_prompt(seed=1, n_text=14)
    ref_logits, ref_tokens = run_single(make_backend(), ids, px, 30)
    logits, tokens = run_single(make_backend(kv_cache_dtype=kv), ids, px, 30, forced=ref_tokens[:-1])
    err = rel_err(logits, ref_logits)
    assert 0 < err <= max_rel
    # greedy choice agrees on (nearly) every step; random tiny models have near-tied logits at a few
    agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)) / len(tokens)
    assert agree >= 0.9
    assert tokens[0] == ref_tokens[0]  # prefill attends to the exact keys/values


def test_engine_greedy_answers_with_a_bf16_cache_equal_the_float_cache(perf_dir):
    from edgevlm.runtime import Engine

    image = np.random.default_rng(3).integers(0, 256, size=(48, 80, 3), dtype=np.uint8)
    base = Engine.load(perf_dir)
    other = Engine.load(perf_dir, backend_options={"kv_cache_dtype": "bf16"})
    for q in ("how many circles are there ?", "what colour is the square ?"):
        assert other.ask(image, q, max_new_tokens=12).text == base.ask(image, q, max_new_tokens=12).text


def test_engine_int4_cache_first_answer_token_matches(perf_dir):
    from edgevlm.runtime import Engine

    image = np.random.default_rng(4).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    base = Engine.load(perf_dir)
    int4 = Engine.load(perf_dir, backend_options={"kv_cache_dtype": "int4"})
    a = base.ask(image, "describe the picture", max_new_tokens=1)
    b = int4.ask(image, "describe the picture", max_new_tokens=1)
    assert a.text == b.text and a.stats.new_tokens == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_batch_size": "4"}, "max_batch_size"),
    ({"min_kv_bucket": 0}, "min_kv_bucket"),
    ({"kv_cache": "int4"}, "unknown torch backend option"),
])
def test_bad_backend_options_are_invalid_requests(perf_dir, options, message):
    from edgevlm.errors import InvalidRequestError
    from edgevlm.runtime import Engine

    with pytest.raises(InvalidRequestError, match=message):
        Engine.load(perf_dir, backend_options=options)


def test_int4_cache_rejects_an_odd_head_dim():
    from edgevlm.runtime.kv_cache import make_kv_cache

    with pytest.raises(ValueError, match="head_dim"):
        make_kv_cache("int4", 1, 2, 8, 33, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        make_kv_cache("int2", 1, 2, 8, 32, dtype=torch.float32, device="cpu")
