"""The systemd unit that runs the daemon, where the daemon's settings depend on it: the unit's
``TimeoutStopSec=`` bounds ``service.shutdown_timeout_s`` (:func:`stop_timeout_problem`). On
``systemctl stop`` the daemon lets the request in flight run for ``shutdown_timeout_s``, then says
goodbye to the broker (up to ``MQTT_STOP_TIMEOUT_S``); systemd kills it (SIGKILL) at
``TimeoutStopSec=``, and whatever was still in flight then is never answered.

The one source of the unit's value is the unit file systemd reads: the shipped
``jetson/edgevlm.service`` as ``jetson/install.sh`` installs it (``/etc/systemd/system/edgevlm.service``),
with its drop-ins (``edgevlm.service.d/*.conf``, where ``systemctl edit edgevlm`` writes). Nothing copies
the value elsewhere.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from edgevlm.config import DaemonConfig

__all__ = ["find_unit", "parse_timespan_s", "stop_timeout_problem", "timeout_stop_s"]

logger = logging.getLogger(__name__)

UNIT_NAME = "edgevlm.service"
UNIT_FILE_ENV = "EDGEVLM_UNIT_FILE"
"""Names the unit file to check instead of looking for ``edgevlm.service`` in :data:`UNIT_DIRS`."""
UNIT_DIRS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)
"""Where systemd looks for a system unit and its drop-ins, first wins (systemd.unit(5))."""
DEFAULT_TIMEOUT_STOP_S = 90.0
"""systemd's ``DefaultTimeoutStopSec=``: a unit that sets no ``TimeoutStopSec=`` gets it."""

_SPAN_UNITS = {
    "us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3,
    "": 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0, "w": 604800.0, "week": 604800.0, "weeks": 604800.0,
}  # fmt: skip
_SPAN_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)")


def parse_timespan_s(text: str) -> float:
    """Seconds of a systemd time span (systemd.time(7): ``30s``, ``1min 30s``, ``90`` = seconds,
    ``500ms``); ``math.inf`` for ``infinity``.

    Raises:
        ValueError: not a time span.
    """
    text = text.strip()
    if text == "infinity":
        return math.inf
    if not text:
        raise ValueError("not a systemd time span: ''")
    total, pos = 0.0, 0
    while pos < len(text):
        m = _SPAN_PART.match(text, pos)
        if m is None or m.group(2) not in _SPAN_UNITS:
            raise ValueError(f"not a systemd time span: {text!r}")
        total += float(m.group(1)) * _SPAN_UNITS[m.group(2)]
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return total


def _unit_name(env: Mapping[str, str], cgroup: Path) -> str:
    """The unit this process runs in when systemd started it (``$INVOCATION_ID`` set; the last
    ``*.service`` of ``/proc/self/cgroup``), else :data:`UNIT_NAME`."""
    if env.get("INVOCATION_ID"):
        try:
            for line in cgroup.read_text().splitlines():
                name = line.rsplit("/", 1)[-1]
                if name.endswith(".service"):
                    return name
        except OSError:
            pass
    return UNIT_NAME


def find_unit(
    env: Mapping[str, str] | None = None,
    *,
    dirs: tuple[str, ...] = UNIT_DIRS,
    cgroup: Path = Path("/proc/self/cgroup"),
) -> tuple[Path, list[Path]] | None:
    """The unit file the service that runs this config reads, and its drop-ins in the order systemd
    applies them: ``$EDGEVLM_UNIT_FILE`` (its drop-ins beside it), else the service this process runs
    in under systemd or ``edgevlm.service``, found in ``dirs``. None when there is none (not installed)."""
    env = os.environ if env is None else env
    if env.get(UNIT_FILE_ENV):
        unit = Path(env[UNIT_FILE_ENV])
        dirs, name = (str(unit.parent),), unit.name
    else:
        name = _unit_name(env, cgroup)
        unit = next((Path(d) / name for d in dirs if (Path(d) / name).is_file()), Path(dirs[0]) / name)
    if not unit.is_file():
        return None
    dropins: dict[str, Path] = {}
    for d in dirs:  # a drop-in of one name: the first directory's
        for conf in sorted((Path(d) / f"{name}.d").glob("*.conf")):
            dropins.setdefault(conf.name, conf)
    return unit, [dropins[k] for k in sorted(dropins)]


def timeout_stop_s(unit: Path, dropins: Sequence[Path] = ()) -> tuple[float, str]:
    """``TimeoutStopSec=`` as systemd reads it, in seconds (``math.inf`` for ``infinity``), and the line that
    set it (``TimeoutStopSec=30s``, or systemd's default): the last ``TimeoutStopSec=`` or ``TimeoutSec=`` of
    the ``[Service]`` sections of ``unit``, then of ``dropins``; an empty assignment resets to the default.

    Raises:
        ValueError: a value that is not a time span; OSError: a file that cannot be read.
    """
    value, where = DEFAULT_TIMEOUT_STOP_S, "systemd's default DefaultTimeoutStopSec=90s"
    for path in (unit, *dropins):
        section = None
        for raw in path.read_text(errors="replace").splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, val = line.partition("=")
            if section != "Service" or not sep or key.strip() not in ("TimeoutStopSec", "TimeoutSec"):
                continue
            val = val.strip()
            if not val:
                value, where = DEFAULT_TIMEOUT_STOP_S, "systemd's default DefaultTimeoutStopSec=90s"
            else:
                value, where = parse_timespan_s(val), f"{key.strip()}={val}"
    return value, where


def stop_timeout_problem(
    cfg: DaemonConfig,
    env: Mapping[str, str] | None = None,
    *,
    dirs: tuple[str, ...] = UNIT_DIRS,
    cgroup: Path = Path("/proc/self/cgroup"),
) -> str | None:
    """``service.shutdown_timeout_s: ...`` when the daemon's shutdown (``service.shutdown_timeout_s`` for
    the request in flight, then up to ``MQTT_STOP_TIMEOUT_S`` for the MQTT goodbye) does not fit in the
    ``TimeoutStopSec=`` of the unit that runs it (:func:`find_unit`), else None (also when no unit is
    installed, or its value cannot be read: logged at DEBUG). ``edgevlm serve --check-config`` refuses it;
    ``serve`` logs it as a WARNING and starts. ``dirs`` / ``cgroup``: see :func:`find_unit`."""
    from edgevlm.daemon.app import MQTT_STOP_TIMEOUT_S

    found = find_unit(env, dirs=dirs, cgroup=cgroup)
    if found is None:
        return None
    unit, dropins = found
    try:
        limit_s, where = timeout_stop_s(unit, dropins)
    except (OSError, ValueError) as exc:
        logger.debug("cannot read TimeoutStopSec= of %s: %s", unit, exc)
        return None
    shutdown_s = cfg.service.shutdown_timeout_s
    if shutdown_s + MQTT_STOP_TIMEOUT_S <= limit_s:
        return None
    files = ", ".join(str(p) for p in (unit, *dropins))
    fits = limit_s - MQTT_STOP_TIMEOUT_S
    advice = f"set it to at most {fits:g} s or raise" if fits > 0 else "raise"
    return (
        f"service.shutdown_timeout_s: {shutdown_s:g} s for the request in flight plus up to "
        f"{MQTT_STOP_TIMEOUT_S:g} s for the MQTT goodbye is longer than the systemd unit allows ({where}; "
        f"{files}): systemd kills the daemon (SIGKILL) mid-drain and the requests in flight are never "
        f"answered; {advice} TimeoutStopSec= (sudo systemctl edit {unit.name})"
    )
