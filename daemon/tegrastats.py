"""Jetson ``tegrastats`` telemetry: a shape-based line parser, a throttling detector and a reader.

Format (NVIDIA Jetson Linux Developer Guide, "tegrastats Utility", and real lines from L4T r35/r36
boards in ``tests/fixtures/tegrastats/``): one line per interval, a sequence of ``NAME VALUE``
pairs plus self-describing tokens, e.g. ::

    04-11-2025 10:36:27 RAM 4321/62801MB (lfb 1759x4MB) SWAP 19/31400MB (cached 0MB)
    CPU [0%@729,off,...] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] VIC_FREQ 729 APE 174
    CPU@44.562C GPU@-256C tj@44.343C VDD_GPU_SOC 2340mW/2340mW VIN_SYS_5V0 4025mW/4025mW

Which fields appear, their order, their case and their exact form differ between Jetson
generations and JetPack releases (``GR3D_FREQ 0%@611`` / ``0%@[305,305]`` / ``@[1000,1000]`` /
``0%``; rails ``5299mW/5299mW`` or ``1212/1212``; engines ``off``, ``N%@MHz`` or ``MHz``;
``CPU [x%,y%]@MHz`` on old boards). So the parser never reads by position: each token, or
``NAME VALUE`` pair, is classified by the *shape* of its value (one regex per kind). A field
that is missing makes that metric absent (``None``/missing key), an unknown token is kept in
``TegraSample.unparsed``, and a ``-256C`` sensor (no reading) is dropped. Units: RAM/SWAP in MB,
clocks in MHz, loads in %, temperatures in °C, power in mW.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

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

# -- token shapes -------------------------------------------------------------------------------
_TIMESTAMP_RE = re.compile(r"^\s*(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})\s+")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_MEM_RE = re.compile(r"^(\d+)/(\d+)(kB|MB|GB)(\(.*)?$")  # RAM 4321/62801MB, IRAM 0/252kB(lfb 252kB)
_LFB_RE = re.compile(r"^\(?lfb\s+(?:(\d+)x)?(\d+)(kB|MB|GB)\)$")  # (lfb 1759x4MB), (lfb 252kB)
_CACHED_RE = re.compile(r"^\(?cached\s+(\d+)(kB|MB|GB)\)$")  # (cached 0MB)
_TEMP_RE = re.compile(r"^([A-Za-z][\w.-]*)@(-?\d+(?:\.\d+)?)C(?:/-?\d+(?:\.\d+)?C)?$")  # tj@44.3C
_RAIL_RE = re.compile(r"^(\d+)(?:mW)?/(\d+)(?:mW)?(?:/\d+(?:mW)?)?$")  # 5299mW/5299mW, 1212/1212
_ENGINE_RE = re.compile(  # 0%@2133, 0%@[305,305], @[1000,1000], 0%, 729
    r"^(?:(\d+(?:\.\d+)?)%)?(?:@(?:(\d+)|\[([\d,\s]*)\]))?$|^(\d+)$"
)
_CORE_RE = re.compile(r"^(\d+(?:\.\d+)?)%(?:@(\d+))?$")  # 6%@729 or 6%
_NO_READING_C = -100.0  # -256C means "sensor unavailable"; nothing real is this cold
_UNIT_MB = {"kB": 1 / 1024, "MB": 1.0, "GB": 1024.0}
_TOTAL_POWER_RAILS = ("VDD_IN", "POM_5V_IN", "VIN")  # rails measuring the whole module input
_NOT_CONNECTED = "NC"


@dataclass(frozen=True)
class CpuCore:
    """One CPU core: ``online`` is False for ``off`` (powered down)."""

    index: int
    online: bool
    load_pct: float | None = None
    freq_mhz: int | None = None


@dataclass(frozen=True)
class EngineReading:
    """A clocked engine (``EMC``, ``GR3D``, ``VIC``, ``NVENC``...; the ``_FREQ`` suffix is dropped).
    ``freq_mhz`` has one entry per printed clock (``GR3D_FREQ 0%@[305,305]``: one per GPC)."""

    name: str
    online: bool = True
    load_pct: float | None = None
    freq_mhz: tuple[int, ...] = ()

    @property
    def max_freq_mhz(self) -> int | None:
        return max(self.freq_mhz) if self.freq_mhz else None


@dataclass(frozen=True)
class MemoryReading:
    """``RAM``/``SWAP``/``IRAM`` usage in MB (``IRAM`` is printed in kB and converted)."""

    used_mb: float
    total_mb: float
    lfb_blocks: int | None = None
    lfb_block_mb: float | None = None
    cached_mb: float | None = None


@dataclass(frozen=True)
class PowerRail:
    """A power rail: instantaneous and average power in mW."""

    name: str
    power_mw: int
    avg_power_mw: int


@dataclass(frozen=True)
class TegraSample:
    """One parsed tegrastats line. Every metric may be absent (``None`` / missing key)."""

    received_s: float  # UNIX time the line was read
    printed_at: datetime | None = None  # the line's own timestamp (local time), when printed
    memory: dict[str, MemoryReading] = field(default_factory=dict)  # keys upper case: RAM, SWAP
    cpu: tuple[CpuCore, ...] = ()
    engines: dict[str, EngineReading] = field(default_factory=dict)  # keys upper case: GR3D, EMC
    temps_c: dict[str, float] = field(default_factory=dict)  # keys lower case: cpu, gpu, tj
    rails: dict[str, PowerRail] = field(default_factory=dict)  # keys as printed: VDD_IN
    unparsed: tuple[str, ...] = ()

    def _mem(self, name: str, attr: str) -> float | None:
        m = self.memory.get(name)
        return getattr(m, attr) if m is not None else None

    @property
    def ram_used_mb(self) -> float | None:
        return self._mem("RAM", "used_mb")

    @property
    def ram_total_mb(self) -> float | None:
        return self._mem("RAM", "total_mb")

    @property
    def swap_used_mb(self) -> float | None:
        return self._mem("SWAP", "used_mb")

    @property
    def swap_total_mb(self) -> float | None:
        return self._mem("SWAP", "total_mb")

    @property
    def cpu_load_pct(self) -> float | None:
        """Mean load of the online cores that report one."""
        loads = [c.load_pct for c in self.cpu if c.online and c.load_pct is not None]
        return sum(loads) / len(loads) if loads else None

    @property
    def cpu_freq_mhz(self) -> int | None:
        """Highest clock among the online cores."""
        freqs = [c.freq_mhz for c in self.cpu if c.online and c.freq_mhz is not None]
        return max(freqs) if freqs else None

    def _gpu(self) -> list[EngineReading]:
        return [e for name, e in self.engines.items() if re.fullmatch(r"GR3D\d*", name)]

    @property
    def gpu_load_pct(self) -> float | None:
        """iGPU load (``GR3D``; the busiest GPC where several are printed)."""
        loads = [e.load_pct for e in self._gpu() if e.load_pct is not None]
        return max(loads) if loads else None

    @property
    def gpu_freq_mhz(self) -> int | None:
        """iGPU clock: the highest printed GPC clock (0 = idle/rail-gated)."""
        freqs = [f for e in self._gpu() for f in e.freq_mhz]
        return max(freqs) if freqs else None

    @property
    def emc_load_pct(self) -> float | None:
        e = self.engines.get("EMC")
        return e.load_pct if e is not None else None

    @property
    def emc_freq_mhz(self) -> int | None:
        e = self.engines.get("EMC")
        return e.max_freq_mhz if e is not None else None

    @property
    def max_temp_c(self) -> float | None:
        """Hottest sensor, ignoring ``PMIC`` (a fixed 100 °C placeholder on Nano/Xavier)."""
        temps = [t for name, t in self.temps_c.items() if name != "pmic"]
        return max(temps) if temps else None

    @property
    def total_power_mw(self) -> int | None:
        """Module input power: the input rail where one is printed (``VDD_IN``), else the sum of
        all rails (AGX Orin prints no total)."""
        for name in _TOTAL_POWER_RAILS:
            if name in self.rails:
                return self.rails[name].power_mw
        return sum(r.power_mw for r in self.rails.values()) if self.rails else None


def _to_mb(value: str, unit: str) -> float:
    return int(value) * _UNIT_MB[unit]


def _parse_engine(name: str, value: str) -> EngineReading | None:
    if value.lower() == "off":
        return EngineReading(name, online=False)
    m = _ENGINE_RE.match(value)
    if m is None or not value or value == "@":
        return None
    load, freq, freq_list, bare = m.groups()
    if bare is not None:  # a bare number is a clock in MHz (VIC_FREQ 729, APE 174)
        return EngineReading(name, freq_mhz=(int(bare),))
    freqs: tuple[int, ...] = ()
    if freq is not None:
        freqs = (int(freq),)
    elif freq_list is not None:
        freqs = tuple(int(f) for f in freq_list.replace(" ", "").split(",") if f)
    return EngineReading(name, load_pct=float(load) if load is not None else None, freq_mhz=freqs)


def _parse_cpu(body: str) -> tuple[CpuCore, ...] | None:
    # body: "[6%@729,off,...]" or "[2%,1%,off]@102" (old boards: one clock for all cores)
    m = re.fullmatch(r"\[([^\]]*)\](?:@(\d+))?", body)
    if m is None:
        return None
    shared = int(m.group(2)) if m.group(2) else None
    cores = []
    for i, item in enumerate(x.strip() for x in m.group(1).split(",")):
        if item.lower() == "off":
            cores.append(CpuCore(i, online=False))
            continue
        c = _CORE_RE.match(item)
        if c is None:  # an empty or unknown entry: the core exists, its reading does not
            cores.append(CpuCore(i, online=bool(item)))
            continue
        freq = int(c.group(2)) if c.group(2) else shared
        cores.append(CpuCore(i, online=True, load_pct=float(c.group(1)), freq_mhz=freq))
    return tuple(cores)


def parse_line(line: str, *, received_s: float | None = None) -> TegraSample | None:
    """Parse one tegrastats line. Never raises.

    Returns ``None`` only when no token of the line has a known shape (an error message, an empty
    line); otherwise a :class:`TegraSample` with whatever the line carries.
    """
    received = time.time() if received_s is None else received_s
    printed_at = None
    m = _TIMESTAMP_RE.match(line)
    if m is not None:
        try:
            printed_at = datetime.strptime(m.group(1), "%m-%d-%Y %H:%M:%S")
        except ValueError:
            printed_at = None
        line = line[m.end() :]
    toks = line.split()
    memory: dict[str, MemoryReading] = {}
    cpu: tuple[CpuCore, ...] = ()
    engines: dict[str, EngineReading] = {}
    temps: dict[str, float] = {}
    rails: dict[str, PowerRail] = {}
    unparsed: list[str] = []
    i, n = 0, len(toks)
    while i < n:
        tok = toks[i]
        nxt = toks[i + 1] if i + 1 < n else ""
        t = _TEMP_RE.match(tok)
        if t is not None:
            value = float(t.group(2))
            if value > _NO_READING_C:
                temps[t.group(1).lower()] = value
            i += 1
            continue
        if _NAME_RE.match(tok) is None or not nxt:
            unparsed.append(tok)
            i += 1
            continue
        if tok.upper() == "CPU" and nxt.startswith("["):
            j = i + 1
            while j < n and "]" not in toks[j]:
                j += 1
            cores = _parse_cpu("".join(toks[i + 1 : j + 1]))
            if cores is not None:
                cpu = cores
            else:
                unparsed.extend(toks[i : j + 1])
            i = j + 1
            continue
        if tok == "MTS":  # Xavier: "MTS fg 0% bg 0%"
            j = i + 1
            while j + 1 < n and toks[j] in ("fg", "bg") and _CORE_RE.match(toks[j + 1]):
                engines[f"MTS_{toks[j].upper()}"] = EngineReading(
                    f"MTS_{toks[j].upper()}", load_pct=float(toks[j + 1].rstrip("%"))
                )
                j += 2
            i = j
            continue
        mem = _MEM_RE.match(nxt)
        if mem is not None:
            # the optional "(lfb ...)" / "(cached ...)" group, attached or not, up to its ")"
            j = i + 2
            extra = [mem.group(4)] if mem.group(4) else []
            if not extra and j < n and toks[j].startswith("("):
                extra, j = [toks[j]], j + 1
            while extra and not extra[-1].endswith(")") and j < n:
                extra.append(toks[j])
                j += 1
            group = " ".join(extra)
            lfb, cached = _LFB_RE.match(group), _CACHED_RE.match(group)
            memory[tok.upper()] = MemoryReading(
                used_mb=_to_mb(mem.group(1), mem.group(3)),
                total_mb=_to_mb(mem.group(2), mem.group(3)),
                lfb_blocks=int(lfb.group(1)) if lfb and lfb.group(1) else (1 if lfb else None),
                lfb_block_mb=_to_mb(lfb.group(2), lfb.group(3)) if lfb else None,
                cached_mb=_to_mb(cached.group(1), cached.group(2)) if cached else None,
            )
            i = j
            continue
        rail = _RAIL_RE.match(nxt)
        if rail is not None:
            if tok != _NOT_CONNECTED:
                rails[tok] = PowerRail(tok, int(rail.group(1)), int(rail.group(2)))
            i += 2
            continue
        name = re.sub(r"_FREQ$", "", tok.upper())
        engine = _parse_engine(name, nxt)
        if engine is not None:
            engines[name] = engine
            i += 2
            continue
        unparsed.append(tok)
        i += 1
    if not (memory or cpu or engines or temps or rails):
        return None
    return TegraSample(
        received_s=received,
        printed_at=printed_at,
        memory=memory,
        cpu=cpu,
        engines=engines,
        temps_c=temps,
        rails=rails,
        unparsed=tuple(unparsed),
    )


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


def iter_samples(lines: Iterable[str]) -> Iterable[TegraSample]:
    """Parse many lines (e.g. a saved log), skipping the ones with no known field."""
    for line in lines:
        sample = parse_line(line)
        if sample is not None:
            yield sample
