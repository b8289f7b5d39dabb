"""CUDA-graph capture of the decode step over the static KV cache.

One decode step of a 7B model is ~450 kernel launches; eager PyTorch spends several microseconds
of host time per launch, so batch-1 decode is bound by launch overhead long before memory
bandwidth. Capturing the step once into a ``torch.cuda.CUDAGraph`` and replaying it launches the
whole step at once (NVIDIA, "CUDA C++ Programming Guide", section "CUDA Graphs"; the same technique
as gpt-fast's ``torch.compile(mode="reduce-overhead")`` and vLLM's decode graphs).

A graph replays fixed kernels on fixed addresses, so everything that varies between steps lives in
static buffers that are updated in place before :meth:`DecodeGraphs.replay`: the token ids
``(B_max, 1)``, per-row positions ``(B_max,)`` and, for multimodal-RoPE decoders, per-row RoPE
offsets ``(B_max,)``. The attention mask is computed inside the graph
from the positions. Shapes that differ (batch size, attended KV length) get one graph each, keyed
by ``(batch, kv_len)``; ``kv_len`` comes from :func:`edgevlm.runtime.kv_cache.kv_bucket`, so a
4096-position cache needs at most ``log2(4096 / 256) + 1 = 5`` graphs per batch size. All graphs
share one memory pool (they never run concurrently).

A *feeding* graph (``feed=True``, its own key) also writes the next step's inputs into the same
buffers: each row's greedy token and its position + 1 (:func:`~edgevlm.runtime.sampling.greedy_feed`).
Greedy decoding replays it step after step without the host writing anything in between, so the
host can queue step ``k + 1`` before it reads token ``k`` (the GPU never waits for the host's
per-token work; :meth:`~edgevlm.runtime.backends.torch_backend.TorchBackend.greedy_step`).

Capture runs the step eagerly twice on a side stream first (cuBLAS/SDPA workspace set-up, lazy
kernel re-layouts such as :class:`~edgevlm.runtime.int4.Int4Linear`'s). Those runs write the same
keys/values at the same positions as the replay that follows, so capturing in the middle of a
generation is harmless.
"""

from __future__ import annotations

import logging
import time

import torch

from edgevlm.runtime.decoder import Decoder
from edgevlm.runtime.sampling import greedy_feed

logger = logging.getLogger(__name__)


def graph_batch_size(n: int, max_batch_size: int) -> int:
    """The captured batch size used for ``n`` rows: the next power of two, capped at the cache's
    ``max_batch_size`` (rows past ``n`` compute garbage into free cache rows)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_batch_size)


def decode_step_from(decoder: Decoder, tokens: torch.Tensor, positions: torch.Tensor, rope_offsets: torch.Tensor,
                     batch: int, kv_len: int, feed: bool) -> torch.Tensor:
    """:meth:`Decoder.decode_step` of rows ``0..batch-1`` from input buffers ``tokens (B_max, 1)``,
    ``positions (B_max,)`` and ``rope_offsets (B_max,)`` (int64; the offsets are read by multimodal-RoPE
    decoders only) -> logits ``(batch, V)``; ``feed``: the step also writes the next step's inputs into
    the buffers (:func:`~edgevlm.runtime.sampling.greedy_feed`). What a (feeding) graph captures, and
    what the torch backend runs eagerly where there are no graphs."""
    offsets = rope_offsets[:batch] if decoder.cfg.mrope_section is not None else 0
    logits = decoder.decode_step(tokens[:batch], positions[:batch], kv_len, offsets)
    if feed:
        greedy_feed(logits, tokens[:batch], positions[:batch])
    return logits


class DecodeGraphs:
    """CUDA graphs of :meth:`Decoder.decode_step` per ``(batch, kv_len)``.

    Usage: write the step's inputs into :attr:`tokens` ``[:batch]`` and :attr:`positions`
    ``[:batch]`` (and :attr:`rope_offsets` ``[:batch]`` when :attr:`uses_rope_offsets`), then :meth:`replay` returns the logits ``(batch, V)`` — a static output tensor
    that the next replay overwrites (consume or clone it first).

    Raises ``RuntimeError`` if the decoder is not on a CUDA device.
    """

    def __init__(self, decoder: Decoder, max_batch_size: int | None = None) -> None:
        device = decoder.embed_tokens.weight.device
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the decoder is on {device}")
        self.decoder = decoder
        self.device = device
        self.max_batch_size = max_batch_size or decoder.max_batch_size
        self.tokens = torch.zeros(self.max_batch_size, 1, dtype=torch.long, device=device)  # (B_max, 1)
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)  # (B_max,)
        # M-RoPE decoders (mrope_section): RoPE position = slot + rope_offsets[row] (see Decoder.forward)
        self.rope_offsets = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)  # (B_max,)
        self.uses_rope_offsets = decoder.cfg.mrope_section is not None
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.capture_ms: dict[tuple[int, int, bool], float] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def _step(self, batch: int, kv_len: int, feed: bool = False) -> torch.Tensor:
        return decode_step_from(self.decoder, self.tokens, self.positions, self.rope_offsets, batch, kv_len, feed)

    def eager(self, batch: int, kv_len: int, feed: bool = False) -> torch.Tensor:
        """The same step without a graph (reference for tests and the GPU suite)."""
        return self._step(batch, kv_len, feed)

    def capture(self, batch: int, kv_len: int, feed: bool = False) -> None:
        """Capture the graph for ``(batch, kv_len, feed)`` (no-op when it exists). The inputs in the
        buffers are what the replay after it reads (a feeding step's warm-up runs restore them)."""
        key = (batch, kv_len, feed)
        if key in self._graphs:
            return
        if not 1 <= batch <= self.max_batch_size or not 1 <= kv_len <= self.decoder.max_seq_len:
            raise ValueError(f"cannot capture batch={batch}, kv_len={kv_len} "
                             f"(cache: {self.max_batch_size} rows x {self.decoder.max_seq_len} positions)")
        t0 = time.perf_counter()
        # the inputs to restore, copied on the current stream before the side stream starts (it moves them on)
        inputs = (self.tokens.clone(), self.positions.clone()) if feed else None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(batch, kv_len, feed)
                if inputs is not None:  # a feeding run moved the inputs on: the next run (and the replay) reads these
                    self.tokens.copy_(inputs[0])
                    self.positions.copy_(inputs[1])
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(batch, kv_len, feed)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = (graph, out)
        self.capture_ms[key] = (time.perf_counter() - t0) * 1e3
        logger.debug("captured decode graph batch=%d kv_len=%d feed=%s in %.1f ms", batch, kv_len, feed,
                     self.capture_ms[key])

    def replay(self, batch: int, kv_len: int, feed: bool = False) -> torch.Tensor:
        """Run the step for the inputs in the static buffers (capturing first if needed); returns
        the static logits ``(batch, V)``. ``feed``: the feeding graph (module docstring), which
        leaves the next step's inputs in the buffers."""
        key = (batch, kv_len, feed)
        if key not in self._graphs:
            self.capture(batch, kv_len, feed)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def reset(self) -> None:
        """Drop every graph (e.g. after the caches were re-allocated)."""
        self._graphs.clear()
        self._pool = None
