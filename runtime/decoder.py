"""Llama-family decoder with a static KV cache and a prefill/decode split (gpt-fast style).

Architecture: Touvron et al., "LLaMA" (2023) — RMSNorm (Zhang & Sennrich 2019), rotary position
embeddings (Su et al., "RoFormer", 2021; the half-rotation layout of transformers' Llama), SwiGLU
MLP (Shazeer 2020), grouped-query attention (Ainslie et al., "GQA", 2023). Numerics mirror
transformers' ``LlamaForCausalLM``: RMSNorm in float32 then cast back before the weight, RoPE
tables computed in float32 and cast to the activation dtype, scale ``head_dim ** -0.5``.
Parameter names follow transformers' Llama so checkpoints load by name.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.config import TextConfig
from edgevlm.runtime.kv_cache import KVCache, decode_mask
from edgevlm.runtime.vision import activation

logger = logging.getLogger(__name__)



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
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``(max_seq_len, head_dim)`` float32 for RoPE ('default' type)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (Dh/2,)
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float)
    freqs = pos[:, None] * inv_freq.to(device)[None, :]  # (S, Dh/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, Dh)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, T, Dh)`` with ``cos``/``sin`` ``(T, Dh)`` (half-rotation layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention over a static KV cache."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=cfg.attention_bias)
        self.kv_cache: KVCache | None = None

    def _sdpa(self, q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        if self.n_kv_heads != self.n_heads:
            if sdpa_has_gqa():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, D)`` at positions ``input_pos`` ``(T,)`` -> ``(B, T, D)``.

        ``mask`` None means "prefill from position 0": causal attention over the first T cache
        slots; otherwise a boolean ``(1, 1, T, max_seq_len)`` mask over the whole cache (decode).
        """
        if self.kv_cache is None:
            raise RuntimeError("KV cache not set up: call setup_caches() first")
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all, v_all = self.kv_cache.update(input_pos, k, v)  # (B, Hkv, S, Dh)
        if mask is None:
            y = self._sdpa(q, k_all[:, :, :t], v_all[:, :, :t], None, is_causal=True)
        else:
            y = self._sdpa(q, k_all, v_all, mask, is_causal=False)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class MLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, input_pos, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token embedding, decoder layers, final RMSNorm and LM head (``lm_head`` may be tied)."""

    def __init__(self, cfg: TextConfig, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_seq_len = 0
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the static KV caches ``(B, n_kv_heads, max_seq_len, head_dim)`` per layer and the
        RoPE tables, on the device/dtype of the weights."""
        w = self.embed_tokens.weight
        self.max_seq_len = max_seq_len
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(
                max_batch_size, self.cfg.num_key_value_heads, max_seq_len, self.cfg.head_dim,
                dtype=w.dtype, device=w.device,
            )
        self.rope_cos, self.rope_sin = rope_tables(self.cfg.head_dim, max_seq_len, self.cfg.rope_theta, w.device)

    def forward(self, embeds: torch.Tensor, input_pos: torch.Tensor, *, prefill: bool,
                all_logits: bool = False) -> torch.Tensor:
        """Run the decoder on ``embeds`` ``(B, T, D)`` at positions ``input_pos`` ``(T,)`` int64.

        ``prefill=True`` requires ``input_pos == arange(T)`` (causal attention over the first T
        slots); ``prefill=False`` attends over the whole static cache with a mask (decode, or a
        continuation prefill). Returns logits ``(B, V)`` of the last position, or ``(B, T, V)``
        with ``all_logits``, in the weights' dtype.
        """
        if self.rope_cos is None:
            raise RuntimeError("caches not set up: call setup_caches() first")
        cos = self.rope_cos[input_pos].to(embeds.dtype)  # (T, Dh)
        sin = self.rope_sin[input_pos].to(embeds.dtype)
        mask = None if prefill else decode_mask(input_pos, self.max_seq_len)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask)
        x = self.norm(x if all_logits else x[:, -1:])
        logits = self.lm_head(x)  # (B, T|1, V)
        return logits if all_logits else logits[:, -1]
