"""The daemon side of the latency controller: budgets, queue-wait prediction and slowdown hints.

:class:`BudgetController` wraps :class:`edgevlm.runtime.policy.Controller` (which learns each
operating point's live latency) with what only the daemon knows:

- the **budget** of a request (:meth:`BudgetController.budget_for`), i.e. the latency target the
  choice plans for, and the **deadline** past which it is refused at once:

  ========================  ===========================================  ==========================
  request                   budget (planned for)                         refused at once when the
                                                                         cheapest point's predicted
                                                                         latency exceeds
  ========================  ===========================================  ==========================
  ``budget_ms`` given       ``min(budget_ms, timeout_ms)``               the budget (an answer after
                                                                         it is useless: issue 4)
  no ``budget_ms``          ``min(default budget, timeout_ms)``          ``timeout_ms`` (never
                                                                         refused while the cheapest
                                                                         point can still answer in
                                                                         time; no deadline = never)
  ========================  ===========================================  ==========================

  When no point fits the budget but the cheapest is predicted within the deadline, the cheapest
  runs. The default budget is ``controller.default_budget_ms``, else the profile's
  ``default_budget_ms``. ``timeout_ms`` stays the hard deadline at dequeue too (the scheduler);
- the **queue wait** the scheduler predicts (the running request's remaining predicted time plus
  the predicted service time of every request ahead), handed to ``Controller.choose``;
- the **slowdown hint** ``h >= 1`` of hardware telemetry (thermal throttling from ``tegrastats``:
  the inverse GPU clock ratio): predictions are multiplied by ``h`` and the stats fed back are
  divided by it, so the controller steps down as soon as the clocks drop (before slow requests are
  observed), its learned model stays in unthrottled units, and a slowdown the hint explains is not
  counted twice (``choose(budget / h, wait / h)`` is exactly ``choose`` with every prediction
  scaled by ``h``); when the hint returns to 1 the predictions do too;
- the daemon's own **per-request overhead** (image decode, frame fetch, response encoding: the
  worker's time around the engine call), tracked as an EWMA and added to every predicted service
  time, so the prediction covers what the budget covers — receipt to response;
- the **answer length**: a prompt seen before is predicted to generate as many tokens as the most
  it generated so far (robots ask recurring questions; "is the path blocked?" answers in 2 tokens,
  "describe the scene." in 15); a new prompt as many as the most any prompt with the same first two
  words generated ("how many ...", "is there ..."); anything else its full ``max_new_tokens`` —
  predicting every request at its worst case would refuse or step down far more than needed;
- a **warm-up** of every operating point at start (one unmeasured 2-token request each on a grey
  frame), so torch's first-call set-up of each input size is not mistaken for a slow device;
- a **refit** when the request leaves the queue: if the point chosen at arrival no longer fits the
  budget left, the most accurate cheaper point that does is run instead (never a refusal then: the
  request was accepted; its hard deadline stays ``timeout_ms``). The same refit, passing over the
  points with as many vision tokens, serves a prompt that does not fit the KV cache at the chosen
  point (:class:`~edgevlm.errors.PromptTooLongError`; the scheduler's one rule: see
  :mod:`edgevlm.daemon.scheduler`).

:func:`build_controller` makes one for a loaded engine: the frontier comes from
``controller.frontier`` (refused when measured on other weights: :func:`check_frontier_weights`), else the model's (or bundle's) ``frontier.json`` (measured for exactly this
model by ``edgevlm calibrate``; ignored, with a warning, when the weights changed since), else the
profile's ``operating_points.frontier`` (the shipped figures for the demo model on that device;
only when every rung it names is on the model's ladder), else one point per resolution rung
measured at start-up (accuracy then only ranks rungs, highest resolution first). Points the engine
cannot run (exit thresholds without exit heads, token pruning on a backend that does not prune) are dropped
with a warning (when none is left of the model's own frontier, the ladder is measured instead); a frontier naming an
``exit_layer`` past the vision encoder's depth is refused (:func:`check_frontier_depth`). Per request, the choice
and the refit pass over the points its frames cannot take (:meth:`BudgetController.points_for`: a video, several
frames to Qwen2.5-VL / Qwen3-VL, is never pruned; several images are neither pruned nor exited early).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgevlm.errors import ConfigError, DeadlineExceededError, InvalidRequestError
from edgevlm.profile import FrontierPoint, Profile, load_frontier, load_profile
from edgevlm.runtime.policy import Controller, Decision, PointProfile
from edgevlm.types import OperatingPoint, Stats, asks_adaptive_vision, exit_depth_error, vision_items_error

logger = logging.getLogger(__name__)

FALLBACK_BUDGET_MS = 1000.0
MAX_PROMPTS = 1024  # answer lengths remembered (least recently seen forgotten first)
MAX_HINT = 50.0


def _ms(value: float) -> float | int:
    """``value`` as an int when it is whole (request fields are integers on the wire)."""
    return int(value) if float(value).is_integer() else round(float(value), 3)


@dataclass(frozen=True)
class Choice:
    """What the scheduler runs a request with."""

    point: OperatingPoint
    predicted_ms: float  # e2e including the predicted queue wait
    service_ms: float  # predicted time on the worker (queue wait excluded)
    budget_ms: float  # the latency target planned for
    decision: Decision
    deadline_ms: float | None = None  # refusal limit (None = the budget)


class BudgetController:
    """Thread-safe; see the module doc.

    Args:
        controller: the runtime controller over the frontier.
        default_budget_ms: budget of requests that name none.
        source: where the frontier came from (logged and reported).
    """

    def __init__(self, controller: Controller, *, default_budget_ms: float, source: str = "") -> None:
        self.controller = controller
        self.default_budget_ms = float(default_budget_ms)
        self.source = source
        self._hint = 1.0
        self._overhead_ms = 0.0
        self._tokens: collections.OrderedDict[str, int] = collections.OrderedDict()  # prompt -> most tokens seen
        self._lock = threading.Lock()

    @property
    def points(self) -> list[PointProfile]:
        return self.controller.points

    @property
    def slowdown_hint(self) -> float:
        return self._hint

    @property
    def overhead_ms(self) -> float:
        """EWMA of the worker's time per request outside the engine call (ms)."""
        return self._overhead_ms

    @staticmethod
    def _prompt_keys(prompt: str) -> tuple[str, str]:
        words = prompt.lower().split()
        return "=" + prompt, "~" + " ".join(words[:2])

    def expected_tokens(self, prompt: str | None, max_new_tokens: int) -> int:
        """Tokens to plan for: the most this prompt generated before, else the most a prompt with
        the same first two words generated, else ``max_new_tokens`` (always capped by it)."""
        if prompt is None:
            return max_new_tokens
        exact, family = self._prompt_keys(prompt)
        with self._lock:
            seen = self._tokens.get(exact, self._tokens.get(family))
        return max_new_tokens if seen is None else max(1, min(max_new_tokens, seen))

    def _remember_tokens(self, prompt: str, new_tokens: int) -> None:
        with self._lock:
            for key in self._prompt_keys(prompt):
                self._tokens[key] = max(new_tokens, self._tokens.pop(key, 0))
            while len(self._tokens) > MAX_PROMPTS:
                self._tokens.popitem(last=False)

    def observe_overhead(self, ms: float) -> None:
        """Feed the worker's time around one engine call (decode image, fetch frame, reply)."""
        if ms >= 0:
            with self._lock:
                self._overhead_ms += self.controller.alpha * (ms - self._overhead_ms)

    def hint_slowdown(self, factor: float) -> None:
        """The device is ``factor`` times slower than nominal (1.0 = not throttled) until the next
        hint: predictions are scaled by it (see the module doc).

        Called by the daemon with ``ThermalState.slowdown_hint`` on every tegrastats sample.
        Non-finite or non-positive values are ignored (logged); values below 1 count as 1."""
        try:
            f = float(factor)
        except (TypeError, ValueError):
            f = float("nan")
        if not f > 0 or f == float("inf"):
            logger.warning("controller: ignoring slowdown hint %r", factor)
            return
        f = min(max(f, 1.0), MAX_HINT)
        with self._lock:
            if abs(f - self._hint) > 1e-3:
                logger.info("controller: slowdown hint %.2f -> %.2f", self._hint, f)
            self._hint = f

    def budget_for(self, budget_ms: int | None, timeout_ms: int | None = None) -> tuple[float, float]:
        """``(budget, deadline)`` of a request (ms from receipt), see the module doc's table:
        ``budget_ms`` given: ``(min(budget_ms, timeout_ms),) * 2``; else ``(min(default,
        timeout_ms), timeout_ms)``. ``timeout_ms`` None or :data:`~edgevlm.protocol.NO_DEADLINE_MS`
        = no deadline (``inf``)."""
        from edgevlm.protocol import deadline_s

        timeout = float("inf") if deadline_s(timeout_ms) is None else float(timeout_ms)
        if budget_ms is not None:
            b = min(float(budget_ms), timeout)
            return b, b
        return min(self.default_budget_ms, timeout), timeout

    def points_for(self, kinds: Sequence[str] = ("image",)) -> list[PointProfile]:
        """The points a request whose vision items are ``kinds`` (``Engine.vision_kinds``: one image,
        one video, several images) can run at: :func:`runnable`'s rule for a request of that kind
        (:func:`~edgevlm.types.vision_items_error`; every point here is runnable by the engine: see
        :func:`build_controller`), best first.

        Raises:
            InvalidRequestError: none is (a frontier of token-pruning points only, and a video):
                ``no operating point of the latency controller (...) can run this request: ...``.
        """
        ok = [p for p in self.points if vision_items_error(p.point, kinds) is None]
        if not ok:
            names = [p.name for p in self.points]
            reason = vision_items_error(self.points[0].point, kinds)
            raise InvalidRequestError(
                f"no operating point of the latency controller ({', '.join(names)}) can run this request: "
                f"{reason} (give the controller's frontier a point without early exit or token pruning)",
                details={"reason": "no_operating_point", "points": names, "vision_kinds": list(kinds)})
        return ok

    def choose(self, budget_ms: float, *, max_new_tokens: int, queue_wait_ms: float,
               deadline_ms: float | None = None, requested_budget_ms: float | None = None,
               deadline_limit: str = "timeout_ms", kinds: Sequence[str] = ("image",)) -> Choice:
        """The most accurate point predicted to finish within ``budget_ms`` (predictions scaled by
        the slowdown hint, plus the overhead); when none does, the cheapest point as long as its
        mean prediction is within ``deadline_ms`` (default: ``budget_ms``). Only the points the
        request can run count (:meth:`points_for` its vision items ``kinds``: a video is never
        pruned, several images neither pruned nor exited early).

        ``budget_ms`` and ``deadline_ms`` are what :meth:`budget_for` returns; ``requested_budget_ms``
        is the request's own ``budget_ms`` (None when it gave none). Without ``deadline_ms`` the
        budget is the limit and counts as requested. The refusal names the request field that was
        the limit: the request's ``budget_ms`` when it gave one no longer than the deadline, else
        its ``timeout_ms``, or its MQTT v5 Message Expiry Interval when ``deadline_limit`` is
        ``"message_expiry"`` (the interval was shorter than the timeout: the deadline came from it).

        Raises:
            DeadlineExceededError: even the cheapest point is predicted to miss the deadline;
                message ``"budget_ms B cannot be met: ..."`` or ``"timeout_ms T cannot be met:
                ..."`` (``"the Message Expiry Interval of T ms cannot be met: ..."``); ``details``
                has ``cheapest_predicted_ms``, ``planned_budget_ms`` (the budget planned for, as in
                the response stats' ``budget_ms``), ``queue_wait_ms``, ``slowdown_hint``,
                ``slowdown``, ``budget_ms`` only when the request gave one, and ``timeout_ms`` and
                ``limit`` (``deadline_limit``) only when the deadline was the limit.
            InvalidRequestError: no point can run the request (:meth:`points_for`).
        """
        h, extra = self._hint, self._overhead_ms
        points = self.points_for(kinds)
        only = None if len(points) == len(self.points) else {p.name for p in points}
        deadline = budget_ms if deadline_ms is None else deadline_ms
        if deadline_ms is None and requested_budget_ms is None:
            requested_budget_ms = budget_ms
        try:
            d = self.controller.choose((budget_ms - extra) / h, max_new_tokens=max_new_tokens,
                                       queue_wait_ms=queue_wait_ms / h, only=only)
        except DeadlineExceededError:
            point = min(points, key=lambda p: self.service_ms(p.point, max_new_tokens)).point
            service = self.service_ms(point, max_new_tokens)
            cheapest = service + queue_wait_ms
            if cheapest <= deadline:
                # no point fits the budget with the headroom, but the cheapest is predicted in time
                # (refusing is for requests that cannot be answered in time at all)
                d = Decision(point=point, predicted_ms=(cheapest - extra) / h, budget_ms=budget_ms,
                             ceiling=self.controller.ceiling.name, slowdown=self.controller.slowdown)
                return Choice(point=point, predicted_ms=cheapest, service_ms=service, budget_ms=budget_ms,
                              decision=d, deadline_ms=deadline)
            details: dict[str, Any] = {
                "cheapest_predicted_ms": round(cheapest, 2), "planned_budget_ms": _ms(budget_ms),
                "queue_wait_ms": round(queue_wait_ms, 2), "slowdown_hint": round(self._hint, 3),
                "slowdown": round(self.controller.slowdown, 3)}
            if requested_budget_ms is not None:
                details["budget_ms"] = _ms(requested_budget_ms)
            if requested_budget_ms is not None and requested_budget_ms <= deadline:
                what = f"budget_ms {requested_budget_ms:.0f}"
            else:
                details["timeout_ms"] = _ms(deadline)
                details["limit"] = deadline_limit
                what = (f"the Message Expiry Interval of {deadline:.0f} ms" if deadline_limit == "message_expiry"
                        else f"timeout_ms {deadline:.0f}")  # fmt: skip
            raise DeadlineExceededError(
                f"{what} cannot be met: the cheapest operating point is predicted to take "
                f"{cheapest:.0f} ms (queue wait {queue_wait_ms:.0f} ms included)",
                details=details,
            ) from None
        predicted = d.predicted_ms * h + extra
        return Choice(point=d.point, predicted_ms=predicted, service_ms=max(0.0, predicted - queue_wait_ms),
                      budget_ms=budget_ms, decision=d, deadline_ms=deadline)

    def service_ms(self, point: OperatingPoint, max_new_tokens: int, *, tail: bool = False) -> float:
        """Predicted worker time of ``point`` (slowdown hint and overhead included): the mean, or
        with ``tail`` what the controller plans with (times its tail factor)."""
        n = min(max_new_tokens, point.max_new_tokens or max_new_tokens)
        return self.controller.predict_ms(point.name, n, tail=tail) * self._hint + self._overhead_ms

    def refit(self, choice: Choice, remaining_ms: float, *, max_new_tokens: int,
              too_long: Collection[OperatingPoint] = (), kinds: Sequence[str] = ("image",)
              ) -> tuple[OperatingPoint, float] | None:
        """At dequeue: keep the chosen point if it still fits ``remaining_ms`` (with the controller's
        headroom), else the most accurate cheaper point that does, else the cheapest. Returns the
        point and its predicted service time. Does not move the controller's hysteresis state.
        Only the points a request of vision items ``kinds`` can run count (:meth:`points_for`).

        ``too_long``: points at which the request's prompt did not fit the KV cache; they are passed
        over, and so is every point with as many vision tokens (the same rung and keep ratio: see
        :func:`same_vision_tokens`). None when that leaves no point.

        Raises:
            InvalidRequestError: no point can run the request (:meth:`points_for`).
        """
        limit = remaining_ms * self.controller.headroom
        points = self.points_for(kinds)
        names = [p.name for p in points]
        start = names.index(choice.point.name) if choice.point.name in names else 0
        best: tuple[OperatingPoint, float] | None = None
        for p in points[start:]:
            if any(same_vision_tokens(p.point, t) for t in too_long):
                continue
            ms = self.service_ms(p.point, max_new_tokens, tail=True)
            if ms <= limit:  # its token cap raised to what the budget left affords (see runtime.policy)
                return self.controller.lift_cap(p.point, (remaining_ms - self._overhead_ms) / self._hint), ms
            if best is None or ms < best[1]:
                best = (p.point, ms)
        return best

    def observe(self, point: OperatingPoint, stats: Stats, *, prompt: str | None = None) -> None:
        """Feed back the engine's measurements of a request run at ``point`` (divided by the hint),
        and the answer length of ``prompt``."""
        if prompt is not None and stats.new_tokens > 0:
            self._remember_tokens(prompt, stats.new_tokens)
        h = self._hint
        scaled = stats if h == 1.0 else stats.model_copy(update={
            "vision_ms": stats.vision_ms / h, "prefill_ms": stats.prefill_ms / h, "tpot_ms": stats.tpot_ms / h})
        self.controller.observe(point.name, scaled)

    def describe(self) -> dict[str, Any]:
        """Frontier, ceiling, learned slowdown and hint (for logs and status)."""
        return {
            "source": self.source,
            "points": [p.name for p in self.points],
            "ceiling": self.controller.ceiling.name,
            "slowdown": round(self.controller.slowdown, 3),
            "slowdown_hint": round(self._hint, 3),
            "tail": round(self.controller.tail, 3),
            "overhead_ms": round(self._overhead_ms, 2),
            "default_budget_ms": self.default_budget_ms,
        }


