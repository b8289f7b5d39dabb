"""W4A16 group-wise asymmetric INT4 weights: quantize, pack, dequantize, and an ``nn.Linear`` drop-in.

Scheme (the same one AWQ, GPTQ and onnxruntime's ``MatMulNBits`` use): every output row of a
weight ``W (N, K)`` (``N = out_features``, ``K = in_features``) is cut into ``K / group_size``
groups of ``group_size`` consecutive input channels; each group has an fp16 ``scale`` and an
integer ``zero`` point in ``[0, 15]``, and every weight is stored as a 4-bit code ``q`` in
``[0, 15]``::

    W[n, k] ~= (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]

The group's range is widened to include 0 (GPTQ's convention), so 0.0 is represented exactly and
the zero point never needs clamping: ``scale = (max(w_max, 0) - min(w_min, 0)) / 15`` (rounded *up*
to fp16, then clamped to fp16's smallest normal number), ``zero = round(-min(w_min, 0) / scale)``,
``q = clamp(round(w / scale) + zero, 0, 15)``. Every weight is then within ``scale / 2`` of its
dequantized value.

Canonical storage layout (bundle format version 1, also the buffers of :class:`Int4Linear`):

* ``qweight``: ``uint8 (N, K // 2)``; byte ``j`` of row ``n`` holds ``q[n, 2j]`` in its low
  nibble (bits 0-3) and ``q[n, 2j + 1]`` in its high nibble (bits 4-7). This is byte for byte the
  ``B`` input of ``com.microsoft::MatMulNBits`` (bits=4) reshaped to ``(N, K // block, block // 2)``.
* ``scales``: ``float16 (N, K // group_size)``.
* ``zeros``: ``uint8 (N, K // group_size)``, one integer zero point per group (unpacked).

Kernels are private re-layouts derived from this at load time (see :class:`Int4Linear`):
torch's tinygemm (``aten._weight_int4pack_mm`` on CUDA, ``aten._weight_int4pack_mm_for_cpu`` on
CPU) dequantizes ``(q - 8) * scale + offset`` with a float offset per group, so the canonical
zero point converts exactly as ``offset = (8 - zero) * scale``.

The format functions (quantize, pack, dequantize) live in :mod:`edgevlm.runtime.int4_format` and
are re-exported here.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.int4_format import (  # noqa: F401  (re-exported: the canonical format)
    FP16_MIN_NORMAL,
    INT4_LAYOUT_VERSION,
    MMA_GROUP_SIZES,
    SUPPORTED_GROUP_SIZES,
    Int4Weight,
    check_int4_shape,
    compute_qparams,
    dequantize_int4,
    fake_quantize_int4,
    gated_row_order,
    mma_layout_shapes,
    pack_int4,
    quantize_codes,
    quantize_int4,
    repack_int4_mma,
    unpack_int4,
)

logger = logging.getLogger(__name__)

# M (rows of the activation matrix) up to which the CPU int4 kernel is used; above it a dequantized
# weight + dense matmul (prefill). bench/quantize_cpu_kernels.py on the 2-core dev machine: the
# kernel costs ~0.06 ms per row of a 3456x1280 layer, dequantizing ~4 ms once, a dense bf16 row
# ~0.02 ms, so dequantize + matmul wins from M ~ 128 (bf16) / ~ 256 (fp32); 64 stays on the safe side.
CPU_KERNEL_MAX_M = 64
# On CUDA tinygemm is used up to this M; larger prefills dequantize into a cuBLAS matmul.
CUDA_KERNEL_MAX_M = 64
# ... and up to this M when the Triton dequantizer is there (bench/w4a16_tune.py, H200: tinygemm
# 35 us at M = 8 on 12288x4096, the Triton dequantizer + cuBLAS 68 us at any M <= 64; at M = 32 on
# 4096x4096 tinygemm takes 42 us, dequantize + cuBLAS ~20 us).
CUDA_TRITON_KERNEL_MAX_M = 16
# Up to this M the tensor-core W4A16 kernel (runtime/kernels/w4a16_mma.cu) serves CUDA decode; on sm_90
# its bulk-copy variant (w4a16_bulk.cu) serves up to MMA_BULK_MAX_M (batched decode to batch 32).
MMA_KERNEL_MAX_M = 16
MMA_BULK_MAX_M = 32
# ... and up to this many kernel launches over row blocks (M up to 2 x 32 on sm_90): at M = 64 two launches
# of the four 7B layers take 2 x 104 us against 257 us for dequantize + cuBLAS (H200, bench/w4a16_kernel.py).
MMA_MAX_CALLS = 2
# Prefill (M above the kernel's rows) with the extension present: a one-pass dequantizer ("cuda": the
# extension's, "triton": kernels/w4a16.py's) writes the bf16 weight in row chunks of at most this many
# bytes into one reused buffer, each multiplied by cuBLAS right after (so the chunk can stay in L2);
# 0 = the whole weight at once. bench/w4a16_kernel.py measures the choice (results/w4a16_kernel_h200_*.md).
PREFILL_DEQUANTIZER = "cuda"
PREFILL_CHUNK_BYTES = 0
# Prefill through the Triton W4A16 GEMM (runtime/kernels/w4a16_gemm.py: dequantization inside the GEMM's main
# loop, no dense weight written) instead of dequantize + cuBLAS, for M >= PREFILL_GEMM_MIN_M rows, only on the GPU
# model its launch table was measured on and only for the shapes and M buckets where that table says it beat
# dequantize + cuBLAS (bench/w4a16_prefill_gemm.py). EDGEVLM_W4A16_PREFILL_GEMM overrides per call: 0 = never,
# 1 = as the table says, force = every prefill of a CUDA layer (benchmarks, tests). H200 table of 2026-12-02: it wins
# only in the M <= 128 bucket on the gate_up shapes and 7B's qkv (M = 65..128 there: M <= 64 is the mma kernel's);
# at M = 600 it is ~1.9x slower than dequantize + cuBLAS, which stays the prefill path (results/w4a16_prefill_gemm_*).
PREFILL_GEMM = True
PREFILL_GEMM_MIN_M = 33
PREFILL_GEMM_ENV = "EDGEVLM_W4A16_PREFILL_GEMM"

_MMA_FALLBACK_LOGGED: set[str] = set()


def mma_kernel_ok(device: torch.device, out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the tensor-core W4A16 kernel serves this layer on ``device``. Where the kernel is absent
    (CPU, no compiler, GPU older than sm_80, failed build or probe, ``EDGEVLM_W4A16_MMA=0``) one INFO
    line per device says why and that decode falls back to torch's int4 kernel (tinygemm)."""
    if group_size not in MMA_GROUP_SIZES or out_features % 16 or in_features % 64:
        return False  # this layer's shape only; the kernel may serve others
    return mma_device_ok(device)


