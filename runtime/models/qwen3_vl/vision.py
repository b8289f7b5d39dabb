"""The Qwen3-VL vision tower: native-resolution ViT with DeepStack outputs.

Reference: Qwen Team, "Qwen3-VL Technical Report" (2025) and transformers' ``Qwen3VLVisionModel``
(the facts below are taken from it; the code is ours):

* patches: ``(N, C * T * p * p)`` rows (T = ``temporal_patch_size`` 2, p = ``patch_size`` 16) in the
  2x2-merge-block order of :func:`~edgevlm.runtime.models.qwen_vl` patchify, embedded by a Conv3d
  whose kernel equals its stride — computed here as one matmul over the flattened kernel;
* learned absolute position embeddings on a square ``G x G`` grid (``G = sqrt(num_position_embeddings)``),
  resampled bilinearly to each image's ``(h, w)`` patch grid with ``align_corners=True``
  (source coordinate ``i * (G - 1) / max(h - 1, 1)``, taps ``floor`` and ``floor + 1`` clamped to the
  grid, weights ``1 - |src - tap|``), the same for every frame of a video;
* 2-D rotary attention: ``head_dim / 4`` frequencies ``theta ** (-2k / (head_dim / 2))`` per axis,
  angles ``[h * f, w * f]`` repeated twice over the head dim (half-rotation layout), applied in fp32;
* pre-LayerNorm blocks (eps 1e-6, fused ``qkv`` with bias, GELU-tanh MLP); attention is full within
  each frame and never across frames or images;
* the patch merger: LayerNorm, 2x2 neighbours concatenated, ``Linear -> GELU -> Linear`` to the
  decoder width; DeepStack (Meng et al., "DeepStack", 2024): the output of each block in
  ``deepstack_visual_indexes`` goes through its own merger (LayerNorm after the concatenation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.decoder import apply_rope
from edgevlm.runtime.models.qwen3_vl.config import Qwen3VLVisionConfig
from edgevlm.runtime.models.qwen_vl.patch_embed import PatchEmbed
from edgevlm.runtime.vision import activation

_LN_EPS = 1e-6


def block_order_hw(grid_thw: torch.Tensor, merge: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(row, col)`` patch coordinates of every patch in the tower's order: per item, per frame,
    ``merge x merge`` blocks in raster order and patches in raster order inside a block.

    ``grid_thw`` ``(N_items, 3)`` int64 -> ``(N_patches, 2)`` int64 on ``device`` (None: the grid's).
    A CPU grid with a CUDA ``device`` needs no host sync (device-side ``arange`` only: CUDA-graph safe)."""
    device = grid_thw.device if device is None else device
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        rc = torch.stack([rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()], -1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps of target positions ``index`` on an axis of ``size``
    positions into a source axis of ``side`` positions: ``(N, 2)`` int64 taps, ``(N, 2)`` float32 weights."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    lo = torch.floor(src)
    raw = lo.long()[:, None] + torch.arange(2, device=index.device)  # (N, 2)
    weights = (1 - (src[:, None] - raw.float()).abs()).clamp(min=0)
    return raw.clamp(0, side - 1), weights


class PatchMerger(nn.Module):
    """2x2 patch merger: ``(N, D)`` -> ``(N / 4, D_out)``. ``postshuffle_norm``: LayerNorm over the
    concatenated ``4 D`` (DeepStack mergers) instead of over ``D`` before concatenating."""

    def __init__(self, cfg: Qwen3VLVisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=_LN_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle_norm else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
        """``x`` ``(N, D)``, ``cos``/``sin`` ``(N, Dh)`` float32; attention within each segment of ``seg_lens``."""
        n, d = x.shape
        qkv = self.qkv(x).view(n, 3, self.n_heads, -1)  # (N, 3, H, Dh)
        # q and k in one fp32 pass: (N, 2, H, Dh)
        qk = apply_rope(qkv[:, :2].float(), cos[:, None, None], sin[:, None, None]).to(x.dtype)
        y = frame_attention(qk[:, 0], qk[:, 1], qkv[:, 2], seg_lens)  # (N, H, Dh)
        return self.proj(y.reshape(n, d))


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
    """Bidirectional attention of ``q``/``k``/``v`` ``(N, H, Dh)`` (any strides, last dim dense)
    within consecutive segments of ``seg_lens`` (sum N) -> ``(N, H, Dh)``.

    SDPA always gets 4-D ``(B, H, L, Dh)`` inputs: its fused (flash / memory-efficient) kernels take
    only 4-D tensors, and a 3-D call falls back to the math path, which materialises the
    ``H x L x L`` score matrix (the cost that grew with resolution). Equal segments (one image, or
    the frames of a video) go in one call as a batch; segments of different lengths one call each."""
    n, h, dh = q.shape
    if len(set(seg_lens)) == 1:
        s, length = len(seg_lens), seg_lens[0]

        def batched(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(s, length, h, dh).transpose(1, 2)  # (S, H, L, Dh)

        return F.scaled_dot_product_attention(batched(q), batched(k), batched(v)).transpose(1, 2).reshape(n, h, dh)
    outs = [F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None])
            for qs, ks, vs in zip(q.split(seg_lens), k.split(seg_lens), v.split(seg_lens), strict=True)]
    return torch.cat([o[0].transpose(0, 1) for o in outs])


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.act, self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, seg_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg_lens)
        return x + self.mlp(self.norm2(x))


