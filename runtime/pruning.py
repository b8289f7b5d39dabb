"""Visual-token pruning: keep the most informative vision tokens before the projector.

The score of a patch token is the attention the CLS token pays to it in the last vision block
that ran (averaged over heads) — the signal of "[CLS] attention" token pruning (EViT: Liang et
al., "Not All Patches are What You Need", ICLR 2022; FastV / SparseVLM use the same idea on the
decoder side). The alternative score is the L2 norm of the token's final feature (cheaper, no
attention needed). The ``k`` best tokens are kept **in their original order**, so the decoder
still sees them in raster order with consecutive positions; each kept token carries its own 2-D
position from the ViT's position embeddings.

``keep_ratio`` r keeps ``k = clamp(ceil(r * N), 1, N)`` of N patch tokens (a CLS token kept by the
``full`` select strategy is always kept and not counted in N). :func:`pruned_count` is torch-free
so the engine can size the prompt before any tensor exists.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SCORES = ("cls_attention", "feature_norm")
"""Token-scoring methods: CLS attention of the last run block, or the feature L2 norm."""


def pruned_count(n_tokens: int, keep_ratio: float | None) -> int:
    """Tokens kept out of ``n_tokens`` at ``keep_ratio`` (None or >= 1: all).

    Raises:
        ValueError: ``keep_ratio`` not in (0, 1] or ``n_tokens`` < 0.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if keep_ratio is None or n_tokens == 0:
        return n_tokens
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    # the small epsilon keeps e.g. 0.5 * 432 = 216 exact despite float rounding
    return max(1, min(n_tokens, math.ceil(keep_ratio * n_tokens - 1e-9)))


def select_tokens(
    tokens: torch.Tensor, scores: torch.Tensor, keep_ratio: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the top-scored tokens of each sample, in their original order.

    Args:
        tokens: ``(B, N, D)`` patch tokens (any dtype).
        scores: ``(B, N)`` importance, higher = keep (ties keep the earlier token).
        keep_ratio: fraction kept (see :func:`pruned_count`); None keeps everything.
    Returns:
        ``(kept (B, k, D), index (B, k) int64)`` with ``index`` ascending per row.
    Raises:
        ValueError: shape mismatch or a bad ``keep_ratio``.
    """
    import torch

    b, n, _ = tokens.shape
    if scores.shape != (b, n):
        raise ValueError(f"scores shape {tuple(scores.shape)} does not match tokens {tuple(tokens.shape)}")
    k = pruned_count(n, keep_ratio)
    if k == n:
        index = torch.arange(n, device=tokens.device).expand(b, n)
        return tokens, index
    # stable descending order: sort by (-score, position) so equal scores keep the earlier token
    order = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices  # (B, N)
    index = torch.sort(order[:, :k], dim=1).values  # (B, k) ascending = original order
    kept = torch.gather(tokens, 1, index[..., None].expand(b, k, tokens.shape[-1]))  # (B, k, D)
    return kept, index


def feature_norm_scores(tokens: torch.Tensor) -> torch.Tensor:
    """``(B, N, D)`` -> ``(B, N)`` float32 L2 norm of each token's feature."""
    return tokens.float().norm(dim=-1)