def mma_device_ok(device: torch.device, *, note: str = "") -> bool:
    """Whether the tensor-core W4A16 kernel is usable on ``device`` at all (any layer shape). If not,
    the one INFO line per device that :func:`mma_kernel_ok` promises is logged here, ``note`` appended
    (the bundle loader adds that a stored mma layout is ignored) when this call is the first to log."""
    dev = torch.device(device)
    if os.environ.get("EDGEVLM_W4A16_MMA", "1").strip() in ("0", "false", "no", "off"):
        reason = "disabled by EDGEVLM_W4A16_MMA=0"
    else:
        from edgevlm.runtime.kernels.w4a16_mma import mma_status

        reason = mma_status(dev, "reg")
    if reason is None:
        return True
    key = f"{dev.type}:{dev.index}"
    if key not in _MMA_FALLBACK_LOGGED:
        _MMA_FALLBACK_LOGGED.add(key)
        logger.info("W4A16 tensor-core kernel unavailable on %s (%s): decode falls back to torch's int4 kernel "
                    "(tinygemm)%s", dev, reason, note)
    return False


def mma_max_rows(device: torch.device) -> int:
    """Activation rows up to which the tensor-core kernel serves on ``device`` (32 where the sm_90
    bulk-copy variant is usable, else 16); call only where :func:`mma_kernel_ok` said yes."""
    from edgevlm.runtime.kernels.w4a16_mma import max_rows

    return min(max_rows(device), MMA_BULK_MAX_M)


