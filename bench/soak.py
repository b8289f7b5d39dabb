"""Soak test: the daemon under mixed good and bad requests with a broker restart and a camera dropout.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 2] [--interval-s 0.5] [--model DIR|demo]
        [--broker-down-s 5] [--dropout-s 20] [--keep]

Runs, all real and local: mosquitto with persistence on a free loopback port; the daemon as a
process (``edgevlm.daemon.app.run``) with a camera read through ``gst-launch-1.0`` (videotestsrc
through a wrapper script that "unplugs" the camera while a flag file exists; a small Python frame
writer stands in when gst-launch-1.0 is missing) and MQTT sessions kept across broker restarts
(``mqtt.session_expiry_s``); ``--clients`` paho MQTT v5 clients (persistent sessions too) each
sending a request every ``--interval-s``, drawn from 13 kinds: 7 valid (5 camera questions, 2
inline PNGs) and 6 invalid (malformed JSON, wrong shape, negative timeout, unknown source,
truncated JPEG, a decompression-bomb PNG). At 30 % of the run the broker is stopped for ``--broker-down-s``; at 60 %
the camera is unplugged for ``--dropout-s``. After the run every request gets 90 s to be
answered, then the daemon gets SIGTERM and must exit 0 after publishing "offline".

A valid request is *lost* when no response ever arrives. Valid requests answered with an error
(a camera question during the dropout gets ``INTERNAL`` with ``stale_frame``/``no_frame``) are
reported by code; an invalid request must get its expected error code. The model defaults to a tiny
random checkpoint (robustness, not accuracy; ``--model demo`` uses the shipped demo model).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

DEVICE = "soak"
SOURCE = "cam"
CAMERA_PIPELINE = ("videotestsrc is-live=true pattern=ball ! video/x-raw,format=BGR,width=160,height=120,"
                   "framerate=10/1 ! appsink")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PersistentBroker:
    """mosquitto with persistence on a fixed port, restartable (sessions and queued QoS 1
    messages survive a restart)."""

    def __init__(self, exe: str, work: Path) -> None:
        self.exe, self.work, self.port = exe, work, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        (work / "db").mkdir(exist_ok=True)
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence true",
                 f"persistence_location {work / 'db'}/", "autosave_interval 1", "max_queued_messages 100000",
                 f"log_dest file {work / 'mosquitto.log'}", "log_type error", "log_type warning", "log_type notice"]  # fmt: skip
        if os.geteuid() == 0:
            lines.append("user root")
        (work / "mosquitto.conf").write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        for _ in range(100):
            self.proc = subprocess.Popen([self.exe, "-c", str(self.work / "mosquitto.conf")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    return
                except OSError:
                    time.sleep(0.05)
            time.sleep(0.2)  # the port may still be held after a restart: try again
        raise RuntimeError("mosquitto did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: mosquitto saves its persistence database
            self.proc.wait(15)
        self.proc = None


def camera_wrapper(work: Path, flag: Path) -> Path:
    """An executable standing in for gst-launch-1.0 that fails while ``flag`` exists and stops a
    running pipeline when it appears (an unplugged camera)."""
    gst = shutil.which("gst-launch-1.0")
    path = work / "camera"
    if gst is not None:
        path.write_text(f"""#!/bin/sh
[ -e "{flag}" ] && {{ echo "camera unplugged" >&2; exit 1; }}
"{gst}" "$@" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  if [ -e "{flag}" ]; then kill "$pid"; wait "$pid"; exit 1; fi
  sleep 0.2
done
wait "$pid"
""")
    else:
        path.write_text(f"""#!{sys.executable}
import os, re, sys, time
flag = {str(flag)!r}
if os.path.exists(flag):
    sys.exit("camera unplugged")
text = " ".join(sys.argv[1:])
w, h = int(re.findall(r"width=(\\d+)", text)[-1]), int(re.findall(r"height=(\\d+)", text)[-1])
i = 0
while not os.path.exists(flag):
    sys.stdout.buffer.write(bytes([i % 256, 64, 128]) * (w * h)); sys.stdout.buffer.flush()
    i += 1; time.sleep(0.1)
