"""Triton W4A16 GEMM for prefill: ``y = x @ W.T (+ bias)`` with the INT4 weight dequantized inside the main loop.

Prefill (activation rows ``M`` > 32) of an :class:`edgevlm.runtime.int4.Int4Linear` otherwise writes the whole
weight out in bf16 (``w4a16_dequant.cu``) and hands it to cuBLAS: ~505 MB of extra traffic per 7B decoder layer.
This kernel reads the canonical INT4 tensors directly (the layout of :mod:`edgevlm.runtime.kernels.w4a16`:
``qweight`` viewed as ``int32 (N, K/8)``, input channel ``8w + i`` in bits ``4i .. 4i+3`` of word ``w``;
``scales float16 (N, K/g)``, ``zeros uint8 (N, K/g)``; ``W[n, k] = (q - zero) * scale``) and never stores the
dense weight:

* each program owns a ``BLOCK_M x BLOCK_N`` output tile (``GROUP_M`` row tiles swizzled per column tile so the
  activations and the weight stay in L2), and walks K in ``BLOCK_K`` steps that never cross a quantization
  group (``group_size % BLOCK_K == 0``), so one scale and one zero per output row serve a whole step;
* a step loads ``BLOCK_N x BLOCK_K/8`` int32 words, splits the 8 nibbles with shifts and ``tl.join`` (register
  local) in channel order, turns each code into the exact float ``8388608 + q`` by or-ing in the fp32 exponent
  (no int-to-float conversion), subtracts ``8388608 + zero`` (exact), multiplies by the scale in fp32 and
  rounds once to the activations' dtype -- the same bits :func:`~edgevlm.runtime.int4_format.dequantize_int4`
  and the CUDA dequantizer write -- then ``tl.dot`` accumulates in fp32 on the tensor cores;
* ``SWAP_AB`` computes the transposed tile ``W_tile @ x_tile^T`` so the dequantized weight is the MMA's
  register-fed A operand on Hopper (no round trip of the weight tile through shared memory) and the
  activations are the shared-memory B operand: the operand-swap of mixed-input GEMMs.

Fixed summation order (no split-K, no atomics): bit-stable across runs. The mixed-input idea -- keep the
weight compressed in memory, upconvert it in registers right before the tensor-core instruction, fold in the
group scale and zero point -- is Marlin's (Frantar et al., 2024), Machete's (Neural Magic / vLLM, 2024) and AWQ's
GEMM (Lin et al., MLSys 2024); the exponent-or conversion is the "magic number" trick of FasterTransformer's
weight-only kernels. The code is this project's own, written for Triton.

Launch configurations are not autotuned at run time: :func:`gemm_config` reads ``w4a16_gemm_configs.json``
(written by ``bench/w4a16_prefill_gemm.py --install-table`` from a sweep on a GPU), per weight shape and
group size and M bucket (:data:`M_BUCKETS`), which also records that sweep's time of the GEMM and of
dequantize + cuBLAS; :func:`prefers_gemm` says whether the GEMM won there (what ``Int4Linear`` asks before
using it for prefill). Kernels compile on first use per configuration (call once before a CUDA-graph capture;
the launch itself allocates only the output and is capturable). ``TRITON_INTERPRET=1`` runs the kernel on CPU
tensors (fp16/fp32) for the tests.

Measured (H200, Triton 3.6, bench/results/w4a16_prefill_gemm_h200_20261202.md): the GEMM beats dequantize +
cuBLAS only at M = 128 on the gate_up shapes and 7B's qkv (88.6 vs 113.1 us on 22016x4096); at M = 600 and 1024
it is 1.7-2.5x slower on every shape (7B layer at M = 600: 875 us vs 455 us), ~40 % of cuBLAS's bf16 rate. The
compiled code (TTGIR) shows why the main loop stalls: the per-step scale and zero loads are plain synchronous loads
(not in the cp.async pipeline) and the weight words are copied 8 bytes at a time (``K // 8`` is not known to be a
multiple of 16); prefetching the next step's scales/zeros and passing the word stride are the next things to measure.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from edgevlm.runtime.kernels.w4a16 import _check

logger = logging.getLogger(__name__)

CONFIGS_FILE = Path(__file__).with_name("w4a16_gemm_configs.json")
M_BUCKETS = (128, 600, 1024)
"""Activation rows the sweep measures; a call with ``M`` rows uses the smallest bucket ``>= M`` (the largest
above 1024)."""
DEFAULT_CONFIG = (128, 128, 64, 8, 3, 8, 1)
"""``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, SWAP_AB)`` for shapes the sweep did not
measure (a common Hopper/Ampere tile; not a measured winner)."""
CANDIDATES = (
    # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, SWAP_AB
    (128, 128, 64, 8, 4, 8, 0),
    (128, 256, 64, 8, 3, 8, 0),
    (64, 128, 64, 4, 4, 8, 0),
    (128, 64, 64, 4, 4, 8, 0),
    (64, 256, 64, 8, 4, 8, 0),
    (128, 128, 128, 8, 3, 8, 0),
    (128, 128, 64, 8, 4, 8, 1),
    (64, 128, 64, 4, 4, 8, 1),
    (128, 256, 64, 8, 3, 8, 1),
    (128, 64, 64, 4, 4, 8, 1),
    (64, 256, 64, 8, 4, 8, 1),
    (256, 128, 64, 8, 3, 8, 1),
    (128, 128, 128, 8, 3, 8, 1),
    (64, 64, 64, 4, 5, 8, 1),
)
"""The launch configurations ``bench/w4a16_prefill_gemm.py`` sweeps (``GROUP_M`` is then varied on the best)."""
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _kernel():
    """The compile-on-demand Triton kernel (triton imported here: the module imports without it)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M", "GROUP_M"])
    def w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, GROUP_M,
                          HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n  # programs of one band of GROUP_M row tiles
        first_m = (pid // per_group) * GROUP_M
        band_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % band_m
        pid_n = (pid % per_group) // band_m
        BKW: tl.constexpr = BLOCK_K // 8  # int32 words per weight row per step
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        rows_m = offs_m % M  # loads wrap instead of masking; the store is masked
        rows_n = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        offs_w = tl.arange(0, BKW)
        kw_total = K // 8
        groups = K // GROUP
        x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]  # (BM, BK)
        w_ptrs = qw_ptr + rows_n[:, None] * kw_total + offs_w[None, :]  # (BN, BKW) int32 words
        sz_ptrs = rows_n * groups  # (BN,) start of each row's groups
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs)  # (BM, BK)
            words = tl.load(w_ptrs)  # (BN, BKW)
            g = k0 // GROUP  # a step never crosses a group
            s = tl.load(s_ptr + sz_ptrs + g).to(tl.float32)  # (BN,)
            zf = tl.load(z_ptr + sz_ptrs + g).to(tl.float32) + 8388608.0  # (BN,) 2^23 + zero
            # nibble i of word w is channel 8w + i: join 8 nibble planes so that row-major order is i
            e = 0x4B000000  # fp32 bits of 2^23: (e | q) is the float 2^23 + q exactly
            n0 = (words & 0xF) | e
            n1 = ((words >> 4) & 0xF) | e
            n2 = ((words >> 8) & 0xF) | e
            n3 = ((words >> 12) & 0xF) | e
            n4 = ((words >> 16) & 0xF) | e
            n5 = ((words >> 20) & 0xF) | e
            n6 = ((words >> 24) & 0xF) | e
            n7 = ((words >> 28) & 0xF) | e
            q = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
            q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32, bitcast=True)  # (BN, BK): 2^23 + code
            w = ((q - zf[:, None]) * s[:, None]).to(x.dtype)  # (BN, BK): one rounding, as the dequantizer
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc)  # (BN, BM)
            else:
                acc = tl.dot(x, tl.trans(w), acc)  # (BM, BN)
            x_ptrs += BLOCK_K
            w_ptrs += BKW
        if SWAP_AB:
            acc = tl.trans(acc)  # (BM, BN)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])

    return w4a16_gemm_kernel


