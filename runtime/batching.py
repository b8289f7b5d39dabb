"""Dynamic batching: token-budget prefill groups and continuous batching of decode steps.

Several requests share one model and one KV cache with ``max_batch_size`` rows (see
:class:`~edgevlm.runtime.backends.torch_backend.TorchBackend`). :class:`ContinuousBatcher` runs an
iteration-level schedule in the style of Orca (Yu et al., "Orca: A Distributed Serving System for
Transformer-Based Generative Models", OSDI 2022) and vLLM's scheduler:

1. requests whose deadline passed while waiting are answered ``"deadline"`` (never started);
2. **admission**: the most urgent waiting requests (earliest deadline, then arrival), as many as
   there are free cache rows, are cut into prefill groups by :func:`plan_prefill_groups` — sorted by
   total tokens (vision + text) and packed so that ``rows x longest prompt <= token_budget``
   (1024 by default; a longer prompt runs alone) — and the group holding the most urgent request
   is admitted: its images go through the vision encoder (LLaVA pixels: one batch per input size;
   any family's :class:`~edgevlm.runtime.models.base.VisionInput`: one ``encode_vision`` per
   request, keeping its side features such as Qwen3-VL's DeepStack), its prompts are prefilled
   together (right-padded; per-row M-RoPE tables and DeepStack adds) into the lowest free rows, and
   its first tokens chosen;
3. **decode**: one batched decode step for every running request (rows ``0..n-1``, CUDA-graph
   replay on GPU) at per-row cache slots, with per-row RoPE offsets: a multimodal-RoPE request
   (Qwen2.5-VL, Qwen3-VL) decodes slot ``s`` at RoPE position ``s + rope_delta`` of its own prompt;
   finished requests free their rows at once. When every running request is greedy and the
   backend has ``greedy_step`` (the torch backend), each step's tokens and slots are fed to the next
   step on the device and step ``k + 1`` is queued before the host reads step ``k``'s tokens, so the
   host's per-token work (results, stop checks, streamed text, admissions' bookkeeping) overlaps the
   GPU; a request that ends on EOS or a stop string had one step computed past it, discarded.

Why the Qwen prefills can be grouped: M-RoPE only changes the rotation each position gets, and a
right-padded causal prefill never lets a row attend to another row or to its padding, so a group
is exactly the single prefills with each row's own ``(cos, sin)`` tables (the decoder's ``rope``
hook takes ``(B, T, Dh)``) and DeepStack's ``layer_adds`` over a ``(B, T)`` vision mask.

Only one prefill group runs per iteration, so a running request's next token is delayed by at most
one group's vision encode + prefill, and a waiting request is admitted as soon as a row is free and
it is the most urgent. What bounds a group is that stall, a time: with ``prefill_budget_ms`` the
batcher measures each admission (seconds per padded token, an exponential average) and lets a group
grow past ``token_budget`` while its predicted time stays within ``prefill_budget_ms``. A token count
alone cannot serve both ends: 1024 tokens are ~20 ms of a 7B model's prefill on an H100, but only two
prompts of the demo model, whose whole 32-row batch prefills in a few milliseconds (the host's kernel
launches, not the GPU, set its time: one group of 32 costs about what a group of 2 does). The
proportional estimate over-predicts large groups of a launch-bound model (their fixed cost is
counted per token), so a group grows over a few admissions rather than overshooting at once. Sampling is greedy or per-request
(:class:`~edgevlm.runtime.sampling.SamplingParams`); results are token ids (detokenise with the
engine's tokenizer). A request with an adaptive ``operating_point`` (early exit, token pruning) has
its image encoded on its own (``backend.encode_image(..., operating_point=...)``, the exit/pruning
path of :mod:`edgevlm.runtime.exits` / :mod:`edgevlm.runtime.pruning`); its prefill and decode are
batched like any other. ``on_token`` lets the caller end a request early (stop strings).
The daemon's inference worker drives it through :mod:`edgevlm.daemon.batching`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from edgevlm.errors import InvalidRequestError
from edgevlm.runtime.preprocess import normalize_for_encoder, pixel_norm
from edgevlm.runtime.sampling import SamplingParams, make_generator, select_token
from edgevlm.types import OperatingPoint, asks_adaptive_vision

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_BUDGET = 1024
DEFAULT_PREFILL_BUDGET_MS = 30.0
"""The daemon's stall budget of one admission (vision encode + prefill), in ms: a tenth of a cloud
profile's 300 ms default latency budget."""
_COST_EWMA = 0.3  # weight of the newest admission in the seconds-per-token estimate


