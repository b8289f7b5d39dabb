"""Soak test: the daemon under mixed good and bad requests while the broker, the daemon and the camera fail.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 2] [--interval-s 0.5] [--timeout-s 30]
        [--model DIR|demo] [--broker-down-s 5] [--daemon-down-s 3] [--sigstop-s 20] [--dropout-s 20]
        [--out FILE] [--keep]

Runs, all real and local: mosquitto with persistence on a free loopback port; the daemon as a
process (``edgevlm.daemon.app.run``) with a camera read through ``gst-launch-1.0`` (videotestsrc
through a wrapper script that "unplugs" the camera while a flag file exists; a small Python frame
writer stands in when gst-launch-1.0 is missing) and a persistent MQTT session
(``mqtt.session_expiry_s``); ``--clients`` SDK clients (:class:`edgevlm.Client`, which re-sends an
unanswered request with the same Correlation Data until its deadline) each sending a request every
``--interval-s`` with ``--timeout-s``, drawn from 13 kinds: 7 valid (5 camera questions, 2 inline
PNGs) and 6 invalid (malformed JSON, wrong shape, negative timeout, unknown source, truncated JPEG,
a decompression-bomb PNG). The faults, at fractions of the run: 15 % the broker is killed (-9) for
``--broker-down-s``; 30 % it is stopped (SIGTERM) as long; 45 % the daemon is killed (-9) and
started again ``--daemon-down-s`` later (a new process: the model loads again); 60 % the camera is
unplugged for ``--dropout-s``; 80 % the daemon is stopped (SIGSTOP) for ``--sigstop-s``. At the
end every ask has returned (each by its deadline), then the daemon gets SIGTERM and must exit 0.

A valid request is *lost* when the application got no answer by its deadline. Valid requests
answered with an error (a camera question during the dropout gets ``INTERNAL`` with
``stale_frame``/``no_frame``; one whose deadline passed during an outage ``DEADLINE_EXCEEDED``) are
reported by code; an invalid request must get its expected error code. *Answered twice* counts
requests the application got more than one answer for; *ran twice* counts Correlation Data for which
a spy on the response topics saw two different responses (the request ran twice: the daemon's
recent-answers cache re-sends the same bytes). For the daemon kill it reports the requests sent
from the kill until the new process re-subscribed and how many of them were answered. The model
defaults to a tiny random checkpoint (robustness, not accuracy; ``--model demo`` uses the shipped
demo model). Prints a table, then one JSON line; exits 1 unless 0 valid requests were lost, 0 were
answered twice, every invalid one got its code and the daemon exited 0.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
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

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (mosquitto saves its persistence database) or SIGKILL (what changed since the
        last autosave is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
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
    """One SDK client (:class:`edgevlm.Client`, re-sends on) sending requests from a thread pool and
    recording what the application gets back; a spy on its response topic records every response
    that reaches the wire (to see a request that ran twice)."""

    def __init__(self, index: int, port: int, records: list[dict[str, Any]], lock: threading.Lock,
                 timeout_s: float) -> None:  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        from edgevlm import Client

        self.records, self.lock, self.timeout_s = records, lock, timeout_s
        self.client = Client("127.0.0.1", port, DEVICE, client_id=f"soak-client-{index}", connect_timeout_s=30)
        self.pool = ThreadPoolExecutor(max_workers=96, thread_name_prefix=f"soak-{index}")

    def send(self, kind: str, payload: bytes, expected: str | None) -> None:
        rec: dict[str, Any] = {"kind": kind, "expected": expected, "sent": time.monotonic(), "answers": 0}
        with self.lock:
            self.records.append(rec)
        self.pool.submit(self._ask, rec, payload)

    def _ask(self, rec: dict[str, Any], payload: bytes) -> None:
        from edgevlm.errors import BrokerUnreachableError, EdgeVLMError

        try:
            self.client.request(payload, timeout_s=self.timeout_s)
            code, reason = "OK", None
        except BrokerUnreachableError:
            code, reason = "LOST", "broker unreachable at the deadline"
        except EdgeVLMError as err:
            local = bool(err.details.get("local"))
            code, reason = ("LOST", "no answer by the deadline") if local else (err.code.value, err.details.get("reason"))
        except Exception as exc:  # noqa: BLE001 - recorded, the soak goes on
            code, reason = "LOST", f"{type(exc).__name__}: {exc}"
        with self.lock:
            rec["answers"] += 1
            rec["latency_s"] = time.monotonic() - rec["sent"]
            rec["code"], rec["reason"] = code, reason

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


class WireSpy:
    """Subscribes to every SDK response topic of the device and keeps, per Correlation Data, the
    distinct response payloads seen (two distinct payloads = a request that ran twice)."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.lock = threading.Lock()
        self.seen: dict[bytes, set[bytes]] = {}
        self.copies = 0
        c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5, client_id="soak-spy")
        c.reconnect_delay_set(0.2, 2)
        c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(f"edgevlm/{DEVICE}/response/#", qos=1)
        c.on_message = self._on_message
        c.connect("127.0.0.1", port)
        c.loop_start()
        self.client = c

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        corr = bytes(getattr(msg.properties, "CorrelationData", b"") or b"")
        with self.lock:
            self.copies += 1
            self.seen.setdefault(corr, set()).add(bytes(msg.payload))

    def ran_twice(self) -> int:
        with self.lock:
            return sum(len(v) > 1 for v in self.seen.values())

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class DaemonProcess:
    """``edgevlm.daemon.app.run`` in a child process, killable, stoppable and restartable."""

    RUN = ("import sys; from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; "
           "sys.exit(run(load_daemon_config(sys.argv[1])))")  # fmt: skip

    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log_path = config, log
        self.log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", self.RUN, str(self.config)], stdout=self.log,
                                     stderr=self.log)  # fmt: skip

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--interval-s", type=float, default=0.5, help="per client, between requests")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="each request's timeout_s (the SDK's deadline)")
    ap.add_argument("--model", default=None, help="model folder, 'demo', or none (a tiny random checkpoint)")
    ap.add_argument("--broker-down-s", type=float, default=5.0)
    ap.add_argument("--daemon-down-s", type=float, default=3.0, help="daemon kill -9, restarted this much later")
    ap.add_argument("--sigstop-s", type=float, default=20.0)
    ap.add_argument("--dropout-s", type=float, default=20.0)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table and the JSON line here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

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
    daemon = DaemonProcess(work / "daemon.yaml", work / "daemon.log")
    daemon.start()

    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    status: list[tuple[float, dict[str, Any]]] = []
    watcher = _status_watcher(broker.port, status)

    def online_after(t: float, timeout_s: float = 300) -> float | None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if any(ts > t and s.get("state") == "online" for ts, s in list(status)):
                return next(ts for ts, s in list(status) if ts > t and s.get("state") == "online")
            if daemon.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    if online_after(0.0) is None:
        print(f"daemon did not come online (see {work / 'daemon.log'})", file=sys.stderr)
        return 1

    spy = WireSpy(broker.port)
    clients = [LoadClient(i, broker.port, records, lock, args.timeout_s) for i in range(args.clients)]
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
        _sleep_until(t0 + 0.15 * duration)
        events["broker_kill9"] = [time.monotonic() - t0]
        broker.stop(kill=True)
        time.sleep(args.broker_down_s)
        broker.start()
        events["broker_kill9"].append(time.monotonic() - t0)
        _sleep_until(t0 + 0.3 * duration)
        events["broker_restart"] = [time.monotonic() - t0]
        broker.stop()
        time.sleep(args.broker_down_s)
        broker.start()
        events["broker_restart"].append(time.monotonic() - t0)
        _sleep_until(t0 + 0.45 * duration)
        killed = time.monotonic()
        events["daemon_kill9"] = [killed - t0]
        daemon.kill()
        time.sleep(args.daemon_down_s)
        daemon.start()
        back = online_after(killed)
        events["daemon_kill9"].append((back or time.monotonic()) - t0)
        _sleep_until(t0 + 0.6 * duration)
        events["camera_dropout"] = [time.monotonic() - t0]
        flag.touch()
        time.sleep(args.dropout_s)
        flag.unlink()
        events["camera_dropout"].append(time.monotonic() - t0)
        _sleep_until(t0 + 0.8 * duration)
        events["daemon_sigstop"] = [time.monotonic() - t0]
        daemon.signal(signal.SIGSTOP)
        time.sleep(args.sigstop_s)
        daemon.signal(signal.SIGCONT)
        events["daemon_sigstop"].append(time.monotonic() - t0)
        _sleep_until(t0 + duration)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    for c in clients:  # every ask returns by its deadline
        c.close()
    exit_code = daemon.terminate()
    daemon.close()
    time.sleep(0.5)
    spy_twice, spy_copies = spy.ran_twice(), spy.copies
    spy.close()
    watcher.disconnect()
    watcher.loop_stop()
    broker.stop()
    report = summarise(records, events, exit_code, status, args, t0, spy_twice, spy_copies)
    lines = print_report(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder: {work}", file=sys.stderr)
    ok = (report["lost_valid"] == 0 and report["answered_twice"] == 0 and report["daemon_exit_code"] == 0
          and not report["wrong_code"])  # fmt: skip
    return 0 if ok else 1


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _status_watcher(port: int, out: list[tuple[float, dict[str, Any]]]) -> Any:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.reconnect_delay_set(0.2, 2)
    c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(f"edgevlm/{DEVICE}/status", qos=1)
    c.on_message = lambda cl, u, m: out.append((time.monotonic(), json.loads(m.payload)))
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1000, 1)


