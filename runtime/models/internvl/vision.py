"""InternVL's vision side: the InternViT tower and the pixel-shuffle + MLP projector.

InternViT (Chen et al., "InternVL: Scaling up Vision Foundation Models and Aligning for Generic
Visual-Linguistic Tasks", 2024; the 300M tower of InternVL2.5 / 3 / 3.5) as transformers'
``InternVLVisionModel`` runs it:

* embeddings: a conv patch embedding (with bias), a learned CLS token prepended, learned absolute
  position embeddings ``(1, 1 + S*S, D)`` added (tiles are always the trained ``S x S`` grid, so no
  interpolation is needed);
* blocks (timm's ``Block`` with layer scale, Touvron et al., "Going deeper with Image Transformers"
  (CaiT), 2021): ``x + lambda_1 * attn(norm_before(x))``, then ``x + lambda_2 * mlp(norm_after(x))``;
  the norms are LayerNorm or RMSNorm (``norm_type``); attention is bidirectional with optional q/k
  RMSNorm over the whole width (not per head; eps 1e-6) before the head split;
* ``layernorm`` after the last block only when ``use_mean_pooling`` is false (else identity).

The projector (transformers' ``InternVLModel.get_image_features`` + ``InternVLMultiModalProjector``):
drop the CLS token ('default' selection), pixel-shuffle the ``S x S`` grid by ``1 / downsample_ratio``
(:func:`~edgevlm.runtime.models.blocks.pixel_shuffle.pixel_shuffle`), then LayerNorm (eps 1e-5),
Linear, activation, Linear: LLaVA's 2-layer MLP (:class:`edgevlm.runtime.vision.Projector`) behind a
LayerNorm. Parameter names follow transformers' (``vision_tower.embeddings.patch_embeddings.projection``,
``vision_tower.encoder.layer.{i}.attention.q_proj``, ``multi_modal_projector.linear_1``, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.decoder import RMSNorm
from edgevlm.runtime.models.blocks.pixel_shuffle import pixel_shuffle
from edgevlm.runtime.models.internvl.config import InternVisionConfig, InternVLConfig
from edgevlm.runtime.vision import Projector, VisionMLP


def _norm(cfg: InternVisionConfig) -> nn.Module:
    if cfg.norm_type == "rms_norm":
        return RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.projection = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(N, C, T, T)`` -> ``(N, (T/p)^2, D)``, patches in raster order."""
        w = self.projection.weight
        return self.projection(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)


