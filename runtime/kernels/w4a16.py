"""Triton W4A16 kernels over the canonical INT4 layout: a decode GEMV and a dequantizer for prefill.

Both read :mod:`edgevlm.runtime.int4`'s canonical tensors directly (no kernel-private re-layout):
``qweight uint8 (N, K/2)`` (low nibble = even input channel) viewed as ``int32 (N, K/8)`` — in a
little-endian word, input channel ``8w + i`` sits in bits ``4i .. 4i+3`` —, ``scales float16
(N, K/g)`` and ``zeros uint8 (N, K/g)``; ``W[n, k] = (q[n, k] - zeros[n, k//g]) * scales[n, k//g]``.

* :func:`w4a16_gemv` ``y = x @ W.T (+ bias)`` for the few rows of decode (``M <= GEMV_MAX_M``).
  Batch-1 decode is a matrix-vector product bound by the bytes of the weight, so the kernel is a
  streaming read of ``qweight`` in 16-byte-per-thread words, dequantized in registers with fp32
  accumulation: ``BLOCK_N`` output rows per program, optionally the K axis split over ``SPLIT_K``
  programs (fp32 atomics) when ``N`` alone gives too few programs to keep every SM's loads in
  flight. The W4A16 scheme is AWQ's (Lin et al., MLSys 2024); the split-K GEMV is the classic
  bandwidth-bound schedule (e.g. as in FasterTransformer's weight-only GEMV), written here for Triton.
* :func:`dequantize_w4` ``W (N, K)`` in bf16/fp16 in one pass (read K/2 bytes, write 2K bytes per
  row), so prefill runs ``dequantize + cuBLAS`` at close to the dense matmul's speed instead of
  torch's many-op dequantization.

Launch configurations are picked per shape by :func:`gemv_config` from measurements on an H200
(``bench/w4a16_tune.py``). Kernels compile on first use per configuration; call them once before a
CUDA-graph capture (the decode graphs' warm-up does). ``TRITON_INTERPRET=1`` runs them on CPU
tensors (fp16/fp32 only) for the tests.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GEMV_MAX_M = 8
"""Rows up to which :func:`w4a16_gemv` is used; above it, ``dequantize_w4`` + a dense matmul."""


@functools.cache
def _kernels():
    """Compile-on-demand Triton kernels (triton imported here: the module imports without it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                    K_PER_SPLIT,  # input channels per split (multiple of BLOCK_K)
                    HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        BKW: tl.constexpr = BLOCK_K // 8  # int32 words per row per step
        NG: tl.constexpr = BLOCK_K // GROUP  # groups per step
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        mask_m = offs_m < M
        mask_n = offs_n < N
        kw_total = K // 8
        groups = K // GROUP
        offs_w = tl.arange(0, BKW)
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, NG)
        shifts = tl.arange(0, 8) * 4  # (8,)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            w_idx = k0 // 8 + offs_w  # (BKW,)
            words = tl.load(qw_ptr + offs_n[:, None] * kw_total + w_idx[None, :],
                            mask=mask_n[:, None] & (w_idx < kw_total)[None, :], other=0)  # (BN, BKW) int32
            codes = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # (BN, BKW, 8)
            codes = tl.reshape(codes, (BLOCK_N, NG, GROUP)).to(tl.float32)  # (BN, NG, g), k order kept
            g_idx = k0 // GROUP + offs_g  # (NG,)
            g_mask = mask_n[:, None] & (g_idx < groups)[None, :]
            s = tl.load(s_ptr + offs_n[:, None] * groups + g_idx[None, :], mask=g_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + offs_n[:, None] * groups + g_idx[None, :], mask=g_mask, other=0).to(tl.float32)
            w = tl.reshape((codes - z[:, :, None]) * s[:, :, None], (BLOCK_N, BLOCK_K))  # (BN, BK) fp32
            k_idx = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_idx[None, :],
                        mask=mask_m[:, None] & (k_idx < K)[None, :], other=0.0).to(tl.float32)  # (BM, BK)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # (BM, BN)
        out_mask = mask_m[:, None] & mask_n[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:  # y is a zeroed fp32 buffer; bias is added by the caller
            tl.atomic_add(y_ptrs, acc, mask=out_mask, sem="relaxed")

    @triton.jit
    def dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        BKW: tl.constexpr = BLOCK_K // 8
        NG: tl.constexpr = BLOCK_K // GROUP
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_idx = pid_k * BKW + tl.arange(0, BKW)
        g_idx = pid_k * NG + tl.arange(0, NG)
        kw_total = K // 8
        groups = K // GROUP
        mask_n = offs_n < N
        words = tl.load(qw_ptr + offs_n[:, None] * kw_total + w_idx[None, :],
                        mask=mask_n[:, None] & (w_idx < kw_total)[None, :], other=0)  # (BN, BKW)
        shifts = tl.arange(0, 8) * 4
        codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, NG, GROUP)).to(tl.float32)
        g_mask = mask_n[:, None] & (g_idx < groups)[None, :]
        s = tl.load(s_ptr + offs_n[:, None] * groups + g_idx[None, :], mask=g_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_n[:, None] * groups + g_idx[None, :], mask=g_mask, other=0).to(tl.float32)
        w = tl.reshape((codes - z[:, :, None]) * s[:, :, None], (BLOCK_N, BLOCK_K))
        k_idx = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + offs_n[:, None] * K + k_idx[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & (k_idx < K)[None, :])

    @triton.jit
    def gemv1_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, K_PER_SPLIT,
                     HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUPS_PER_STEP: tl.constexpr, SPLIT_K: tl.constexpr):
        # One activation row. Weight words are loaded as (BN, NG, GW) -- output row, group, word in
        # group -- so scales/zeros broadcast per group without any register re-layout; the 8
        # nibbles of a word are peeled with shifts against 8 strided slices of x.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        GW: tl.constexpr = GROUP // 8  # int32 words per group
        NG: tl.constexpr = GROUPS_PER_STEP
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        mask_n = offs_n < N
        kw_total = K // 8
        groups = K // GROUP
        offs_g = tl.arange(0, NG)  # (NG,)
        offs_w = tl.arange(0, GW)  # (GW,)
        acc = tl.zeros((BLOCK_N, NG, GW), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, NG * GROUP):
            g_idx = k0 // GROUP + offs_g  # (NG,)
            g_ok = g_idx < groups
            w_idx = g_idx[:, None] * GW + offs_w[None, :]  # (NG, GW) word index along K
            words = tl.load(qw_ptr + offs_n[:, None, None] * kw_total + w_idx[None, :, :],
                            mask=mask_n[:, None, None] & g_ok[None, :, None], other=0,
                            eviction_policy="evict_first")  # (BN, NG, GW) int32, streamed once
            s = tl.load(s_ptr + offs_n[:, None] * groups + g_idx[None, :],
                        mask=mask_n[:, None] & g_ok[None, :], other=0.0).to(tl.float32)  # (BN, NG)
            z = tl.load(z_ptr + offs_n[:, None] * groups + g_idx[None, :],
                        mask=mask_n[:, None] & g_ok[None, :], other=0).to(tl.float32)
            qx = tl.zeros((BLOCK_N, NG, GW), dtype=tl.float32)
            xs = tl.zeros((NG, GW), dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + w_idx * 8 + i, mask=g_ok[:, None], other=0.0).to(tl.float32)  # (NG, GW)
                qx += ((words >> (4 * i)) & 0xF).to(tl.float32) * xi[None, :, :]
                xs += xi
            # sum_k (q - z) s x = s (sum_k q x - z sum_k x), per group
            acc += s[:, :, None] * (qx - z[:, :, None] * xs[None, :, :])
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # (BN,)
        if SPLIT_K == 1:
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.atomic_add(y_ptr + offs_n, y, mask=mask_n, sem="relaxed")

    return gemv_kernel, dequant_kernel, gemv1_kernel