sys.exit(1)
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def png_bytes(rgb: np.ndarray) -> bytes:
    import cv2

    return cv2.imencode(".png", rgb[:, :, ::-1].copy())[1].tobytes()


def bomb_png(side: int = 12000) -> bytes:
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(bytes(side + 1)) for _ in range(side)) + comp.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = side.to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def request_mix() -> list[tuple[str, bytes, str | None]]:
    """``(kind, payload, expected error code or None for valid)``."""
    import cv2

    rng = np.random.default_rng(0)
    scene = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    png = base64.b64encode(png_bytes(scene)).decode()
    jpeg = cv2.imencode(".jpg", scene)[1].tobytes()
    cut = base64.b64encode(jpeg[: len(jpeg) // 2]).decode()
    bomb = base64.b64encode(bomb_png()).decode()

    def js(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj).encode()

    valid_cam = js({"prompt": "What is in front of me?", "source": SOURCE, "max_new_tokens": 4, "timeout_ms": 30000})
    valid_png = js({"prompt": "What colour is it?", "image_b64": png, "max_new_tokens": 4, "timeout_ms": 30000})
    return [
        *[("valid_camera", valid_cam, None)] * 5,
        *[("valid_inline", valid_png, None)] * 2,
        ("malformed_json", b'{"prompt": "x", ', "INVALID_REQUEST"),
        ("wrong_shape", js({"prompt": 3, "source": SOURCE}), "INVALID_REQUEST"),
        ("negative_timeout", js({"prompt": "x", "source": SOURCE, "timeout_ms": -5}), "INVALID_REQUEST"),
        ("unknown_source", js({"prompt": "x", "source": "rear"}), "UNKNOWN_SOURCE"),
        ("truncated_jpeg", js({"prompt": "x", "image_b64": cut}), "INVALID_IMAGE"),
        ("bomb_png", js({"prompt": "x", "image_b64": bomb}), "INVALID_IMAGE"),
    ]


class LoadClient:
    """One MQTT v5 client with a persistent session sending requests and recording responses."""

    def __init__(self, index: int, port: int, records: dict[bytes, dict[str, Any]], lock: threading.Lock) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.records, self.lock = records, lock
        self.topic = f"soak/resp/{index}"
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"soak-client-{index}", protocol=mqtt.MQTTv5)
        self.client.reconnect_delay_set(0.2, 2)
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(self.topic, qos=1) if not rc.is_failure else None
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", port, clean_start=mqtt.MQTT_CLEAN_START_FIRST_ONLY, properties=props)
        self.client.loop_start()
        self._props = Properties
        self._ptype = PacketTypes

    def send(self, kind: str, payload: bytes, expected: str | None) -> None:
        corr = uuid.uuid4().bytes
        props = self._props(self._ptype.PUBLISH)
        props.ResponseTopic, props.CorrelationData = self.topic, corr
        with self.lock:
            self.records[corr] = {"kind": kind, "expected": expected, "sent": time.monotonic(), "wall": time.time()}
        self.client.publish(f"edgevlm/{DEVICE}/request", payload, qos=1, properties=props)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        try:
            body = json.loads(msg.payload)
        except ValueError:
            body = {"ok": False, "error": {"code": "UNPARSEABLE"}}
        with self.lock:
            rec = self.records.get(bytes(corr) if corr else b"")
            if rec is None:
                return
            rec["responses"] = rec.get("responses", 0) + 1
            if "latency_s" not in rec:
                rec["latency_s"] = time.monotonic() - rec["sent"]
                rec["ok"] = bool(body.get("ok"))
                err = body.get("error") or {}
                rec["code"] = "OK" if rec["ok"] else err.get("code", "?")
                rec["reason"] = (err.get("details") or {}).get("reason")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--interval-s", type=float, default=0.5, help="per client, between requests")
    ap.add_argument("--model", default=None, help="model folder, 'demo', or none (a tiny random checkpoint)")
    ap.add_argument("--broker-down-s", type=float, default=5.0)
    ap.add_argument("--dropout-s", type=float, default=20.0)
    ap.add_argument("--drain-s", type=float, default=90.0)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = ap.parse_args(argv)

    import yaml

    from edgevlm.daemon.demo import find_mosquitto

    exe, _ = find_mosquitto()
    if exe is None:
        print("mosquitto not found: apt-get install mosquitto", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="edgevlm-soak-"))
    model: str | None
    if args.model == "demo":
        model = None
    elif args.model:
        model = str(Path(args.model).resolve())
    else:
        from edgevlm.runtime.testing import write_tiny_checkpoint

        model = str(write_tiny_checkpoint(work / "tiny", seed=0))
    flag = work / "camera-unplugged"
    broker = PersistentBroker(exe, work)
    broker.start()
    cfg = {
        "mqtt": {"host": "127.0.0.1", "port": broker.port, "device_id": DEVICE, "session_expiry_s": 3600,
                 "reconnect_min_delay_s": 0.2, "reconnect_max_delay_s": 2.0},
        "model": {"path": model, "device": "cpu"},
        "sources": [{"name": SOURCE, "uri": CAMERA_PIPELINE, "capture": "subprocess",
                     "gst_launch": str(camera_wrapper(work, flag)), "read_timeout_s": 2.0, "open_timeout_s": 5.0,
                     "reopen_delay_s": 0.5, "reconnect_max_delay_s": 4.0, "max_frame_age_s": 2.0}],
        "queue_max_size": 32,
        # robustness, not latency: a generous budget keeps the latency controller from refusing
        # requests on a slow, shared CPU (DEADLINE_EXCEEDED is still counted if it happens)
        "controller": {"default_budget_ms": 30000},
        "defaults": {"max_new_tokens": 4, "timeout_ms": 30000},
        "metrics": {"listen": "127.0.0.1:0"},
        "telemetry": {"interval_s": 10},
        "log_level": "INFO",
    }  # fmt: skip
    (work / "daemon.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    run = ("import sys; from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; "
           "sys.exit(run(load_daemon_config(sys.argv[1])))")  # fmt: skip
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - closed at the end
    daemon = subprocess.Popen([sys.executable, "-c", run, str(work / "daemon.yaml")], stdout=log, stderr=log)

    records: dict[bytes, dict[str, Any]] = {}
    lock = threading.Lock()
    status: list[dict[str, Any]] = []
    watcher = _status_watcher(broker.port, status)
    t_wait = time.monotonic()
    while not any(s.get("state") == "online" for s in status):
        if daemon.poll() is not None or time.monotonic() - t_wait > 300:
            print(f"daemon did not come online (see {work / 'daemon.log'})", file=sys.stderr)
            return 1
        time.sleep(0.1)

    clients = [LoadClient(i, broker.port, records, lock) for i in range(args.clients)]
    mix = request_mix()
    duration = args.minutes * 60.0
    events: dict[str, list[float]] = {}
    stop = threading.Event()
    t0 = time.monotonic()

    def load(client: LoadClient, seed: int) -> None:
        rnd = random.Random(seed)
        nxt = time.monotonic()
        while not stop.is_set():
            kind, payload, expected = rnd.choice(mix)
            client.send(kind, payload, expected)
            nxt += args.interval_s
            stop.wait(max(0.0, nxt - time.monotonic()))

    threads = [threading.Thread(target=load, args=(c, i), daemon=True) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    try:
        _sleep_until(t0 + 0.3 * duration)
        events["broker_restart"] = [time.monotonic() - t0]
        broker.stop()
        time.sleep(args.broker_down_s)
        broker.start()
        events["broker_restart"].append(time.monotonic() - t0)
        _sleep_until(t0 + 0.6 * duration)
        events["camera_dropout"] = [time.monotonic() - t0]
        flag.touch()
        time.sleep(args.dropout_s)
        flag.unlink()
        events["camera_dropout"].append(time.monotonic() - t0)
        _sleep_until(t0 + duration)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    sent_until = time.monotonic()
    while time.monotonic() - sent_until < args.drain_s:
        with lock:
            if all("code" in r for r in records.values()):
                break
        time.sleep(0.5)
    daemon.send_signal(signal.SIGTERM)
    try:
        exit_code = daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
        exit_code = daemon.wait()
    log.close()
    time.sleep(0.5)
    for c in clients:
        c.close()
    watcher.disconnect()
    watcher.loop_stop()
    broker.stop()
    report = summarise(records, events, exit_code, status, args, t0)
    print_report(report)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder: {work}", file=sys.stderr)
    return 0 if report["lost_valid"] == 0 and report["daemon_exit_code"] == 0 and not report["wrong_code"] else 1


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _status_watcher(port: int, out: list[dict[str, Any]]) -> Any:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.reconnect_delay_set(0.2, 2)
    c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(f"edgevlm/{DEVICE}/status", qos=1)
    c.on_message = lambda cl, u, m: out.append(json.loads(m.payload))
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1000, 1)


