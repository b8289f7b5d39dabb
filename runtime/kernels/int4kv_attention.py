"""Decode attention straight from the INT4 KV cache (split-KV "flash-decoding", one Triton kernel).

The plain path of :class:`~edgevlm.runtime.kv_cache.Int4KVCache` dequantizes the attended keys and
values into 16-bit tensors every decode step and then runs SDPA: it reads 4-bit codes but writes
and re-reads twice the bytes of a 16-bit cache, so INT4 KV made decode *slower* than bf16 KV
(7B shape on an H200: 8.99 vs 2.91 ms per token). This kernel reads the codes, scales and zeros
once and never materialises 16-bit keys or values:

* grid ``(B, H, n_splits)``: one program per (row, query head, slice of the cache), the slices
  combined afterwards — the split-KV scheme of Flash-Decoding (Dao et al., "Flash-Decoding for
  long-context inference", 2023), so a batch-1 step still fills the GPU;
* within a slice, blocks of ``BLOCK_S`` positions with the online softmax of FlashAttention
  (Dao et al., NeurIPS 2022, algorithm 1; running max and sum in fp32);
* keys and values never dequantized element by element: with ``x = code * scale + zero`` per
  group of ``group_size`` channels (the layout of :func:`~edgevlm.runtime.kv_cache.quantize_kv_int4`:
  low nibble = even channel), ``q.k = sum_g scale_g (q_g . codes_g) + zero_g sum(q_g)`` and
  ``sum_s p_s v_s = sum_s (p_s scale_s) codes_s + sum_s p_s zero_s`` per group, so the inner
  products run on the raw codes (the query split into even and odd channels to match);
* causal validity from each row's position (key position ``<= pos[b]``, what
  :func:`~edgevlm.runtime.kv_cache.decode_mask` allows; with a ``window``, also ``> pos[b] -
  window``, Gemma 3's sliding layers), so no mask tensor is read; grouped-query attention by
  mapping query head ``h`` to KV head ``h // (H / Hkv)``; the score scale is a parameter (default
  ``head_dim ** -0.5``; Gemma 3: ``query_pre_attn_scalar ** -0.5``).

The decode-step *write* is fused too (:func:`int4kv_write`): the new token's keys and values are
quantized and stored (codes, scale, zero) by one kernel per layer instead of about twenty small
torch kernels, with exactly the arithmetic of ``quantize_kv_int4`` (round half to even).

Statistics in fp32; the result is rounded once to the query's dtype. ``TRITON_INTERPRET=1`` runs
it on the CPU (fp32/fp16) for the tests. Used by :class:`edgevlm.runtime.decoder.Attention` for
decode steps on CUDA with an INT4 cache.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int4kv_decode_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, pos_ptr,
                             acc_ptr, m_ptr, l_ptr,
                             H, REP, N_SPLITS, S, CHUNK, sm_scale, WINDOW,
                             sc_b, sc_h, sc_s, ss_b, ss_h, ss_s,
                             GROUPS: tl.constexpr, PAIRS: tl.constexpr, BLOCK_S: tl.constexpr,
                             HAS_WINDOW: tl.constexpr):
        # Codes as (positions, groups, channel pairs); per group the scale/zero factor out of the
        # sums: q.k = sum_g scale_g * (sum_p q . code) + zero_g * (sum_p q), so the inner products
        # run on the raw 4-bit codes and each position's scales/zeros are loaded once per group.
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        hk = h // REP
        pos = tl.load(pos_ptr + b)
        gi = tl.arange(0, GROUPS)
        j = gi[:, None] * PAIRS + tl.arange(0, PAIRS)[None, :]  # (G, P) channel-pair index
        q_base = q_ptr + (b * H + h) * (2 * GROUPS * PAIRS)
        q_even = tl.load(q_base + 2 * j).to(tl.float32) * sm_scale  # (G, P)
        q_odd = tl.load(q_base + 2 * j + 1).to(tl.float32) * sm_scale
        q_sum = tl.sum(q_even + q_odd, axis=1)  # (G,)
        m_i = tl.full((), -1.0e30, tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc_e = tl.zeros((GROUPS, PAIRS), tl.float32)
        acc_o = tl.zeros((GROUPS, PAIRS), tl.float32)
        acc_z = tl.zeros((GROUPS,), tl.float32)  # sum_s p_s * zero_v[s, g]
        start = split * CHUNK
        kc_row = kc_ptr + b * sc_b + hk * sc_h
        vc_row = vc_ptr + b * sc_b + hk * sc_h
        s_off = b * ss_b + hk * ss_h
        for s0 in range(start, start + CHUNK, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)  # (BS,)
            live = (s < S) & (s <= pos)
            if HAS_WINDOW:  # sliding window: pos - WINDOW < s (sliding_decode_mask's rule)
                live = live & (s > pos - WINDOW)
            l3 = live[:, None, None]
            l2 = live[:, None]
            c_off = s[:, None, None] * sc_s + j[None, :, :]  # (BS, G, P)
            g_off = s_off + s[:, None] * ss_s + gi[None, :]  # (BS, G)
            kc = tl.load(kc_row + c_off, mask=l3, other=0).to(tl.int32)
            ksc = tl.load(ks_ptr + g_off, mask=l2, other=0.0).to(tl.float32)
            kz = tl.load(kz_ptr + g_off, mask=l2, other=0.0).to(tl.float32)
            vc = tl.load(vc_row + c_off, mask=l3, other=0).to(tl.int32)
            vsc = tl.load(vs_ptr + g_off, mask=l2, other=0.0).to(tl.float32)
            vz = tl.load(vz_ptr + g_off, mask=l2, other=0.0).to(tl.float32)
            dots = tl.sum((kc & 15).to(tl.float32) * q_even[None] + (kc >> 4).to(tl.float32) * q_odd[None],
                          axis=2)  # (BS, G)
            score = tl.sum(ksc * dots + kz * q_sum[None, :], axis=1)  # (BS,)
            score = tl.where(live, score, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(score, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(live, tl.exp(score - m_new), 0.0)  # (BS,)
            w = (p[:, None] * vsc)[:, :, None]  # (BS, G, 1): p_s * scale_v[s, g]
            acc_e = acc_e * alpha + tl.sum(w * (vc & 15).to(tl.float32), axis=0)
            acc_o = acc_o * alpha + tl.sum(w * (vc >> 4).to(tl.float32), axis=0)
            acc_z = acc_z * alpha + tl.sum(p[:, None] * vz, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        part = (b * H + h) * N_SPLITS + split
        out = acc_ptr + part * (2 * GROUPS * PAIRS)
        tl.store(out + 2 * j, acc_e + acc_z[:, None])
        tl.store(out + 2 * j + 1, acc_o + acc_z[:, None])
        tl.store(m_ptr + part, m_i)
        tl.store(l_ptr + part, l_i)

    @triton.jit
    def int4kv_write_kernel(k_ptr, v_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, pos_ptr, rows_ptr, HKV,
                            sc_b, sc_h, sc_s, ss_b, ss_h, ss_s,
                            HALF: tl.constexpr, GROUPS: tl.constexpr, PAIRS: tl.constexpr):
        b = tl.program_id(0)
        hh = tl.program_id(1)  # 0..HKV-1: keys, HKV..2HKV-1: values
        kind = hh // HKV
        h = hh % HKV
        pos = tl.load(pos_ptr + b)
        row = tl.load(rows_ptr + b)
        gi = tl.arange(0, GROUPS)[:, None]  # (G, 1)
        pj = tl.arange(0, PAIRS)[None, :]  # (1, P): channel pairs within a group
        j = gi * PAIRS + pj  # (G, P) pair index
        off = (b * HKV + h) * (2 * HALF)
        if kind == 0:
            xe = tl.load(k_ptr + off + 2 * j).to(tl.float32)  # (G, P) even channels
            xo = tl.load(k_ptr + off + 2 * j + 1).to(tl.float32)
        else:
            xe = tl.load(v_ptr + off + 2 * j).to(tl.float32)
            xo = tl.load(v_ptr + off + 2 * j + 1).to(tl.float32)
        lo = tl.min(tl.minimum(xe, xo), axis=1)  # (G,)
        hi = tl.max(tl.maximum(xe, xo), axis=1)
        zero = lo.to(tl.float16)
        zf = zero.to(tl.float32)
        # IEEE-rounded divisions (div_rn; Triton's "/" is approximate on CUDA) so that codes, scales
        # and zeros equal quantize_kv_int4's bit for bit
        scale = tl.maximum(tl.math.div_rn(hi - zf, tl.full((GROUPS,), 15.0, tl.float32)),
                           6.103515625e-05).to(tl.float16)  # clamp at 2**-14, as quantize_kv_int4
        sf = scale.to(tl.float32)
        ye = tl.math.div_rn(xe - zf[:, None], tl.broadcast_to(sf[:, None], (GROUPS, PAIRS)))
        yo = tl.math.div_rn(xo - zf[:, None], tl.broadcast_to(sf[:, None], (GROUPS, PAIRS)))
        re = tl.floor(ye + 0.5)  # round half to even, as torch.round
        re = tl.where(((re - ye) == 0.5) & ((re % 2) != 0), re - 1.0, re)
        ro = tl.floor(yo + 0.5)
        ro = tl.where(((ro - yo) == 0.5) & ((ro % 2) != 0), ro - 1.0, ro)
        qe = tl.minimum(tl.maximum(re, 0.0), 15.0).to(tl.int32)
        qo = tl.minimum(tl.maximum(ro, 0.0), 15.0).to(tl.int32)
        packed = (qe | (qo << 4)).to(tl.uint8)
        cdst = row * sc_b + h * sc_h + pos * sc_s + j
        sdst = row * ss_b + h * ss_h + pos * ss_s + tl.arange(0, GROUPS)
        if kind == 0:
            tl.store(kc_ptr + cdst, packed)
            tl.store(ks_ptr + sdst, scale)
            tl.store(kz_ptr + sdst, zero)
        else:
            tl.store(vc_ptr + cdst, packed)
            tl.store(vs_ptr + sdst, scale)
            tl.store(vz_ptr + sdst, zero)

    return int4kv_decode_kernel, int4kv_write_kernel


def code_tiles(head_dim: int, group_size: int) -> tuple[int, int] | None:
    """``(groups, channel pairs per group)`` the kernels tile a head into, or None when either is
    not a power of two (Triton block shapes must be; the cache then keeps the torch path)."""
    groups, pairs = head_dim // group_size, group_size // 2
    return None if groups & (groups - 1) or pairs & (pairs - 1) else (groups, pairs)


def _tiles_or_raise(head_dim: int, group_size: int) -> tuple[int, int]:
    tiles = code_tiles(head_dim, group_size)
    if tiles is None:
        raise ValueError(f"head_dim {head_dim} / group_size {group_size} must give groups and pairs in powers of two")
    return tiles


def n_splits_for(batch: int, n_heads: int, kv_len: int, block_s: int, target_programs: int = 264) -> int:
    """Cache slices per (row, head): enough programs to fill about ``target_programs`` (2x the SMs
    of an H100/H200), at least one block of positions each."""
    blocks = max(1, math.ceil(kv_len / block_s))
    return max(1, min(blocks, math.ceil(target_programs / max(1, batch * n_heads))))


def int4kv_decode_attention(q: torch.Tensor, cache, pos: torch.Tensor, kv_len: int, *,
                            block_s: int = 64, n_splits: int | None = None, num_warps: int = 1,
                            scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of one new token per row over an :class:`~edgevlm.runtime.kv_cache.Int4KVCache`.

    Args:
        q: ``(B, H, 1, Dh)`` queries (RoPE applied), fp32/fp16/bf16, on the cache's device.
        cache: the layer's INT4 cache (rows ``0..B-1`` are attended).
        pos: ``(B,)`` int position of each row's new token: keys at positions ``<= pos[b]`` count.
        kv_len: attended positions ``[0, kv_len)`` (a static bucket: CUDA-graph friendly).
        block_s, num_warps: positions per loop step and warps per program; the defaults (64, 1)
            were the fastest overall of 16/32/64 x 1/2/4/8 on an H200 over 7B and GQA shapes at
            batch 1 and 8, 1024 and 4096 positions (``bench/gpu_int4kv.py``).
        n_splits: cache slices per (row, head); default :func:`n_splits_for`.
        scale: the attention score scale; None = ``Dh ** -0.5`` (SDPA's default; Gemma 3 passes
            ``query_pre_attn_scalar ** -0.5``).
        window: a sliding window (Gemma 3's sliding layers over a full-length cache): only keys
            ``pos[b] - window < s <= pos[b]`` count (:func:`~edgevlm.runtime.decoder.sliding_decode_mask`);
            None = every key up to ``pos[b]``.
    Returns:
        ``(B, H, 1, Dh)`` in ``q.dtype``; equal (up to fp32 summation order) to dequantizing the
        cache and running SDPA (with ``scale``) under :func:`~edgevlm.runtime.kv_cache.decode_mask`
        (with ``window``: under :func:`~edgevlm.runtime.decoder.sliding_decode_mask`).
    Raises:
        ValueError: shapes that do not match the cache, ``H`` not a multiple of the KV heads, a
            ``block_s`` that is not a power of two, ``kv_len`` outside ``1..max_seq_len``, a
            ``window`` below 1 or a ``scale`` that is not positive.
    """
    b, h, t, dh = q.shape
    bmax, hkv, smax, half = cache.k.shape
    if t != 1 or 2 * half != dh or b > bmax or h % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match an INT4 KV cache of {tuple(cache.k.shape)} codes "
                         "(one token per row, head_dim = 2 x code bytes, heads a multiple of the KV heads)")
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two >= 16, got {block_s}")
    if not 1 <= kv_len <= smax:
        raise ValueError(f"kv_len must be in 1..{smax}, got {kv_len}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    groups, pairs = _tiles_or_raise(dh, cache.group_size)
    if tuple(pos.shape) != (b,):
        raise ValueError(f"pos must be ({b},), got {tuple(pos.shape)}")
    splits = n_splits or n_splits_for(b, h, kv_len, block_s)
    chunk = math.ceil(math.ceil(kv_len / splits) / block_s) * block_s
    splits = math.ceil(kv_len / chunk)
    q = q.contiguous()
    acc = torch.empty(b, h, splits, dh, dtype=torch.float32, device=q.device)
    m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    for name in ("k", "v"):
        if getattr(cache, name).stride(-1) != 1 or getattr(cache, name + "_scale").stride(-1) != 1:
            raise ValueError("INT4 KV cache buffers must be contiguous in the last dimension")
    if cache.k_scale.stride() != cache.v_scale.stride() or cache.k.stride() != cache.v.stride():
        raise ValueError("INT4 KV cache: key and value buffers must share strides")
    _kernel()[0][(b, h, splits)](
        q, cache.k, cache.k_scale, cache.k_zero, cache.v, cache.v_scale, cache.v_zero,
        pos.to(torch.int32).contiguous(), acc, m, lsum,
        h, h // hkv, splits, kv_len, chunk, 1.0 / math.sqrt(dh) if scale is None else float(scale), window or 0,
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.k_scale.stride(0), cache.k_scale.stride(1), cache.k_scale.stride(2),
        GROUPS=groups, PAIRS=pairs, BLOCK_S=block_s, HAS_WINDOW=window is not None, num_warps=num_warps,
    )
    w = torch.exp(m - m.amax(dim=-1, keepdim=True))  # (B, H, splits): rescale each slice's partials
    out = (acc * w[..., None]).sum(dim=2) / (lsum * w).sum(dim=-1, keepdim=True).clamp_min(1e-30)  # (B, H, Dh)
    return out[:, :, None].to(q.dtype)  # (B, H, 1, Dh)


def int4kv_write(cache, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
    """Quantize and store one decode token per row into an INT4 KV cache (what
    :meth:`~edgevlm.runtime.kv_cache.KVCache.write` does for ``T = 1``, in one kernel).

    Args:
        k, v: ``(B, Hkv, 1, Dh)`` the new keys/values.
        input_pos: ``(1,)`` position shared by all rows, or ``(B, 1)`` per row.
        rows: ``(B,)`` cache rows (None = ``0..B-1``).
    Raises:
        ValueError: shapes that do not match the cache, a head_dim / group_size split that is not
            in powers of two, or key/value buffers that are not laid out alike.
    """
    b, hkv, t, dh = k.shape
    bmax, chkv, _, half = cache.k.shape
    if t != 1 or v.shape != k.shape or chkv != hkv or 2 * half != dh or b > bmax:
        raise ValueError(f"k/v {tuple(k.shape)} do not match an INT4 KV cache of {tuple(cache.k.shape)} codes "
                         "(one token per row)")
    groups, pairs = _tiles_or_raise(dh, cache.group_size)
    if cache.k.stride() != cache.v.stride() or cache.k_scale.stride() != cache.v_scale.stride() \
            or cache.k_zero.stride() != cache.k_scale.stride() or cache.v_zero.stride() != cache.v_scale.stride():
        raise ValueError("INT4 KV cache: key and value buffers must be laid out alike")
    pos = (input_pos.reshape(-1).expand(b) if input_pos.dim() == 1 else input_pos[:, 0]).to(torch.int32).contiguous()
    r = (torch.arange(b, device=k.device) if rows is None else rows).to(torch.int32).contiguous()
    _kernel()[1][(b, 2 * hkv)](
        k.contiguous(), v.contiguous(), cache.k, cache.k_scale, cache.k_zero, cache.v, cache.v_scale, cache.v_zero,
        pos, r, hkv,
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.k_scale.stride(0), cache.k_scale.stride(1), cache.k_scale.stride(2),
        HALF=half, GROUPS=groups, PAIRS=pairs,
    )