def plan_prefill_groups(total_tokens: list[int], token_budget: int = DEFAULT_TOKEN_BUDGET,
                        max_group_size: int | None = None) -> list[list[int]]:
    """Group requests for batched prefill.

    Args:
        total_tokens: prompt length (vision + text tokens) of each request.
        token_budget: padded tokens per group, ``len(group) * max(lengths in group)``; a request
            longer than the budget forms a group of its own.
        max_group_size: cap on requests per group (free cache rows), None = no cap.
    Returns:
        groups of request indices, each sorted by total tokens; the groups in increasing length.
    Raises:
        ValueError: a non-positive budget, group size or token count.
    """
    if token_budget < 1 or (max_group_size is not None and max_group_size < 1):
        raise ValueError(f"token_budget and max_group_size must be positive, got {token_budget}, {max_group_size}")
    if any(t < 1 for t in total_tokens):
        raise ValueError(f"every request needs at least one token, got {total_tokens}")
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in sorted(range(len(total_tokens)), key=lambda j: (total_tokens[j], j)):
        t = total_tokens[i]
        full = max_group_size is not None and len(cur) >= max_group_size
        if cur and (full or max(cur_max, t) * (len(cur) + 1) > token_budget):
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, t)
    if cur:
        groups.append(cur)
    return groups


@dataclass
class GenerationRequest:
    """One tokenised request.

    Attributes:
        input_ids: prompt token ids, with one image placeholder per vision token.
        pixel_values: ``(1, 3, H, W)`` float32 normalised image, or ``(1, H, W, 3)`` uint8 resized
            image normalised on the device with ``pixel_norm``, or None (LLaVA's pixel path,
            batched per input size and ``pixel_norm``).
        pixel_norm: ``(mean, std)`` per channel on the 0..1 scale, for uint8 ``pixel_values``.
        vision: the family processor's :class:`~edgevlm.runtime.models.base.VisionInput` (any
            family: several images, tiles, video), encoded alone; used when ``pixel_values`` is
            None. Neither = text only.
        max_new_tokens: generation budget (capped by the KV cache).
        eos_token_ids: tokens that end the generation (not included in the result).
        params: sampling knobs; None = greedy.
        deadline_s: ``clock()`` time after which a request still waiting is answered "deadline".
        request_id: anything, echoed in the result.
        operating_point: encode the image with this point's early exit / token pruning (alone,
            not in the vision batch); None or a point without them = the plain batched encoder.
            ``input_ids`` must then hold as many image placeholders as vision tokens are kept.
        on_token: called with each generated token (EOS excluded) after it is appended; returning
            True ends the request with finish reason "stop" (e.g. a stop string was completed).
    """

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None
    max_new_tokens: int = 64
    vision: Any = None
    eos_token_ids: frozenset[int] = frozenset()
    params: SamplingParams | None = None
    deadline_s: float | None = None
    request_id: Any = None
    operating_point: OperatingPoint | None = None
    on_token: Callable[[int], bool] | None = None
    pixel_norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None