@functools.cache
def _table() -> dict:
    """``w4a16_gemm_configs.json`` as loaded (``{}`` when absent or unreadable)."""
    try:
        data = json.loads(CONFIGS_FILE.read_text())
        if not isinstance(data.get("configs"), dict):
            raise ValueError("no 'configs' object")
        return data
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        logger.debug("no tuned W4A16 prefill GEMM configs (%s): defaults only", exc)
        return {}


def m_bucket(m: int) -> int:
    """The sweep's row count whose entry serves ``m`` rows (smallest bucket ``>= m``, else the largest)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def _entry(m: int, n: int, k: int, group_size: int) -> dict | None:
    row = _table().get("configs", {}).get(f"{n}x{k}g{group_size}")
    entry = row.get(str(m_bucket(m))) if isinstance(row, dict) else None
    return entry if isinstance(entry, dict) else None


def table_device() -> str | None:
    """The GPU name the installed table was measured on (None without a table)."""
    dev = _table().get("device")
    return str(dev) if dev else None


def gemm_config(m: int, n: int, k: int, group_size: int) -> tuple[int, int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, SWAP_AB)`` for an ``(M, K) x (N, K)^T``
    product: the sweep's best for this shape, group size and M bucket, else :data:`DEFAULT_CONFIG`."""
    entry = _entry(m, n, k, group_size)
    cfg = entry.get("config") if entry else None
    if isinstance(cfg, list) and len(cfg) == 7 and all(isinstance(v, int) for v in cfg):
        return tuple(cfg)  # type: ignore[return-value]
    return DEFAULT_CONFIG


