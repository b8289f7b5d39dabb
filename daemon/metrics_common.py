"""Constants and pure helpers of :mod:`edgevlm.daemon.metrics` (no prometheus-client import).

The histogram buckets, the result codes, :func:`parse_listen_address` (also used to validate the
config without prometheus-client), :func:`telemetry_topic`, and the small helpers that sanitise
the values the metrics take and summarise latencies as percentiles.
"""

from __future__ import annotations

import math
import re
from collections import deque
from typing import Any

from edgevlm.errors import ErrorCode

TTFT_BUCKETS_S: tuple[float, ...] = tuple(round(0.010 * 1.5**k, 9) for k in range(12))  # 10 ms .. 865 ms
E2E_BUCKETS_S: tuple[float, ...] = tuple(round(0.010 * 1.5**k, 9) for k in range(18))  # 10 ms .. 9.85 s
RESULT_OK = "OK"
RESULT_CODES: tuple[str, ...] = (RESULT_OK, *(c.value for c in ErrorCode))
_OTHER = "OTHER"
SUMMARY_SCHEMA_VERSION = 1


def parse_listen_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:9108"``, ``"[::1]:9108"``, ``":9108"`` (all interfaces) or ``"9108"`` ->
    ``(host, port)``. Port 0 asks the kernel for a free port.

    Raises:
        ValueError: not of these forms, or the port is outside 0..65535.
    """
    text = str(address).strip()
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^:\[\]\s]*)):(\d{1,5})|(\d{1,5})", text)
    if m is None:
        raise ValueError(f"metrics listen address {address!r}: expected HOST:PORT, [IPV6]:PORT or PORT")
    host = m.group(1) or m.group(2) or "0.0.0.0"
    port = int(m.group(3) or m.group(4))
    if port > 65535:
        raise ValueError(f"metrics listen address {address!r}: port {port} is not in 0..65535")
    return host, port


def telemetry_topic(prefix: str, device_id: str) -> str:
    """The topic the telemetry summary is published on: ``<prefix>/<device_id>/telemetry``."""
    return f"{prefix}/{device_id}/telemetry"


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
