"""Continuous batching in the daemon: throughput and within-budget fraction, batching on vs off.

    .venv/bin/python bench/batching_daemon.py [--model DIR] [--clients 8] [--per-client 8]
        [--rows 8] [--max-new-tokens 16] [--budget-ms auto] [--controller] [--threads 1]

Starts a private mosquitto and the daemon in this process (``edgevlm.daemon.app.Daemon`` around a
loaded engine) twice: **off** (one KV-cache row: ``engine.ask`` per request, as before issue 6's
dynamic batching) and **on** (``--rows`` rows, ``continuous_batching``; see
:mod:`edgevlm.daemon.batching`). In each, ``--clients`` SDK clients (MQTT v5) ask demo evaluation
questions about their scene images in a closed loop (the next request as soon as the answer is
in), ``--per-client`` each. The budget (``auto`` = 3 x the median round trip of 8 single requests
on the idle daemon with batching off) is sent as ``budget_ms`` (used by the controller when on); a request is
*within budget* when its answer arrived (client clock, from publishing) within it;
``DEADLINE_EXCEEDED`` answers count as not within. Also reported: answers/s over the run, p50/p99
round trip, accuracy, how many answers are identical between the two modes (greedy: should be
all). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def _png(image) -> bytes:
    import cv2

    ok, buf = cv2.imencode(".png", image[:, :, ::-1])
    return buf.tobytes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients")
    ap.add_argument("--per-client", type=int, default=8, help="requests per client")
    ap.add_argument("--rows", type=int, default=8, help="KV-cache rows with batching on (model.max_batch_size)")
    ap.add_argument("--token-budget", type=int, default=1024, help="model.prefill_token_budget")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget-ms", default="auto")
    ap.add_argument("--controller", action="store_true", help="latency controller on (default: off, fixed top rung)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=3000, help="evaluation set seed of the questions")
    args = ap.parse_args(argv)

    import torch

    from edgevlm.client import Client
    from edgevlm.config import parse_daemon_config
    from edgevlm.daemon.app import Daemon
    from edgevlm.daemon.demo import start_private_broker
    from edgevlm.errors import EdgeVLMError
    from edgevlm.runtime import Engine
    from edgevlm.runtime.demo import scenes

    torch.set_num_threads(args.threads)
    broker = start_private_broker("edgevlm-batching-")
    if broker is None:
        print("mosquitto not found: apt-get install mosquitto mosquitto-clients", file=sys.stderr)
        return 2
    n = args.clients * args.per_client
    items = scenes.eval_set(n, args.seed)
    probe_items = scenes.eval_set(8, args.seed + 1)
    encoded = {id(it): _png(it.image) for it in items + probe_items}  # encoded before any clock starts

    def daemon(rows: int) -> Daemon:
        engine = Engine.load(args.model, backend_options={"max_batch_size": rows})
        engine.warmup()
        cfg = parse_daemon_config({
            "mqtt": {"host": "127.0.0.1", "port": broker.port, "device_id": "bench"},
            # vision cache off: the clients repeat images, and batching (encoding every group) does not use it
            "model": {"continuous_batching": rows > 1, "max_batch_size": rows, "prefill_token_budget": args.token_budget,
                      "vision_cache_mb": 0},
            "defaults": {"max_new_tokens": args.max_new_tokens, "timeout_ms": 60000},
            "queue_max_size": max(64, n), "metrics": {"listen": None}, "telemetry": {"interval_s": None},
            "tegrastats": {"enabled": False}, "controller": {"enabled": args.controller},
        })
        d = Daemon(cfg, engine=engine, notify_socket="")
        d.start()
        if not d.wait_ready(10):
            raise RuntimeError("daemon did not connect")
        with Client("127.0.0.1", broker.port, "bench") as c:  # unmeasured warm-up through the whole path
            for it in probe_items[:4]:
                c.ask(it.qa.question, image=encoded[id(it)], max_new_tokens=args.max_new_tokens, timeout_s=60)
        return d

    results, answers = [], {}
    try:
        d = daemon(1)
        with Client("127.0.0.1", broker.port, "bench") as c:
            probe = []
            for it in probe_items:
                t0 = time.perf_counter()
                c.ask(it.qa.question, image=encoded[id(it)], max_new_tokens=args.max_new_tokens, timeout_s=60)
                probe.append((time.perf_counter() - t0) * 1e3)
        d.stop()
        budget = 3.0 * _pct(probe, 0.5) if args.budget_ms == "auto" else float(args.budget_ms)
        print(f"single-request round trip p50 {_pct(probe, 0.5):.0f} ms -> budget {budget:.0f} ms", file=sys.stderr)
        for mode, rows in (("off", 1), ("on", args.rows)):
            d = daemon(rows)
            recs: list[dict] = []
            lock = threading.Lock()

            def worker(k: int, recs=recs, lock=lock, mode=mode) -> None:
                with Client("127.0.0.1", broker.port, "bench") as c:
                    for i in range(args.per_client):
                        it = items[k * args.per_client + i]
                        t0 = time.perf_counter()
                        try:
                            a = c.ask(it.qa.question, image=encoded[id(it)], max_new_tokens=args.max_new_tokens,
                                      budget_ms=int(budget), timeout_s=60)
                            rec = {"ok": True, "ms": (time.perf_counter() - t0) * 1e3,
                                   "correct": a.text.strip() == it.qa.answer,
                                   "batch": getattr(a.stats, "batch_size", 1) or 1}
                            answers[(mode, k, i)] = a.text
                        except EdgeVLMError as err:
                            rec = {"ok": False, "ms": (time.perf_counter() - t0) * 1e3, "code": err.code.value}
                        with lock:
                            recs.append(rec)

            t_start = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall_s = time.perf_counter() - t_start
            joins = d.counters.get("batch_joins")
            d.stop()
            ok = [r for r in recs if r["ok"]]
            results.append({
                "mode": mode, "rows": rows, "requests": len(recs), "answered": len(ok), "wall_s": round(wall_s, 2),
                "answers_per_s": round(len(ok) / wall_s, 2),
                "within_budget": round(sum(r["ok"] and r["ms"] <= budget for r in recs) / len(recs), 4),
                "deadline_exceeded": sum(r.get("code") == "DEADLINE_EXCEEDED" for r in recs),
                "p50_ms": round(_pct([r["ms"] for r in ok], 0.5), 1),
                "p99_ms": round(_pct([r["ms"] for r in ok], 0.99), 1),
                "accuracy": round(sum(r["correct"] for r in ok) / max(1, len(ok)), 4),
                "mean_batch_size": round(sum(r["batch"] for r in ok) / max(1, len(ok)), 2),
                "batch_joins": joins,
            })
            print(f"batching {mode}: {results[-1]}", file=sys.stderr)
    finally:
        broker.stop()

    both = [key[1:] for key in answers if key[0] == "off" and ("on",) + key[1:] in answers]
    same = sum(answers[("off",) + k] == answers[("on",) + k] for k in both)
    print(f"model {args.model or 'demo'}  clients {args.clients} x {args.per_client}  max_new_tokens "
          f"{args.max_new_tokens}  budget {budget:.0f} ms  controller {'on' if args.controller else 'off'}  "
          f"threads {args.threads}  ({platform.machine()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')})")
    print("| batching | rows | requests | answers/s | within budget | DEADLINE_EXCEEDED | p50 ms | p99 ms | accuracy "
          "| mean batch | joins |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['rows']} | {r['requests']} | {r['answers_per_s']:.2f} | "
              f"{100 * r['within_budget']:.1f}% | {r['deadline_exceeded']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{100 * r['accuracy']:.1f}% | {r['mean_batch_size']:.2f} | {r['batch_joins']} |")
    print(f"identical answers on/off: {same}/{len(both)}")
    speedup = results[1]["answers_per_s"] / results[0]["answers_per_s"] if results[0]["answers_per_s"] else None
    print(json.dumps({"bench": "batching_daemon", "model": args.model or "demo", "clients": args.clients,
                      "per_client": args.per_client, "max_new_tokens": args.max_new_tokens,
                      "budget_ms": round(budget, 1), "controller": args.controller, "threads": args.threads,
                      "token_budget": args.token_budget, "results": results,
                      "throughput_speedup": round(speedup, 2) if speedup else None,
                      "identical_answers": [same, len(both)], "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
