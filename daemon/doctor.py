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
``/proc/asound``), ``broker`` (a real MQTT v5 CONNECT/CONNACK exchange), ``jetson`` (model and L4T
release), ``power mode`` (``nvpmodel -q``), ``clocks`` (GPU devfreq, CPU cpufreq), ``tegrastats``.

Host paths are read under ``root`` (default ``/``) so tests can point the checks at a prepared tree.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import logging
import os
import platform
import re
import secrets
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CheckResult", "Verdict", "main", "mqtt_probe", "run_checks"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class Verdict(str, Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class CheckResult:
    check: str
    verdict: Verdict
    detail: str

    def as_dict(self) -> dict[str, str]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d


def _ok(check: str, detail: str) -> CheckResult:
    return CheckResult(check, Verdict.OK, detail)


def _warn(check: str, detail: str) -> CheckResult:
    return CheckResult(check, Verdict.WARN, detail)


def _fail(check: str, detail: str) -> CheckResult:
    return CheckResult(check, Verdict.FAIL, detail)


@dataclass
class _Host:
    root: Path
    config: Any  # edgevlm.config.DaemonConfig | None
    jetson_model: str | None = None
    l4t: str | None = None

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def read(self, p: str) -> str | None:
        try:
            return self.path(p).read_bytes().replace(b"\0", b"").decode(errors="replace").strip()
        except OSError:
            return None

    @property
    def is_jetson(self) -> bool:
        return self.jetson_model is not None or self.l4t is not None

    @property
    def model_device(self) -> str:
        return self.config.model.device if self.config is not None else "cpu"

    @property
    def backend(self) -> str:
        return self.config.model.backend if self.config is not None else "torch"


# -- software -------------------------------------------------------------------------------------------
def _check_python() -> CheckResult:
    return _ok("python", f"{platform.python_version()} ({sys.executable})")


def _check_edgevlm() -> CheckResult:
    import edgevlm

    return _ok("edgevlm", f"{getattr(edgevlm, '__version__', '?')} ({Path(edgevlm.__file__).parent})")


def _check_torch(h: _Host) -> CheckResult:
    try:
        import torch
    except ImportError:
        hint = (
            "install NVIDIA's PyTorch wheel for this JetPack"
            if h.is_jetson
            else "pip install 'edgevlm[runtime]'"
        )
        verdict = _fail if h.backend == "torch" else _warn
        return verdict("torch", f"not installed: {hint}")
    where = Path(torch.__file__).parent
    return _ok("torch", f"{torch.__version__} ({where})")


def _check_cuda(h: _Host) -> CheckResult:
    try:
        import torch
    except ImportError:
        return _warn("cuda", "torch not installed")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = ", ".join(
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(n)
        )
        return _ok("cuda", f"CUDA {torch.version.cuda}, {n} device(s): {names}")
    built = torch.version.cuda
    if h.is_jetson:
        why = "torch has no CUDA build: was JetPack's torch replaced by a PyPI wheel?" if not built else (
            f"torch built for CUDA {built} sees no GPU: is the user in the video/render groups?"
        )  # fmt: skip
        return _fail("cuda", why)
    if h.model_device.startswith("cuda"):
        return _fail("cuda", f"config asks for model.device={h.model_device} but torch sees no CUDA device")
    return _warn("cuda", "no CUDA device: the model runs on the CPU")


