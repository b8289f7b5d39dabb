"""The link between the daemon's process and one MQTT front process (``mqtt.front_processes``).

One connected Unix stream socket pair per front. A message is a small pickled ``meta`` object
(a tuple whose first item names its kind) and an optional raw ``payload`` (a front's decoded
pixels, a response's JSON), framed as ``!II`` (meta bytes, payload bytes) + meta + payload. The
payload is written straight from the sender's buffer (``sendall`` of a memoryview) and read
straight into a fresh uninitialised buffer (``recv_into``): the kernel copies it once each way, with the
GIL released, and no Python-level concatenation happens.

Why a socket: measured on the 2-core CI machine for one 384x288x3 uint8 image (the bench's), the
receiver's CPU (the daemon's process) was 115 us with ``multiprocessing.Connection.send_bytes`` /
``recv_bytes`` (it joins 64 KB reads in a ``BytesIO`` with the GIL held), 52 us with
``multiprocessing.shared_memory`` (8 slots; the copy out of the slot and the slot's index through a
pipe), 55-63 us with this framing, whose copy runs in the kernel with the GIL released.
Shared memory without the copy out would need each slot held until the model consumed it and a dead
front's slots reclaimed: more states for no measured gain
(``bench/results/daemon_throughput_h200_20261202.md``, "Night").

Messages, front -> daemon: ``("job", job_id, request, received_monotonic, timeout_ms,
deadline_limit, shape, dedup)`` + pixels (``shape`` None: a source request, no payload; ``dedup``
the request's recent-answers key and payload digest, or None), ``("ready",)`` (subscribed),
``("connection", up, reason)`` (its broker connection came up or went down),
``("events", {name: n})`` (counter deltas), ``("metric", method, args)``. Daemon -> front:
``("reply", job_id)`` + the response's JSON, ``("stop_accepting",)``, ``("stop", message)``.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from typing import Any

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!II")  # (meta bytes, payload bytes)
MAX_META_BYTES = 64 * 1024 * 1024
MAX_PAYLOAD_BYTES = 1 << 31


def _uninitialised(n: int) -> Any:
    """A writable uint8 buffer of ``n`` bytes, not zero-filled (a numpy array: bytes-like)."""
    import numpy as np

    return np.empty(n, np.uint8)


class LinkClosed(ConnectionError):
    """The other end closed the link (its process exited) or the link was closed here."""


class FrontLink:
    """One end of a front link; :meth:`send` is thread-safe, :meth:`recv` is for one reader thread.

    Args:
        sock: a connected ``AF_UNIX`` ``SOCK_STREAM`` socket (one end of :meth:`pair`).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._closed = False

    @classmethod
    def pair(cls) -> tuple[FrontLink, FrontLink]:
        """Two connected ends; pass one's :attr:`sock` to the child process (multiprocessing
        pickles a socket by duplicating its file descriptor) and :meth:`close` it here."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(a), cls(b)

    def send(self, meta: Any, payload: Any = None) -> None:
        """Send ``meta`` (picklable) and ``payload`` (anything exposing the buffer protocol: bytes,
        a C-contiguous numpy array; None = no payload).

        Raises:
            LinkClosed: the link is closed or the other end is gone.
        """
        m = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(payload).cast("B") if payload is not None else None
        n = 0 if view is None else view.nbytes
        try:
            with self._send_lock:
                if view is not None and n <= 65536:  # small: one write
                    self.sock.sendall(_FRAME.pack(len(m), n) + m + view)
                else:
                    self.sock.sendall(_FRAME.pack(len(m), n) + m)
                    if view is not None:
                        self.sock.sendall(view)
        except OSError as exc:
            raise LinkClosed(f"front link closed: {exc}") from exc

    def recv(self) -> tuple[Any, Any]:
        """The next message: ``(meta, payload)``; ``payload`` is writable and bytes-like (a
        ``bytearray``, or a 1-D uint8 numpy array over 4 KB; None when the message had none).

        Raises:
            LinkClosed: the other end closed the link (or a frame was malformed).
        """
        head = self._read(_FRAME.size)
        meta_n, payload_n = _FRAME.unpack(head)
        if meta_n > MAX_META_BYTES or payload_n > MAX_PAYLOAD_BYTES:
            raise LinkClosed(f"front link: malformed frame ({meta_n}, {payload_n} bytes)")
        meta = pickle.loads(self._read(meta_n))
        return meta, (self._read(payload_n) if payload_n else None)

    def _read(self, n: int) -> Any:
        buf = bytearray(n) if n <= 4096 else _uninitialised(n)
        view = memoryview(buf)
        got = 0
        try:
            while got < n:
                k = self.sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise LinkClosed("front link: the other end closed it")
                got += k
        except OSError as exc:
            if isinstance(exc, LinkClosed):
                raise
            raise LinkClosed(f"front link closed: {exc}") from exc
        return buf

    def close(self, *, shutdown: bool = True) -> None:
        """Close this end: a blocked :meth:`recv` on either end raises :class:`LinkClosed`.
        ``shutdown=False`` only closes this process's descriptor (the end handed to a child
        process, whose copy stays open)."""
        if self._closed:
            return
        self._closed = True
        if shutdown:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()