def _window(records: list[dict[str, Any]], t0: float, span: list[float], after_s: float = 0.0) -> list[dict[str, Any]]:
    if len(span) < 2:
        return []
    return [r for r in records if span[0] <= r["sent"] - t0 <= span[1] + after_s]


def summarise(records: list[dict[str, Any]], events: dict[str, list[float]], exit_code: int,
              status: list[tuple[float, dict[str, Any]]], args: argparse.Namespace, t0: float,
              spy_twice: int, spy_copies: int) -> dict[str, Any]:  # fmt: skip
    valid = [r for r in records if r["expected"] is None]
    invalid = [r for r in records if r["expected"] is not None]
    lost_valid = [r for r in valid if r.get("code", "LOST") == "LOST"]
    valid_codes = Counter(r.get("code", "LOST") for r in valid)
    valid_errors = Counter(f"{r['code']}:{r.get('reason') or '-'}" for r in valid if r.get("code") not in ("OK", "LOST", None))
    wrong = [r for r in invalid if r.get("code") != r["expected"]]
    lat = [r["latency_s"] for r in valid if r.get("code") == "OK"]
    drop_errors = [r for r in _window(valid, t0, events.get("camera_dropout", []), 10)
                   if r.get("code") not in (None, "OK", "LOST")]  # fmt: skip
    killed = _window(records, t0, events.get("daemon_kill9", []))
    killed_ok = [r for r in killed if r.get("code") not in (None, "LOST")]
    kill_lat = [r["latency_s"] for r in killed_ok]
    stopped = _window(records, t0, events.get("daemon_sigstop", []))
    return {
        "metric": "soak",
        "minutes": args.minutes,
        "clients": args.clients,
        "timeout_s": args.timeout_s,
        "sent": len(records),
        "sent_valid": len(valid),
        "sent_invalid": len(invalid),
        "valid_ok": valid_codes.get("OK", 0),
        "valid_errors": dict(valid_errors),
        "valid_errors_during_camera_dropout": len(drop_errors),
        "lost_valid": len(lost_valid),
        "lost_valid_examples": [(r["kind"], round(r["sent"] - t0, 1), r.get("reason")) for r in lost_valid[:5]],
        "lost_invalid": sum(r.get("code", "LOST") == "LOST" for r in invalid),
        "wrong_code": len(wrong),
        "wrong_code_examples": [(r["kind"], r.get("code")) for r in wrong[:5]],
        "answered_twice": sum(r["answers"] > 1 for r in records),
        "ran_twice_on_the_wire": spy_twice,
        "responses_on_the_wire": spy_copies,
        "ok_latency_p50_ms": _pct(lat, 0.5),
        "ok_latency_p95_ms": _pct(lat, 0.95),
        "ok_latency_max_ms": _pct(lat, 1.0),
        "daemon_kill9_sent_until_resubscribed": len(killed),
        "daemon_kill9_answered": len(killed_ok),
        "daemon_kill9_answer_latency_max_ms": _pct(kill_lat, 1.0),
        "daemon_sigstop_sent": len(stopped),
        "daemon_sigstop_codes": dict(Counter(r.get("code", "LOST") for r in stopped)),
        "broker_kill9_s": [round(x, 1) for x in events.get("broker_kill9", [])],
        "broker_restart_s": [round(x, 1) for x in events.get("broker_restart", [])],
        "daemon_kill9_s": [round(x, 1) for x in events.get("daemon_kill9", [])],
        "camera_dropout_s": [round(x, 1) for x in events.get("camera_dropout", [])],
        "daemon_sigstop_s": [round(x, 1) for x in events.get("daemon_sigstop", [])],
        "daemon_exit_code": exit_code,
        "final_status": status[-1][1].get("state") if status else None,
    }


