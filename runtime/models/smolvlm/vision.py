"""SmolVLM's vision side: the SigLIP-style tower with NaViT-style positions, and the pixel-shuffle connector.

The tower is SigLIP (:mod:`edgevlm.runtime.models.blocks.siglip`: same blocks, same names under
``vision_model.``) with Idefics3's position scheme instead of interpolation (Dehghani et al., "Patch n'
Pack: NaViT", 2023; Laurençon et al., "Building and better understanding vision-language models"
(Idefics3), 2024): for each tile, the valid patch rows/columns (from the patch attention mask) are
mapped to fractional coordinates ``i / n_valid`` and bucketed into the trained ``S x S`` grid
(``torch.bucketize(..., right=True)`` over boundaries ``1/S, 2/S, ...``); padded patches get position
0 and are masked out as attention keys. A tile of the trained size with no padding gets positions
``0..S*S-1`` in raster order.

The connector (Idefics3 / SmolVLM ``SmolVLMConnector``) is a pixel shuffle (space-to-depth, Shi et
al., 2016) by ``scale_factor`` r: ``(N, S*S, D) -> (N, S*S / r^2, D * r^2)``, each output token holding
an ``r x r`` block of neighbouring patches, followed by a bias-free linear projection to the text width.
The channel order of the shuffle is transformers' (a width split, a transpose, a height split), so
``modality_projection.proj`` weights load unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from edgevlm.runtime.models.blocks.pixel_shuffle import pixel_shuffle
from edgevlm.runtime.models.blocks.siglip import SiglipEncoder, SiglipVisionConfig
from edgevlm.runtime.models.smolvlm.config import SmolVLMConfig


def patch_attention_mask(pixel_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Pixel mask ``(N, H, W)`` (nonzero = real pixel) -> patch mask ``(N, H//p, W//p)`` bool: a patch
    is valid when any of its pixels is (transformers' ``unfold`` + ``sum > 0``)."""
    n, h, w = pixel_mask.shape
    gh, gw = h // patch_size, w // patch_size
    blocks = pixel_mask[:, : gh * patch_size, : gw * patch_size].reshape(n, gh, patch_size, gw, patch_size)
    return blocks.to(torch.int64).sum(dim=(2, 4)) > 0


def bucketed_position_ids(patch_mask: torch.Tensor, grid_side: int) -> torch.Tensor:
    """Position ids ``(N, gh * gw)`` int64 for patch grids with validity ``patch_mask`` ``(N, gh, gw)``:
    fractional coordinates of the valid rows/columns bucketed into the trained ``grid_side`` grid,
    0 for padded patches (float32 arithmetic as transformers' ``SmolVLMVisionEmbeddings``)."""
    n, gh, gw = patch_mask.shape
    device = patch_mask.device
    boundaries = torch.arange(1 / grid_side, 1.0, 1 / grid_side, device=device)  # (S-1,)
    rows_valid = patch_mask[:, :, 0].sum(dim=1)  # (N,)
    cols_valid = patch_mask[:, 0, :].sum(dim=1)
    frac_h = torch.arange(gh, device=device, dtype=torch.float32)[None, :] * (1.0 / rows_valid)[:, None]
    frac_w = torch.arange(gw, device=device, dtype=torch.float32)[None, :] * (1.0 / cols_valid)[:, None]
    bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)  # (N, gh)
    bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)  # (N, gw)
    ids = (bucket_h[:, :, None] * grid_side + bucket_w[:, None, :]).reshape(n, -1)  # (N, gh*gw)
    return torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))


class SmolVLMVisionEmbeddings(nn.Module):
    """Conv patch embedding (with bias) + learned positions at bucketed fractional coordinates."""

    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``(N, C, H, W)``, ``patch_mask`` ``(N, H//p, W//p)`` bool -> ``(N, H//p * W//p, D)``."""
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)  # (N, h*w, D)
        ids = bucketed_position_ids(patch_mask, self.cfg.grid_side)  # (N, h*w)
        return x + self.position_embedding(ids).to(x.dtype)


class SmolVLMVisionTransformer(nn.Module):
    """``embeddings`` -> SigLIP ``encoder`` (padded patches masked as keys) -> ``post_layernorm``."""

    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = SmolVLMVisionEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``pixel_values`` ``(N, C, H, W)`` (H, W multiples of the patch), ``patch_mask``
        ``(N, H//p, W//p)`` bool or None (all valid) -> ``(N, H//p * W//p, D_vision)``."""
        p = self.cfg.patch_size
        n, _, h, w = pixel_values.shape
        if patch_mask is None:
            patch_mask = torch.ones(n, h // p, w // p, dtype=torch.bool, device=pixel_values.device)
        x = self.embeddings(pixel_values, patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(n, -1)  # (N, T) or None
        x, _ = self.encoder(x, key_mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Connector(nn.Module):
    """Pixel shuffle by ``scale_factor`` + ``modality_projection.proj`` (D_vision r^2 -> D_text, no bias)."""

    def __init__(self, cfg: SmolVLMConfig) -> None:
        super().__init__()
        self.scale_factor = cfg.scale_factor
        self.modality_projection = ModalityProjection(cfg.vision.hidden_size * cfg.scale_factor**2,
                                                      cfg.text.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, S*S, D_vision)`` -> ``(N, image_seq_len, D_text)``."""
        return self.modality_projection(pixel_shuffle(x, self.scale_factor))



# ---- exit hooks (early exit, edgevlm.runtime.adaptive) -----------------------------------------


class SmolVLMExitRun:
    """One block-by-block encode of one image's tiles (the :class:`edgevlm.runtime.adaptive.ViTRun`
    protocol): the tower's own embeddings, blocks (padded patches masked as keys), post-layernorm
    and connector, so a run without an exit equals ``connector(tower(...))`` exactly. The pooled
    heads read the last tile, the global image (the whole frame at tile size); pruning keeps each
    tile's own share of its ``image_seq_len`` tokens."""

    def __init__(self, tower: SmolVLMVisionTransformer, connector: Connector, pixel_values: torch.Tensor,
                 patch_mask: torch.Tensor | None = None) -> None:
        p = tower.cfg.patch_size
        n, _, h, w = pixel_values.shape
        if patch_mask is None:
            patch_mask = torch.ones(n, h // p, w // p, dtype=torch.bool, device=pixel_values.device)
        self.tower, self.connector = tower, connector
        self.grid = (h // p, w // p)
        self.x = tower.embeddings(pixel_values, patch_mask)  # (N_tiles, h*w, D)
        self.key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(n, -1)
        self.n_blocks = len(tower.encoder.layers)
        self.blocks_run = 0
        seq = (h // p) * (w // p) // connector.scale_factor ** 2
        self.token_groups = [seq] * n

    def step(self) -> torch.Tensor:
        self.x = self.tower.encoder.layers[self.blocks_run](self.x, self.key_mask)
        self.blocks_run += 1
        return self.x  # (N_tiles, h*w, D), raster order per tile

    def pooled_view(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        return hidden[-1:], self.grid  # the global image

    def finish(self, hidden: torch.Tensor, exit_block: int | None = None, adapter=None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = hidden if adapter is None else adapter(hidden).to(hidden.dtype)
        feats = self.connector(self.tower.post_layernorm(x))  # (N_tiles, image_seq_len, D_text)
        return feats.reshape(-1, feats.shape[-1]), []