@dataclass
class GenerationResult:
    """What a request produced. ``finish_reason``: "stop" (EOS or ``on_token``), "length" or
    "deadline"; ``eos``: it ended on an EOS token (not in ``tokens``). Times are ``clock()``
    differences in seconds from submission; ``vision_s`` / ``prefill_s`` are those of the prefill
    group it was admitted in (shared by the group). ``batch_size``: the most requests in one
    prefill group or decode step with it (itself included); ``joined``: it was admitted while
    other requests were decoding. ``vision_info``: the backend's
    :class:`~edgevlm.runtime.vision.VisionInfo` of an adaptive encode, else None."""

    request_id: Any
    tokens: list[int]
    finish_reason: str
    queue_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    key: int = field(default=0, repr=False)  # id() of the GenerationRequest
    eos: bool = False
    vision_s: float = 0.0
    prefill_s: float = 0.0
    batch_size: int = 0
    joined: bool = False
    vision_info: Any = None


@dataclass
class _Running:
    req: GenerationRequest
    row: int
    pos: int  # cache slot the next fed token goes to
    budget: int
    submitted_s: float
    admitted_s: float
    first_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    vision_s: float = 0.0
    prefill_s: float = 0.0
    batch_size: int = 1
    joined: bool = False
    vision_info: Any = None
    rope_delta: int = 0  # M-RoPE: RoPE position = slot + rope_delta