def print_report(r: dict[str, Any]) -> list[str]:
    rows = [
        ("duration (min)", r["minutes"]), ("requests sent (SDK, re-send on)", r["sent"]), ("  valid", r["sent_valid"]),
        ("  invalid", r["sent_invalid"]), ("valid answered OK", r["valid_ok"]),
        ("valid answered with an error", sum(r["valid_errors"].values())),
        *[(f"    {k}", v) for k, v in sorted(r["valid_errors"].items())],
        ("  of which during the camera dropout", r["valid_errors_during_camera_dropout"]),
        ("valid LOST (no answer by the deadline)", r["lost_valid"]), ("invalid never answered", r["lost_invalid"]),
        ("invalid with a wrong error code", r["wrong_code"]),
        ("answered twice (to the application)", r["answered_twice"]),
        ("ran twice (distinct answers on the wire)", r["ran_twice_on_the_wire"]),
        ("OK latency p50 / p95 / max (ms)", f"{r['ok_latency_p50_ms']} / {r['ok_latency_p95_ms']} / {r['ok_latency_max_ms']}"),
        ("daemon kill -9: sent until re-subscribed", r["daemon_kill9_sent_until_resubscribed"]),
        ("  answered / max latency (ms)", f"{r['daemon_kill9_answered']} / {r['daemon_kill9_answer_latency_max_ms']}"),
        ("daemon SIGSTOP: sent while stopped, by code", f"{r['daemon_sigstop_sent']} {r['daemon_sigstop_codes']}"),
        ("broker kill -9 (s from start)", r["broker_kill9_s"]), ("broker SIGTERM restart (s)", r["broker_restart_s"]),
        ("daemon kill -9 .. re-subscribed (s)", r["daemon_kill9_s"]), ("camera unplugged (s)", r["camera_dropout_s"]),
        ("daemon SIGSTOP (s)", r["daemon_sigstop_s"]),
        ("daemon exit code after SIGTERM", r["daemon_exit_code"]), ("last retained status", r["final_status"]),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(json.dumps(r, separators=(",", ":")))
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    sys.exit(main())
