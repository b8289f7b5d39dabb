"""Jetson ``tegrastats`` line parser: the sample dataclasses and a shape-based :func:`parse_line`.

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

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

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


def iter_samples(lines: Iterable[str]) -> Iterable[TegraSample]:
    """Parse many lines (e.g. a saved log), skipping the ones with no known field."""
    for line in lines:
        sample = parse_line(line)
        if sample is not None:
            yield sample
