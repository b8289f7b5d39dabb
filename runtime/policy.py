"""Latency controller: pick, per request, the most accurate operating point that fits its budget.

Pure Python (no torch): the daemon's scheduler calls it on every request, and unit tests run it in
microseconds.

Model. Each operating point ``p`` has an offline profile (accuracy, ``vision_ms``, ``prefill_ms``,
``tpot_ms`` measured when the bundle was built). At run time each stage's latency is tracked per
point with an exponentially weighted moving average (EWMA) of what the engine reports in
:class:`edgevlm.types.Stats`, so the offline figures are only the starting point. A device-wide
``slowdown`` factor (EWMA of observed ÷ predicted e2e, any point) lets a slowdown seen on one point
(thermal throttling, a co-located process) move the predictions of all points at once:

    predicted_ms(p) = slowdown × (vision_ms(p) + prefill_ms(p) + n_tokens × tpot_ms(p)) + queue_wait_ms

A per-point EWMA is corrected for the slowdown it was measured under and moves 4× slower than the
slowdown, so a change the whole device sees lands in the shared factor and a point whose offline
figure was wrong is corrected on its own.

Robustness on a noisy device (a shared CPU, a robot whose other processes take cores):

- **outliers are clipped**: one observation moves the model by at most ``MAX_STEP`` (3×) in either
  direction (a torch first-call warm-up of 2 s against a 100 ms prediction raises the slowdown
  1.6×, not 8×), so a single outlier cannot make every point look too slow;
- **the tail is planned for**: the controller keeps the last ``window`` ratios observed ÷ predicted
  and plans with ``tail = quantile_q(ratios) / median(ratios)`` (clipped to [1, ``MAX_TAIL``]):
  on a quiet device ``tail`` is ~1, on a noisy one the choice leaves the room the noise needs
  (``predicted_ms`` in a :class:`Decision` is the mean prediction times ``tail``);
- **evidence ages while refusing**: refused requests produce no measurement, so a slowdown
  learned during a transient (a warm-up, a co-located job) could otherwise refuse every later
  request forever; from the first refusal after the last observation, the excess slowdown
  ``slowdown - 1`` decays with half-life ``stale_half_life_s`` until a request is admitted and
  measured again.

Hysteresis. The controller keeps a *ceiling*: the most accurate point it currently allows. A
request that does not fit at the ceiling steps the ceiling down at once; the ceiling steps back up
one point only after ``step_up_after`` consecutive requests for which the point above would have
fitted with an extra ``step_up_margin`` of headroom. The ceiling belongs to the budget that set it:
a request whose budget is more than ``LOOSER_BUDGET`` (1.25×) that one is chosen from the top (its
prediction still counts the queue wait and slowdown) and leaves the ceiling alone, so one tight-budget
request does not lower the accuracy of the loose-budget requests after it. A request whose budget even the cheapest
point cannot meet is refused at once (:class:`DeadlineExceededError` carrying the cheapest
prediction), not answered late.

Token caps. A point's ``max_new_tokens`` cap is a latency knob (it bounds the worst case), never an
accuracy one: a cap may only cut an answer the budget cannot afford. The chosen point's cap is
raised to the most tokens the budget affords at that point (the largest ``n`` whose prediction
fits the budget with the headroom), or removed when that reaches ``MAX_NEW_TOKENS_LIMIT``; the
engine still stops at the request's own ``max_new_tokens``. The point keeps its name (its latency
model is the same). :meth:`Controller.lift_cap` applies the rule to a point chosen earlier (the
daemon's refit at dequeue, with the budget left).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from edgevlm.errors import DeadlineExceededError
from edgevlm.protocol import MAX_NEW_TOKENS_LIMIT
from edgevlm.types import OperatingPoint, Stats

logger = logging.getLogger(__name__)

MAX_STEP = 3.0
LOOSER_BUDGET = 1.25  # a budget this much above the ceiling's own is not held to the ceiling
"""Largest factor by which one observation may differ from its prediction (outliers are clipped)."""
MAX_TAIL = 2.0
"""Largest tail factor the controller plans with."""


@dataclass(frozen=True)
class PointProfile:
    """An operating point with its offline measurements (ms) and accuracy (0..1)."""

    point: OperatingPoint
    accuracy: float
    vision_ms: float
    prefill_ms: float
    tpot_ms: float

    @property
    def name(self) -> str:
        return self.point.name


@dataclass
class _Live:
    vision_ms: float
    prefill_ms: float
    tpot_ms: float
    samples: int = 0


@dataclass(frozen=True)
class Decision:
    """The controller's choice for one request."""

    point: OperatingPoint
    predicted_ms: float
    budget_ms: float
    ceiling: str
    slowdown: float
    alternatives: dict[str, float] = field(default_factory=dict)


