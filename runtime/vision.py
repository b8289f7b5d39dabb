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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.types import exit_depth_error

if TYPE_CHECKING:
    from edgevlm.runtime.models.blocks.vit_config import ViTGeometry
    from edgevlm.runtime.models.llava.config import LlavaConfig, VisionConfig
    from edgevlm.runtime.vision_cache import VisionTrunk

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
    """Bidirectional multi-head self-attention (scale ``head_dim ** -0.5``, SDPA), with biased
    ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``: CLIP's and SigLIP's alike."""

    def __init__(self, cfg: ViTGeometry) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        return tuple(proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                     for proj in (self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, D)``; ``key_mask`` ``(B, T)`` bool, False = a padding token no query attends
        to (None = all valid; SmolVLM's padded tiles) -> ``(B, T, D)``."""
        b, t, _ = x.shape
        q, k, v = self._heads(x)  # (B, H, T, Dh) each
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, Dh)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)

    def forward_with_cls_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`forward`, plus the CLS token's attention over all tokens, averaged over
        heads: ``(B, T)`` float32, rows summing to 1 (token pruning scores, see
        :mod:`edgevlm.runtime.pruning`). Costs one ``(1 x T)`` score row per head on top of SDPA."""
        b, t, _ = x.shape
        q, k, v = self._heads(x)  # (B, H, T, Dh) each
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
        logits = (q[:, :, :1].float() @ k.float().transpose(-1, -2)) * self.head_dim**-0.5  # (B, H, 1, T)
        cls_attn = logits.softmax(dim=-1).mean(dim=1)[:, 0]  # (B, T)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1)), cls_attn


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``, biased, with the tower's ``hidden_act``."""

    def __init__(self, cfg: ViTGeometry) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (LayerNorm with the
    tower's ``layer_norm_eps``). One block for CLIP (LLaVA) and SigLIP (LLaVA-SigLIP, SmolVLM):
    parameter names ``layer_norm1``, ``self_attn.{q,k,v,out}_proj``, ``layer_norm2``, ``mlp.fc1``,
    ``mlp.fc2``, as transformers' ``CLIPEncoderLayer`` and ``SiglipEncoderLayer`` save them."""

    def __init__(self, cfg: ViTGeometry) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, D)``, ``key_mask`` as :meth:`VisionAttention.forward`'s -> ``(B, T, D)``."""
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))

    def forward_with_cls_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` plus this block's CLS attention ``(B, T)`` float32 (head mean)."""
        h, cls_attn = self.self_attn.forward_with_cls_attention(self.layer_norm1(x))
        x = x + h
        return x + self.mlp(self.layer_norm2(x)), cls_attn


class VisionEncoder(nn.Module):
    """The CLIP ViT up to the deepest block LLaVA reads features from.

    Blocks after ``num_blocks`` (e.g. the last one when ``vision_feature_layer == -2``) and CLIP's
    ``post_layernorm`` do not influence LLaVA's output, so they are not built.
    """

    has_cls_token = True  # hidden states are (B, 1 + N, D), the CLS token first

    def __init__(self, cfg: VisionConfig, num_blocks: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList([VisionBlock(cfg) for _ in range(num_blocks)])
        # optional fused Triton stem set by the torch backend (edgevlm.runtime.kernels.patch_embed_ln)
        self.fused_stem: nn.Module | None = None

    def stem(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pre_layrnorm(embeddings(pixel_values))``: ``(B, C, H, W)`` -> ``(B, 1 + N, D)``."""
        if self.fused_stem is not None:
            return self.fused_stem(pixel_values)
        return self.pre_layrnorm(self.embeddings(pixel_values))

    def forward(self, pixel_values: torch.Tensor, feature_indices: tuple[int, ...]) -> list[torch.Tensor]:
        """Hidden states at ``feature_indices`` (0 = embeddings after pre-LN, i = after block i).

        Args:
            pixel_values: ``(B, C, H, W)`` normalised image, H and W multiples of the patch size.
        Returns:
            one ``(B, 1 + N, D_vision)`` tensor per index, in the order given.
        """
        x = self.stem(pixel_values)  # (B, 1 + N, D)
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
    """Vision encoder + feature selection + projector: pixels -> vision tokens in the text space.

    ``encoder`` (default: the CLIP :class:`VisionEncoder`) is any module with this encoder's
    interface: ``stem(pixels) -> (B, T, D)``, ``layers`` (blocks ``x -> x``; with
    ``forward_with_cls_attention`` where ``has_cls_token``), ``forward(pixels, feature_indices)``,
    ``has_cls_token`` and ``fused_stem`` — e.g. the LLaVA family's SigLIP adapter, whose tokens have
    no CLS."""

    def __init__(self, cfg: LlavaConfig, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = encoder if encoder is not None else VisionEncoder(cfg.vision, cfg.vision_blocks_needed)
        in_dim = cfg.vision.hidden_size * len(cfg.vision_feature_layer)
        self.projector = Projector(in_dim, cfg.text.hidden_size, cfg.projector_hidden_act, cfg.projector_bias)

    def num_vision_tokens(self, height_px: int, width_px: int) -> int:
        """Vision tokens for an input of ``height_px x width_px`` (after the select strategy)."""
        return self.cfg.num_vision_tokens(height_px, width_px)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, N, D_text)`` vision tokens (transformers' LLaVA
        ``get_image_features``: pick layers, drop CLS for 'default', concat on channels, project)."""
        feats = self.encoder(pixel_values, self.cfg.vision_feature_indices)
        if self.cfg.vision_feature_select_strategy == "default":
            feats = [f[:, 1:] for f in feats]  # drop CLS (transformers drops index 0 of any tower)
        x = feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)  # (B, N, D_vision * k)
        return self.projector(x)  # (B, N, D_text)


# ---- adaptive path: early exit + token pruning ------------------------------------------------


@dataclass
class VisionInfo:
    """What :func:`encode_adaptive` did for one batch.

    Attributes:
        exit_layers: per sample, the block it exited after (None = full depth).
        exit_confidences: per sample, the confidence of the last exit head consulted (None if none).
        blocks_run: encoder blocks run (the deepest sample).
        tokens_total: vision tokens per sample before pruning (CLS included with a CLIP tower's
            'full' strategy).
        tokens_kept: vision tokens per sample fed to the decoder.
        kept_index: per sample, the kept patch indices (ascending, raster order) when tokens were
            pruned; None otherwise.
    """

    exit_layers: list[int | None] = field(default_factory=list)
    exit_confidences: list[float | None] = field(default_factory=list)
    blocks_run: int = 0
    tokens_total: int = 0
    tokens_kept: int = 0
    kept_index: list[list[int]] | None = None


class ExitPastDepthError(ValueError):
    """An ``exit_layer`` past the vision encoder's depth (see :func:`exit_plan`)."""


def exit_plan(exit_blocks: list[int], n_blocks: int, exit_layer: int | None,
              exit_threshold: float | None) -> list[tuple[int, float | None]]:
    """The exit points to consult, as ``(block, threshold)``; threshold None = exit unconditionally.

    - no ``exit_layer`` and no ``exit_threshold``: ``[]`` (full depth);
    - ``exit_layer`` k only: ``[(k, None)]`` (k must be an exit point; ``k == n_blocks`` = full depth);
    - ``exit_threshold`` t: every exit point ``<= exit_layer`` (all if None), each gated by t.

    Raises:
        ExitPastDepthError: ``exit_layer`` is past the encoder's depth (``> n_blocks``): it was
            taken as full depth, which runs another operating point than the one asked for.
        ValueError: an exit is asked for but the model has no exit heads, or ``exit_layer`` is
            not one of its exit points.
    """
    if exit_layer is None and exit_threshold is None:
        return []
    past = exit_depth_error(exit_layer, n_blocks)
    if past is not None:
        raise ExitPastDepthError(past)
    if exit_layer is not None and exit_layer >= n_blocks and exit_threshold is None:
        return []
    if not exit_blocks:
        raise ValueError("this model has no exit heads (run `edgevlm calibrate` on it)")
    if exit_threshold is None:
        if exit_layer not in exit_blocks:
            raise ValueError(f"exit_layer {exit_layer} is not an exit point of this model (exit points: {exit_blocks})")
        return [(exit_layer, None)]
    limit = n_blocks if exit_layer is None else exit_layer
    return [(b, exit_threshold) for b in exit_blocks if b <= limit]


def _select(cfg: LlavaConfig, feats: torch.Tensor) -> torch.Tensor:
    return feats[:, 1:] if cfg.vision_feature_select_strategy == "default" else feats


def encode_adaptive(
    tower: VisionTower,
    pixel_values: torch.Tensor,
    *,
    exit_heads=None,
    exit_layer: int | None = None,
    exit_threshold: float | None = None,
    keep_ratio: float | None = None,
    prune_score: str = "cls_attention",
    exit_query: torch.Tensor | None = None,
    trunk: VisionTrunk | None = None,
) -> tuple[torch.Tensor, VisionInfo]:
    """Pixels -> vision tokens with early exit and token pruning (see :mod:`edgevlm.runtime.exits`
    and :mod:`edgevlm.runtime.pruning`).

    The encoder runs block by block; at each exit point of :func:`exit_plan` the samples whose
    exit confidence reaches the threshold leave the batch with ``adapter(hidden)`` as their
    features, the rest continue. Before the projector, ``keep_ratio`` keeps the best patch tokens
    by the CLS attention of the last block each sample ran (or by feature norm), in raster order.
    With no exit and no pruning the result equals :meth:`VisionTower.forward` exactly.

    Args:
        pixel_values: ``(B, C, H, W)`` normalised image.
        exit_heads: an :class:`~edgevlm.runtime.exits.ExitHeads` or None.
        exit_query: ``(B, Q)`` question embedding for question-conditioned confidence heads
            (:func:`edgevlm.runtime.exits.query_embedding`); None = unknown question.
        trunk: this frame's :class:`~edgevlm.runtime.vision_cache.VisionTrunk` (one image, no
            pruning): the blocks it holds are read, not run again, an exit's tokens made for an
            earlier question are returned as they are, and what is made here is added to it. The
            result equals the walk without it.
    Returns:
        ``(B, N', D_text)`` vision tokens and a :class:`VisionInfo`.
    Raises:
        ValueError: a bad exit request (:func:`exit_plan`), ``keep_ratio`` or ``prune_score``, or a
            ``trunk`` with several images or with pruning.
    """
    from edgevlm.runtime.pruning import SCORES, feature_norm_scores, select_tokens

    cfg = tower.cfg
    enc = tower.encoder
    n_blocks = cfg.vision_blocks_needed
    feature_idx = cfg.vision_feature_indices
    plan = dict(exit_plan(exit_heads.exit_blocks if exit_heads is not None else [], n_blocks,
                          exit_layer, exit_threshold))
    if prune_score not in SCORES:
        raise ValueError(f"prune_score must be one of {SCORES}, got {prune_score!r}")
    prune = keep_ratio is not None and keep_ratio < 1.0
    want_attn = prune and prune_score == "cls_attention"
    if want_attn and not enc.has_cls_token:
        raise ValueError("prune_score 'cls_attention' needs a tower with a CLS token; use 'feature_norm'")

    b = pixel_values.shape[0]
    if trunk is not None and (b != 1 or prune):
        raise ValueError("a vision trunk serves one image without pruning")
    p = cfg.vision.patch_size
    grid_hw = (pixel_values.shape[-2] // p, pixel_values.shape[-1] // p)
    done = 0  # blocks already run on this frame (a trunk's): read, not run
    exit_blocks = set(exit_heads.exit_blocks) if exit_heads is not None else set()
    if trunk is not None and trunk.x is not None:
        x, done, states = trunk.x, trunk.blocks_run, dict(trunk.states)
    else:
        x = enc.stem(pixel_values)  # (B, 1 + N, D)
        states = {0: x} if 0 in feature_idx else {}
        if trunk is not None:
            trunk.x, trunk.states = x, dict(states)
    info = VisionInfo(exit_layers=[None] * b, exit_confidences=[None] * b)
    out: list[torch.Tensor | None] = [None] * b  # per sample: (1 + N, F) features
    scores: list[torch.Tensor | None] = [None] * b  # per sample: (1 + N,) CLS attention
    active = list(range(b))  # batch rows still in x, as original sample indices
    attn = None
    for i, block in enumerate(enc.layers, start=1):
        info.blocks_run = i
        if i <= done:  # run on an earlier question about this frame: its exit blocks were kept
            if i not in plan:
                continue
            xi = trunk.seen[i]
        else:
            if want_attn and (i in plan or i == n_blocks):
                x, attn = block.forward_with_cls_attention(x)  # attn (B_active, 1 + N)
            else:
                x = block(x)
            xi = x
            if i in feature_idx:
                states[i] = x
            if trunk is not None:
                trunk.x, trunk.blocks_run = x, i
                if i in feature_idx:
                    trunk.states[i] = x
                if i in plan or i in exit_blocks:  # every exit block: a later plan (another exit_layer cap) may read it
                    trunk.seen[i] = x
            if i not in plan:
                continue
        threshold = plan[i]
        if threshold is None:  # forced exit: no confidence head is consulted (none reported)
            leave = torch.ones(xi.shape[0], dtype=torch.bool, device=xi.device)
        else:
            query = exit_query[active] if exit_query is not None else None  # (B_active, Q)
            conf = exit_heads.confidence_at(i, xi, grid_hw, query)  # (B_active,)
            leave = conf >= threshold
            for row, sample in enumerate(active):
                info.exit_confidences[sample] = float(conf[row])
        if not bool(leave.any()):
            continue
        rows = leave.nonzero()[:, 0]
        if trunk is not None and i in trunk.tokens:  # an earlier question about this frame left here too
            info.exit_layers[0] = i
            tokens, info.tokens_total, info.tokens_kept = trunk.tokens[i]
            return tokens, info
        adapted = exit_heads.adapt(i, xi[rows])  # (b_exit, 1 + N, F)
        for j, row in enumerate(rows.tolist()):
            sample = active[row]
            out[sample], info.exit_layers[sample] = adapted[j], i
            scores[sample] = attn[row] if attn is not None else None
        stay = (~leave).nonzero()[:, 0]
        active = [active[r] for r in stay.tolist()]
        if not active:
            break
        x = x[stay]
        states = {k: v[stay] for k, v in states.items()}
        attn = attn[stay] if attn is not None else None
    if active and trunk is not None and n_blocks in trunk.tokens:  # the full depth, made for an earlier question
        tokens, info.tokens_total, info.tokens_kept = trunk.tokens[n_blocks]
        return tokens, info
    if active:
        full = torch.cat([states[k] for k in feature_idx], dim=-1) if len(feature_idx) > 1 else states[feature_idx[0]]
        for row, sample in enumerate(active):
            out[sample] = full[row]
            scores[sample] = attn[row] if attn is not None else None

    feats = _select(cfg, torch.stack(out))  # (B, N or 1 + N, F)
    has_cls = cfg.cls_feature
    patches = feats[:, 1:] if has_cls else feats  # (B, N, F)
    info.tokens_total = feats.shape[1]
    if prune:
        if want_attn:
            s = torch.stack(scores)[:, 1:]  # (B, N): CLS attention to each patch
        else:
            s = feature_norm_scores(patches)
        patches, index = select_tokens(patches, s, keep_ratio)
        info.kept_index = index.tolist()
        feats = torch.cat([feats[:, :1], patches], dim=1) if has_cls else patches
    info.tokens_kept = feats.shape[1]
    tokens = tower.projector(feats)  # (B, N', D_text)
    if trunk is not None:  # the tokens of this exit (or of the full depth) are the frame's: kept for the next question
        trunk.tokens[info.exit_layers[0] or n_blocks] = (tokens, info.tokens_total, info.tokens_kept)
    return tokens, info
