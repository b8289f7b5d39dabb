"""Fused Triton kernels for one decode step (T = 1): fewer, larger kernels per decoder layer.

A batch-1 decode step of a small decoder is bound by the number of kernels, not by bytes: inside a
CUDA graph each tiny elementwise kernel still costs ~2-3 us of GPU time (launch latency and a
mostly idle GPU). The plain layer runs ~17 kernels; with these three it runs ~10:

* :func:`add_rms_norm` — ``s = x + delta`` (the residual add, rounded to the activation dtype as
  the unfused ``x + delta`` is) and ``RMSNorm(s) * weight`` in one pass (two kernels -> one; it
  takes the place of each residual add and the norm that follows it).
* :func:`rope_kv_write` — rotary embedding of q and k (the half-rotation layout of transformers'
  Llama; Su et al., "RoFormer", 2021) for each row's RoPE position (the cache slot, or slot +
  ``rope_delta`` for multimodal RoPE), optionally after Qwen3's per-head q/k RMSNorm, q written
  ``(B, H, 1, Dh)`` and the rotated k and the v written straight into the static KV cache at the
  slot (five kernels -> one; eight with q/k norm).
* :func:`silu_mul` / :func:`gated_act` — SwiGLU's ``silu(gate) * up`` (or GeGLU's tanh-GELU,
  Gemma) from the fused gate/up projection (Shazeer, "GLU Variants Improve Transformer", 2020)
  (two kernels -> one); ``interleaved=True`` reads a gated W4A16 layer's column order. A decode step of up to
  ``w4a16_mma.GATED_MAX_M`` rows over a W4A16 model runs none: the gate/up matmul's epilogue applies it.

Gemma 3 (Gemma Team, "Gemma 3 Technical Report", 2025) runs on the same kernels by configuration:
unit-offset norm weights (``1 + w``), its post-attention / post-feedforward norms folded into
:func:`add_rms_norm` (norm of the delta, residual add, next norm: one kernel), the
``query_pre_attn_scalar`` score scale and the sliding layers' window in :func:`decode_attention`,
and the sliding layers' own RoPE tables passed to :func:`rope_kv_write`. The constexpr switches are
off for every other decoder, which compiles to the same kernels as before.

* :func:`rope_decode_attention` — :func:`rope_kv_write` and :func:`decode_attention` in one kernel (three
  kernels -> one): each CTA rotates its KV head's queries and the fresh key itself, the CTA whose key
  range holds the slot writes k and v into the cache, the fresh key stands in for the slot's row where a
  CTA reads the cache, and the last CTA of each KV head to finish (an atomic counter per head, reset by
  that CTA) combines the splits (none at large batch: one CTA per head), or (``combine=False``,
  :data:`FUSED_ATTENTION_COMBINE`) the combine kernel after it. Opt-in (:data:`FUSED_ATTENTION`): it measured
  slower than the three kernels.

FP8 KV caches (:class:`~edgevlm.runtime.kv_cache.Fp8KVCache`, ``float8_e4m3fn`` values + one fp16 scale per
(row, head, position)): :func:`rope_kv_write` quantizes the fresh key and value in its kernel, bit-identical to
the cache's torch quantization, and :func:`decode_attention` reads the e4m3 bytes and scales, never writing a
dequantized copy (half the bytes of a 16-bit cache per step). The launch parameters of :func:`decode_attention`
come from :data:`ATTENTION_CONFIGS` (``bench/decode_attention_tune.py`` measures them).

Programmatic dependent launch (on by default since session 11: :data:`PDL`, ``EDGEVLM_DECODE_PDL=0`` turns it
off; where it applies, sm_90+ and decode steps of at most ``pdl.MAX_ROWS`` rows, is :func:`pdl_ok` /
:func:`edgevlm.runtime.kernels.pdl.allowed`): every kernel here then waits for the previous grid at its very top and
releases the next launch right after, so each launch overlaps the previous kernel's tail; off, the kernels compile
and launch as without it.

All statistics and products in fp32, one rounding on store. ``TRITON_INTERPRET=1`` runs them on
CPU (fp16/fp32) for the tests; :mod:`edgevlm.runtime.decoder` uses them on CUDA (16-bit and fp8 KV caches
directly; INT4 caches through :mod:`~edgevlm.runtime.kernels.int4kv_attention`'s kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

from edgevlm.runtime.kernels import interpreter_mode

logger = logging.getLogger(__name__)

FUSED_ATTENTION = os.environ.get("EDGEVLM_DECODE_FUSED_ATTENTION", "0").strip().lower() in ("1", "true", "yes", "on")
"""Whether :meth:`~edgevlm.runtime.decoder.Decoder._fused_decode` runs :func:`rope_decode_attention` (RoPE,
KV write, split attention and the combine in one kernel) where it applies, instead of :func:`rope_kv_write`
+ :func:`decode_attention` (three kernels). Off by default, ``EDGEVLM_DECODE_FUSED_ATTENTION=1`` opts in: its
first version measured slower in the whole 7B W4A16 decode on an H200 (2026-12-02, three alternations:
404-415 vs 427-441 tok/s at batch 1, 1697-1773 vs 2281-2400 at 8, 2366-2405 vs 3916-4014 at 32;
``bench/results/w4a16_kernel_h200_20261202.md``, session 8); its revised form (no per-thread fence, fewer splits at
large batch) measured slower too (2026-12-03, step 1.850 -> 1.995 ms at batch 1, 2.608 -> 2.881 at 8, 6.214 -> 6.929
at 32; ``bench/results/w4a16_kernel_h200_20261203.md``, session 14). Read at each step, so a new CUDA graph capture
picks up a change."""

FUSED_ATTENTION_COMBINE = os.environ.get("EDGEVLM_DECODE_FUSED_COMBINE", "1").strip().lower() in (
    "1", "true", "yes", "on")
"""Under :data:`FUSED_ATTENTION`, whether :func:`rope_decode_attention` combines the key splits in its own kernel
(the last CTA of each head, behind an atomic counter: one kernel per layer) or leaves them to the combine kernel
:func:`decode_attention` uses (two kernels: RoPE + KV write + split attention, then the combine;
``EDGEVLM_DECODE_FUSED_COMBINE=0``). The two-kernel form measured slower than the three kernels of the default
path too (H200, 2026-12-03, session 16: step 1.841 -> 1.939 ms at batch 1, 2.605 -> 2.781 at 8;
``bench/results/w4a16_kernel_h200_20261203.md``). Read at each launch."""

FP8_NATIVE: bool | None = None
"""How :func:`decode_attention` turns e4m3 bytes into numbers: True the hardware conversion (Triton's
``float8e4nv``, sm_89+), False by moving the bits into fp16's fields (any GPU, and Triton's interpreter), None
(default) the hardware where the device has it (:func:`fp8_native`)."""

ATTENTION_CTA_BUDGET: int | None = None
"""CTAs :func:`decode_attention` aims for when it splits the keys (None: about one wave, :func:`_cta_budget`). A
huge value keeps ``max_splits`` splits at every batch size (the schedule before 2026-12-02; benchmarks A/B it)."""

PDL = os.environ.get("EDGEVLM_DECODE_PDL", "1").strip().lower() in ("1", "true", "yes", "on")
"""This module's switch for launching its Triton kernels as programmatic dependents of the previous kernel in the
stream (:func:`pdl_ok`; where it applies is :func:`edgevlm.runtime.kernels.pdl.allowed`'s rule, shared with the
W4A16 CUDA kernels' own switch :data:`~edgevlm.runtime.kernels.w4a16_mma.PDL`). On by default since session 11
(H200: the 7B W4A16 decode step 2.179 -> 1.997 ms at batch 1 with both modules' kernels so launched, bit-identical);
``EDGEVLM_DECODE_PDL=0`` turns it off. Read at each launch, so a new CUDA graph capture picks up a change."""

# Tried and reverted (H200, 2026-12-03, sessions 16-17; bench/results/w4a16_kernel_h200_20261203.md): under PDL the
# split attention reading its first key block's old keys and values before griddepcontrol.wait (only the new slot
# comes from the RoPE + KV write kernel before it), the new row after. Bit-identical, but it cost registers (sm_90,
# head dim 128: 85 -> 128) and was slower: the 7B W4A16 step 1.862 -> 1.984 ms at batch 1, 2.619 -> 2.682 at 8.
# Also tried and reverted (session 17): every Triton decode kernel releasing its dependents before its wait instead
# of after (the next kernel's CTAs, e.g. the output projection streaming its weights, resident during the
# attention). The same logits (CUDA graph replays bit-identical), slower: 1.864 -> 1.936 ms at batch 1, 2.620 ->
# 2.638 at 8; every W4A16 kernel's own time grew (batch 1: 1583 -> 1856 µs of matmul kernel time per step).

ADD_RMS_NORM_WARPS: int | None = None
"""Warps per CTA (one CTA per row) of :func:`add_rms_norm`'s kernel; None: :func:`add_rms_norm_warps`'s rule. A
knob for benchmarks to A/B; read at each launch."""


def add_rms_norm_warps(d: int) -> int:
    """Warps of :func:`add_rms_norm` for rows of ``d`` elements: :data:`ADD_RMS_NORM_WARPS`, else 16 for
    ``d >= 4096`` and 4 below. 16 since session 11: at ``d = 4096`` on the H200 the kernel took 3.1 -> 2.0 us
    (the 7B W4A16 decode step 2.176 -> 2.098 ms at batch 1, 2.899 -> 2.823 at batch 8; a different reduction
    order, so the last bit of some outputs differs; ``bench/results/session11_h200_20261202/``); smaller rows
    keep the 4 warps they were measured with."""
    if ADD_RMS_NORM_WARPS is not None:
        return int(ADD_RMS_NORM_WARPS)
    return 16 if d >= 4096 else 4


@functools.cache
def _triton_has_gdc() -> bool:
    """Whether the installed Triton exposes grid dependency control (``triton.language.extra.cuda.gdc_wait``,
    Triton >= 3.4); checked once."""
    try:
        from triton.language.extra import cuda
    except Exception:  # noqa: BLE001 - no triton, or one without the CUDA extras
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def pdl_ok(device: torch.device | str, rows: int) -> bool:
    """Whether this module's kernels over ``rows`` rows (the decode batch) on ``device`` are launched with
    programmatic dependent launch (PDL).

    PDL (NVIDIA, CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA,
    ``griddepcontrol``) lets a kernel launched with the attribute start while the previous kernel in the stream
    is still running, once every CTA of that kernel has executed ``griddepcontrol.launch_dependents`` (or exited);
    ``griddepcontrol.wait`` then blocks until the previous grid has completed and its memory writes are visible.
    Inside a CUDA graph the launch becomes a programmatic edge. Here every kernel launched so waits at its very
    top, before any load, store or atomic, and releases its own dependents right after (``USE_GDC``): only the
    launch and the CTAs' start-up overlap the previous kernel's tail, at most one grid waits ahead, and because
    every such kernel waits before touching memory, completion stays transitive along the stream (a kernel
    that is launched plainly waits for the whole previous grid, as always).

    True when :data:`PDL` is on, :func:`edgevlm.runtime.kernels.pdl.allowed` (sm_90+, ``EDGEVLM_PDL`` and the row
    limit), Triton does not run in its CPU interpreter (``TRITON_INTERPRET``) and the installed Triton has
    ``gdc_wait`` (>= 3.4; one warning where it has not). False otherwise; never raises for a CPU device."""
    from edgevlm.runtime.kernels import pdl

    if not PDL or interpreter_mode() or not pdl.allowed(device, rows):
        return False
    if not _triton_has_gdc():
        _warn_no_gdc()
        return False
    return True


@functools.cache
def _warn_no_gdc() -> None:
    logger.warning("this Triton lacks programmatic dependent launch (gdc_wait, Triton >= 3.4): the decode kernels "
                   "are launched plainly")


PDL_KERNELS: frozenset[str] | None = None
"""Under :data:`PDL`, the kernels launched as programmatic dependents, by name (``add_rms_norm``, ``rope_kv``,
``silu_mul``, ``attn_split``, ``attn_combine``, ``rope_attn``); None: all of them. A knob for benchmarks that look
for the kernel a difference comes from (``bench/decode_pdl_check.py``); read at each launch."""


def _gdc_launch(use: bool, kernel: str) -> dict:
    """Launch keywords of ``kernel`` (a name of :data:`PDL_KERNELS`): ``USE_GDC`` (the kernel's wait / release at
    its top) and Triton's ``launch_pdl`` (the launch attribute) together, never one without the other.
    ``launch_pdl`` is left out when False so that a Triton without that option (< 3.4, which refuses unknown
    launch keywords) still launches."""
    use = use and (PDL_KERNELS is None or kernel in PDL_KERNELS)
    return {"USE_GDC": True, "launch_pdl": True} if use else {"USE_GDC": False}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, wd_ptr, s_ptr, y_ptr, D, eps, d_eps, BLOCK_D: tl.constexpr,
                            UNIT_OFFSET: tl.constexpr, DELTA_NORM: tl.constexpr, USE_GDC: tl.constexpr = False):
        if USE_GDC:  # programmatic dependent launch (pdl_ok): the previous grid done before any memory access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        if DELTA_NORM:  # Gemma's post-attention / post-feedforward norm of delta, rounded as the unfused norm
            rstd_d = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / D + d_eps)
            wd = tl.load(wd_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                wd = 1.0 + wd
            d = (d * rstd_d * wd).to(s_ptr.dtype.element_ty).to(tl.float32)
        s = (x + d).to(s_ptr.dtype.element_ty)  # the residual stream, rounded as the unfused add
        tl.store(s_ptr + row * D + offs, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:  # Gemma: weights stored as an offset from 1
            w = 1.0 + w
        tl.store(y_ptr + row * D + offs, (sf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, rpos_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, ks_ptr,
                       vs_ptr, H, HKV, S, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                       UNIT_OFFSET: tl.constexpr, KV_FP8: tl.constexpr, USE_GDC: tl.constexpr = False):
        if USE_GDC:  # programmatic dependent launch (pdl_ok): the previous grid done before any memory access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        head = tl.program_id(1)  # 0..H-1: q heads, H..H+HKV-1: k heads, then v heads
        n_all = H + 2 * HKV
        pos = tl.load(pos_ptr + b)  # cache slot
        offs = tl.arange(0, HALF)
        src = qkv_ptr + (b * n_all + head) * HEAD_DIM
        o1 = tl.load(src + offs).to(tl.float32)  # (Dh/2,) first half
        o2 = tl.load(src + HALF + offs).to(tl.float32)  # second half
        if head < H + HKV:  # q and k: (norm +) RoPE; v as it is
            x1 = o1
            x2 = o2
            if QK_NORM:  # per-head RMSNorm (Qwen3), rounded to the activation dtype as the unfused norm
                rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
                w_ptr = qw_ptr if head < H else kw_ptr
                w1 = tl.load(w_ptr + offs).to(tl.float32)
                w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
                if UNIT_OFFSET:  # Gemma 3's q/k norms: x / rms(x) * (1 + w)
                    w1 = 1.0 + w1
                    w2 = 1.0 + w2
                x1 = (x1 * rstd * w1).to(q_ptr.dtype.element_ty).to(tl.float32)
                x2 = (x2 * rstd * w2).to(q_ptr.dtype.element_ty).to(tl.float32)
            rpos = tl.load(rpos_ptr + b)  # RoPE position (slot + M-RoPE offset)
            c = tl.load(cos_ptr + rpos * HEAD_DIM + offs).to(tl.float32)  # cos[j] == cos[j + Dh/2]
            s = tl.load(sin_ptr + rpos * HEAD_DIM + offs).to(tl.float32)
            o1 = x1 * c - x2 * s
            o2 = x2 * c + x1 * s
        if head < H:
            dst = q_ptr + (b * H + head) * HEAD_DIM
            tl.store(dst + offs, o1.to(q_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, o2.to(q_ptr.dtype.element_ty))
        else:
            kv_ptr = k_ptr
            s_ptr = ks_ptr
            if head >= H + HKV:
                kv_ptr = v_ptr
                s_ptr = vs_ptr
            row = (b * HKV + (head - H) % HKV).to(tl.int64) * S + pos  # (row, KV head, slot)
            if KV_FP8:  # Fp8KVCache._store's rule on the vector rounded to the activation dtype
                z = tl.join(o1.to(q_ptr.dtype.element_ty).to(tl.float32),
                            o2.to(q_ptr.dtype.element_ty).to(tl.float32))  # (Dh/2, 2): [:, 0] first half
                idx = tl.join(offs, offs + HALF)
                amax = tl.max(tl.max(tl.abs(z), axis=1), axis=0)
                # IEEE-rounded divisions (Triton's "/" is approximate on CUDA), scale >= 2**-14, rounded to fp16
                sc = tl.maximum(tl.math.div_rn(amax, 448.0), 6.103515625e-05).to(tl.float16)
                z = tl.math.div_rn(z, tl.zeros([HALF, 2], tl.float32) + sc.to(tl.float32))
                z = tl.minimum(tl.maximum(z, -448.0), 448.0)
                # fp32 -> e4m3 (OCP FP8: bias 7, 3 mantissa bits, no inf), round to nearest even, by bits
                bits = z.to(tl.int32, bitcast=True)
                sign = (bits >> 24) & 128
                mag = bits & 0x7FFFFFFF
                ex = (mag >> 23) - 127  # unbiased fp32 exponent
                man = mag & 0x7FFFFF
                kept = man >> 20  # the 3 mantissa bits kept; the 20 dropped decide the rounding
                rest = man & 0xFFFFF
                up = ((rest > 0x80000) | ((rest == 0x80000) & ((kept & 1) == 1))).to(tl.int32)
                normal = ((ex + 7) << 3) + kept + up  # a carry into the exponent is the right code
                t = mag.to(tl.float32, bitcast=True) * 512.0  # |z| / 2**-9, exact: subnormals are k * 2**-9
                fl = tl.floor(t)
                odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
                tie_up = ((t - fl) > 0.5) | (((t - fl) == 0.5) & odd)
                sub = (fl + tl.where(tie_up, 1.0, 0.0)).to(tl.int32)  # 8 = 2**-6, the first normal's code
                code = (tl.where(ex >= -6, normal, sub) | sign).to(tl.uint8)
                tl.store(kv_ptr + row * HEAD_DIM + idx, code)
                tl.store(s_ptr + row, sc)
            else:
                tl.store(kv_ptr + row * HEAD_DIM + offs, o1.to(kv_ptr.dtype.element_ty))
                tl.store(kv_ptr + row * HEAD_DIM + HALF + offs, o2.to(kv_ptr.dtype.element_ty))

    @triton.jit
    def silu_mul_kernel(gu_ptr, y_ptr, INTER, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr,
                        INTERLEAVED: tl.constexpr = False, USE_GDC: tl.constexpr = False):
        if USE_GDC:  # programmatic dependent launch (pdl_ok): the previous grid done before any memory access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < INTER
        if INTERLEAVED:  # int4_format.gated_row_order: 16-column tiles of 8 gate then their 8 up channels
            g_offs = (offs // 8) * 16 + offs % 8
            u_offs = g_offs + 8
        else:
            g_offs = offs
            u_offs = INTER + offs
        g = tl.load(gu_ptr + row * 2 * INTER + g_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * INTER + u_offs, mask=mask, other=0.0).to(tl.float32)
        if GELU_TANH:  # 0.5 g (1 + tanh(z)) == g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            y = g / (1.0 + tl.exp(-2.0 * z)) * u
        else:
            y = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + row * INTER + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def attn_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, y_ptr, H, HKV, S, CHUNK,
                          scale, WINDOW, REP: tl.constexpr, REP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, USE_GDC: tl.constexpr = False):
        if USE_GDC:  # programmatic dependent launch (pdl_ok): the previous grid done before any memory access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bg = tl.program_id(0)  # row b, KV head g
        split = tl.program_id(1)
        b = bg // HKV
        g = bg % HKV
        n_keys = tl.load(pos_ptr + b) + 1  # keys 0..pos (decode_mask's rule)
        rows = tl.arange(0, REP_PAD)
        d = tl.arange(0, HEAD_DIM)
        head = g * REP + rows  # the query heads sharing KV head g
        q = tl.load(q_ptr + (b * H + head)[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < REP, other=0.0)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        den = tl.zeros([REP_PAD], tl.float32)  # softmax denominator
        acc = tl.zeros([REP_PAD, HEAD_DIM], tl.float32)
        srow = (b * HKV + g).to(tl.int64) * S  # (row, KV head)'s first position: scales (B, HKV, S, 1)
        base = srow * HEAD_DIM
        start = split * CHUNK
        stop = tl.minimum(start + CHUNK, n_keys)
        if HAS_WINDOW:  # sliding window: keys pos - WINDOW < k <= pos (sliding_decode_mask's rule)
            start = tl.maximum(start, n_keys - WINDOW)
        # fp8: the key / value scales of the next block, loaded one block ahead. Triton's software pipeline streams
        # the k / v tiles ahead (cp.async, num_stages) but not these small loads: loaded in the block that uses
        # them, each block waited two memory round trips (the compiled sm_90 code: k / v async copies, the scale
        # loads synchronous in the loop), and the fp8 kernel ran at the bf16 kernel's time with half its bytes.
        ks_next = tl.zeros([BLOCK_N], tl.float32)
        vs_next = tl.zeros([BLOCK_N], tl.float32)
        if KV_FP8:
            first = start + tl.arange(0, BLOCK_N)
            ks_next = tl.load(ks_ptr + srow + first, mask=first < stop, other=0.0).to(tl.float32)
            vs_next = tl.load(vs_ptr + srow + first, mask=first < stop, other=0.0).to(tl.float32)
        for lo in range(start, stop, BLOCK_N):
            keys = lo + tl.arange(0, BLOCK_N)
            valid = keys < stop
            k = tl.load(k_ptr + base + keys[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
            # fp8: e4m3 values are exact in q's dtype; each key's scale multiplies its score. (Products in fp16
            # instead of bf16, one conversion per two values instead of three, measured no faster on the H200,
            # 2026-12-02: 82.6 vs 79.4 us at batch 32 of the 7B shape.)
            if KV_FP8:
                ks, vs = ks_next, vs_next
                ahead = keys + BLOCK_N
                ks_next = tl.load(ks_ptr + srow + ahead, mask=ahead < stop, other=0.0).to(tl.float32)
                vs_next = tl.load(vs_ptr + srow + ahead, mask=ahead < stop, other=0.0).to(tl.float32)
                if FP8_NATIVE:  # the hardware conversion (sm_89+)
                    k = k.to(q.dtype)
                else:  # the byte's sign | exponent | mantissa moved into fp16's fields = value * 2**-8, exact
                    k = k.to(tl.uint16)
                    k = (((k & 128) << 8) | ((k & 127) << 7)).to(tl.float16, bitcast=True).to(q.dtype)
                    ks = ks * 256.0
                sc = tl.dot(q, tl.trans(k)) * (ks * scale)[None, :]  # (REP_PAD, BLOCK_N) fp32
            else:
                sc = tl.dot(q, tl.trans(k)) * scale  # (REP_PAD, BLOCK_N) fp32
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + base + keys[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
            if KV_FP8:  # each value's scale multiplies its probability: sum_s (p_s scale_s) v8_s
                if FP8_NATIVE:
                    v = v.to(q.dtype)
                else:
                    v = v.to(tl.uint16)
                    v = (((v & 128) << 8) | ((v & 127) << 7)).to(tl.float16, bitcast=True).to(q.dtype)
                    vs = vs * 256.0
                acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        keep = rows < REP
        if NSPLIT == 1:  # this CTA saw every key of its rows: the output, no partials, no combine
            y = acc / den[:, None]
            tl.store(y_ptr + (b * H + head)[:, None] * HEAD_DIM + d[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=keep[:, None])
        else:
            out = (b * H + head) * NSPLIT + split  # partials (B * H, NSPLIT, ...)
            tl.store(o_ptr + out[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])
            tl.store(m_ptr + out, m, mask=keep)
            tl.store(l_ptr + out, den, mask=keep)

    @triton.jit
    def attn_combine_kernel(o_ptr, m_ptr, l_ptr, y_ptr, HEAD_DIM: tl.constexpr, NSPLIT: tl.constexpr,
                            USE_GDC: tl.constexpr = False):
        if USE_GDC:  # programmatic dependent launch (pdl_ok): the previous grid done before any memory access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        sp = tl.arange(0, NSPLIT)
        d = tl.arange(0, HEAD_DIM)
        m = tl.load(m_ptr + bh * NSPLIT + sp)  # (NSPLIT,); -inf for a split without keys
        den = tl.load(l_ptr + bh * NSPLIT + sp)
        m_all = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
        o = tl.load(o_ptr + (bh * NSPLIT + sp)[:, None] * HEAD_DIM + d[None, :])
        y = tl.sum(o * w[:, None], 0) / tl.sum(den * w, 0)
        tl.store(y_ptr + bh * HEAD_DIM + d, y.to(y_ptr.dtype.element_ty))

    @triton.jit
    def rope_attn_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, rpos_ptr, qw_ptr, kw_ptr, k_ptr, v_ptr, o_ptr, m_ptr,
                         l_ptr, cnt_ptr, y_ptr, H, HKV, S, CHUNK, scale, eps,
                         REP: tl.constexpr, REP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, QK_NORM: tl.constexpr,
                         UNIT_OFFSET: tl.constexpr, COMBINE: tl.constexpr = True, USE_GDC: tl.constexpr = False):
        if USE_GDC:  # programmatic dependent launch (pdl_ok): the previous grid done before any memory access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bg = tl.program_id(0)  # row b, KV head g
        split = tl.program_id(1)
        b = bg // HKV
        g = bg % HKV
        pos = tl.load(pos_ptr + b)  # cache slot of the fresh token; keys 0..pos are attended
        rpos = tl.load(rpos_ptr + b)  # its RoPE position
        rows = tl.arange(0, REP_PAD)
        keep = rows < REP
        head = g * REP + rows  # the query heads sharing KV head g
        d = tl.arange(0, HEAD_DIM)
        partner = (d + HALF) % HEAD_DIM  # half-rotation: x[d] pairs with x[d +- Dh/2]
        first = d < HALF
        src = qkv_ptr + b * (H + 2 * HKV) * HEAD_DIM
        qx = tl.load(src + head[:, None] * HEAD_DIM + d[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
        qp = tl.load(src + head[:, None] * HEAD_DIM + partner[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
        kx = tl.load(src + (H + g) * HEAD_DIM + d).to(tl.float32)
        kp = tl.load(src + (H + g) * HEAD_DIM + partner).to(tl.float32)
        if QK_NORM:  # per-head RMSNorm before RoPE (Qwen3, Gemma 3), rounded as the unfused norm
            wq = tl.load(qw_ptr + d).to(tl.float32)
            wqp = tl.load(qw_ptr + partner).to(tl.float32)
            wk = tl.load(kw_ptr + d).to(tl.float32)
            wkp = tl.load(kw_ptr + partner).to(tl.float32)
            if UNIT_OFFSET:
                wq = 1.0 + wq
                wqp = 1.0 + wqp
                wk = 1.0 + wk
                wkp = 1.0 + wkp
            rq = 1.0 / tl.sqrt(tl.sum(qx * qx, axis=1) / HEAD_DIM + eps)  # (REP_PAD,)
            qx = (qx * rq[:, None] * wq[None, :]).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            qp = (qp * rq[:, None] * wqp[None, :]).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            rk = 1.0 / tl.sqrt(tl.sum(kx * kx, axis=0) / HEAD_DIM + eps)
            kx = (kx * rk * wk).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            kp = (kp * rk * wkp).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_ptr + rpos * HEAD_DIM + d % HALF).to(tl.float32)  # cos[j] == cos[j + Dh/2], as rope_kv
        sn = tl.load(sin_ptr + rpos * HEAD_DIM + d % HALF).to(tl.float32)
        # first half: x1 c - x2 s; second half: x2 c + x1 s
        q = (qx * c[None, :] + tl.where(first, -qp, qp) * sn[None, :]).to(qkv_ptr.dtype.element_ty)
        kf = (kx * c + tl.where(first, -kp, kp) * sn).to(k_ptr.dtype.element_ty)  # the fresh key, as cached
        vf = tl.load(src + (H + HKV + g) * HEAD_DIM + d).to(v_ptr.dtype.element_ty)
        base = (b * HKV + g).to(tl.int64) * S * HEAD_DIM
        start = split * CHUNK
        if (pos >= start) & (pos < start + CHUNK):  # the one CTA of this head whose keys hold the slot
            tl.store(k_ptr + base + pos * HEAD_DIM + d, kf)
            tl.store(v_ptr + base + pos * HEAD_DIM + d, vf)
        stop = tl.minimum(start + CHUNK, pos + 1)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        den = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, HEAD_DIM], tl.float32)
        for lo in range(start, stop, BLOCK_N):
            keys = lo + tl.arange(0, BLOCK_N)
            valid = keys < stop
            fresh = keys == pos  # the slot's row comes from registers, never from the cache
            k = tl.load(k_ptr + base + keys[:, None] * HEAD_DIM + d[None, :], mask=(valid & ~fresh)[:, None],
                        other=0.0)
            k = tl.where(fresh[:, None], kf[None, :], k)
            sc = tl.dot(q, tl.trans(k)) * scale  # (REP_PAD, BLOCK_N) fp32
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + base + keys[:, None] * HEAD_DIM + d[None, :], mask=(valid & ~fresh)[:, None],
                        other=0.0)
            v = tl.where(fresh[:, None], vf[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        if NSPLIT == 1:  # one CTA per head saw every key: no partials, no counter
            tl.store(y_ptr + (b * H + head)[:, None] * HEAD_DIM + d[None, :],
                     (acc / tl.where(keep, den, 1.0)[:, None]).to(y_ptr.dtype.element_ty), mask=keep[:, None])
            return
        part = (b * H + head) * NSPLIT  # partials (B * H, NSPLIT, ...)
        tl.store(o_ptr + (part + split)[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])
        tl.store(m_ptr + part + split, m, mask=keep)
        tl.store(l_ptr + part + split, den, mask=keep)
        if not COMBINE:  # attn_combine_kernel, launched after this kernel, combines the partials
            return
        # every thread's partials issued before one thread's release of the counter (the barrier orders them
        # before it at CTA scope; the gpu-scope acq_rel atomic makes them visible with it, as CUTLASS's
        # semaphore does after __syncthreads)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + bg, 1, sem="acq_rel")  # splits of this head finished before this one
        if done == NSPLIT - 1:  # the last one combines (the others' partials read past L1)
            sp = tl.arange(0, NSPLIT)
            ms = tl.load(m_ptr + part[:, None] + sp[None, :], mask=keep[:, None], other=float("-inf"),
                         cache_modifier=".cg")  # (REP_PAD, NSPLIT); -inf for a split without keys
            ls = tl.load(l_ptr + part[:, None] + sp[None, :], mask=keep[:, None], other=0.0, cache_modifier=".cg")
            m_all = tl.max(ms, 1)
            w = tl.where(ms > float("-inf"), tl.exp(ms - m_all[:, None]), 0.0)
            total = tl.where(keep, tl.sum(ls * w, 1), 1.0)
            y = tl.zeros([REP_PAD, HEAD_DIM], tl.float32)
            for i in tl.static_range(NSPLIT):
                wi = tl.sum(tl.where(sp[None, :] == i, w, 0.0), 1)  # (REP_PAD,) weight of split i
                oi = tl.load(o_ptr + (part + i)[:, None] * HEAD_DIM + d[None, :], mask=keep[:, None], other=0.0,
                             cache_modifier=".cg")
                y += oi * wi[:, None]
            y = y / total[:, None]
            tl.store(y_ptr + (b * H + head)[:, None] * HEAD_DIM + d[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=keep[:, None])
            tl.atomic_xchg(cnt_ptr + bg, 0)  # ready for the next launch (and graph replay)

    return add_rms_norm_kernel, rope_kv_kernel, silu_mul_kernel, attn_split_kernel, attn_combine_kernel, \
        rope_attn_kernel


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 unit_offset: bool = False, delta_weight: torch.Tensor | None = None,
                 delta_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` and ``rms_norm(s) * weight`` for ``x``/``delta`` ``(R, D)`` (same dtype,
    contiguous), ``weight (D,)``: returns ``(s, normed)``, both ``(R, D)`` in ``x.dtype``.

    ``unit_offset`` (Gemma): every norm weight ``w`` acts as ``1 + w`` (transformers'
    ``Gemma3RMSNorm``). ``delta_weight (D,)`` (Gemma's sandwich norms): ``delta`` is first
    normalised with it (eps ``delta_eps``, default ``eps``) and rounded to ``x.dtype``, as the
    unfused ``post_attention_layernorm`` / ``post_feedforward_layernorm``, so one kernel does
    norm + residual add + the next norm. Statistics and products in fp32.
    Raises ``ValueError`` for mismatched shapes."""
    if x.dim() != 2 or x.shape != delta.shape or weight.shape != (x.shape[1],) \
            or (delta_weight is not None and delta_weight.shape != (x.shape[1],)):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta {tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)} do not match")
    x, delta = x.contiguous(), delta.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    kernel = _kernels()[0]
    d = x.shape[1]
    kernel[(x.shape[0],)](x, delta, weight, weight if delta_weight is None else delta_weight, s, y, d, float(eps),
                          float(eps if delta_eps is None else delta_eps), BLOCK_D=_next_pow2(d),
                          UNIT_OFFSET=bool(unit_offset), DELTA_NORM=delta_weight is not None,
                          num_warps=add_rms_norm_warps(d), **_gdc_launch(pdl_ok(x.device, x.shape[0]), "add_rms_norm"))
    return s, y


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv_heads: int, *,
                  rope_pos: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  unit_offset: bool = False, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-step (q/k RMSNorm +) RoPE + KV-cache write.

    ``qkv (B, (H + 2 Hkv) * Dh)`` — the fused q/k/v projection of one token per row; ``cos``/``sin``
    ``(P, Dh)`` the RoPE tables (``P`` positions); ``input_pos (B,)`` int64 each row's cache slot;
    ``k_cache``/``v_cache`` ``(B_max, Hkv, S, Dh)`` contiguous (rows ``0..B-1`` are written at
    ``input_pos``). ``rope_pos (B,)`` int64: the RoPE position of each row when it is not the slot
    (multimodal RoPE decode: slot + ``rope_delta``; None = ``input_pos``), below ``P``.
    ``q_norm``/``k_norm`` ``(Dh,)``: Qwen3's per-head RMSNorm of q and k before RoPE (eps
    ``norm_eps``; both or neither); ``unit_offset``: their weights act as ``1 + w`` (Gemma 3's
    q/k norms). Sliding-window layers with their own RoPE base (Gemma 3) pass their own tables.

    FP8 caches (:class:`~edgevlm.runtime.kv_cache.Fp8KVCache`): ``k_cache``/``v_cache`` ``float8_e4m3fn``
    with ``k_scale``/``v_scale`` fp16 ``(B_max, Hkv, S, 1)``; each (row, head) key and value vector, rounded to
    ``qkv.dtype`` as the unfused layer stores it, is quantized in the same kernel by ``Fp8KVCache._store``'s
    rule: ``scale = fp16(max(amax / 448, 2**-14))``, ``code = e4m3(clamp(x / scale, -448, 448))`` (OCP 8-bit
    floating point specification (OFP8) rev. 1.0, 2023: E4M3, bias 7, max 448, no infinities), IEEE-rounded
    division and round-to-nearest-even, so the bytes and scales equal ``_store``'s bit for bit (the
    conversion is done on the bits, the same on every GPU and in Triton's interpreter).

    Returns the rotated queries ``(B, H, 1, Dh)`` in ``qkv.dtype``.
    Raises ``ValueError`` for mismatched shapes, an odd / non-power-of-two head dimension, a cache dtype
    other than 16/32-bit float or ``float8_e4m3fn``, an fp8 cache without both fp16 scales of shape
    ``(B_max, Hkv, S, 1)``, or scales given with a 16/32-bit cache."""
    b = qkv.shape[0]
    hkv, s, dh = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if hkv != n_kv_heads or qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * hkv) * dh:
        raise ValueError(f"rope_kv_write: qkv {tuple(qkv.shape)} does not match {n_heads} + 2 x {hkv} heads of {dh}")
    if dh % 2 or dh & (dh - 1) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_kv_write needs a power-of-two head_dim and contiguous caches")
    if cos.dim() != 2 or cos.shape[1] != dh or sin.shape != cos.shape or cos.shape[0] < s \
            or input_pos.shape != (b,):
        raise ValueError("rope_kv_write: cos/sin must be (P >= S, Dh) and input_pos (B,)")
    if rope_pos is not None and rope_pos.shape != (b,):
        raise ValueError(f"rope_kv_write: rope_pos must be (B,) = ({b},), got {tuple(rope_pos.shape)}")
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and (q_norm.shape != (dh,) or k_norm.shape != (dh,))):
        raise ValueError("rope_kv_write: q_norm and k_norm must both be (Dh,) or both None")
    fp8 = _kv_kind("rope_kv_write", k_cache, v_cache, k_scale, v_scale) == "fp8"
    qkv = qkv.contiguous()
    q = torch.empty(b, n_heads, 1, dh, dtype=qkv.dtype, device=qkv.device)
    kernel = _kernels()[1]
    qk_norm = q_norm is not None
    if fp8:  # the kernel stores the e4m3 codes it computes as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    kernel[(b, n_heads + 2 * hkv)](qkv, cos, sin, input_pos, input_pos if rope_pos is None else rope_pos,
                                   q_norm if qk_norm else cos, k_norm if qk_norm else cos, q, k_cache, v_cache,
                                   k_scale if fp8 else cos, v_scale if fp8 else cos,
                                   n_heads, hkv, s, float(norm_eps), HEAD_DIM=dh, HALF=dh // 2, QK_NORM=qk_norm,
                                   UNIT_OFFSET=bool(unit_offset), KV_FP8=fp8, num_warps=1,
                                   **_gdc_launch(pdl_ok(qkv.device, b), "rope_kv"))
    return q


def _kv_kind(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None) -> str:
    """``"fp8"`` for ``float8_e4m3fn`` caches with their fp16 ``(B_max, Hkv, S, 1)`` scales, ``"16bit"`` for
    16/32-bit float caches without scales. Raises ``ValueError`` (prefixed with ``name``) otherwise."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if k_cache.dtype == fp8 and v_cache.dtype == fp8:
        want = (*k_cache.shape[:3], 1)
        for label, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or sc.dtype != torch.float16 or tuple(sc.shape) != want or not sc.is_contiguous() \
                    or sc.device != k_cache.device:
                got = "None" if sc is None else f"{sc.dtype} {tuple(sc.shape)}"
                raise ValueError(f"{name}: a float8_e4m3fn cache needs {label} as contiguous float16 {want} on its "
                                 f"device (Fp8KVCache's layout), got {got}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"{name}: k/v caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)} differ")
        return "fp8"
    if k_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: caches must both be float16/bfloat16/float32 or both float8_e4m3fn, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"{name}: k_scale/v_scale belong to a float8_e4m3fn cache, not {k_cache.dtype}")
    return "16bit"


