"""Subprocess helpers of the tests that run edgevlm as a process and stop it with a signal (``serve``,
``demo``, ``quantize``, the daemon's ``run``)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Kill ``proc`` and collect it if it still runs when the block ends (a failed assertion or a timeout in
    the block never leaves a daemon, a broker or a half-done quantize behind for the next test)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, *, timeout_s: float = 60.0) -> tuple[Any, Any]:
    """Send ``sig`` to ``proc`` and wait for it to end; returns what it printed since (stdout, stderr),
    as ``communicate`` does. Raises ``subprocess.TimeoutExpired`` past ``timeout_s``."""
    proc.send_signal(sig)
    return proc.communicate(timeout=timeout_s)