def summarise(records: dict[bytes, dict[str, Any]], events: dict[str, list[float]], exit_code: int,
              status: list[dict[str, Any]], args: argparse.Namespace, t0: float) -> dict[str, Any]:  # fmt: skip
    valid = [r for r in records.values() if r["expected"] is None]
    invalid = [r for r in records.values() if r["expected"] is not None]
    lost_valid = [r for r in valid if "code" not in r]
    valid_codes = Counter(r.get("code", "LOST") for r in valid)
    valid_errors = Counter(f"{r['code']}:{r.get('reason') or '-'}" for r in valid if r.get("code") not in (None, "OK"))
    wrong = [r for r in invalid if r.get("code") != r["expected"]]
    lat = [r["latency_s"] for r in valid if r.get("code") == "OK"]
    drop = events.get("camera_dropout", [0, 0])
    drop_errors = [r for r in valid if r.get("code") not in (None, "OK")
                   and drop[0] - 5 <= r["sent"] - t0 <= drop[1] + 10]  # fmt: skip
    return {
        "metric": "soak",
        "minutes": args.minutes,
        "clients": args.clients,
        "sent": len(records),
        "sent_valid": len(valid),
        "sent_invalid": len(invalid),
        "valid_ok": valid_codes.get("OK", 0),
        "valid_errors": dict(valid_errors),
        "valid_errors_during_camera_dropout": len(drop_errors),
        "lost_valid": len(lost_valid),
        "lost_invalid": sum("code" not in r for r in invalid),
        "wrong_code": len(wrong),
        "wrong_code_examples": [(r["kind"], r.get("code")) for r in wrong[:5]],
        "duplicate_responses": sum(r.get("responses", 0) > 1 for r in records.values()),
        "ok_latency_p50_ms": _pct(lat, 0.5),
        "ok_latency_p95_ms": _pct(lat, 0.95),
        "ok_latency_max_ms": _pct(lat, 1.0),
        "broker_restart_s": [round(x, 1) for x in events.get("broker_restart", [])],
        "camera_dropout_s": [round(x, 1) for x in events.get("camera_dropout", [])],
        "daemon_exit_code": exit_code,
        "final_status": status[-1].get("state") if status else None,
    }


