"""Constants and pure helpers of :mod:`edgevlm.daemon.metrics` (no prometheus-client import).

The histogram buckets, the result codes, :class:`EventCounters` (the daemon's named event counts,
exported by the metrics), and the small helpers that sanitise the values the metrics take and
summarise latencies as percentiles. :func:`parse_listen_address` (the config's own check) and
:func:`telemetry_topic` (the protocol's) are re-exported from the core.
"""

from __future__ import annotations

import collections
import math
import threading
from collections import deque
from typing import Any

from edgevlm.config_runtime import parse_listen_address  # noqa: F401  (re-exported)
from edgevlm.errors import ErrorCode
from edgevlm.protocol import telemetry_topic  # noqa: F401  (re-exported)

TTFT_BUCKETS_S: tuple[float, ...] = tuple(round(0.010 * 1.5**k, 9) for k in range(12))  # 10 ms .. 865 ms
E2E_BUCKETS_S: tuple[float, ...] = tuple(round(0.010 * 1.5**k, 9) for k in range(18))  # 10 ms .. 9.85 s
RESULT_OK = "OK"
RESULT_CODES: tuple[str, ...] = (RESULT_OK, *(c.value for c in ErrorCode))
_OTHER = "OTHER"
SUMMARY_SCHEMA_VERSION = 1


class EventCounters:
    """Thread-safe named event counts of the daemon (requests received, errors by code, MQTT
    connects, duplicates, batch joins...): the one place they are counted. :class:`~edgevlm.daemon.
    metrics.Metrics` exports every name as ``edgevlm_events_total{event="<name>"}`` and in the
    telemetry summary; without prometheus-client they are still counted (and logged at shutdown)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: collections.Counter[str] = collections.Counter()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def _field(stats: Any, name: str) -> Any:
    if stats is None:
        return None
    if isinstance(stats, dict):
        return stats.get(name)
    return getattr(stats, name, None)


def _number(value: Any) -> float | None:
    """A finite, non-negative number, else None (metrics must not take garbage)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) and v >= 0 else None


def _percentiles(values: deque[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    s = sorted(values)

    def rank(q: float) -> float:  # nearest-rank percentile
        return round(s[max(0, math.ceil(q * len(s)) - 1)], 3)

    return {
        "count": len(s),
        "mean": round(sum(s) / len(s), 3),
        "p50": rank(0.5),
        "p90": rank(0.9),
        "p99": rank(0.99),
    }
