"""CLIP-style ViT vision encoder and the LLaVA 2-layer MLP projector, as plain ``nn.Module``s.

Architecture: Radford et al., "Learning Transferable Visual Models From Natural Language
Supervision" (CLIP, 2021) — conv patch embedding, a learned CLS token, learned position embeddings,
a LayerNorm before the encoder ("pre_layrnorm") and pre-LN transformer blocks. The projector is
LLaVA-1.5's (Liu et al., "Improved Baselines with Visual Instruction Tuning", 2023): Linear, act,
Linear. Parameter names follow transformers' ``CLIPVisionModel`` so checkpoints load by name.

Inputs of any size that is a multiple of the patch size are accepted: the trained square grid of
position embeddings is resized bicubically (``align_corners=False``) to the input's patch grid,
exactly like transformers' ``CLIPVisionEmbeddings.interpolate_pos_encoding`` (DINO's recipe),
including its shortcut that uses the embeddings unchanged for the native square size.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.config import LlavaConfig, VisionConfig

logger = logging.getLogger(__name__)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """Apply a transformers-named activation (``ACT2FN`` semantics) to ``x``."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)  # CLIP's sigmoid approximation of GELU
    if name == "gelu":
        return F.gelu(x)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unsupported activation {name!r}")


class VisionEmbeddings(nn.Module):
    """Patch embedding + CLS token + (interpolated) learned position embeddings."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(cfg.grid_side**2 + 1, cfg.hidden_size)

    def position_embeddings(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """Position embeddings for a ``grid_h x grid_w`` patch grid: ``(1 + grid_h * grid_w, D)``."""
        pos = self.position_embedding.weight  # (1 + S*S, D)
        side = self.cfg.grid_side
        if grid_h == grid_w == side:
            return pos
        cls_pos, patch_pos = pos[:1], pos[1:]
        d = pos.shape[-1]
        grid = patch_pos.reshape(1, side, side, d).permute(0, 3, 1, 2)  # (1, D, S, S)
        grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        patch_pos = grid.permute(0, 2, 3, 1).reshape(grid_h * grid_w, d)  # (h*w, D)
        return torch.cat([cls_pos, patch_pos], dim=0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, 1 + H/p * W/p, D)``; H and W must be multiples of the patch."""
        b = pixel_values.shape[0]
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(w.dtype))  # (B, D, h, w)
        grid_h, grid_w = patches.shape[-2:]
        patches = patches.flatten(2).transpose(1, 2)  # (B, h*w, D)
        cls = self.class_embedding.to(patches.dtype).expand(b, 1, -1)  # (B, 1, D)
        x = torch.cat([cls, patches], dim=1)  # (B, 1 + h*w, D)
        return x + self.position_embeddings(grid_h, grid_w).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention (SDPA)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The CLIP ViT up to the deepest block LLaVA reads features from.

    Blocks after ``num_blocks`` (e.g. the last one when ``vision_feature_layer == -2``) and CLIP's
    ``post_layernorm`` do not influence LLaVA's output, so they are not built.
    """

    def __init__(self, cfg: VisionConfig, num_blocks: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList([VisionBlock(cfg) for _ in range(num_blocks)])

    def forward(self, pixel_values: torch.Tensor, feature_indices: tuple[int, ...]) -> list[torch.Tensor]:
        """Hidden states at ``feature_indices`` (0 = embeddings after pre-LN, i = after block i).

        Args:
            pixel_values: ``(B, C, H, W)`` normalised image, H and W multiples of the patch size.
        Returns:
            one ``(B, 1 + N, D_vision)`` tensor per index, in the order given.
        """
        x = self.pre_layrnorm(self.embeddings(pixel_values))  # (B, 1 + N, D)
        states = {0: x}
        for i, block in enumerate(self.layers, start=1):
            x = block(x)
            states[i] = x
        return [states[i] for i in feature_indices]


class Projector(nn.Module):
    """LLaVA multi-modal projector: ``linear_2(act(linear_1(x)))``, D_vision*k -> D_text."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.act = act
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


class VisionTower(nn.Module):
    """Vision encoder + feature selection + projector: pixels -> vision tokens in the text space."""

    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = VisionEncoder(cfg.vision, cfg.vision_blocks_needed)
        in_dim = cfg.vision.hidden_size * len(cfg.vision_feature_layer)
        self.projector = Projector(in_dim, cfg.text.hidden_size, cfg.projector_hidden_act, cfg.projector_bias)

    def num_vision_tokens(self, height_px: int, width_px: int) -> int:
        """Vision tokens for an input of ``height_px x width_px`` (after the select strategy)."""
        p = self.cfg.vision.patch_size
        n = (height_px // p) * (width_px // p)
        return n + (1 if self.cfg.vision_feature_select_strategy == "full" else 0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, N, D_text)`` vision tokens (transformers' LLaVA
        ``get_image_features``: pick layers, drop CLS for 'default', concat on channels, project)."""
        feats = self.encoder(pixel_values, self.cfg.vision_feature_indices)
        if self.cfg.vision_feature_select_strategy == "default":
            feats = [f[:, 1:] for f in feats]  # drop CLS
        x = feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)  # (B, N, D_vision * k)
        return self.projector(x)  # (B, N, D_text)