class InternVisionEmbeddings(nn.Module):
    """CLS token + patch embeddings + absolute position embeddings."""

    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.patch_embeddings = PatchEmbeddings(cfg)
        self.position_embeddings = nn.Parameter(torch.zeros(1, cfg.grid_side**2 + 1, cfg.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles ``(N, C, T, T)`` at the trained size T -> ``(N, 1 + (T/p)^2, D)``. Raises
        ``ValueError`` for another tile size."""
        t = self.cfg.image_size
        if tuple(pixel_values.shape[-2:]) != (t, t):
            raise ValueError(f"InternViT takes {t}x{t} px tiles, got {tuple(pixel_values.shape[-2:])}")
        x = self.patch_embeddings(pixel_values)  # (N, S*S, D)
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embeddings.to(x.dtype)


class InternVisionAttention(nn.Module):
    """Bidirectional multi-head self-attention (SDPA), optional q/k RMSNorm over the full width."""

    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.attention_bias)
        self.projection_layer = nn.Linear(d, d)
        self.q_norm = RMSNorm(d, cfg.qk_norm_eps) if cfg.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, cfg.qk_norm_eps) if cfg.use_qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_norm(self.k_proj(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
        return self.projection_layer(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class InternVisionLayer(nn.Module):
    """Pre-norm block with layer scale (see the module docstring)."""

    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.layernorm_before = _norm(cfg)
        self.attention = InternVisionAttention(cfg)
        self.layernorm_after = _norm(cfg)
        self.mlp = VisionMLP(cfg)  # fc1, act, fc2 (CLIP's MLP)
        self.lambda_1 = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lambda_2 = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVisionEncoder(nn.Module):
    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([InternVisionLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class InternVisionModel(nn.Module):
    """``embeddings`` -> ``encoder.layer`` blocks -> ``layernorm`` (identity with mean pooling)."""

    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = InternVisionEmbeddings(cfg)
        self.encoder = InternVisionEncoder(cfg)
        self.layernorm = nn.Identity() if cfg.use_mean_pooling else nn.LayerNorm(cfg.hidden_size,
                                                                                 eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, feature_index: int) -> torch.Tensor:
        """Tiles ``(N, C, T, T)`` -> the hidden states after block ``feature_index`` ``(N, 1 + S*S, D)``
        (CLS first); the last block's go through ``layernorm`` (transformers' ``last_hidden_state``)."""
        x = self.embeddings(pixel_values)
        for block in self.encoder.layer[:feature_index]:
            x = block(x)
        return self.layernorm(x) if feature_index == len(self.encoder.layer) else x


class InternVLProjector(Projector):
    """``linear_2(act(linear_1(layer_norm(x))))``: D_vision r^2 -> D_text."""

    def __init__(self, cfg: InternVLConfig) -> None:
        in_dim = cfg.vision.hidden_size * cfg.scale_factor**2
        super().__init__(in_dim, cfg.text.hidden_size, cfg.projector_hidden_act, bias=True)
        self.layer_norm = nn.LayerNorm(in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.layer_norm(x))


def tiles_to_tokens(hidden: torch.Tensor, projector: InternVLProjector, scale_factor: int) -> torch.Tensor:
    """Tower states ``(N, 1 + S*S, D)`` -> vision tokens ``(N, (S/r)^2, D_text)``: drop CLS, pixel
    shuffle by ``r``, project."""
    return projector(pixel_shuffle(hidden[:, 1:], scale_factor))


# ---- exit hooks (early exit, edgevlm.runtime.adaptive) -----------------------------------------


class InternVLExitRun:
    """One block-by-block encode of one request's tiles (the :class:`edgevlm.runtime.adaptive.ViTRun`
    protocol): the tower's own embeddings, blocks, final norm and the projector, so a run without an
    exit equals :meth:`InternVisionModel.forward` + :func:`tiles_to_tokens` exactly. The pooled heads
    read the last tile, the thumbnail (the whole frame at tile size), CLS first; pruning keeps each
    tile's own share of its ``image_seq_len`` tokens."""

    def __init__(self, tower: InternVisionModel, projector: InternVLProjector, cfg: InternVLConfig,
                 pixel_values: torch.Tensor) -> None:
        self.tower, self.projector, self.scale_factor = tower, projector, cfg.scale_factor
        self.grid = (cfg.vision.grid_side, cfg.vision.grid_side)
        self.x = tower.embeddings(pixel_values)  # (N_tiles, 1 + S*S, D)
        self.n_blocks = cfg.feature_index
        self.final_norm = cfg.feature_index == cfg.vision.num_hidden_layers
        self.blocks_run = 0
        self.token_groups = [cfg.image_seq_len] * int(pixel_values.shape[0])

    def step(self) -> torch.Tensor:
        self.x = self.tower.encoder.layer[self.blocks_run](self.x)
        self.blocks_run += 1
        return self.x  # (N_tiles, 1 + S*S, D), CLS first, patches in raster order

    def pooled_view(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        return hidden[-1:], self.grid  # the thumbnail (or the only tile)

    def finish(self, hidden: torch.Tensor, exit_block: int | None = None, adapter=None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = hidden if adapter is None else adapter(hidden).to(hidden.dtype)
        if self.final_norm:
            x = self.tower.layernorm(x)
        feats = tiles_to_tokens(x, self.projector, self.scale_factor)  # (N_tiles, image_seq_len, D_text)
        return feats.reshape(-1, feats.shape[-1]), []