@functools.cache
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def prefill_gemm_ok(m: int, out_features: int, in_features: int, group_size: int, device: torch.device) -> bool:
    """Whether prefill of ``m`` rows of this layer shape on ``device`` runs the Triton W4A16 GEMM rather than
    dequantize + cuBLAS: a CUDA device with triton, ``m >= PREFILL_GEMM_MIN_M``, and (unless
    ``EDGEVLM_W4A16_PREFILL_GEMM=force``) :data:`PREFILL_GEMM` or the variable at 1, the table measured on a GPU
    of this name and faster than dequantize + cuBLAS there for this shape and M bucket. Host-side only (no
    device work): safe while a CUDA graph is being captured."""
    env = os.environ.get(PREFILL_GEMM_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off") or m < PREFILL_GEMM_MIN_M:
        return False
    dev = torch.device(device)
    if dev.type != "cuda" or not _triton_w4a16(dev):
        return False
    if env == "force":
        return True
    if not (PREFILL_GEMM or env in ("1", "true", "yes", "on")):
        return False
    from edgevlm.runtime.kernels.w4a16_gemm import prefers_gemm, table_device

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return table_device() == _cuda_device_name(index) and prefers_gemm(m, out_features, in_features, group_size)


def _prefill_dequant(lin: Int4Linear, dtype: torch.dtype, dequantizer: str, row0: int, rows: int,
                     out: torch.Tensor | None) -> torch.Tensor:
    if dequantizer == "triton":
        from edgevlm.runtime.kernels.w4a16 import dequantize_w4

        view = out[: rows * lin.in_features].view(rows, lin.in_features) if out is not None else None
        return dequantize_w4(lin.qweight[row0:row0 + rows], lin.scales[row0:row0 + rows],
                             lin.zeros[row0:row0 + rows], lin.group_size, dtype, out=view)
    from edgevlm.runtime.kernels.w4a16_mma import w4a16_dequant

    return w4a16_dequant(lin.qweight, lin.scales, lin.zeros, lin.group_size, dtype, row0=row0, rows=rows, out=out)


def _prefill_matmul(x2: torch.Tensor, lin: Int4Linear, dequantizer: str | None = None,
                    chunk_bytes: int | None = None) -> torch.Tensor:
    """``x2 (M, K) @ W^T + bias`` for prefill: a one-pass dequantizer into ``x2.dtype`` (``"cuda"``: the
    extension's, ``"triton"``: :func:`edgevlm.runtime.kernels.w4a16.dequantize_w4`; default
    :data:`PREFILL_DEQUANTIZER`) then cuBLAS, in row chunks of ``chunk_bytes`` (default
    :data:`PREFILL_CHUNK_BYTES`; 0 = the whole weight) written into one reused buffer."""
    dequantizer = dequantizer or PREFILL_DEQUANTIZER
    if dequantizer == "triton" and not _triton_w4a16(x2.device):
        dequantizer = "cuda"
    chunk_bytes = PREFILL_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    n, k = lin.out_features, lin.in_features
    bias = lin.bias.to(x2.dtype) if lin.bias is not None else None
    if dequantizer == "cuda" and x2.dtype not in (torch.bfloat16, torch.float16):  # the kernel writes 16-bit
        return F.linear(x2, lin.dequantized_weight(x2.dtype), bias)
    chunk_rows = (chunk_bytes // (2 * k)) // 16 * 16 if chunk_bytes else 0
    if not chunk_rows or chunk_rows >= n:
        return F.linear(x2, _prefill_dequant(lin, x2.dtype, dequantizer, 0, n, None), bias)
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    buf = torch.empty(chunk_rows * k, dtype=x2.dtype, device=x2.device)
    for r0 in range(0, n, chunk_rows):
        rows = min(chunk_rows, n - r0)
        w = _prefill_dequant(lin, x2.dtype, dequantizer, r0, rows, buf)
        if bias is not None:
            torch.addmm(bias[r0:r0 + rows], x2, w.T, out=out[:, r0:r0 + rows])
        else:
            torch.mm(x2, w.T, out=out[:, r0:r0 + rows])
    return out


# ----------------------------------------------------------------------------- kernel selection
# torch's int4 ops changed signature across releases (2.1-2.4: int32 (N, K) input to
# _convert_weight_to_int4pack; 2.5+: uint8 (N, K/2) with the even channel in the high nibble on
# CUDA, and separate *_for_cpu ops). Rather than trusting version numbers (JetPack ships its own
# builds), each convention is probed once per device type on a small matrix against the
# dequantized reference, and the first one that matches is used. None matching -> dequantize path.

_PROBE_LOCK = threading.Lock()
_PROBED: dict[str, str | None] = {}


def _tinygemm_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(K/g, N, 2)`` tensor ``[scale, (8 - zero) * scale]`` tinygemm expects."""
    s = scales.to(torch.float32)
    offset = (8.0 - zeros.to(torch.float32)) * s
    return torch.stack([s, offset], dim=-1).transpose(0, 1).contiguous().to(dtype)


def _inner_k_tiles(k: int) -> int | None:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return None


def _pack_for_kernel(convention: str, qweight: torch.Tensor) -> torch.Tensor:
    """Re-layout canonical ``qweight (N, K/2)`` for one kernel convention (on qweight's device)."""
    codes = unpack_int4(qweight)  # (N, K) uint8
    k = codes.shape[1]
    if convention == "cpu_for_cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    tiles = _inner_k_tiles(k)
    if convention == "cuda_uint8_hi":  # torch >= 2.5
        packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
        return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), tiles)
    if convention == "cuda_int32":  # torch 2.1 - 2.4
        return torch.ops.aten._convert_weight_to_int4pack(codes.to(torch.int32).contiguous(), tiles)
    raise ValueError(f"unknown int4 kernel convention {convention!r}")


def _kernel_mm(convention: str, x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor):
    if convention == "cpu_for_cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)


def _candidates(device_type: str) -> list[str]:
    if device_type == "cpu":
        return ["cpu_for_cpu"] if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else []
    if device_type == "cuda":
        return ["cuda_uint8_hi", "cuda_int32"] if hasattr(torch.ops.aten, "_weight_int4pack_mm") else []
    return []


def kernel_convention(device: torch.device) -> str | None:
    """The int4-kernel convention that works on ``device`` (probed once), or None (dequantize)."""
    dev = torch.device(device)
    if dev.type in _PROBED:  # fast path of every forward: no lock once probed
        return _PROBED[dev.type]
    with _PROBE_LOCK:
        if dev.type in _PROBED:
            return _PROBED[dev.type]
        chosen = None
        gen = torch.Generator().manual_seed(0)
        n, k, g = 32, 256, 128
        w = torch.randn(n, k, generator=gen)
        qw = quantize_int4(w, g)
        x = torch.randn(2, k, generator=gen)
        ref = x.double() @ dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64).T
        for conv in _candidates(dev.type):
            try:
                packed = _pack_for_kernel(conv, qw.qweight.to(dev))
                sz = _tinygemm_scales_and_zeros(qw.scales, qw.zeros, torch.bfloat16).to(dev)
                y = _kernel_mm(conv, x.to(dev, torch.bfloat16), packed, g, sz).double().cpu()
            except (RuntimeError, TypeError, NotImplementedError) as exc:
                logger.debug("int4 kernel convention %s unavailable on %s: %s", conv, dev.type, exc)
                continue
            if (y - ref).abs().max().item() <= 0.05 * ref.abs().max().item():
                chosen = conv
                break
            logger.debug("int4 kernel convention %s gives wrong results on %s", conv, dev.type)
        if chosen is None:
            logger.info("no torch int4 kernel on %s (torch %s): using dequantize + matmul", dev, torch.__version__)
        _PROBED[dev.type] = chosen
        return chosen


