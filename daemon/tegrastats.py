"""Jetson ``tegrastats`` telemetry: a shape-based line parser, a throttling detector and a reader.

The parser (the line format, :class:`TegraSample` and :func:`parse_line`) lives in
:mod:`edgevlm.daemon.tegrastats_parse` and is re-exported here.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgevlm.daemon.tegrastats_parse import (  # noqa: F401  (re-exported: the parser's public names)
    CpuCore,
    EngineReading,
    MemoryReading,
    PowerRail,
    TegraSample,
    iter_samples,
    parse_line,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CpuCore",
    "EngineReading",
    "MemoryReading",
    "PowerRail",
    "TegraSample",
    "TegrastatsReader",
    "ThermalState",
    "ThrottleDetector",
    "parse_line",
]


# -- throttling -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThermalState:
    """What the latency controller needs from one sample.

    ``gpu_clock_ratio`` is the GPU clock over the reference clock (1.0 = full speed);
    ``throttled`` is True when the hottest sensor is at/above the limit or the GPU runs below
    ``clock_ratio_limit`` of its reference clock while busy; ``reasons`` says which.
    """

    max_temp_c: float | None
    gpu_freq_mhz: int | None
    gpu_load_pct: float | None
    reference_gpu_freq_mhz: int | None
    gpu_clock_ratio: float | None
    throttled: bool
    reasons: tuple[str, ...] = ()

    @property
    def slowdown_hint(self) -> float:
        """Expected slowdown of GPU-bound work (>= 1.0): the inverse clock ratio while throttled."""
        if self.throttled and self.gpu_clock_ratio:
            return max(1.0, 1.0 / self.gpu_clock_ratio)
        return 1.0


class ThrottleDetector:
    """Turns samples into :class:`ThermalState` (thread-safe).

    Args:
        temp_limit_c: a sensor at or above this counts as throttling (Orin's software throttling
            starts near 99 °C junction; the default warns a little before).
        clock_ratio_limit: a busy GPU below this fraction of its reference clock is throttled.
        busy_load_pct: GPU load from which a low clock means throttling rather than idling (DVFS).
        reference_gpu_freq_mhz: the GPU's full clock for the current power mode; ``None`` = the
            highest clock seen so far (learned).

    Raises:
        ValueError: parameters out of range.
    """

    def __init__(
        self,
        *,
        temp_limit_c: float = 95.0,
        clock_ratio_limit: float = 0.8,
        busy_load_pct: float = 50.0,
        reference_gpu_freq_mhz: int | None = None,
    ) -> None:
        if not 0 < clock_ratio_limit <= 1 or not 0 <= busy_load_pct <= 100:
            raise ValueError("clock_ratio_limit must be in (0, 1] and busy_load_pct in [0, 100]")
        if reference_gpu_freq_mhz is not None and reference_gpu_freq_mhz <= 0:
            raise ValueError("reference_gpu_freq_mhz must be > 0")
        self.temp_limit_c = temp_limit_c
        self.clock_ratio_limit = clock_ratio_limit
        self.busy_load_pct = busy_load_pct
        self._fixed_ref = reference_gpu_freq_mhz
        self._peak = 0
        self._lock = threading.Lock()

    def update(self, sample: TegraSample) -> ThermalState:
        temp, freq, load = sample.max_temp_c, sample.gpu_freq_mhz, sample.gpu_load_pct
        with self._lock:
            if freq is not None:
                self._peak = max(self._peak, freq)
            ref = self._fixed_ref or (self._peak or None)
        ratio = freq / ref if (freq is not None and ref) else None
        reasons = []
        if temp is not None and temp >= self.temp_limit_c:
            reasons.append(f"temperature {temp:.1f} C >= {self.temp_limit_c:.1f} C")
        busy = load is not None and load >= self.busy_load_pct
        if busy and ratio is not None and ratio < self.clock_ratio_limit:
            reasons.append(f"GPU clock {freq} MHz is {ratio:.0%} of {ref} MHz at {load:.0f}% load")
        return ThermalState(temp, freq, load, ref, ratio, bool(reasons), tuple(reasons))


# -- reader ---------------------------------------------------------------------------------------
class TegrastatsReader:
    """Reads samples in a background thread from ``tegrastats --interval MS`` or by tailing a log
    file (``tegrastats --logfile``), keeping the newest one.

    Args:
        interval_ms: sampling interval passed to tegrastats (and the log poll period).
        binary: tegrastats executable (name on ``$PATH`` or a path).
        log_path: tail this file instead of running the binary (follows rotation/truncation).
        on_sample: called in the reader thread with each parsed sample (exceptions are logged).
        restart_max_delay_s: cap of the exponential backoff when the process dies or the log
            file is missing.
    """

    def __init__(
        self,
        *,
        interval_ms: int = 1000,
        binary: str = "tegrastats",
        log_path: str | Path | None = None,
        on_sample: Callable[[TegraSample], None] | None = None,
        restart_max_delay_s: float = 30.0,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
        self.interval_ms = interval_ms
        self.binary = binary
        self.log_path = Path(log_path) if log_path is not None else None
        self.on_sample = on_sample
        self.restart_max_delay_s = restart_max_delay_s
        self.lines_read = 0
        self.lines_unparsed = 0
        self.restarts = 0
        self._latest: TegraSample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._tail_from: tuple[int, int] | None = None

    def available(self) -> bool:
        """Whether there is something to read: the log file's folder exists, or the binary does."""
        if self.log_path is not None:
            return self.log_path.parent.is_dir()
        return shutil.which(self.binary) is not None

    def latest(self, max_age_s: float | None = None) -> TegraSample | None:
        """The newest sample, or ``None`` if none yet or older than ``max_age_s``."""
        s = self._latest
        if s is None or (max_age_s is not None and time.time() - s.received_s > max_age_s):
            return None
        return s

    def feed(self, line: str) -> TegraSample | None:
        """Parse one line and publish it as the latest sample (the threads call this)."""
        self.lines_read += 1
        sample = parse_line(line)
        if sample is None:
            if line.strip():
                self.lines_unparsed += 1
                logger.debug("tegrastats: no known field in %r", line[:200])
            return None
        self._latest = sample
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # noqa: BLE001 - a consumer bug must not stop telemetry
                logger.exception("tegrastats on_sample callback failed")
        return sample

    def start(self) -> bool:
        """Start the reader thread; ``False`` (and a log line) when nothing can be read."""
        if self._thread is not None:
            return True
        if not self.available():
            logger.info("tegrastats: %s not found; Jetson telemetry disabled", self.log_path or self.binary)
            return False
        self._stop.clear()
        if self.log_path is not None:
            # lines already in the file are not current telemetry: start after them
            try:
                st = os.stat(self.log_path)
                self._tail_from = (st.st_ino, st.st_size)
            except OSError:
                self._tail_from = None
        target = self._tail_loop if self.log_path is not None else self._process_loop
        self._thread = threading.Thread(target=target, name="tegrastats", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and the tegrastats process (idempotent)."""
        with self._lock:
            self._stop.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout_s)

    def _backoff(self, attempt: int) -> float:
        return min(self.restart_max_delay_s, 0.5 * 2**attempt)

    def _process_loop(self) -> None:
        attempt = 0
        cmd = [self.binary, "--interval", str(self.interval_ms)]
        while not self._stop.is_set():
            try:
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                logger.error("tegrastats: cannot run %s: %s", cmd[0], exc)
                proc = None
            if proc is not None:
                with self._lock:
                    self._proc = proc
                    if self._stop.is_set():  # stop() ran while the process was starting
                        proc.terminate()
                got = False
                assert proc.stdout is not None
                for line in proc.stdout:
                    got = self.feed(line) is not None or got
                    if got:
                        attempt = 0
                proc.wait()
                err = proc.stderr.read().strip()[-500:] if proc.stderr else ""
                proc.stdout.close()
                if proc.stderr:
                    proc.stderr.close()
                if self._stop.is_set():
                    return
                logger.warning("tegrastats exited with status %s: %s", proc.returncode, err or "(no stderr)")
            self.restarts += 1
            self._stop.wait(self._backoff(attempt))
            attempt += 1

    def _tail_loop(self) -> None:
        assert self.log_path is not None
        attempt, f, ino, skip_to = 0, None, None, self._tail_from
        buf = ""
        poll_s = min(self.interval_ms / 1000, 0.25)
        while not self._stop.is_set():
            if f is None:
                try:
                    f = open(self.log_path, encoding="utf-8", errors="replace")  # noqa: SIM115
                except OSError:
                    self._stop.wait(self._backoff(attempt))
                    attempt += 1
                    continue
                ino, attempt = os.fstat(f.fileno()).st_ino, 0
                if skip_to is not None and skip_to[0] == ino:
                    f.seek(skip_to[1])
                skip_to, buf = None, ""
            chunk = f.read()
            if chunk:
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    self.feed(line)
                continue
            try:
                st = os.stat(self.log_path)
                rotated = st.st_ino != ino or st.st_size < f.tell()
            except OSError:
                rotated = True
            if rotated:  # replaced or truncated: read the new file from its start
                f.close()
                f = None
                continue
            self._stop.wait(poll_s)
        if f is not None:
            f.close()