#: activations :func:`gated_act` fuses (transformers' ``ACT2FN`` names)
GATED_ACTS = ("silu", "gelu_pytorch_tanh", "gelu_new")


def gated_act_code(act: str, where: str = "gated_act") -> int:
    """The code every gated-MLP backend (the W4A16 kernel's epilogue, the act(gate) * up Triton kernel) takes for
    ``act``: 0 SiLU (SwiGLU), 1 the tanh-approximated GELU (GeGLU; Gemma's ``gelu_pytorch_tanh`` and
    ``gelu_new`` are the same function). Raises ``ValueError`` naming ``where`` for an activation not in
    :data:`GATED_ACTS`."""
    if act not in GATED_ACTS:
        raise ValueError(f"{where}: activation {act!r} is not one of {', '.join(GATED_ACTS)}")
    return 0 if act == "silu" else 1


def gated_act(gate_up: torch.Tensor, act: str = "silu", *, interleaved: bool = False) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up (R, 2 I)`` = ``[gate | up]`` -> ``(R, I)`` in its dtype, ``act``
    one of :data:`GATED_ACTS`: SwiGLU's SiLU (Shazeer 2020) or GeGLU's tanh-approximated GELU
    (Hendrycks & Gimpel 2016, eq. of ``torch.nn.functional.gelu(approximate="tanh")``; Gemma), computed
    in fp32 as ``g * sigmoid(2 z)`` with ``z = sqrt(2/pi) (g + 0.044715 g^3)`` (= ``0.5 g (1 + tanh z)``).
    ``interleaved``: the columns are in :func:`~edgevlm.runtime.int4_format.gated_row_order` (per 16 columns, 8 gate
    channels then their up partners; what a gated W4A16 layer's plain launch returns), ``I`` a multiple of 8.
    Raises ``ValueError`` for an odd last dimension (not a multiple of 16 when interleaved) or another
    activation."""
    from edgevlm.runtime.int4_format import GATED_ROW_TILE

    if gate_up.dim() != 2 or gate_up.shape[1] % (GATED_ROW_TILE if interleaved else 2):
        raise ValueError(f"gated_act: expected (R, 2I){' with I % 8 == 0' if interleaved else ''}, "
                         f"got {tuple(gate_up.shape)}")
    code = gated_act_code(act)
    gate_up = gate_up.contiguous()
    r, inter = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(r, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _kernels()[2][(r, -(-inter // block))](gate_up, y, inter, BLOCK=block, GELU_TANH=code == 1,
                                           INTERLEAVED=interleaved, num_warps=4,
                                           **_gdc_launch(pdl_ok(gate_up.device, gate_up.shape[0]), "silu_mul"))
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up (R, 2 I)`` = ``[gate | up]`` -> ``(R, I)`` in its dtype
    (:func:`gated_act` with ``"silu"``). Raises ``ValueError`` for an odd last dimension."""
    return gated_act(gate_up, "silu")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of :func:`decode_attention`: keys per loop step (``block_n``, a power of two >= 16),
    warps and software-pipeline stages per CTA, and the CTAs per SM the split of the keys aims for
    (:func:`decode_attention`'s schedule)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3  # Triton's CUDA default, what every launch used before it was a parameter
    ctas_per_sm: int = 4


ATTENTION_CONFIGS: dict[str, tuple[tuple[int, AttentionConfig], ...]] = {
    "16bit": ((1 << 30, AttentionConfig()),),
    "fp8": ((1 << 30, AttentionConfig()),),
}
""":func:`decode_attention`'s defaults per cache kind (``"16bit"``, ``"fp8"``): ``(max batch, config)`` pairs in
increasing batch, the first whose max batch is >= the step's batch applies. One config for every batch until
``bench/decode_attention_tune.py`` on the target GPU says otherwise (it prints the table to paste here)."""


def attention_config(kind: str, batch: int) -> AttentionConfig:
    """The :data:`ATTENTION_CONFIGS` entry of cache kind ``kind`` for ``batch`` rows (the last entry past them all).
    Raises ``ValueError`` for an unknown kind."""
    if kind not in ATTENTION_CONFIGS:
        raise ValueError(f"attention_config: kind must be one of {', '.join(ATTENTION_CONFIGS)}, got {kind!r}")
    rule = ATTENTION_CONFIGS[kind]
    return next((cfg for top, cfg in rule if batch <= top), rule[-1][1])


def attention_splits(batch: int, n_kv_heads: int, kv_len: int, block_n: int, max_splits: int, budget: int) -> int:
    """Key splits per (row, KV head) of :func:`decode_attention`: the key blocks rounded up to a power of two,
    at most ``max_splits``, halved while ``batch x n_kv_heads x splits`` exceeds ``budget`` CTAs."""
    nsplit = min(max_splits, _next_pow2(-(-kv_len // block_n)))
    while nsplit > 1 and batch * n_kv_heads * nsplit > budget:
        nsplit //= 2
    return nsplit


def fp8_native(device: torch.device) -> bool:
    """Whether :func:`decode_attention` converts e4m3 with the hardware instruction (:data:`FP8_NATIVE`; None:
    CUDA devices of compute capability >= 8.9, whose Triton has ``float8e4nv``) rather than on the bits."""
    if FP8_NATIVE is not None:
        return bool(FP8_NATIVE)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
                     kv_len: int, block_n: int | None = None, max_splits: int = 16, *, scale: float | None = None,
                     window: int | None = None, cta_budget: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """One-token grouped-query attention over the static KV cache, split over the keys
    (flash-decoding: Dao et al., "Flash-Decoding for long-context inference", 2023; online softmax,
    Milakov & Gimelshein 2018) and combined in a second kernel.

    Splits (:func:`attention_splits`): the ``kv_len / block_n`` key blocks over up to ``max_splits`` CTAs per
    (row, KV head), halved while ``B x Hkv x splits`` exceeds ``cta_budget`` (None: :data:`ATTENTION_CTA_BUDGET`,
    else the config's ``ctas_per_sm`` x the SMs, about one wave): a batch with enough (row, head) pairs to fill
    the GPU gains nothing from splitting the keys and pays per CTA (its query load, its partials, the combine).
    One split writes the output itself, without the combine kernel (batch 32 of a 7B's 32 KV heads; batch 1
    keeps 16 splits). ``block_n``, ``num_warps``, ``num_stages`` and the CTAs per SM default to
    :func:`attention_config` of the cache kind and batch (:data:`ATTENTION_CONFIGS`).

    ``q`` ``(B, H, 1, Dh)`` contiguous; ``k_cache``/``v_cache`` ``(B_max, Hkv, S, Dh)`` contiguous, either of
    ``q``'s dtype or ``float8_e4m3fn`` with ``k_scale``/``v_scale`` fp16 ``(B_max, Hkv, S, 1)`` (the layout of
    :class:`~edgevlm.runtime.kv_cache.Fp8KVCache`: value = e4m3 code x scale). FP8 keys and values are read as
    bytes and never dequantized into memory: each e4m3 value is exact in ``q``'s dtype (OCP OFP8 E4M3: 4
    significant bits, 2**-9..448), the dot products run on them, and each key's scale multiplies its score and
    each value's scale its probability (``q.k_s = scale_s (q . k8_s)``, ``sum_s p_s v_s = sum_s (p_s scale_s)
    v8_s``); conversion by the hardware on sm_89+ (:func:`fp8_native`), else on the bits. Row ``b`` attends to
    its keys ``0..input_pos[b]`` (``input_pos (B,)`` int64, the rule of
    :func:`~edgevlm.runtime.kv_cache.decode_mask`), never past ``kv_len`` (static: the splits cover
    ``[0, kv_len)``, so one CUDA graph serves every position below it). Query head ``h`` reads KV head
    ``h // (H / Hkv)``, as transformers' ``repeat_kv``. Score scale ``scale`` (None: ``Dh ** -0.5``; Gemma 3:
    ``query_pre_attn_scalar ** -0.5``), fp32 softmax and accumulation. ``window`` (Gemma 3's sliding layers over
    a full-length cache): only keys ``input_pos[b] - window < k <= input_pos[b]`` count
    (:func:`~edgevlm.runtime.decoder.sliding_decode_mask`); None = all. Returns ``(B, H, 1, Dh)`` in
    ``q.dtype``. Raises ``ValueError`` for mismatched shapes or dtypes, a head count not divisible by ``Hkv``, a
    non-power-of-two ``Dh`` or ``block_n``, a window < 1, an fp8 cache without its scales (or scales with a
    16-bit cache)."""
    b, h, t, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if t != 1 or k_cache.shape != v_cache.shape or k_cache.shape[3] != dh or k_cache.shape[0] < b \
            or h % hkv or input_pos.shape != (b,) or not 1 <= kv_len <= s:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"input_pos {tuple(input_pos.shape)}, kv_len {kv_len} do not match")
    kind = _kv_kind("decode_attention", k_cache, v_cache, k_scale, v_scale)
    if dh & (dh - 1) or dh < 16 or (kind == "16bit" and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype)) \
            or not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention needs contiguous q/k/v of one dtype (or float8_e4m3fn k/v) and a "
                         "power-of-two head_dim >= 16")
    if window is not None and window < 1:
        raise ValueError(f"decode_attention: window must be >= 1, got {window}")
    cfg = attention_config(kind, b)
    block_n = cfg.block_n if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode_attention: block_n must be a power of two >= 16, got {block_n}")
    rep = h // hkv
    budget = cta_budget if cta_budget is not None else ATTENTION_CTA_BUDGET or cfg.ctas_per_sm * _sm_count(q.device)
    nsplit = attention_splits(b, hkv, kv_len, block_n, max_splits, budget)
    n_blocks = -(-kv_len // block_n)
    chunk = block_n * -(-n_blocks // nsplit)
    y = torch.empty_like(q)
    rows = b * h if nsplit > 1 else 1  # one split: the kernel writes y; the partials are not read
    part = torch.empty(rows, nsplit, dh, dtype=torch.float32, device=q.device)
    m = torch.empty(rows, nsplit, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    split_k = _kernels()[3]
    use_pdl = pdl_ok(q.device, b)
    fp8 = kind == "fp8"
    native = fp8 and fp8_native(q.device)
    if fp8 and not native:  # the kernel decodes the bytes itself
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    split_k[(b * hkv, nsplit)](q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, input_pos, part,
                               m, lse, y, h, hkv, s, chunk, dh ** -0.5 if scale is None else float(scale), window or 0,
                               REP=rep, REP_PAD=max(16, _next_pow2(rep)), HEAD_DIM=dh, BLOCK_N=block_n,
                               NSPLIT=nsplit, HAS_WINDOW=window is not None, KV_FP8=fp8, FP8_NATIVE=native,
                               num_warps=cfg.num_warps if num_warps is None else num_warps,
                               num_stages=cfg.num_stages if num_stages is None else num_stages,
                               **_gdc_launch(use_pdl, "attn_split"))
    if nsplit > 1:
        _combine_splits(part, m, lse, y, use_pdl)
    return y


def _combine_splits(part: torch.Tensor, m: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, use_pdl: bool) -> None:
    """The combine kernel over the key splits' partials ``part (B * H, NSPLIT, Dh)`` fp32, running maxima ``m`` and
    denominators ``lse`` ``(B * H, NSPLIT)`` into ``y (B, H, 1, Dh)``: one CTA per (row, query head)."""
    _kernels()[4][(part.shape[0],)](part, m, lse, y, HEAD_DIM=part.shape[2], NSPLIT=part.shape[1], num_warps=1,
                                    **_gdc_launch(use_pdl, "attn_combine"))


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# every counter buffer ever handed out stays allocated: a CUDA graph captured with a smaller one keeps its
# address (freeing it when a larger batch needs more counters made those graphs' replays write freed memory)
_COUNTERS_KEPT: list[torch.Tensor] = []


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """``(>= n,)`` int32 zeros, one per (row, KV head) of :func:`rope_decode_attention`: every launch leaves
    them at zero again (the last CTA of a head resets its own), so one buffer per device serves every
    layer, launch and CUDA-graph replay of one stream. Allocated outside a capture where possible (the
    CUDA-graph warm-up runs first)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
        _COUNTERS_KEPT.append(buf)
    return buf


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 (an H200's) off CUDA."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cta_budget(device: torch.device) -> int:
    """CTAs :func:`decode_attention` and :func:`rope_decode_attention` aim for at most (about four per SM:
    one wave at their occupancy); their splits of the keys are halved until ``rows x KV heads x splits``
    fits (each split costs a CTA's set-up, partials and their combine; in the one-kernel form also a wait
    for the partials to land and a counter, a cost paid per wave). 528 (an H200's 132 SMs) off CUDA."""
    return 4 * _sm_count(device)


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv_heads: int, kv_len: int,
                          *, rope_pos: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                          k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6, unit_offset: bool = False,
                          scale: float | None = None, block_n: int = 64, max_splits: int = 16,
                          combine: bool | None = None) -> torch.Tensor:
    """:func:`rope_kv_write` then :func:`decode_attention`, in one kernel: the decode step's attention
    from the fused q/k/v projection.

    ``qkv (B, (H + 2 Hkv) * Dh)`` one token per row; ``cos``/``sin`` ``(P, Dh)`` RoPE tables;
    ``input_pos (B,)`` int64 each row's cache slot, which receives the rotated key and the value, and the
    last key the row attends to (keys ``0..input_pos[b]``, never past ``kv_len``); ``k_cache``/``v_cache``
    ``(B_max, Hkv, S, Dh)`` contiguous, ``qkv``'s dtype. ``rope_pos (B,)`` int64: RoPE positions when
    they are not the slots (M-RoPE decode; None = ``input_pos``); ``q_norm``/``k_norm`` ``(Dh,)``:
    per-head RMSNorm before RoPE (eps ``norm_eps``, ``unit_offset``: weights act as ``1 + w``);
    ``scale``: score scale (None: ``Dh ** -0.5``). The keys are split as :func:`decode_attention` splits them
    (``block_n``, up to ``max_splits``), halved while ``B x Hkv x splits`` exceeds :func:`_cta_budget`; one
    split writes the output directly. ``combine`` (None: :data:`FUSED_ATTENTION_COMBINE`): True, the last CTA of each
    head to finish combines the splits (an atomic counter per head; one kernel); False, :func:`decode_attention`'s
    combine kernel runs after it (two kernels, no counter). No sliding window and no rolling cache (those keep the
    two-kernel path). Returns ``(B, H, 1, Dh)`` in ``qkv.dtype``; the same function as the two kernels
    (queries and keys rounded to the activation dtype as they store them; the splits' combine sums in
    another order: equal to fp32 rounding). Raises ``ValueError`` as those two do."""
    b = qkv.shape[0]
    hkv, s, dh = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if hkv != n_kv_heads or qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * hkv) * dh or n_heads % hkv:
        raise ValueError(f"rope_decode_attention: qkv {tuple(qkv.shape)} does not match {n_heads} + 2 x {hkv} "
                         f"heads of {dh}")
    if dh % 2 or dh & (dh - 1) or dh < 16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()) \
            or k_cache.shape != v_cache.shape or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError("rope_decode_attention needs a power-of-two head_dim >= 16 and contiguous caches of "
                         "qkv's dtype")
    if cos.dim() != 2 or cos.shape[1] != dh or sin.shape != cos.shape or cos.shape[0] < s \
            or input_pos.shape != (b,) or k_cache.shape[0] < b or not 1 <= kv_len <= s:
        raise ValueError("rope_decode_attention: cos/sin must be (P >= S, Dh), input_pos (B,), 1 <= kv_len <= S")
    if rope_pos is not None and rope_pos.shape != (b,):
        raise ValueError(f"rope_decode_attention: rope_pos must be (B,) = ({b},), got {tuple(rope_pos.shape)}")
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and (q_norm.shape != (dh,) or k_norm.shape != (dh,))):
        raise ValueError("rope_decode_attention: q_norm and k_norm must both be (Dh,) or both None")
    qkv = qkv.contiguous()
    rep = n_heads // hkv
    n_blocks = -(-kv_len // block_n)
    nsplit = attention_splits(b, hkv, kv_len, block_n, max_splits, _cta_budget(qkv.device))
    chunk = block_n * -(-n_blocks // nsplit)
    part = torch.empty(b * n_heads, nsplit, dh, dtype=torch.float32, device=qkv.device)
    m = torch.empty(b * n_heads, nsplit, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(b * n_heads, nsplit, dtype=torch.float32, device=qkv.device)
    y = torch.empty(b, n_heads, 1, dh, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm is not None
    combine = FUSED_ATTENTION_COMBINE if combine is None else bool(combine)
    use_pdl = pdl_ok(qkv.device, b)
    _kernels()[5][(b * hkv, nsplit)](
        qkv, cos, sin, input_pos, input_pos if rope_pos is None else rope_pos, q_norm if qk_norm else cos,
        k_norm if qk_norm else cos, k_cache, v_cache, part, m, lse, _counters(b * hkv, qkv.device), y,
        n_heads, hkv, s, chunk, dh ** -0.5 if scale is None else float(scale), float(norm_eps),
        REP=rep, REP_PAD=max(16, _next_pow2(rep)), HEAD_DIM=dh, HALF=dh // 2, BLOCK_N=block_n, NSPLIT=nsplit,
        QK_NORM=qk_norm, UNIT_OFFSET=bool(unit_offset), COMBINE=combine, num_warps=4,
        **_gdc_launch(use_pdl, "rope_attn"))
    if nsplit > 1 and not combine:
        _combine_splits(part, m, lse, y, use_pdl)
    return y
