"""Daemon overhead: SDK round trip over a private mosquitto vs. the engine call it wraps.

    .venv/bin/python bench/daemon_latency.py [--model DIR] [--n 30] [--max-new-tokens 8]
        [--width-px 640 --height-px 480]

Starts a private broker (mosquitto on a free loopback port) and the daemon in this process
(``edgevlm.daemon.app.Daemon`` with the engine loaded here), then asks the same question about
the same inline image ``n`` times through ``edgevlm.Client``. The overhead per request is the client's round trip minus the engine's own
``e2e_ms`` (PNG encode + base64 + JSON + two MQTT hops + queue + PNG decode). Without ``--model``
a tiny random checkpoint (``edgevlm.runtime.testing``) is used, so the engine time is small and
the overhead dominates. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", type=Path, default=None, help="model folder (default: a tiny random checkpoint)"
    )
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--width-px", type=int, default=640)
    ap.add_argument("--height-px", type=int, default=480)
    args = ap.parse_args(argv)

    from edgevlm.client import Client, encode_png
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon
    from edgevlm.daemon.demo import Broker, find_mosquitto
    from edgevlm.runtime import Engine

    work = Path(tempfile.mkdtemp(prefix="edgevlm-bench-"))
    model = args.model
    if model is None:
        from edgevlm.runtime.testing import write_tiny_checkpoint

        model = write_tiny_checkpoint(work / "tiny")
    engine = Engine.load(model, device="cpu")
    mosquitto, _ = find_mosquitto()
    if mosquitto is None:
        print("mosquitto not found: apt-get install mosquitto mosquitto-clients", file=sys.stderr)
        return 2
    broker = Broker(mosquitto, work).start()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(args.height_px, args.width_px, 3), dtype=np.uint8)
    prompt = "what is in the picture ?"
    png_bytes = len(encode_png(image))
    cfg = DaemonConfig.model_validate(
        {"mqtt": {"host": "127.0.0.1", "port": broker.port, "device_id": "bench"}, "queue_max_size": 4}
    )
    daemon = Daemon(cfg, engine=engine)
    try:
        daemon.start()
        if not daemon.wait_ready(10):
            raise RuntimeError("daemon did not connect")
        for _ in range(3):  # warm-up
            engine.ask(image, prompt, max_new_tokens=args.max_new_tokens)
        rtt, engine_e2e, queue = [], [], []
        with Client("127.0.0.1", broker.port, "bench") as client:
            client.ask(prompt, image=image, max_new_tokens=args.max_new_tokens)
            for _ in range(args.n):
                t0 = time.perf_counter()
                answer = client.ask(prompt, image=image, max_new_tokens=args.max_new_tokens, timeout_s=60)
                rtt.append((time.perf_counter() - t0) * 1000)
                engine_e2e.append(answer.stats.e2e_ms)
                queue.append(answer.stats.queue_ms)
    finally:
        daemon.stop()
        broker.stop()
    overhead = [r - e for r, e in zip(rtt, engine_e2e, strict=True)]
    rows = [
        ("Client.ask round trip (ms)", rtt),
        ("engine e2e_ms in daemon (ms)", engine_e2e),
        ("daemon queue_ms (ms)", queue),
        ("overhead = rtt - e2e (ms)", overhead),
    ]
    print(f"model {model} | image {args.width_px}x{args.height_px} (PNG {png_bytes} B) | "
          f"max_new_tokens {args.max_new_tokens} | n {args.n}")  # fmt: skip
    print(f"{'measure':32s} {'p50':>9s} {'p95':>9s} {'mean':>9s}")
    for name, values in rows:
        print(
            f"{name:32s} {_pct(values, 0.5):9.2f} {_pct(values, 0.95):9.2f} {statistics.fmean(values):9.2f}"
        )
    result = {
        "bench": "daemon_latency",
        "model": str(model),
        "image_px": [args.width_px, args.height_px],
        "png_bytes": png_bytes,
        "n": args.n,
        "rtt_p50_ms": round(_pct(rtt, 0.5), 3),
        "rtt_p95_ms": round(_pct(rtt, 0.95), 3),
        "overhead_p50_ms": round(_pct(overhead, 0.5), 3),
        "overhead_p95_ms": round(_pct(overhead, 0.95), 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
