"""Visual-token pruning: keep the most informative vision tokens before the decoder.

Towers with a CLS token (CLIP): the score of a patch token is the attention the CLS token pays to
it in the last vision block that ran (averaged over heads) — the signal of "[CLS] attention" token
pruning (EViT: Liang et al., "Not All Patches are What You Need", ICLR 2022; FastV / SparseVLM use
the same idea on the decoder side).

Towers without one (SigLIP in LLaVA, Qwen2.5-VL, Qwen3-VL, SmolVLM): the L2 norm of each token's
feature — for Qwen and SmolVLM of the *connector's output* (the merged / pixel-shuffled tokens the
decoder receives), so the score needs no attention map and no CLS. Norm as an importance signal:
Kobayashi et al., "Attention is Not Only a Weight: Analyzing Transformers with Vector Norms" (EMNLP
2020) show a token's contribution scales with the norm of its transformed vector, not only its
attention weight; Darcet et al., "Vision Transformers Need Registers" (ICLR 2024) find that ViT
tokens with large norms are the ones carrying global image information.

The ``k`` best tokens are kept **in their original order**. LLaVA: the decoder sees them in raster
order (each keeping its ViT position embedding; prefill gives them their unpruned RoPE distances).
Qwen (multimodal RoPE): each kept token keeps its own ``(t, h, w)`` position
(:func:`pruned_position_ids`). SmolVLM: each tile keeps its own share, the prompt's per-tile runs
shrink to match (:func:`pruned_tokens_per_item`).

``keep_ratio`` r keeps ``k = clamp(ceil(r * N), 1, N)`` of N tokens per group (a CLS token kept by
the ``full`` select strategy is always kept and not counted in N). :func:`pruned_count` and
:func:`pruned_tokens_per_item` are torch-free so the engine can size the prompt before any tensor
exists.
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


# ---- towers without a CLS token: groups of connector output tokens (Qwen, SmolVLM) -----------


def pruned_tokens_per_item(vision, keep_ratio: float | None) -> list[int]:
    """Vision tokens each item of ``vision`` (a :class:`~edgevlm.runtime.models.base.VisionInput`)
    keeps at ``keep_ratio``: every pruning group (``vision.token_groups``, default one per item)
    keeps :func:`pruned_count` of its tokens. Torch-free, so the engine sizes the prompt first.

    Raises:
        ValueError: a bad ``keep_ratio``, or groups that do not add up to the items' tokens.
    """
    groups = vision.token_groups if vision.token_groups is not None else list(vision.tokens_per_item)
    if sum(groups) != vision.num_tokens:
        raise ValueError(f"token groups {groups} do not add up to {vision.num_tokens} vision tokens")
    out, it = [], iter(groups)
    for n in vision.tokens_per_item:
        kept = 0
        while n > 0:
            g = next(it)
            kept += pruned_count(g, keep_ratio)
            n -= g
        out.append(kept)
    return out


def select_in_groups(tokens: torch.Tensor, groups: list[int], keep_ratio: float | None) -> torch.Tensor:
    """Indices of the tokens kept by feature-norm pruning, group by group.

    Args:
        tokens: ``(N, D)`` connector output tokens (what the decoder receives), prompt order.
        groups: token counts of consecutive groups (summing to N); each keeps
            :func:`pruned_count` of its own tokens (SmolVLM: one group per tile).
        keep_ratio: fraction kept; None or 1 keeps everything.
    Returns:
        ``(N',)`` int64, ascending (kept tokens stay in their original order).
    Raises:
        ValueError: groups that do not add up to N, or a bad ``keep_ratio``.
    """
    import torch

    if sum(groups) != tokens.shape[0]:
        raise ValueError(f"token groups {groups} do not add up to {tokens.shape[0]} tokens")
    index, start = [], 0
    for g in groups:
        chunk = tokens[start:start + g][None]  # (1, g, D)
        _, kept = select_tokens(chunk, feature_norm_scores(chunk), keep_ratio)  # (1, k)
        index.append(kept[0] + start)
        start += g
    return torch.cat(index) if index else torch.zeros(0, dtype=torch.long, device=tokens.device)


def expand_vision_run(ids: list[int], vision_token_ids: set[int], n_full: int) -> tuple[list[int], int, int]:
    """The unpruned prompt of a pruned one: the single run of vision placeholder tokens in ``ids``
    (``n_kept`` long) widened to ``n_full``. Returns ``(full ids, run start, n_kept)``.

    Raises ValueError when the vision placeholders do not form one run."""
    slots = [i for i, t in enumerate(ids) if t in vision_token_ids]
    if not slots or slots[-1] - slots[0] + 1 != len(slots):
        raise ValueError("token pruning needs the vision placeholders of one image as one run")
    start, n_kept = slots[0], len(slots)
    return ids[:start] + [ids[start]] * n_full + ids[start + n_kept:], start, n_kept


def pruned_position_ids(full_positions: torch.Tensor, start: int, n_full: int,
                        kept_index: list[int]) -> tuple[torch.Tensor, int]:
    """Multimodal-RoPE positions of a pruned prompt: the unpruned prompt's positions
    ``full_positions`` ``(3, 1, T_full)`` with the dropped vision tokens' columns removed, so
    every kept vision token keeps its own ``(t, h, w)`` position and the text after the image
    keeps its position (as without pruning). Returns ``((3, 1, T) int64, rope_delta)`` with
    ``rope_delta = max(position) + 1 - T``: decoding continues right after the prompt's largest
    position, as for an unpruned prompt.

    Raises ValueError for kept indices outside ``0..n_full-1``."""
    import torch

    t_full = full_positions.shape[-1]
    kept = torch.as_tensor(kept_index, dtype=torch.long)
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= n_full):
        raise ValueError(f"kept vision token indices outside 0..{n_full - 1}")
    cols = torch.cat([torch.arange(start), start + kept, torch.arange(start + n_full, t_full)])
    pos = full_positions[..., cols.to(full_positions.device)]
    return pos, int(pos.max()) + 1 - pos.shape[-1]
