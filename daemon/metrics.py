"""Prometheus metrics of the daemon and the JSON telemetry summary published over MQTT.

Everything lives in a private :class:`prometheus_client.CollectorRegistry` (never the global
one, so two daemons or tests in one process do not collide) served by prometheus-client's HTTP
server on a configurable address. Names follow the Prometheus conventions (base units in the name:
``_seconds``, ``_bytes``, ``_celsius``, ``_watts``, ``_hertz``; ``_total`` for counters):

==========================================  ==========  ========================================
metric                                      type        labels / notes
==========================================  ==========  ========================================
edgevlm_requests_total                      counter     ``code``: OK or a wire error code
edgevlm_ttft_seconds                        histogram   buckets 10 ms × 1.5^k, k = 0..11
edgevlm_e2e_seconds                         histogram   buckets 10 ms × 1.5^k, k = 0..17
edgevlm_queue_wait_seconds                  histogram   time in the daemon's queue
edgevlm_vision_encode_seconds               histogram   ``_count`` = vision encodes run
edgevlm_decode_tokens_per_second            gauge       last request's decode rate
edgevlm_decode_tokens_total / _seconds_total counter    rate() of both = mean decode rate
edgevlm_queue_depth                         gauge       requests waiting
edgevlm_deadline_misses_total               counter     DEADLINE_EXCEEDED or answered late
edgevlm_budget_misses_total                 counter     answered later than its latency budget
                                                        (``stats.budget_ms``, from receipt): the
                                                        controller's predictions were too low
edgevlm_early_exits_total                   counter     ``layer``: vision block exited after
edgevlm_operating_point                     gauge       ``name``: 1 for the point in use
edgevlm_operating_point_requests_total      counter     ``name``
edgevlm_source_fps / _state / _frame_age_seconds gauge  ``source`` (and ``state``: 1 = current)
edgevlm_source_reconnects_total             counter     ``source``
edgevlm_requests_dropped_total              counter     ``reason``: a request that cannot be answered
                                                        (invalid_response_topic, no_reply_address,
                                                        response_refused by the broker's ACL)
edgevlm_duplicate_requests_total            counter     ``outcome``: re-sent request answered from
                                                        the cache (answered) or absorbed (in_flight)
edgevlm_events_total                        counter     ``event``: every named event the daemon counts
                                                        (:class:`~edgevlm.daemon.metrics_common.EventCounters`:
                                                        messages_received, errors_<CODE>, mqtt_connects,
                                                        duplicate_answered, batch_joins, ...); also the
                                                        summary's ``events``
edgevlm_jetson_*                            gauge       from the newest tegrastats sample
==========================================  ==========  ========================================

prometheus-client is imported when :class:`Metrics` is built; without it the constructor raises
``ImportError`` naming the extra (``pip install 'edgevlm[metrics]'``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from edgevlm.daemon.metrics_common import (  # noqa: F401  (re-exported: constants and helpers)
    _OTHER,
    E2E_BUCKETS_S,
    RESULT_CODES,
    RESULT_OK,
    SUMMARY_SCHEMA_VERSION,
    TTFT_BUCKETS_S,
    EventCounters,
    _field,
    _number,
    _percentiles,
    parse_listen_address,
    telemetry_topic,
)
from edgevlm.daemon.metrics_export import (  # noqa: F401  (re-exported: the exporters)
    TelemetryPublisher,
    _EventsCollector,
    _JetsonCollector,
)
from edgevlm.errors import ErrorCode

logger = logging.getLogger(__name__)

DROP_REASONS = ("invalid_response_topic", "no_reply_address", "response_refused")
"""Why a request was dropped unanswered (``edgevlm_requests_dropped_total{reason}``)."""

__all__ = [
    "E2E_BUCKETS_S",
    "RESULT_CODES",
    "TTFT_BUCKETS_S",
    "Metrics",
    "TelemetryPublisher",
    "parse_listen_address",
    "telemetry_topic",
]


class Metrics:
    """The daemon's metrics (thread-safe; every method may be called from any thread).

    Args:
        device_id: this device's id (in ``edgevlm_build_info`` and the summary).
        window: how many recent requests the summary's percentiles cover.
        version: software version for ``edgevlm_build_info``.
        pool: the pool this daemon is a member of (``mqtt.pool``), a label of ``edgevlm_build_info``.

    The ``observe_*``/``set_*`` methods never raise on bad input: a metric must not fail a request.
    """

    def __init__(self, *, device_id: str = "", window: int = 512, version: str = "", pool: str | None = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "Prometheus metrics need prometheus-client: pip install 'edgevlm[metrics]'"
            ) from exc
        self.device_id = device_id
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._started_s = time.time()
        r, ns = self.registry, "edgevlm"
        self.requests = prom.Counter(
            "requests", "Requests answered, by result code.", ["code"], namespace=ns, registry=r
        )
        for code in RESULT_CODES:
            self.requests.labels(code)
        self.ttft = prom.Histogram(
            "ttft_seconds", "Time to first token.", namespace=ns, registry=r, buckets=TTFT_BUCKETS_S
        )
        self.e2e = prom.Histogram(
            "e2e_seconds", "End-to-end inference time.", namespace=ns, registry=r, buckets=E2E_BUCKETS_S
        )
        self.queue_wait = prom.Histogram(
            "queue_wait_seconds",
            "Time requests waited in the queue.",
            namespace=ns,
            registry=r,
            buckets=E2E_BUCKETS_S,
        )
        self.vision = prom.Histogram(
            "vision_encode_seconds", "Vision encoder + projector time per encode (_count = encodes).",
            namespace=ns, registry=r, buckets=TTFT_BUCKETS_S,
        )  # fmt: skip
        self.decode_rate = prom.Gauge(
            "decode_tokens_per_second", "Decode rate of the last request.", namespace=ns, registry=r
        )
        self.decode_tokens = prom.Counter(
            "decode_tokens", "Tokens decoded after the first.", namespace=ns, registry=r
        )
        self.decode_seconds = prom.Counter(
            "decode_seconds", "Time spent decoding after the first token.", namespace=ns, registry=r
        )
        self.queue_depth = prom.Gauge(
            "queue_depth", "Requests waiting for the inference worker.", namespace=ns, registry=r
        )
        self.deadline_misses = prom.Counter(
            "deadline_misses", "Requests that missed their deadline.", namespace=ns, registry=r
        )
        self.budget_misses = prom.Counter(
            "budget_misses", "Requests answered later than the latency budget the controller planned for.",
            namespace=ns, registry=r,
        )
        self.early_exits = prom.Counter(
            "early_exits",
            "Vision encodes that exited early, by exit layer.",
            ["layer"],
            namespace=ns,
            registry=r,
        )
        self.operating_point = prom.Gauge(
            "operating_point", "Operating point in use (1) or not (0).", ["name"], namespace=ns, registry=r
        )
        self.op_requests = prom.Counter(
            "operating_point_requests",
            "Requests run per operating point.",
            ["name"],
            namespace=ns,
            registry=r,
        )
        self.source_fps = prom.Gauge(
            "source_fps", "Frames per second delivered.", ["source"], namespace=ns, registry=r
        )
        self.source_state = prom.Gauge(
            "source_state", "Source state (1 = current).", ["source", "state"], namespace=ns, registry=r
        )
        self.source_frame_age = prom.Gauge(
            "source_frame_age_seconds", "Age of the newest frame.", ["source"], namespace=ns, registry=r
        )
        self.source_reconnects = prom.Counter(
            "source_reconnects", "Source reconnect attempts.", ["source"], namespace=ns, registry=r
        )
        self.requests_dropped = prom.Counter(
            "requests_dropped", "Requests that could not be answered, by reason.", ["reason"],
            namespace=ns, registry=r,
        )  # fmt: skip
        for reason in DROP_REASONS:
            self.requests_dropped.labels(reason)
        self.duplicate_requests = prom.Counter(
            "duplicate_requests", "Re-sent requests (same Response Topic and Correlation Data), by outcome.",
            ["outcome"], namespace=ns, registry=r,
        )  # fmt: skip
        for outcome in ("answered", "in_flight"):
            self.duplicate_requests.labels(outcome)
        build = prom.Gauge(
            "build_info",
            "Software version, device id and pool (empty when not a pool member).",
            ["version", "device_id", "pool"],
            namespace=ns,
            registry=r,
        )
        build.labels(version or "unknown", device_id, pool or "").set(1)
        prom.Gauge("start_time_seconds", "UNIX time the daemon started.", namespace=ns, registry=r).set(
            self._started_s
        )
        self._prom = prom
        self.events = EventCounters()
        """The daemon's named event counts, exported as ``edgevlm_events_total{event}``."""
        self.registry.register(_EventsCollector(self))
        self.registry.register(_JetsonCollector(self))
        # state for the JSON summary
        self._codes: dict[str, int] = dict.fromkeys(RESULT_CODES, 0)
        self._deadline_misses = 0
        self._budget_misses = 0
        self._early_exits: dict[str, int] = {}
        self._ttft_ms: deque[float] = deque(maxlen=window)
        self._e2e_ms: deque[float] = deque(maxlen=window)
        self._tps: deque[float] = deque(maxlen=window)
        self._vision_count, self._vision_s = 0, 0.0
        self._queue_depth = 0
        self._op_name: str | None = None
        self._sources: dict[str, dict[str, Any]] = {}
        self.tegra_sample: Any = None
        self.thermal: Any = None

    # -- daemon API ---------------------------------------------------------------------------------
    def observe_response(self, response: Any, received_monotonic: float, timeout_ms: int,
                         queue_depth: int | None = None) -> None:
        """Count one request answered with the wire ``response`` (every transport calls this once
        per answer): its code, its stats, whether an ok answer left after the deadline
        (``timeout_ms`` from ``received_monotonic``; :data:`~edgevlm.protocol.NO_DEADLINE_MS` = none)
        or after the latency budget the controller planned for (``stats.budget_ms`` from
        ``received_monotonic``), the operating point it ran at, and the queue depth now."""
        from edgevlm.protocol import deadline_s

        code = "OK" if response.ok else (response.error.code if response.error else "INTERNAL")
        after_s = deadline_s(timeout_ms)
        now = time.monotonic()
        late = after_s is not None and now > received_monotonic + after_s
        budget_ms = response.stats.budget_ms if response.ok and response.stats is not None else None
        over_budget = budget_ms is not None and (now - received_monotonic) * 1000.0 > budget_ms
        self.observe_answer(response.stats, code, deadline_missed=late and response.ok, budget_missed=over_budget)
        if response.stats is not None and response.stats.operating_point:
            self.set_operating_point(response.stats.operating_point)
        if queue_depth is not None:
            self.set_queue_depth(queue_depth)

    def observe_answer(
        self, stats: Any = None, code: ErrorCode | str = RESULT_OK, *, deadline_missed: bool = False,
        budget_missed: bool = False,
    ) -> None:
        """Count one finished request.

        Args:
            stats: the answer's :class:`edgevlm.types.Stats` (or its dict; ``None`` for a request
                that failed before inference). Times in ms, as the runtime reports them.
            code: ``"OK"`` or the wire :class:`ErrorCode` the request was answered with.
            deadline_missed: the answer went out after the request's deadline (also implied by
                ``DEADLINE_EXCEEDED``).
            budget_missed: the answer went out after the latency budget it was planned for.
        """
        try:
            self._observe(stats, code, deadline_missed, budget_missed)
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            logger.exception("metrics: cannot record an answer")

    def _observe(self, stats: Any, code: ErrorCode | str, deadline_missed: bool, budget_missed: bool) -> None:
        label = code.value if isinstance(code, ErrorCode) else str(code)
        if label not in self._codes:
            label = _OTHER
        missed = deadline_missed or label == ErrorCode.DEADLINE_EXCEEDED.value
        self.requests.labels(label).inc()
        if missed:
            self.deadline_misses.inc()
        if budget_missed:
            self.budget_misses.inc()
        ttft, e2e = _number(_field(stats, "ttft_ms")), _number(_field(stats, "e2e_ms"))
        queue, vision = _number(_field(stats, "queue_ms")), _number(_field(stats, "vision_ms"))
        decode, new_tokens = _number(_field(stats, "decode_ms")), _number(_field(stats, "new_tokens"))
        exit_layer, op = _field(stats, "exit_layer"), _field(stats, "operating_point")
        tps = None
        if ttft:
            self.ttft.observe(ttft / 1000)
        if e2e:
            self.e2e.observe(e2e / 1000)
        if queue is not None and stats is not None:
            self.queue_wait.observe(queue / 1000)
        if vision:
            self.vision.observe(vision / 1000)
        if decode and new_tokens and new_tokens > 1:
            tokens = int(new_tokens) - 1
            tps = tokens / (decode / 1000)
            self.decode_rate.set(tps)
            self.decode_tokens.inc(tokens)
            self.decode_seconds.inc(decode / 1000)
        if isinstance(exit_layer, int) and not isinstance(exit_layer, bool):
            self.early_exits.labels(str(exit_layer)).inc()
        if isinstance(op, str) and op:
            self.op_requests.labels(op).inc()
        with self._lock:
            self._codes[label] = self._codes.get(label, 0) + 1
            self._deadline_misses += missed
            self._budget_misses += budget_missed
            if ttft:
                self._ttft_ms.append(ttft)
            if e2e:
                self._e2e_ms.append(e2e)
            if tps is not None:
                self._tps.append(tps)
            if vision:
                self._vision_count += 1
                self._vision_s += vision / 1000
            if isinstance(exit_layer, int) and not isinstance(exit_layer, bool):
                self._early_exits[str(exit_layer)] = self._early_exits.get(str(exit_layer), 0) + 1

    def request_dropped(self, reason: str) -> None:
        """Count a request dropped unanswered (``reason``: one of :data:`DROP_REASONS`)."""
        if isinstance(reason, str) and reason:
            self.requests_dropped.labels(reason).inc()

    def duplicate_request(self, outcome: str) -> None:
        """Count a re-sent request: ``"answered"`` (from the cache) or ``"in_flight"`` (absorbed)."""
        if outcome in ("answered", "in_flight"):
            self.duplicate_requests.labels(outcome).inc()

    def set_queue_depth(self, depth: int) -> None:
        """Requests currently waiting for the worker."""
        if _number(depth) is None:
            return
        self.queue_depth.set(depth)
        with self._lock:
            self._queue_depth = int(depth)

    def set_operating_point(self, point: Any) -> None:
        """The operating point now in use (an :class:`~edgevlm.types.OperatingPoint` or its name)."""
        name = getattr(point, "name", point)
        if not isinstance(name, str) or not name:
            return
        with self._lock:
            previous, self._op_name = self._op_name, name
        if previous is not None and previous != name:
            self.operating_point.labels(previous).set(0)
        self.operating_point.labels(name).set(1)

    def observe_source(
        self,
        name: str,
        *,
        fps: float | None = None,
        state: str | None = None,
        frame_age_s: float | None = None,
    ) -> None:
        """A camera/microphone source's delivered rate, state (e.g. ``streaming``, ``reconnecting``)
        and newest-frame age; ``None`` leaves a value unchanged."""
        with self._lock:
            entry = self._sources.setdefault(name, {})
            previous = entry.get("state")
            if _number(fps) is not None:
                entry["fps"] = round(float(fps), 3)
                self.source_fps.labels(name).set(fps)
            if _number(frame_age_s) is not None:
                entry["frame_age_s"] = round(float(frame_age_s), 3)
                self.source_frame_age.labels(name).set(frame_age_s)
            if isinstance(state, str) and state:
                entry["state"] = state
        if isinstance(state, str) and state:
            if previous is not None and previous != state:
                self.source_state.labels(name, previous).set(0)
            self.source_state.labels(name, state).set(1)

    def source_reconnect(self, name: str) -> None:
        """Count one reconnect attempt of a source."""
        self.source_reconnects.labels(name).inc()
        with self._lock:
            entry = self._sources.setdefault(name, {})
            entry["reconnects"] = entry.get("reconnects", 0) + 1

    def observe_tegrastats(self, sample: Any, thermal: Any = None) -> None:
        """The newest :class:`~edgevlm.daemon.tegrastats.TegraSample` (and its
        :class:`~edgevlm.daemon.tegrastats.ThermalState`); exported at scrape time."""
        with self._lock:
            self.tegra_sample, self.thermal = sample, thermal

    # -- HTTP endpoint --------------------------------------------------------------------------------
    def start(self, address: str = "127.0.0.1:9108", *, raise_errors: bool = False) -> tuple[str, int] | None:
        """Serve ``/metrics`` on ``address`` (see :func:`parse_listen_address`) in a daemon thread.

        Returns the bound ``(host, port)``, or ``None`` when the address cannot be bound (logged:
        the daemon keeps serving without an endpoint) and ``raise_errors`` is false.

        Raises:
            ValueError: a malformed address.
            OSError: with ``raise_errors``, the address cannot be bound (nothing is logged; the
                caller reports it).
        """
        host, port = parse_listen_address(address)
        if self._server is not None:
            return self.address
        try:
            self._server, self._server_thread = self._prom.start_http_server(
                port, addr=host, registry=self.registry
            )
        except OSError as exc:
            if raise_errors:
                raise
            logger.error("metrics: cannot listen on %s: %s; Prometheus endpoint disabled", address, exc)
            return None
        logger.info("metrics: serving Prometheus metrics on http://%s:%d/metrics", *self.address)
        return self.address

    @property
    def address(self) -> tuple[str, int] | None:
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return host, port

    def stop(self) -> None:
        """Stop the HTTP endpoint (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(5)
            self._server_thread = None

    def exposition(self) -> bytes:
        """The text exposition format of the registry (what ``/metrics`` returns)."""
        return self._prom.generate_latest(self.registry)

    # -- telemetry summary ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """A JSON-serialisable summary for ``<prefix>/<device_id>/telemetry``: totals since start,
        latency percentiles (ms) over the last ``window`` requests, sources, and Jetson state."""
        with self._lock:
            out: dict[str, Any] = {
                "schema_version": SUMMARY_SCHEMA_VERSION,
                "device_id": self.device_id,
                "ts": round(time.time(), 3),
                "uptime_s": round(time.time() - self._started_s, 3),
                "requests": {k: v for k, v in self._codes.items() if v or k in RESULT_CODES},
                "requests_total": sum(self._codes.values()),
                "deadline_misses": self._deadline_misses,
                "budget_misses": self._budget_misses,
                "queue_depth": self._queue_depth,
                "operating_point": self._op_name,
                "ttft_ms": _percentiles(self._ttft_ms),
                "e2e_ms": _percentiles(self._e2e_ms),
                "decode_tokens_per_s": _percentiles(self._tps),
                "vision_encodes": self._vision_count,
                "vision_encode_s": round(self._vision_s, 6),
                "early_exits": dict(sorted(self._early_exits.items(), key=lambda kv: int(kv[0]))),
                "sources": {k: dict(v) for k, v in sorted(self._sources.items())},
            }
            sample, thermal = self.tegra_sample, self.thermal
        out["events"] = dict(sorted(self.events.snapshot().items()))
        if sample is not None:
            jetson = {
                "max_temp_c": sample.max_temp_c,
                "gpu_freq_mhz": sample.gpu_freq_mhz,
                "gpu_load_pct": sample.gpu_load_pct,
                "cpu_load_pct": None if sample.cpu_load_pct is None else round(sample.cpu_load_pct, 2),
                "ram_used_mb": sample.ram_used_mb,
                "ram_total_mb": sample.ram_total_mb,
                "total_power_mw": sample.total_power_mw,
                "sample_age_s": round(max(0.0, time.time() - sample.received_s), 3),
            }
            if thermal is not None:
                jetson["throttled"] = thermal.throttled
                jetson["throttle_reasons"] = list(thermal.reasons)
            out["jetson"] = {k: v for k, v in jetson.items() if v is not None}
        return out

    def summary_json(self) -> bytes:
        """:meth:`summary` as compact UTF-8 JSON (the MQTT payload)."""
        return json.dumps(self.summary(), separators=(",", ":"), allow_nan=False).encode()
