"""Visual-token pruning: prefill time and accuracy at several keep ratios, two token scores.

    .venv/bin/python bench/pruning.py [--model DIR] [--n 180] [--rungs 384 256]
        [--keep-ratios 1 0.75 0.5 0.35 0.25] [--scores cls_attention feature_norm] [--threads 1]

For every evaluation item (:func:`edgevlm.runtime.demo.scenes.eval_set`, greedy, exact match)
the engine answers once per (score, keep ratio), back to back. Reported: vision tokens fed to the
decoder, ``prefill_ms`` and ``vision_ms`` (means, from :class:`edgevlm.types.Stats`), the prefill
time saved against keeping every token, and accuracy (overall and on top/bottom questions, which
the demo decoder answers from the RoPE distance to the vision tokens). Scores: ``cls_attention``
(the CLS token's attention in the last vision block, EViT-style) and ``feature_norm`` (L2 norm of
the feature). Positions (``--positions``): ``original`` (kept tokens keep their unpruned RoPE
distances, the runtime's default) or ``compact`` (consecutive positions). Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--n", type=int, default=180)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--rungs", type=int, nargs="+", default=None, help="default: the top rung")
    ap.add_argument("--keep-ratios", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.35, 0.25])
    ap.add_argument("--scores", nargs="+", default=["cls_attention", "feature_norm"])
    ap.add_argument("--positions", nargs="+", default=["original", "compact"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    import torch

    from edgevlm.runtime import Engine
    from edgevlm.runtime.demo import scenes
    from edgevlm.types import OperatingPoint

    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model)
    model = engine.backend.model
    rungs = args.rungs or [max(engine.resolution_ladder)]
    items = scenes.eval_set(args.n, args.seed)
    engine.warmup(rungs)
    t0 = time.perf_counter()
    results = []
    for rung in rungs:
        configs = [(s, k, p) for s in args.scores for k in args.keep_ratios for p in args.positions
                   if not (k >= 1.0 and (s != args.scores[0] or p != args.positions[0]))]
        rows: dict[tuple[str, float, str], list] = {c: [] for c in configs}
        for it in items:
            for score, keep, positions in configs:
                model.prune_score, model.prune_positions = score, positions
                op = OperatingPoint(name=f"k{keep:g}", resolution_px=rung, keep_ratio=keep if keep < 1 else None)
                a = engine.ask(it.image, it.qa.question, max_new_tokens=args.max_new_tokens, operating_point=op)
                rows[(score, keep, positions)].append((a.text.strip() == it.qa.answer, a.stats.prefill_ms,
                                                       a.stats.vision_ms, a.stats.vision_tokens, it.qa.kind))
        model.prune_score, model.prune_positions = "cls_attention", "original"
        base = statistics.fmean(r[1] for r in rows[(args.scores[0], max(args.keep_ratios), args.positions[0])])
        for (score, keep, positions), r in rows.items():
            prefill = statistics.fmean(x[1] for x in r)
            tb = [x[0] for x in r if x[4] == "position_tb"]
            results.append({
                "rung": rung, "score": score if keep < 1 else "-", "positions": positions if keep < 1 else "-",
                "keep_ratio": keep, "vision_tokens": round(statistics.fmean(x[3] for x in r), 1),
                "accuracy": round(sum(x[0] for x in r) / len(r), 4),
                "accuracy_top_bottom": round(sum(tb) / len(tb), 4) if tb else None,
                "prefill_ms": round(prefill, 2),
                "prefill_saved_pct": round(100 * (1 - prefill / base), 1),
                "vision_ms": round(statistics.fmean(x[2] for x in r), 2),
            })
    elapsed = time.perf_counter() - t0
    print(f"model {engine.model_dir}  n={args.n}  threads={args.threads}  ({elapsed:.0f} s)")
    print("| rung | score | positions | keep | vision tokens | accuracy | top/bottom | prefill ms | prefill saved "
          "| vision ms |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        tb = "-" if r["accuracy_top_bottom"] is None else f"{100 * r['accuracy_top_bottom']:.0f}%"
        print(f"| {r['rung']} | {r['score']} | {r['positions']} | {r['keep_ratio']:g} | {r['vision_tokens']:.0f} | "
              f"{100 * r['accuracy']:.1f}% | {tb} | {r['prefill_ms']:.1f} | {r['prefill_saved_pct']:.1f}% | "
              f"{r['vision_ms']:.1f} |")
    print(json.dumps({"bench": "pruning", "model": str(engine.model_dir), "n": args.n, "seed": args.seed,
                      "threads": args.threads, "rows": results, "elapsed_s": round(elapsed, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
