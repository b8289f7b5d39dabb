"""The edgevlm daemon: camera sources + one inference worker + the MQTT v5 front end.

``edgevlm serve --config FILE`` calls :func:`run`, which blocks until SIGTERM/SIGINT. Start-up
order: sources (capture threads), the inference worker (loads the model; a failure makes
:func:`run` return 1, or raise for ``edgevlm serve``, which exits 2 with one error line),
then MQTT (the retained status says "online" only once requests can be served), then metrics,
telemetry and Jetson telemetry. Shutdown runs in reverse: new requests are answered ``BUSY``,
queued ones ``BUSY`` ("shutting down"), the running one may finish within
``service.shutdown_timeout_s`` (else it is answered ``BUSY`` too), the status says "offline", the
broker connection closes, cameras are released, and :func:`run` returns 0.

Under systemd (``Type=notify``, :mod:`edgevlm.daemon.sdnotify`): ``STATUS=`` lines for each phase,
``READY=1`` once the engine is loaded *and* the request topic is subscribed on the broker,
``WATCHDOG=1`` at half of ``WatchdogSec=`` while the inference worker's heartbeat is alive (a
request running longer than ``service.worker_busy_timeout_s`` stops the pings, so systemd
restarts a hung daemon), ``RELOADING=1`` on SIGHUP, ``STOPPING=1`` on shutdown.

Telemetry: Prometheus metrics on ``metrics.listen``; the JSON summary on
``<prefix>/<device_id>/telemetry`` every ``telemetry.interval_s``; tegrastats samples feed the
metrics and, through :class:`~edgevlm.daemon.tegrastats.ThrottleDetector`, a slowdown hint for
the latency controller (``hint_slowdown``) when the scheduler has one. Each camera's state is
published retained on ``<prefix>/<device_id>/sources/<name>``.

With ``mqtt.front_processes: N`` (N >= 1; 0 is all of the above in one process; the default ``auto`` is
up to 4 for a CUDA model with continuous batching, else 0: :func:`front_process_count`), N front
processes (:mod:`edgevlm.daemon.front`, started and restarted by :mod:`edgevlm.daemon.fronts`) take the
request topics through an MQTT v5 shared subscription, validate the requests and decode their images,
and publish the answers; this process keeps its own connection for the status, the retained state,
telemetry, reload results and audio, and READY waits for every front's subscription too. Shutdown
stops the fronts after the scheduler (each answers what it still holds ``BUSY``).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from edgevlm.config import DaemonConfig
from edgevlm.daemon.metrics_common import EventCounters
from edgevlm.daemon.mqtt_bridge import MqttBridge
from edgevlm.daemon.scheduler import Scheduler, StartupCancelled, default_prepare_threads
from edgevlm.daemon.sources import FrameSource, SourceManager
from edgevlm.errors import EdgeVLMError, shutting_down_error
from edgevlm.protocol import (
    StatusMessage,
    audio_request_topic,
    audio_topic,
    deadline_s,
    reload_topic,
    source_topic,
    telemetry_topic,
)

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1

MODEL_LOAD_TIMEOUT_S = 600.0
MQTT_STOP_TIMEOUT_S = 5.0
MAX_BUSY_TIMEOUT_S = 3600.0
CUDA_HOST_THREADS = 1
"""torch intra-op threads of a daemon whose model runs on CUDA (``model.cpu_threads`` unset): its
host-side tensor ops are small (concatenating a group's pixels, token ids), and torch's default pool
of one thread per core makes each of them wait for threads that the prepare threads, the broker and
the clients keep busy (this 2-core machine, loaded: ``torch.cat`` of one 384x288 image 0.25 ms with
1 thread, 8 ms with 2; that concatenation was 33 % of the H200 worker, see
bench/results/daemon_throughput_h200_20261201.md)."""


def host_threads(config: DaemonConfig) -> int | None:
    """torch intra-op threads the engine loader sets: ``model.cpu_threads``, else
    :data:`CUDA_HOST_THREADS` for a CUDA model, else None (torch's default, one per core)."""
    m = config.model
    if m.cpu_threads is not None:
        return m.cpu_threads
    return CUDA_HOST_THREADS if m.device.startswith("cuda") else None


def load_engine(config: DaemonConfig, path: Path | None) -> Any:
    """Load the engine at ``path`` (None = the demo model) as ``config`` says: ``model.device``,
    ``dtype``, ``backend``, the host threads, the backend options (the profile's for a CUDA model,
    then ``model.max_batch_size``) and the vision cache (``model.vision_cache_mb``). The one rule
    for the engine at start-up and at a hot reload.

    Raises:
        ModelLoadError: the model cannot be loaded (see :meth:`edgevlm.runtime.Engine.load`).
    """
    from edgevlm.runtime import Engine

    m = config.model
    logger.info("loading model %s on %s (backend %s)", path or "<demo model>", m.device, m.backend)
    threads = host_threads(config)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    options = {}
    if config.profile is not None and m.device.startswith("cuda"):
        from edgevlm.profile import load_profile

        options = load_profile(config.profile).backend_options(m.backend, m.device)
        logger.info("profile %s: backend options %s", config.profile, options)
    if m.max_batch_size is not None:  # the config overrides the profile (torch only: checked by the schema)
        options["max_batch_size"] = m.max_batch_size
    engine = Engine.load(path, device=m.device, dtype=m.dtype, backend=m.backend, backend_options=options,
                         vision_cache_mb=m.vision_cache_mb or None)
    if engine.vision_cache is not None:
        logger.info("vision cache: %g MiB (questions about one frame share its vision tokens, or with an "
                    "exit_threshold its encoder walk; not with continuous batching)", m.vision_cache_mb)
    return engine


def engine_loader(config: DaemonConfig) -> Callable[[], Any]:
    """A function that loads the configured engine (run on the inference worker's thread)."""
    return lambda: load_engine(config, config.model.path)


def batching_settings(config: DaemonConfig) -> tuple[bool, int]:
    """``(continuous_batching, prefill_token_budget)`` of the inference worker: ``model.*`` when set,
    else the profile's ``runtime.*`` for a CUDA model with a profile, else off and 1024 tokens."""
    from edgevlm.profile import RuntimeConfig, load_profile

    m = config.model
    runtime = RuntimeConfig()
    if config.profile is not None and m.device.startswith("cuda"):
        prof = load_profile(config.profile)
        if prof.device == "cuda":
            runtime = prof.runtime
    enabled = m.continuous_batching if m.continuous_batching is not None else runtime.continuous_batching
    if m.backend != "torch":
        enabled = False
    budget = m.prefill_token_budget if m.prefill_token_budget is not None else runtime.prefill_token_budget
    return enabled, budget


FRONT_CPUS = 4
"""``mqtt.front_processes: auto`` starts one front process per this many host CPUs."""
MAX_AUTO_FRONTS = 4
"""The most front processes ``auto`` starts (4 served 819 answers/s at 32 clients on the H200, 2 served
715: ``bench/results/daemon_throughput_h200_20261202.md``)."""


def front_process_count(config: DaemonConfig, host_cpus: int | None = None) -> tuple[int, str]:
    """``mqtt.front_processes`` resolved: ``(count, why)``.

    A configured count is used as is. ``auto`` gives a CUDA model with continuous batching (what the
    cloud profiles turn on: a GPU daemon one Python process holds back) ``min(4, host_cpus // 4)``
    fronts, and 0 to everything else: a CPU or Jetson model (no batching; its cores run the model), a
    non-torch backend, or a daemon with ``offload.pool`` (which forwards image files, not pixels).

    Args:
        config: the validated daemon configuration.
        host_cpus: CPUs this process may run on (default: ``os.sched_getaffinity``, else ``os.cpu_count``).
    """
    import os

    asked = config.mqtt.front_processes
    if asked != "auto":
        return asked, "mqtt.front_processes"
    if config.offload.pool is not None:
        return 0, "auto: offload.pool is set"
    if not (config.model.device.startswith("cuda") and batching_settings(config)[0]):
        return 0, "auto: not a CUDA model with continuous batching"
    if host_cpus is None:
        try:
            host_cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            host_cpus = os.cpu_count() or 1
    count = min(MAX_AUTO_FRONTS, host_cpus // FRONT_CPUS)
    return count, f"auto: a CUDA model with continuous batching, {host_cpus} host CPUs"


def worker_busy_timeout_s(config: DaemonConfig) -> float:
    """How long one request may run before the worker counts as hung: the configured value, else
    twice the default request deadline plus 60 s, at most an hour."""
    if config.service.worker_busy_timeout_s is not None:
        return config.service.worker_busy_timeout_s
    after_s = deadline_s(config.defaults.timeout_ms)
    if after_s is None:
        return MAX_BUSY_TIMEOUT_S
    return min(MAX_BUSY_TIMEOUT_S, 2 * after_s + 60.0)


class Daemon:
    """The daemon's parts wired together; :meth:`start` / :meth:`stop` (see the module doc).

    Args:
        config: the validated configuration.
        engine: an already loaded :class:`edgevlm.runtime.Engine` handed to the inference worker
            (default: the worker loads ``config.model``).
        notify_socket: systemd notify socket (default ``$NOTIFY_SOCKET``; ``""`` = off).
    """

    def __init__(self, config: DaemonConfig, *, engine: Any = None, notify_socket: str | None = None) -> None:
        from edgevlm import __version__
        from edgevlm.daemon.sdnotify import Heartbeat, SystemdNotifier, Watchdog

        self.config = config
        self.version = __version__
        self.notifier = SystemdNotifier(notify_socket)
        self.heartbeat = Heartbeat(
            idle_timeout_s=config.service.worker_idle_timeout_s, busy_timeout_s=worker_busy_timeout_s(config)
        )
        self.metrics = self._make_metrics()
        # the daemon's event counts: with metrics, the same counters Prometheus exports
        self.counters = self.metrics.events if self.metrics is not None else EventCounters()
        self.sources = SourceManager(config.sources, listener=self._on_source_state)
        batching = batching_settings(config)
        self.front_count, front_why = front_process_count(config)
        if config.mqtt.front_processes == "auto":
            logger.info("mqtt.front_processes: %d (%s)", self.front_count, front_why)
        self.scheduler = Scheduler(
            None if engine is not None else engine_loader(config),
            self.sources,
            queue_max_size=config.queue_max_size,
            defaults=config.defaults,
            counters=self.counters,
            engine=engine,
            heartbeat=self.heartbeat,
            controller_factory=self._make_controller,
            monitors=self._make_monitors(),
            continuous_batching=batching[0],
            prefill_token_budget=batching[1],
            # a CPU model's compute takes the cores: preparing images beside it only competes with it
            prepare_threads=default_prepare_threads() if config.model.device.startswith("cuda") else 0,
        )
        online = StatusMessage(
            state="online",
            device_id=config.mqtt.device_id,
            version=__version__,
            sources=self.sources.names,
            model=_model_name(config, engine),
            model_id=served_model_id(config, engine),
            pool=config.mqtt.pool,
            **({"audio": [a.name for a in config.audio]} if config.audio else {}),
        )
        self.bridge = MqttBridge(
            config.mqtt,
            self.scheduler,
            online,
            self.counters,
            limits=config.limits,
            metrics=self.metrics,
            on_ready=self._on_broker_ready,
            on_connection=self._on_connection,
            serve_requests=self.front_count == 0,  # else the front processes take the requests
        )
        self.fronts = self._make_fronts()
        self.http = self._make_http(engine)
        self.scheduler.model_id = served_model_id(config, engine)
        self.offload = self._make_offload()
        self.scheduler.offloader = self.offload
        self.telemetry_topic = telemetry_topic(config.mqtt.prefix, config.mqtt.device_id)
        self.telemetry = self._make_telemetry()
        self.throttle, self.tegrastats = self._make_tegrastats()
        self.audio = self._make_audio()
        self.reload = self._make_reload(engine)
        self.watchdog = Watchdog(self.notifier, self.heartbeat)
        self.thermal: Any = None
        self.ready_sent = threading.Event()
        self._started = False

    # ------------------------------------------------------------------ parts
    def _make_controller(self, engine: Any) -> Any:
        """The latency controller for the loaded engine (``edgevlm.daemon.budget``); on the worker."""
        from edgevlm.daemon.batching import batch_rows
        from edgevlm.daemon.budget import build_controller

        batched = batching_settings(self.config)[0] and batch_rows(engine) >= 2
        return build_controller(self.config, engine, batched=batched)

    def _make_fronts(self) -> Any:
        """The MQTT front processes (``edgevlm.daemon.fronts``), when :func:`front_process_count` >= 1."""
        if not self.front_count:
            return None
        from edgevlm.daemon.fronts import FrontProcesses

        return FrontProcesses(self.config, self.front_count, self.scheduler, self.counters, self.metrics,
                              on_ready=self._on_broker_ready, on_connection=self._on_connection)

    def _make_http(self, engine: Any) -> Any:
        """The OpenAI-compatible HTTP API (``edgevlm.daemon.openai_api``), when ``http.enabled``."""
        if not self.config.http.enabled:
            return None
        from edgevlm.daemon.openai_api import OpenAIServer

        return OpenAIServer(self.config.http, self.scheduler, self.config, model_id=served_model_id(self.config, engine),
                            metrics=self.metrics)

    def _make_offload(self) -> Any:
        """Edge-to-pool offload (``edgevlm.daemon.offload``), when ``offload.pool`` is set."""
        if self.config.offload.pool is None:
            return None
        from edgevlm.daemon.offload import Offloader

        return Offloader(self.config, self.sources, self.counters)

    def _make_monitors(self) -> Any:
        """The label monitors (``edgevlm.daemon.monitors``), publishing through the bridge."""
        if not self.config.monitors:
            return None
        from edgevlm.daemon.monitors import MonitorRunner

        return MonitorRunner(self.config.monitors, self.sources, lambda t, p: self.bridge.publish_safe(t, p),
                             prefix=self.config.mqtt.prefix, device_id=self.config.mqtt.device_id)

    def _make_audio(self) -> Any:
        """Microphones and WAV sources (``edgevlm.daemon.audio``) with their MQTT topics. Without any, the
        features topic is still served: a request there is answered ``UNKNOWN_SOURCE`` (none configured),
        not left unanswered."""
        from edgevlm.daemon.audio import AudioManager, make_features_handler

        manager = AudioManager(self.config.audio, listener=self._on_audio_event)
        mqtt = self.config.mqtt
        self.bridge.add_handler(audio_request_topic(mqtt.prefix, mqtt.device_id),
                                make_features_handler(manager, self.bridge))
        return manager

    def _make_reload(self, engine: Any) -> Any:
        """Hot reload (SIGHUP or ``reload.watch_dir``), publishing on ``<prefix>/<device_id>/reload``."""
        from edgevlm.daemon.reload import ReloadManager

        current = getattr(engine, "model_dir", None) if engine is not None else self.config.model.path
        return ReloadManager(
            self.config,
            self.scheduler,
            current_path=Path(current) if current is not None else None,
            loader=lambda path: load_engine(self.config, path),  # the start-up options (rows, profile)
            publish=self._on_reload,
            controller_factory=self._make_controller,
            notifier=self.notifier,
        )

    def _on_reload(self, result: Any) -> None:
        payload = json.dumps(result.as_dict(), separators=(",", ":")).encode()
        self.bridge.publish_safe(reload_topic(self.config.mqtt.prefix, self.config.mqtt.device_id), payload,
                                 retain=True)
        if result.ok:
            # the served id follows the new model (unless http.model_name pins it): the wire's and the
            # HTTP API's `model` name what now answers (the status says so to the pool's other members)
            model_id = served_model_id(self.config, self.scheduler.engine)
            self.bridge.update_online(model=result.path, model_id=model_id)
            self.scheduler.model_id = model_id
            if self.http is not None:
                self.http.model_id = model_id

    def _on_audio_event(self, src: Any, event: dict[str, Any]) -> None:
        mqtt = self.config.mqtt
        payload = json.dumps({"schema_version": 1, "source": src.name, **event}, separators=(",", ":")).encode()
        if event.get("type") == "state":
            self.bridge.publish_safe(audio_topic(mqtt.prefix, mqtt.device_id, src.name, "state"), payload, retain=True)
        else:
            try:
                self.bridge.publish(audio_topic(mqtt.prefix, mqtt.device_id, src.name, "events"), payload, qos=0)
            except EdgeVLMError as err:
                logger.debug("audio event not published: %s", err.message)

    def _make_metrics(self) -> Any:
        try:
            from edgevlm.daemon.metrics import Metrics

            return Metrics(device_id=self.config.mqtt.device_id, version=self.version, pool=self.config.mqtt.pool)
        except ImportError as exc:
            logger.warning("metrics disabled: %s", exc)
            return None

    def _make_telemetry(self) -> Any:
        interval = self.config.telemetry.interval_s
        if self.metrics is None or interval is None:
            return None
        from edgevlm.daemon.metrics import TelemetryPublisher

        return TelemetryPublisher(
            self.metrics,
            lambda payload: self.bridge.publish(self.telemetry_topic, payload, qos=0),
            interval,
            refresh=self.refresh_metrics,
        )

    def _make_tegrastats(self) -> tuple[Any, Any]:
        cfg = self.config.tegrastats
        if not cfg.enabled:
            return None, None
        from edgevlm.daemon.tegrastats import TegrastatsReader, ThrottleDetector

        detector = ThrottleDetector(temp_limit_c=cfg.temp_limit_c, reference_gpu_freq_mhz=cfg.reference_gpu_freq_mhz)
        reader = TegrastatsReader(
            interval_ms=cfg.interval_ms, binary=cfg.binary, log_path=cfg.log_path, on_sample=self._on_tegra_sample
        )
        return detector, reader

    # ------------------------------------------------------------------ callbacks
    def _on_broker_ready(self) -> None:
        """The daemon's connection is subscribed, or (with front processes) every front is: READY
        once both hold."""
        if self.fronts is not None and not (self.fronts.ready() and self.bridge.wait_ready(0)):
            return
        status = f"serving {self.bridge.request_topic} on {self.config.mqtt.host}:{self.config.mqtt.port}"
        if self.fronts is not None:
            status += f" through {self.fronts.count} front process(es)"
        if not self.ready_sent.is_set():
            self.ready_sent.set()
            self.notifier.ready(status)
            logger.info("ready: %s", status)
        else:
            self.notifier.status(status)

    def _on_connection(self, up: bool, reason: str) -> None:
        if not up:
            self.notifier.status(f"broker connection lost ({reason}); reconnecting")

    def _on_source_state(self, src: FrameSource, info: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.observe_source(src.name, fps=info.get("fps"), state=info["state"],
                                        frame_age_s=info.get("frame_age_s"))  # fmt: skip
            if info.get("event") == "reconnecting":
                self.metrics.source_reconnect(src.name)
        payload = json.dumps({"schema_version": 1, **info}, separators=(",", ":")).encode()
        topic = source_topic(self.config.mqtt.prefix, self.config.mqtt.device_id, src.name)
        self.bridge.publish_safe(topic, payload, retain=True)

    def _on_tegra_sample(self, sample: Any) -> None:
        thermal = self.throttle.update(sample)
        previous, self.thermal = self.thermal, thermal
        if self.metrics is not None:
            self.metrics.observe_tegrastats(sample, thermal)
        if thermal.throttled and (previous is None or not previous.throttled):
            logger.warning("thermal throttling: %s", "; ".join(thermal.reasons))
        elif previous is not None and previous.throttled and not thermal.throttled:
            logger.info("thermal throttling over")
        controller = getattr(self.scheduler, "controller", None)
        hint = getattr(controller, "hint_slowdown", None)
        if hint is not None:
            hint(thermal.slowdown_hint)

    def refresh_metrics(self) -> None:
        """Copy the queue depth and every source's fps/state/frame age into the metrics."""
        if self.metrics is None:
            return
        self.metrics.set_queue_depth(self.scheduler.queue_size())
        for name, info in self.sources.infos().items():
            self.metrics.observe_source(name, fps=info["fps"], state=info["state"], frame_age_s=info["frame_age_s"])

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, load_timeout_s: float | None = MODEL_LOAD_TIMEOUT_S,
              cancel: threading.Event | None = None) -> None:
        """Start sources, load the model, connect to the broker (returns without waiting for the
        connection: paho retries until the broker is reachable; ``READY=1`` follows it).

        ``cancel``: a stop signal's event; set before the broker connection is made (while the model
        loads, typically), the start-up ends with :class:`~edgevlm.daemon.scheduler.StartupCancelled`
        within 0.1 s and announces nothing (no ``READY=1``, no retained ``online``).

        Raises:
            ModelLoadError: the model could not be loaded (everything started is stopped again).
            ConfigError: the loaded model cannot serve a config key, e.g. a monitor's label (the same).
            StartupCancelled: ``cancel`` was set (everything started is stopped again).
            OSError, ValueError: paho refused the broker connection's set-up (a TLS file it cannot
                read; everything started, the front processes included, is stopped again).
        """
        self.notifier.status("starting camera sources")
        self.sources.start()
        if self.audio is not None:
            self.audio.start()
        self.notifier.status(f"loading model {_model_name(self.config, self.scheduler.engine)}")
        try:
            self.scheduler.start(load_timeout_s, cancel)
            if cancel is not None and cancel.is_set():  # came as the load finished
                raise StartupCancelled("stopped while the model loaded")
        except BaseException:
            self.scheduler.stop(timeout_s=1.0)
            self.sources.stop()
            if self.audio is not None:
                self.audio.stop()
            raise
        self.heartbeat.beat()
        self.notifier.status(f"model loaded; connecting to the broker at {self.config.mqtt.host}:{self.config.mqtt.port}")
        try:
            if self.fronts is not None:
                self.fronts.start()
            self.bridge.start()  # raises on what paho refuses at set-up (a TLS file it cannot read)
        except BaseException:
            if self.fronts is not None:
                self.fronts.stop()  # else they, and their supervisor restarting them, outlive the failed start
            self.scheduler.stop(timeout_s=1.0)
            self.sources.stop()
            if self.audio is not None:
                self.audio.stop()
            raise
        self._started = True
        self.watchdog.start()
        if self.metrics is not None and self.config.metrics.listen is not None:
            self._start_metrics(self.config.metrics.listen)
        if self.http is not None:
            self._start_http()
        if self.offload is not None:
            self.offload.start()
        if self.telemetry is not None:
            self.telemetry.start()
        if self.tegrastats is not None:
            self.tegrastats.start()
        self.reload.start()

    def _start_http(self) -> None:
        """Serve the HTTP API; an address that cannot be bound is one ERROR naming the config keys:
        the daemon serves MQTT without it."""
        try:
            self.http.start()
        except OSError as exc:
            logger.error("http: cannot listen on %s port %d (%s); the HTTP API is off, MQTT is served as usual "
                         "(set http.host/http.port to a free address)", self.config.http.host, self.config.http.port,
                         exc.strerror or exc)
            self.http = None

    def _start_metrics(self, listen: str) -> None:
        """Serve ``/metrics`` on ``listen``; an address that cannot be bound (the port in use,
        no permission) is one WARNING naming the config key and the port: the daemon serves
        MQTT without the Prometheus endpoint."""
        try:
            self.metrics.start(listen, raise_errors=True)
        except OSError as exc:
            from edgevlm.daemon.metrics import parse_listen_address

            host, port = parse_listen_address(listen)
            logger.warning(
                "metrics.listen: cannot listen on %s port %d (%s); the Prometheus endpoint is off, MQTT is "
                "served as usual (set metrics.listen to a free port, or null)",
                host, port, exc.strerror or exc,
            )

    def wait_ready(self, timeout_s: float | None) -> bool:
        """Wait until the broker connection is up and the request topic subscribed (with front
        processes: by every front)."""
        import time

        until = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.bridge.wait_ready(timeout_s):
            return False
        if self.fronts is None:
            return True
        return self.fronts.wait_ready(None if until is None else max(0.0, until - time.monotonic()))

    def stop(self) -> None:
        """Shut down cleanly within ``service.shutdown_timeout_s`` (+ the MQTT goodbye); idempotent."""
        if not self._started:
            return
        self._started = False
        bound_s = self.config.service.shutdown_timeout_s
        self.notifier.stopping("shutting down")
        self.bridge.stop_accepting()
        if self.fronts is not None:
            self.fronts.stop_accepting()
        if self.http is not None:
            self.http.stop_accepting()
        self.reload.stop()
        if self.tegrastats is not None:
            self.tegrastats.stop()
        if self.telemetry is not None:
            self.telemetry.stop()
        self.watchdog.stop()
        self.scheduler.stop(timeout_s=bound_s)
        unfinished = shutting_down_error(
            f"the daemon is shutting down; the request did not finish within {bound_s} s")
        failed = self.bridge.fail_outstanding(unfinished)
        if self.http is not None:
            failed += self.http.fail_outstanding(unfinished)
        if self.fronts is not None:
            failed += self.fronts.fail_outstanding(unfinished)
            self.fronts.stop()
        if failed:
            logger.warning("shutdown: %d request(s) in flight answered BUSY", failed)
        if self.http is not None:
            self.http.stop()
        if self.offload is not None:
            self.offload.stop()
        self.bridge.stop(MQTT_STOP_TIMEOUT_S)
        self.sources.stop()
        if self.audio is not None:
            self.audio.stop()
        if self.metrics is not None:
            self.metrics.stop()
        self.notifier.close()
        logger.info("stopped; counters: %s", self.counters.snapshot())

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def served_model_id(config: DaemonConfig, engine: Any = None) -> str:
    """The id of the model served, one rule for every front end (the HTTP API's ``model``, the wire
    request's ``model``, Ray Serve): ``http.model_name`` when set, else the model folder's name,
    ``edgevlm-demo`` for the shipped demo model."""
    from pathlib import Path

    from edgevlm.runtime.demo import model_dir as demo_model_dir

    if config.http.model_name:
        return config.http.model_name
    path = getattr(engine, "model_dir", None) or config.model.path
    if path is None or Path(path).resolve() == demo_model_dir().resolve():
        return "edgevlm-demo"
    return Path(path).name


def _model_name(config: DaemonConfig, engine: Any) -> str:
    model_dir = getattr(engine, "model_dir", None) if engine is not None else None
    if model_dir is not None:
        return str(model_dir)
    return str(config.model.path) if config.model.path is not None else "demo"


def _setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(
    config: DaemonConfig, *, stop_event: threading.Event | None = None, raise_startup_errors: bool = False
) -> int:
    """Run the daemon until SIGTERM/SIGINT (or ``stop_event``, for embedding).

    Args:
        config: the validated configuration.
        stop_event: set it to stop the daemon (default: only the signals stop it).
        raise_startup_errors: raise a start-up failure instead of logging it and returning 1
            (``edgevlm serve`` does, to print it as its one-line error, exit status 2).

    Returns:
        The exit status: 0 after a clean shutdown, 1 if start-up failed (e.g. the model does not
        load) and ``raise_startup_errors`` is false.

    Raises:
        EdgeVLMError: with ``raise_startup_errors``, the start-up failure (e.g. ModelLoadError).
    """
    _setup_logging(config.log_level)
    stop = stop_event or threading.Event()
    previous: dict[int, Any] = {}

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        daemon = Daemon(config)
        if threading.current_thread() is threading.main_thread():

            def _on_hup(signum: int, frame: FrameType | None) -> None:
                logger.info("received SIGHUP; reloading the engine")
                daemon.reload.request("SIGHUP")

            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _on_hup)
        try:
            daemon.start(cancel=stop)
        except StartupCancelled:
            daemon.notifier.stopping("stopped during start-up")
            logger.info("stopped during start-up, before the broker connection")
            return EXIT_OK
        except EdgeVLMError as err:
            daemon.notifier.status(f"start-up failed: {err.message}")
            if raise_startup_errors:
                raise
            logger.error("start-up failed: %s", err.message)
            return EXIT_STARTUP_FAILED
        logger.info("started: requests on %s (sources: %s); the 'ready' line says when the broker has the subscription",
                    daemon.bridge.request_topic, ", ".join(daemon.sources.names) or "none")  # fmt: skip
        try:
            while not stop.wait(1.0):
                pass
        finally:
            daemon.stop()
        return EXIT_OK
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
