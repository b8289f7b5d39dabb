"""``edgevlm doctor``: is this machine ready to run the daemon? One row per check with a verdict.

Each check returns :class:`CheckResult` rows ``(check, verdict, detail)`` with verdict ``OK``,
``WARN`` (works, but something is missing or slower than it could be) or ``FAIL`` (the daemon as
configured will not work). A check that crashes becomes a ``FAIL`` row naming the exception; the
report is always complete. Rows, in order:

``python``, ``edgevlm``, ``config`` (with ``--config``), ``torch``, ``cuda``, ``int4 kernels``
(torch's tinygemm ops ``_weight_int4pack_mm`` / ``_weight_int4pack_mm_for_cpu``, probed the way the
runtime selects them), ``tensorrt``, ``onnxruntime`` (execution providers), ``opencv`` (and its
GStreamer support), ``capture path`` (how GStreamer/CSI sources are read: OpenCV's GStreamer
backend or a ``gst-launch-1.0`` subprocess), ``cameras`` (``/dev/video*`` with V4L2 capabilities),
``source <name>`` per configured source, ``microphones`` (PortAudio via sounddevice, else
``/proc/asound``), ``audio <name>`` per configured audio source (a WAV file: its format and length),
``broker`` (a real MQTT v5 CONNECT/CONNACK exchange; with a config that does not validate, the broker
of its ``mqtt`` section if that loads alone, else a WARN row saying it was not checked), ``jetson`` (model and L4T
release), ``power mode`` (``nvpmodel -q``), ``clocks`` (GPU devfreq, CPU cpufreq), ``tegrastats``.

Host paths are read under ``root`` (default ``/``) so tests can point the checks at a prepared tree.
The checks live in :mod:`~edgevlm.daemon.doctor_software`, :mod:`~edgevlm.daemon.doctor_devices`,
:mod:`~edgevlm.daemon.doctor_mqtt` and :mod:`~edgevlm.daemon.doctor_host` (rows and Jetson checks);
this module runs them in order and is the CLI.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from edgevlm.daemon.doctor_devices import _check_audio_sources, _check_cameras, _check_microphones
from edgevlm.daemon.doctor_devices import _check_source as _check_source  # re-exported (tests)
from edgevlm.daemon.doctor_host import (
    CheckResult,
    Verdict,
    _check_clocks,
    _check_jetson,
    _check_power_mode,
    _check_tegrastats,
    _fail,
    _Host,
    _ok,
    _warn,
)
from edgevlm.daemon.doctor_mqtt import mqtt_probe
from edgevlm.daemon.doctor_software import (
    _check_cuda,
    _check_edgevlm,
    _check_int4,
    _check_onnxruntime,
    _check_opencv,
    _check_python,
    _check_tensorrt,
    _check_torch,
)
from edgevlm.profile import jetson_host

logger = logging.getLogger(__name__)

__all__ = ["CheckResult", "Verdict", "main", "mqtt_probe", "run_checks"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


# -- driver ---------------------------------------------------------------------------------------------
def _guard(name: str, fn: Any, *args: Any) -> list[CheckResult]:
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a crashing check is a FAIL row, never a traceback
        logger.debug("doctor check %s crashed", name, exc_info=True)
        return [_fail(name, f"check crashed: {type(exc).__name__}: {exc}")]
    return out if isinstance(out, list) else [out]


def run_checks(
    config: Any = None,
    *,
    broker: tuple[str, int] | None = None,
    timeout_s: float = 3.0,
    root: str | Path = "/",
    mqtt: Any = None,
    broker_unknown: str | None = None,
) -> list[CheckResult]:
    """Run every check and return the rows in a stable order (see the module doc).

    Args:
        config: a :class:`edgevlm.config.DaemonConfig` (sources, model device/backend, broker).
        broker: ``(host, port)`` to probe; default: the config's broker (``mqtt``'s without a
            config), else ``localhost:1883``.
        timeout_s: broker connect/answer timeout.
        root: folder the host paths (``/dev``, ``/sys``, ``/proc``, ``/etc``) are read under.
        mqtt: a :class:`edgevlm.config.MqttConfig` for the broker check when ``config`` is None (the
            ``mqtt`` section of a config file that does not validate as a whole).
        broker_unknown: why the configured broker is not known (a config whose ``mqtt`` section does
            not load): without ``broker`` the broker row then says it was not checked, and why,
            instead of probing a default the daemon would not use.
    """
    h = _Host(Path(root), config)
    h.jetson_model, release = jetson_host(h.root)
    if release:
        m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release)
        h.l4t = f"L4T R{m.group(1)}.{m.group(2)}" if m else "L4T (unparsed release file)"
    mq = config.mqtt if config is not None else mqtt
    from_section = broker is None and config is None and mqtt is not None  # of a config that does not load
    if broker is None and mq is not None:
        broker = (mq.host, mq.port)
    elif broker is None and broker_unknown is None:
        broker = ("localhost", 1883)  # no config given: the daemon's default
    rows: list[CheckResult] = []
    rows += _guard("python", _check_python)
    rows += _guard("edgevlm", _check_edgevlm)
    for name, fn in (
        ("torch", _check_torch),
        ("cuda", _check_cuda),
        ("int4 kernels", _check_int4),
        ("tensorrt", _check_tensorrt),
        ("onnxruntime", _check_onnxruntime),
        ("opencv", _check_opencv),
        ("cameras", _check_cameras),
        ("microphones", _check_microphones),
        ("audio sources", _check_audio_sources),
    ):
        rows += _guard(name, fn, h)
    if broker is None:
        rows.append(_warn("broker", f"not checked: {broker_unknown}; give --broker HOST[:PORT] to probe one"))
    else:
        host, port = broker
        probed = _guard(
            "broker",
            lambda: mqtt_probe(
                host, port, timeout_s=timeout_s,
                username=mq.username if mq else None, password=mq.password if mq else None, tls=mq.tls if mq else None,
            ),
        )  # fmt: skip
        if from_section:  # say where the broker came from: the rest of the config is broken
            probed = [CheckResult(r.check, r.verdict, f"{r.detail} (the config's mqtt section; the config does not "
                                                      "load as a whole)") for r in probed]  # fmt: skip
        rows += probed
    for name, fn in (
        ("jetson", _check_jetson),
        ("power mode", _check_power_mode),
        ("clocks", _check_clocks),
        ("tegrastats", _check_tegrastats),
    ):
        rows += _guard(name, fn, h)
    return rows


def _parse_broker(text: str) -> tuple[str, int]:
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^:\s]+))(?::(\d{1,5}))?", text.strip())
    if m is None or (m.group(3) and not 0 < int(m.group(3)) < 65536):
        raise argparse.ArgumentTypeError(f"expected HOST[:PORT], got {text!r}")
    return (m.group(1) or m.group(2)), int(m.group(3) or 1883)


def _mqtt_section(path: Path) -> tuple[Any, str | None]:
    """``(MqttConfig, None)`` from the ``mqtt`` section of a config file that does not validate as a
    whole (validated alone, by the same rules; no section: the daemon's defaults, as it would use), or
    ``(None, why)`` when that section cannot be read either."""
    from edgevlm.config import parse_daemon_config, read_config_file
    from edgevlm.errors import ConfigError

    try:
        data = read_config_file(path)
    except ConfigError as exc:
        return None, f"the config file does not load ({exc.message})"
    if data is not None and not isinstance(data, dict):
        return None, "the config is not a mapping"
    section = {"mqtt": data["mqtt"]} if data and "mqtt" in data else {}
    try:
        return parse_daemon_config(section, base_dir=path.resolve().parent).mqtt, None
    except ConfigError as exc:
        return None, f"the config's mqtt section does not load ({exc.message})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` options (for a subcommand of the ``edgevlm`` CLI)."""
    from edgevlm.cli_args import positive_float

    parser.add_argument("--config", type=Path, help="daemon config to check (sources, model, broker)")
    parser.add_argument("--broker", type=_parse_broker, help="HOST[:PORT] to probe (default: the config's)")
    parser.add_argument("--timeout", type=positive_float, default=3.0,
                        help="broker timeout in seconds, > 0 (default 3)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the checks for parsed :func:`add_arguments` options, print the report, return the exit
    code: 0 = no FAIL, 1 = at least one FAIL (a config that does not load is a FAIL row)."""
    rows: list[CheckResult] = []
    config = mqtt = broker_unknown = None
    if args.config is not None:
        from edgevlm.config import load_daemon_config
        from edgevlm.errors import ConfigError

        try:
            config = load_daemon_config(args.config)
            from edgevlm.model_folder import check_config_model_path

            check_config_model_path(config)  # what `edgevlm serve --check-config` also checks
            rows.append(_ok("config", f"{args.config}: valid"))
        except ConfigError as exc:
            rows.append(_fail("config", f"{args.config}: {exc}"))
            mqtt, broker_unknown = _mqtt_section(args.config)
    checks = run_checks(config, broker=args.broker, timeout_s=args.timeout, mqtt=mqtt, broker_unknown=broker_unknown)
    rows = checks[:2] + rows + checks[2:]  # python, edgevlm, config, ...
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        width = max(len(r.check) for r in rows)
        for r in rows:
            print(f"{r.verdict.value:<5} {r.check:<{width}}  {r.detail}")
        fails = sum(r.verdict is Verdict.FAIL for r in rows)
        warns = sum(r.verdict is Verdict.WARN for r in rows)
        print(f"\n{len(rows)} checks: {len(rows) - fails - warns} OK, {warns} WARN, {fails} FAIL")
    return EXIT_FAIL if any(r.verdict is Verdict.FAIL for r in rows) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """``edgevlm doctor [--config FILE] [--broker HOST[:PORT]] [--timeout S] [--json]``.

    Returns 0 (no FAIL), 1 (some FAIL) or 2 (bad arguments: one ``edgevlm: error:`` line)."""
    from edgevlm.cli_args import OneLineParser

    parser = OneLineParser(prog="edgevlm doctor", description="Check this machine for edgevlm.")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if exc.code in (0, None) else EXIT_USAGE
    return run_from_args(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
