"""Run the ``onnx/vision.onnx`` of a Qwen2.5-VL, Qwen3-VL, SmolVLM2 or InternVL bundle on onnxruntime.

The graphs (written by :mod:`edgevlm.quantize.onnx_vision_export`, whose docstring is the graph
contract) are shape-generic: everything that depends on the image's patch grid is computed here, on
the host, by the same functions the PyTorch towers use, and fed as graph inputs:

- Qwen2.5-VL: the 2-D rotary ``cos``/``sin`` and the window layout of
  :func:`edgevlm.runtime.models.qwen2_5_vl.vision.vision_layout`, given to the graph in the
  processor's patch order (no reordering inside the graph): for the window-attention blocks and for
  the full-attention blocks (one segment per frame) a padded gather table ``(S, L)`` of patch rows, its
  additive key bias ``(S, L)`` and the scatter index ``(N,)`` that puts the ``S * L`` results back;
- Qwen3-VL: the bilinear position-embedding taps (``Qwen3VLVisionTower.position_taps``), the rotary
  ``cos``/``sin`` (``Qwen3VLVisionTower.rotary``) and the per-frame attention segments (same tables);
- SmolVLM2: the bucketed position ids (:func:`edgevlm.runtime.models.smolvlm.vision.bucketed_position_ids`)
  and the padded-patch key bias of each tile, from the request's ``pixel_attention_mask`` (all patches
  valid when there is none);
- InternVL: nothing but the tiles (always the trained tile size).

:class:`VisionGraph` is the session plus these feeds; its outputs equal the PyTorch tower's
(``Qwen*VisionTower.forward``, ``SmolVLMModel.encode_tiles``), in float32.
Needs ``pip install 'edgevlm[onnx]'`` (onnxruntime).
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from edgevlm.errors import ModelLoadError

__all__ = ["VISION_FAMILIES", "VisionGraph", "segment_tables", "vision_feeds"]

logger = logging.getLogger(__name__)

#: families whose vision.onnx this module feeds
VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm", "internvl", "gemma3")
_MASKED = float(np.finfo(np.float32).min)  # additive bias of a padding key (finite: no row is all padding)


def segment_tables(prefix: str, order: torch.Tensor, cu_seqlens: torch.Tensor) -> dict[str, np.ndarray]:
    """Gather/bias/scatter tables of attention inside segments.

    ``order`` ``(N,)`` int64: the patch (row of the graph's ``(N, D)`` activations) at each position of
    the segmented sequence; ``cu_seqlens`` ``(S + 1,)`` int64: segment bounds in that sequence. Returns
    ``{prefix}_index`` ``(S, L)`` int64 (the patches of segment ``s``, padded with patch 0, ``L`` the
    longest segment), ``{prefix}_bias`` ``(S, L)`` float32 (0 for a real key, float32 min for padding)
    and ``{prefix}_scatter`` ``(N,)`` int64 (where patch ``i`` sits in the flattened ``S * L`` rows)."""
    cu = cu_seqlens.to(torch.int64).cpu()
    lengths = cu[1:] - cu[:-1]
    n_seg, n = lengths.numel(), int(cu[-1])
    width = int(lengths.max()) if n_seg else 0
    seg = torch.repeat_interleave(torch.arange(n_seg), lengths)  # (N,)
    off = torch.arange(n) - cu[:-1][seg]
    index = torch.zeros(n_seg, width, dtype=torch.int64)
    bias = torch.full((n_seg, width), _MASKED, dtype=torch.float32)
    index[seg, off] = order.cpu()
    bias[seg, off] = 0.0
    scatter = torch.empty(n, dtype=torch.int64)
    scatter[order.cpu()] = seg * width + off
    return {f"{prefix}_index": index.numpy(), f"{prefix}_bias": bias.numpy(), f"{prefix}_scatter": scatter.numpy()}


def _qwen2_5_vl_feeds(cfg, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, np.ndarray]:
    from edgevlm.runtime.models.qwen2_5_vl.vision import vision_layout

    vc = cfg.vision
    layout = vision_layout(grid_thw.cpu(), vc)
    unit = vc.spatial_merge_size ** 2
    order = (layout.window_index[:, None] * unit + torch.arange(unit)).reshape(-1)  # window position -> patch
    cos, sin = torch.empty_like(layout.cos), torch.empty_like(layout.sin)
    cos[order], sin[order] = layout.cos, layout.sin  # back to the processor's patch order
    feeds = {"pixel_values": _f32(pixel_values), "rope_cos": cos.numpy(), "rope_sin": sin.numpy()}
    feeds.update(segment_tables("window", order, layout.cu_window_seqlens))
    feeds.update(segment_tables("frame", order, layout.cu_seqlens))
    return feeds


def _qwen3_vl_feeds(tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, np.ndarray]:
    grid = grid_thw.cpu().to(torch.int64)
    idx, weights = tower.position_taps(grid)
    cos, sin = tower.rotary(grid)
    frames = torch.tensor([h * w for t, h, w in grid.tolist() for _ in range(t)], dtype=torch.int64)
    cu = torch.nn.functional.pad(frames.cumsum(0), (1, 0))
    feeds = {"pixel_values": _f32(pixel_values), "pos_index": idx.numpy(), "pos_weight": weights.float().numpy(),
             "rope_cos": cos.numpy(), "rope_sin": sin.numpy()}
    feeds.update(segment_tables("frame", torch.arange(int(cu[-1])), cu))
    return feeds


def _smolvlm_feeds(cfg, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None) -> dict[str, np.ndarray]:
    from edgevlm.runtime.models.smolvlm.vision import bucketed_position_ids, patch_attention_mask

    vc = cfg.vision
    n, _, h, w = pixel_values.shape
    if pixel_mask is None:
        patch_mask = torch.ones(n, h // vc.patch_size, w // vc.patch_size, dtype=torch.bool)
    else:
        patch_mask = patch_attention_mask(pixel_mask.cpu(), vc.patch_size)
    ids = bucketed_position_ids(patch_mask, vc.grid_side)  # (N, h*w)
    bias = torch.where(patch_mask.reshape(n, -1), 0.0, _MASKED).to(torch.float32)
    return {"pixel_values": _f32(pixel_values), "position_ids": ids.numpy(), "key_bias": bias.numpy()}


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def vision_feeds(family: str, cfg, pixel_values: torch.Tensor, *, grid_thw: torch.Tensor | None = None,
                 pixel_mask: torch.Tensor | None = None, tower=None) -> dict[str, np.ndarray]:
    """The graph inputs of ``family``'s vision.onnx (names, shapes and dtypes: the contract in
    :mod:`edgevlm.quantize.onnx_vision_export`).

    ``pixel_values`` is the processor's (Qwen ``(N_patches, C*T*p*p)``, SmolVLM ``(N_tiles, 3, H, W)``);
    ``grid_thw`` ``(N_items, 3)`` for the Qwen families; ``pixel_mask`` ``(N_tiles, H, W)`` for
    SmolVLM (None: every pixel real); ``tower``: a Qwen3-VL tower (any device, meta included) whose
    host-side methods give the position taps and rotary tables.

    Raises:
        ValueError: an unknown family, a Qwen input without ``grid_thw``, or a patch count that
            does not match ``grid_thw``.
    """
    if family in ("qwen2_5_vl", "qwen3_vl"):
        if grid_thw is None:
            raise ValueError(f"{family} vision input needs grid_thw")
        if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patches do not match grid_thw {grid_thw.tolist()}")
        if family == "qwen2_5_vl":
            return _qwen2_5_vl_feeds(cfg, pixel_values, grid_thw)
        return _qwen3_vl_feeds(tower, pixel_values, grid_thw)
    if family == "smolvlm":
        return _smolvlm_feeds(cfg, pixel_values, pixel_mask)
    if family in ("internvl", "gemma3"):  # tiles / images at the trained size: nothing depends on the image
        return {"pixel_values": _f32(pixel_values)}
    raise ValueError(f"no ONNX vision graph for the {family} family (supported: {', '.join(VISION_FAMILIES)})")


class VisionGraph:
    """An onnxruntime session of a bundle's vision.onnx with its host-side feeds.

    ``path``: the graph; ``family``: the bundle's family name; ``cfg``: its parsed config (the
    ``files.config`` of :class:`~edgevlm.runtime.loader.ModelFiles`); ``providers``: onnxruntime
    execution providers, best first.

    Raises ModelLoadError for another family or when onnxruntime cannot load the graph."""

    def __init__(self, path: str | Path, family: str, cfg, providers: list[str]) -> None:
        self.family = family
        if self.family not in VISION_FAMILIES:
            raise ModelLoadError(f"no ONNX vision graph for the {self.family} family")
        self.cfg = cfg
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ModelLoadError(f"onnxruntime cannot load {path}: {exc}") from exc
        self.output_names = [o.name for o in self.session.get_outputs()]

    @cached_property
    def _tower(self):
        if self.family != "qwen3_vl":
            return None
        from edgevlm.runtime.models.qwen3_vl.vision import Qwen3VLVisionTower

        with torch.device("meta"):  # only the host-side methods are used: no weights
            return Qwen3VLVisionTower(self.cfg.vision)

    def run(self, pixel_values: torch.Tensor, *, grid_thw: torch.Tensor | None = None,
            pixel_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The graph's outputs as float32 CPU tensors, in :attr:`output_names` order: ``image_features``
        (Qwen ``(N_patches / 4, D_text)``, SmolVLM ``(N_tiles, image_seq_len, D_text)``), then Qwen3-VL's
        ``deepstack.{k}`` ``(N_patches / 4, D_text)``. Arguments as :func:`vision_feeds`."""
        feeds = vision_feeds(self.family, self.cfg, pixel_values, grid_thw=grid_thw, pixel_mask=pixel_mask,
                             tower=self._tower)
        return [torch.from_numpy(x) for x in self.session.run(self.output_names, feeds)]
