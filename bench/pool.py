"""Throughput of a pool of daemons (MQTT v5 shared subscription) against its member count.

    .venv/bin/python bench/pool.py [--members 1 2 4] [--clients 8] [--seconds 15] [--max-new-tokens 4]

For each member count N: a private mosquitto (the project's config), N ``edgevlm serve`` processes on
the tiny random checkpoint (``edgevlm.runtime.testing``, one intra-op thread each) joined to pool
``bench``, and ``--clients`` closed-loop SDK clients in pool mode (``Client(pool="bench")``, one thread
each) asking about inline 48x32 images for ``--seconds``. Prints answers/s and the client-side
round trip p50/p99 per member count, then one JSON line. Every member is a separate process, so the
members scale until the machine's cores run out (this CPU has 2: expect the curve to flatten there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def run_pool(n_members: int, args: argparse.Namespace, model: Path, work: Path) -> dict[str, float]:
    from edgevlm.client import Client
    from edgevlm.daemon.demo_processes import DaemonProcess, start_private_broker

    broker = start_private_broker("edgevlm-pool-")
    if broker is None:
        raise SystemExit("mosquitto not found: apt-get install mosquitto mosquitto-clients")
    members = []
    try:
        for i in range(n_members):
            d = work / f"n{n_members}-m{i}"
            d.mkdir(parents=True)
            members.append(DaemonProcess({
                "mqtt": {"host": "127.0.0.1", "port": broker.port, "device_id": f"m{i}", "pool": "bench"},
                # vision cache off: the clients repeat images, which it would answer from memory
                "model": {"path": str(model), "device": "cpu", "cpu_threads": 1, "vision_cache_mb": 0},
                "queue_max_size": 64, "defaults": {"max_new_tokens": args.max_new_tokens, "timeout_ms": 60000},
                "metrics": {"listen": None}, "log_level": "WARNING"}, d).start())
        with Client("127.0.0.1", broker.port, pool="bench") as watcher:
            deadline = time.monotonic() + 180
            while sum(s.state == "online" for s in watcher.pool_members.values()) < n_members:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {watcher.pool_members} came online")
                time.sleep(0.2)
        images = [np.random.default_rng(i).integers(0, 256, size=(32, 48, 3), dtype=np.uint8) for i in range(16)]
        rtts: list[float] = []
        stop = threading.Event()
        lock = threading.Lock()

        def client_loop(k: int) -> None:
            with Client("127.0.0.1", broker.port, pool="bench") as c:
                c.ask("hi", image=images[0], max_new_tokens=args.max_new_tokens, timeout_s=60)  # warm-up
                j = k
                while not stop.is_set():
                    t0 = time.perf_counter()
                    c.ask("what is in the picture ?", image=images[j % len(images)],
                          max_new_tokens=args.max_new_tokens, timeout_s=60)
                    with lock:
                        rtts.append((time.perf_counter() - t0) * 1000)
                    j += 1

        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # all clients warmed up and looping
        with lock:
            rtts.clear()
        t_start = time.perf_counter()
        time.sleep(args.seconds)
        with lock:
            window = list(rtts)
        elapsed = time.perf_counter() - t_start
        stop.set()
        for t in threads:
            t.join(120)
        return {"members": n_members, "answers_per_s": len(window) / elapsed, "rtt_p50_ms": _pct(window, 0.5),
                "rtt_p99_ms": _pct(window, 0.99), "answers": len(window),
                "rtt_mean_ms": statistics.fmean(window) if window else float("nan")}
    finally:
        for m in members:
            m.stop()
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    args = ap.parse_args(argv)
    from edgevlm.runtime.testing import write_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="edgevlm-pool-bench-"))
    model = write_tiny_checkpoint(work / "tiny")
    rows = [run_pool(n, args, model, work) for n in args.members]
    base = rows[0]["answers_per_s"]
    print(f"tiny random checkpoint | {args.clients} closed-loop clients | {args.seconds:.0f} s per row | "
          f"max_new_tokens {args.max_new_tokens}")
    print(f"{'members':>7s} {'answers/s':>10s} {'vs 1':>6s} {'rtt p50 ms':>11s} {'rtt p99 ms':>11s} {'answers':>8s}")
    for r in rows:
        print(f"{r['members']:7d} {r['answers_per_s']:10.1f} {r['answers_per_s'] / base:6.2f} "
              f"{r['rtt_p50_ms']:11.1f} {r['rtt_p99_ms']:11.1f} {r['answers']:8d}")
    print(json.dumps({"bench": "pool", "clients": args.clients, "seconds": args.seconds,
                      "rows": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
