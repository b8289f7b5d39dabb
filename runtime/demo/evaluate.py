"""Exact-match accuracy of a model on the held-out scene set, per resolution-ladder rung, via our runtime.

    python -m edgevlm.runtime.demo.evaluate [--model DIR] [--resolutions 384 256 192 128] [--n 900]
        [--seed 1000] [--device cpu] [--dtype float32] [--backend torch]

Runs ``edgevlm.runtime.Engine`` (greedy decoding, ``operating_point.resolution_px`` = the rung) on
:func:`edgevlm.runtime.demo.scenes.eval_set` (``n`` items, question kinds in round-robin) and counts
an answer right when its text, stripped, equals the expected answer exactly. Prints a table (rows:
question kinds, columns: rungs) and ends with one JSON line
``{"model": ..., "n": ..., "seed": ..., "accuracy": {"<rung>": {"all": ..., "<kind>": ...}}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import defaultdict

from edgevlm.runtime.demo import scenes

logger = logging.getLogger(__name__)

EVAL_SEED = 1000
MAX_NEW_TOKENS = 24  # the longest answer (4-object description) is 15 tokens + </s>


def evaluate(engine, items: list[scenes.EvalItem], resolutions_px: list[int]) -> dict[str, dict[str, float]]:
    """Exact-match accuracy per rung: ``{"<rung>": {"all": acc, "<kind>": acc, ...}}``.

    ``engine`` is an :class:`edgevlm.runtime.Engine`; ``items`` from :func:`scenes.eval_set`.
    """
    from edgevlm.types import OperatingPoint

    out: dict[str, dict[str, float]] = {}
    for rung in resolutions_px:
        op = OperatingPoint(name=f"r{rung}", resolution_px=rung)
        hits: dict[str, list[bool]] = defaultdict(list)
        for it in items:
            ans = engine.ask(it.image, it.qa.question, max_new_tokens=MAX_NEW_TOKENS, operating_point=op)
            hits[it.qa.kind].append(ans.text.strip() == it.qa.answer)
        flat = [h for v in hits.values() for h in v]
        row = {"all": sum(flat) / max(len(flat), 1)}
        row.update({k: sum(hits[k]) / len(hits[k]) for k in scenes.KINDS if hits.get(k)})
        out[str(rung)] = row
    return out


def format_table(accuracy: dict[str, dict[str, float]]) -> str:
    """Markdown table: one row per question kind (and ``all``), one column per rung."""
    rungs = list(accuracy)
    kinds = ["all"] + [k for k in scenes.KINDS if any(k in accuracy[r] for r in rungs)]
    lines = ["| kind | " + " | ".join(f"{r} px" for r in rungs) + " |"]
    lines.append("|---|" + "---:|" * len(rungs))
    for k in kinds:
        cells = [f"{100 * accuracy[r][k]:.1f}%" if k in accuracy[r] else "-" for r in rungs]
        name = f"**{k}**" if k == "all" else k
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the shipped demo model)")
    ap.add_argument(
        "--resolutions", type=int, nargs="+", default=None, help="rungs (default: the model's ladder)"
    )
    ap.add_argument("--n", type=int, default=900, help="held-out items")
    ap.add_argument("--seed", type=int, default=EVAL_SEED, help="held-out set seed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from edgevlm.errors import EdgeVLMError
    from edgevlm.runtime import Engine

    if args.n <= 0:
        print("error: --n must be positive", file=sys.stderr)
        return 2
    try:
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    except EdgeVLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rungs = args.resolutions or list(engine.resolution_ladder)
    t0 = time.perf_counter()
    items = scenes.eval_set(args.n, args.seed)
    accuracy = evaluate(engine, items, rungs)
    elapsed_s = time.perf_counter() - t0
    print(
        f"model {engine.model_dir}  n={args.n} seed={args.seed} device={engine.device} dtype={engine.dtype}"
    )
    print(format_table(accuracy))
    result = {
        "model": str(engine.model_dir),
        "n": args.n,
        "seed": args.seed,
        "device": engine.device,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "backend": engine.backend_name,
        "elapsed_s": round(elapsed_s, 1),
        "accuracy": accuracy,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
