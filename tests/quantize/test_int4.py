"""runtime/int4.py: the canonical W4A16 layout and Int4Linear, checked against float64 references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgevlm.runtime import int4
from edgevlm.runtime.int4 import (
    Int4Linear,
    dequantize_int4,
    fake_quantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)


def _reference_qparams(w64: torch.Tensor, group_size: int):
    """Independent float64 reference of the documented scheme."""
    n, k = w64.shape
    g = w64.reshape(n, k // group_size, group_size)
    w_max = g.amax(-1).clamp(min=0.0)
    w_min = g.amin(-1).clamp(max=0.0)
    exact = (w_max - w_min) / 15.0
    scales = exact.to(torch.float16).double()
    up = torch.nextafter(exact.to(torch.float16), torch.tensor(float("inf"), dtype=torch.float16)).double()
    scales = torch.where(scales < exact.float().double(), up, scales).clamp(min=2.0**-14)  # rounded up
    zeros = torch.round(-w_min / scales).clamp(0, 15)
    codes = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    deq = (codes - zeros[..., None]) * scales[..., None]
    return scales, zeros, codes.reshape(n, k), deq.reshape(n, k)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_matches_float64_reference(group_size):
    gen = torch.Generator().manual_seed(group_size)
    w = torch.randn(48, 256, generator=gen, dtype=torch.float64) * 0.05
    w[3, :group_size] += 0.7  # a group with only positive weights: 0 must stay representable
    q = quantize_int4(w.float(), group_size)
    scales, zeros, codes, deq = _reference_qparams(w.float().double(), group_size)
    assert q.qweight.shape == (48, 128) and q.qweight.dtype == torch.uint8
    assert q.scales.shape == (48, 256 // group_size) and q.scales.dtype == torch.float16
    assert q.zeros.dtype == torch.uint8
    torch.testing.assert_close(q.scales.double(), scales, rtol=0, atol=0)
    torch.testing.assert_close(q.zeros.double(), zeros, rtol=0, atol=0)
    mismatch = (unpack_int4(q.qweight).double() != codes).float().mean().item()
    assert mismatch < 1e-3  # only float32-vs-float64 rounding ties may differ
    got = dequantize_int4(q.qweight, q.scales, q.zeros, group_size, torch.float64)
    # The guarantee of round-to-nearest: every weight within half a step of its group's scale.
    step = q.scales.double().repeat_interleave(group_size, dim=1)
    assert ((got - w.float().double()).abs() <= step / 2 + 1e-9).all()
    assert (got - deq).abs().max().item() <= step.max().item() * (mismatch > 0)


def test_pack_layout_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_int4(packed), codes)


def test_zero_and_constant_groups():
    w = torch.zeros(16, 128)
    w[1] = 0.25  # constant positive group
    q = quantize_int4(w, 128)
    deq = dequantize_int4(q.qweight, q.scales, q.zeros, 128)
    assert torch.equal(deq[0], torch.zeros(128))
    torch.testing.assert_close(deq[1], torch.full((128,), 0.25), rtol=0, atol=0.25 / 30)


def test_fake_quantize_equals_dequantized_storage():
    w = torch.randn(32, 192)
    q = quantize_int4(w, 64)
    torch.testing.assert_close(fake_quantize_int4(w, 64), dequantize_int4(q.qweight, q.scales, q.zeros, 64))


@pytest.mark.parametrize(
    "shape, group_size, match",
    [((16, 200), 128, "not divisible"), ((16, 256), 100, "group_size must be"), ((16, 256), 16, "group_size")],
)
def test_bad_shapes_raise(shape, group_size, match):
    with pytest.raises(ValueError, match=match):
        quantize_int4(torch.randn(*shape), group_size)
    with pytest.raises(ValueError, match=match):
        Int4Linear(shape[1], shape[0], group_size=group_size)


def test_non_finite_weight_raises():
    w = torch.randn(16, 128)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_int4(w, 128)
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4(torch.randn(4, 4, 128), 128)


def _layer(n=64, k=256, g=128, bias=True, input_scale=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    mod = Int4Linear.from_linear(lin, g)
    if input_scale:
        mod = Int4Linear.from_int4(mod.int4_weight(), mod.bias, torch.rand(k, generator=gen) + 0.5)
    return mod


def _reference_out(mod: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    w64 = dequantize_int4(mod.qweight, mod.scales, mod.zeros, mod.group_size, torch.float64)
    x64 = x.double()
    if mod.input_scale is not None:
        x64 = x64 * mod.input_scale.double()
    y = x64 @ w64.T
    return y + mod.bias.double() if mod.bias is not None else y


@pytest.mark.parametrize("kernel", ["auto", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 100])  # decode, small batch, prefill
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_float64(kernel, dtype, m, group_size):
    mod = _layer(g=group_size, input_scale=(group_size == 64)).to(dtype)
    mod.kernel = kernel
    x = torch.randn(1, m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    with torch.no_grad():
        y = mod(x)
    assert y.shape == (1, m, 64) and y.dtype == dtype
    ref = _reference_out(mod, x)
    # bf16 activations (the kernel casts fp32 decode inputs to bf16 too): relative tolerance of bf16.
    bf16_path = dtype == torch.bfloat16 or mod.execution_path(m, x.device) != "dequant"
    tol = 2e-2 if bf16_path else 1e-5
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, (err, mod.execution_path(m, x.device))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch without CPU int4 op")
def test_cpu_kernel_selected_for_decode_only():
    assert int4.kernel_convention(torch.device("cpu")) == "cpu_for_cpu"
    mod = _layer()
    assert mod.execution_path(1, torch.device("cpu")) == "cpu_for_cpu"
    assert mod.execution_path(int4.CPU_KERNEL_MAX_M + 1, torch.device("cpu")) == "dequant"
    odd = _layer(n=40)  # the CPU kernel needs out_features % 16 == 0
    assert odd.execution_path(1, torch.device("cpu")) == "dequant"
    x = torch.randn(1, 256)
    torch.testing.assert_close(odd(x).double(), _reference_out(odd, x), rtol=1e-5, atol=1e-5)
    mod.kernel = "dequant"
    assert mod.execution_path(1, torch.device("cpu")) == "dequant"


def test_dtype_conversion_keeps_scales_fp16_and_state_dict_round_trips():
    mod = _layer(input_scale=True).to(torch.bfloat16)
    assert mod.scales.dtype == torch.float16
    assert mod.input_scale.dtype == torch.float32
    assert mod.bias.dtype == torch.bfloat16
    sd = mod.state_dict()
    assert set(sd) == {"qweight", "scales", "zeros", "bias", "input_scale"}
    fresh = Int4Linear(256, 64, True, 128, has_input_scale=True, dtype=torch.bfloat16)
    fresh.load_state_dict(sd)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(fresh(x), mod(x))


def test_forward_rejects_wrong_width_and_set_kernel():
    mod = _layer()
    with pytest.raises(ValueError, match=r"\(\.\.\., 256\)"):
        mod(torch.randn(2, 255))
    holder = nn.Sequential(mod, nn.ReLU(), _layer(n=64, k=64, g=64))
    assert int4.set_int4_kernel(holder, "dequant") == 2
    with pytest.raises(ValueError, match="kernel must be"):
        int4.set_int4_kernel(holder, "fast")


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch without CPU int4 op")
def test_prepare_int4_kernels_packs_eligible_layers():
    holder = nn.Sequential(_layer(n=64), nn.ReLU(), _layer(n=40, k=256))  # 40 rows: no CPU kernel
    assert int4.prepare_int4_kernels(holder) == 1
    assert holder[0]._kernel_cache is not None and holder[2]._kernel_cache is None
    x = torch.randn(1, 256)
    torch.testing.assert_close(holder[0](x).double(), _reference_out(holder[0], x), rtol=2e-2, atol=2e-2)
    holder.to(torch.bfloat16)  # moving/converting drops the derived layouts
    assert holder[0]._kernel_cache is None
