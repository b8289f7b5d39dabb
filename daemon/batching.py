"""Continuous batching on the daemon's inference worker (issue 6, "Dynamic batching").

When the engine was loaded with ``max_batch_size > 1`` KV-cache rows (``model.max_batch_size``, or a
cloud profile's ``runtime.max_batch_size`` on CUDA) and batching is on (``model.continuous_batching``
or the profile's ``runtime.continuous_batching``), the scheduler's worker
(:mod:`edgevlm.daemon.scheduler`) does not call ``engine.ask`` per request. It hands each dequeued
request to a :class:`BatchWorker`, which drives an
:class:`~edgevlm.runtime.batching.ContinuousBatcher` over the engine's backend between requests:

* a request is validated, tokenised and preprocessed exactly as ``Engine.ask`` does (same errors,
  same token ids, same resolution rung) when the worker takes it off the queue;
* between decode steps the waiting requests are admitted into free cache rows, prefilled in groups
  of ``prefill_token_budget`` padded tokens or more, as many as the measured prefill time lets into
  the scheduler's ``prefill_budget_ms`` (Orca-style iteration-level scheduling, see
  :mod:`edgevlm.runtime.batching`), and every running request advances one token per step;
* each request ends on its own EOS / ``max_new_tokens`` (the operating point's cap included) and
  is answered at once, with an :class:`~edgevlm.types.Answer` built like ``Engine.ask``'s: the same
  text for greedy decoding (batched logits equal the single-request ones within float error).

Every registered family batches (LLaVA, SmolVLM with its tiles and several images, Qwen2.5-VL and
Qwen3-VL with multimodal RoPE and DeepStack: see :mod:`edgevlm.runtime.batching`). Every wire
request can run batched: sampling knobs (``temperature``, ``top_p``, ``seed``) and stop
strings are applied per row, streamed text deltas (the HTTP API's ``stream: true``) are handed out as
each row's tokens are decoded, and an operating point with early exit or token pruning has its image
encoded on its own (the adaptive encoder) while its prefill and decode join the batch. Different
resolutions share a batch (the vision encoder batches per input size).

Stats of a batched answer: ``vision_ms`` / ``prefill_ms`` are those of the prefill group the
request was admitted in (shared by the group); ``ttft_ms`` / ``e2e_ms`` run from the moment the
worker started preparing the request, so they include the wait for its prefill group and the other
requests' prefills between its decode steps (which also lengthen ``tpot_ms``); ``batch_size`` (an
extra field) is the most requests it shared a prefill group or decode step with, itself included;
``admit_ms`` (an extra field) runs from the same origin to the start of its prefill group.

Not thread-safe: only the inference worker calls it. It uses the engine's backend directly, so no
other thread may run the same engine meanwhile (in the daemon, only the worker does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgevlm.types import Answer, OperatingPoint, Stats

logger = logging.getLogger(__name__)

BATCHED_ENTRY_POINTS = ("encode_images", "encode_vision_state", "prefill_batch", "decode_batch")


def batch_rows(engine: Any) -> int:
    """KV-cache rows of ``engine``'s backend that support batched decode (1 = no batching)."""
    be = getattr(engine, "backend", None)
    if be is None or not all(hasattr(be, name) for name in BATCHED_ENTRY_POINTS):
        return 1
    return int(getattr(be, "max_batch_size", 1))


@dataclass
class _Item:
    tag: Any
    stats: Stats
    start_s: float  # monotonic time the request's preparation began (its ttft/e2e origin)
    submit_s: float  # monotonic time it was handed to the batcher
    text: Any  # TextAssembler
    decoder: Any  # IncrementalDecoder
    on_delta: Callable[[str], None] | None = None  # streaming consumer of the text deltas


