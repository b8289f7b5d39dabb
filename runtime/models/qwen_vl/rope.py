"""Multimodal RoPE (M-RoPE) of the Qwen-VL families: 3-row position ids and per-token cos/sin tables.

Source: Qwen2-VL (Wang et al., 2024, section 2.1 "Multimodal Rotary Position Embedding") and the rules of
transformers' ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index`` (5.x):

- a text token has the same position in the temporal, height and width rows; positions count up by 1;
- a vision item (an image or a video, ``grid_thw`` in patches) gives its ``llm_t * llm_h * llm_w``
  tokens (``llm_h = grid_h / merge_size``, ``llm_w`` likewise, ``llm_t = grid_t``) the positions
  ``start + (t * time_interval).long()`` (temporal), ``start + h`` and ``start + w``, ``start`` being
  the next text position; the text after it continues at ``start + max(llm_h, llm_w)``;
- ``time_interval`` is 1 for images; for a Qwen2.5-VL video ``tokens_per_second *
  second_per_grid_t`` (seconds one temporal patch spans), so temporal positions follow the frames'
  timestamps;
- ``rope_delta = max(positions) + 1 - T``: decode step ``s`` (cache slot ``s``) uses position
  ``s + rope_delta`` in all three rows.

The cos/sin tables: ``freqs = position[row] * inv_freq`` per row; the ``head_dim / 2`` frequencies are
split into ``mrope_section`` ``(t, h, w)`` parts taken from rows 0, 1, 2 in turn (Qwen2-VL /
Qwen2.5-VL, "sequential"), or, interleaved (Qwen3-VL), frequency ``j`` comes from row 1 when ``j % 3 ==
1 and j < 3 * section_h``, from row 2 when ``j % 3 == 2 and j < 3 * section_w``, else from row 0;
then ``[freqs, freqs]`` (half-rotation layout) -> ``cos``, ``sin`` ``(T, head_dim)`` float32.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpan:
    """One image or video of a prompt, for :func:`mrope_position_ids`.

    ``token_id``: its placeholder token (image or video pad); ``grid_thw``: ``(t, h, w)`` in patches
    (the processor's ``grid_thw`` row); ``time_interval``: temporal position step per temporal patch."""

    token_id: int
    grid_thw: tuple[int, int, int]
    time_interval: float = 1.0


def vision_position_ids(start: int, grid_thw: tuple[int, int, int], merge_size: int,
                        time_interval: float = 1.0) -> torch.Tensor:
    """Positions ``(3, llm_t * llm_h * llm_w)`` int64 of one vision item's tokens (row-major
    ``t, h, w``, the merger's output order) starting at text position ``start``."""
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    temporal = (torch.arange(t) * time_interval).long() + start  # float32 product, truncated, as transformers
    rows = torch.meshgrid(temporal, torch.arange(h) + start, torch.arange(w) + start, indexing="ij")
    return torch.stack(rows).reshape(3, -1)


def mrope_position_ids(input_ids: torch.Tensor, spans: list[VisionSpan], merge_size: int) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a prompt: ``input_ids`` ``(T,)`` or ``(1, T)`` int64 whose vision
    placeholders appear as runs of ``span.token_id``, ``spans`` in prompt order.

    Returns ``(position_ids (3, T) int64, rope_delta)``.

    Raises:
        ValueError: a placeholder run does not match the next span (token id or token count), or
            spans are left over.
    """
    ids = input_ids.reshape(-1).tolist()
    span_tokens = {s.token_id for s in spans}
    pending = iter(spans)
    parts: list[torch.Tensor] = []
    pos = 0
    i = 0
    for token, run in itertools.groupby(ids, key=lambda t: t if t in span_tokens else None):
        n = len(list(run))
        if token is None:
            parts.append(torch.arange(pos, pos + n).expand(3, -1))
            pos += n
        else:
            while n:
                span = next(pending, None)
                if span is None or span.token_id != token:
                    raise ValueError(f"placeholder run of token {token} at {i} has no matching vision item")
                t, h, w = span.grid_thw
                count = t * (h // merge_size) * (w // merge_size)
                if count > n:
                    raise ValueError(f"vision item {span.grid_thw} needs {count} placeholder tokens, found {n} at {i}")
                parts.append(vision_position_ids(pos, span.grid_thw, merge_size, span.time_interval))
                pos += max(h, w) // merge_size
                n -= count
                i += count
            continue
        i += n
    if next(pending, None) is not None:
        raise ValueError("more vision items than placeholder runs in the prompt")
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.to(torch.int64), delta


def mrope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section: tuple[int, ...],
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token RoPE tables ``cos``, ``sin`` ``(T, head_dim)`` float32 from ``position_ids`` ``(3, T)``
    and the decoder's ``inv_freq`` ``(head_dim / 2,)`` (``rope_inv_freq``), see the module doc.

    Raises ValueError when ``mrope_section`` does not sum to ``head_dim / 2``."""
    half = inv_freq.shape[0]
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {tuple(mrope_section)} must sum to head_dim / 2 = {half}")
    freqs = position_ids.reshape(3, -1).float()[..., None] * inv_freq.float().to(position_ids.device)  # (3, T, Dh/2)
    if interleaved:
        out = freqs[0].clone()
        for row in (1, 2):
            idx = slice(row, mrope_section[row] * 3, 3)
            out[..., idx] = freqs[row, ..., idx]
    else:
        chunks = freqs.split(list(mrope_section), dim=-1)
        out = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)  # (T, Dh/2)
    emb = torch.cat([out, out], dim=-1)  # (T, Dh)
    return emb.cos(), emb.sin()
