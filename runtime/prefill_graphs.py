"""CUDA graphs of the decoder's prefill, one per shape of its inputs (rows and length buckets).

A prefill launched from Python is bound by the host on a big GPU: the demo model (hidden 256, 4
layers) takes ~3 ms of host time to launch a prefill of 2 or of 32 prompts of ~450 tokens on an
H200 while the GPU work is well under a millisecond, and a 7B's single prefill took 59 ms eagerly
against 26 ms replayed (``bench/results/ttft_breakdown_h200_20261202.log``). So
:meth:`~edgevlm.runtime.decoder.Decoder.prefill_batch` (embeddings in, last logits out, the KV cache
written in place) is captured once per shape and replayed, with every family's hooks as graph
inputs: ``rope`` (per-row RoPE tables: M-RoPE, pruned LLaVA tokens), ``layer_adds`` (Qwen3-VL's
DeepStack) and ``image_blocks`` (Gemma 3's bidirectional image attention). The families turn a
pending prefill into those inputs themselves (``DecoderVLM.prefill_inputs`` for one request,
``prefill_batch_inputs`` for cache rows), so a replay computes what their eager ``prefill`` does.

Shapes are bucketed so that a handful of graphs serve every group (:func:`pad_prefill`): rows to the
next power of two, length to the next multiple of :data:`LENGTH_BUCKET` (capped by the KV cache),
DeepStack features to a multiple of :data:`LENGTH_BUCKET` rows. Padding is harmless:

* positions past a prompt's length are right padding (zero embeddings and RoPE tables, image block
  -1, no DeepStack add): causal attention never lets a real position read them, a sliding layer's
  ring cache keeps each row's real positions only (the row's length is an input), and the cache
  slots they fill are overwritten by decode before they are attended to (the eager batched
  prefill pads the same way, to its longest prompt);
* the padding rows repeat the group's last prompt (its embeddings, length, hooks and DeepStack
  features) into cache rows that hold no request (the caller's free rows) or, when there are none
  left, into that prompt's own row (the same values written twice); their logits are dropped;
* DeepStack rows past the mask's count are never read (:func:`~edgevlm.runtime.decoder.add_at_mask`).

A graph is keyed by every input's presence, shape and dtype. Each is checked once when captured:
its first replay must give the eager forward's logits on the same inputs (within 2e-2: the same
kernels, 16-bit logits), else that key runs eagerly (one WARNING). Graphs share one memory pool
(they never run concurrently) and at most ``max_graphs`` are kept (least recently used dropped);
the logits are cloned out of the graph's output after each replay.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 64
"""Prompt lengths are padded to a multiple of this many positions in a captured prefill."""


def rows_bucket(n: int) -> int:
    """Captured rows for a group of ``n`` prompts: the next power of two."""
    return 1 << (n - 1).bit_length()


def length_bucket(t: int, max_seq_len: int) -> int:
    """Captured length for a longest prompt of ``t`` positions (at most ``max_seq_len``)."""
    return min(max_seq_len, -(-t // LENGTH_BUCKET) * LENGTH_BUCKET)


def padding_rows(rows: list[int], spare_rows: list[int] | None, pad_rows: int) -> list[int]:
    """Cache rows for the ``pad_rows`` padding rows of a group written into ``rows``: the first
    ``spare_rows`` (rows holding no request) not in ``rows``, then ``rows[-1]`` again (the group's
    last prompt written twice into its own row: the same values)."""
    taken = set(rows)
    extra = [r for r in (spare_rows or []) if r not in taken][:pad_rows]
    return extra + [rows[-1]] * (pad_rows - len(extra))


def pad_prefill(embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, hooks: dict, length: int,
                extra_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Right-pad the arguments of ``Decoder.prefill_batch`` to a captured shape.

    ``embeds`` ``(B, T, D)``, ``lengths`` / ``rows`` ``(B,)`` int64 and ``hooks`` (present ones of
    ``rope`` ``(cos, sin)`` ``(B, T, Dh)``, ``layer_adds`` per layer None or ``(mask (B, T) bool,
    feats (N, D))`` with N the mask's count, ``image_blocks`` ``(B, T)`` int64) -> the same padded to
    ``length`` >= T positions (embeddings and tables with zeros, masks with False, image blocks
    with -1), with one more row per entry of ``extra_rows`` (cache rows) repeating the last row's
    prompt, and each DeepStack ``feats`` padded with zero rows to a multiple of
    :data:`LENGTH_BUCKET` (its last row's features repeated first for the extra rows). A mask
    shared by several layers stays one tensor. Raises ``ValueError`` for ``length`` < T."""
    b, t = embeds.shape[:2]
    if length < t:
        raise ValueError(f"cannot pad a prefill of {t} positions to {length}")
    extra = list(extra_rows or [])
    dev = embeds.device
    pick = torch.tensor(list(range(b)) + [b - 1] * len(extra), device=dev) if extra else None

    def pad(x: torch.Tensor, value=0) -> torch.Tensor:  # (B, T, ...) -> (B + extra, length, ...)
        if pick is not None:
            x = x.index_select(0, pick)
        if length == t:
            return x
        widths = [0, 0] * (x.dim() - 2) + [0, length - t]
        return F.pad(x, widths, value=value)

    out: dict = {}
    if "rope" in hooks:
        out["rope"] = tuple(pad(table) for table in hooks["rope"])
    if "image_blocks" in hooks:
        out["image_blocks"] = pad(hooks["image_blocks"], -1)
    if "layer_adds" in hooks:
        masks: dict[int, tuple[torch.Tensor, int]] = {}  # id(mask) -> (padded mask, the last row's count)
        adds: list = []
        for add in hooks["layer_adds"]:
            if add is None:
                adds.append(None)
                continue
            mask, feats = add
            if id(mask) not in masks:
                masks[id(mask)] = (pad(mask, False), int(mask[-1].sum()) if extra else 0)
            padded, last = masks[id(mask)]
            n = feats.shape[0]
            parts = [feats] + [feats[n - last :]] * len(extra)
            n_all = n + last * len(extra)
            bucket = max(1, -(-n_all // LENGTH_BUCKET)) * LENGTH_BUCKET
            parts.append(feats.new_zeros(bucket - n_all, feats.shape[1]))
            adds.append((padded, torch.cat(parts)))
        out["layer_adds"] = adds
    if extra:
        lengths = lengths.index_select(0, pick)
        rows = torch.cat([rows, torch.tensor(extra, dtype=rows.dtype, device=rows.device)])
    return pad(embeds), lengths, rows, out


def _flatten(embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, hooks: dict
             ) -> tuple[list[torch.Tensor], tuple]:
    """The tensors of a prefill's inputs (each once: a mask shared by layers is one leaf) and the
    structure that :func:`_unflatten` rebuilds them from (which hooks, which layers add)."""
    leaves: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def leaf(x: torch.Tensor) -> int:
        if id(x) not in index:
            index[id(x)] = len(leaves)
            leaves.append(x)
        return index[id(x)]

    base = (leaf(embeds), leaf(lengths), leaf(rows))
    rope = tuple(leaf(x) for x in hooks["rope"]) if "rope" in hooks else None
    adds = None
    if "layer_adds" in hooks:
        adds = tuple(None if a is None else (leaf(a[0]), leaf(a[1])) for a in hooks["layer_adds"])
    blocks = leaf(hooks["image_blocks"]) if "image_blocks" in hooks else None
    return leaves, (base, rope, adds, blocks)


def _unflatten(leaves: list[torch.Tensor], spec: tuple) -> tuple[tuple[torch.Tensor, ...], dict]:
    """``(embeds, lengths, rows)`` and the hooks of :func:`_flatten`'s ``spec`` over ``leaves``."""
    base, rope, adds, blocks = spec
    hooks: dict = {}
    if rope is not None:
        hooks["rope"] = tuple(leaves[i] for i in rope)
    if adds is not None:
        hooks["layer_adds"] = [None if a is None else (leaves[a[0]], leaves[a[1]]) for a in adds]
    if blocks is not None:
        hooks["image_blocks"] = leaves[blocks]
    return tuple(leaves[i] for i in base), hooks


class PrefillGraphs:
    """Replays ``forward(embeds (B, T, D), lengths (B,) int64, rows (B,) int64, **hooks) -> logits
    (B, V)`` (``Decoder.prefill_batch``'s signature; ``hooks``: its ``rope``, ``layer_adds``,
    ``image_blocks``) from CUDA graphs keyed by the presence, shape and dtype of every input; at
    most ``max_graphs`` kept (least recently used dropped), all in one memory pool.

    Raises ``RuntimeError`` when ``device`` is not CUDA.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], device: torch.device, max_graphs: int = 16) -> None:
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

    def keys(self) -> list[tuple]:
        """The keys of the graphs kept, least recently used first: ``(structure, ((shape, dtype), ...))``
        (:func:`_flatten`'s structure; the shapes of embeds, lengths, rows, then the hooks' tensors)."""
        return list(self._graphs)

    def __call__(self, embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, **hooks) -> torch.Tensor:
        """``embeds`` ``(B, T, D)`` already padded to a bucket (:func:`pad_prefill`), ``lengths`` /
        ``rows`` ``(B,)`` int64 and the hooks' tensors on the device -> the forward's logits
        ``(B, V)`` (a fresh tensor)."""
        leaves, spec = _flatten(embeds, lengths, rows, hooks)
        key = (spec, tuple((tuple(x.shape), x.dtype) for x in leaves))
        if key in self._eager:
            return self.forward(embeds, lengths, rows, **hooks)
        entry = self._graphs.get(key)
        if entry is None:
            return self._capture(key, leaves, spec)
        self._graphs.move_to_end(key)
        graph, static, out = entry
        for buf, value in zip(static, leaves, strict=True):
            buf.copy_(value)
        graph.replay()
        return out.clone()

    def _capture(self, key: tuple, leaves: list[torch.Tensor], spec: tuple) -> torch.Tensor:
        """Capture the graph for ``key`` and return the eager logits of this call (the first replay
        must equal them, else the key stays eager)."""
        t0 = time.perf_counter()
        static = [x.clone() for x in leaves]
        args, hooks = _unflatten(static, spec)
        name = tuple(args[0].shape[:2]), tuple(sorted(hooks))
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # cuBLAS / SDPA workspaces before capture; writes the same cache rows
                    expected = self.forward(*args, **hooks)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.forward(*args, **hooks)
            graph.replay()
        except RuntimeError as exc:
            logger.warning("prefill not CUDA-graph capturable for %s (%s): running it eagerly", name, exc)
            self._eager.add(key)
            args, hooks = _unflatten(leaves, spec)
            return self.forward(*args, **hooks)
        if not torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2):
            err = (out.float() - expected.float()).abs().max().item()
            logger.warning("prefill graph %s replays other logits than eager (max abs diff %.3g): "
                           "running it eagerly", name, err)
            self._eager.add(key)
            return expected.clone()
        if self._pool is None:
            self._pool = graph.pool()
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        self._graphs[key] = (graph, static, out)
        self.capture_ms[key] = (time.perf_counter() - t0) * 1e3
        logger.info("captured prefill graph %s in %.1f ms", name, self.capture_ms[key])
        return out.clone()
