"""A per-frame cache of vision features (issue 13 §4): robots ask several questions about one frame,
so the vision encoder runs once per (frame, operating point) and each question's prefill reuses the
cached vision tokens.

Keys are ``(frame identity, operating-point knobs that change the features)``; the frame identity is
a caller-supplied key (a source's ``(name, seq)``) or the content hash of the image arrays
(:func:`content_key`: BLAKE2b-128 over each array's shape, dtype and bytes). Entries are evicted in
least-recently-used order to stay within ``budget_bytes`` (features counted at
``numel * element_size``); an entry larger than the whole budget is not stored.

Early exit gated by a question-conditioned confidence (``exit_threshold``) makes the vision tokens
depend on the question, but not the encoder's blocks: block ``k``'s output is a function of the
frame alone. For those points the cache keeps a :class:`VisionTrunk` per (frame, resolution) — the
outputs of the exit blocks walked so far and the encoder positioned at its deepest block — and the
next question's walk reads its exit heads off the stored outputs, running only the blocks past the
deepest one it needs (:func:`edgevlm.runtime.vision.encode_adaptive`,
:func:`edgevlm.runtime.adaptive.encode_adaptive`). Its answer equals the uncached walk's.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch


def content_key(images: Sequence[np.ndarray], extra: Hashable = None) -> tuple:
    """``("blake2b", hex digest, extra)`` identifying the pixels of ``images`` (in order)."""
    h = hashlib.blake2b(digest_size=16)
    for a in images:
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).data)
    return ("blake2b", h.hexdigest(), extra)


class VisionCache:
    """LRU of ``key -> (features (N, D) tensor, backend vision info | None)`` within ``budget_bytes``.

    Thread-safe. Counters: ``hits``, ``misses``, ``evictions``; ``bytes_used``.
    """

    def __init__(self, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"vision cache budget must be a positive number of bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[Hashable, tuple[torch.Tensor, Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: Hashable) -> tuple[torch.Tensor, Any] | None:
        """The cached ``(features, info)`` for ``key`` (now most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0], entry[1]

    def put(self, key: Hashable, features: Any, info: Any = None) -> None:
        """Store ``features`` (a tensor, or a :class:`VisionTrunk`) for ``key``, evicting least
        recently used entries past the budget."""
        size = features.nbytes() if isinstance(features, VisionTrunk) else features.numel() * features.element_size()
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes_used -= old[2]
            if size > self.budget_bytes:
                return
            while self.bytes_used + size > self.budget_bytes and self._entries:
                _, (_, _, freed) = self._entries.popitem(last=False)
                self.bytes_used -= freed
                self.evictions += 1
            self._entries[key] = (features, info, size)
            self.bytes_used += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes_used = 0


class VisionTrunk:
    """The encoder walk of one frame at one resolution, kept for the next question's early exit
    (see the module doc). A family's adaptive encode fills it; nothing here runs a model.

    Attributes:
        blocks_run: encoder blocks run on this frame so far (0: none, not even the stem).
        seen: block -> its output ``(1, T, D)`` for the exit blocks (and the last block) walked.
        x: the deepest block's output ``(1, T, D)`` (LLaVA's tower: where the next block starts).
        states: LLaVA's feature-layer outputs (``vision_feature_indices``) computed so far.
        run: a ``ViTRun`` positioned at ``blocks_run`` (the native-resolution families).
        tokens: exit block (the last block for the full depth) -> the vision tokens made there
            (LLaVA: ``(tokens, tokens_total, tokens_kept)``; the ViTRun families: ``(tokens, side
            features)``): an exit's tokens depend on the frame and the block, not the question.
    """

    def __init__(self) -> None:
        self.blocks_run = 0
        self.seen: dict[int, torch.Tensor] = {}
        self.x: torch.Tensor | None = None
        self.states: dict[int, torch.Tensor] = {}
        self.run: Any = None
        self.tokens: dict[int, tuple] = {}

    def nbytes(self) -> int:
        """Bytes held in tensors (each counted once; a ``ViTRun``'s own state as one more block)."""
        made = [t for entry in self.tokens.values() for item in entry
                for t in (item if isinstance(item, list) else [item]) if isinstance(t, torch.Tensor)]
        tensors = {id(t): t for t in [*self.seen.values(), *self.states.values(), self.x, *made] if t is not None}
        held = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.run is not None and self.seen:
            last = self.seen[max(self.seen)]
            held += last.numel() * last.element_size()
        return held
