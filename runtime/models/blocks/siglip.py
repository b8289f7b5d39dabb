"""SigLIP vision transformer: the vision block shared by LLaVA-SigLIP and SmolVLM.

Architecture: Zhai et al., "Sigmoid Loss for Language Image Pre-Training" (SigLIP, 2023) — a ViT
(Dosovitskiy et al., 2021) with a conv patch embedding *with* bias, learned position embeddings and
no CLS token, pre-LN blocks (LayerNorm -> attention, LayerNorm -> MLP with ``gelu_pytorch_tanh``), a
final ``post_layernorm`` and an optional multi-head attention pooling head (MAP, Lee et al., "Set
Transformer", 2019). Parameter names follow transformers' ``SiglipVisionModel`` (its 4.x ``vision_model.`` prefix
dropped, as transformers 5 saves them) so checkpoints load by name: ``embeddings.patch_embedding``,
``embeddings.position_embedding``, ``encoder.layers.{i}.{layer_norm1,self_attn.{q,k,v,out}_proj,
layer_norm2,mlp.fc1,mlp.fc2}``, ``post_layernorm``, ``head.*``.

Facts carried over from transformers' ``SiglipVisionEmbeddings``:

* the patch grid is ``image_size // patch_size`` per side (an ``image_size`` that is not a multiple of
  ``patch_size`` is floored, e.g. so400m-patch14-384: 27 x 27 = 729 positions), the conv uses
  ``padding="valid"`` so extra border pixels are dropped;
* other grid sizes: with ``interpolate_pos_encoding`` the square table is resized bicubically
  (``align_corners=False``, DINO's recipe) to the input's patch grid, unchanged when the input is
  square and has exactly the trained number of patches; without it the input must have the trained
  number of patches.

SmolVLM / Idefics3 use the same blocks with their own position scheme (bucketed fractional positions
and a patch attention mask, see :mod:`edgevlm.runtime.models.smolvlm.vision`); the blocks take an
optional key mask for that. The block itself is CLIP's (:class:`edgevlm.runtime.vision.VisionBlock`:
the same pre-LN layout and parameter names, the activation and LayerNorm epsilon from the config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.models.blocks.siglip_config import SiglipVisionConfig
from edgevlm.runtime.vision import VisionBlock, VisionMLP


def interpolate_positions(table: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Resize a square position table ``(S*S, D)`` to ``(grid_h * grid_w, D)`` bicubically
    (``align_corners=False``), in raster order. Raises ``ValueError`` if the table is not square."""
    n, d = table.shape
    side = round(n**0.5)
    if side * side != n:
        raise ValueError(f"position table of {n} entries is not a square grid")
    grid = table.reshape(1, side, side, d).permute(0, 3, 1, 2)  # (1, D, S, S)
    grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(grid_h * grid_w, d)  # (h*w, D)


