#!/usr/bin/env python3
"""Demo-set accuracy and KV memory per KV cache precision (16-bit, INT4, FP8 e4m3).

Loads the demo model (or ``--model DIR``) once per precision through
``Engine.load(..., backend_options={"kv_cache_dtype": ...})`` and scores greedy answers on the
held-out scene set with the demo evaluator (:func:`edgevlm.runtime.demo.evaluate.evaluate`, exact
match). Reports, per precision: accuracy at each rung, the change against 16-bit in points, and KV
bytes per token (all layers, scales included) with the ratio to 16-bit. Goal (issue 6): INT4 uses
>= 3.5x less KV memory than 16-bit and stays within 0.5 points of its accuracy.

Usage: ``python bench/gpu_kv_accuracy.py [--device cuda] [--n 300] [--kv bf16,int4,fp8_e4m3]``.
Runs on CPU too (``--device cpu``; float32 activations there, so "16-bit" is the fp32 cache unless
``--kv`` names bf16). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys


def measure(model, device: str, n: int, resolutions: list[int] | None, kvs: list[str]) -> list[dict]:
    """One row per precision in ``kvs`` (the first is the baseline); raises EdgeVLMError when the
    model cannot be loaded."""
    import time

    from edgevlm.runtime import Engine
    from edgevlm.runtime.demo import scenes
    from edgevlm.runtime.demo.evaluate import evaluate

    items = scenes.eval_set(n, 1000)
    rows = []
    for kv in kvs:
        engine = Engine.load(model, device=device, backend_options={} if kv == "model" else {"kv_cache_dtype": kv})
        rungs = resolutions or [max(engine.resolution_ladder)]
        layers = engine.backend.model.language_model.layers
        kv_bytes = sum(layer.self_attn.kv_cache.bytes_per_token() for layer in layers)
        t0 = time.perf_counter()
        acc = evaluate(engine, items, rungs)
        rows.append({"kv": kv if kv != "model" else str(engine.dtype).removeprefix("torch."),
                     "kv_bytes_per_token": kv_bytes, "accuracy": {r: a["all"] for r, a in acc.items()},
                     "by_kind": acc, "eval_s": round(time.perf_counter() - t0, 1)})
        del engine
    base = rows[0]
    for r in rows:
        r["memory_ratio_vs_base"] = base["kv_bytes_per_token"] / r["kv_bytes_per_token"]
        r["delta_points"] = {k: 100 * (v - base["accuracy"][k]) for k, v in r["accuracy"].items()}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the shipped demo model)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--n", type=int, default=300, help="held-out items per rung")
    ap.add_argument("--resolutions", type=int, nargs="+", default=None, help="rungs (default: the largest)")
    ap.add_argument("--kv", default="model,int4,fp8_e4m3",
                    help="comma-separated precisions; 'model' = the activation dtype (16-bit on GPU)")
    args = ap.parse_args(argv)
    import torch

    from edgevlm.errors import EdgeVLMError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.n < 1:
        print("error: --n must be positive", file=sys.stderr)
        return 2
    try:
        rows = measure(args.model, device, args.n, args.resolutions, [k.strip() for k in args.kv.split(",") if k.strip()])
    except EdgeVLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = rows[0]
    print(f"{'kv cache':>10} {'bytes/tok':>10} {'vs base':>8} " + " ".join(f"{r + ' px':>9}" for r in base["accuracy"])
          + " " + " ".join(f"{'d' + r:>7}" for r in base["accuracy"]))
    for r in rows:
        print(f"{r['kv']:>10} {r['kv_bytes_per_token']:>10d} {r['memory_ratio_vs_base']:>7.2f}x "
              + " ".join(f"{100 * v:>8.1f}%" for v in r["accuracy"].values()) + " "
              + " ".join(f"{v:>+7.1f}" for v in r["delta_points"].values()))
    print(json.dumps({"bench": "gpu_kv_accuracy", "device": device, "n": args.n, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
