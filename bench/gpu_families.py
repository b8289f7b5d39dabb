"""Qwen2.5-VL / Qwen3-VL / SmolVLM2 / InternVL in real shapes with random weights: edgevlm vs transformers.

A thin wrapper kept so that the commands of ``bench/results/gpu_families_h200_20261201.md`` still run: the
harness is ``edgevlm bench`` (:mod:`edgevlm.quantize.benchmark`, the family models in
:mod:`edgevlm.quantize.bench_families`). This script maps its old flags onto it: ``--models`` (default
the four shapes it measured first: Qwen2.5-VL-3B, Qwen3-VL-2B / 8B, SmolVLM2-2.2B), ``--sizes``, ``--device``, ``--new-tokens`` (default 32), ``--parity`` (off by
default here), ``--no-w4``, ``--batches`` (default 1), ``--impls`` (transformers,edgevlm,edgevlm-w4) and
``--out`` (the JSON line; nothing is saved under bench/results). Prints the table, then one JSON line.

Usage: ``python3 bench/gpu_families.py [--models ...] [--sizes 448x448,1280x720] [--parity]``, the same as
``edgevlm bench --models qwen2.5-vl-3b,qwen3-vl-2b,qwen3-vl-8b,smolvlm2-2.2b --variants edgevlm,edgevlm-w4
--batch-sizes 1 --new-tokens 32 --results-dir ''``.
"""

from __future__ import annotations

import argparse
import sys

from edgevlm.quantize.bench_families import (  # noqa: F401  (re-exported for tests/gpu_perf/test_vision_graphs.py)
    CONFIGS,
    build,
    make_request,
    model_config,
)

IMPLS = ("transformers", "edgevlm", "edgevlm-w4")
#: the models of this script's runs in bench/results (InternVL came later: ``--models internvl3-1b``)
MODELS = ("qwen2.5-vl-3b", "qwen3-vl-2b", "qwen3-vl-8b", "smolvlm2-2.2b")


def edgevlm_bench_argv(argv: list[str] | None = None) -> list[str]:
    """The ``edgevlm bench`` arguments of this script's ``argv``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sizes", default="448x448,1280x720", help="W x H, comma-separated")
    ap.add_argument("--device", default=None)
    ap.add_argument("--new-tokens", default="32")
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--no-w4", action="store_true")
    ap.add_argument("--batches", default="1", help="decode batch sizes, comma-separated (e.g. 1,8)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i and not (args.no_w4 and i == "edgevlm-w4")]
    out = ["--models", args.models, "--sizes", args.sizes, "--new-tokens", args.new_tokens,
           "--batch-sizes", args.batches, "--results-dir", "", "--out", args.out]
    out += ["--device", args.device] if args.device else []
    out += [] if args.parity else ["--no-parity"]
    out += [] if "transformers" in impls else ["--no-hf"]
    variants = [i for i in impls if i != "transformers"]
    if not variants:
        ap.error("--impls: edgevlm bench always measures an edgevlm implementation (edgevlm or edgevlm-w4)")
    return out + ["--variants", ",".join(variants)]


def main(argv: list[str] | None = None) -> int:
    from edgevlm.quantize.benchmark import main as bench_main

    return bench_main(edgevlm_bench_argv(argv))


if __name__ == "__main__":
    sys.exit(main())
