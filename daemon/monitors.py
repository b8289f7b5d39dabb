"""Monitors: continuous per-frame label checks on a camera, published as MQTT events on change.

A monitor (``monitors:`` in the daemon config, :class:`edgevlm.config.MonitorConfig`) runs the
vision encoder only up to an exit classifier (:meth:`edgevlm.runtime.Engine.classify`, trained by
``edgevlm calibrate``) on the newest frame of its source, at most ``fps`` times a second. Its
*state* is the sorted list of its ``labels`` whose probability reaches ``threshold``. A new state
is published once it has been seen on ``debounce_frames`` consecutive new frames (a flicker shorter
than that is never published); the first stable state is published too. Topic::

    <prefix>/<device_id>/events/<monitor>     QoS 1, not retained

Payload (JSON)::

    {"schema_version": 1, "monitor": "red_object", "source": "front", "present": ["red"],
     "labels": {"red": true}, "scores": {"red": 0.97}, "previous": [], "frame_ts": 1700000000.12,
     "frame_pos_ms": 1200.0, "frame_index": 12, "ts": 1700000000.19, "exit_layer": 2,
     "resolution_px": 128}

``frame_ts`` is the capture time of the frame that completed the debounce (UNIX s).

Scheduling: the scheduler's single inference worker runs monitor ticks only when no request is
waiting (:class:`~edgevlm.daemon.scheduler.Scheduler`), one tick at a time, so requests always
go first and wait at most one tick; the tick's predicted remaining time is part of the queue-wait
prediction. A monitor that falls behind does not catch up (its next tick is one period later).
A frame already classified is skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgevlm.config import MonitorConfig
from edgevlm.errors import ConfigError, EdgeVLMError
from edgevlm.protocol import events_topic

logger = logging.getLogger(__name__)

PublishFn = Callable[[str, bytes], Any]


@dataclass
class MonitorState:
    """Runtime state of one monitor."""

    config: MonitorConfig
    topic: str
    resolution_px: int = 0
    exit_layer: int | None = None
    next_due: float = 0.0
    last_seq: int = 0
    published: tuple[str, ...] | None = None  # last published state (None = nothing yet)
    candidate: tuple[str, ...] | None = None
    streak: int = 0
    ticks: int = 0
    skipped: int = 0
    events: int = 0
    errors: int = 0
    last_scores: dict[str, float] = field(default_factory=dict)


def check_monitors(monitors: list[MonitorConfig], labels: list[str], blocks: list[int], *,
                   patch_size_px: int | None = None) -> None:
    """The monitors against a model's exit classifier: its ``labels`` and the vision blocks with a classifier
    after them (``blocks``). The one rule for ``serve --check-config`` (from the model folder's ``exits.json``) and
    for the start-up (from the loaded model, which also gives its ``patch_size_px``). Raises ``ConfigError`` naming
    the monitor's key: no classifier at all, an unknown label, an ``exit_layer`` without a classifier, a
    ``resolution_px`` below the patch size (as ``edgevlm ask --resolution``)."""
    if monitors and not labels:
        raise ConfigError("monitors: the model has no exit classifier (run `edgevlm calibrate` on it)")
    for i, mon in enumerate(monitors):
        unknown = [lab for lab in mon.labels if lab not in labels]
        if unknown:
            raise ConfigError(f"monitors[{i}].labels: unknown label(s) {unknown} (the model has {labels})")
        if mon.exit_layer is not None and mon.exit_layer not in blocks:
            raise ConfigError(f"monitors[{i}].exit_layer: no classifier after block {mon.exit_layer} "
                              f"(classifier blocks: {blocks})")
        if mon.resolution_px is not None and patch_size_px and mon.resolution_px < patch_size_px:
            raise ConfigError(f"monitors[{i}].resolution_px: {mon.resolution_px} px is below the model's patch size "
                              f"({patch_size_px} px)")


class MonitorRunner:
    """All configured monitors. :meth:`attach` (worker thread, engine loaded), then the scheduler
    calls :meth:`next_due` / :meth:`run_due` whenever it is idle.

    Args:
        configs: the monitors.
        sources: the daemon's :class:`~edgevlm.daemon.sources.SourceManager`.
        publish: ``publish(topic, payload)``; failures are logged by the caller.
        prefix, device_id: topic layout.
    """

    def __init__(self, configs: list[MonitorConfig], sources: Any, publish: PublishFn, *, prefix: str,
                 device_id: str) -> None:
        self.sources = sources
        self.publish = publish
        self.states = [MonitorState(c, events_topic(prefix, device_id, c.name)) for c in configs]
        self._tick_ms = 20.0  # EWMA of one tick's duration (queue-wait prediction)

    def attach(self, engine: Any) -> None:
        """Check every monitor against the loaded model (labels, classifier block, rung).

        Raises:
            ConfigError: the model has no exit classifier, or a label / exit_layer it does not have, or a
                resolution_px below its patch size.
        """
        labels = list(getattr(engine, "labels", []) or [])
        ladder = sorted(getattr(engine, "resolution_ladder", None) or [engine.image_size_px])
        heads = getattr(engine.backend, "exit_heads", None)
        blocks = list(heads.spec.classifier_blocks) if heads is not None else []
        check_monitors([st.config for st in self.states], labels, blocks,
                       patch_size_px=getattr(engine, "patch_size_px", None))
        now = time.monotonic()
        for st in self.states:
            c = st.config
            st.exit_layer = c.exit_layer if c.exit_layer is not None else (blocks[0] if blocks else None)
            st.resolution_px = c.resolution_px or ladder[0]
            st.next_due = now
        logger.info("monitors: %s", ", ".join(f"{s.config.name} ({s.config.source}, {s.config.fps:g} fps, "
                                             f"block {s.exit_layer}, {s.resolution_px} px)" for s in self.states))

    def next_due(self) -> float | None:
        """Monotonic time of the earliest due tick (None without monitors)."""
        return min((s.next_due for s in self.states), default=None)

    def tick_ms(self) -> float:
        """Predicted duration of one tick (ms)."""
        return self._tick_ms

    def run_due(self, engine: Any) -> None:
        """Run the most overdue monitor's tick (one only: requests may be waiting by then)."""
        if not self.states:
            return
        st = min(self.states, key=lambda s: s.next_due)
        now = time.monotonic()
        if st.next_due > now:
            return
        period = 1.0 / st.config.fps
        st.next_due = max(st.next_due + period, now)  # no catching up after falling behind
        t0 = time.perf_counter()
        try:
            self._tick(engine, st)
        except EdgeVLMError as err:
            st.errors += 1
            logger.warning("monitor %s: %s", st.config.name, err.message)
        except Exception:  # noqa: BLE001 - a monitor must never kill the worker
            st.errors += 1
            logger.exception("monitor %s failed", st.config.name)
        self._tick_ms += 0.2 * ((time.perf_counter() - t0) * 1e3 - self._tick_ms)

    def _tick(self, engine: Any, st: MonitorState) -> None:
        src = self.sources.get(st.config.source)
        frame = src.latest()
        if frame is None or frame.seq == st.last_seq:
            st.skipped += 1
            return
        st.last_seq = frame.seq
        scores = engine.classify(frame.image, resolution_px=st.resolution_px, block=st.exit_layer)
        st.ticks += 1
        st.last_scores = {lab: scores[lab] for lab in st.config.labels}
        state = tuple(sorted(lab for lab in st.config.labels if scores[lab] >= st.config.threshold))
        if state == st.published:
            st.candidate, st.streak = None, 0
            return
        if state == st.candidate:
            st.streak += 1
        else:
            st.candidate, st.streak = state, 1
        if st.streak < st.config.debounce_frames:
            return
        previous, st.published = st.published, state
        st.candidate, st.streak = None, 0
        payload = {
            "schema_version": 1,
            "monitor": st.config.name,
            "source": st.config.source,
            "present": list(state),
            "labels": {lab: lab in state for lab in st.config.labels},
            "scores": {lab: round(v, 4) for lab, v in st.last_scores.items()},
            "previous": list(previous) if previous is not None else None,
            "frame_ts": frame.ts,
            "frame_pos_ms": frame.pos_ms,
            "frame_index": frame.index,
            "ts": time.time(),
            "exit_layer": st.exit_layer,
            "resolution_px": st.resolution_px,
        }
        st.events += 1
        logger.info("monitor %s: %s -> %s", st.config.name, previous, list(state))
        self.publish(st.topic, json.dumps(payload, separators=(",", ":")).encode())

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per monitor: ticks, skipped frames, events, errors, state, last scores."""
        return {s.config.name: {"ticks": s.ticks, "skipped": s.skipped, "events": s.events, "errors": s.errors,
                                "present": list(s.published) if s.published is not None else None,
                                "scores": dict(s.last_scores)} for s in self.states}
