"""Early exit and token pruning on a native-resolution ViT without a CLS token (Qwen2.5-VL,
Qwen3-VL, SmolVLM), family-independent.

A family's tower hands out a :class:`ViTRun` (``exit_run`` in its ``vision.py``): one encode of
one request's pixels, block by block. :func:`encode_adaptive` walks it with the exit heads of
:mod:`edgevlm.runtime.exits` (the same cascade as LLaVA's, :func:`edgevlm.runtime.vision.exit_plan`):

- after each exit block ``k`` of the plan, the pooled confidence head reads block k's per-patch
  states in raster order (``LN(mean of the patches)`` in the CLS slot, as for SigLIP, plus the
  question embedding for question-conditioned heads); at ``confidence >= exit_threshold`` (or
  always, for a forced ``exit_layer``) the encoder stops;
- the exit adapter maps block k's states ``(B, T, D)`` to the states the tower's last block would
  have produced, which then go through the family's own connector (Qwen: the 2x2 merger;
  SmolVLM: post-layernorm + pixel shuffle + projection). Qwen3-VL's DeepStack mergers of layers
  deeper than k read the adapter's output too (the only stand-in for states that were never
  computed; the mergers of layers up to k read the real states), so the decoder's DeepStack adds
  keep their shapes and the calibration measures the answers they give;
- token pruning (``keep_ratio``) scores the connector's output tokens by feature norm
  (:func:`edgevlm.runtime.pruning.select_in_groups`) and keeps the best of each group in order;
  DeepStack features are pruned with the same index.

With no exit and no pruning the result equals the family's ``encode_vision`` exactly (the run is
the tower's own blocks in its own order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from edgevlm.runtime.vision import VisionInfo, exit_plan
from edgevlm.runtime.vision_cache import VisionTrunk


class ViTRun(Protocol):
    """One block-by-block encode of a family's tower (see the module doc).

    Attributes:
        n_blocks: blocks of the full tower.
        blocks_run: blocks run so far.
        token_groups: connector output tokens of each pruning group, in prompt order.
    """

    n_blocks: int
    blocks_run: int
    token_groups: list[int]

    def step(self) -> torch.Tensor:
        """Run the next block; its output ``(B, T, D)`` in the tower's own token order."""
        ...

    def pooled_view(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """``hidden`` ``(B, T, D)`` -> ``((1, h*w, D) patch tokens in raster order, (h, w))`` for
        the pooled heads. Raises ValueError for inputs without one grid (several images)."""
        ...

    def finish(self, hidden: torch.Tensor, exit_block: int | None = None,
               adapter: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The connector on ``hidden`` (block ``exit_block``'s output mapped by ``adapter``; None:
        the last block's output): ``((N_tokens, D_text) vision tokens in prompt order, side
        features)`` (Qwen3-VL: the DeepStack features ``(N_tokens, D_text)`` each; else ``[]``)."""
        ...


def encode_adaptive(run: ViTRun, heads, *, exit_layer: int | None = None, exit_threshold: float | None = None,
                    keep_ratio: float | None = None, query: torch.Tensor | None = None,
                    seen: dict[int, torch.Tensor] | None = None,
                    finished: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] | None = None
                    ) -> tuple[torch.Tensor, list[torch.Tensor], VisionInfo]:
    """Walk ``run`` with early exit and token pruning (see the module doc).

    Args:
        run: a family's :class:`ViTRun`, nothing run yet.
        heads: the model's :class:`~edgevlm.runtime.exits.ExitHeads`, or None.
        exit_layer, exit_threshold: the operating point's exit knobs (:func:`exit_plan`).
        keep_ratio: fraction of the connector's output tokens kept per group (None: all).
        query: ``(1, Q)`` question embedding for question-conditioned confidence heads.
        seen: block -> its output for the blocks ``run`` has run already (a
            :class:`~edgevlm.runtime.vision_cache.VisionTrunk`'s: a run resumed on a later question
            about the same frame): those are read, not run again; the exit blocks and the last block
            run here are added to it. None: ``run`` starts at block 0 and nothing is kept.
        finished: exit block (the last block for the full depth) -> the connector's ``(tokens,
            side features)`` made there for an earlier question about the frame (the trunk's):
            returned as they are, and what is made here is added.
    Returns:
        ``((N', D_text) vision tokens, side features pruned alike, VisionInfo)``.
    Raises:
        ValueError: a bad exit request (no heads, not an exit point) or ``keep_ratio``.
    """
    from edgevlm.runtime.pruning import pruned_count, select_in_groups

    if keep_ratio is not None:
        pruned_count(1, keep_ratio)  # validates (0, 1]
    plan = dict(exit_plan(heads.exit_blocks if heads is not None else [], run.n_blocks, exit_layer, exit_threshold))
    info = VisionInfo(exit_layers=[None], exit_confidences=[None])
    exited = None
    hidden = None
    done = run.blocks_run  # > 0 only for a resumed run (then ``seen`` holds its exit blocks)
    exit_blocks = set(heads.exit_blocks) if heads is not None else set()
    i = 0
    while i < run.n_blocks:
        i += 1
        if i <= done:  # run on an earlier question about this frame
            if i not in plan and i != run.n_blocks:
                continue
            hidden = seen[i]
        else:
            hidden = run.step()
            # every exit block, not only this plan's: a later plan (another exit_layer cap) may read it
            if seen is not None and (i in plan or i in exit_blocks or i == run.n_blocks):
                seen[i] = hidden
        if i not in plan:
            continue
        threshold = plan[i]
        if threshold is not None:
            x, grid = run.pooled_view(hidden)
            conf = float(heads.confidence_at(i, x, grid, query)[0])
            info.exit_confidences[0] = conf
            if conf < threshold:
                continue
        exited = i
        break
    info.blocks_run = i
    end = exited if exited is not None else run.n_blocks
    if exited is not None:
        info.exit_layers[0] = exited
    if finished is not None and end in finished:  # this exit's tokens, made for an earlier question
        tokens, side = finished[end]
    elif exited is not None:
        tokens, side = run.finish(hidden, exited, lambda h: heads.adapt(exited, h))
    else:
        tokens, side = run.finish(hidden)
    if finished is not None:
        finished[end] = (tokens, side)
    info.tokens_total = tokens.shape[0]
    if keep_ratio is not None and keep_ratio < 1.0:
        index = select_in_groups(tokens, run.token_groups, keep_ratio)  # (N',) ascending
        tokens = tokens[index]
        side = [s[index] for s in side]
        info.kept_index = [index.tolist()]
    info.tokens_kept = tokens.shape[0]
    return tokens, side, info


def encode_model_adaptive(model, vision, operating_point=None, prompt_ids: torch.Tensor | None = None,
                          trunk: VisionTrunk | None = None) -> tuple[torch.Tensor, list[torch.Tensor], VisionInfo]:
    """:func:`encode_adaptive` over ``model.exit_run(vision)`` with ``model.exit_heads`` and the
    operating point's knobs (None: the full tower, every token); ``prompt_ids`` ``(1, T)`` int64
    feed question-conditioned confidence heads; ``trunk``: the frame's kept walk (its run resumed,
    its exit blocks read; see :mod:`edgevlm.runtime.vision_cache`). Returns what
    :func:`encode_adaptive` returns."""
    op = operating_point
    run = trunk.run if trunk is not None and trunk.run is not None else model.exit_run(vision)
    out = encode_adaptive(run, model.exit_heads, exit_layer=getattr(op, "exit_layer", None),
                          exit_threshold=getattr(op, "exit_threshold", None), keep_ratio=getattr(op, "keep_ratio", None),
                          query=question_embedding(model, prompt_ids), seen=trunk.seen if trunk is not None else None,
                          finished=trunk.tokens if trunk is not None else None)
    if trunk is not None:
        trunk.run, trunk.blocks_run = run, run.blocks_run
    return out


def question_embedding(model, prompt_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The question embedding ``(1, Q)`` the model's question-conditioned confidence heads read
    (:func:`edgevlm.runtime.exits.query_embedding` over ``prompt_ids`` ``(1, T)``, vision
    placeholders left out); None without a prompt or without such heads."""
    heads = getattr(model, "exit_heads", None)
    if prompt_ids is None or heads is None or not heads.needs_query:
        return None
    from edgevlm.runtime.exits import query_embedding

    embed = model.language_model.embed_tokens
    ids = prompt_ids.to(embed.weight.device)
    video = getattr(model.cfg, "video_token_id", None)
    if video is not None:  # video placeholders are vision tokens too
        ids = torch.where(ids == video, torch.full_like(ids, model.cfg.image_token_id), ids)
    return query_embedding(embed, ids, model.cfg.image_token_id)


def attach(model, heads):
    """``heads`` moved to ``model``'s device and dtype, in eval mode (None stays None): what a
    model's ``attach_exit_heads`` stores."""
    return heads.to(model.device, model.dtype).eval() if heads is not None else None
