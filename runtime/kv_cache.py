"""Preallocated, static-shape KV caches in three precisions (gpt-fast style layout).

Each decoder layer owns one cache holding keys and values for ``max_batch_size`` rows ("slots") of
``max_seq_len`` positions, laid out ``(B, n_kv_heads, max_seq_len, head_dim)`` and allocated once.
Prefill writes positions ``[0, T)`` of some rows; decode writes one position per row and then
attends over the first ``kv_len`` positions with a mask (:func:`decode_mask`). ``kv_len`` is a
Python int (a length bucket), so every decode step of a bucket sees tensors of identical shape —
the property a CUDA graph capture needs (:mod:`edgevlm.runtime.cuda_graphs`).

Precisions (``kv_cache_dtype``, the profile key of the same name):

* ``"bf16"``/``"fp16"``/``"fp32"`` (:class:`KVCache`): plain tensors; :meth:`KVCache.read` returns views.
* ``"int4"`` (:class:`Int4KVCache`): per (row, head, position), ``head_dim`` is cut into groups of
  ``group_size`` channels; each group is stored as 4-bit codes with an fp16 ``scale`` and fp16
  ``zero`` (the group minimum), ``x ~= q * scale + zero`` — asymmetric per-token group-wise
  quantization as in KIVI's value cache (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
  Quantization for KV Cache", 2024) and FlexGen (Sheng et al., 2023). Codes are packed two per
  byte, low nibble = even channel (the layout of :mod:`edgevlm.runtime.int4`). On CUDA a decode
  step writes the new token with one Triton kernel and attends straight from the codes
  (:mod:`edgevlm.runtime.kernels.int4kv_attention`); otherwise the attended positions are
  dequantized right before attention, in the compute dtype.
* ``"fp8_e4m3"`` (:class:`Fp8KVCache`): ``float8_e4m3fn`` values (OCP FP8 spec; max 448) with one
  fp16 scale per (row, head, position) = ``amax / 448``. The fused CUDA decode step quantizes the new
  token inside its RoPE + KV-write kernel (bit-identical to :meth:`Fp8KVCache._store`) and attends straight
  from the e4m3 bytes (:mod:`edgevlm.runtime.kernels.decode_fused`); otherwise the attended positions are
  dequantized right before attention.

Buffers start as zeros (codes and scales) and are never NaN/Inf, so masked-out (stale or unused)
slots contribute exactly 0 to attention.

Rolling (ring) caches, any precision (``ring=True``; Gemma 3's sliding-window layers): the cache
holds ``W = max_seq_len`` slots and position ``p`` lives in slot ``p % W`` (the rolling buffer of
Mistral 7B, Jiang et al. 2023, sec. 2). Keys are stored already rotated (RoPE at their own position),
and attention does not depend on the order of the keys, so a decode query at position ``p`` attends to
slots ``j <= p`` of the first ``min(kv_len, W)``: :func:`decode_mask` over the slots, exactly the keys
``p - W < k <= p`` (slot ``j`` holds position ``p - ((p - j) mod W)``; slots ``j > p`` are not written
yet). A multi-token write is a prefill from position 0: only the last ``W`` positions of each row
(``lengths``, for right-padded batches) are stored, gathered into their slots (static shapes, no host
sync; the prefill's own attention runs over the fresh keys). Shapes never depend on the position, so
CUDA-graph decode captures as before.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("bf16", "fp16", "fp32", "int4", "fp8_e4m3")
_FLOAT_KV = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_E4M3_MAX = 448.0
DEFAULT_INT4_GROUP_SIZE = 64


class KVCache(nn.Module):
    """One layer's 16-/32-bit key/value cache, ``k``/``v`` ``(B, n_kv_heads, max_seq_len, head_dim)``."""

    kv_cache_dtype = "16-bit"

    def __init__(self, max_batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, ring: bool = False) -> None:
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.ring = ring  # rolling buffer: position p in slot p % max_seq_len (see the module docstring)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    @property
    def max_batch_size(self) -> int:
        return self.k.shape[0]

    def _store(self, input_pos: torch.Tensor, rows: torch.Tensor | None, name: str, x: torch.Tensor) -> None:
        _scatter(getattr(self, name), input_pos, rows, x.to(getattr(self, name).dtype))

    def write(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """Store ``k``/``v`` ``(B, n_kv_heads, T, head_dim)``.

        ``input_pos``: ``(T,)`` int64 positions shared by all rows, or ``(B, T)`` per row.
        ``rows``: ``(B,)`` int64 cache rows to write (None = rows ``0..B-1``).
        ``lengths``: ``(B,)`` int64 real tokens per row of a right-padded prefill; read by ring
        caches only (None = ``T``). Raises ``ValueError`` for a ring-cache write that is neither one
        token per row nor a prefill with shared positions (see :meth:`ring_layout`).
        """
        if self.ring:
            input_pos, k, v = self.ring_layout(input_pos, k, v, lengths)
        self._store(input_pos, rows, "k", k)
        self._store(input_pos, rows, "v", v)

    def ring_layout(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions -> slots of a ring cache of ``W = max_seq_len`` slots: ``(slots, k, v)`` to store.

        One token per row (``T = 1``, decode): slot ``input_pos % W``. A prefill (``T > 1``; ``input_pos``
        ``(T,)`` = ``0..T-1``): each row's slot ``j`` gets position ``last - ((last - j) mod W)`` with
        ``last = lengths[b] - 1`` (None: ``T - 1``), i.e. the last ``W`` real positions; slots with no
        position yet (``j > last``) get position 0's values, masked until a decode step writes them.
        Returns ``(W,)`` slots and ``k``/``v`` gathered to ``(B, n_kv_heads, W, head_dim)``.
        Raises ``ValueError`` for per-row positions with ``T > 1`` (a continuation prefill, which a
        rolling buffer cannot hold: its queries need keys it would overwrite)."""
        w = self.max_seq_len
        b, hkv, t, dh = k.shape
        if t == 1:
            return input_pos % w, k, v
        if input_pos.dim() != 1:
            raise ValueError("a ring KV cache takes one token per row or a prefill from position 0 "
                             f"with shared positions (T,), got input_pos {tuple(input_pos.shape)}")
        last = torch.full((b,), t - 1, device=k.device) if lengths is None else (lengths.to(k.device) - 1)  # (B,)
        slots = torch.arange(w, device=k.device)
        src = (last[:, None] - (last[:, None] - slots) % w).clamp(0, t - 1)  # (B, W) position held by slot j
        idx = src[:, None, :, None].expand(b, hkv, w, dh)
        return slots, k.gather(2, idx), v.gather(2, idx)

    def read(self, batch: int, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows ``0..batch-1``, positions ``[0, kv_len)``:
        ``(batch, n_kv_heads, kv_len, head_dim)`` each, in ``dtype`` (views when it matches)."""
        return self.k[:batch, :, :kv_len].to(dtype), self.v[:batch, :, :kv_len].to(dtype)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write at ``input_pos`` (rows ``0..B-1``) and return the whole buffers of those rows."""
        self.write(input_pos, k, v)
        return self.read(k.shape[0], self.max_seq_len, k.dtype)

    def bytes_per_token(self) -> int:
        """Bytes one position of one row takes (keys + values, all heads)."""
        per_row = sum(b.numel() * b.element_size() for b in self.buffers()) // self.max_batch_size
        return per_row // self.max_seq_len

    def reset(self) -> None:
        """Zero the buffers (not needed between requests: positions past the prompt are masked)."""
        for b in self.buffers():
            b.zero_()


def _scatter(buf: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor | None, x: torch.Tensor) -> None:
    """``buf[row, :, pos] = x[:, :, t]`` for ``buf (B, H, S, ...)`` and ``x (B, H, T, ...)``; no host sync."""
    b = x.shape[0]
    if input_pos.dim() == 1 and rows is None:
        buf[:b].index_copy_(2, input_pos, x)
        return
    t = x.shape[2]
    r = torch.arange(b, device=buf.device) if rows is None else rows
    pos = input_pos.expand(b, t) if input_pos.dim() == 1 else input_pos  # (B, T)
    # advanced indices on dims 0 and 2 -> the indexed view is (B, T, H, ...)
    buf[r[:, None], :, pos] = x.transpose(1, 2)


class Int4KVCache(KVCache):
    """INT4 group-wise KV cache: codes ``uint8 (B, H, S, head_dim/2)``, ``scale``/``zero`` fp16
    ``(B, H, S, head_dim/group_size)`` for keys and for values (see the module docstring)."""

    kv_cache_dtype = "int4"

    def __init__(self, max_batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, group_size: int = DEFAULT_INT4_GROUP_SIZE,
                 ring: bool = False) -> None:
        nn.Module.__init__(self)
        self.ring = ring
        group_size = min(group_size, head_dim)
        if head_dim % 2 or head_dim % group_size:
            raise ValueError(f"int4 KV cache: head_dim={head_dim} must be even and a multiple of group_size={group_size}")
        self.group_size = group_size
        base = (max_batch_size, n_kv_heads, max_seq_len)
        groups = head_dim // group_size
        for name in ("k", "v"):
            self.register_buffer(name, torch.zeros(*base, head_dim // 2, dtype=torch.uint8, device=device),
                                 persistent=False)
            self.register_buffer(name + "_scale", torch.zeros(*base, groups, dtype=torch.float16, device=device),
                                 persistent=False)
            self.register_buffer(name + "_zero", torch.zeros(*base, groups, dtype=torch.float16, device=device),
                                 persistent=False)

    def write(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """As :meth:`KVCache.write`; a CUDA decode step (T = 1) quantizes and stores keys and values
        in one Triton kernel (:func:`edgevlm.runtime.kernels.int4kv_attention.int4kv_write`, the
        same arithmetic), other writes with :func:`quantize_kv_int4`."""
        if self.ring:
            input_pos, k, v = self.ring_layout(input_pos, k, v, lengths)
        if k.is_cuda and k.shape[2] == 1 and self._fused_write_ok(k.shape[-1]):
            from edgevlm.runtime.kernels.int4kv_attention import int4kv_write

            int4kv_write(self, input_pos, k, v, rows)
            return
        self._store(input_pos, rows, "k", k)
        self._store(input_pos, rows, "v", v)

    def _fused_write_ok(self, head_dim: int) -> bool:
        from edgevlm.runtime.kernels import triton_available
        from edgevlm.runtime.kernels.int4kv_attention import code_tiles

        return triton_available() and code_tiles(head_dim, self.group_size) is not None

    def _store(self, input_pos, rows, name, x) -> None:
        codes, scale, zero = quantize_kv_int4(x, self.group_size)
        _scatter(getattr(self, name), input_pos, rows, codes)
        _scatter(getattr(self, name + "_scale"), input_pos, rows, scale)
        _scatter(getattr(self, name + "_zero"), input_pos, rows, zero)

    def read(self, batch: int, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for name in ("k", "v"):
            codes = getattr(self, name)[:batch, :, :kv_len]
            scale = getattr(self, name + "_scale")[:batch, :, :kv_len]
            zero = getattr(self, name + "_zero")[:batch, :, :kv_len]
            out.append(dequantize_kv_int4(codes, scale, zero, self.group_size, dtype))
        return out[0], out[1]


def quantize_kv_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x (..., D)`` -> codes ``uint8 (..., D/2)``, ``scale``/``zero`` fp16 ``(..., D/group_size)``.

    ``scale = (max - min) / 15`` per group (fp16, at least 2**-14 so constant groups stay finite),
    ``zero = min``, ``q = clamp(round((x - zero) / scale), 0, 15)``."""
    *lead, d = x.shape
    g = x.float().reshape(*lead, d // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # (..., G)
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / 15.0).clamp(min=2.0**-14).to(torch.float16)
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(*lead, d)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale, zero


def dequantize_kv_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_int4`: ``(..., D/2)`` codes -> ``(..., D)`` in ``dtype``."""
    *lead, half = codes.shape
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*lead, -1, group_size)  # (..., G, gs)
    x = q.to(dtype) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]
    return x.reshape(*lead, 2 * half)


class Fp8KVCache(KVCache):
    """FP8 e4m3 KV cache: ``float8_e4m3fn (B, H, S, head_dim)`` plus an fp16 scale ``(B, H, S)``."""

    kv_cache_dtype = "fp8_e4m3"

    def __init__(self, max_batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, ring: bool = False) -> None:
        nn.Module.__init__(self)
        self.ring = ring
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"fp8_e4m3 KV cache needs torch >= 2.1 with float8 dtypes (this is {torch.__version__})")
        base = (max_batch_size, n_kv_heads, max_seq_len)
        for name in ("k", "v"):
            self.register_buffer(name, torch.zeros(*base, head_dim, dtype=torch.float8_e4m3fn, device=device),
                                 persistent=False)
            self.register_buffer(name + "_scale", torch.zeros(*base, 1, dtype=torch.float16, device=device),
                                 persistent=False)

    def _store(self, input_pos, rows, name, x) -> None:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=2.0**-14).to(torch.float16)
        values = (xf / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        # scatter the bytes: index_copy_ has no float8 kernel on CPU
        _scatter(getattr(self, name).view(torch.uint8), input_pos, rows, values.view(torch.uint8))
        _scatter(getattr(self, name + "_scale"), input_pos, rows, scale)

    def read(self, batch: int, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for name in ("k", "v"):
            values = getattr(self, name)[:batch, :, :kv_len]
            scale = getattr(self, name + "_scale")[:batch, :, :kv_len]
            out.append(values.to(dtype) * scale.to(dtype))
        return out[0], out[1]


def make_kv_cache(kv_cache_dtype: str | None, max_batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                  *, dtype: torch.dtype, device: torch.device | str,
                  int4_group_size: int = DEFAULT_INT4_GROUP_SIZE, ring: bool = False) -> KVCache:
    """A cache of precision ``kv_cache_dtype`` (one of :data:`KV_CACHE_DTYPES`; None = ``dtype``);
    ``ring``: a rolling buffer of ``max_seq_len`` slots (see the module docstring).

    Raises ``ValueError`` for an unknown precision or a head_dim the int4 layout cannot hold."""
    args = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
    if kv_cache_dtype is None:
        return KVCache(*args, dtype=dtype, device=device, ring=ring)
    if kv_cache_dtype in _FLOAT_KV:
        return KVCache(*args, dtype=_FLOAT_KV[kv_cache_dtype], device=device, ring=ring)
    if kv_cache_dtype == "int4":
        return Int4KVCache(*args, dtype=dtype, device=device, group_size=int4_group_size, ring=ring)
    if kv_cache_dtype == "fp8_e4m3":
        return Fp8KVCache(*args, dtype=dtype, device=device, ring=ring)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})")


def decode_mask(input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean attention mask over the first ``kv_len`` cache positions, True where the key position
    ``<=`` the query's: ``(1, 1, T, kv_len)`` for ``input_pos (T,)``, ``(B, 1, T, kv_len)`` for ``(B, T)``."""
    keys = torch.arange(kv_len, device=input_pos.device)  # (S,)
    if input_pos.dim() == 1:
        return (keys[None, :] <= input_pos[:, None])[None, None]  # (1, 1, T, S)
    return (keys[None, None, :] <= input_pos[:, :, None])[:, None]  # (B, 1, T, S)


def kv_bucket(n_positions: int, max_seq_len: int, min_bucket: int = 256) -> int:
    """Attended length for ``n_positions`` live positions: the next power of two ``>= min_bucket``,
    capped at ``max_seq_len`` (few buckets = few CUDA graphs; no reads of far-away empty slots)."""
    b = min_bucket
    while b < n_positions:
        b *= 2
    return min(b, max_seq_len)


def kv_bytes_per_token(kv_cache_dtype: str, n_layers: int, n_kv_heads: int, head_dim: int,
                       int4_group_size: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """KV cache bytes per token of one sequence, all layers (keys + values, scales included)."""
    if kv_cache_dtype in _FLOAT_KV:
        per_head = head_dim * torch.empty((), dtype=_FLOAT_KV[kv_cache_dtype]).element_size()
    elif kv_cache_dtype == "int4":
        g = min(int4_group_size, head_dim)
        per_head = head_dim // 2 + 2 * 2 * (head_dim // g)
    elif kv_cache_dtype == "fp8_e4m3":
        per_head = head_dim + 2
    else:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return 2 * n_layers * n_kv_heads * per_head


def cache_nbytes(n_layers: int, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype) -> int:
    """Bytes the 16-bit KV caches of ``n_layers`` layers take (k and v)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * batch * n_kv_heads * max_seq_len * head_dim * elem