def same_vision_tokens(a: OperatingPoint, b: OperatingPoint) -> bool:
    """Whether points ``a`` and ``b`` give an image as many vision tokens: the same rung and keep
    ratio (early exit changes the encoder's depth, not its token count)."""
    return a.resolution_px == b.resolution_px and (a.keep_ratio or 1.0) == (b.keep_ratio or 1.0)


# ------------------------------------------------------------------------------ construction


def resolve_profile(config: Any) -> Profile | None:
    """The daemon's profile: ``config.profile``, else ``cpu`` for a CPU model, else None."""
    name = config.profile
    if name is None and str(config.model.device) == "cpu":
        name = "cpu"
    return load_profile(name) if name is not None else None


def runnable(engine: Any, p: FrontierPoint) -> bool:
    """Whether ``engine`` can run point ``p`` (exits need exit heads at the asked layer, a keep
    ratio below 1 a backend that prunes tokens) for a request of one image; for each request the
    controller also passes over the points its vision items cannot take (a video is never pruned,
    several images neither pruned nor exited early: :meth:`BudgetController.points_for`)."""
    backend = getattr(engine, "backend", None)
    if p.keep_ratio is not None and p.keep_ratio < 1.0 and backend is not None \
            and not getattr(backend, "supports_pruning", False):
        return False
    if p.exit_threshold is None and p.exit_layer is None:
        return True
    exits = list(getattr(engine, "exit_points", []) or [])
    if not exits:
        return False
    return p.exit_layer is None or p.exit_threshold is not None or p.exit_layer in exits


