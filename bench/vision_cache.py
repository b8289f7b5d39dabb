"""The per-frame vision cache (issue 13 §4): 4 questions about one frame, cache on vs off.

    .venv/bin/python bench/vision_cache.py [--model DIR] [--frames 8] [--questions 4]
        [--max-new-tokens 8] [--rung PX] [--exit-threshold T] [--threads 1] [--device cpu]

For each of ``--frames`` demo scenes (the shipped demo model's held-out set), asks ``--questions``
distinct questions about that one frame, first with the vision cache off, then on
(``Engine.set_vision_cache``; the first question of a frame encodes it, the others reuse its vision
tokens; with ``--exit-threshold T``, an early-exit point gated at T, what the latency controller
picks for the demo model: the cache keeps the frame's encoder walk and the later questions read
their exit heads off it). Reports the mean time for all questions of one frame (sum of e2e), the mean vision_ms per
question, the speed-up, and whether every answer is identical between the two (greedy: it must be).
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped demo model)")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--rung", type=int, default=None, help="resolution rung (px); default: the largest")
    ap.add_argument("--exit-threshold", type=float, default=None,
                    help="an early-exit point gated at this confidence (e.g. 0.95, the demo controller's choice)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    import torch

    from edgevlm.runtime import Engine
    from edgevlm.runtime.demo import scenes
    from edgevlm.types import OperatingPoint

    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, device=args.device)
    rung = args.rung or max(engine.resolution_ladder)
    op = OperatingPoint(name=f"r{rung}" + (f"-x{args.exit_threshold:g}" if args.exit_threshold is not None else ""),
                        resolution_px=rung, exit_threshold=args.exit_threshold)
    items = []
    for it in scenes.eval_set(args.frames * 3):  # frames with enough distinct questions
        qs = [qa.question for qa in scenes.all_questions(it.scene)][:args.questions]
        if len(qs) == args.questions:
            items.append((it.image, qs))
        if len(items) == args.frames:
            break
    engine.warmup([rung])
    results = {}
    t0 = time.perf_counter()
    for mode in ("off", "on"):
        engine.set_vision_cache(64 if mode == "on" else None)
        per_frame, vision, texts = [], [], []
        for image, qs in items:
            answers = [engine.ask(image, q, max_new_tokens=args.max_new_tokens, operating_point=op) for q in qs]
            per_frame.append(sum(a.stats.e2e_ms for a in answers))
            vision += [a.stats.vision_ms for a in answers]
            texts += [a.text for a in answers]
        results[mode] = {"frame_ms": statistics.fmean(per_frame), "vision_ms": statistics.fmean(vision),
                         "texts": texts, "encodes": engine.vision_cache.misses if mode == "on" else len(texts)}
    engine.set_vision_cache(None)
    elapsed = time.perf_counter() - t0
    identical = results["on"]["texts"] == results["off"]["texts"]
    speedup = results["off"]["frame_ms"] / results["on"]["frame_ms"]
    print(f"model {engine.model_dir}  device={args.device}  threads={args.threads}  rung={rung}px  "
          f"point={op.name}  frames={len(items)} x {args.questions} questions  ({elapsed:.0f} s)  {platform.processor() or ''}")
    print(f"| cache | encoder runs | ms per frame ({args.questions} questions) | vision ms / question |")
    print("| --- | --- | --- | --- |")
    for mode in ("off", "on"):
        r = results[mode]
        print(f"| {mode} | {r['encodes']} | {r['frame_ms']:.1f} | {r['vision_ms']:.2f} |")
    print(f"speed-up {speedup:.2f}x; answers identical: {identical}")
    print(json.dumps({"bench": "vision_cache", "model": str(engine.model_dir), "device": args.device,
                      "threads": args.threads, "rung_px": rung, "operating_point": op.name, "frames": len(items), "questions": args.questions,
                      "max_new_tokens": args.max_new_tokens,
                      "off_ms_per_frame": round(results["off"]["frame_ms"], 2),
                      "on_ms_per_frame": round(results["on"]["frame_ms"], 2),
                      "off_vision_ms": round(results["off"]["vision_ms"], 3),
                      "on_vision_ms": round(results["on"]["vision_ms"], 3),
                      "speedup": round(speedup, 3), "answers_identical": identical}))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