def _check_int4(h: _Host) -> CheckResult:
    try:
        import torch
    except ImportError:
        return _warn("int4 kernels", "torch not installed")
    ops = torch.ops.aten
    have = [n for n in ("_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu") if hasattr(ops, n)]
    if not have:
        return _warn(
            "int4 kernels", f"torch {torch.__version__} has no int4 kernels: INT4 bundles dequantize (slower)"
        )
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    try:
        from edgevlm.runtime.int4 import kernel_convention
    except Exception as exc:  # noqa: BLE001 - the runtime may be missing its extra
        return _ok("int4 kernels", f"present: {', '.join(have)} (not probed: {exc})")
    chosen = {d: kernel_convention(torch.device(d)) for d in devices}
    working = {d: c for d, c in chosen.items() if c}
    detail = f"present: {', '.join(have)}; working: " + (
        ", ".join(f"{d}={c}" for d, c in working.items()) or "none"
    )
    if "cuda" in chosen and not chosen["cuda"]:
        return _warn("int4 kernels", detail + " (CUDA INT4 layers will dequantize)")
    if not working:
        return _warn("int4 kernels", detail + " (INT4 layers will dequantize)")
    return _ok("int4 kernels", detail)


def _check_tensorrt(h: _Host) -> CheckResult:
    try:
        import tensorrt
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken install (OSError on libs)
        why = f"not importable ({type(exc).__name__})"
        if h.backend == "tensorrt":
            return _fail("tensorrt", f"{why} but config uses backend tensorrt")
        hint = "install JetPack's python3-libnvinfer" if h.is_jetson else "optional backend"
        return _warn("tensorrt", f"{why}: {hint}")
    return _ok("tensorrt", f"{tensorrt.__version__}")