def prefers_gemm(m: int, n: int, k: int, group_size: int) -> bool:
    """Whether the sweep measured this GEMM faster than dequantize + cuBLAS for this shape, group size and
    ``m``'s bucket (False for shapes it did not measure). The caller checks the device
    (:func:`table_device`)."""
    entry = _entry(m, n, k, group_size)
    try:
        return float(entry["gemm_us"]) < float(entry["dequant_cublas_us"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return False


def _check_config(cfg: tuple, group_size: int) -> tuple[int, int, int, int, int, int, int]:
    if len(cfg) != 7 or not all(isinstance(v, int) for v in cfg):
        raise ValueError(f"config must be 7 ints (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, SWAP_AB), "
                         f"got {cfg!r}")
    bm, bn, bk, warps, stages, group_m, swap = cfg
    for name, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk), ("num_warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two")
    if min(bm, bn, bk) < 16:
        raise ValueError(f"BLOCK_M/N/K must be at least 16 (tl.dot), got {bm}/{bn}/{bk}")
    if stages < 1 or group_m < 1 or swap not in (0, 1):
        raise ValueError(f"num_stages={stages} and GROUP_M={group_m} must be >= 1, SWAP_AB={swap} 0 or 1")
    bk = min(bk, group_size)  # a step stays inside one quantization group (both are powers of two)
    return bm, bn, bk, warps, stages, group_m, swap


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x (M, K) @ W.T + bias`` with ``W (N, K)`` the canonical INT4 weight, dequantized in the GEMM's main loop.

    Args:
        x: activations ``(M, K)``, bfloat16 or float16 on CUDA (float32 too under ``TRITON_INTERPRET=1`` on the
            CPU); its last dimension must be contiguous (else it is copied).
        qweight: ``uint8 (N, K/2)``, contiguous, starting on a 4-byte boundary (read as ``int32 (N, K/8)``).
        scales: ``float16 (N, K/group_size)``; zeros: ``uint8 (N, K/group_size)``; both contiguous.
        group_size: 32, 64 or 128 input channels per quantization group.
        bias: optional ``(N,)`` (any float dtype; added in fp32 before the one rounding of the output).
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, SWAP_AB)``, overriding
            :func:`gemm_config` (the sweep); ``BLOCK_K`` above ``group_size`` is lowered to it.

    Returns:
        ``(M, N)`` in ``x.dtype``: fp32 accumulation of bf16/fp16 products of the weight as
        ``dequantize_int4`` rounds it to ``x.dtype``; one rounding at the end. Deterministic.

    Raises:
        ValueError: a weight tensor of the wrong dtype, shape, contiguity or alignment, a group size other than
            32/64/128 or one that does not divide K, ``x`` not ``(M, K)``, ``x`` of another dtype, tensors on
            different devices, ``bias`` not ``(N,)``, or a bad ``config``.
    """
    n, k = _check(qweight, scales, zeros, group_size)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    allowed = ACTIVATION_DTYPES if x.device.type == "cuda" else (*ACTIVATION_DTYPES, torch.float32)
    if x.dtype not in allowed:
        raise ValueError(f"x must be one of {allowed} on {x.device.type}, got {x.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float ({n},) tensor, got {bias.dtype} {tuple(bias.shape)}")
    m = x.shape[0]
    bm, bn, bk, warps, stages, group_m, swap = _check_config(
        tuple(config) if config is not None else gemm_config(m, n, k, group_size), group_size)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    grid = (-(-m // bm) * -(-n // bn),)
    _kernel()[grid](x, qweight.view(torch.int32), scales, zeros, bias if bias is not None else scales, y, m, n, k,
                    x.stride(0), y.stride(0), group_m, HAS_BIAS=bias is not None, GROUP=group_size, BLOCK_M=bm,
                    BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, num_warps=warps, num_stages=stages)
    return y
