"""``edgevlm doctor``'s device rows: ``cameras`` (``/dev/video*`` with V4L2 capabilities),
``source <name>`` per configured source, ``microphones`` and ``audio <name>`` per configured audio
source. See :mod:`edgevlm.daemon.doctor`."""

from __future__ import annotations

import glob
import os
import re
import shutil
from pathlib import Path
from typing import Any

from edgevlm.daemon.audio import import_sounddevice
from edgevlm.daemon.doctor_host import CheckResult, _fail, _Host, _ok, _warn
from edgevlm.daemon.v4l2 import query_capability


def _v4l2_caps(path: Path) -> str | None:
    """'capture' / 'no capture (metadata...)' from VIDIOC_QUERYCAP, or None when it cannot be asked."""
    try:
        cap = query_capability(path)
    except OSError:
        return None
    if cap is None:
        return None
    if cap.video_capture:
        return f"capture, {cap.card}"
    return f"no video capture (metadata node?), {cap.card}"


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


def _check_audio_sources(h: _Host) -> list[CheckResult]:
    """``audio <name>`` per configured audio source: a WAV file as a video file is listed (its format and
    length, or why it cannot be played), a microphone by the device it opens."""
    from edgevlm.daemon.wav import WavFormatError, read_wav_info

    rows: list[CheckResult] = []
    for mic in h.config.audio if h.config is not None else []:
        check = f"audio {mic.name}"
        if mic.file is None:
            device = "the default input" if mic.device is None else f"device {mic.device!r}"
            rows.append(_ok(check, f"microphone: PortAudio {device} (see microphones)"))
            continue
        try:
            info, frames = read_wav_info(mic.file)
        except FileNotFoundError:
            rows.append(_fail(check, f"{mic.file} not found"))
            continue
        except (OSError, WavFormatError) as exc:
            rows.append(_fail(check, f"WAV file {mic.file}: {exc}"))
            continue
        seconds = frames / info.sample_rate_hz
        rows.append(_ok(check, f"WAV file {mic.file} ({info.sample_rate_hz} Hz, {info.channels} ch, {seconds:.1f} s"
                               f"{', looped' if mic.loop else ', played once'})"))  # fmt: skip
    return rows


def _check_microphones(h: _Host) -> CheckResult:
    try:
        sd = import_sounddevice()  # ImportError naming the fix: the pip extra, or apt-get install libportaudio2
        inputs = [d for d in sd.query_devices() if d.get("max_input_channels", 0) > 0]
        if inputs:
            names = ", ".join(
                f"{d['name']} ({d['max_input_channels']} ch, {int(d['default_samplerate'])} Hz)"
                for d in inputs
            )
            return _ok("microphones", f"PortAudio: {len(inputs)} input device(s): {names}")
        via = "PortAudio: no input device"
    except ImportError as exc:  # sounddevice or the PortAudio library missing: the message says what to install
        via = str(exc)
    except Exception as exc:  # noqa: BLE001 - PortAudio itself failing: name it
        via = f"PortAudio: cannot list devices ({type(exc).__name__}: {exc})"
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