class Qwen3VLVisionTower(nn.Module):
    """Patches -> (main vision tokens, DeepStack features). Parameter names follow transformers'
    ``Qwen3VLVisionModel`` (``patch_embed``, ``pos_embed``, ``blocks``, ``merger``, ``deepstack_merger_list``)."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes])

    def position_embeddings(self, grid_thw: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Learned position embeddings resampled to each grid: ``(N_patches, D)`` float32 on
        ``device`` (None: the grid's; see :func:`block_order_hw`)."""
        idx, weights = self.position_taps(grid_thw, device)
        return (self.pos_embed(idx).float() * weights[:, :, None]).sum(1)

    def position_taps(self, grid_thw: torch.Tensor, device: torch.device | str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bilinear taps :meth:`position_embeddings` sums: ``pos_embed`` rows ``(N_patches, 4)``
        int64 and their weights ``(N_patches, 4)`` float32 on ``device`` (None: the grid's; no
        weights read: the ONNX graph's feed)."""
        g = self.cfg.grid_side
        device = grid_thw.device if device is None else device
        rc = block_order_hw(grid_thw, self.cfg.spatial_merge_size, device)  # (N, 2)
        sizes = [(t * h * w, h, w) for t, h, w in grid_thw.tolist()]
        heights = torch.cat([torch.full((n,), h, device=device) for n, h, _ in sizes])
        widths = torch.cat([torch.full((n,), w, device=device) for n, _, w in sizes])
        h_taps, h_w = bilinear_taps(rc[:, 0], heights, g)
        w_taps, w_w = bilinear_taps(rc[:, 1], widths, g)
        idx = (h_taps[:, :, None] * g + w_taps[:, None, :]).reshape(-1, 4)  # (N, 4)
        weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)  # (N, 4) float32
        return idx, weights

    def rotary(self, grid_thw: torch.Tensor, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary ``cos``/``sin`` ``(N_patches, head_dim)`` float32 on ``device`` (None: the grid's)."""
        quarter = self.cfg.head_dim // 2
        dev = grid_thw.device if device is None else device
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=dev) / quarter))
        rc = block_order_hw(grid_thw, self.cfg.spatial_merge_size, dev).float()  # (N, 2)
        ang = (rc[:, :, None] * inv_freq).flatten(1)  # (N, Dh/2): [h * f, w * f]
        ang = torch.cat([ang, ang], -1)  # (N, Dh)
        return ang.cos(), ang.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                n_blocks: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``pixel_values`` ``(N_patches, C*T*p*p)``, ``grid_thw`` ``(N_items, 3)`` int64 ->
        (vision tokens ``(N_patches / 4, D_out)``, DeepStack features: one ``(N_patches / 4, D_out)``
        per ``deepstack_visual_indexes`` entry, in that order). ``n_blocks`` stops after that many
        blocks (the merger then runs on that block's output; DeepStack features past it are absent).

        A CPU ``grid_thw`` costs no host sync (every index is built on the pixels' device): the
        forward is then CUDA-graph safe (:mod:`edgevlm.runtime.vision_graphs`).

        Raises ``ValueError`` when the patch count does not match ``grid_thw``."""
        grid_thw = grid_thw.to(dtype=torch.long)
        dev = pixel_values.device
        if sum(t * h * w for t, h, w in grid_thw.tolist()) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patches do not match grid_thw {grid_thw.tolist()}")
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grid_thw, dev).to(x.dtype)
        cos, sin = self.rotary(grid_thw, dev)
        seg_lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]  # one attention segment per frame
        deepstack: list[torch.Tensor] = []
        depth = len(self.blocks) if n_blocks is None else n_blocks
        for i, block in enumerate(self.blocks[:depth]):
            x = block(x, cos, sin, seg_lens)
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


# ---- exit hooks (early exit, edgevlm.runtime.adaptive) -----------------------------------------


def block_to_raster(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``(N,)`` int64 index that puts patch states in the tower's merge-block order into raster
    order (per item, frame-major): ``x_raster = x_block[index]``."""
    rc = block_order_hw(grid_thw, merge)  # (N, 2)
    pos, base = [], 0
    for t, h, w in grid_thw.tolist():
        n = t * h * w
        local = rc[base:base + n]
        frame = torch.arange(n, device=rc.device) // (h * w)
        pos.append(base + frame * h * w + local[:, 0] * w + local[:, 1])
        base += n
    return torch.argsort(torch.cat(pos))


class Qwen3ExitRun:
    """One block-by-block encode of :class:`Qwen3VLVisionTower` (the
    :class:`edgevlm.runtime.adaptive.ViTRun` protocol): the tower's own stem, blocks, merger and
    DeepStack mergers, so a run without an exit equals ``forward`` exactly. After an exit at block
    k, the DeepStack features of layers up to k are the real ones and those of deeper layers are
    their mergers applied to the adapter's output (see :mod:`edgevlm.runtime.adaptive`)."""

    def __init__(self, tower: Qwen3VLVisionTower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        grid_thw = grid_thw.to(device=pixel_values.device, dtype=torch.long)
        if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patches do not match grid_thw {grid_thw.tolist()}")
        self.tower, self.grid_thw = tower, grid_thw
        x = tower.patch_embed(pixel_values)
        self.x = x + tower.position_embeddings(grid_thw).to(x.dtype)
        self.cos, self.sin = tower.rotary(grid_thw)
        self.seg_lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        self.deepstack: dict[int, torch.Tensor] = {}  # 0-based block index -> its merged features
        self.n_blocks = len(tower.blocks)
        self.blocks_run = 0
        unit = tower.cfg.spatial_merge_size ** 2
        self.token_groups = [t * h * w // unit for t, h, w in grid_thw.tolist()]

    def step(self) -> torch.Tensor:
        i = self.blocks_run
        self.x = self.tower.blocks[i](self.x, self.cos, self.sin, self.seg_lens)
        indexes = self.tower.cfg.deepstack_visual_indexes
        if i in indexes:
            self.deepstack[i] = self.tower.deepstack_merger_list[indexes.index(i)](self.x)
        self.blocks_run += 1
        return self.x[None]  # (1, N, D), merge-block order

    def pooled_view(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        if self.grid_thw.shape[0] != 1:
            raise ValueError("exit confidence reads one image or video at a time")
        t, h, w = self.grid_thw[0].tolist()
        return hidden[:, block_to_raster(self.grid_thw, self.tower.cfg.spatial_merge_size)], (t * h, w)

    def finish(self, hidden: torch.Tensor, exit_block: int | None = None, adapter=None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = (hidden if adapter is None else adapter(hidden).to(hidden.dtype))[0]  # (N, D)
        done = self.n_blocks if exit_block is None else exit_block  # blocks 0..done-1 ran for real
        side = [self.deepstack[i] if i < done else self.tower.deepstack_merger_list[j](x)
                for j, i in enumerate(self.tower.cfg.deepstack_visual_indexes)]
        return self.tower.merger(x), side