def _check(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> tuple[int, int]:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous uint8 (N, K/2) tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_size not in (32, 64, 128) or k % group_size:
        raise ValueError(f"in_features={k} must be a multiple of group_size={group_size} (32, 64 or 128)")
    g = k // group_size
    if tuple(scales.shape) != (n, g) or tuple(zeros.shape) != (n, g):
        raise ValueError(f"scales/zeros must be ({n}, {g}), got {tuple(scales.shape)} / {tuple(zeros.shape)}")
    if not (scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("scales and zeros must be contiguous")
    if qweight.storage_offset() % 4:
        raise ValueError("qweight must start on a 4-byte boundary (it is read as int32 words)")
    return n, k


CONFIGS_FILE = Path(__file__).with_name("w4a16_configs.json")
M_BUCKETS = (1, 2, 4, 8)


@functools.cache
def tuned_configs() -> dict[str, dict[str, list]]:
    """Measured best launch configurations per weight shape ``"NxKgG"``: ``{"M": [BM, BN, BK,
    SPLIT_K, warps]}`` for :func:`w4a16_gemv`, ``"gemv1": [BN, GROUPS_PER_STEP, SPLIT_K, warps]``
    for :func:`w4a16_gemv1` with its time ``"gemv1_us"`` and torch tinygemm's ``"tinygemm_us"``,
    written by ``bench/w4a16_tune.py`` on an H200 ({} when the file is absent or unreadable)."""
    try:
        data = json.loads(CONFIGS_FILE.read_text())
        return {str(key): {str(m): list(cfg) for m, cfg in row.items()}
                for key, row in data.get("configs", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        logger.debug("no tuned W4A16 configs (%s): heuristic only", exc)
        return {}


def gemv_config(m: int, n: int, k: int, group_size: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps)`` for an ``(M, K) x (N, K)^T`` product.

    The measured best for this shape and row count when ``w4a16_configs.json`` has it, else a
    heuristic: 16 output rows and 256 input channels (128 bytes of each row) per step, and the K
    axis split until there are at least ~4 programs per SM of a 132-SM GPU."""
    bucket = next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])
    tuned = tuned_configs().get(f"{n}x{k}g{group_size}", {}).get(str(bucket))
    if tuned is not None and len(tuned) == 5:
        return tuple(tuned)  # type: ignore[return-value]
    block_m = 1 if m == 1 else (2 if m == 2 else 4)
    block_n, block_k = 16, max(256, group_size)
    programs = -(-n // block_n)
    split = 1
    steps = -(-k // block_k)
    while programs * split < 528 and split * 2 <= steps and split < 8:
        split *= 2
    return block_m, block_n, block_k, split, 4


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, bias: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x (M, K)`` (bf16/fp16; fp32 in the interpreter) times the INT4 weight ``(N, K)``, transposed,
    plus ``bias (N,)``: ``(M, N)`` in ``x.dtype``, fp32 accumulation.

    Raises ``ValueError`` for mismatched shapes, a group size other than 32/64/128 or a
    non-contiguous weight. ``config`` overrides :func:`gemv_config` (tuning)."""
    n, k = _check(qweight, scales, zeros, group_size)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    bm, bn, bk, split, warps = config or gemv_config(m, n, k, group_size)
    if bk % group_size or bk % 8:
        raise ValueError(f"BLOCK_K={bk} must be a multiple of group_size={group_size}")
    steps = -(-k // bk)
    k_per_split = -(-steps // split) * bk
    split = -(-k // k_per_split)
    gemv_kernel = _kernels()[0]
    grid = (-(-n // bn), split, -(-m // bm))
    qw32 = qweight.view(torch.int32)
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        gemv_kernel[grid](x, qw32, scales, zeros, bias if bias is not None else scales, y, m, n, k,
                          x.stride(0), y.stride(0), k_per_split, HAS_BIAS=bias is not None, GROUP=group_size,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=warps)
        return y
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    gemv_kernel[grid](x, qw32, scales, zeros, scales, acc, m, n, k, x.stride(0), acc.stride(0), k_per_split,
                      HAS_BIAS=False, GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                      num_warps=warps)
    if bias is not None:
        acc += bias.to(torch.float32)
    return acc.to(x.dtype)


GEMV1_DEFAULT = False
"""Whether :func:`w4a16_gemv1` is preferred to tinygemm for a weight shape that was not tuned."""


def prefer_gemv1(n: int, k: int, group_size: int) -> bool:
    """Whether the batch-1 Triton GEMV measured faster than torch's tinygemm for this shape
    (:data:`GEMV1_DEFAULT` when the shape was not measured)."""
    row = tuned_configs().get(f"{n}x{k}g{group_size}", {})
    try:
        return float(row["gemv1_us"][0]) < float(row["tinygemm_us"][0])
    except (KeyError, IndexError, TypeError, ValueError):
        return GEMV1_DEFAULT


def gemv1_config(n: int, k: int, group_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, GROUPS_PER_STEP, SPLIT_K, num_warps)`` for :func:`w4a16_gemv1`: the measured
    best for the shape (``w4a16_configs.json``, key ``"gemv1"``) or a heuristic (8 rows x 512 input
    channels per step; K split until ~4 programs per SM of a 132-SM GPU)."""
    tuned = tuned_configs().get(f"{n}x{k}g{group_size}", {}).get("gemv1")
    if tuned is not None and len(tuned) == 4:
        return tuple(tuned)  # type: ignore[return-value]
    block_n, per_step = 8, max(1, 512 // group_size)
    split, steps = 1, -(-k // (per_step * group_size))
    while -(-n // block_n) * split < 528 and split * 2 <= steps and split < 4:
        split *= 2
    return block_n, per_step, split, 4


def w4a16_gemv1(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Batch-1 decode GEMV: ``x (1, K)`` or ``(K,)`` times the INT4 weight transposed (+ ``bias``)
    -> ``(1, N)`` in ``x.dtype`` (fp32 accumulation). Raises ``ValueError`` like :func:`w4a16_gemv`;
    ``config`` overrides :func:`gemv1_config` (tuning)."""
    n, k = _check(qweight, scales, zeros, group_size)
    if x.numel() != k:
        raise ValueError(f"x must hold one row of {k}, got {tuple(x.shape)}")
    x = x.reshape(k)
    if x.stride(0) != 1:
        x = x.contiguous()
    bn, per_step, split, warps = config or gemv1_config(n, k, group_size)
    if per_step < 1 or per_step & (per_step - 1) or bn & (bn - 1):
        raise ValueError(f"BLOCK_N={bn} and GROUPS_PER_STEP={per_step} must be powers of two")
    step = per_step * group_size
    steps = -(-k // step)
    k_per_split = -(-steps // split) * step
    split = -(-k // k_per_split)
    kernel = _kernels()[2]
    grid = (-(-n // bn), split)
    qw32 = qweight.view(torch.int32)
    if split == 1:
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
        kernel[grid](x, qw32, scales, zeros, bias if bias is not None else scales, y, n, k, k_per_split,
                     HAS_BIAS=bias is not None, GROUP=group_size, BLOCK_N=bn, GROUPS_PER_STEP=per_step,
                     SPLIT_K=1, num_warps=warps)
        return y
    acc = torch.zeros(1, n, dtype=torch.float32, device=x.device)
    kernel[grid](x, qw32, scales, zeros, scales, acc, n, k, k_per_split, HAS_BIAS=False, GROUP=group_size,
                 BLOCK_N=bn, GROUPS_PER_STEP=per_step, SPLIT_K=split, num_warps=warps)
    if bias is not None:
        acc += bias.to(torch.float32)
    return acc.to(x.dtype)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense ``(N, K)`` weight in ``dtype`` from the canonical INT4 tensors, one kernel; ``(q - zero)
    * scale`` in fp32, one rounding to ``dtype`` (bit-identical to
    :func:`edgevlm.runtime.int4.dequantize_int4`). Raises ``ValueError`` like :func:`w4a16_gemv`."""
    n, k = _check(qweight, scales, zeros, group_size)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    elif tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({n}, {k}) tensor")
    dequant_kernel = _kernels()[1]
    bn, bk = 32, max(256, group_size)
    dequant_kernel[(-(-n // bn), -(-k // bk))](qweight.view(torch.int32), scales, zeros, out, n, k,
                                               GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out
