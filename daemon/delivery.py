"""Parts of the daemon's MQTT front end that make delivery exactly-once and deadlines honest:
the recent-answers cache (:class:`RecentAnswers`) and the receipt clock (:class:`ReceiptClock`);
composed into :class:`~edgevlm.daemon.mqtt_bridge.MqttBridge`.

Duplicates: a request is identified by its reply address and Correlation Data (``reply_to`` +
``correlation_id`` for the JSON fallback). :class:`RecentAnswers` remembers the last
``mqtt.dedup_cache_size`` of them with a digest of their payload: a re-sent request (same address,
same Correlation Data, same payload) that is still queued or running is absorbed, and one already
answered gets the same response again (byte for byte) instead of running twice. The SDK re-sends
unanswered requests (see :mod:`edgevlm.client`), so this makes delivery exactly-once for the
application. A request without Correlation Data is never deduplicated.

Receipt time: :class:`ReceiptClock` notices when the daemon's own process was not running (SIGSTOP,
a paused VM) and dates the requests read right after that from when the stop began, since they
waited in the socket meanwhile; the deadline rule itself is
:func:`edgevlm.protocol.request_timeout_ms`.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time

from edgevlm.errors import ErrorCode
from edgevlm.protocol import Response

logger = logging.getLogger(__name__)

DedupKey = tuple[str, bytes]


class RecentAnswers:
    """Bounded map of recent requests (reply address + Correlation Data) to their response:
    None while the request is queued or running. Thread-safe; the oldest entry goes first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[DedupKey, tuple[bytes, Response | None]] = collections.OrderedDict()

    def claim(self, key: DedupKey, digest: bytes) -> tuple[str, Response | None]:
        """``("new", None)`` (now recorded as in flight), ``("in_flight", None)`` or
        ``("answered", response)``. A known key with another payload is a new request."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == digest:
                self._entries.move_to_end(key)
                return ("in_flight", None) if entry[1] is None else ("answered", entry[1])
            self._entries[key] = (digest, None)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)
            return "new", None

    def settle(self, key: DedupKey, digest: bytes, response: Response) -> None:
        """The request ``(key, digest)`` was answered with ``response``: remember it for re-sends, or,
        for a transient ``BUSY``, drop the entry so that a re-send (to this daemon or, in a pool,
        another) runs again. An entry already replaced by another payload is left alone."""
        busy = response.error is not None and response.error.code == ErrorCode.BUSY
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != digest:
                return
            if busy:
                del self._entries[key]
            else:
                self._entries[key] = (digest, response)

    def forget(self, key: DedupKey, digest: bytes) -> None:
        """Drop the entry of ``(key, digest)`` (a request handed on, not answered here)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == digest and entry[1] is None:
                del self._entries[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


RECEIVE_MAXIMUM = 16
"""The daemon's MQTT v5 Receive Maximum (CONNECT property, OASIS MQTT 5.0 section 3.1.2.11.3): the
broker sends at most this many QoS 1/2 requests the daemon has not acknowledged, so at most this
many can wait in its socket while its process is stopped; the rest wait in the broker, where their
Message Expiry Interval keeps counting."""


class ReceiptClock:
    """Monotonic receipt times that survive the daemon's process being stopped.

    A ticker thread records the time every ``tick_s``; a gap longer than ``stall_s`` means the
    process did not run (SIGSTOP, a suspended VM or container). Requests read while such a gap is
    still open, or less than ``grace_s`` after it closed, may have waited in the socket all along:
    the first ``in_socket_max`` of them at QoS >= 1 (the broker sends no more unacknowledged ones, see
    :data:`RECEIVE_MAXIMUM`) and every QoS 0 one are dated from the last tick before the gap (the
    earliest they can have arrived unread), so a request whose client gave up meanwhile is not run.
    Later QoS >= 1 requests waited in the broker instead, whose forwarded Message Expiry Interval
    already counts that wait: they are dated now.
    """

    def __init__(self, tick_s: float = 0.1, stall_s: float = 2.0, grace_s: float = 0.5,
                 in_socket_max: int = RECEIVE_MAXIMUM) -> None:  # fmt: skip
        self.tick_s, self.stall_s, self.grace_s, self.in_socket_max = tick_s, stall_s, grace_s, in_socket_max
        self._last = time.monotonic()
        self._stall: tuple[float, float] | None = None
        self._lock = threading.Lock()
        self._episode: float | None = None  # start of the stall whose socket backlog is being dated
        self._left = 0
        self.stalls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._tick, name="edgevlm-receipt-clock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - self._last > self.stall_s:
                self._stall = (self._last, now)
                self.stalls += 1
                logger.warning("the daemon's process did not run for %.1f s (stopped?); requests that waited in "
                               "its socket are dated from when it stopped", now - self._last)  # fmt: skip
            self._last = now

    def received(self, qos: int = 1) -> float:
        """The receipt time (monotonic s) of a request message of ``qos`` handled now."""
        now = time.monotonic()
        if self._thread is None:
            return now
        last = self._last
        if now - last > self.stall_s:
            start = last  # stopped, and the ticker has not run since
        else:
            stall = self._stall
            if stall is None or now - stall[1] >= self.grace_s:
                return now
            start = stall[0]
        with self._lock:
            if self._episode != start:
                self._episode, self._left = start, self.in_socket_max
            if qos == 0:
                return start
            if self._left > 0:
                self._left -= 1
                return start
        return now


def payload_digest(payload: bytes) -> bytes:
    """16-byte BLAKE2b digest of a request payload (tells a re-send from a new request that reuses
    the Correlation Data)."""
    return hashlib.blake2b(payload, digest_size=16).digest()
