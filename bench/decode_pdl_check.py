#!/usr/bin/env python3
"""Is a decode step with programmatic dependent launch (PDL) bit-identical to one without? Per kernel group.

PDL lets a kernel start before the previous one in the stream has finished (each kernel waits for it with
``griddepcontrol.wait`` before touching memory): it may move time, never a result. This check builds the
LLaVA-1.5-7B-shape W4A16 model as ``bench/decode_step_breakdown.py`` does (random weights, bf16 KV cache filled
with random values, rows at position 609 of a 768-slot bucket), and for each PDL setting and batch size captures
the decode step's CUDA graph, replays it ``--replays`` times and compares the logits bit for bit: across the
replays (a race shows as replays that differ) and against the first setting (``none``: plain launches).

A setting is ``none`` or ``+``-joined parts: ``w4`` (the W4A16 CUDA kernels, ``w4a16_mma.PDL``), ``le16`` / ``le8``
(programmatic dependents only in steps of at most 16 / 8 rows, ``pdl.MAX_ROWS``; else every batch size), ``triton`` (every
Triton decode kernel, ``decode_fused.PDL``) or one Triton kernel by name (``add_rms_norm``, ``rope_kv``,
``silu_mul``, ``attn_split``, ``attn_combine``; ``decode_fused.PDL_KERNELS``). Also times each graph (CUDA events,
median step ms). Prints a table, then one JSON line; exits 1 when a setting differs. Usage (on an sm_90 GPU)::

    python3 bench/decode_pdl_check.py [--batch-sizes 1,8,32] [--replays 5] [--settings none,w4,triton,w4+triton]
"""

from __future__ import annotations

import argparse
import sys
import time

TRITON_KERNELS = ("add_rms_norm", "rope_kv", "silu_mul", "attn_split", "attn_combine")


def parse_setting(text: str) -> tuple[bool, frozenset[str] | None, bool, int | None]:
    """``(w4a16 PDL, Triton kernels with PDL (None: all), any Triton PDL, row limit (None: none))`` of a setting;
    raises ``ValueError``."""
    if text == "none":
        return False, frozenset(), False, None
    parts = text.split("+")
    bad = [p for p in parts if p not in ("w4", "le8", "le16", "triton", *TRITON_KERNELS)]
    if bad or len(set(parts)) != len(parts) or {"le8", "le16"} <= set(parts):
        raise ValueError(f"bad PDL setting {text!r}: parts are w4, le8 or le16, triton, {', '.join(TRITON_KERNELS)}")
    kernels = None if "triton" in parts else frozenset(p for p in parts if p in TRITON_KERNELS)
    limit = 8 if "le8" in parts else (16 if "le16" in parts else None)
    return "w4" in parts, kernels, kernels is None or bool(kernels), limit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava-7b")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=609, help="row position of the step")
    ap.add_argument("--settings", default="none,w4+triton+le8,w4+triton,w4,triton,"
                    + ",".join(f"w4+{k}" for k in TRITON_KERNELS))
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    from bench_support import print_result, use_package  # bench/ is sys.path[0] when run as a script
    from decode_step_breakdown import w4_decode_model

    try:
        settings = [(s, *parse_setting(s)) for s in args.settings.split(",") if s]
    except ValueError as exc:
        print(f"decode_pdl_check: {exc}", file=sys.stderr)
        return 2
    use_package()
    import torch

    from edgevlm.quantize.bench_measure import event_ms
    from edgevlm.runtime.kernels import decode_fused, pdl
    from edgevlm.runtime.kernels import w4a16_mma as mk

    if not torch.cuda.is_available():
        print("decode_pdl_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model, be, kv_len = w4_decode_model(args.model, dev, max(batches), args.prompt, 32)
    saved = (mk.PDL, pdl.MAX_ROWS, decode_fused.PDL, decode_fused.PDL_KERNELS)
    result = {"bench": "decode_pdl_check", "model": args.model, "gpu": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "kv_len": kv_len, "late_trigger_build": bool(getattr(mk.load_extension(dev), "lean_late_trigger", False)),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    base: dict[int, torch.Tensor] = {}
    try:
        for name, w4, kernels, triton, max_rows in settings:
            mk.PDL, pdl.MAX_ROWS, decode_fused.PDL, decode_fused.PDL_KERNELS = w4, max_rows, triton, kernels
            be.graphs.reset()
            for b in batches:
                be.graphs.tokens[:b].fill_(7)
                be.graphs.positions[:b].fill_(args.prompt)
                outs = [be.graphs.replay(b, kv_len).float().clone() for _ in range(args.replays)]
                stable = all(torch.equal(outs[0], o) for o in outs[1:])
                ref = base.setdefault(b, outs[0])
                rel = float((outs[0] - ref).norm() / ref.norm())
                rows_bad = [int(r) for r in (outs[0] != ref).any(-1).nonzero().flatten()]
                step_ms = event_ms(lambda b=b: be.graphs.replay(b, kv_len), dev, warmup=3, iters=20)
                run = {"setting": name, "batch": b, "stable": stable, "equal_to_none": rel == 0.0 and stable,
                       "rel_vs_none": rel, "rows_differing": rows_bad[:16], "step_ms": round(step_ms, 4)}
                result["runs"].append(run)
                print(f"{name:22s} B={b:<3d} stable {stable!s:5s} equal {run['equal_to_none']!s:5s} rel {rel:.3g} "
                      f"rows {rows_bad[:8]} step {step_ms:.3f} ms", flush=True)
    finally:
        mk.PDL, pdl.MAX_ROWS, decode_fused.PDL, decode_fused.PDL_KERNELS = saved
        be.graphs.reset()
    result["all_equal"] = all(r["equal_to_none"] for r in result["runs"])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print_result(result, args.out)
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
