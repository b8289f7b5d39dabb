"""The Qwen2.5-VL vision tower: a native-resolution ViT with window attention and a 2x2 patch merger.

Architecture (Bai et al., "Qwen2.5-VL Technical Report", 2025, section 2.1; facts from transformers'
``Qwen2_5_VisionTransformerPretrainedModel``):

- patch embedding: a Conv3d with kernel = stride = ``(temporal_patch_size, patch_size, patch_size)``,
  no bias, over rows of ``C * tp * p * p`` pixels (computed here as the equal matmul);
- 2-D rotary embeddings: per patch, ``head_dim / 4`` frequencies ``theta ** (-2i / (head_dim / 2))``
  times its row and its column index, ``[row freqs, col freqs]`` twice over the head dimension
  (half-rotation layout), applied to q and k in float32;
- ``depth`` pre-norm blocks: RMSNorm (eps 1e-6) -> attention (fused ``qkv`` with bias, ``proj``) ->
  RMSNorm -> SwiGLU MLP with biases;
- attention inside windows of ``window_size`` px (``window_units`` merged patches a side, per frame),
  except the blocks in ``fullatt_block_indexes``, which attend over a whole frame. The patches are
  reordered once so that each window is contiguous (``window_index``; ``cu_window_seqlens`` /
  ``cu_seqlens`` bound the windows / frames), and the merger's output is put back in raster order;
- merger: RMSNorm, the 2x2 neighbourhood concatenated (``4 * hidden``), Linear -> GELU -> Linear to the
  decoder's width.

Parameter names follow transformers' (``patch_embed.proj``, ``blocks.N.attn.qkv``, ``merger.mlp.0``), so
checkpoints load by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.decoder import RMSNorm, apply_rope
from edgevlm.runtime.models.qwen2_5_vl.config import Qwen25VisionConfig
from edgevlm.runtime.models.qwen_vl.patch_embed import PatchEmbed
from edgevlm.runtime.vision import activation


@dataclass
class SegmentPlan:
    """One batched SDPA over the attention segments (windows, or frames) of a layout, planned once
    per encode on the host (no device syncs in the blocks).

    Tokens are already in segment order. Equal segments are a reshape ``(n_seg, L)``; otherwise every
    segment is padded to ``max_len``: ``src`` ``(n_seg * max_len,)`` int64 gives the token row that
    fills each padded slot (padding slots copy row 0; they are masked as keys and their outputs are
    dropped), ``dest`` ``(N,)`` int64 the padded slot of each token, ``keep`` ``(n_seg, 1, 1,
    max_len)`` bool the key mask; ``cos``/``sin`` ``(n_seg * max_len, head_dim)`` float32 follow the
    padded layout (the unpadded tables when there is no padding)."""

    cu_seqlens: torch.Tensor
    n_seg: int
    max_len: int
    cos: torch.Tensor
    sin: torch.Tensor
    src: torch.Tensor | None = None
    dest: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def segment_plan(lengths: list[int], cos: torch.Tensor, sin: torch.Tensor,
                 device: torch.device | str = "cpu") -> SegmentPlan:
    """The :class:`SegmentPlan` of segments of ``lengths`` (positive, sum N) over tables ``cos``/``sin``
    ``(N, head_dim)`` (on ``device``)."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    cu = F.pad(lens.cumsum(0), (1, 0))
    n_seg, max_len, n = len(lengths), max(lengths), int(lens.sum())
    if n_seg * max_len == n:
        return SegmentPlan(cu.to(device), n_seg, max_len, cos, sin)
    seg = torch.repeat_interleave(torch.arange(n_seg), lens)  # (N,)
    dest = seg * max_len + torch.arange(n) - cu[:-1][seg]  # (N,)
    src = torch.zeros(n_seg * max_len, dtype=torch.int64)
    src[dest] = torch.arange(n)
    keep = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None]  # (n_seg, 1, 1, L)
    src_dev = src.to(device)
    return SegmentPlan(cu.to(device), n_seg, max_len, cos.index_select(0, src_dev), sin.index_select(0, src_dev),
                       src_dev, dest.to(device), keep.to(device))


@dataclass
class VisionLayout:
    """Everything about the patch order that depends only on ``grid_thw`` (computed once per encode).

    ``window_index`` ``(N / merge**2,)``: merged units in window order; ``cu_window_seqlens`` /
    ``cu_seqlens``: segment bounds (in patches, window order) for window / full attention; ``cos``,
    ``sin`` ``(N, head_dim)`` float32, already in window order; ``windows`` / ``frames``: the
    :class:`SegmentPlan` of each attention kind."""

    window_index: torch.Tensor
    cu_window_seqlens: torch.Tensor
    cu_seqlens: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    windows: SegmentPlan | None = None
    frames: SegmentPlan | None = None