class BatchWorker:
    """Requests of one engine decoded together (see the module doc).

    Args:
        engine: a loaded :class:`edgevlm.runtime.Engine` whose backend has the batched entry points.
        token_budget: padded tokens per prefill group at least
            (:func:`~edgevlm.runtime.batching.plan_prefill_groups`).
        prefill_budget_ms: a group grows past ``token_budget`` while its measured encode + prefill
            time is predicted within this many ms (the stall of the running decodes; see
            :mod:`edgevlm.runtime.batching`); None = ``token_budget`` only.
    Raises:
        ValueError: the engine cannot batch (one cache row, or a backend without batched entry
            points), or a budget is not positive.
    """

    def __init__(self, engine: Any, token_budget: int, prefill_budget_ms: float | None = None) -> None:
        from edgevlm.runtime.batching import ContinuousBatcher

        if batch_rows(engine) < 2:
            raise ValueError("continuous batching needs a torch backend loaded with max_batch_size >= 2")
        self.engine = engine
        self.batcher = ContinuousBatcher(engine.backend, token_budget=token_budget,
                                         prefill_budget_ms=prefill_budget_ms, clock=time.monotonic)
        self._items: dict[int, _Item] = {}  # id(GenerationRequest) -> item

    @property
    def rows(self) -> int:
        return self.engine.backend.max_batch_size

    @property
    def n_active(self) -> int:
        """Requests handed to :meth:`add` and not yet returned by :meth:`step`/:meth:`abort`."""
        return len(self._items)

    @property
    def idle(self) -> bool:
        return not self._items

    def free_slots(self) -> int:
        """How many more requests can be added now without waiting for a cache row."""
        return max(0, self.rows - len(self._items))

    def add(self, tag: Any, image: np.ndarray | list[np.ndarray], prompt: str, *, max_new_tokens: int,
            operating_point: OperatingPoint | None, deadline_s: float | None,
            on_delta: Callable[[str], None] | None = None, temperature: float = 0.0, top_p: float = 1.0,
            stop: list[str] | None = None, seed: int | None = None, prepared: Any = None) -> None:
        """Validate, tokenise and preprocess a request (as ``Engine.ask`` does: ``Engine.prepare``,
        the family's processor; ``image`` one frame or several) and queue it for the next
        admission. ``prepared``: ``engine.prepare``'s result for these arguments (with
        ``uint8_pixels=True``: the batched encoder normalises on the device), made beforehand
        (the daemon's prepare threads, off the inference thread); then nothing is prepared here. ``deadline_s`` (monotonic): still waiting for a row after it, the request comes back from :meth:`step` with answer None. ``tag`` is returned with the answer.
        ``on_delta`` is called with each text delta as the request's tokens are decoded (streaming);
        ``temperature``, ``top_p``, ``stop`` and ``seed`` are ``Engine.ask``'s sampling knobs.

        Raises:
            InvalidImageError: ``image`` is not an ``(H, W, 3)`` uint8 array (or a list of them).
            InvalidRequestError: bad knobs, or the prompt + vision tokens do not fit the KV cache.
        """
        from edgevlm.runtime.batching import GenerationRequest
        from edgevlm.runtime.sampling import TextAssembler
        from edgevlm.runtime.tokenizer import IncrementalDecoder

        eng = self.engine
        start = time.monotonic()
        if prepared is None:
            prepared = eng.prepare(image, prompt, max_new_tokens=max_new_tokens, operating_point=operating_point,
                                   temperature=temperature, top_p=top_p, stop=stop, seed=seed, uint8_pixels=True)
        op, params, vision = prepared.operating_point, prepared.params, prepared.vision
        n_vision, ids = prepared.n_vision, prepared.ids
        stats = Stats(operating_point=op.name, backend=eng.backend_name, vision_tokens=n_vision,
                      prompt_tokens=len(ids) - n_vision, preprocess_ms=prepared.preprocess_ms)
        if vision is not None and vision.input_sizes_px:
            stats.input_height_px, stats.input_width_px = vision.input_sizes_px[0]
        # LLaVA's one image: pixels, batched with the group's other images of its size; any other
        # family (M-RoPE, DeepStack, tiles, several images, video): its VisionInput, encoded alone
        pixels = norm = None
        if eng.family.batched_pixels and vision is not None and vision.kinds == ["image"]:
            pixels, vision = vision.pixel_values, None  # (1, 3, H, W) float32 or (1, H, W, 3) uint8
            norm = (tuple(eng.image_mean), tuple(eng.image_std))
        text, decoder = TextAssembler(params.stop), IncrementalDecoder(eng.tokenizer)

        def on_token(token: int) -> bool:  # detokenise as the single-request path does
            delta = text.add(decoder.push(token))
            if delta and on_delta is not None:
                on_delta(delta)
            return text.stopped

        req = GenerationRequest(ids, pixels, max_new_tokens=params.max_new_tokens, vision=vision,
                                eos_token_ids=eng.eos_token_ids, deadline_s=deadline_s, params=params,
                                operating_point=op, on_token=on_token, pixel_norm=norm)
        self.batcher.submit(req)  # InvalidRequestError: cannot fit the KV cache
        self._items[id(req)] = _Item(tag, stats, start, time.monotonic(), text, decoder, on_delta)

    def warm_up(self, image: np.ndarray, prompt: str, *, max_new_tokens: int = 2,
                operating_point: OperatingPoint | None = None) -> list[int]:
        """Run one prefill group of each rows bucket (1, 2, 4, ... up to :attr:`rows` copies of
        ``prompt`` about ``image``, each decoding up to ``max_new_tokens`` tokens) before the first
        request, so that the CUDA graphs the batched path replays (the vision tower per batch
        bucket, the prefill per rows x length bucket, the decode step per batch) are captured now
        rather than inside the first groups of each size that clients send (a capture stalls every
        running request for 50-100 ms), at ``operating_point`` (its resolution sets the vision graphs'
        geometry; None = the model's default). Each size runs twice: greedy (the decode step that feeds
        itself on the device, :meth:`~edgevlm.runtime.backends.torch_backend.TorchBackend.greedy_step`)
        and sampled (``temperature`` 1: the host-fed decode step). The answers are dropped; the token and time budgets are
        restored and the measured admission cost forgotten (captures are not admissions). Call only
        while idle. Returns the group sizes run.

        Raises:
            Whatever :meth:`add` / :meth:`step` raise (the caller logs it and serves anyway).
        """
        if not self.idle:
            raise RuntimeError("warm_up needs an idle BatchWorker")
        b = self.batcher
        saved = (b.token_budget, b.prefill_budget_ms)
        b.token_budget, b.prefill_budget_ms = 1 << 30, None  # one group of exactly n
        sizes: list[int] = []
        try:
            n = 1
            while True:
                n = min(n, self.rows)
                for temperature in (0.0, 1.0):  # greedy and sampled requests replay different decode graphs
                    for i in range(n):
                        self.add(None, image, prompt, max_new_tokens=max_new_tokens, operating_point=operating_point,
                                 deadline_s=None, temperature=temperature, seed=i)
                    while not self.idle:
                        self.step()
                sizes.append(n)
                if n >= self.rows:
                    return sizes
                n *= 2
        finally:
            if not self.idle:
                self.abort()
            b.token_budget, b.prefill_budget_ms = saved
            b.s_per_token = None

    def step(self) -> list[tuple[Any, Answer | None]]:
        """One batcher iteration (expire, admit one prefill group, one decode step). Returns
        ``(tag, answer)`` for each request that finished in it; answer None = its deadline passed
        while it waited for admission (it never ran)."""
        out = []
        for res in self.batcher.step():
            item = self._items.pop(res.key)
            out.append((item.tag, None if res.finish_reason == "deadline" else self._answer(item, res)))
        return out

    def abort(self) -> list[Any]:
        """Drop everything (after a failed step); returns the tags of the dropped requests."""
        self.batcher.abort()
        tags = [item.tag for item in self._items.values()]
        self._items.clear()
        return tags

    def _answer(self, item: _Item, res: Any) -> Answer:
        ms = 1e3
        prep_s = item.submit_s - item.start_s
        stats = item.stats
        stats.vision_ms, stats.prefill_ms = res.vision_s * ms, res.prefill_s * ms
        stats.ttft_ms = (prep_s + res.ttft_s) * ms
        stats.admit_ms = round((prep_s + res.queue_s) * ms, 3)  # extra field: to its prefill group
        stats.e2e_ms = (prep_s + res.e2e_s) * ms
        stats.new_tokens = len(res.tokens) + (1 if res.eos else 0)
        stats.decode_ms = (res.e2e_s - res.ttft_s) * ms
        stats.tpot_ms = stats.decode_ms / (stats.new_tokens - 1) if stats.new_tokens > 1 else 0.0
        stats.finish_reason = "length" if res.finish_reason == "length" else "stop"
        info = res.vision_info
        if info is not None:
            stats.exit_layer = info.exit_layers[0]
            stats.exit_confidence = info.exit_confidences[0]
            stats.vision_tokens = info.tokens_kept
        stats.batch_size = res.batch_size  # extra field (Stats allows extras)
        tail = item.text.finish()
        if tail and item.on_delta is not None:
            item.on_delta(tail)
        return Answer(text=item.text.final_text, stats=stats)
