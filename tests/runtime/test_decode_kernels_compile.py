"""The fused decode step's Triton kernels compile for the GPUs edgevlm targets, on a machine without one:
sm_87 (Jetson AGX Orin), sm_80 (A100) and sm_90 (H100 / H200), through Triton's own compiler and its
bundled ptxas, with the specialisations a real launch gets (16-byte aligned pointers). Caught here: a
kernel that only compiles where the GPU has fp8 types (sm_89+): fp8 KV caches reach the kernels as bytes
on older GPUs (Triton refuses ``float8_e4m3fn`` pointers on sm_87)."""

from __future__ import annotations

import pytest

from tests.triton_support import needs_triton

pytestmark = needs_triton

TARGETS = (80, 87, 90)


def _compile(fn, signature: dict, constexprs: dict, cc: int, num_warps: int = 4, num_stages: int = 3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items()) if ty.startswith("*")}
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    except TypeError:  # the compile API of Triton >= 3.3 (this test's form); older ones name things otherwise
        pytest.skip(f"triton {triton.__version__}: ASTSource takes no constexprs= / attrs= of this form")
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


@pytest.mark.parametrize("cc", TARGETS)
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_rope_kv_write_and_split_attention_compile(cc, cache):
    from edgevlm.runtime.kernels import decode_fused

    kernels = decode_fused._kernels()
    fp8 = cache == "fp8"
    native = fp8 and cc >= 89  # decode_fused.fp8_native's rule: e4m3 pointers only where the GPU has fp8
    kv = ("*fp8e4nv" if native else "*u8") if fp8 else "*bf16"
    scales = "*fp16" if fp8 else "*fp32"
    rope = _compile(kernels[1], {
        "qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "rpos_ptr": "*i64",
        "qw_ptr": "*fp32", "kw_ptr": "*fp32", "q_ptr": "*bf16", "k_ptr": "*u8" if fp8 else "*bf16",
        "v_ptr": "*u8" if fp8 else "*bf16", "ks_ptr": scales, "vs_ptr": scales, "H": "i32", "HKV": "i32", "S": "i32",
        "eps": "fp32", "HEAD_DIM": "constexpr", "HALF": "constexpr", "QK_NORM": "constexpr", "UNIT_OFFSET": "constexpr",
        "KV_FP8": "constexpr", "USE_GDC": "constexpr"},
        {"HEAD_DIM": 128, "HALF": 64, "QK_NORM": True, "UNIT_OFFSET": False, "KV_FP8": fp8, "USE_GDC": False}, cc,
        num_warps=1)
    split = _compile(kernels[3], {
        "q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "ks_ptr": scales, "vs_ptr": scales, "pos_ptr": "*i64",
        "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "y_ptr": "*bf16", "H": "i32", "HKV": "i32", "S": "i32",
        "CHUNK": "i32", "scale": "fp32", "WINDOW": "i32", "REP": "constexpr", "REP_PAD": "constexpr",
        "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "NSPLIT": "constexpr", "HAS_WINDOW": "constexpr",
        "KV_FP8": "constexpr", "FP8_NATIVE": "constexpr", "USE_GDC": "constexpr"},
        {"REP": 4, "REP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64, "NSPLIT": 2, "HAS_WINDOW": False, "KV_FP8": fp8,
         "FP8_NATIVE": native, "USE_GDC": False}, cc)
    for out in (rope, split):
        assert len(out.asm["cubin"]) > 1000
        assert f".target sm_{cc}" in out.asm["ptx"]