def print_report(r: dict[str, Any]) -> None:
    rows = [
        ("duration (min)", r["minutes"]), ("requests sent", r["sent"]), ("  valid", r["sent_valid"]),
        ("  invalid", r["sent_invalid"]), ("valid answered OK", r["valid_ok"]),
        ("valid answered with an error", sum(r["valid_errors"].values())),
        *[(f"    {k}", v) for k, v in sorted(r["valid_errors"].items())],
        ("  of which during the camera dropout", r["valid_errors_during_camera_dropout"]),
        ("valid LOST (never answered)", r["lost_valid"]), ("invalid never answered", r["lost_invalid"]),
        ("invalid with a wrong error code", r["wrong_code"]), ("duplicate responses", r["duplicate_responses"]),
        ("OK latency p50 / p95 / max (ms)", f"{r['ok_latency_p50_ms']} / {r['ok_latency_p95_ms']} / {r['ok_latency_max_ms']}"),
        ("broker down (s from start)", r["broker_restart_s"]), ("camera unplugged (s from start)", r["camera_dropout_s"]),
        ("daemon exit code after SIGTERM", r["daemon_exit_code"]), ("last retained status", r["final_status"]),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps(r, separators=(",", ":")))


if __name__ == "__main__":
    sys.exit(main())