def _check_onnxruntime(h: _Host) -> CheckResult:
    try:
        import onnxruntime
    except Exception as exc:  # noqa: BLE001
        why = f"not importable ({type(exc).__name__})"
        if h.backend == "onnx":
            return _fail(
                "onnxruntime", f"{why} but config uses backend onnx: pip install 'edgevlm[onnx]'"
            )
        return _warn("onnxruntime", f"{why}: optional backend (pip install 'edgevlm[onnx]')")
    providers = onnxruntime.get_available_providers()
    detail = f"{onnxruntime.__version__}, providers: {', '.join(providers)}"
    accel = {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
    if h.is_jetson and not accel & set(providers):
        return _warn("onnxruntime", detail + " (CPU only: install the Jetson onnxruntime-gpu wheel)")
    return _ok("onnxruntime", detail)


def _check_opencv(h: _Host) -> list[CheckResult]:
    try:
        import cv2
    except Exception as exc:  # noqa: BLE001
        return [
            _fail("opencv", f"not importable ({type(exc).__name__}): pip install 'edgevlm[runtime]'"),
            _warn("capture path", "no OpenCV"),
        ]
    m = re.search(r"GStreamer:\s*(\w+)", cv2.getBuildInformation())
    gst = bool(m and m.group(1).upper() == "YES")
    rows = [_ok("opencv", f"{cv2.__version__} ({'with' if gst else 'without'} GStreamer)")]
    gst_launch = shutil.which("gst-launch-1.0")
    wants_gst = h.config is not None and any(s.kind == "gstreamer" for s in h.config.sources)
    if gst:
        rows.append(_ok("capture path", "GStreamer pipelines through OpenCV's GStreamer backend"))
    elif gst_launch:
        rows.append(
            _ok(
                "capture path",
                f"GStreamer pipelines through a {gst_launch} subprocess (OpenCV lacks GStreamer)",
            )
        )
    elif wants_gst:
        rows.append(
            _fail(
                "capture path",
                "a GStreamer source is configured but OpenCV lacks GStreamer and gst-launch-1.0 is missing",
            )
        )
    else:
        rows.append(
            _warn(
                "capture path", "no GStreamer (OpenCV without it, no gst-launch-1.0): CSI cameras unavailable"
            )
        )
    return rows


# -- devices --------------------------------------------------------------------------------------------
_VIDIOC_QUERYCAP = 0x80685600  # _IOR('V', 0, struct v4l2_capability), 104 bytes (linux/videodev2.h)
_V4L2_CAP_VIDEO_CAPTURE = 0x00000001
_V4L2_CAP_VIDEO_CAPTURE_MPLANE = 0x00001000
_V4L2_CAP_DEVICE_CAPS = 0x80000000


def _v4l2_caps(path: Path) -> str | None:
    """'capture' / 'no capture (metadata...)' from VIDIOC_QUERYCAP, or None when it cannot be asked."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        buf = fcntl.ioctl(fd, _VIDIOC_QUERYCAP, bytes(104))
    except OSError:
        return None
    finally:
        os.close(fd)
    caps, device_caps = struct.unpack_from("<II", buf, 84)
    use = device_caps if caps & _V4L2_CAP_DEVICE_CAPS else caps
    card = buf[16:48].split(b"\0")[0].decode(errors="replace")
    if use & (_V4L2_CAP_VIDEO_CAPTURE | _V4L2_CAP_VIDEO_CAPTURE_MPLANE):
        return f"capture, {card}"
    return f"no video capture (metadata node?), {card}"


def _check_cameras(h: _Host) -> list[CheckResult]:
    devs = sorted(
        (Path(p) for p in glob.glob(str(h.path("/dev/video*")))),
        key=lambda p: int(re.sub(r"\D", "", p.name) or 0),
    )
    rows: list[CheckResult] = []
    if not devs:
        rows.append(_warn("cameras", "no /dev/video* devices (USB/CSI cameras)"))
    else:
        parts, denied = [], []
        for dev in devs:
            name = h.read(f"/sys/class/video4linux/{dev.name}/name") or "?"
            caps = _v4l2_caps(dev)
            parts.append(f"/dev/{dev.name} ({name}{'; ' + caps if caps else ''})")
            if not os.access(dev, os.R_OK | os.W_OK):
                denied.append(f"/dev/{dev.name}")
        detail = f"{len(devs)} found: " + ", ".join(parts)
        if denied:
            rows.append(
                _fail(
                    "cameras", f"{detail}; not accessible: {', '.join(denied)} (add the user to group video)"
                )
            )
        else:
            rows.append(_ok("cameras", detail))
    for src in h.config.sources if h.config is not None else []:
        rows.append(_check_source(h, src))
    return rows


def _check_source(h: _Host, src: Any) -> CheckResult:
    check = f"source {src.name}"
    kind, uri = src.kind, src.uri
    if kind == "v4l2":
        dev = f"/dev/video{uri}" if isinstance(uri, int) else str(uri)
        p = h.path(dev)
        if not p.exists():
            return _fail(check, f"{dev} does not exist")
        if not os.access(p, os.R_OK | os.W_OK):
            return _fail(check, f"{dev} is not readable/writable by this user (group video)")
        return _ok(check, f"{dev} present")
    if kind == "file":
        return (
            _ok(check, f"video file {uri}") if Path(str(uri)).is_file() else _fail(check, f"{uri} not found")
        )
    if kind in ("gstreamer", "csi"):
        from edgevlm.daemon.capture import capture_path, subprocess_pipeline

        path = capture_path(src)
        if path == "opencv-gstreamer":
            return _ok(check, f"{kind} source read through OpenCV's GStreamer backend")
        exe = shutil.which(src.gst_launch)
        if exe is None:
            return _fail(check, f"{kind} source needs {src.gst_launch} (OpenCV lacks GStreamer): "
                                "apt-get install gstreamer1.0-tools")  # fmt: skip
        try:
            _, w, h = subprocess_pipeline(src)
        except ValueError as exc:
            return _fail(check, str(exc))
        return _ok(check, f"{kind} source read as {w}x{h} BGR from a {exe} subprocess (OpenCV lacks GStreamer)")
    return _ok(check, f"{kind} source (not probed)")


def _check_microphones(h: _Host) -> CheckResult:
    try:
        import sounddevice as sd

        inputs = [d for d in sd.query_devices() if d.get("max_input_channels", 0) > 0]
        if inputs:
            names = ", ".join(
                f"{d['name']} ({d['max_input_channels']} ch, {int(d['default_samplerate'])} Hz)"
                for d in inputs
            )
            return _ok("microphones", f"PortAudio: {len(inputs)} input device(s): {names}")
        via = "PortAudio: no input device"
    except Exception as exc:  # noqa: BLE001 - not installed, or PortAudio missing (OSError)
        via = f"sounddevice unavailable ({type(exc).__name__})"
    cards = {}
    for line in (h.read("/proc/asound/cards") or "").splitlines():
        m = re.match(r"\s*(\d+)\s+\[[^\]]*\]:\s*(.*)", line)
        if m:
            cards[m.group(1)] = m.group(2).split(" - ", 1)[-1].strip()
    pcms = sorted(glob.glob(str(h.path("/dev/snd/pcmC*D*c"))))
    if not pcms:
        return _warn("microphones", f"{via}; no ALSA capture device (/dev/snd/pcmC*D*c)")
    parts, denied = [], []
    for p in pcms:
        m = re.search(r"pcmC(\d+)D(\d+)c$", p)
        card = cards.get(m.group(1), "?") if m else "?"
        parts.append(f"{Path(p).name} ({card})")
        if not os.access(p, os.R_OK | os.W_OK):
            denied.append(Path(p).name)
    detail = f"{via}; ALSA: {len(pcms)} capture device(s): {', '.join(parts)}"
    if denied:
        return _fail(
            "microphones", f"{detail}; not accessible: {', '.join(denied)} (add the user to group audio)"
        )
    return _ok("microphones", detail)


# -- broker ---------------------------------------------------------------------------------------------
_CONNACK_REASONS = {
    0x80: "unspecified error", 0x81: "malformed packet", 0x82: "protocol error", 0x84: "unsupported protocol version",
    0x85: "client identifier not valid", 0x86: "bad user name or password", 0x87: "not authorized",
    0x88: "server unavailable", 0x89: "server busy", 0x8A: "banned", 0x8C: "bad authentication method",
    0x95: "packet too large", 0x97: "quota exceeded", 0x9F: "connection rate exceeded",
}  # fmt: skip


def _mqtt_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the server")
        buf += chunk
    return buf


def mqtt_probe(
    host: str,
    port: int,
    *,
    timeout_s: float = 3.0,
    username: str | None = None,
    password: str | None = None,
    tls: Any = None,
) -> CheckResult:
    """Connect to an MQTT broker, send an MQTT 5.0 CONNECT (spec §3.1) with a random client id
    (never the daemon's, which would take its session over), read the CONNACK (§3.2), disconnect.

    ``tls`` is a config object with ``ca_certs``, ``certfile``, ``keyfile``, ``insecure`` (or None).
    Returns a ``broker`` row: OK with the round trip in ms, or FAIL naming the reason.
    """
    check, where = "broker", f"{host}:{port}"
    flags = 0x02  # clean start
    payload = _mqtt_str(f"edgevlm-doctor-{secrets.token_hex(4)}")
    if username is not None:
        flags |= 0x80
        payload += _mqtt_str(username)
        if password is not None:
            flags |= 0x40
            payload += _mqtt_str(password)
    var = _mqtt_str("MQTT") + bytes([5, flags]) + struct.pack("!H", 10) + _varint(0)
    packet = bytes([0x10]) + _varint(len(var) + len(payload)) + var + payload
    t0 = time.perf_counter()
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        return _fail(check, f"{where}: cannot connect: {exc.strerror or exc}")
    try:
        sock: socket.socket = raw
        if tls is not None:
            ctx = ssl.create_default_context(cafile=str(tls.ca_certs) if tls.ca_certs else None)
            if tls.certfile:
                ctx.load_cert_chain(str(tls.certfile), str(tls.keyfile) if tls.keyfile else None)
            if tls.insecure:
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            sock = ctx.wrap_socket(raw, server_hostname=host)
        sock.settimeout(timeout_s)
        sock.sendall(packet)
        head = _recv_exact(sock, 2)
        if head[0] >> 4 != 2:
            return _fail(check, f"{where}: not an MQTT broker (first reply byte 0x{head[0]:02x})")
        length, shift, byte = 0, 0, head[1]
        while True:  # remaining length: variable byte integer (spec §1.5.5)
            length += (byte & 0x7F) << shift
            if not byte & 0x80 or shift > 21:
                break
            shift += 7
            byte = _recv_exact(sock, 1)[0]
        body = _recv_exact(sock, length)
        rtt_ms = (time.perf_counter() - t0) * 1000
        code = body[1] if len(body) >= 2 else 0xFF
        if length == 2 and code in (1, 2, 3, 4, 5):  # an MQTT 3.1.1 CONNACK return code
            if code == 1:
                return _fail(check, f"{where}: the broker does not speak MQTT v5 (3.1.1 only)")
            return _fail(check, f"{where}: connection refused (MQTT 3.1.1 return code {code})")
        if code != 0:
            return _fail(check, f"{where}: CONNACK {_CONNACK_REASONS.get(code, f'reason 0x{code:02x}')}")
        with contextlib.suppress(OSError):
            sock.sendall(b"\xe0\x00")  # DISCONNECT, normal
        secure = ", TLS" if tls is not None else ""
        return _ok(check, f"{where}: MQTT v5 CONNACK in {rtt_ms:.1f} ms{secure}")
    except ssl.SSLError as exc:
        return _fail(check, f"{where}: TLS handshake failed: {exc.reason or exc}")
    except (OSError, ConnectionError) as exc:
        return _fail(check, f"{where}: no MQTT answer: {exc}")
    finally:
        raw.close()


# -- Jetson ---------------------------------------------------------------------------------------------
def _check_jetson(h: _Host) -> list[CheckResult]:
    if not h.is_jetson:
        return [_ok("jetson", "not a Jetson (Jetson checks skipped)")]
    return [_ok("jetson", f"{h.jetson_model or 'Jetson'}, {h.l4t or 'L4T release unknown'}")]


def _check_power_mode(h: _Host) -> CheckResult:
    nvpmodel = shutil.which("nvpmodel")
    if nvpmodel is None:
        if h.is_jetson:
            return _warn("power mode", "nvpmodel not found (sudo apt-get install nvidia-l4t-tools)")
        return _ok("power mode", "nvpmodel not present (not a Jetson)")
    try:
        proc = subprocess.run([nvpmodel, "-q"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _warn("power mode", f"nvpmodel -q failed: {exc}")
    m = re.search(r"NV Power Mode:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or m is None:
        return _warn(
            "power mode", f"nvpmodel -q: {(proc.stderr or proc.stdout).strip()[:200] or 'no answer'}"
        )
    rest = proc.stdout[m.end() :].split()
    mode_id = rest[0] if rest and rest[0].isdigit() else "?"
    return _ok("power mode", f"{m.group(1).strip()} (mode {mode_id})")


def _read_int(h: _Host, path: str) -> int | None:
    text = h.read(path)
    return int(text) if text and text.strip().lstrip("-").isdigit() else None


def _check_clocks(h: _Host) -> CheckResult:
    parts, warn = [], False
    for node in sorted(glob.glob(str(h.path("/sys/class/devfreq/*")))):
        name = Path(node).name
        if not re.search(r"gpu|gv11b|gp10b|ga10b|gb10b", name):
            continue
        rel = f"/sys/class/devfreq/{name}"
        cur, mx = _read_int(h, f"{rel}/cur_freq"), _read_int(h, f"{rel}/max_freq")
        gov = h.read(f"{rel}/governor") or "?"
        if cur is not None and mx:
            parts.append(f"GPU {cur // 1_000_000}/{mx // 1_000_000} MHz ({gov})")
            warn = warn or cur < 0.99 * mx
    cur, mx = (_read_int(h, f"/sys/devices/system/cpu/cpu0/cpufreq/scaling_{k}_freq") for k in ("cur", "max"))
    if cur is not None and mx:
        parts.append(f"CPU0 {cur // 1000}/{mx // 1000} MHz")
    if not parts:
        return _ok(
            "clocks", "no GPU devfreq or CPU cpufreq readings" + ("" if h.is_jetson else " (not a Jetson)")
        )
    detail = ", ".join(parts)
    if warn and h.is_jetson:
        return _warn(
            "clocks", f"{detail}: GPU not at its maximum clock; `sudo jetson_clocks` gives steadier latency"
        )
    return _ok("clocks", detail)


def _check_tegrastats(h: _Host) -> CheckResult:
    path = shutil.which("tegrastats")
    if path:
        return _ok("tegrastats", f"{path} (Jetson telemetry available)")
    if h.is_jetson:
        return _warn("tegrastats", "not found: no temperature/clock telemetry for the latency controller")
    return _ok("tegrastats", "not present (not a Jetson)")


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
) -> list[CheckResult]:
    """Run every check and return the rows in a stable order (see the module doc).

    Args:
        config: a :class:`edgevlm.config.DaemonConfig` (sources, model device/backend, broker).
        broker: ``(host, port)`` to probe; default: the config's broker, else ``localhost:1883``.
        timeout_s: broker connect/answer timeout.
        root: folder the host paths (``/dev``, ``/sys``, ``/proc``, ``/etc``) are read under.
    """
    h = _Host(Path(root), config)
    h.jetson_model = (h.read("/proc/device-tree/model") or "") or None
    if h.jetson_model and "jetson" not in h.jetson_model.lower():
        h.jetson_model = None
    release = h.read("/etc/nv_tegra_release")
    if release:
        m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release)
        h.l4t = f"L4T R{m.group(1)}.{m.group(2)}" if m else "L4T (unparsed release file)"
    if broker is None:
        broker = (config.mqtt.host, config.mqtt.port) if config is not None else ("localhost", 1883)
    mq = config.mqtt if config is not None else None
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
    ):
        rows += _guard(name, fn, h)
    rows += _guard(
        "broker",
        lambda: mqtt_probe(
            broker[0], broker[1], timeout_s=timeout_s,
            username=mq.username if mq else None, password=mq.password if mq else None, tls=mq.tls if mq else None,
        ),
    )  # fmt: skip
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` options (for a subcommand of the ``edgevlm`` CLI)."""
    parser.add_argument("--config", type=Path, help="daemon config to check (sources, model, broker)")
    parser.add_argument("--broker", type=_parse_broker, help="HOST[:PORT] to probe (default: the config's)")
    parser.add_argument("--timeout", type=float, default=3.0, help="broker timeout in seconds (default 3)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the checks for parsed :func:`add_arguments` options, print the report, return the exit
    code: 0 = no FAIL, 1 = at least one FAIL (a config that does not load is a FAIL row)."""
    rows: list[CheckResult] = []
    config = None
    if args.config is not None:
        from edgevlm.config import load_daemon_config
        from edgevlm.errors import ConfigError

        try:
            config = load_daemon_config(args.config)
            rows.append(_ok("config", f"{args.config}: valid"))
        except ConfigError as exc:
            rows.append(_fail("config", f"{args.config}: {exc}"))
    checks = run_checks(config, broker=args.broker, timeout_s=args.timeout)
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

    Returns 0 (no FAIL), 1 (some FAIL) or 2 (bad arguments; argparse prints one usage line)."""
    parser = argparse.ArgumentParser(prog="edgevlm doctor", description="Check this machine for edgevlm.")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if exc.code in (0, None) else EXIT_USAGE
    if args.timeout <= 0:
        print("edgevlm doctor: error: --timeout must be > 0", file=sys.stderr)
        return EXIT_USAGE
    return run_from_args(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