def ladder_points(engine: Any) -> list[PointProfile]:
    """One point per resolution rung, latencies measured now with a 2-token request on a grey
    frame, accuracy = rank (highest rung best): a starting point when no frontier was measured."""
    import numpy as np

    rungs = sorted(getattr(engine, "resolution_ladder", None) or [engine.image_size_px], reverse=True)
    image = np.full((engine.image_size_px * 3 // 4, engine.image_size_px, 3), 128, np.uint8)
    out = []
    for i, r in enumerate(rungs):
        op = OperatingPoint(name=f"r{r}", resolution_px=r)
        engine.ask(image, "describe", max_new_tokens=2, operating_point=op)  # warm-up
        s = engine.ask(image, "describe", max_new_tokens=2, operating_point=op).stats
        out.append(PointProfile(op, 1.0 - i / (10 * len(rungs)), s.vision_ms, s.prefill_ms, max(s.tpot_ms, 0.01)))
    return out


def warm_up(engine: Any, points: list[PointProfile]) -> None:
    """One unmeasured 2-token request per operating point on a grey frame: torch's one-time set-up
    of each input size / exit / pruning path happens now, not in a user's first requests (where
    the controller would read it as a slow device). Errors are logged, never raised."""
    import numpy as np

    size = int(getattr(engine, "image_size_px", 64))
    image = np.full((size * 3 // 4, size, 3), 128, np.uint8)
    for p in points:
        try:
            engine.ask(image, "describe", max_new_tokens=2, operating_point=p.point)
        except Exception as exc:  # noqa: BLE001 - a point that fails here fails the same way on requests
            logger.warning("controller: warm-up of %s failed: %s: %s", p.name, type(exc).__name__, exc)


def measured_on(record: Any, model_dir: Any) -> bool:
    """Whether a frontier record was measured on the weights in ``model_dir`` (unknown = yes: a
    hand-written file has no ``weights_fingerprint``, an engine may have no folder)."""
    if not record.weights_fingerprint or model_dir is None:
        return True
    from edgevlm.model_folder import weights_fingerprint

    return record.weights_fingerprint == weights_fingerprint(model_dir)


def _same_weights(record: Any, model_dir: Any) -> bool:
    """Whether a model's frontier.json was measured on its current weights; a warning when not."""
    if measured_on(record, model_dir):
        return True
    logger.warning("controller: %s/frontier.json was measured on other weights: not used", model_dir)
    return False


def check_frontier_weights(record: Any, path: Any, model_dir: Any) -> None:
    """``controller.frontier`` (``record``, read from ``path``) must have been measured on the
    weights in ``model_dir``: a frontier of another model (or of this one before retraining) would
    run this model at that model's rungs, exits and keep ratios under that model's latencies, and
    name the points as that model did. A frontier without ``weights_fingerprint`` (hand-written) is
    not checked. The one rule for ``serve --check-config`` and the start-up.

    Raises:
        ConfigError: ``controller.frontier: ...`` naming both models.
    """
    if not measured_on(record, model_dir):
        raise ConfigError(
            f"controller.frontier: {path} was measured on other weights (its model: {record.model!r}), not on "
            f"{model_dir}'s: measure this model's with `edgevlm calibrate MODEL` (or drop the file's "
            f"weights_fingerprint to use it anyway)")


def vision_blocks_of(model_config: Any) -> int | None:
    """The vision encoder's depth (blocks a full encode runs) of a parsed model config (``Engine.config``, or
    what ``family.parse_config`` returns at ``--check-config``), or None for a family without early exit
    (its points with an exit are not runnable: :func:`runnable`)."""
    geometry = getattr(model_config, "exit_geometry", None)
    return None if geometry is None else int(geometry.vision_blocks)


def check_frontier_depth(points: list[FrontierPoint], where: str, vision_blocks: int | None) -> None:
    """Every point's ``exit_layer`` (the deepest block an exit may happen after) lies within the vision
    encoder's ``vision_blocks``: a point past it names no block of this model (a frontier of a deeper model,
    or a hand edit): the engine would run it silently as if it had no ``exit_layer`` (with an
    ``exit_threshold``: every exit point consulted, up to full depth) under the name and measured latency of
    another encoder's exit, and the controller drop it as "cannot run" without one. ``where``: the frontier's
    source (``controller.frontier: <file>``, ``model.path: <folder>/frontier.json``, ``profile <name>:
    operating_points``). Not checked when ``vision_blocks`` is None (:func:`vision_blocks_of`). The one rule
    for ``serve --check-config`` and the start-up, for every frontier the controller takes.

    Raises:
        ConfigError: ``<where>: frontier[i] ('<name>'): exit_layer K is past the vision encoder's depth (N
            blocks: exit_layer 1..N)``, naming the first such point.
    """
    if vision_blocks is None:
        return
    for i, p in enumerate(points):
        past = exit_depth_error(p.exit_layer, vision_blocks)
        if past is not None:
            raise ConfigError(f"{where}: frontier[{i}] ({p.name!r}): {past}")


def _fits_ladder(profile: Profile, engine: Any) -> bool:
    """Whether a profile's frontier was made for a model like ``engine``: every rung it names is
    on the engine's resolution ladder (a frontier of another model would run it at foreign sizes)."""
    ladder = set(getattr(engine, "resolution_ladder", None) or [])
    off = sorted({p.resolution_px for p in profile.operating_points.frontier
                  if p.resolution_px is not None and p.resolution_px not in ladder})
    if off:
        # a shipped profile's frontier is the demo model's: for another model it is expected not to fit
        logger.info("controller: profile %s's frontier uses rungs %s that this model's ladder %s lacks: not used "
                    "(measure this model's: python -m edgevlm.quantize.frontier MODEL)", profile.name, off,
                    sorted(ladder) or "(none)")
    return not off


def build_controller(config: Any, engine: Any, *, batched: bool = False) -> BudgetController | None:
    """A :class:`BudgetController` for ``engine`` under daemon ``config`` (None when
    ``controller.enabled`` is false). See the module doc for where the frontier comes from.
    ``batched``: the worker batches requests (continuous batching over several KV-cache rows);
    then the points with early exit or token pruning are left out when the frontier has others:
    their images are encoded one request at a time, while the plain points' images share one
    encoder batch, so the single-request latencies the frontier was measured with overstate what
    exits save under load (measured: bench/results/daemon_throughput_h200_20261201.md).

    Raises:
        ConfigError: the profile or frontier file is invalid, ``controller.frontier`` was measured on
            other weights (:func:`check_frontier_weights`), a point's ``exit_layer`` is past the vision
            encoder's depth (:func:`check_frontier_depth`), or no point of ``controller.frontier`` is
            runnable (the model's own ``frontier.json`` or a profile's without one this engine runs is
            replaced by the resolution ladder measured at start-up, with a warning).
    """
    cc = config.controller
    if not cc.enabled:
        return None
    profile = resolve_profile(config)
    points: list[FrontierPoint] = []
    source = where = ""
    model_dir = getattr(engine, "model_dir", None)
    model_frontier = Path(model_dir) / "frontier.json" if model_dir is not None else None
    if cc.frontier is not None:
        record = load_frontier(cc.frontier)
        check_frontier_weights(record, cc.frontier, model_dir)
        points, source, where = record.frontier, str(cc.frontier), f"controller.frontier: {cc.frontier}"
    elif model_frontier is not None and model_frontier.is_file() \
            and _same_weights(record := load_frontier(model_frontier), model_dir):
        points, source, where = record.frontier, str(model_frontier), f"model.path: {model_frontier}"
    elif profile is not None and profile.operating_points.frontier and _fits_ladder(profile, engine):
        points, source = profile.operating_points.frontier, f"profile {profile.name}"
        where = f"profile {profile.name}: operating_points"
    if points:
        check_frontier_depth(points, where, vision_blocks_of(getattr(engine, "config", None)))
    profiles: list[PointProfile]
    if points:
        ok = [p for p in points if runnable(engine, p)]
        dropped = [p.name for p in points if p not in ok]
        if dropped:
            logger.warning("controller: dropping points this model/backend cannot run (early exit or token pruning): %s",
                           ", ".join(dropped))
        if batched and any(not asks_adaptive_vision(p) for p in ok):
            solo = [p.name for p in ok if asks_adaptive_vision(p)]
            ok = [p for p in ok if not asks_adaptive_vision(p)]
            if solo:
                logger.info("controller: continuous batching: leaving out the points that encode one image at a "
                            "time (early exit, token pruning): %s", ", ".join(solo))
        if not ok and cc.frontier is None:
            # the model's own frontier.json (or a profile's) is a starting point, not a setting: measure the
            # ladder instead (a frontier.json written before it kept the plain points, on a backend that
            # neither exits nor prunes, held none this engine runs)
            logger.warning("controller: no operating point of %s can run on this model/backend; measuring "
                           "the resolution ladder at start-up instead (re-run edgevlm calibrate to store plain "
                           "points)", source)
            points = []
        elif not ok:
            raise ConfigError(f"controller: no operating point of {source} can run on this model")
    if points:
        from edgevlm.profile import pareto

        # the stored frontier also carries the full-depth points' own frontier (for models without exit
        # heads); among the points this model runs, a dominated one would only slow the ceiling's step-up
        ok = pareto(ok)
        profiles = [PointProfile(p.operating_point(), p.accuracy, p.vision_ms, p.prefill_ms, p.tpot_ms) for p in ok]
        warm_up(engine, profiles)
    else:
        profiles, source = ladder_points(engine), "resolution ladder measured at start-up"
    default = cc.default_budget_ms or (profile.default_budget_ms if profile is not None else FALLBACK_BUDGET_MS)
    controller = Controller(profiles, alpha=cc.alpha, headroom=cc.headroom, step_up_after=cc.step_up_after,
                            step_up_margin=cc.step_up_margin)
    bc = BudgetController(controller, default_budget_ms=default, source=source)
    logger.info("controller: %d operating points from %s, default budget %.0f ms", len(profiles), source, default)
    return bc
