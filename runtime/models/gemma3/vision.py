"""Gemma 3's vision side: the SigLIP tower and ``Gemma3MultiModalProjector``.

The tower is SigLIP (:mod:`edgevlm.runtime.models.blocks.siglip`, So400m/14 at 896 px in the
released models: a 64 x 64 patch grid, no CLS token); Gemma 3 reads ``last_hidden_state``, the last
block's output after ``post_layernorm``. The projector (Gemma Team, "Gemma 3 Technical Report",
2025, section 2.1; transformers' ``Gemma3MultiModalProjector``): the ``(S*S, D_v)`` states reshaped
to the ``S x S`` grid, average-pooled with a ``k x k`` window and stride (``k = S /
sqrt(mm_tokens_per_image)``: 4 x 4 -> 256 tokens), flattened in raster order, a unit-offset RMSNorm
(``mm_soft_emb_norm``, eps = the tower's ``layer_norm_eps``), then ``x @ mm_input_projection_weight``
with the weight stored ``(D_v, D_text)`` (no transpose, no bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.decoder import UnitOffsetNorm
from edgevlm.runtime.models.blocks.siglip import SiglipVisionTransformer
from edgevlm.runtime.models.gemma3.config import Gemma3Config


class Gemma3Projector(nn.Module):
    """Average pool + ``mm_soft_emb_norm`` + ``mm_input_projection_weight``: ``(N, S*S, D_v)`` ->
    ``(N, mm_tokens_per_image, D_text)`` in the input's dtype."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        v = cfg.vision
        self.grid_side, self.kernel = v.grid_side, cfg.pool_kernel
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden_size, cfg.text.hidden_size))
        self.mm_soft_emb_norm = UnitOffsetNorm(v.hidden_size, v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        s, k = self.grid_side, self.kernel
        grid = x.transpose(1, 2).reshape(n, d, s, s).contiguous()  # (N, D_v, S, S)
        pooled = F.avg_pool2d(grid, kernel_size=k, stride=k).flatten(2).transpose(1, 2)  # (N, (S/k)^2, D_v)
        h = self.mm_soft_emb_norm(pooled)
        return torch.matmul(h, self.mm_input_projection_weight).type_as(x)  # (N, (S/k)^2, D_text)


def make_tower(cfg: Gemma3Config) -> SiglipVisionTransformer:
    """The SigLIP tower without its pooling head (names ``embeddings.*``, ``encoder.layers.{i}.*``,
    ``post_layernorm``)."""
    return SiglipVisionTransformer(cfg.vision, use_head=False)


# ---- exit hooks (early exit, edgevlm.runtime.adaptive) -----------------------------------------


class Gemma3ExitRun:
    """One block-by-block encode of one request's images (the :class:`edgevlm.runtime.adaptive.ViTRun`
    protocol): the tower's own embeddings, blocks, ``post_layernorm`` and the projector, so a run
    without an exit equals ``projector(tower(...).last_hidden_state)`` exactly. The pooled heads read
    the last image; pruning keeps each image's own share of its ``mm_tokens_per_image`` tokens."""

    def __init__(self, tower: SiglipVisionTransformer, projector: Gemma3Projector, cfg: Gemma3Config,
                 pixel_values: torch.Tensor) -> None:
        self.tower, self.projector = tower, projector
        self.grid = (cfg.vision.grid_side, cfg.vision.grid_side)
        self.x = tower.embeddings(pixel_values)  # (N_img, S*S, D)
        self.n_blocks = len(tower.encoder.layers)
        self.blocks_run = 0
        self.token_groups = [cfg.mm_tokens_per_image] * int(pixel_values.shape[0])

    def step(self) -> torch.Tensor:
        self.x = self.tower.encoder.layers[self.blocks_run](self.x, None)
        self.blocks_run += 1
        return self.x  # (N_img, S*S, D), raster order per image

    def pooled_view(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        return hidden[-1:], self.grid  # the last image

    def finish(self, hidden: torch.Tensor, exit_block: int | None = None, adapter=None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = hidden if adapter is None else adapter(hidden).to(hidden.dtype)
        feats = self.projector(self.tower.post_layernorm(x))  # (N_img, mm_tokens, D_text)
        return feats.reshape(-1, feats.shape[-1]), []