class ContinuousBatcher:
    """Iteration-level scheduler over a backend with batched entry points (``encode_images``,
    ``encode_vision_state``, ``position_ids``, ``embed``, ``prefill_batch``, ``decode_batch``,
    ``max_batch_size``, ``max_seq_len``).

    Not thread-safe: one thread calls :meth:`submit`/:meth:`step` (the daemon's inference worker).

    Args:
        backend: the model's backend (see above).
        token_budget: padded tokens per prefill group (:func:`plan_prefill_groups`); with
            ``prefill_budget_ms``, the least a group may hold.
        prefill_budget_ms: stall budget of one admission in ms (see the module doc); None = groups
            of ``token_budget`` tokens only.
        clock: monotonic seconds.
    Raises:
        ValueError: a non-positive ``token_budget`` or ``prefill_budget_ms``.
    """

    def __init__(self, backend, *, token_budget: int = DEFAULT_TOKEN_BUDGET, prefill_budget_ms: float | None = None,
                 image_token_id: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        if prefill_budget_ms is not None and not prefill_budget_ms > 0:
            raise ValueError(f"prefill_budget_ms must be positive, got {prefill_budget_ms}")
        self.backend = backend
        self.token_budget = token_budget
        self.prefill_budget_ms = prefill_budget_ms
        self.s_per_token: float | None = None  # measured admission cost (s per padded token), EWMA
        self.image_token_id = image_token_id
        self.clock = clock
        self._waiting: list[tuple[float, GenerationRequest]] = []  # (submitted_s, request)
        self._rows: list[_Running | None] = [None] * backend.max_batch_size
        self.steps = 0
        self.joins = 0  # requests admitted while others were decoding
        # the greedy step queued on the device whose tokens the host has not read yet, with the run of
        # each of its rows (None: a row it computed nothing for): see _decode_greedy
        self._pending: tuple[Any, list[_Running | None]] | None = None

    @property
    def n_running(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request. Raises InvalidRequestError when it cannot fit the KV cache, has no
        tokens/budget, or has uint8 ``pixel_values`` without a ``pixel_norm`` of three means and
        three positive stds (refused here: at admission it would fail the whole prefill group)."""
        n = len(req.input_ids)
        if n < 1 or n >= self.backend.max_seq_len:
            raise InvalidRequestError(f"prompt of {n} tokens; the KV cache holds {self.backend.max_seq_len} positions")
        if req.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be positive, got {req.max_new_tokens}")
        if req.pixel_values is not None and req.pixel_values.dtype == torch.uint8:
            pixel_norm_key(req.pixel_norm)
        self._waiting.append((self.clock(), req))

    def abort(self) -> list[GenerationRequest]:
        """Drop every waiting and running request (after a failed step) and return them; the
        cache rows are free again."""
        out = [r for _, r in self._waiting] + [run.req for run in self._rows if run is not None]
        self._waiting = []
        self._rows = [None] * len(self._rows)
        self._pending = None
        return out

    def run(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Submit ``requests`` and step until all are done; results in the input order."""
        for r in requests:
            self.submit(r)
        done: dict[int, GenerationResult] = {}
        while self._waiting or self.n_running:
            for res in self.step():
                done[res.key] = res
        return [done[id(r)] for r in requests]

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[GenerationResult]:
        """One scheduling iteration (expire, admit one prefill group, one decode step); returns
        the requests that finished in it."""
        self.steps += 1
        now = self.clock()
        finished = self._expire(now)
        free = [i for i, r in enumerate(self._rows) if r is None]
        if self._waiting and free:
            # an admission waits for the device anyway: read the queued greedy step first, so its tokens
            # (and the requests they end) do not wait for the encode + prefill, nor count in its cost
            finished += self._drain()
            free = [i for i, r in enumerate(self._rows) if r is None]
            finished += self._admit(free)
        if self.n_running:
            finished += self._decode()
        elif self._pending is not None:  # only a step computed past its rows' last tokens: nothing to read
            self._pending = None
        return finished

    def _expire(self, now: float) -> list[GenerationResult]:
        out, keep = [], []
        for sub, req in self._waiting:
            if req.deadline_s is not None and now > req.deadline_s:
                out.append(self._result(req, [], "deadline", sub, now, now, now))
            else:
                keep.append((sub, req))
        self._waiting = keep
        return out

    def group_token_budget(self) -> int:
        """Padded tokens the next prefill group may hold: ``token_budget``, or more while the
        measured cost (:attr:`s_per_token`) predicts the group within ``prefill_budget_ms``."""
        if self.prefill_budget_ms is None or not self.s_per_token:
            return self.token_budget
        return max(self.token_budget, int(self.prefill_budget_ms / 1e3 / self.s_per_token))

    def _observe_cost(self, padded_tokens: int, seconds: float) -> None:
        """Feed one admission's measured vision encode + prefill time into :attr:`s_per_token`."""
        cost = seconds / padded_tokens
        self.s_per_token = cost if self.s_per_token is None else (
            _COST_EWMA * cost + (1.0 - _COST_EWMA) * self.s_per_token)

    def _admit(self, free: list[int]) -> list[GenerationResult]:
        inf = float("inf")
        urgent = sorted(self._waiting, key=lambda sr: (sr[1].deadline_s if sr[1].deadline_s is not None else inf, sr[0]))
        cands = urgent[: len(free)]
        groups = plan_prefill_groups([len(r.input_ids) for _, r in cands], self.group_token_budget())
        group = next(g for g in groups if 0 in g)  # the group of the most urgent request
        chosen = [cands[i] for i in group]
        chosen_ids = {id(r) for _, r in chosen}
        self._waiting = [sr for sr in self._waiting if id(sr[1]) not in chosen_ids]
        be = self.backend
        be.synchronize()  # work still queued (a greedy step past its request's end) is not this admission's
        now = self.clock()
        joined = self.n_running > 0
        rows = free[: len(chosen)]
        reqs = [r for _, r in chosen]
        feat_of, info_of, state_of = self._encode(reqs)
        be.synchronize()
        t_vision = self.clock()
        if all(r.pixel_values is not None and not asks_adaptive_vision(r.operating_point) for r in reqs) and hasattr(
                be, "prefill_images_batch"):  # LLaVA's plain images: one embed, one prefill, no per-row work
            logits = be.prefill_images_batch([r.input_ids for r in reqs], [feat_of[i] for i in range(len(reqs))],
                                             rows, spare_rows=free[len(reqs):])  # (n, V)
            deltas = [0] * len(reqs)
        else:
            logits, deltas = self._prefill_rows(reqs, rows, feat_of, info_of, state_of, spare_rows=free[len(reqs):])
        be.synchronize()
        t_prefill = self.clock()
        self._observe_cost(len(reqs) * max(len(r.input_ids) for r in reqs), t_prefill - now)
        for i, ((sub, r), row) in enumerate(zip(chosen, rows, strict=True)):
            n = len(r.input_ids)
            run = _Running(req=r, row=row, pos=n, rope_delta=deltas[i],
                           budget=min(r.max_new_tokens, be.max_seq_len - n + 1),
                           submitted_s=sub, admitted_s=now, vision_s=t_vision - now, prefill_s=t_prefill - t_vision,
                           batch_size=self.n_running + 1, joined=joined, vision_info=info_of.get(i))
            if r.params is not None and not r.params.greedy:
                run.generator = make_generator(r.params.seed, logits.device)
            self._rows[row] = run
        if joined:
            self.joins += len(chosen)
        return self._consume(logits, [self._rows[row] for row in rows], first=True)

    def _prefill_rows(self, reqs: list[GenerationRequest], rows: list[int], feat_of: dict[int, torch.Tensor],
                      info_of: dict[int, Any], state_of: dict[int, Any], spare_rows: list[int] | None = None
                      ) -> tuple[torch.Tensor, list[int]]:
        """Prefill a group embedded row by row (any family: M-RoPE positions, DeepStack states, pruned
        tokens; a CUDA-graph replay on the torch backend, whose padding rows may fill ``spare_rows``,
        free cache rows). Returns the last logits ``(n, V)`` and each row's RoPE offset."""
        be = self.backend
        embeds, ids_of, positions, deltas = [], [], [], []
        for i, r in enumerate(reqs):
            ids = torch.tensor([r.input_ids], dtype=torch.long, device=be.device)  # (1, T)
            info = info_of.get(i)
            kept = info.kept_index[0] if info is not None and info.kept_index is not None else None
            pos_ids, delta = be.position_ids(ids, r.vision, kept_index=kept) if r.vision is not None else (None, 0)
            embeds.append(be.embed(ids, feat_of.get(i)))
            ids_of.append(ids)
            positions.append(pos_ids)  # M-RoPE (3, 1, T) or None
            deltas.append(delta)
        extra = {}
        if any(p is not None for p in positions):
            extra["position_ids"] = positions
        if state_of:
            extra.update(input_ids=ids_of, vision_states=[state_of.get(i) for i in range(len(reqs))])
        if spare_rows:
            extra["spare_rows"] = spare_rows
        return be.prefill_batch(embeds, rows, **extra), deltas  # (n, V)

    def _encode(self, reqs: list[GenerationRequest]
                ) -> tuple[dict[int, torch.Tensor], dict[int, Any], dict[int, Any]]:
        """Vision features of a prefill group, by index: plain pixel images in one encoder batch per
        input size, adaptive operating points one by one (with their VisionInfo), a family's
        ``vision`` one by one (with the model's side state, e.g. DeepStack, by index when any)."""
        be = self.backend
        by_norm: dict[Any, list[int]] = {}  # plain images, by their uint8 normalisation (None: float32)
        for i, r in enumerate(reqs):
            if r.pixel_values is not None and not asks_adaptive_vision(r.operating_point):
                key = pixel_norm_key(r.pixel_norm) if r.pixel_values.dtype == torch.uint8 else None
                by_norm.setdefault(key, []).append(i)
        feat_of: dict[int, torch.Tensor] = {}
        for norm, idx in by_norm.items():
            kw = {} if norm is None else {"normalize": norm}
            feat_of.update(zip(idx, be.encode_images([reqs[i].pixel_values for i in idx], **kw), strict=True))
        info_of: dict[int, Any] = {}
        state_of: dict[int, Any] = {}
        for i, r in enumerate(reqs):
            if r.pixel_values is not None or r.vision is None or not r.vision.kinds:
                continue
            if asks_adaptive_vision(r.operating_point):  # LLaVA's early exit / pruning of its one image
                op = r.operating_point
                prompt = torch.tensor([r.input_ids], dtype=torch.long) if op.exit_threshold is not None else None
                feat_of[i] = be.encode_vision(r.vision, operating_point=op, prompt_ids=prompt)
                info_of[i] = getattr(be, "last_vision_info", None)
                self._take_state(state_of, i)
                continue
            feat_of[i], state = be.encode_vision_state(r.vision)  # (N, D_text), side state
            if state is not None:
                state_of[i] = state
        for i, r in enumerate(reqs):
            if r.pixel_values is None or not asks_adaptive_vision(r.operating_point):
                continue
            op = r.operating_point
            # question-conditioned exit confidence heads read the prompt (as Engine does)
            prompt = torch.tensor([r.input_ids], dtype=torch.long) if op.exit_threshold is not None else None
            feat_of[i] = be.encode_image(_float_pixels(r), operating_point=op, prompt_ids=prompt)  # (1, N', D)
            info_of[i] = getattr(be, "last_vision_info", None)
            self._take_state(state_of, i)  # pruned tokens keep their unpruned RoPE positions
        return feat_of, info_of, state_of

    def _take_state(self, state_of: dict[int, Any], i: int) -> None:
        take = getattr(self.backend, "take_vision_state", None)
        state = take() if take is not None else None
        if state is not None:
            state_of[i] = state

    def _decode(self) -> list[GenerationResult]:
        """One decode step of every running request. All greedy (the usual case) and a backend with
        ``greedy_step``: :meth:`_decode_greedy`. Otherwise the logits come to the host and each row
        picks its token (per-request sampling), after any queued greedy step was read."""
        if hasattr(self.backend, "greedy_step") and all(
                run is None or run.req.params is None or run.req.params.greedy for run in self._rows):
            return self._decode_greedy()
        finished = self._drain()
        if not self.n_running:
            return finished
        n = max(i for i, r in enumerate(self._rows) if r is not None) + 1
        tokens, positions, offsets = [0] * n, [0] * n, [0] * n
        for i in range(n):
            run = self._rows[i]
            if run is not None:
                tokens[i], positions[i], offsets[i] = run.tokens[-1], run.pos, run.rope_delta
        if any(offsets):
            logits = self.backend.decode_batch(tokens, positions, offsets)  # (n, V)
        else:
            logits = self.backend.decode_batch(tokens, positions)
        running = [self._rows[i] for i in range(n)]
        self._advance([run for run in running if run is not None])
        return finished + self._consume(logits, running, first=False)

    def _decode_greedy(self) -> list[GenerationResult]:
        """Queue the next greedy step, then read the previous one (``backend.greedy_step``): each
        row's next input stays on the device (the step writes its argmax and slot + 1), so the GPU
        runs step ``k + 1`` while the host turns step ``k``'s tokens into results, stop checks and
        streamed text. A row whose last token (its budget) is in flight gets no further step; a
        row that ends on EOS or a stop string had one step computed past it, which is discarded
        (its KV write lands past the request's last slot, in a row that is free from then on)."""
        pending = self._pending
        prev = pending[1] if pending is not None else []
        n = max(i for i, r in enumerate(self._rows) if r is not None) + 1
        new_inputs: dict[int, tuple[int, int, int] | None] = {}
        launch: list[_Running | None] = [None] * n
        for i in range(n):
            run = self._rows[i]
            in_flight = i < len(prev) and prev[i] is run and run is not None
            if run is None or len(run.tokens) + in_flight >= run.budget:
                new_inputs[i] = None  # no request from now on (the backend keeps the row parked)
                continue
            if not in_flight:  # admitted since (its first token came from the prefill), or after a sampled step
                new_inputs[i] = (run.tokens[-1], run.pos, run.rope_delta)
            launch[i] = run
        self._pending = None
        if any(run is not None for run in launch):
            self._pending = (self.backend.greedy_step(n, new_inputs), launch)
            self._advance([run for run in launch if run is not None])
        return self._read(pending) if pending is not None else []

    def _drain(self) -> list[GenerationResult]:
        """Read the queued greedy step, if any (before a step whose inputs the host writes)."""
        pending, self._pending = self._pending, None
        return self._read(pending) if pending is not None else []

    def _read(self, pending: tuple[Any, list[_Running | None]]) -> list[GenerationResult]:
        """The tokens of a queued greedy step, taken by the rows' runs that are still running."""
        tokens = pending[0].tokens()  # waits for that step only
        now = self.clock()
        out = []
        for i, run in enumerate(pending[1]):
            if run is not None and self._rows[i] is run:
                res = self._take(run, tokens[i], now, first=False)
                if res is not None:
                    out.append(res)
        return out

    def _advance(self, runs: list[_Running]) -> None:
        """The runs a decode step was queued for: their next slot, and the batch they shared."""
        n_running = self.n_running
        for run in runs:
            run.pos += 1
            run.batch_size = max(run.batch_size, n_running)

    def _consume(self, logits: torch.Tensor, runs: list[_Running | None], first: bool) -> list[GenerationResult]:
        greedy = logits.argmax(dim=-1).tolist()  # one host sync for the whole batch
        now = self.clock()
        out = []
        for i, run in enumerate(runs):
            if run is None:
                continue
            p = run.req.params
            token = greedy[i] if p is None or p.greedy else select_token(logits[i], p, run.generator)
            res = self._take(run, token, now, first)
            if res is not None:
                out.append(res)
        return out

    def _take(self, run: _Running, token: int, now: float, first: bool) -> GenerationResult | None:
        """Row ``run`` chose ``token``: its result if that ends it (EOS, ``on_token`` asks to stop,
        the budget), else None."""
        if first:
            run.first_s = now
        if token in run.req.eos_token_ids:
            return self._finish(run, "stop", now, eos=True)
        run.tokens.append(token)
        if run.req.on_token is not None and run.req.on_token(token):
            return self._finish(run, "stop", now)
        if len(run.tokens) >= run.budget:
            return self._finish(run, "length", now)
        return None

    def _finish(self, run: _Running, reason: str, now: float, eos: bool = False) -> GenerationResult:
        self._rows[run.row] = None
        res = self._result(run.req, run.tokens, reason, run.submitted_s, run.admitted_s, run.first_s, now)
        res.eos, res.vision_s, res.prefill_s = eos, run.vision_s, run.prefill_s
        res.batch_size, res.joined, res.vision_info = run.batch_size, run.joined, run.vision_info
        return res

    @staticmethod
    def _result(req, tokens, reason, sub, admitted, first, end) -> GenerationResult:
        return GenerationResult(request_id=req.request_id, tokens=list(tokens), finish_reason=reason,
                                queue_s=admitted - sub, ttft_s=first - sub, e2e_s=end - sub, key=id(req))


def pixel_norm_key(value: Any) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """:attr:`GenerationRequest.pixel_norm` as :func:`~edgevlm.runtime.preprocess.pixel_norm` reads it
    (hashable: requests group by its value). Raises InvalidRequestError for None, another shape, or a
    std that is not positive."""
    try:
        return pixel_norm(value)
    except ValueError as exc:
        raise InvalidRequestError(f"uint8 pixel_values need pixel_norm: {exc}") from None


def _float_pixels(r: GenerationRequest) -> torch.Tensor:
    """``r.pixel_values`` as the ``(1, 3, H, W)`` float32 normalised image: as given, or uint8 ``(1, H, W, 3)``
    normalised with ``r.pixel_norm`` by :func:`~edgevlm.runtime.preprocess.normalize_for_encoder` (the host
    path's numbers). For the per-request (adaptive) vision path, whose encoder takes float pixels only."""
    px = r.pixel_values
    if px.dtype != torch.uint8:
        return px
    mean, std = pixel_norm_key(r.pixel_norm)
    return torch.from_numpy(normalize_for_encoder(px[0].cpu().numpy(), mean, std))[None]  # (1, 3, H, W)