class SiglipVisionEmbeddings(nn.Module):
    """Conv patch embedding (with bias) + learned position embeddings, no CLS token."""

    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)

    def patchify(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """``(B, C, H, W)`` -> patch embeddings ``(B, h*w, D)`` (raster order) and the grid ``h, w``
        (``H // patch``, ``W // patch``: border pixels past the last full patch are dropped)."""
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(w.dtype))  # (B, D, h, w)
        grid_h, grid_w = patches.shape[-2:]
        return patches.flatten(2).transpose(1, 2), grid_h, grid_w

    def position_embeddings(self, grid_h: int, grid_w: int, interpolate: bool) -> torch.Tensor:
        """Position embeddings ``(grid_h * grid_w, D)`` for a patch grid.

        Raises:
            ValueError: the grid does not have the trained number of patches and ``interpolate``
                is False (transformers' ``interpolate_pos_encoding=False`` fails the same way).
        """
        table = self.position_embedding.weight  # (S*S, D)
        if grid_h * grid_w == table.shape[0] and (grid_h == grid_w or not interpolate):
            return table
        if not interpolate:
            raise ValueError(
                f"input gives a {grid_h}x{grid_w} patch grid but the position table has {table.shape[0]} entries "
                "(pass interpolate_pos_encoding=True)"
            )
        return interpolate_positions(table, grid_h, grid_w)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, (H//p) * (W//p), D)``."""
        x, grid_h, grid_w = self.patchify(pixel_values)
        return x + self.position_embeddings(grid_h, grid_w, interpolate_pos_encoding).to(x.dtype)


class SiglipEncoder(nn.Module):
    """The stack of :class:`VisionBlock` (``encoder.layers.{i}`` in checkpoints)."""

    def __init__(self, cfg: SiglipVisionConfig, num_blocks: int | None = None) -> None:
        super().__init__()
        n = cfg.num_hidden_layers if num_blocks is None else num_blocks
        self.layers = nn.ModuleList([VisionBlock(cfg) for _ in range(n)])

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                keep_hidden_states: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``x`` ``(B, T, D)`` -> the last block's output and, with ``keep_hidden_states``, the list
        ``[input, block_1, ..., block_n]`` (transformers' ``hidden_states`` convention); else ``[]``."""
        states = [x] if keep_hidden_states else []
        for layer in self.layers:
            x = layer(x, key_mask)
            if keep_hidden_states:
                states.append(x)
        return x, states


class SiglipPoolingHead(nn.Module):
    """Multi-head attention pooling: a learned probe attends over the tokens, then LN + MLP residual."""

    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, cfg.hidden_size))
        self.attention = nn.MultiheadAttention(cfg.hidden_size, cfg.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, D)`` -> pooled ``(B, D)``."""
        probe = self.probe.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, D)
        h = self.attention(probe, x, x, need_weights=False)[0]  # (B, 1, D)
        h = h + self.mlp(self.layernorm(h))
        return h[:, 0]


@dataclass
class SiglipOutput:
    """``last_hidden_state`` ``(B, N, D)`` after ``post_layernorm`` (None when the encoder was built
    truncated); ``hidden_states`` ``[embeddings, block_1, ..., block_n]`` each ``(B, N, D)`` (without
    post-LN, empty unless asked for); ``pooler_output`` ``(B, D)`` from the head (None without)."""

    last_hidden_state: torch.Tensor | None
    hidden_states: list[torch.Tensor]
    pooler_output: torch.Tensor | None = None


class SiglipVisionTransformer(nn.Module):
    """SigLIP ViT: embeddings -> encoder -> ``post_layernorm`` (-> pooling head).

    ``num_blocks`` < ``num_hidden_layers`` builds a truncated tower for callers that read an earlier
    layer (LLaVA's ``vision_feature_layer``); then ``post_layernorm`` and the head are not built and
    ``last_hidden_state`` is None.
    """

    def __init__(self, cfg: SiglipVisionConfig, num_blocks: int | None = None, use_head: bool | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        n = cfg.num_hidden_layers if num_blocks is None else num_blocks
        if not 0 <= n <= cfg.num_hidden_layers:
            raise ValueError(f"num_blocks {n} is outside 0..{cfg.num_hidden_layers}")
        self.full_depth = n == cfg.num_hidden_layers
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg, n)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if self.full_depth else None
        head = cfg.vision_use_head if use_head is None else use_head
        self.head = SiglipPoolingHead(cfg) if head and self.full_depth else None

    def num_patches(self, height_px: int, width_px: int) -> int:
        """Vision tokens for an input of ``height_px x width_px``."""
        p = self.cfg.patch_size
        return (height_px // p) * (width_px // p)

    def forward(self, pixel_values: torch.Tensor, *, interpolate_pos_encoding: bool = False,
                output_hidden_states: bool = False) -> SiglipOutput:
        """``pixel_values`` ``(B, C, H, W)`` normalised image (H, W at least one patch).

        Raises ``ValueError`` for a grid other than the trained one without ``interpolate_pos_encoding``,
        or an input smaller than one patch."""
        p = self.cfg.patch_size
        if pixel_values.shape[-2] < p or pixel_values.shape[-1] < p:
            raise ValueError(f"input {tuple(pixel_values.shape[-2:])} is smaller than one {p}x{p} patch")
        x = self.embeddings(pixel_values, interpolate_pos_encoding)  # (B, N, D)
        x, states = self.encoder(x, keep_hidden_states=output_hidden_states)
        if self.post_layernorm is None:
            return SiglipOutput(None, states)
        last = self.post_layernorm(x)
        pooled = self.head(last) if self.head is not None else None
        return SiglipOutput(last, states, pooled)


#: checkpoint name -> :class:`SiglipVisionTransformer` name: transformers 5's ``SiglipVisionModel``
#: saves the names unprefixed, 4.x checkpoints (e.g. google/siglip-*) under ``vision_model.``.
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"^(vision_model\.)?embeddings\.position_ids$", None),
    (r"^(?:vision_model\.)?(.*)$", r"\1"),
)
