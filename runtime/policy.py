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

Hysteresis. The controller keeps a *ceiling*: the most accurate point it currently allows. A
request that does not fit at the ceiling steps the ceiling down at once; the ceiling steps back up
one point only after ``step_up_after`` consecutive requests for which the point above would have
fitted with an extra ``step_up_margin`` of headroom. A request whose budget even the cheapest
point cannot meet is refused at once (:class:`DeadlineExceededError` carrying the cheapest
prediction), not answered late.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from edgevlm.errors import DeadlineExceededError
from edgevlm.types import OperatingPoint, Stats

logger = logging.getLogger(__name__)


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
    ) -> None:
        if not frontier:
            raise ValueError("the frontier needs at least one operating point")
        names = [p.name for p in frontier]
        if len(set(names)) != len(names):
            raise ValueError(f"operating point names must be unique, got {names}")
        if not (0 < alpha <= 1 and 0 < headroom <= 1 and 0 < step_up_margin <= 1 and step_up_after >= 1):
            raise ValueError("alpha, headroom, step_up_margin must be in (0, 1]; step_up_after >= 1")
        self.points = sorted(frontier, key=lambda p: (-p.accuracy, p.vision_ms + p.prefill_ms))
        self.alpha, self.headroom = alpha, headroom
        self.step_up_after, self.step_up_margin = step_up_after, step_up_margin
        self._live = {p.name: _Live(p.vision_ms, p.prefill_ms, p.tpot_ms) for p in self.points}
        self._by_name = {p.name: p for p in self.points}
        self._slowdown = 1.0
        self._ceiling = 0  # index into self.points
        self._room_streak = 0
        self._lock = threading.Lock()

    # -- prediction ---------------------------------------------------------------------------
    @property
    def slowdown(self) -> float:
        return self._slowdown

    @property
    def ceiling(self) -> OperatingPoint:
        return self.points[self._ceiling].point

    def _service_ms(self, name: str, new_tokens: int) -> float:
        live = self._live[name]
        return self._slowdown * (live.vision_ms + live.prefill_ms + max(0, new_tokens - 1) * live.tpot_ms)

    def predict_ms(self, name: str, new_tokens: int, queue_wait_ms: float = 0.0) -> float:
        """Predicted e2e latency (ms) of ``name`` for ``new_tokens`` output tokens, queue included."""
        with self._lock:
            return self._service_ms(name, new_tokens) + max(0.0, queue_wait_ms)

    # -- choice -------------------------------------------------------------------------------
    def choose(self, budget_ms: float, *, max_new_tokens: int, queue_wait_ms: float = 0.0) -> Decision:
        """Pick the most accurate point at or below the ceiling predicted to finish in budget.

        ``max_new_tokens`` is the request's cap (each point may cap lower). Raises
        :class:`DeadlineExceededError` (details: ``cheapest_predicted_ms``) when no point fits.
        """
        with self._lock:
            preds = []
            for p in self.points:
                n = min(max_new_tokens, p.point.max_new_tokens or max_new_tokens)
                preds.append(self._service_ms(p.name, n) + max(0.0, queue_wait_ms))
            limit = budget_ms * self.headroom
            fits = [i for i, ms in enumerate(preds) if ms <= limit]
            alternatives = {p.name: round(ms, 2) for p, ms in zip(self.points, preds, strict=True)}
            if not fits:
                cheapest = min(preds)
                self._room_streak = 0
                raise DeadlineExceededError(
                    f"budget {budget_ms:.0f} ms cannot be met: the cheapest operating point is "
                    f"predicted to take {cheapest:.0f} ms",
                    details={"cheapest_predicted_ms": round(cheapest, 2), "budget_ms": budget_ms},
                )
            if self._ceiling > 0 and preds[self._ceiling - 1] <= limit * self.step_up_margin:
                self._room_streak += 1  # the point above would have fitted, with margin
                if self._room_streak >= self.step_up_after:
                    self._ceiling -= 1
                    self._room_streak = 0
                    logger.info("controller: ceiling up to %s", self.points[self._ceiling].name)
            else:
                self._room_streak = 0
            chosen = next((i for i in fits if i >= self._ceiling), fits[-1])
            if chosen > self._ceiling:  # overload: step the ceiling down at once
                logger.info("controller: ceiling %s -> %s", self.points[self._ceiling].name, self.points[chosen].name)
                self._ceiling, self._room_streak = chosen, 0
            return Decision(
                point=self.points[chosen].point,
                predicted_ms=preds[chosen],
                budget_ms=budget_ms,
                ceiling=self.points[self._ceiling].name,
                slowdown=self._slowdown,
                alternatives=alternatives,
            )

    # -- learning -----------------------------------------------------------------------------
    def observe(self, name: str, stats: Stats) -> None:
        """Feed back what the engine measured for a request run at point ``name``.

        Unknown names are ignored (logged). Stages reported as 0 ms (not run) leave their EWMA as is.
        """
        with self._lock:
            live = self._live.get(name)
            if live is None:
                logger.warning("controller: observation for unknown operating point %r ignored", name)
                return
            n = max(1, stats.new_tokens)
            predicted = self._service_ms(name, n)
            observed = stats.vision_ms + stats.prefill_ms + max(0, n - 1) * stats.tpot_ms
            if predicted > 0 and observed > 0:
                ratio = observed / predicted
                self._slowdown *= (1 - self.alpha) + self.alpha * ratio
                self._slowdown = min(max(self._slowdown, 0.05), 50.0)
            # per-point figures, normalised by the device-wide slowdown, move 4x slower than the
            # slowdown itself so that a change seen everywhere lands in the shared factor
            a, s = self.alpha / 4, self._slowdown
            if stats.vision_ms > 0:
                live.vision_ms += a * (stats.vision_ms / s - live.vision_ms)
            if stats.prefill_ms > 0:
                live.prefill_ms += a * (stats.prefill_ms / s - live.prefill_ms)
            if stats.tpot_ms > 0:
                live.tpot_ms += a * (stats.tpot_ms / s - live.tpot_ms)
            live.samples += 1
