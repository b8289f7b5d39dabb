"""Preallocated, static-shape KV cache (gpt-fast style).

Each decoder layer owns one :class:`KVCache` holding ``k`` and ``v`` buffers of shape
``(B, n_kv_heads, max_seq_len, head_dim)``, allocated once. Prefill writes positions
``[0, T)`` and decode writes one position with ``index_copy_`` at ``input_pos``; decode then
attends over the *whole* buffer with a mask (:func:`decode_mask`), so every decode step sees
tensors of identical shape — the property a CUDA graph capture needs (Ansel et al., "PyTorch 2",
2024; the gpt-fast reference implementation uses the same layout).

Buffers start as zeros and are never filled with NaN/Inf, so masked-out (stale or unused) slots
contribute exactly 0 to attention.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class KVCache(nn.Module):
    """One layer's key/value cache, ``(B, n_kv_heads, max_seq_len, head_dim)`` each."""

    def __init__(
        self,
        max_batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``(B, n_kv_heads, T, head_dim)`` at positions ``input_pos`` ``(T,)`` int64.

        Returns the full buffers ``(B, n_kv_heads, max_seq_len, head_dim)`` (views, not copies).
        """
        b = k.shape[0]
        self.k[:b].index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v[:b].index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k[:b], self.v[:b]

    def reset(self) -> None:
        """Zero the buffers (not needed between requests: positions past the prompt are masked)."""
        self.k.zero_()
        self.v.zero_()


def decode_mask(input_pos: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Boolean attention mask for decode at ``input_pos`` ``(T,)``: ``(1, 1, T, max_seq_len)``,
    True where key position ``<=`` the query's position (causal over the whole static buffer)."""
    keys = torch.arange(max_seq_len, device=input_pos.device)  # (S,)
    return (keys[None, :] <= input_pos[:, None])[None, None]  # (1, 1, T, S)


def cache_nbytes(n_layers: int, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype) -> int:
    """Bytes the KV caches of ``n_layers`` layers take (k and v)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * batch * n_kv_heads * max_seq_len * head_dim * elem
