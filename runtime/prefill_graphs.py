"""CUDA graphs of the decoder's batched prefill, one per (rows bucket, length bucket).

A small decoder's prefill is launch-bound on a big GPU: the demo model (hidden 256, 4 layers) takes
~3 ms of host time to launch a prefill of 2 or of 32 prompts of ~450 tokens on an H200, while the
GPU work is well under a millisecond; under load that host time, not the GPU, bounds the answers per
second (``bench/results/daemon_throughput_h200_20261202.md``). So :meth:`Decoder.prefill_batch`
(embeddings in, last logits out, the KV cache written in place) is captured once per shape and
replayed.

Shapes are bucketed so that a handful of graphs serve every group: rows to the next power of two,
length to the next multiple of :data:`LENGTH_BUCKET` (capped by the KV cache). Padding is harmless:

* positions past a prompt's length are right padding: causal attention never lets a real position
  read them, and the cache slots they fill are overwritten by decode before they are attended to
  (the eager batched prefill pads the same way, to its longest prompt);
* the padding rows are written into cache rows that hold no request (the caller's free rows) or,
  when there are none left, into the group's last row with the group's last prompt again (the same
  values written twice); their logits are dropped.

Each graph is checked once when captured: its first replay must give the eager forward's logits on
the same inputs (within 2e-2: the same kernels, 16-bit logits), else that shape runs eagerly (one
WARNING). Graphs share one memory pool (they never
run concurrently); the logits are cloned out of the graph's output after each replay.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 64
"""Prompt lengths are padded to a multiple of this many positions in a captured prefill."""


def rows_bucket(n: int) -> int:
    """Captured rows for a group of ``n`` prompts: the next power of two."""
    return 1 << (n - 1).bit_length()


def length_bucket(t: int, max_seq_len: int) -> int:
    """Captured length for a longest prompt of ``t`` positions (at most ``max_seq_len``)."""
    return min(max_seq_len, -(-t // LENGTH_BUCKET) * LENGTH_BUCKET)


class PrefillGraphs:
    """Replays ``forward(embeds (B, T, D), lengths (B,) int64, rows (B,) int64) -> logits (B, V)``
    from CUDA graphs keyed by ``(B, T)``; at most ``max_graphs`` kept (least recently used dropped).

    Raises ``RuntimeError`` when ``device`` is not CUDA.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, max_graphs: int = 16) -> None:
        if torch.device(device).type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._eager: set[tuple] = set()
        self._pool = None
        self.capture_ms: dict[tuple, float] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``embeds`` ``(B, T, D)`` already padded to a bucket, ``lengths`` / ``rows`` ``(B,)`` int64
        on the device -> the forward's logits ``(B, V)`` (a fresh tensor)."""
        key = (tuple(embeds.shape), embeds.dtype)
        if key in self._eager:
            return self.forward(embeds, lengths, rows)
        entry = self._graphs.get(key)
        if entry is None:
            return self._capture(key, embeds, lengths, rows)
        self._graphs.move_to_end(key)
        graph, static, out = entry
        for buf, value in zip(static, (embeds, lengths, rows), strict=True):
            buf.copy_(value)
        graph.replay()
        return out.clone()

    def _capture(self, key: tuple, embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Capture the graph for ``key`` and return the eager logits of this call (the first replay
        must equal them, else the shape stays eager)."""
        t0 = time.perf_counter()
        static = (embeds.clone(), lengths.clone(), rows.clone())
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # cuBLAS / SDPA workspaces before capture; writes the same cache rows
                    expected = self.forward(*static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.forward(*static)
            graph.replay()
        except RuntimeError as exc:
            logger.warning("batched prefill not CUDA-graph capturable for %s (%s): running it eagerly", key[0], exc)
            self._eager.add(key)
            return self.forward(embeds, lengths, rows)
        if not torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2):
            err = (out.float() - expected.float()).abs().max().item()
            logger.warning("batched prefill graph %s replays other logits than eager (max abs diff %.3g): "
                           "running it eagerly", key[0], err)
            self._eager.add(key)
            return expected.clone()
        if self._pool is None:
            self._pool = graph.pool()
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        self._graphs[key] = (graph, static, out)
        self.capture_ms[key] = (time.perf_counter() - t0) * 1e3
        logger.info("captured batched prefill graph %s in %.1f ms", key[0], self.capture_ms[key])
        return out.clone()