def _layer_fits_kernel(convention: str, out_features: int, in_features: int, group_size: int) -> bool:
    if convention == "cpu_for_cpu":
        return out_features % 16 == 0 and in_features % 2 == 0
    return out_features % 8 == 0 and _inner_k_tiles(in_features) is not None


class Int4Linear(nn.Module):
    """Drop-in for ``nn.Linear`` with W4A16 group-wise INT4 weights (canonical layout buffers).

    ``forward(x)``: ``x (..., in_features)`` float32/bfloat16/float16 -> ``(..., out_features)`` in
    ``x.dtype``. If ``input_scale (in_features,)`` is set (AWQ scales that could not be folded into
    a preceding op), the layer computes ``W_q @ (x * input_scale) + bias``.

    Execution path, chosen per call:

    * CUDA, ``M <= MMA_KERNEL_MAX_M`` rows (decode; ``MMA_BULK_MAX_M`` on sm_90, batched decode; up to
      ``MMA_MAX_CALLS`` times that in as many launches over row blocks),
      group size 64/128, ``out_features % 16 == 0``: the tensor-core W4A16 kernel over the mma layout
      (:mod:`edgevlm.runtime.kernels.w4a16_mma`, repacked from the canonical buffers on first use and
      cached, or a bundle's stored copy: :meth:`set_mma_layout`); above those rows (prefill) the same
      extension's one-pass dequantizer + cuBLAS (``"cuda_dequant"``, see :data:`PREFILL_CHUNK_BYTES`), or, where
      :func:`prefill_gemm_ok` says the measured table favours it, the Triton W4A16 GEMM that dequantizes in its
      main loop (``"triton_gemm"``, :mod:`edgevlm.runtime.kernels.w4a16_gemm`). Where the extension is absent (see
      :func:`mma_kernel_ok`, one log line) the paths below.
    * CUDA, ``M <= CUDA_TRITON_KERNEL_MAX_M`` rows (decode): tinygemm ``aten._weight_int4pack_mm``
      (bf16 activations; 43 % of copy bandwidth on 7B shapes on an H200, ``bench/w4a16_tune.py``);
      above it the Triton dequantizer + cuBLAS (:mod:`edgevlm.runtime.kernels.w4a16`; prefill; or the Triton GEMM
      where :func:`prefill_gemm_ok` says so).
      Where tinygemm is missing, the Triton W4A16 GEMV serves decode (~2x slower than tinygemm,
      ~25x faster than torch-op dequantization). Without triton: tinygemm up to
      ``CUDA_KERNEL_MAX_M``, then torch-op dequantization; ``kernel = "tinygemm"`` forces that.
    * CPU, ``M <= CPU_KERNEL_MAX_M`` rows (decode): ``aten._weight_int4pack_mm_for_cpu`` with the
      activations cast to bf16 (the kernel is slow with fp32 activations).
    * Otherwise (prefill, torch builds without the ops such as older JetPack wheels, layer shapes
      the kernels reject, or ``kernel = "dequant"``): the weight is dequantized to ``x.dtype`` and a
      dense matmul runs.

    The kernel's private weight re-layout is derived on first use on a device and cached in the
    module (not in ``state_dict``). ``module.to(dtype)`` keeps ``scales`` in float16 and
    ``input_scale`` in float32 (only their device follows).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 128,
        *,
        has_input_scale: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        check_int4_shape(out_features, in_features, group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.kernel = "auto"  # one of INT4_KERNELS (see set_int4_kernel)
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("zeros", torch.full((out_features, groups), 8, dtype=torch.uint8, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer(
            "input_scale", torch.ones(in_features, dtype=torch.float32, device=device) if has_input_scale else None
        )
        self._kernel_cache: tuple | None = None
        self._mma_cache: tuple | None = None
        self.gated_act: str | None = None  # a fused gate/up projection of this activation (set_gated)

    @classmethod
    def from_int4(
        cls, weight: Int4Weight, bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None
    ) -> Int4Linear:
        """Wrap canonical INT4 tensors (and an optional bias/input scale) in a module."""
        dtype = bias.dtype if bias is not None else torch.float32
        mod = cls(
            weight.in_features, weight.out_features, bias is not None, weight.group_size,
            has_input_scale=input_scale is not None, device=weight.qweight.device, dtype=dtype,
        )
        mod.qweight.copy_(weight.qweight)
        mod.scales.copy_(weight.scales)
        mod.zeros.copy_(weight.zeros)
        if bias is not None:
            mod.bias.copy_(bias)
        if input_scale is not None:
            mod.input_scale.copy_(input_scale)
        return mod

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128) -> Int4Linear:
        """RTN-quantize an ``nn.Linear`` (raises ``ValueError`` for an unsupported shape)."""
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_int4(quantize_int4(linear.weight.detach(), group_size), bias)

    def int4_weight(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``(out_features, in_features)`` weight, ``input_scale`` not applied."""
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, input_scale={self.input_scale is not None}, kernel={self.kernel}"
        )

    def _apply(self, fn, recurse=True):  # noqa: D401 - keep scales fp16 under module.to(dtype)
        keep = {n: getattr(self, n) for n in ("scales", "input_scale") if getattr(self, n) is not None}
        super()._apply(fn, recurse)
        for name, t in keep.items():
            dev = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
            self._buffers[name] = t.to(dev)
        self._kernel_cache = None
        self._mma_cache = None
        return self

    def execution_path(self, m: int, device: torch.device) -> str:
        """Name of the path :meth:`forward` takes for ``m`` activation rows on ``device``."""
        if self.kernel == "dequant":
            return "dequant"
        dev_type = torch.device(device).type
        mma_ok = self.kernel in ("auto", "mma") \
            and mma_kernel_ok(device, self.out_features, self.in_features, self.group_size)
        if mma_ok and 0 < m <= MMA_MAX_CALLS * mma_max_rows(device):
            return "mma"
        if mma_ok and self.in_features % 32 == 0:  # prefill: the extension's dequantizer + cuBLAS
            return self._prefill_path(m, device, "cuda_dequant")
        triton_ok = (self.kernel == "triton" or (self.kernel == "auto" and dev_type == "cuda")) \
            and _triton_w4a16(device)
        conv = None if self.kernel == "triton" else kernel_convention(device)
        if conv is not None and not _layer_fits_kernel(conv, self.out_features, self.in_features, self.group_size):
            conv = None
        if conv == "cpu_for_cpu":
            max_m = CPU_KERNEL_MAX_M
        else:  # with the Triton dequantizer, dequantize + cuBLAS beats tinygemm from M ~ 32 (H200)
            max_m = CUDA_TRITON_KERNEL_MAX_M if triton_ok else CUDA_KERNEL_MAX_M
        if triton_ok and m == 1:
            from edgevlm.runtime.kernels.w4a16 import prefer_gemv1

            if conv is None or prefer_gemv1(self.out_features, self.in_features, self.group_size):
                return "triton_gemv1"
        if conv is not None and m <= max_m:
            return conv
        if triton_ok:
            from edgevlm.runtime.kernels.w4a16 import GEMV_MAX_M

            if conv is None and m <= GEMV_MAX_M:
                return "triton_gemv"
            return self._prefill_path(m, device, "triton_dequant")
        return "dequant"

    def _prefill_path(self, m: int, device: torch.device, dequant_path: str) -> str:
        """``"triton_gemm"`` where :func:`prefill_gemm_ok` says so (kernel ``"auto"`` only), else ``dequant_path``."""
        if self.kernel == "auto" and prefill_gemm_ok(m, self.out_features, self.in_features, self.group_size, device):
            return "triton_gemm"
        return dequant_path

    def _kernel_tensors(self, conv: str) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._kernel_cache
        if cache is None or cache[0] != conv or cache[1] != self.qweight.device:
            packed = _pack_for_kernel(conv, self.qweight)
            sz = _tinygemm_scales_and_zeros(self.scales, self.zeros, torch.bfloat16)
            cache = (conv, self.qweight.device, packed, sz)
            self._kernel_cache = cache
        return cache[2], cache[3]

    def _mma_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qw, meta, bias float32)`` of the mma layout, derived once per device (layout version
        ``MMA_LAYOUT_VERSION``); for a gated projection (:meth:`set_gated`) of the rows in
        :func:`~edgevlm.runtime.int4_format.gated_row_order` (the order itself cached as ``_mma_cache[4]``)."""
        cache = self._mma_cache
        if cache is None or cache[0] != self.qweight.device:
            qweight, scales, zeros, bias = self.qweight, self.scales, self.zeros, self.bias
            order = None
            if self.gated_act is not None:
                order = gated_row_order(self.out_features, qweight.device)
                qweight, scales, zeros = qweight[order], scales[order], zeros[order]
                bias = bias[order] if bias is not None else None
            qw, meta = repack_int4_mma(qweight, scales, zeros, self.group_size)
            bias = bias.to(torch.float32).contiguous() if bias is not None else None
            cache = (self.qweight.device, qw, meta, bias, order)
            self._mma_cache = cache
        return cache[1], cache[2], cache[3]

    def _mma_inputs(self, x2: torch.Tensor) -> tuple:
        """``(xa, qw, meta, bias, pdl)`` of a tensor-core launch over ``x2 (M, in_features)``: the activations in bf16
        unless fp16 (contiguous), the layout (:meth:`_mma_tensors`), and ``pdl`` = False on the call that repacks the
        layout (the kernel reads the weights before its PDL wait, griddepcontrol.wait being where the previous grid's
        writes are guaranteed visible, ``runtime/kernels/pdl.py``, and the repack's kernels are this stream's last),
        else None (the rule's choice)."""
        fresh = self._mma_cache is None or self._mma_cache[0] != self.qweight.device
        qw, meta, bias = self._mma_tensors()
        xa = (x2 if x2.dtype in (torch.bfloat16, torch.float16) else x2.to(torch.bfloat16)).contiguous()
        return xa, qw, meta, bias, (False if fresh else None)

    def _mma_launch(self, x2: torch.Tensor) -> torch.Tensor:
        """The tensor-core product of ``x2 (M, in_features)`` (any float dtype, see :meth:`_mma_inputs`) for the
        ``"mma"`` path: ``(M, out_features)`` in the launch dtype, its columns in the layout's row order (a gated
        layer's interleaved order). Up to ``MMA_MAX_CALLS`` launches over equal row blocks of at most
        :func:`mma_max_rows`."""
        from edgevlm.runtime.kernels.w4a16_mma import w4a16_mma

        xa, qw, meta, bias, pdl = self._mma_inputs(x2)
        m, top = xa.shape[0], mma_max_rows(xa.device)
        if m <= top:
            return w4a16_mma(xa, qw, meta, self.group_size, bias, pdl=pdl)
        calls = -(-m // top)
        step = -(-m // calls)
        return torch.cat([w4a16_mma(xa[r:r + step], qw, meta, self.group_size, bias, pdl=pdl)
                          for r in range(0, m, step)])

    def set_gated(self, act: str | None) -> None:
        """Mark this layer as a fused gate/up projection (rows ``[gate | up]``, 2 I of them) whose decode launches may
        apply ``act`` and the product in the W4A16 kernel's epilogue (:meth:`forward_gated`), or unmark it (None).
        Its mma layout then holds the rows in :func:`~edgevlm.runtime.int4_format.gated_row_order` (re-derived on the
        next call; a stored bundle layout is dropped, and :meth:`set_mma_layout` unmarks it again);
        :meth:`forward` still returns ``[gate | up]``. A change drops the layout: CUDA graphs captured before it
        read freed memory and must be captured again (``DecodeGraphs.reset``). Raises ``ValueError`` for another
        activation than ``decode_fused.GATED_ACTS`` or rows that are not a multiple of 16."""
        if act is not None:
            from edgevlm.runtime.int4_format import check_gated_rows
            from edgevlm.runtime.kernels.decode_fused import gated_act_code

            gated_act_code(act, "set_gated")
            check_gated_rows(self.out_features, "set_gated")
        if act != self.gated_act:
            self.gated_act = act
            self._mma_cache = None

    def gated_ready(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward_gated` serves ``x (..., in_features)``: a gated layer (:meth:`set_gated`) on CUDA
        without ``input_scale`` whose rows take the tensor-core (``"mma"``) path."""
        if self.gated_act is None or self.input_scale is not None or x.device.type != "cuda":
            return False
        return self.execution_path(x.numel() // self.in_features, x.device) == "mma"

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of a gated projection (:meth:`set_gated`): ``x (..., in_features)`` (launched in bf16
        unless fp16, as :meth:`forward`) -> ``(..., out_features / 2)`` in ``x.dtype``. Where
        ``w4a16_mma.gated_ok`` says so (decode steps of up to ``GATED_MAX_M`` rows), one launch with the gated
        epilogue (fp32 gate and up, one rounding); else the plain launches over the interleaved rows and
        ``decode_fused.gated_act(..., interleaved=True)``. Only where :meth:`gated_ready` says so; raises
        ``ValueError`` otherwise."""
        if not self.gated_ready(x):
            raise ValueError("forward_gated: not a gated layer on the W4A16 tensor-core path for this input "
                             "(see gated_ready)")
        from edgevlm.runtime.kernels.w4a16_mma import gated_ok, w4a16_mma_gated

        x2 = x.reshape(-1, self.in_features)
        if gated_ok(x2.device, x2.shape[0], self.gated_act):
            xa, qw, meta, bias, pdl = self._mma_inputs(x2)
            y = w4a16_mma_gated(xa, qw, meta, self.group_size, self.gated_act, bias, pdl=pdl)
        else:
            from edgevlm.runtime.kernels.decode_fused import gated_act

            y = gated_act(self._mma_launch(x2), self.gated_act, interleaved=True)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features // 2)

    def set_mma_layout(self, qw: torch.Tensor, meta: torch.Tensor) -> None:
        """Use ``(qw, meta)``, a stored copy of :func:`repack_int4_mma`'s output for this layer (layout
        version ``MMA_LAYOUT_VERSION``; shapes of :func:`~edgevlm.runtime.int4_format.mma_layout_shapes`,
        int32), as the kernel's layout instead of repacking on first use; moved to ``qweight``'s device.
        The copy is not checked against the canonical buffers (the bundle's SHA-256 covers it); a later
        ``module.to(...)`` drops it and the layout is repacked.

        Raises:
            ValueError: the layer's shape has no mma layout, or a tensor's dtype/shape is not the one
                this layer needs (the message names ``qw`` or ``meta`` and both shapes).
        """
        want_qw, want_meta = mma_layout_shapes(self.out_features, self.in_features, self.group_size)
        for what, t, want in (("qw", qw, want_qw), ("meta", meta, want_meta)):
            if t.dtype != torch.int32 or tuple(t.shape) != want:
                raise ValueError(f"{what} is {t.dtype} {tuple(t.shape)}; this layer ({self.out_features}, "
                                 f"{self.in_features}, group_size {self.group_size}) needs torch.int32 {want}")
        dev = self.qweight.device
        bias = self.bias.to(torch.float32).contiguous() if self.bias is not None else None
        self.gated_act = None  # the stored copy is in the canonical row order
        self._mma_cache = (dev, qw.to(dev).contiguous(), meta.to(dev).contiguous(), bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected (..., {self.in_features}) input, got {tuple(x.shape)}")
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        path = self.execution_path(x2.shape[0], x2.device)
        if path == "mma":
            y = self._mma_launch(x2)
            order = self._mma_cache[4]
            if order is not None:  # a gated layer's layout holds its rows in gated_row_order: back to [gate | up]
                y = torch.empty_like(y).index_copy_(1, order, y)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)
        if path == "cuda_dequant":
            return _prefill_matmul(x2.contiguous(), self).reshape(*x.shape[:-1], self.out_features)  # (..., N)
        if path == "triton_gemm":
            if x2.dtype in (torch.bfloat16, torch.float16):
                from edgevlm.runtime.kernels.w4a16_gemm import w4a16_gemm

                y = w4a16_gemm(x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
            else:  # the GEMM takes 16-bit activations; float32 prefill takes the dense reference path
                y = F.linear(x2, self.dequantized_weight(x2.dtype),
                             self.bias.to(x2.dtype) if self.bias is not None else None)
            return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)
        if path == "triton_gemv1":
            from edgevlm.runtime.kernels.w4a16 import w4a16_gemv1

            y = w4a16_gemv1(x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)
        if path == "triton_gemv":
            from edgevlm.runtime.kernels.w4a16 import w4a16_gemv

            y = w4a16_gemv(x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)
        if path == "triton_dequant":
            from edgevlm.runtime.kernels.w4a16 import dequantize_w4

            w = dequantize_w4(self.qweight, self.scales, self.zeros, self.group_size, x2.dtype)
            return F.linear(x2, w, self.bias.to(x2.dtype) if self.bias is not None else None).reshape(
                *x.shape[:-1], self.out_features)
        if path == "dequant":
            y = F.linear(x2, self.dequantized_weight(x.dtype))
        else:
            packed, sz = self._kernel_tensors(path)
            y = _kernel_mm(path, x2.to(torch.bfloat16).contiguous(), packed, self.group_size, sz).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)


INT4_KERNELS = ("auto", "dequant", "tinygemm", "triton", "mma")


def _triton_w4a16(device: torch.device) -> bool:
    """Whether the Triton W4A16 kernels (:mod:`edgevlm.runtime.kernels.w4a16`) serve ``device``: CUDA
    with triton importable (or the CPU interpreter, for tests), bf16/fp16 activations."""
    from edgevlm.runtime.kernels import kernels_usable

    return kernels_usable(device)


def set_int4_kernel(module: nn.Module, kernel: str) -> int:
    """Set ``kernel`` on every :class:`Int4Linear` in ``module``; returns the count.

    ``"auto"``: see :class:`Int4Linear` (tinygemm for decode, the Triton dequantizer + cuBLAS for
    prefill on CUDA; torch's CPU int4 kernel for decode on CPU). ``"tinygemm"``: torch's int4 ops
    and torch-op dequantization only. ``"triton"``: the Triton kernels only (GEMV for
    ``M <= GEMV_MAX_M``; also on CPU under ``TRITON_INTERPRET=1``). ``"mma"``: the tensor-core kernel for
    ``M <= MMA_KERNEL_MAX_M`` where it is usable (else, with one log line, as ``"auto"``; the auto path
    already prefers it on CUDA). ``"dequant"``: dequantize with
    torch ops + dense matmul everywhere (the reference path).
    Raises ``ValueError`` for another name."""
    if kernel not in INT4_KERNELS:
        raise ValueError(f"kernel must be one of {INT4_KERNELS}, got {kernel!r}")
    count = 0
    for m in module.modules():
        if isinstance(m, Int4Linear):
            m.kernel = kernel
            count += 1
    return count


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc only; a no-op elsewhere)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl or another libc
        pass


def prepare_int4_kernels(module: nn.Module) -> int:
    """Build the kernel weight layouts of every :class:`Int4Linear` in ``module`` now (where its
    decode path uses a kernel) instead of on the first request; returns how many were packed.

    Packing goes through a transient int32 ``(N, K)`` copy of the codes per layer; glibc keeps such
    freed blocks in its heap (on the ~0.5B bench decoder: ~0.9 GB of RSS), so the heap is trimmed
    afterwards.
    """
    count = 0
    for m in module.modules():
        if isinstance(m, Int4Linear):
            path = m.execution_path(1, m.qweight.device)
            if path == "mma":
                m._mma_tensors()
                count += 1
            elif path not in ("dequant", "triton_gemv", "triton_gemv1", "triton_dequant", "cuda_dequant", "triton_gemm"):
                m._kernel_tensors(path)
                count += 1
    if count:
        _malloc_trim()
    return count
