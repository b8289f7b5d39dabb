"""CUDA graphs of a vision tower's forward, one per input geometry.

A ViT of 24-27 blocks launches ~600 small kernels per image; at batch 1 and 448x448 the GPU work is
~3-4 ms while the host needs 10-18 ms to launch it (measured on the H200,
``bench/results/profile_families_h200_20261201*.md``). A robot's camera sends frames of one size, so
the tower's forward for that geometry is captured once into a ``torch.cuda.CUDAGraph`` and replayed
per frame (the technique of :mod:`edgevlm.runtime.cuda_graphs`, NVIDIA "CUDA C++ Programming Guide",
"CUDA Graphs").

The wrapped forward must be capture safe for a CPU ``grid_thw``: no host syncs and no host-to-device
copies inside (every index built on the device from the grid's Python ints), as
:class:`~edgevlm.runtime.models.qwen3_vl.vision.Qwen3VLVisionTower` is. What varies between frames,
the pixels, is copied into the graph's static input first; the outputs are cloned after the replay, so
callers may keep them (vision cache) while the next frame replays.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def vision_graphs_for(tower: Callable, device: torch.device, enabled: bool = True,
                      max_graphs: int = 4) -> VisionGraphs | None:
    """A family model's ``enable_vision_graphs``: :class:`VisionGraphs` of ``tower`` when ``enabled`` and
    ``device`` is CUDA, else None (the eager tower)."""
    if not enabled or torch.device(device).type != "cuda":
        return None
    return VisionGraphs(tower, device, max_graphs)


def _clone(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_clone(o) for o in out)
    return out


class VisionGraphs:
    """Replays ``forward(pixel_values, grid_thw)`` from CUDA graphs keyed by ``(pixel shape, dtype,
    grid_thw)``; at most ``max_graphs`` kept (least recently used dropped first). All graphs share one
    memory pool (they never run concurrently; each keeps its outputs alive).

    ``forward`` returns a tensor or a (nested) tuple / list of tensors. A geometry whose capture fails
    runs eagerly from then on (one WARNING). Raises ``RuntimeError`` when ``device`` is not CUDA."""

    def __init__(self, forward: Callable, device: torch.device, max_graphs: int = 4) -> None:
        if torch.device(device).type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = OrderedDict()
        self._eager: set[tuple] = set()
        self._pool = None
        self.capture_ms: dict[tuple, float] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """``pixel_values`` on the device, ``grid_thw`` ``(N_items, 3)`` int64 on the CPU -> the
        forward's outputs (fresh tensors)."""
        key = (tuple(pixel_values.shape), pixel_values.dtype, tuple(map(tuple, grid_thw.tolist())))
        if key in self._eager:
            return self.forward(pixel_values, grid_thw)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, pixel_values, grid_thw)
            if entry is None:
                return self.forward(pixel_values, grid_thw)
        self._graphs.move_to_end(key)
        graph, static_px, out = entry
        static_px.copy_(pixel_values)
        graph.replay()
        return _clone(out)

    def _capture(self, key: tuple, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        t0 = time.perf_counter()
        static_px = pixel_values.clone()
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # cuBLAS / SDPA workspaces, autotuning, before capture
                    self.forward(static_px, grid_thw)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.forward(static_px, grid_thw)
        except RuntimeError as exc:
            logger.warning("vision tower not CUDA-graph capturable for %s (%s): running it eagerly", key[2], exc)
            self._eager.add(key)
            return None
        if self._pool is None:
            self._pool = graph.pool()
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        self._graphs[key] = (graph, static_px, out)
        self.capture_ms[key] = (time.perf_counter() - t0) * 1e3
        logger.debug("captured vision graph %s in %.1f ms", key[2], self.capture_ms[key])
        return self._graphs[key]
