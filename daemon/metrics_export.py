"""The exporters of :class:`~edgevlm.daemon.metrics.Metrics` besides its own registry metrics.

:class:`_JetsonCollector` turns the newest tegrastats sample into ``edgevlm_jetson_*`` gauges at
scrape time; :class:`TelemetryPublisher` publishes the JSON summary
(:meth:`~edgevlm.daemon.metrics.Metrics.summary_json`) every few seconds over MQTT.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgevlm.daemon.metrics import Metrics

logger = logging.getLogger(__name__)


class _EventsCollector:
    """Exports the daemon's named event counts (:class:`~edgevlm.daemon.metrics_common.EventCounters`)
    at scrape time as ``edgevlm_events_total{event}``."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> Iterator[Any]:
        return iter(())  # dynamic label values: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("edgevlm_events", "Daemon events by name (requests received, errors by "
                                     "code, MQTT connects, duplicates, batch joins, ...).", labels=["event"])
        for name, value in sorted(self.m.events.snapshot().items()):
            family.add_metric([name], value)
        yield family


class _JetsonCollector:
    """Exports the newest tegrastats sample at scrape time; absent fields are simply not exported."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> Iterator[Any]:
        return iter(())  # dynamic: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        sample, thermal = self.m.tegra_sample, self.m.thermal
        if sample is None:
            return
        p = "edgevlm_jetson_"

        def gauge(name: str, doc: str, value: float | None, scale: float = 1.0) -> Iterator[Any]:
            if value is not None:
                yield GaugeMetricFamily(p + name, doc, value=value * scale)

        mb = 1024 * 1024
        yield from gauge("ram_used_bytes", "RAM in use.", sample.ram_used_mb, mb)
        yield from gauge("ram_total_bytes", "RAM available to applications.", sample.ram_total_mb, mb)
        yield from gauge("swap_used_bytes", "Swap in use.", sample.swap_used_mb, mb)
        yield from gauge("swap_total_bytes", "Swap size.", sample.swap_total_mb, mb)
        yield from gauge("gpu_load_ratio", "iGPU (GR3D) load.", sample.gpu_load_pct, 0.01)
        yield from gauge("gpu_freq_hertz", "iGPU clock.", sample.gpu_freq_mhz, 1e6)
        yield from gauge("emc_load_ratio", "Memory controller load.", sample.emc_load_pct, 0.01)
        yield from gauge("emc_freq_hertz", "Memory controller clock.", sample.emc_freq_mhz, 1e6)
        yield from gauge("max_temperature_celsius", "Hottest sensor.", sample.max_temp_c)
        yield from gauge("total_power_watts", "Module input power.", sample.total_power_mw, 1e-3)
        yield from gauge(
            "sample_age_seconds", "Age of the tegrastats sample.", max(0.0, time.time() - sample.received_s)
        )
        if sample.cpu:
            load = GaugeMetricFamily(p + "cpu_load_ratio", "CPU core load (online cores).", labels=["core"])
            freq = GaugeMetricFamily(p + "cpu_freq_hertz", "CPU core clock (online cores).", labels=["core"])
            online = GaugeMetricFamily(p + "cpu_online", "CPU core online (1) or off (0).", labels=["core"])
            for c in sample.cpu:
                online.add_metric([str(c.index)], 1.0 if c.online else 0.0)
                if c.load_pct is not None:
                    load.add_metric([str(c.index)], c.load_pct / 100)
                if c.freq_mhz is not None:
                    freq.add_metric([str(c.index)], c.freq_mhz * 1e6)
            yield from (load, freq, online)
        if sample.temps_c:
            temps = GaugeMetricFamily(p + "temperature_celsius", "Thermal sensor.", labels=["sensor"])
            for name, value in sorted(sample.temps_c.items()):
                temps.add_metric([name], value)
            yield temps
        if sample.rails:
            now = GaugeMetricFamily(p + "power_watts", "Power rail, instantaneous.", labels=["rail"])
            avg = GaugeMetricFamily(p + "power_avg_watts", "Power rail, average.", labels=["rail"])
            for rail in sample.rails.values():
                now.add_metric([rail.name], rail.power_mw / 1000)
                avg.add_metric([rail.name], rail.avg_power_mw / 1000)
            yield from (now, avg)
        if thermal is not None:
            yield from gauge("throttled", "1 while throttling is detected.", float(thermal.throttled))
            yield from gauge("gpu_clock_ratio", "GPU clock / reference clock.", thermal.gpu_clock_ratio)


class TelemetryPublisher:
    """Calls ``publish(payload_bytes)`` with :meth:`Metrics.summary_json` every ``interval_s`` in a
    daemon thread (the MQTT bridge publishes it on :func:`telemetry_topic`). ``refresh()``, when
    given, runs first on each turn (e.g. to copy the sources' fps/state and the queue depth into
    the metrics). A failing refresh or publish is logged and retried at the next interval.

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(
        self,
        metrics: Metrics,
        publish: Callable[[bytes], Any],
        interval_s: float = 10.0,
        *,
        refresh: Callable[[], Any] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.metrics, self.publish, self.interval_s, self.refresh = metrics, publish, interval_s, refresh
        self.published = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish_now(self) -> bool:
        """Refresh and publish one summary now. Returns whether the publish succeeded."""
        if self.refresh is not None:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - stale values are better than no telemetry
                logger.warning("telemetry refresh failed", exc_info=True)
        try:
            self.publish(self.metrics.summary_json())
        except Exception:  # noqa: BLE001 - the broker may be down; try again next time
            logger.warning("telemetry publish failed", exc_info=True)
            return False
        self.published += 1
        return True

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish_now()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