class Controller:
    """Chooses operating points under per-request latency budgets (thread-safe).

    Args:
        frontier: the Pareto frontier (any order; sorted here by accuracy, best first).
            Names must be unique.
        alpha: EWMA weight of a new measurement (0 < alpha <= 1).
        headroom: fraction of the budget a prediction may use (guards against prediction error).
        step_up_after: consecutive requests that must show room before the ceiling rises one point.
        step_up_margin: extra headroom the point above must show to count towards a step up.
        tail_quantile: quantile of observed ÷ predicted that the choice plans for (see the module doc).
        window: how many recent observations the tail factor is computed from.
        stale_half_life_s: half-life (s) of the excess slowdown while requests are refused.
        clock: monotonic clock in seconds (tests inject one).

    Raises:
        ValueError: an empty frontier, duplicate names, or parameters out of range.
    """

    def __init__(
        self,
        frontier: list[PointProfile],
        *,
        alpha: float = 0.3,
        headroom: float = 0.9,
        step_up_after: int = 3,
        step_up_margin: float = 0.8,
        tail_quantile: float = 0.95,
        window: int = 64,
        stale_half_life_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not frontier:
            raise ValueError("the frontier needs at least one operating point")
        names = [p.name for p in frontier]
        if len(set(names)) != len(names):
            raise ValueError(f"operating point names must be unique, got {names}")
        if not (0 < alpha <= 1 and 0 < headroom <= 1 and 0 < step_up_margin <= 1 and step_up_after >= 1):
            raise ValueError("alpha, headroom, step_up_margin must be in (0, 1]; step_up_after >= 1")
        if not (0.5 <= tail_quantile <= 1 and window >= 1 and stale_half_life_s > 0):
            raise ValueError("tail_quantile must be in [0.5, 1], window >= 1, stale_half_life_s > 0")
        self.points = sorted(frontier, key=lambda p: (-p.accuracy, p.vision_ms + p.prefill_ms))
        self.alpha, self.headroom = alpha, headroom
        self.step_up_after, self.step_up_margin = step_up_after, step_up_margin
        self._live = {p.name: _Live(p.vision_ms, p.prefill_ms, p.tpot_ms) for p in self.points}
        self._by_name = {p.name: p for p in self.points}
        self._slowdown = 1.0
        self._ceiling = 0  # index into self.points
        self._ceiling_budget_ms: float | None = None  # the budget of the request that set the ceiling
        self._room_streak = 0
        self.tail_quantile, self.stale_half_life_s = tail_quantile, stale_half_life_s
        self._ratios: collections.deque[float] = collections.deque(maxlen=window)
        self._refusing_since: float | None = None  # first refusal after the last observation
        self._clock = clock
        self._lock = threading.Lock()

    # -- prediction ---------------------------------------------------------------------------
    @property
    def slowdown(self) -> float:
        """The device-wide slowdown factor now (aged while requests are being refused)."""
        with self._lock:
            return self._current_slowdown()

    @property
    def tail(self) -> float:
        """The tail factor the choice plans with (1 = no noise seen; see the module doc)."""
        with self._lock:
            return self._tail()

    def _current_slowdown(self) -> float:
        s = self._slowdown
        if self._refusing_since is None or s <= 1.0:
            return s
        age_s = max(0.0, self._clock() - self._refusing_since)
        return 1.0 + (s - 1.0) * 0.5 ** (age_s / self.stale_half_life_s)

    def _tail(self) -> float:
        if len(self._ratios) < 4:
            return 1.0
        r = sorted(self._ratios)
        q = r[min(len(r) - 1, int(self.tail_quantile * len(r)))]
        median = r[len(r) // 2]
        return min(max(q / median, 1.0), MAX_TAIL)

    @property
    def ceiling(self) -> OperatingPoint:
        return self.points[self._ceiling].point

    def _service_ms(self, name: str, new_tokens: int) -> float:
        live = self._live[name]
        return self._current_slowdown() * (live.vision_ms + live.prefill_ms + max(0, new_tokens - 1) * live.tpot_ms)

    def predict_ms(self, name: str, new_tokens: int, queue_wait_ms: float = 0.0, *, tail: bool = False) -> float:
        """Predicted e2e latency (ms) of ``name`` for ``new_tokens`` output tokens, queue included:
        the mean prediction, or with ``tail`` the one the choice plans with (times :attr:`tail`)."""
        with self._lock:
            ms = self._service_ms(name, new_tokens) * (self._tail() if tail else 1.0)
            return ms + max(0.0, queue_wait_ms)

    # -- choice -------------------------------------------------------------------------------
    def choose(self, budget_ms: float, *, max_new_tokens: int, queue_wait_ms: float = 0.0,
               only: Collection[str] | None = None) -> Decision:
        """Pick the most accurate point at or below the ceiling predicted to finish in budget.

        ``max_new_tokens`` is the request's cap (each point may cap lower). ``only``: the names of the
        points this request can run (None = all; a video cannot be pruned): the others are passed over,
        and a ceiling on one of them is not stepped down for it (the ceiling moves on what fits the
        budget, as for any request). Raises :class:`DeadlineExceededError` (details:
        ``cheapest_predicted_ms``, of the points in ``only``) when none of those fits, and ValueError
        when ``only`` names none of the points.
        """
        allowed = [only is None or p.name in only for p in self.points]
        if not any(allowed):
            raise ValueError(f"only: names none of the operating points {[p.name for p in self.points]}")
        with self._lock:
            preds = []
            tail = self._tail()
            for p in self.points:
                n = min(max_new_tokens, p.point.max_new_tokens or max_new_tokens)
                preds.append(self._service_ms(p.name, n) * tail + max(0.0, queue_wait_ms))
            limit = budget_ms * self.headroom
            fits = [i for i, ms in enumerate(preds) if ms <= limit]
            runs = [i for i in fits if allowed[i]]  # what fits and this request can run
            alternatives = {p.name: round(ms, 2) for p, ms, ok in zip(self.points, preds, allowed, strict=True) if ok}
            if not runs:
                cheapest = min(ms for ms, ok in zip(preds, allowed, strict=True) if ok)
                self._room_streak = 0
                if self._refusing_since is None:
                    self._refusing_since = self._clock()
                raise DeadlineExceededError(
                    f"budget {budget_ms:.0f} ms cannot be met: the cheapest operating point is "
                    f"predicted to take {cheapest:.0f} ms",
                    details={"cheapest_predicted_ms": round(cheapest, 2), "budget_ms": budget_ms},
                )
            if self._ceiling > 0 and self._ceiling_budget_ms is not None \
                    and budget_ms > self._ceiling_budget_ms * LOOSER_BUDGET:
                point, predicted_ms = self._lifted(runs[0], preds, limit, queue_wait_ms, max_new_tokens, tail)
                return Decision(point=point, predicted_ms=predicted_ms, budget_ms=budget_ms,
                                ceiling=self.points[self._ceiling].name, slowdown=self._current_slowdown(),
                                alternatives=alternatives)
            if self._ceiling > 0 and preds[self._ceiling - 1] <= limit * self.step_up_margin:
                self._room_streak += 1  # the point above would have fitted, with margin
                if self._room_streak >= self.step_up_after:
                    self._ceiling -= 1
                    self._room_streak = 0
                    if self._ceiling == 0:
                        self._ceiling_budget_ms = None
                    logger.info("controller: ceiling up to %s", self.points[self._ceiling].name)
            else:
                self._room_streak = 0
            lowered = next((i for i in fits if i >= self._ceiling), fits[-1])  # all points: budget evidence
            if lowered > self._ceiling:  # overload: step the ceiling down at once
                logger.info("controller: ceiling %s -> %s", self.points[self._ceiling].name, self.points[lowered].name)
                self._ceiling, self._room_streak = lowered, 0
                self._ceiling_budget_ms = budget_ms
            chosen = next((i for i in runs if i >= self._ceiling), runs[-1])
            point, predicted_ms = self._lifted(chosen, preds, limit, queue_wait_ms, max_new_tokens, tail)
            return Decision(
                point=point,
                predicted_ms=predicted_ms,
                budget_ms=budget_ms,
                ceiling=self.points[self._ceiling].name,
                slowdown=self._current_slowdown(),
                alternatives=alternatives,
            )

    def lift_cap(self, point: OperatingPoint, budget_ms: float, *, queue_wait_ms: float = 0.0) -> OperatingPoint:
        """``point`` with its ``max_new_tokens`` cap raised to the most tokens ``budget_ms`` (ms,
        queue wait included) affords at that point, or removed (None) when that reaches
        ``MAX_NEW_TOKENS_LIMIT`` (see "Token caps" in the module doc). A point without a cap, or
        unknown to this controller, is returned as is; a cap is never lowered."""
        with self._lock:
            return self._lift_cap_locked(point, budget_ms * self.headroom, queue_wait_ms)

    def _lifted(self, i: int, preds: list[float], limit_ms: float, queue_wait_ms: float, max_new_tokens: int,
                tail: float) -> tuple[OperatingPoint, float]:
        """Point ``i`` with its cap lifted, and its prediction for the tokens it may now generate."""
        point = self._lift_cap_locked(self.points[i].point, limit_ms, queue_wait_ms)
        if point is self.points[i].point:
            return point, preds[i]
        n = min(max_new_tokens, point.max_new_tokens or max_new_tokens)
        return point, self._service_ms(point.name, n) * tail + max(0.0, queue_wait_ms)

    def _lift_cap_locked(self, point: OperatingPoint, limit_ms: float, queue_wait_ms: float) -> OperatingPoint:
        live = self._live.get(point.name)
        if point.max_new_tokens is None or live is None:
            return point
        per_token_ms = self._current_slowdown() * self._tail() * live.tpot_ms
        fixed_ms = self._current_slowdown() * self._tail() * (live.vision_ms + live.prefill_ms)
        room_ms = limit_ms - max(0.0, queue_wait_ms) - fixed_ms
        if per_token_ms <= 0:
            return point.model_copy(update={"max_new_tokens": None}) if room_ms >= 0 else point
        affordable = 1 + math.floor(room_ms / per_token_ms) if room_ms >= 0 else 0
        if affordable <= point.max_new_tokens:
            return point
        cap = None if affordable >= MAX_NEW_TOKENS_LIMIT else affordable
        return point.model_copy(update={"max_new_tokens": cap})

    # -- learning -----------------------------------------------------------------------------
    def observe(self, name: str, stats: Stats) -> None:
        """Feed back what the engine measured for a request run at point ``name``.

        Unknown names are ignored (logged). Stages reported as 0 ms (not run) leave their EWMA as is, and
        so does the vision stage of a vision-cache hit (``stats.vision_cached``).
        Each measurement counts as at most ``MAX_STEP`` times (or 1/``MAX_STEP`` of) its prediction.
        """
        with self._lock:
            live = self._live.get(name)
            if live is None:
                logger.warning("controller: observation for unknown operating point %r ignored", name)
                return
            self._slowdown = self._current_slowdown()  # the aged value is the new starting point
            self._refusing_since = None
            n = max(1, stats.new_tokens)
            predicted = self._service_ms(name, n)
            # a vision-cache hit ran no encoder: its ~0 ms says nothing of the encoder's speed, so the
            # prediction stands in for it (the next frame's first question pays the encoder again)
            vision_ms = live.vision_ms * self._slowdown if stats.vision_cached else stats.vision_ms
            observed = vision_ms + stats.prefill_ms + max(0, n - 1) * stats.tpot_ms
            if predicted > 0 and observed > 0:
                ratio = min(max(observed / predicted, 1 / MAX_STEP), MAX_STEP)
                self._ratios.append(ratio)
                self._slowdown *= (1 - self.alpha) + self.alpha * ratio
                self._slowdown = min(max(self._slowdown, 0.05), 50.0)
            # per-point figures, normalised by the device-wide slowdown, move 4x slower than the
            # slowdown itself so that a change seen everywhere lands in the shared factor
            a, s = self.alpha / 4, self._slowdown
            live.vision_ms = _ewma(live.vision_ms, 0.0 if stats.vision_cached else stats.vision_ms / s, a)
            live.prefill_ms = _ewma(live.prefill_ms, stats.prefill_ms / s, a)
            live.tpot_ms = _ewma(live.tpot_ms, stats.tpot_ms / s, a)
            live.samples += 1


def _ewma(current: float, measured: float, alpha: float) -> float:
    """One EWMA step towards ``measured`` clipped to [current / MAX_STEP, current * MAX_STEP];
    a measurement of 0 (stage not run) leaves ``current`` as is."""
    if measured <= 0:
        return current
    if current > 0:
        measured = min(max(measured, current / MAX_STEP), current * MAX_STEP)
    return current + alpha * (measured - current)