def vision_layout(grid_thw: torch.Tensor, cfg: Qwen25VisionConfig, device: torch.device | str = "cpu") -> VisionLayout:
    """The :class:`VisionLayout` of items with ``grid_thw`` ``(N_items, 3)`` (patches)."""
    m, unit = cfg.spatial_merge_size, cfg.spatial_merge_size ** 2
    vws = cfg.window_units
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))  # (head_dim/4,)
    order, windows, frames, rows, cols = [], [], [], [], []
    base = 0
    for t, h, w in grid_thw.tolist():
        lh, lw = h // m, w // m
        tt, rr, cc = torch.meshgrid(torch.arange(t), torch.arange(lh), torch.arange(lw), indexing="ij")
        n_wh, n_ww = -(-lh // vws), -(-lw // vws)
        window = ((tt * n_wh + rr // vws) * n_ww + cc // vws).flatten()  # window id of each merged unit
        key = window * (vws * vws) + ((rr % vws) * vws + cc % vws).flatten()
        order.append(torch.argsort(key) + base)
        counts = torch.bincount(window, minlength=t * n_wh * n_ww)
        windows.append(counts[counts > 0] * unit)
        frames.append(torch.full((t,), h * w))
        # patch row/column in merge-block order: unit (r, c), then its m x m patches row-major
        pr = (rr[..., None, None] * m + torch.arange(m)[:, None]).expand(t, lh, lw, m, m)
        pc = (cc[..., None, None] * m + torch.arange(m)[None, :]).expand(t, lh, lw, m, m)
        rows.append(pr.reshape(-1))
        cols.append(pc.reshape(-1))
        base += t * lh * lw
    window_index = torch.cat(order)
    patch_order = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)  # patches in window order
    row = torch.cat(rows)[patch_order].float()
    col = torch.cat(cols)[patch_order].float()
    freqs = torch.cat([row[:, None] * inv_freq, col[:, None] * inv_freq], dim=-1)  # (N, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (N, head_dim)

    cos, sin = emb.cos().to(device), emb.sin().to(device)
    win_plan = segment_plan(torch.cat(windows).tolist(), cos, sin, device)
    frame_plan = segment_plan(torch.cat(frames).tolist(), cos, sin, device)
    return VisionLayout(window_index.to(device), win_plan.cu_seqlens, frame_plan.cu_seqlens, cos, sin,
                        win_plan, frame_plan)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention of ``q``/``k``/``v`` ``(N, H, Dh)`` within each segment
    ``cu_seqlens[i]:cu_seqlens[i+1]`` -> ``(N, H, Dh)``. Segments are padded into one batch
    ``(n_seg, H, L_max, Dh)`` with a key mask: one SDPA call however many windows there are."""
    n, h, dh = q.shape
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    n_seg = lengths.numel()
    max_len = int(lengths.max())
    if n_seg * max_len == n:  # equal segments (one frame, or the frames of a video): no padding, no mask
        def batched(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(n_seg, max_len, h, dh).transpose(1, 2)  # (n_seg, H, L, Dh)

        y = F.scaled_dot_product_attention(batched(q), batched(k), batched(v))
        return y.transpose(1, 2).reshape(n, h, dh)
    seg = torch.repeat_interleave(torch.arange(n_seg, device=q.device), lengths)  # (N,)
    off = torch.arange(n, device=q.device) - cu_seqlens[:-1][seg]

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(n_seg, max_len, h, dh)
        out[seg, off] = x
        return out.transpose(1, 2)  # (n_seg, H, L, Dh)

    keep = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]  # (n_seg, L)
    y = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=keep[:, None, None, :])
    return y.transpose(1, 2)[seg, off]  # (N, H, Dh)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor | SegmentPlan) -> torch.Tensor:
        """``x`` ``(N, D)`` in window order -> ``(N, D)``; attention within the segments of
        ``cu_seqlens``: a :class:`SegmentPlan` (one batched SDPA with the plan's own rope tables), or
        a bounds tensor (:func:`segment_attention`, ``cos``/``sin`` ``(N, Dh)``)."""
        if isinstance(cu_seqlens, SegmentPlan):
            return self._planned(x, cu_seqlens)
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.n_heads, -1).unbind(1)  # (N, H, Dh) each
        cos, sin = cos[:, None], sin[:, None]  # (N, 1, Dh), float32
        q = apply_rope(q.float(), cos, sin).to(x.dtype)
        k = apply_rope(k.float(), cos, sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, cu_seqlens).reshape(n, -1))

    def _planned(self, x: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        """Pad the input rows into segments (one gather), q/k/v and RoPE on the padded rows (q and k
        in one fp32 pass), one SDPA ``(n_seg, H, max_len, Dh)`` with the key mask, outputs gathered
        back before ``proj``: about half the kernels of the unplanned path, and no host syncs."""
        n, d = x.shape
        xp = x if plan.src is None else x.index_select(0, plan.src)  # (n_seg * L, D)
        m = xp.shape[0]
        qkv = self.qkv(xp).view(m, 3, self.n_heads, -1)  # (M, 3, H, Dh)
        qk = apply_rope(qkv[:, :2].float(), plan.cos[:, None, None], plan.sin[:, None, None]).to(x.dtype)

        def batched(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(plan.n_seg, plan.max_len, self.n_heads, -1).transpose(1, 2)  # (S, H, L, Dh)

        y = F.scaled_dot_product_attention(batched(qk[:, 0]), batched(qk[:, 1]), batched(qkv[:, 2]),
                                           attn_mask=plan.keep)
        y = y.transpose(1, 2).reshape(m, d)
        return self.proj(y if plan.dest is None else y.index_select(0, plan.dest))


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class Qwen25VisionTower(nn.Module):
    """``pixel_values`` ``(N, C*tp*p*p)`` + ``grid_thw`` ``(N_items, 3)`` -> vision tokens
    ``(N / merge**2, out_hidden_size)`` in the processor's (raster, item) order."""

    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.full_attention = frozenset(cfg.fullatt_block_indexes)
        self._layouts: dict[tuple, VisionLayout] = {}  # per (grid, device): the forward is then sync free

    def layout(self, grid_thw: torch.Tensor, device: torch.device) -> VisionLayout:
        """:func:`vision_layout` of ``grid_thw``, cached per geometry (at most 8): a repeated frame size
        needs no host work or host-to-device copies, so the forward is CUDA-graph safe
        (:mod:`edgevlm.runtime.vision_graphs`) once its geometry was seen."""
        key = (tuple(map(tuple, grid_thw.tolist())), str(device))
        if key not in self._layouts:
            if len(self._layouts) >= 8:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = vision_layout(grid_thw, self.cfg, device)
        return self._layouts[key]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        w = self.patch_embed.proj.weight
        layout = self.layout(grid_thw, w.device)
        unit = self.cfg.spatial_merge_size ** 2
        x = self.patch_embed(pixel_values.to(w.device))  # (N, D)
        x = x.reshape(-1, unit, x.shape[-1])[layout.window_index].reshape(x.shape)  # window order
        for i, block in enumerate(self.blocks):
            cu = layout.frames if i in self.full_attention else layout.windows  # SegmentPlan
            x = block(x, layout.cos, layout.sin, cu)
        merged = self.merger(x)  # (N / unit, D_out), window order
        return merged[torch.argsort(layout.window_index)]


# ---- exit hooks (early exit, edgevlm.runtime.adaptive) -----------------------------------------


def window_to_raster(layout: VisionLayout, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``(N,)`` int64 index that puts patch states in window order into raster order (per item,
    frame-major, row-major inside a frame): ``x_raster = x_window[index]``."""
    units, base_p = [], 0
    for t, h, w in grid_thw.tolist():
        lh, lw = h // merge, w // merge
        u = torch.arange(t * lh * lw)
        frame, r, c = u // (lh * lw), (u % (lh * lw)) // lw, u % lw
        a, b = torch.arange(merge).repeat_interleave(merge), torch.arange(merge).repeat(merge)  # (unit,)
        pos = frame[:, None] * h * w + (r[:, None] * merge + a) * w + c[:, None] * merge + b  # (units, unit)
        units.append(pos + base_p)
        base_p += t * h * w
    raster_of_unit_patch = torch.cat(units)  # (units, unit): raster position of each merge-order patch
    window = layout.window_index.cpu()
    pos = raster_of_unit_patch[window].reshape(-1)  # raster position of each window-order patch
    return torch.argsort(pos).to(layout.window_index.device)


class Qwen25ExitRun:
    """One block-by-block encode of :class:`Qwen25VisionTower` (the :class:`edgevlm.runtime.adaptive.ViTRun`
    protocol): the tower's own stem, blocks (window or full attention as in ``forward``) and
    merger, so a run without an exit equals ``forward`` exactly; an exit may follow any block."""

    def __init__(self, tower: Qwen25VisionTower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        w = tower.patch_embed.proj.weight
        self.tower, self.grid_thw = tower, grid_thw
        self.layout = vision_layout(grid_thw, tower.cfg, w.device)
        unit = tower.cfg.spatial_merge_size ** 2
        x = tower.patch_embed(pixel_values.to(w.device))  # (N, D)
        self.x = x.reshape(-1, unit, x.shape[-1])[self.layout.window_index].reshape(x.shape)  # window order
        self.n_blocks = len(tower.blocks)
        self.blocks_run = 0
        self.token_groups = [t * h * w // unit for t, h, w in grid_thw.tolist()]

    def step(self) -> torch.Tensor:
        i = self.blocks_run
        cu = self.layout.cu_seqlens if i in self.tower.full_attention else self.layout.cu_window_seqlens
        self.x = self.tower.blocks[i](self.x, self.layout.cos, self.layout.sin, cu)
        self.blocks_run += 1
        return self.x[None]  # (1, N, D), window order

    def pooled_view(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        if self.grid_thw.shape[0] != 1:
            raise ValueError("exit confidence reads one image or video at a time")
        t, h, w = self.grid_thw[0].tolist()
        index = window_to_raster(self.layout, self.grid_thw, self.tower.cfg.spatial_merge_size)
        return hidden[:, index], (t * h, w)  # frames stacked top to bottom

    def finish(self, hidden: torch.Tensor, exit_block: int | None = None, adapter=None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = hidden if adapter is None else adapter(hidden)  # (1, N, D)
        merged = self.tower.merger(x[0].to(hidden.dtype))  # (N / unit, D_out), window order
        return merged[torch.argsort(self.layout.window_index)], []
