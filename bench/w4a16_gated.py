#!/usr/bin/env python3
"""The W4A16 gated-MLP epilogue against the plain kernel + the separate act(gate) * up kernel, per fused gate/up
shape (7B, Qwen3-VL-8B, Qwen3-VL-2B) and decode rows M.

For each (shape, M): the plain lean launch at the gated launch's configuration, the same launch followed by
``decode_fused.gated_act`` (what a decode step ran before session 13), and ``w4a16_mma_gated`` at its own
configuration (``gated_config``) and every gated one (``GATED_CONFIGS`` x tiles per CTA 1, 2). Timing as ``bench/w4a16_marlin.py``: CUDA-graph replays
of one call per weight copy, enough copies to read > 3x the L2, median of 30, plain launches (no PDL). Each gated
output is checked against a float64 reference (rel <= 3e-3).

Prints a table, then one JSON line. Usage (CUDA GPU)::

    python3 bench/w4a16_gated.py [--ms 1,8,16] [--shapes 7b,qwen8b,qwen2b] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"7b": (11008, 4096), "qwen8b": (12288, 4096), "qwen2b": (6144, 2048)}  # (intermediate I, hidden K)
REL_LIMIT = 3e-3


def _marlin():
    spec = importlib.util.spec_from_file_location("w4a16_marlin", REPO / "bench" / "w4a16_marlin.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["w4a16_marlin"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    from bench_support import print_result, use_package

    use_package()
    import torch
    import torch.nn.functional as F

    from edgevlm.runtime.int4_format import dequantize_int4, gated_row_order, quantize_int4, repack_int4_mma
    from edgevlm.runtime.kernels import w4a16_mma as mk
    from edgevlm.runtime.kernels.decode_fused import gated_act

    if not torch.cuda.is_available():
        print("w4a16_gated: needs a CUDA GPU", file=sys.stderr)
        return 2
    mar = _marlin()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, t0 = [], time.perf_counter()
    for name in [s for s in args.shapes.split(",") if s]:
        inter, k = SHAPES[name]
        n = 2 * inter
        w = quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, 128)
        w64 = dequantize_int4(w.qweight, w.scales, w.zeros, 128, torch.float64)
        order = gated_row_order(n, dev)
        plain = repack_int4_mma(w.qweight, w.scales, w.zeros, 128)
        gated = repack_int4_mma(w.qweight[order], w.scales[order], w.zeros[order], 128)
        copies = mar.copies_for(w.nbytes(), l2)
        plain_c = [(plain[0].clone(), plain[1].clone()) for _ in range(copies)]
        gated_c = [(gated[0].clone(), gated[1].clone()) for _ in range(copies)]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            dense = x.double() @ w64.T
            ref = F.silu(dense[:, :inter]) * dense[:, inter:]
            ks, depth, tpc = mk.gated_config(m, n, k, 128)
            cfg = ("lean", ks, depth, tpc)
            row = {"shape": name, "n": n, "k": k, "m": m, "config": [ks, depth, tpc],
                   "plain_us": round(mar.graph_us([partial(mk.w4a16_mma, x, q, mt, 128, config=cfg, pdl=False)
                                                   for q, mt in plain_c]), 2)}

            def plain_then_act(x, cfg, q, mt):
                return gated_act(mk.w4a16_mma(x, q, mt, 128, config=cfg, pdl=False), "silu")

            row["plain_act_us"] = round(mar.graph_us([partial(plain_then_act, x, cfg, q, mt) for q, mt in plain_c]),
                                        2)
            sweep = {}
            for c in dict.fromkeys([(ks, depth, tpc), *((*pair, t) for pair in mk.GATED_CONFIGS for t in (1, 2))]):
                y = mk.w4a16_mma_gated(x, *gated, 128, "silu", config=c, pdl=False)
                err = mar.rel(y, ref)
                us = mar.graph_us([partial(mk.w4a16_mma_gated, x, q, mt, 128, "silu", config=c, pdl=False)
                                   for q, mt in gated_c])
                sweep[str(list(c))] = {"us": round(us, 2), "rel_err": err, "ok": err <= REL_LIMIT}
            row["gated"] = sweep
            row["gated_us"] = sweep[str([ks, depth, tpc])]["us"]
            best = min((v["us"], c) for c, v in sweep.items() if v["ok"])
            row["gated_best"] = {"config": best[1], "us": best[0]}
            row["all_ok"] = all(v["ok"] for v in sweep.values())
            rows.append(row)
            print(f"{name:7s} M={m:2d} cfg {ks},{depth},{tpc}: plain {row['plain_us']:7.2f}  plain+act "
                  f"{row['plain_act_us']:7.2f}  gated {row['gated_us']:7.2f}  best gated {best[0]:7.2f} {best[1]}  "
                  f"ok {row['all_ok']}", flush=True)
        del plain_c, gated_c
    print(f"\n{'shape':8s}{'M':>4s}{'plain':>9s}{'plain+act':>11s}{'gated':>9s}{'best gated':>12s}  config")
    for r in rows:
        print(f"{r['shape']:8s}{r['m']:>4d}{r['plain_us']:>9.2f}{r['plain_act_us']:>11.2f}{r['gated_us']:>9.2f}"
              f"{r['gated_best']['us']:>12.2f}  {r['gated_best']['config']}")
    print_result({"bench": "w4a16_gated", "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
                  "wall_s": round(time.perf_counter() - t0, 1)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
