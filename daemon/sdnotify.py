"""systemd service notifications (``sd_notify``) and a liveness-gated watchdog.

The protocol (systemd ``sd_notify(3)``, "Notify socket" in ``systemd.exec(5)``): the service
manager passes the path of a ``AF_UNIX``/``SOCK_DGRAM`` socket in ``$NOTIFY_SOCKET``; the service
sends newline-separated ``KEY=VALUE`` assignments as one datagram. A path starting with ``@`` names
a socket in the Linux abstract namespace (the ``@`` becomes a NUL byte). When ``$NOTIFY_SOCKET``
is unset (not started by systemd, or ``Type=`` is not ``notify``) every call is a no-op.

The watchdog (``WatchdogSec=`` in the unit, ``$WATCHDOG_USEC``/``$WATCHDOG_PID`` in the
environment) expects ``WATCHDOG=1`` at least once per period; :class:`Watchdog` pings at half the
period, and only while a liveness check holds, so a hung inference worker stops the pings and
systemd restarts the service (``Restart=on-failure``). :class:`Heartbeat` is such a check for a
worker loop.

Nothing here raises on a missing or dead socket: the daemon must keep serving; a failed send is
logged once and reported as ``False``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping

logger = logging.getLogger(__name__)

__all__ = ["Heartbeat", "SystemdNotifier", "Watchdog", "watchdog_period_s"]


def _socket_address(value: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` -> an address for ``socket.sendto`` (abstract names as bytes with a NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def _clean(value: str) -> str:
    # One assignment per line: a newline inside a value would start a bogus assignment.
    return " ".join(str(value).splitlines()).strip()


class SystemdNotifier:
    """Sends state changes to the service manager.

    Args:
        socket_path: the notify socket; ``None`` reads ``$NOTIFY_SOCKET`` from ``env``.
            ``""`` disables notifications.
        env: environment to read (default ``os.environ``).

    Every method returns ``True`` when the datagram was sent, ``False`` when notifications are off
    or the send failed (logged once per kind of failure; never raises ``OSError``).
    """

    def __init__(self, socket_path: str | None = None, *, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "") if socket_path is None else socket_path
        self.socket_path = path
        self._address = _socket_address(path) if path else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failures_logged: set[int] = set()

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured."""
        return self._address is not None

    def notify(self, *assignments: str, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram, e.g. ``notify("READY=1", STATUS="up")``."""
        if self._address is None:
            return False
        lines = [_clean(a) for a in assignments]
        lines += [f"{key}={_clean(str(val))}" for key, val in fields.items()]
        payload = "\n".join(line for line in lines if line).encode()
        if not payload:
            return False
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(payload, self._address)
            except OSError as exc:
                if exc.errno not in self._failures_logged:
                    self._failures_logged.add(exc.errno)
                    logger.warning("sd_notify to %s failed: %s", self.socket_path, exc)
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up finished (engine loaded, broker connected)."""
        return self.notify("READY=1", **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        """``STATUS=...``: a one-line human-readable state shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: shutdown has begun."""
        return self.notify("STOPPING=1", **({"STATUS": status} if status else {}))

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``: a reload (SIGHUP) has begun; send :meth:`ready`
        when it is done."""
        fields: dict[str, str | int] = {"MONOTONIC_USEC": time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}
        if status:
            fields["STATUS"] = status
        return self.notify("RELOADING=1", **fields)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: keep-alive ping."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC=``: ask for more time to start/stop (a slow engine load)."""
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def watchdog_period_s(env: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """The watchdog period in seconds from ``$WATCHDOG_USEC``, or ``None`` when no watchdog applies.

    ``None`` also when ``$WATCHDOG_PID`` names another process (the variables were inherited) or
    the value is not a positive integer (logged).
    """
    env = os.environ if env is None else env
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner:
        try:
            if int(owner) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            logger.warning("ignoring WATCHDOG_PID=%r: not an integer", owner)
            return None
    try:
        usec = int(raw)
    except ValueError:
        logger.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    if usec <= 0:
        logger.warning("ignoring WATCHDOG_USEC=%r: not positive", raw)
        return None
    return usec / 1e6


class Heartbeat:
    """Liveness of a worker loop, usable as a :class:`Watchdog` check.

    The worker calls :meth:`beat` on every turn of its loop (also when idle, e.g. after a
    ``queue.get(timeout=...)`` that timed out) and wraps each inference in :meth:`busy`. The worker
    counts as alive while its last beat is younger than ``idle_timeout_s``, or, during a request,
    while that request has run for less than ``busy_timeout_s`` (a long inference is not a hang; one
    that outlives any deadline is).

    Args:
        idle_timeout_s: longest gap between beats of an idle loop (s).
        busy_timeout_s: longest single request (s).
        clock: monotonic clock in seconds (tests may pass their own).
    """

    def __init__(
        self,
        idle_timeout_s: float = 10.0,
        busy_timeout_s: float = 120.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_timeout_s <= 0 or busy_timeout_s <= 0:
            raise ValueError("idle_timeout_s and busy_timeout_s must be > 0")
        self.idle_timeout_s = idle_timeout_s
        self.busy_timeout_s = busy_timeout_s
        self._clock = clock
        self._last_beat = clock()
        self._busy_since: float | None = None

    def beat(self) -> None:
        """The loop made progress."""
        self._last_beat = self._clock()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark one request in progress (beats on entry and exit)."""
        self._busy_since = self._last_beat = self._clock()
        try:
            yield
        finally:
            self._busy_since = None
            self._last_beat = self._clock()

    def age_s(self) -> float:
        """Seconds since the last beat."""
        return self._clock() - self._last_beat

    def __call__(self) -> bool:
        """``True`` while the worker is alive (see the class docstring)."""
        now = self._clock()
        since = self._busy_since
        if since is not None:
            return now - since < self.busy_timeout_s
        return now - self._last_beat < self.idle_timeout_s


class Watchdog:
    """Pings ``WATCHDOG=1`` every ``interval_s`` while ``is_alive()`` returns ``True``.

    Args:
        notifier: where to send.
        is_alive: liveness check, e.g. a :class:`Heartbeat`; an exception counts as not alive.
        interval_s: ping period; ``None`` = half of :func:`watchdog_period_s` (systemd's advice in
            ``sd_watchdog_enabled(3)``); when that is ``None`` too the watchdog is disabled and
            :meth:`start` does nothing.
        env: environment for :func:`watchdog_period_s`.

    When the check fails the pings stop (so the service manager kills and restarts the service
    after ``WatchdogSec=``), ``STATUS=`` says why, and the failure is logged once; pings resume if
    the check recovers before that.
    """

    def __init__(
        self,
        notifier: SystemdNotifier,
        is_alive: Callable[[], bool],
        *,
        interval_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if interval_s is None:
            period = watchdog_period_s(env)
            interval_s = period / 2 if period is not None else None
        elif interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.notifier = notifier
        self.is_alive = is_alive
        self.interval_s = interval_s
        self.pings = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None and self.notifier.enabled

    def tick(self) -> bool:
        """Check liveness once and ping if alive. Returns whether a ping was sent."""
        try:
            alive = bool(self.is_alive())
        except Exception:  # noqa: BLE001 - a broken check must not kill the watchdog thread
            logger.exception("watchdog liveness check raised; treating the worker as hung")
            alive = False
        if not alive:
            if not self._failing:
                self._failing = True
                logger.error("inference worker is not alive: stopping watchdog pings")
                self.notifier.status("inference worker unresponsive; waiting for the watchdog restart")
            return False
        if self._failing:
            self._failing = False
            logger.warning("inference worker alive again: resuming watchdog pings")
        sent = self.notifier.watchdog()
        if sent:
            self.pings += 1
        return sent

    def start(self) -> bool:
        """Start the ping thread (daemon thread). Returns ``False`` when the watchdog is disabled."""
        if not self.enabled or self._thread is not None:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()
        logger.info("systemd watchdog: pinging every %.3f s while the worker is alive", self.interval_s)
        return True

    def _run(self) -> None:
        assert self.interval_s is not None  # start() checked
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the ping thread (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
