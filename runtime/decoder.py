"""Llama-family decoder with a static KV cache and a prefill/decode split (gpt-fast style).

Architecture: Touvron et al., "LLaMA" (2023) — RMSNorm (Zhang & Sennrich 2019), rotary position
embeddings (Su et al., "RoFormer", 2021; the half-rotation layout of transformers' Llama), SwiGLU
MLP (Shazeer 2020), grouped-query attention (Ainslie et al., "GQA", 2023). Numerics mirror
transformers' ``LlamaForCausalLM``: RMSNorm in float32 then cast back before the weight, RoPE
tables computed in float32 and cast to the activation dtype, scale ``head_dim ** -0.5``.
Parameter names follow transformers' Llama so checkpoints load by name.

Gemma 3 (Gemma Team, "Gemma 3 Technical Report", 2025) is the same decoder with configuration
switches (:class:`~edgevlm.runtime.config.TextConfig`; numerics of transformers' ``Gemma3TextModel``):
unit-offset RMSNorm in float32 (:class:`UnitOffsetNorm`), four norms per layer, embeddings scaled by
``sqrt(hidden_size)`` (:class:`ScaledEmbedding`), the ``query_pre_attn_scalar`` attention scale,
interleaved sliding-window / full layers with their own RoPE tables (the sliding layers' KV caches
rolling buffers of window slots, :mod:`edgevlm.runtime.kv_cache`), and bidirectional attention
within each image's tokens during prefill (``image_blocks``, see :meth:`Decoder.forward`).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.config import TextConfig
from edgevlm.runtime.kernels import kernels_usable
from edgevlm.runtime.kernels.int4kv_attention import int4kv_decode_attention
from edgevlm.runtime.kv_cache import (
    DEFAULT_INT4_GROUP_SIZE,
    Fp8KVCache,
    Int4KVCache,
    KVCache,
    decode_mask,
    make_kv_cache,
)
from edgevlm.runtime.vision import activation

logger = logging.getLogger(__name__)

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


@functools.cache
def sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5); checked once, on first use."""
    q = torch.zeros(1, 2, 1, 2)
    kv = torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype and _HAS_RMS_NORM:
            # one fused kernel on CUDA (aten::_fused_rms_norm, fp32 statistics) instead of eight
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class UnitOffsetNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (Gemma): ``x / rms(x) * (1 + w)``, the
    statistics and the product in float32, cast back to ``x``'s dtype at the end (transformers'
    ``Gemma3RMSNorm``; ``w`` starts at 0). ``(..., dim)`` -> same shape and dtype.

    Deliberately not named ``*RMSNorm``: AWQ folds its ``1 / s`` into modules of that name by
    dividing the weight (:func:`edgevlm.quantize.awq.find_scale_groups`), which for ``1 + w`` would
    be wrong; the linears behind this norm keep an explicit AWQ input scale instead."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(cfg: TextConfig, dim: int) -> nn.Module:
    """The decoder's RMSNorm over ``dim`` channels: :class:`UnitOffsetNorm` with
    ``cfg.norm_unit_offset`` (Gemma), else :class:`RMSNorm` (Llama)."""
    return UnitOffsetNorm(dim, cfg.rms_norm_eps) if cfg.norm_unit_offset else RMSNorm(dim, cfg.rms_norm_eps)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times ``scale`` (Gemma: ``sqrt(hidden_size)``), the scale rounded to the
    weights' dtype first, as transformers' ``Gemma3TextScaledWordEmbedding`` (a float32 scalar cast
    to the weight dtype: 50.5 in bfloat16 for ``sqrt(2560)``). ``(B, T)`` int64 -> ``(B, T, D)``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def scale_for(self, dtype: torch.dtype) -> float:
        """``scale`` rounded to float32 and then to ``dtype``, as a Python number (a kernel argument:
        no host-to-device copy, so CUDA graphs can capture the multiply)."""
        return float(torch.tensor(self.scale, dtype=torch.float32).to(dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale_for(self.weight.dtype)


def prefill_masks(t: int, image_blocks: torch.Tensor | None, sliding_window: int | None,
                  device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Boolean attention masks ``(B|1, 1, T, T)`` (True = attend) of a prefill from slot 0, for the
    full and the sliding-window layers; None where plain causal attention is exact.

    Rules of transformers' ``create_masks_for_vision_model`` (Gemma 3): full layers
    ``causal OR same_block``; sliding layers ``(causal OR same_block) AND q - k < sliding_window``,
    where ``same_block`` = query and key carry the same non-negative ``image_blocks`` id (``(B, T)``
    int64, -1 for text; None: no image)."""
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    allowed = k <= q  # (T, T)
    full = None
    if image_blocks is not None:
        ids = image_blocks.to(device)
        same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)  # (B, T, T)
        allowed = allowed | same
        full = allowed[:, None]  # (B, 1, T, T)
    sliding = None
    if sliding_window is not None and (image_blocks is not None or t > sliding_window):
        sliding = (allowed & (k > q - sliding_window)).reshape(-1, 1, t, t)  # (B|1, 1, T, T)
    return full, sliding


def add_at_mask(x: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, T, D)`` with ``feats`` ``(N, D)`` added at the True positions of ``mask`` ``(B, T)``
    bool in row-major order (the k-th True position gets ``feats[k]``, cast to ``x``'s dtype; rows of
    ``feats`` past the mask count are unused) -> a new ``(B, T, D)``: ``h[mask] += feats``.

    Without a host sync (a CUDA graph captures it): boolean indexing counts the mask on the host,
    so the rows are gathered by the mask's running count instead. The sums are those of
    ``index_put(..., accumulate=True)`` (one ``x + f`` rounding per position); other positions keep
    ``x`` exactly. A mask count above N reads ``feats[N - 1]`` again (callers check the counts)."""
    n = feats.shape[0]
    if n == 0:
        return x
    src = (torch.cumsum(mask.reshape(-1), 0) - 1).clamp_(0, n - 1)  # (B*T,) int64: feature row per position
    gathered = feats.to(x.dtype).index_select(0, src).view(x.shape)  # (B, T, D)
    return torch.where(mask[..., None], x + gathered, x)


def sliding_decode_mask(input_pos: torch.Tensor, kv_len: int, sliding_window: int) -> torch.Tensor:
    """:func:`~edgevlm.runtime.kv_cache.decode_mask` restricted to a sliding window: key position
    ``k`` visible to a query at position ``p`` when ``p - sliding_window < k <= p``; ``(1, 1, T,
    kv_len)`` for ``input_pos (T,)``, ``(B, 1, T, kv_len)`` for ``(B, T)``."""
    keys = torch.arange(kv_len, device=input_pos.device)  # (S,)
    pos = input_pos[:, None] if input_pos.dim() == 1 else input_pos[:, :, None]  # (T, 1) / (B, T, 1)
    allowed = (keys <= pos) & (keys > pos - sliding_window)
    return allowed[None, None] if input_pos.dim() == 1 else allowed[:, None]


def rope_inv_freq(cfg: TextConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``(head_dim / 2,)`` float32 for ``cfg.rope_type``.

    ``default``/``dynamic``: ``theta ** (-2i / Dh)`` (Su et al., RoFormer). ``linear``: divided by
    ``rope_factor`` (position interpolation, Chen et al. 2023). ``llama3``: Llama 3.1's scaling
    (Meta's ``apply_scaling`` in llama-models, the formula of transformers'
    ``_compute_llama3_parameters``): wavelengths below ``original_max / high_freq_factor`` keep
    their frequency, those above ``original_max / low_freq_factor`` are divided by ``factor``, and
    the band between is interpolated with ``s = (original_max / wavelen - low) / (high - low)``,
    ``(1 - s) * f / factor + s * f``. (``dynamic`` NTK only changes frequencies past
    ``max_position_embeddings``, which the KV cache never reaches: :meth:`Decoder.setup_caches`.)
    """
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))  # (Dh/2,)
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if cfg.rope_type not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope_type {cfg.rope_type!r}")
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``(*positions.shape, Dh)`` float32 at integer (or float) ``positions`` for
    ``inv_freq`` ``(Dh/2,)``, half-rotation layout (``[freqs, freqs]``)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # (..., Dh/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., Dh)
    return emb.cos(), emb.sin()


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``(max_seq_len, head_dim)`` float32 for positions ``0..max_seq_len-1``:
    of ``inv_freq`` (:func:`rope_inv_freq`) when given, else of the 'default' type with base ``theta``."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (Dh/2,)
    return rope_cos_sin(inv_freq, torch.arange(max_seq_len, device=device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, T, Dh)`` with ``cos``/``sin`` ``(T, Dh)`` (half-rotation layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` ``(..., Dh)`` with its first half negated: for :func:`apply_rope_rolled`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in three kernels: ``rotate_half(x) * sin == roll(x, Dh/2) * signed_sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def fuse_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([m(x) for m in mods], -1)`` in a single matmul, or None when the
    modules cannot be fused (mixed types, biases, group sizes or unfolded AWQ scales).

    The output rows of a linear layer are independent, so concatenating the weights (dense, or the
    canonical INT4 tensors of :mod:`edgevlm.runtime.int4`) is exact. No memory is added: afterwards
    each original module's weights are views into the fused ones (they keep working)."""
    from edgevlm.runtime.int4 import Int4Linear, Int4Weight

    if all(type(m) is nn.Linear for m in mods):
        if len({m.bias is None for m in mods}) != 1:
            return None
        w = torch.cat([m.weight.detach() for m in mods])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=mods[0].bias is not None, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        if mods[0].bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False)
        names = ("weight", "bias") if mods[0].bias is not None else ("weight",)
        tensors = {n: getattr(fused, n) for n in names}
    elif all(isinstance(m, Int4Linear) for m in mods):
        if len({m.group_size for m in mods}) != 1 or any(m.input_scale is not None for m in mods) \
                or len({m.bias is None for m in mods}) != 1 or len({m.kernel for m in mods}) != 1:
            return None
        cat = {n: torch.cat([getattr(m, n) for m in mods]) for n in ("qweight", "scales", "zeros")}
        bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
        fused = Int4Linear.from_int4(Int4Weight(cat["qweight"], cat["scales"], cat["zeros"], mods[0].group_size), bias)
        fused.kernel = mods[0].kernel
        names = ("qweight", "scales", "zeros") + (("bias",) if bias is not None else ())
        tensors = {n: getattr(fused, n) for n in names}
    else:
        return None
    start = 0
    for m in mods:
        n_out = m.out_features
        for name, t in tensors.items():
            view = t[start : start + n_out]
            if isinstance(t, nn.Parameter):
                setattr(m, name, nn.Parameter(view, requires_grad=False))
            else:
                setattr(m, name, view)
        if hasattr(m, "_kernel_cache"):
            m._kernel_cache = None
        start += n_out
    return fused


class Attention(nn.Module):
    """Causal grouped-query self-attention over a static KV cache."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=cfg.o_bias)
        # Qwen3 / Gemma 3: RMSNorm over each head's q and k (weights (Dh,)) before RoPE
        self.q_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.scale = cfg.attn_scale  # None: SDPA's head_dim ** -0.5
        self.window: int | None = None  # Gemma 3's sliding layers: their window (set by Decoder)
        self.kv_cache: KVCache | None = None
        self.qkv_proj: nn.Module | None = None  # set by fuse(): q, k, v in one matmul
        self.int4kv_kernel = True  # CUDA decode over an INT4 cache: attend from the codes (False: dequantize + SDPA)

    def fuse(self) -> bool:
        """Compute q, k and v with one matmul (see :func:`fuse_linears`); returns whether it did."""
        if self.qkv_proj is None:
            self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv_proj is not None

    def _sdpa(self, q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        if self.n_kv_heads != self.n_heads:
            if sdpa_has_gqa():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True,
                                                      scale=self.scale)
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale)

    def _masked_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of ``q (B, H, T, Dh)`` over ``k``/``v`` ``(B, Hkv, S, Dh)`` with a boolean
        ``mask (B|1, 1, T, S)``. Grouped-query attention without copying the cache: the ``H / Hkv``
        query heads sharing a KV head are folded into the query axis, ``(B, Hkv, rep * T, Dh)``,
        which every SDPA backend (mem-efficient included) accepts with a mask."""
        b, h, t, dh = q.shape
        rep = h // self.n_kv_heads
        if rep == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        qg = q.reshape(b, self.n_kv_heads, rep * t, dh)  # (B, Hkv, rep*T, Dh)
        if t > 1:
            mb, s = mask.shape[0], mask.shape[-1]
            mask = mask[:, :, None].expand(mb, 1, rep, t, s).reshape(mb, 1, rep * t, s)
        y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)  # (B, Hkv, rep*T, Dh)
        return y.reshape(b, h, t, dh)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: torch.Tensor,
        mask: torch.Tensor | None,
        rows: torch.Tensor | None = None,
        sin_signed: torch.Tensor | None = None,
        attend_fresh: bool = False,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, D)`` at positions ``input_pos`` (``(T,)``, or ``(B, T)`` per row) -> ``(B, T, D)``.

        ``mask`` None means "prefill from position 0": keys/values go to the cache and attention is
        causal over the T fresh ones; otherwise a boolean ``(B|1, 1, T, kv_len)`` mask over the first
        ``kv_len`` cache positions (decode); boolean or additive (0 / -inf in ``x.dtype``). ``rows``
        ``(B,)``: cache rows to write (None = ``0..B-1``; decode always uses rows ``0..B-1``).
        ``sin_signed``: :func:`signed_sin` of ``sin`` (used by the fused-projection path).
        ``attend_fresh``: a prefill from position 0 with a ``mask`` ``(B|1, 1, T, T)`` over the T fresh
        keys (sliding windows, Gemma 3's bidirectional image blocks) instead of the cache.
        ``lengths``: ``(B,)`` real tokens per row of a right-padded prefill, for a rolling (ring)
        cache (Gemma 3's sliding layers), which keeps each row's last ``window`` positions only;
        a ring cache's decode ``mask`` spans its slots (see :mod:`edgevlm.runtime.kv_cache`).
        """
        if self.kv_cache is None:
            raise RuntimeError("KV cache not set up: call setup_caches() first")
        b, t, _ = x.shape
        h, hkv, dh = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None:  # one matmul, one RoPE pass over q and k together
            qkv = self.qkv_proj(x)  # (B, T, (H + 2 Hkv) Dh)
            qk = qkv[..., : (h + hkv) * dh].view(b, t, h + hkv, dh)  # (B, T, H + Hkv, Dh)
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, :, :h]), self.k_norm(qk[:, :, h:])], dim=2)
            qk = qk.transpose(1, 2)  # (B, H + Hkv, T, Dh)
            qk = apply_rope_rolled(qk, cos, sin_signed if sin_signed is not None else signed_sin(sin))
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[..., (h + hkv) * dh :].view(b, t, hkv, dh).transpose(1, 2)  # (B, Hkv, T, Dh)
        else:
            q = self.q_proj(x).view(b, t, h, dh)  # (B, T, H, Dh)
            k = self.k_proj(x).view(b, t, hkv, dh)  # (B, T, Hkv, Dh)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H|Hkv, T, Dh)
            v = self.v_proj(x).view(b, t, hkv, dh).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.kv_cache.write(input_pos, k, v, rows, lengths)
        if mask is None:
            y = self._sdpa(q, k, v, None, is_causal=True)
        elif attend_fresh:
            y = self._masked_sdpa(q, k, v, mask)  # (B, H, T, Dh)
        elif t == 1 and self.int4kv_kernel and self.kv_cache.kv_cache_dtype == "int4" and kernels_usable(q.device):
            # decode from the 4-bit codes without dequantizing the cache (kernels/int4kv_attention.py,
            # CUDA or Triton's CPU interpreter); the mask is decode_mask's (key position <= the row's
            # position), within the window on Gemma 3's sliding layers (sliding_decode_mask's)
            pos = input_pos.reshape(-1).expand(b) if input_pos.dim() == 1 else input_pos[:, 0]  # (B,)
            y = int4kv_decode_attention(q, self.kv_cache, pos, mask.shape[-1], scale=self.scale,
                                        window=None if self.kv_cache.ring else self.window)  # (B, H, 1, Dh)
        else:
            k_all, v_all = self.kv_cache.read(b, mask.shape[-1], q.dtype)  # (B, Hkv, kv_len, Dh)
            y = self._masked_sdpa(q, k_all, v_all, mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class MLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse()

    def fuse(self) -> bool:
        """Compute gate and up with one matmul (see :func:`fuse_linears`); returns whether it did."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        return self.gate_up_proj is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., I) each
            return self.down_proj(activation(self.act, gate) * up)
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``
    (Llama). With ``cfg.sandwich_norms`` (Gemma 2 / 3) ``post_attention_layernorm`` normalises the
    attention output and the MLP sits between ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``: ``x + post_attn(attn(in(x)))``, then ``x + post_ff(mlp(pre_ff(x)))``."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.sandwich_norms = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)

    def forward(self, x, cos, sin, input_pos, mask, rows=None, sin_signed=None, attend_fresh=False,
                lengths=None) -> torch.Tensor:
        if self.sandwich_norms:
            h = self.self_attn(self.input_layernorm(x), cos, sin, input_pos, mask, rows, sin_signed, attend_fresh,
                               lengths)
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, mask, rows, sin_signed, attend_fresh)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token embedding, decoder layers, final RMSNorm and LM head (``lm_head`` may be tied)."""

    def __init__(self, cfg: TextConfig, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.embed_scale is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = make_norm(cfg, cfg.hidden_size)
        # Gemma 3: which layers attend within the sliding window (their own RoPE tables when
        # sliding_rope_theta is set); empty for every other decoder
        self.sliding_layers = frozenset(i for i, kind in enumerate(cfg.layer_types or ()) if kind == "sliding_attention")
        for i in self.sliding_layers:
            self.layers[i].self_attn.window = cfg.sliding_layer_window
        self.local_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (cos, sin, sin_signed)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_seq_len = 0
        self.kv_cache_dtype: str | None = None
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.rope_sin_signed: torch.Tensor | None = None
        self.inv_freq: torch.Tensor | None = None  # (Dh/2,) float32, set by setup_caches
        self.fused_decode = False  # see enable_fused_decode()
        self.ring_window: int | None = None  # slots of the sliding layers' rolling caches (setup_caches)

    def setup_caches(self, max_batch_size: int, max_seq_len: int, kv_cache_dtype: str | None = None,
                     int4_group_size: int = DEFAULT_INT4_GROUP_SIZE, window_caches: bool = True) -> None:
        """Allocate the static KV caches (``max_batch_size`` rows of ``max_seq_len`` positions per
        layer, precision ``kv_cache_dtype``, see :func:`edgevlm.runtime.kv_cache.make_kv_cache`;
        None = the weights' dtype) and the RoPE tables (:func:`rope_inv_freq`), on the weights' device.

        ``window_caches`` (Gemma 3, ``cfg.sliding_layer_window`` below ``max_seq_len``): the sliding
        layers get rolling caches of ``sliding_layer_window`` slots instead of ``max_seq_len``
        (:mod:`edgevlm.runtime.kv_cache`; same logits, a fraction of the memory); False = full length.

        Raises ``ValueError`` for an unknown ``kv_cache_dtype``, or a ``max_seq_len`` past what the
        config computes exactly: Mistral's ``sliding_window``, or ``max_position_embeddings`` for
        dynamic-NTK RoPE (whose frequencies change past it)."""
        w = self.embed_tokens.weight
        if self.cfg.sliding_window is not None and max_seq_len > self.cfg.sliding_window:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's sliding_window "
                             f"({self.cfg.sliding_window}): attention past the window is not implemented")
        if self.cfg.rope_type == "dynamic" and max_seq_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings "
                             f"({self.cfg.max_position_embeddings}), past which dynamic-NTK RoPE rescales")
        self.max_seq_len = max_seq_len
        self.kv_cache_dtype = kv_cache_dtype
        for layer in self.layers:
            layer.self_attn.kv_cache = None  # free the old cache before allocating the new one
        window = self.cfg.sliding_layer_window
        self.ring_window = window if window_caches and window is not None and window < max_seq_len \
            and self.sliding_layers else None
        for i, layer in enumerate(self.layers):
            ring = self.ring_window is not None and i in self.sliding_layers
            layer.self_attn.kv_cache = make_kv_cache(
                kv_cache_dtype, max_batch_size, self.cfg.num_key_value_heads, window if ring else max_seq_len,
                self.cfg.head_dim, dtype=w.dtype, device=w.device, int4_group_size=int4_group_size, ring=ring,
            )
        # M-RoPE positions run ahead of the cache slots for video (decode reads slot + rope_offset)
        n_rope = max_seq_len if self.cfg.mrope_section is None else 2 * max_seq_len
        self.inv_freq = rope_inv_freq(self.cfg)  # (Dh/2,) float32, on the CPU
        cos, sin = rope_tables(self.cfg.head_dim, n_rope, self.cfg.rope_theta, w.device, self.inv_freq)  # float32
        # stored in the activation dtype, as transformers casts them (one cast at set-up, not per step)
        self.rope_cos, self.rope_sin = cos.to(w.dtype), sin.to(w.dtype)
        self.rope_sin_signed = signed_sin(sin).to(w.dtype)
        self.local_rope = None
        if self.cfg.sliding_rope_theta is not None and self.sliding_layers:  # Gemma 3's local RoPE base
            cos, sin = rope_tables(self.cfg.head_dim, n_rope, self.cfg.sliding_rope_theta, w.device)
            self.local_rope = cos.to(w.dtype), sin.to(w.dtype), signed_sin(sin).to(w.dtype)

    def fuse_projections(self) -> int:
        """Fuse q/k/v and gate/up of every layer into single matmuls (fewer kernels per decode
        step; exact, no extra memory, see :func:`fuse_linears`). Returns the number fused."""
        return sum(int(layer.self_attn.fuse()) + int(layer.mlp.fuse()) for layer in self.layers)

    @property
    def max_batch_size(self) -> int:
        cache = self.layers[0].self_attn.kv_cache if len(self.layers) else None
        return cache.max_batch_size if cache is not None else 0

    def forward(self, embeds: torch.Tensor, input_pos: torch.Tensor, *, prefill: bool,
                all_logits: bool = False, kv_len: int | None = None, rows: torch.Tensor | None = None,
                last_index: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_offset: int | torch.Tensor = 0,
                layer_adds: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                image_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder on ``embeds`` ``(B, T, D)`` at cache slots ``input_pos``: ``(T,)`` int64
        shared by all rows, or ``(B, T)`` per row.

        ``prefill=True`` requires slots ``0..T-1`` (causal attention over the T fresh tokens;
        ``rows`` ``(B,)`` picks the cache rows to fill, None = ``0..B-1``); ``prefill=False`` attends
        over the first ``kv_len`` cache positions (None = all) of rows ``0..B-1`` with a mask
        (decode, or a continuation prefill). Returns logits ``(B, V)`` of the last position — or of
        position ``last_index[b]`` per row (right-padded batched prefill) — or ``(B, T, V)`` with
        ``all_logits``, in the weights' dtype.

        Hooks for the model families (``runtime/models``):

        * ``rope``: ``(cos, sin)`` ``(T, Dh)`` or ``(B, T, Dh)`` (any float dtype; cast to the
          activations') used instead of the tables at ``input_pos``: positions that are not the
          slots (multimodal RoPE, pruned vision tokens). Keys are cached already rotated.
        * ``rope_offset``: int or ``(B,)`` int64: RoPE position = slot + offset (M-RoPE decode:
          the ``rope_delta`` of the prompt). Position + offset must stay within the tables
          (``max_seq_len``, twice that with ``mrope_section``).
        * ``layer_adds``: per decoder layer ``i`` (list index), None or ``(mask (B, T) bool, feats
          (N, D))``: after layer ``i``, ``h[mask] += feats`` (DeepStack, Qwen3-VL), N >= the mask
          count (rows past it unused: a captured prefill pads them), see :func:`add_at_mask`.
        * ``image_blocks``: prefill only, ``(B, T)`` int64: tokens sharing an id >= 0 attend to each
          other in both directions (Gemma 3's image tokens, transformers' ``block_sequence_ids``);
          -1 = causal. See :func:`prefill_masks`.

        With ``cfg.layer_types`` (Gemma 3) the sliding layers attend within ``cfg.sliding_layer_window``
        and use the ``sliding_rope_theta`` tables; over rolling caches (:meth:`setup_caches`) a prefill
        stores each row's last window positions (``last_index`` + 1 real tokens per row) and a decode
        step attends to the first ``min(kv_len, window)`` slots. Raises ``ValueError`` for
        ``image_blocks`` outside a prefill or without ``layer_types``, and for a continuation
        prefill (``prefill=False``, T > 1) over rolling caches.
        """
        if self.rope_cos is None:
            raise RuntimeError("caches not set up: call setup_caches() first")
        dt = embeds.dtype
        shifted = not (isinstance(rope_offset, int) and rope_offset == 0)
        if not prefill and self.fused_decode and embeds.shape[1] == 1 \
                and input_pos.dim() == 2 and not all_logits \
                and rows is not None and rope is None and layer_adds is None:
            # the fused step builds no mask and gathers no RoPE rows (its kernels read the tables at the
            # positions): ~8 small kernels fewer per step
            slot = input_pos[:, 0]  # (B,); M-RoPE: RoPE position = slot + offset
            rope_pos = None
            if shifted:
                off = rope_offset
                rope_pos = (input_pos + (off[:, None] if isinstance(off, torch.Tensor) and off.dim() == 1 else off))
                rope_pos = rope_pos[:, 0].expand(slot.shape)
            return self._fused_decode(embeds, slot, kv_len or self.max_seq_len, rope_pos)
        if rope is not None:
            cos, sin = rope[0].to(dt), rope[1].to(dt)  # (T|B,T, Dh)
            sin_signed = signed_sin(sin)
        else:
            rope_pos = input_pos
            if shifted:
                off = rope_offset
                if isinstance(off, torch.Tensor) and input_pos.dim() == 2 and off.dim() == 1:
                    off = off[:, None]  # (B, 1)
                rope_pos = input_pos + off
            cos = self.rope_cos[rope_pos].to(dt)  # (T, Dh) or (B, T, Dh)
            sin = self.rope_sin[rope_pos].to(dt)
            sin_signed = self.rope_sin_signed[rope_pos].to(dt)
        if cos.dim() == 3:  # (B, 1, T, Dh): broadcast over heads
            cos, sin, sin_signed = cos[:, None], sin[:, None], sin_signed[:, None]
        mask = None
        if not prefill:  # additive 0 / -inf, built once per step rather than converted in every layer
            allowed = decode_mask(input_pos, kv_len or self.max_seq_len)
            mask = torch.full(allowed.shape, float("-inf"), dtype=dt, device=embeds.device)
            mask.masked_fill_(allowed, 0.0)
        if image_blocks is not None and not prefill:
            raise ValueError("image_blocks apply to a prefill only")
        if self.ring_window is not None and not prefill and embeds.shape[1] > 1:
            raise ValueError("a continuation prefill (prefill=False, T > 1) cannot run over the sliding layers' "
                             "rolling KV caches: set them up with setup_caches(..., window_caches=False)")
        lengths = last_index + 1 if prefill and last_index is not None and self.ring_window is not None else None
        per_layer = None
        if self.cfg.layer_types is not None:  # Gemma 3: (rope, mask, attend_fresh) per kind of layer
            per_layer = self._layer_kinds(embeds, input_pos, prefill, mask, kv_len, rope, (cos, sin, sin_signed),
                                          rope_pos if rope is None else None, image_blocks)
        elif image_blocks is not None:
            raise ValueError("image_blocks need a config with layer_types (Gemma 3)")
        x = embeds
        for i, layer in enumerate(self.layers):
            if per_layer is None:
                x = layer(x, cos, sin, input_pos, mask, rows, sin_signed)
            else:
                (c, s, ss), m, fresh = per_layer[i in self.sliding_layers]
                x = layer(x, c, s, input_pos, m, rows, ss, fresh, lengths)
            add = layer_adds[i] if layer_adds is not None and i < len(layer_adds) else None
            if add is not None:
                x = add_at_mask(x, add[0], add[1])  # h[mask] += feats
        if not all_logits and last_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_index][:, None]  # (B, 1, D)
        elif not all_logits:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))  # (B, T|1, V)
        return logits if all_logits else logits[:, -1]

    def _layer_kinds(self, embeds, input_pos, prefill, mask, kv_len, rope, tables, rope_pos, image_blocks):
        """``{False: full layers, True: sliding layers}`` -> ``((cos, sin, sin_signed), mask,
        attend_fresh)`` for :meth:`forward` with ``cfg.layer_types``."""
        dt, window = embeds.dtype, self.cfg.sliding_layer_window
        local = tables
        if self.local_rope is not None:
            if rope is not None:
                raise ValueError("explicit rope tables are not supported with sliding_rope_theta (Gemma 3: 1-D RoPE)")
            local = tuple(t[rope_pos].to(dt) for t in self.local_rope)
            if local[0].dim() == 3:
                local = tuple(t[:, None] for t in local)
        if prefill:
            full_mask, sliding_mask = prefill_masks(embeds.shape[1], image_blocks, window, embeds.device)
            return {False: (tables, full_mask, full_mask is not None),
                    True: (local, sliding_mask, sliding_mask is not None)}
        sliding_mask = mask
        if self.ring_window is not None:  # rolling caches: slots j <= position of the first min(kv_len, W)
            allowed = decode_mask(input_pos, min(kv_len or self.max_seq_len, self.ring_window))
            sliding_mask = torch.full(allowed.shape, float("-inf"), dtype=dt, device=embeds.device)
            sliding_mask.masked_fill_(allowed, 0.0)
        elif window is not None:
            allowed = sliding_decode_mask(input_pos, kv_len or self.max_seq_len, window)
            sliding_mask = torch.full(allowed.shape, float("-inf"), dtype=dt, device=embeds.device)
            sliding_mask.masked_fill_(allowed, 0.0)
        return {False: (tables, mask, False), True: (local, sliding_mask, False)}

    def enable_fused_decode(self, enabled: bool = True) -> bool:
        """Use the fused Triton decode kernels (:mod:`edgevlm.runtime.kernels.decode_fused`) for
        one-token steps where they apply: CUDA (or Triton's CPU interpreter), fused q/k/v and
        gate/up projections (:meth:`fuse_projections`), a SiLU or tanh-GELU MLP, power-of-two head dim
        (q/k norm and a ``rope_offset`` are fused too, and Gemma 3's configuration: unit-offset and
        sandwich norms, attention scale, sliding / full layers with their own RoPE tables); every KV
        cache precision (:meth:`_fused_attention` says how each is attended); steps with ``rope``
        tables run the layer loop. With the fused path on, each fused W4A16 gate/up projection is marked gated
        (:meth:`~edgevlm.runtime.int4.Int4Linear.set_gated`, where ``w4a16_mma.GATED`` is on and its rows allow) so
        the step applies ``act(gate) * up`` in that matmul's epilogue; off, unmarked. Returns whether the fused path
        is now on."""
        from edgevlm.runtime.int4 import Int4Linear
        from edgevlm.runtime.int4_format import gated_rows_ok
        from edgevlm.runtime.kernels import kernels_usable, w4a16_mma
        from edgevlm.runtime.kernels.decode_fused import GATED_ACTS

        ok = enabled and len(self.layers) > 0 and kernels_usable(self.embed_tokens.weight.device) \
            and self.cfg.hidden_act in GATED_ACTS and self.cfg.head_dim & (self.cfg.head_dim - 1) == 0 \
            and all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
                    and isinstance(layer.self_attn.kv_cache, KVCache) for layer in self.layers)
        self.fused_decode = bool(ok)
        for layer in self.layers:
            gu = layer.mlp.gate_up_proj
            if isinstance(gu, Int4Linear):
                gated = self.fused_decode and w4a16_mma.GATED and gated_rows_ok(gu.out_features)
                gu.set_gated(layer.mlp.act if gated else None)
        return self.fused_decode

    def _fused_decode(self, embeds: torch.Tensor, pos: torch.Tensor, kv_len: int,
                      rope_pos: torch.Tensor | None = None) -> torch.Tensor:
        """One-token decode step of rows ``0..B-1`` with the fused kernels: ``embeds (B, 1, D)``,
        cache slots ``pos (B,)`` int64 (row ``b`` attends to keys ``0..pos[b]`` of the first ``kv_len``),
        RoPE positions ``rope_pos (B,)`` int64 (None = ``pos``) -> logits ``(B, V)``. Same math as the
        layer loop (residual adds rounded to the activation dtype, fp32 norm statistics); with Gemma 3's
        ``sandwich_norms`` each post-attention / post-feedforward norm is fused into the residual add
        and the norm after it (:func:`~edgevlm.runtime.kernels.decode_fused.add_rms_norm`). Each layer's
        attention by its cache (:meth:`_fused_attention`); where
        :data:`~edgevlm.runtime.kernels.decode_fused.FUSED_ATTENTION` is on, a layer over a 16-bit
        full-length cache without a sliding window runs RoPE, the KV write and attention as one kernel
        (:func:`~edgevlm.runtime.kernels.decode_fused.rope_decode_attention`)."""
        from edgevlm.runtime.kernels import decode_fused
        from edgevlm.runtime.kernels.decode_fused import add_rms_norm, gated_act, rope_decode_attention

        cfg = self.cfg
        unit = cfg.norm_unit_offset
        b, d = embeds.shape[0], embeds.shape[2]
        x = embeds.reshape(b, d)  # (B, D) residual stream
        first = self.layers[0].input_layernorm
        h = F.rms_norm(x, (d,), first.weight, first.eps) if _HAS_RMS_NORM and x.is_cuda and not unit else first(x)
        scratch: dict = {}  # tensors _fused_attention builds once per step (masks, zero slots)
        one_kernel = decode_fused.FUSED_ATTENTION
        window = cfg.sliding_layer_window
        if self.ring_window is not None:  # rolling caches: slot pos % W, keys = slots <= pos of min(kv_len, W)
            ring_len = min(kv_len, self.ring_window)
            ring_slot = pos % self.ring_window  # (B,)
            ring_pos = pos.clamp(max=ring_len - 1)  # the kernel attends to slots 0..ring_pos
            ring_rope = pos if rope_pos is None else rope_pos
        for i, layer in enumerate(self.layers):
            attn, cache = layer.self_attn, layer.self_attn.kv_cache
            sliding = i in self.sliding_layers
            cos, sin = (self.local_rope[0], self.local_rope[1]) if sliding and self.local_rope is not None \
                else (self.rope_cos, self.rope_sin)
            ring = cache.ring
            win = window if sliding and not ring else None
            qkv = attn.qkv_proj(h)  # (B, (H + 2 Hkv) Dh)
            if one_kernel and type(cache) is KVCache and not ring and win is None and cache.k.dtype == embeds.dtype:
                qn = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm is not None \
                    else (None,) * 3
                try:
                    y = rope_decode_attention(qkv, cos, sin, pos, cache.k, cache.v, attn.n_heads, attn.n_kv_heads,
                                              kv_len, rope_pos=rope_pos, q_norm=qn[0], k_norm=qn[1],
                                              norm_eps=qn[2] or 1e-6, unit_offset=unit,
                                              scale=attn.scale)  # (B, H, 1, Dh); k, v at the slot
                except Exception as exc:  # noqa: BLE001 - e.g. a Triton that cannot compile it: the 3 kernels
                    if torch.cuda.is_current_stream_capturing():
                        raise
                    logger.warning("rope_decode_attention unavailable (%s: %s); decoding with rope_kv_write + "
                                   "decode_attention", type(exc).__name__, str(exc)[:200])
                    decode_fused.FUSED_ATTENTION = one_kernel = False
                else:
                    o = attn.o_proj(y.reshape(b, -1))  # (B, D)
                    x, h = self._fused_mlp(layer, i, x, o, unit, gated_act, add_rms_norm)
                    continue
            if ring:
                y = self._fused_attention(attn, qkv, cos, sin, ring_slot, ring_pos, ring_len, ring_rope, None,
                                           scratch)
            else:
                y = self._fused_attention(attn, qkv, cos, sin, pos, pos, kv_len, rope_pos, win, scratch)
            o = attn.o_proj(y.reshape(b, -1))  # (B, D)
            x, h = self._fused_mlp(layer, i, x, o, unit, gated_act, add_rms_norm)
        return self.lm_head(h)  # (B, V); h is the final norm's output

    def _fused_attention(self, attn: Attention, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         slot: torch.Tensor, key_pos: torch.Tensor, n_keys: int, rope_pos: torch.Tensor | None,
                         window: int | None, scratch: dict) -> torch.Tensor:
        """One layer's attention in :meth:`_fused_decode`: ``qkv (B, (H + 2 Hkv) Dh)`` -> ``(B, H, 1, Dh)``.

        The fresh key and value go to cache slot ``slot (B,)`` int64 (RoPE at ``rope_pos``, None = ``slot``);
        row ``b`` attends to slots ``0..key_pos[b]`` of the first ``n_keys``, within ``window`` (None: no
        window). ``scratch``: a dict kept for one step (tensors built once per step). By the cache's kind:

        * 16-bit cache of the activation dtype, or :class:`~edgevlm.runtime.kv_cache.Fp8KVCache`: ``rope_kv_write``
          stores k and v at the slot (fp8: quantized in the kernel) and ``decode_attention`` reads the cache
          (fp8: the e4m3 bytes and scales, dequantized in registers) — two kernels and the split combine;
        * :class:`~edgevlm.runtime.kv_cache.Int4KVCache` (with ``attn.int4kv_kernel`` and a head the int4 kernels
          tile): RoPE into a one-slot buffer, ``int4kv_write``, ``int4kv_decode_attention`` from the codes;
        * anything else (a 32-bit cache under 16-bit activations, an int4 cache the kernels do not tile or with
          ``int4kv_kernel`` off): the cache's own write and ``read`` (dequantized) + masked SDPA, the layer loop's
          arithmetic."""
        from edgevlm.runtime.kernels.decode_fused import decode_attention, rope_kv_write
        from edgevlm.runtime.kernels.int4kv_attention import int4kv_write

        cache = attn.kv_cache
        b, hkv, dh = qkv.shape[0], attn.n_kv_heads, attn.head_dim
        norm = {"q_norm": None, "k_norm": None, "norm_eps": 1e-6, "unit_offset": self.cfg.norm_unit_offset}
        if attn.q_norm is not None:
            norm.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight, norm_eps=attn.q_norm.eps or 1e-6)
        fp8 = isinstance(cache, Fp8KVCache)
        if type(cache) is KVCache or fp8:
            scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if fp8 else {}
            q = rope_kv_write(qkv, cos, sin, slot, cache.k, cache.v, attn.n_heads, hkv, rope_pos=rope_pos,
                              **norm, **scales)  # (B, H, 1, Dh); k, v stored at the slot
            if fp8 or cache.k.dtype == q.dtype:  # split-K Triton attention over the cache
                return decode_attention(q, cache.k, cache.v, key_pos, n_keys, scale=attn.scale, window=window,
                                        **scales)  # (B, H, 1, Dh)
        else:  # the cache quantizes on write: rotate k into a one-slot buffer first
            k1 = qkv.new_empty(b, hkv, 1, dh)
            v1 = qkv.new_empty(b, hkv, 1, dh)
            if "zeros" not in scratch:
                scratch["zeros"] = torch.zeros_like(slot)  # (B,) the buffer's one slot
            q = rope_kv_write(qkv, cos, sin, scratch["zeros"], k1, v1, attn.n_heads, hkv,
                              rope_pos=slot if rope_pos is None else rope_pos, **norm)  # (B, H, 1, Dh)
            if isinstance(cache, Int4KVCache) and attn.int4kv_kernel and cache._fused_write_ok(dh):
                int4kv_write(cache, slot[:, None], k1, v1)
                return int4kv_decode_attention(q, cache, key_pos, n_keys, scale=attn.scale, window=window)
            cache.write(slot[:, None], k1, v1)
        k_all, v_all = cache.read(b, n_keys, q.dtype)  # (B, Hkv, n_keys, Dh)
        key = (n_keys, window, cache.ring)
        masks = scratch.setdefault("masks", {})
        if key not in masks:
            if window is not None:
                masks[key] = sliding_decode_mask(key_pos[:, None], n_keys, window)  # (B, 1, 1, n_keys) bool
            elif cache.ring:
                masks[key] = decode_mask(key_pos[:, None], n_keys)  # (B, 1, 1, W') bool
            else:  # additive, as forward() builds it
                allowed = decode_mask(key_pos[:, None], n_keys)  # (B, 1, 1, n_keys)
                masks[key] = torch.full(allowed.shape, float("-inf"), dtype=q.dtype, device=q.device)
                masks[key].masked_fill_(allowed, 0.0)
        return attn._masked_sdpa(q, k_all, v_all, masks[key])  # (B, H, 1, Dh)

    def _fused_mlp(self, layer, i: int, x: torch.Tensor, o: torch.Tensor, unit: bool, gated_act, add_rms_norm):
        """The rest of layer ``i`` in :meth:`_fused_decode` after the attention output projection ``o (B, D)``:
        residual add + norm, the gated MLP, residual add + the next layer's (or the final) norm. Returns the
        residual stream and the next norm's output, both ``(B, D)``."""
        nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
        if layer.sandwich_norms:  # x + post_attn(o), pre_ff(.); x + post_ff(mlp), next norm(.)
            post, pre = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            x, h = add_rms_norm(x, o, pre.weight, pre.eps, unit_offset=unit, delta_weight=post.weight,
                                delta_eps=post.eps)
            post = layer.post_feedforward_layernorm
            mlp = layer.mlp.down_proj(self._gate_up_act(layer.mlp, h, gated_act))
            return add_rms_norm(x, mlp, nxt.weight, nxt.eps, unit_offset=unit, delta_weight=post.weight,
                                delta_eps=post.eps)
        x, h = add_rms_norm(x, o, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                            unit_offset=unit)
        return add_rms_norm(x, layer.mlp.down_proj(self._gate_up_act(layer.mlp, h, gated_act)),
                            nxt.weight, nxt.eps, unit_offset=unit)

    @staticmethod
    def _gate_up_act(mlp, h: torch.Tensor, gated_act) -> torch.Tensor:
        """``act(gate) * up`` of the fused gate/up projection for ``h (B, D)``: in the W4A16 launch's epilogue where
        it applies (``Int4Linear.gated_ready``), else the projection and ``gated_act``'s kernel. ``(B, I)``."""
        gu = mlp.gate_up_proj
        if getattr(gu, "gated_act", None) is not None and gu.gated_ready(h):
            return gu.forward_gated(h)
        return gated_act(gu(h), mlp.act)

    def decode_step(self, token_ids: torch.Tensor, input_pos: torch.Tensor, kv_len: int,
                    rope_offset: int | torch.Tensor = 0) -> torch.Tensor:
        """One batched decode step over cache rows ``0..B-1``: ``token_ids`` ``(B, 1)`` int64 at
        per-row slots ``input_pos`` ``(B,)`` int64, attending over the first ``kv_len`` positions
        (a static int: one CUDA graph per value) -> logits ``(B, V)``. ``rope_offset`` (int or
        ``(B,)`` int64): RoPE position = slot + offset (M-RoPE), see :meth:`forward`."""
        embeds = self.embed_tokens(token_ids)  # (B, 1, D)
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)  # once per step, not per layer
        return self(embeds, input_pos[:, None], prefill=False, kv_len=kv_len, rows=rows, rope_offset=rope_offset)

    def prefill_batch(self, embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, *,
                      rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                      layer_adds: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                      image_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill several right-padded prompts at once: ``embeds`` ``(B, T, D)``, row ``b`` real for
        its first ``lengths[b]`` positions (padding after them only reaches cache positions that
        decode overwrites before it attends to them), written into cache rows ``rows`` ``(B,)``.
        ``rope`` ``(cos, sin)`` ``(B, T, Dh)`` (per-row M-RoPE tables) and ``layer_adds`` (mask
        ``(B, T)``) and ``image_blocks`` ``(B, T)`` (padding -1): the :meth:`forward` hooks. Returns
        the logits ``(B, V)`` at position ``lengths[b] - 1`` of each row."""
        t = embeds.shape[1]
        input_pos = torch.arange(t, device=embeds.device)
        if image_blocks is None:
            return self(embeds, input_pos, prefill=True, rows=rows, last_index=lengths - 1, rope=rope,
                        layer_adds=layer_adds)
        return self(embeds, input_pos, prefill=True, rows=rows, last_index=lengths - 1, rope=rope,
                    layer_adds=layer_adds, image_blocks=image_blocks)


class DecoderVLM(nn.Module):
    """Base of every family's model (:class:`edgevlm.runtime.models.base.VLMModel`): a vision part
    feeding ``language_model``, the shared :class:`Decoder`. Gives the parts every accelerator
    reaches through the decoder: the model's dtype and device (those of the token embeddings) and
    the KV-cache set-up."""

    language_model: Decoder

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    def setup_caches(self, max_batch_size: int, max_seq_len: int, **kwargs) -> None:
        """Allocate the decoder's static KV caches and RoPE tables (see :meth:`Decoder.setup_caches`;
        ``kwargs``: its KV precision and layout options)."""
        self.language_model.setup_caches(max_batch_size, max_seq_len, **kwargs)

    # ---- prefill: one prompt, or several in cache rows (continuous batching) ---------------------
    def prefill_inputs(self, embeds: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """The decoder hooks of the prefill of ``embeds`` ``(1, T, D)`` (the result of this model's
        last ``embed``) from slot 0, as :meth:`Decoder.prefill_batch` keyword arguments for that one
        row: ``rope`` ``(cos, sin)`` ``(1, T, Dh)`` float32 (RoPE at positions other than the slots),
        ``layer_adds`` (per layer None or ``(mask (1, T) bool, feats (N, D))``, DeepStack) and
        ``image_blocks`` ``(1, T)`` int64 (bidirectional image attention); a key is absent where the
        hook is unused. Side state the family kept for this prefill (DeepStack features, pruned
        positions, image runs) is handed over and forgotten, exactly as :meth:`prefill` does: the
        two are one code path, so a backend running ``Decoder.prefill_batch`` itself (a CUDA graph,
        :mod:`edgevlm.runtime.prefill_graphs`) computes what :meth:`prefill` would.

        Here: ``position_ids`` (M-RoPE ``(3, 1, T)``) -> the :meth:`rope_tables` at them, None -> no
        hooks. Raises ``ValueError`` where the family takes no ``position_ids`` (1-D RoPE) or the
        side state does not match ``embeds``."""
        if position_ids is None:
            return {}
        cos, sin = self.rope_tables(position_ids)  # (T, Dh) each
        return {"rope": (cos[None].float(), sin[None].float())}

    def prefill(self, embeds: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run the prompt ``embeds`` ``(B, T, D)`` (B = 1 but for LLaVA's plain prompts) from slot 0
        into the KV cache -> the last logits ``(B, V)``, or ``(B, T, V)`` with ``all_logits``, in
        the weights' dtype. ``position_ids``: the family's (M-RoPE ``(3, 1, T)``; None = the slots);
        the family's hooks and side state come from :meth:`prefill_inputs` (see there for errors)."""
        hooks = self.prefill_inputs(embeds, position_ids)
        input_pos = torch.arange(embeds.shape[1], device=embeds.device)
        return self.language_model(embeds, input_pos, prefill=True, all_logits=all_logits, **hooks)

    def take_vision_state(self):
        """Side features the last :meth:`encode_vision` kept for the next prefill, handed over and
        forgotten (a batch encodes several requests before prefilling them together). None here:
        the family's ``encode_vision`` result is all its prefill needs (``vision_state_free``)."""
        return None

    def rope_tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(cos, sin)`` ``(T, head_dim)`` float32 for ``position_ids`` other than the
        slots; families with 1-D RoPE never get any (their ``position_ids`` is None)."""
        raise ValueError(f"{type(self).__name__} uses 1-D RoPE: position_ids must be None")

    def row_rope(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                 vision_state) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One row of a batched prefill: its RoPE ``(cos, sin)`` ``(T_i, head_dim)`` (any float
        dtype) from its ``position_ids`` (:meth:`rope_tables`), or None for the slots. ``input_ids``
        ``(1, T_i)`` and ``vision_state`` are there for families whose positions come from the
        vision state (LLaVA's pruned tokens)."""
        return None if position_ids is None else self.rope_tables(position_ids)

    def batch_layer_adds(self, input_ids: torch.Tensor, vision_states: list) -> list | None:
        """The decoder's ``layer_adds`` for a right-padded batch ``input_ids`` ``(B, T)`` (padding
        -1) and each row's :meth:`take_vision_state`; None = nothing to add."""
        return None

    def image_blocks_for(self, embeds: torch.Tensor) -> torch.Tensor | None:
        """The decoder's ``image_blocks`` ``(1, T)`` for the prefill of ``embeds`` (the result of this
        model's last ``embed``), handed over and forgotten; None = causal, as for every family but
        Gemma 3. Backends that run the decoder themselves (ONNX) ask for it."""
        return None

    def batch_image_blocks(self, input_ids: torch.Tensor, vision_states: list) -> torch.Tensor | None:
        """The decoder's ``image_blocks`` (bidirectional attention within each image's tokens,
        :meth:`Decoder.forward`) for a right-padded batch ``input_ids`` ``(B, T)`` (padding -1);
        None = causal, as for every family but Gemma 3."""
        return None

    def prefill_batch_inputs(self, embeds: list[torch.Tensor], rows: torch.Tensor, *,
                             input_ids: list[torch.Tensor] | None = None,
                             position_ids: list[torch.Tensor | None] | None = None,
                             vision_states: list | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """The arguments of :meth:`Decoder.prefill_batch` for the prompts of :meth:`prefill_batch`
        (same arguments): ``(embeds (B, T, D) right-padded with zeros to the longest, lengths (B,)
        int64, rows (B,) int64, hooks)``, all on the embeddings' device; ``hooks`` holds the present
        ones of ``rope`` ``(cos, sin)`` ``(B, T, Dh)`` float32 (a row without tables: the decoder's
        own at the slots; padding zeros), ``layer_adds`` (:meth:`batch_layer_adds`) and
        ``image_blocks`` ``(B, T)`` (:meth:`batch_image_blocks`, padding -1). Raises ``ValueError``
        where a family's state and its row disagree."""
        lm = self.language_model
        n = len(embeds)
        lengths = [e.shape[1] for e in embeds]
        t = max(lengths)
        dev = embeds[0].device
        x = torch.cat([F.pad(e, (0, 0, 0, t - e.shape[1])) for e in embeds])  # (B, T, D)
        ropes = [self.row_rope(input_ids[i] if input_ids is not None else None,
                               position_ids[i] if position_ids is not None else None,
                               vision_states[i] if vision_states is not None else None) for i in range(n)]
        hooks: dict = {}
        if any(r is not None for r in ropes):
            slots = torch.arange(t, device=dev)
            cos_rows, sin_rows = [], []
            for r, length in zip(ropes, lengths, strict=True):
                if r is None:  # 1-D positions: the decoder's own tables at the slots
                    cos, sin = lm.rope_cos[slots].float(), lm.rope_sin[slots].float()
                else:
                    cos, sin = (table.to(dev).float() for table in r)  # (T_i, Dh)
                    cos, sin = F.pad(cos, (0, 0, 0, t - length)), F.pad(sin, (0, 0, 0, t - length))
                cos_rows.append(cos)
                sin_rows.append(sin)
            hooks["rope"] = torch.stack(cos_rows), torch.stack(sin_rows)  # (B, T, Dh) each
        if vision_states is not None and any(s is not None for s in vision_states):
            ids = torch.cat([F.pad(i.to(dev), (0, t - i.shape[1]), value=-1) for i in input_ids])  # (B, T)
            layer_adds = self.batch_layer_adds(ids, vision_states)
            image_blocks = self.batch_image_blocks(ids, vision_states)
            if layer_adds is not None:
                hooks["layer_adds"] = layer_adds
            if image_blocks is not None:
                hooks["image_blocks"] = image_blocks
        return x, torch.tensor(lengths, device=dev), rows.to(dev)[:n], hooks

    def prefill_batch(self, embeds: list[torch.Tensor], rows: torch.Tensor, *,
                      input_ids: list[torch.Tensor] | None = None,
                      position_ids: list[torch.Tensor | None] | None = None,
                      vision_states: list | None = None) -> torch.Tensor:
        """Prefill several prompts at once into cache ``rows`` ``(B,)`` int64 (each from slot 0):
        ``embeds`` ``(1, T_i, D)`` each (right-padded to the longest), ``input_ids`` ``(1, T_i)``
        each (needed only with ``vision_states``), ``position_ids`` per row: the family's
        ``position_ids`` (M-RoPE ``(3, 1, T_i)``; None = the slots), ``vision_states`` per row: its
        :meth:`take_vision_state`. Returns each prompt's last logits ``(B, V)``; the same numbers
        as one :meth:`prefill` per prompt up to float reassociation (rows never attend to each other
        or to padding: causal attention over right padding). See :meth:`prefill_batch_inputs`."""
        x, lengths, rows, hooks = self.prefill_batch_inputs(embeds, rows, input_ids=input_ids,
                                                            position_ids=position_ids, vision_states=vision_states)
        return self.language_model.prefill_batch(x, lengths, rows, **hooks)
