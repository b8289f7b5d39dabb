"""Early exit in the vision encoder: vision latency saved against accuracy lost on the demo set.

    .venv/bin/python bench/early_exit.py [--model DIR] [--n 180] [--rungs 384] [--thresholds 0.9 0.8 0.7 0.6 0.5]
        [--threads 1] [--seed 1000]

Needs a model with exit heads (``edgevlm calibrate``; default: the shipped demo model). For every
evaluation item (:func:`edgevlm.runtime.demo.scenes.eval_set`, greedy, exact match) the engine
answers once per configuration, back to back (so machine-load drift hits every configuration
alike): full depth, a forced exit after each exit block, and the confidence-gated cascade at each
threshold. Reported per configuration: accuracy and its change in points against full depth,
``vision_ms`` (vision encoder + exit heads + projector, from :class:`edgevlm.types.Stats`) mean and
median, the mean vision time saved, the exit rate and the mean blocks run. Goal (issue 4): >= 45%
vision latency saved with <= 1 point of accuracy lost. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder with exit heads (default: the demo model)")
    ap.add_argument("--n", type=int, default=180, help="evaluation items")
    ap.add_argument("--seed", type=int, default=1000, help="evaluation set seed")
    ap.add_argument("--rungs", type=int, nargs="+", default=None, help="resolution rungs (default: the top one)")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    import torch

    from edgevlm.runtime import Engine
    from edgevlm.runtime.demo import scenes
    from edgevlm.types import OperatingPoint

    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model)
    if not engine.exit_points:
        print(f"{engine.model_dir} has no exit heads: run `edgevlm calibrate` on it first", file=sys.stderr)
        return 2
    rungs = args.rungs or [max(engine.resolution_ladder)]
    items = scenes.eval_set(args.n, args.seed)
    n_blocks = engine.config.vision_blocks_needed
    engine.warmup(rungs)
    t0 = time.perf_counter()
    results = []
    for rung in rungs:
        configs = {"full": OperatingPoint(name="full", resolution_px=rung)}
        for k in engine.exit_points:
            configs[f"exit@{k}"] = OperatingPoint(name=f"exit@{k}", resolution_px=rung, exit_layer=k)
        for t in args.thresholds:
            configs[f"x{t:g}"] = OperatingPoint(name=f"x{t:g}", resolution_px=rung, exit_threshold=t)
        rows = {name: [] for name in configs}
        for it in items:
            for name, op in configs.items():
                a = engine.ask(it.image, it.qa.question, max_new_tokens=args.max_new_tokens, operating_point=op)
                s = a.stats
                rows[name].append((a.text.strip() == it.qa.answer, s.vision_ms, s.exit_layer))
        full_acc = sum(r[0] for r in rows["full"]) / len(items)
        full_mean = statistics.fmean(r[1] for r in rows["full"])
        for name, r in rows.items():
            acc = sum(x[0] for x in r) / len(r)
            mean_ms = statistics.fmean(x[1] for x in r)
            results.append({
                "rung": rung, "config": name, "accuracy": round(acc, 4), "delta_points": round(100 * (acc - full_acc), 2),
                "vision_ms_mean": round(mean_ms, 2), "vision_ms_median": round(statistics.median(x[1] for x in r), 2),
                "saved_pct": round(100 * (1 - mean_ms / full_mean), 1),
                "exit_rate": round(sum(x[2] is not None for x in r) / len(r), 3),
                "blocks_mean": round(statistics.fmean(x[2] or n_blocks for x in r), 2),
            })
    elapsed = time.perf_counter() - t0
    print(f"model {engine.model_dir}  exit points {engine.exit_points} of {n_blocks} blocks  n={args.n}  "
          f"threads={args.threads}  ({elapsed:.0f} s)")
    print("| rung | config | accuracy | Δ points | vision ms mean | vision ms median | saved | exit rate | blocks |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['rung']} | {r['config']} | {100 * r['accuracy']:.1f}% | {r['delta_points']:+.1f} | "
              f"{r['vision_ms_mean']:.1f} | {r['vision_ms_median']:.1f} | {r['saved_pct']:.1f}% | "
              f"{100 * r['exit_rate']:.0f}% | {r['blocks_mean']:.2f} |")
    meets = [r for r in results if r["config"] != "full" and r["saved_pct"] >= 45 and r["delta_points"] >= -1]
    best = max(meets, key=lambda r: (r["delta_points"], r["saved_pct"])) if meets else None
    print(json.dumps({"bench": "early_exit", "model": str(engine.model_dir), "n": args.n, "seed": args.seed,
                      "threads": args.threads, "exit_points": engine.exit_points, "vision_blocks": n_blocks,
                      "rows": results, "goal": ">=45% vision saved with <=1 point lost", "goal_met": best is not None,
                      "best": best, "elapsed_s": round(elapsed, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
