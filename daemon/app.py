"""The edgevlm daemon: camera sources + one inference worker + the MQTT v5 front end.

``edgevlm serve --config FILE`` calls :func:`run`, which blocks until SIGTERM/SIGINT. Start-up
order: sources (capture threads), the inference worker (loads the model; a failure exits 1),
then MQTT (the retained status says "online" only once requests can be served). Shutdown runs in
reverse: queued requests are answered ``BUSY`` ("shutting down"), the running one finishes, the
status says "offline", the broker connection closes, cameras are released.

Under systemd (``Type=notify``) the daemon sends ``READY=1`` once serving and ``STOPPING=1`` on
shutdown, and pings the watchdog while the inference worker is alive (``edgevlm.daemon.sdnotify``).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from edgevlm.config import DaemonConfig
from edgevlm.daemon.mqtt_bridge import MqttBridge
from edgevlm.daemon.scheduler import Counters, Scheduler
from edgevlm.daemon.sources import SourceManager
from edgevlm.errors import EdgeVLMError
from edgevlm.protocol import StatusMessage

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1

MODEL_LOAD_TIMEOUT_S = 600.0
MQTT_STOP_TIMEOUT_S = 5.0


def engine_loader(config: DaemonConfig) -> Callable[[], Any]:
    """A function that loads the configured engine (run on the inference worker's thread)."""

    def load() -> Any:
        from edgevlm.runtime import Engine

        m = config.model
        logger.info("loading model %s on %s (backend %s)", m.path or "<demo model>", m.device, m.backend)
        return Engine.load(m.path, device=m.device, dtype=m.dtype, backend=m.backend)

    return load


class Daemon:
    """The daemon's parts wired together; :meth:`start` / :meth:`stop` (see the module doc).

    Args:
        config: the validated configuration.
        engine: an already loaded :class:`edgevlm.runtime.Engine` handed to the inference worker
            (default: the worker loads ``config.model``).
    """

    def __init__(self, config: DaemonConfig, *, engine: Any = None) -> None:
        from edgevlm import __version__
        from edgevlm.daemon.sdnotify import Heartbeat, SystemdNotifier, Watchdog

        self.config = config
        self.counters = Counters()
        self.sources = SourceManager(config.sources)
        self.heartbeat = Heartbeat()
        self.scheduler = Scheduler(
            None if engine is not None else engine_loader(config),
            self.sources,
            queue_max_size=config.queue_max_size,
            defaults=config.defaults,
            counters=self.counters,
            engine=engine,
            heartbeat=self.heartbeat,
        )
        online = StatusMessage(
            state="online",
            device_id=config.mqtt.device_id,
            version=__version__,
            sources=self.sources.names,
            model=_model_name(config, engine),
        )
        self.bridge = MqttBridge(config.mqtt, self.scheduler, online, self.counters)
        self.notifier = SystemdNotifier()
        self.watchdog = Watchdog(self.notifier, self.heartbeat)
        self._started = False

    def start(self, *, load_timeout_s: float | None = MODEL_LOAD_TIMEOUT_S) -> None:
        """Start sources, load the model, connect to the broker (returns without waiting for the
        connection: paho retries until the broker is reachable).

        Raises:
            ModelLoadError: the model could not be loaded (everything started is stopped again).
        """
        self.sources.start()
        try:
            self.scheduler.start(load_timeout_s)
        except BaseException:
            self.scheduler.stop(timeout_s=1.0)
            self.sources.stop()
            raise
        self.bridge.start()
        self._started = True
        self.notifier.ready(f"serving {self.bridge.request_topic}")
        self.watchdog.start()

    def wait_ready(self, timeout_s: float | None) -> bool:
        """Wait until the broker connection is up and the request topic subscribed."""
        return self.bridge.wait_ready(timeout_s)

    def stop(self) -> None:
        """Shut down cleanly (idempotent)."""
        if not self._started:
            return
        self._started = False
        self.notifier.stopping("shutting down")
        self.watchdog.stop()
        self.scheduler.stop()
        self.bridge.stop(MQTT_STOP_TIMEOUT_S)
        self.sources.stop()
        self.notifier.close()
        logger.info("stopped; counters: %s", self.counters.snapshot())

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _model_name(config: DaemonConfig, engine: Any) -> str:
    model_dir = getattr(engine, "model_dir", None) if engine is not None else None
    if model_dir is not None:
        return str(model_dir)
    return str(config.model.path) if config.model.path is not None else "demo"


def _setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(config: DaemonConfig, *, stop_event: threading.Event | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT (or ``stop_event``, for embedding). Returns the exit
    status: 0 after a clean shutdown, 1 if start-up failed (e.g. the model does not load)."""
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
        try:
            daemon.start()
        except EdgeVLMError as err:
            logger.error("start-up failed: %s", err.message)
            return EXIT_STARTUP_FAILED
        logger.info(
            "serving %s (sources: %s)", daemon.bridge.request_topic, ", ".join(daemon.sources.names) or "none"
        )
        try:
            while not stop.wait(1.0):
                pass
        finally:
            daemon.stop()
        return EXIT_OK
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
