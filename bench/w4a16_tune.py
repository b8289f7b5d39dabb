#!/usr/bin/env python3
"""Tune and time the Triton W4A16 kernels (runtime/kernels/w4a16.py) on a CUDA GPU.

For each layer shape of the bench models (LLaVA-1.5-7B's decoder with fused q/k/v and gate/up, the
issue's 11008x4096, the ~0.5B small decoder) and M = 1, 2, 4, 8 rows, it times every GEMV launch
configuration of a grid inside a CUDA graph (``triton.testing.do_bench_cudagraph``: no host launch
overhead, as in the decode graphs), checks the best against a float64 reference, and compares with
torch's tinygemm int4 op and a bf16 cuBLAS matmul. For prefill-sized M it times the Triton
dequantizer + cuBLAS against the bf16 matmul alone. Achieved bandwidth = bytes of qweight + scales +
zeros + activations / time, against the device-to-device copy bandwidth measured first.

Writes the best configurations to ``runtime/kernels/w4a16_configs.json`` (``--write``) and to
``$OUT`` when set. Prints tables, then one JSON line. Usage::

    python3 bench/w4a16_tune.py [--write] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (N out, K in)
    "7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008),
    "7b.up": (11008, 4096),
    "small.qkv": (1152, 896), "small.o": (896, 896), "small.gate_up": (9728, 896), "small.down": (896, 4864),
}
GRID = {"BN": (8, 16, 32), "BK": (256, 512, 1024), "SPLIT": (1, 2, 4, 8), "warps": (4,)}
TOP = 6  # configs of M = 1 re-timed with 2 and 8 warps, and tried for M > 1


def copy_gbps() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(partial(dst.copy_, src), warmup=25, rep=200, return_mode="median")
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def dequant_mm(x, qw, g):
    from edgevlm.runtime.kernels import w4a16

    return F.linear(x, w4a16.dequantize_w4(qw.qweight, qw.scales, qw.zeros, g))


def kernel_call(kernel, x, qw, g, cfg):
    """A zero-argument call of a W4A16 kernel with launch configuration ``cfg`` (for graph_us)."""
    return partial(kernel, x, qw.qweight, qw.scales, qw.zeros, g, config=cfg)


def sweep(make, cfgs, label: str) -> list[tuple[float, tuple]]:
    """``(us, cfg)`` of every configuration the compiler accepts, fastest first."""
    out = []
    for cfg in cfgs:
        try:
            out.append((graph_us(make(cfg)), cfg))
        except Exception as exc:  # a config the compiler rejects (registers/shared memory)
            print(f"  {label} {cfg}: {type(exc).__name__}", flush=True)
    return sorted(out)


def graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write runtime/kernels/w4a16_configs.json")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (smoke run)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--only-gemv1", action="store_true",
                    help="tune only the batch-1 GEMV (w4a16_gemv1) against tinygemm; keep the rest of the file")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16

    if not torch.cuda.is_available():
        print("w4a16_tune: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = args.group_size
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_gbps()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy {bw:.0f} GB/s", flush=True)
    grid = {k: v[:2] if args.quick else v for k, v in GRID.items()}
    configs: dict[str, dict[str, list]] = {}
    cfg_file = REPO / "runtime" / "kernels" / "w4a16_configs.json"
    old_configs = json.loads(cfg_file.read_text()).get("configs", {}) if cfg_file.is_file() else {}
    rows = []
    conv = int4.kernel_convention(dev)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) * 0.02
        qw = int4.quantize_int4(w, g)
        wq64 = int4.dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
        wbf = wq64.to(torch.bfloat16)
        weight_bytes = qw.nbytes()
        packed = sz = None
        if conv is not None:
            packed = int4._pack_for_kernel(conv, qw.qweight)
            sz = int4._tinygemm_scales_and_zeros(qw.scales, qw.zeros, torch.bfloat16)
        key = f"{n}x{k}g{g}"
        configs[key] = dict(old_configs.get(key, {}))
        # batch-1 GEMV (w4a16_gemv1): (BLOCK_N, GROUPS_PER_STEP, SPLIT_K, warps)
        x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref1 = x1.double() @ wq64.T
        g1 = [(bn, ps, sp, 4) for bn, ps, sp in itertools.product((4, 8, 16, 32), (1, 2, 4, 8), (1, 2, 4))
              if ps * g <= max(k, g)]
        make1 = partial(kernel_call, w4a16.w4a16_gemv1, x1, qw, g)
        t1 = sweep(make1, g1, f"{name} gemv1")
        t1 = sorted(t1 + sweep(make1, [c[:3] + (wp,) for _, c in t1[:TOP] for wp in (2, 8)], f"{name} gemv1"))
        us1, best1 = t1[0]
        y1 = w4a16.w4a16_gemv1(x1, qw.qweight, qw.scales, qw.zeros, g, config=best1)
        err1 = ((y1.double() - ref1).norm() / ref1.norm()).item()
        if not err1 < 1e-2:
            print(f"WRONG RESULT {name} gemv1 {best1}: rel err {err1:.2e}", file=sys.stderr)
            return 1
        tg1 = graph_us(partial(torch.ops.aten._weight_int4pack_mm, x1, packed, g, sz)) if packed is not None \
            else float("nan")
        bf1 = graph_us(partial(F.linear, x1, wbf))
        moved1 = weight_bytes + k * 2 + n * 2
        configs[key]["gemv1"] = list(best1)
        configs[key]["gemv1_us"] = [round(us1, 2)]
        configs[key]["tinygemm_us"] = [round(tg1, 2)]
        rows.append({"shape": name, "n": n, "k": k, "m": 1, "kernel": "gemv1", "best": list(best1),
                     "triton_us": round(us1, 2), "tinygemm_us": round(tg1, 2), "bf16_us": round(bf1, 2),
                     "triton_gbps": round(moved1 / us1 / 1e3, 1), "pct_copy": round(100 * moved1 / us1 / 1e3 / bw, 1),
                     "tinygemm_pct_copy": round(100 * moved1 / tg1 / 1e3 / bw, 1), "rel_err": err1})
        print(f"{name:14s} gemv1 best {best1}  {us1:7.2f} us  {rows[-1]['pct_copy']:5.1f}% copy   tinygemm "
              f"{tg1:7.2f} us ({rows[-1]['tinygemm_pct_copy']:.1f}%)  bf16 {bf1:7.2f} us  err {err1:.1e}", flush=True)
        if args.only_gemv1:
            torch.cuda.empty_cache()
            continue
        ranked: list[tuple[float, tuple]] = []
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ wq64.T
            bms = (1,) if m == 1 else (2,) if m == 2 else (4,) if m == 4 else (4, 8)
            if m == 1:
                cands = [(1, bn, bk, sp, wp) for bn, bk, sp, wp in itertools.product(
                    grid["BN"], grid["BK"], grid["SPLIT"], grid["warps"]) if bk % g == 0]
            else:  # the best of M = 1, with this M's block
                cands = [(bm,) + c[1:] for _, c in ranked[:TOP] for bm in bms]
            make = partial(kernel_call, w4a16.w4a16_gemv, x, qw, g)
            timed = sweep(make, cands, f"{name} M={m}")
            if m == 1:  # the leaders again with other warp counts
                timed = sorted(timed + sweep(make, [c[:4] + (wp,) for _, c in timed[:TOP] for wp in (2, 8)],
                                             f"{name} M={m}"))
                ranked = timed
            us, best = timed[0]
            y = w4a16.w4a16_gemv(x, qw.qweight, qw.scales, qw.zeros, g, config=best)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"WRONG RESULT {name} M={m} {best}: rel err {err:.2e}", file=sys.stderr)
                return 1
            heur = list(w4a16.gemv_config(m, n, k, g))
            bf16_us = graph_us(partial(F.linear, x, wbf))
            tg_us = graph_us(partial(torch.ops.aten._weight_int4pack_mm, x, packed, g, sz)) if packed is not None \
                else float("nan")
            moved = weight_bytes + x.numel() * 2 + m * n * 2
            rows.append({"shape": name, "n": n, "k": k, "m": m, "best": list(best), "triton_us": round(us, 2),
                         "tinygemm_us": round(tg_us, 2), "bf16_us": round(bf16_us, 2),
                         "triton_gbps": round(moved / us / 1e3, 1), "pct_copy": round(100 * moved / us / 1e3 / bw, 1),
                         "bf16_pct_copy": round(100 * (n * k * 2) / bf16_us / 1e3 / bw, 1), "rel_err": err,
                         "n_configs": len(timed), "heuristic": heur})
            configs[key][str(m)] = list(best)
            print(f"{name:14s} M={m}  best {best}  {us:7.2f} us  {rows[-1]['pct_copy']:5.1f}% copy  "
                  f"tinygemm {tg_us:7.2f} us  bf16 {bf16_us:7.2f} us  err {err:.1e}", flush=True)
        # prefill: dequantize + cuBLAS vs bf16 matmul
        for m in (16, 64, 608):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            dq_us = graph_us(partial(dequant_mm, x, qw, g))
            bf16_us = graph_us(partial(F.linear, x, wbf))
            rows.append({"shape": name, "n": n, "k": k, "m": m, "dequant_mm_us": round(dq_us, 2),
                         "bf16_us": round(bf16_us, 2)})
            print(f"{name:14s} M={m:<4d} dequant+mm {dq_us:8.2f} us   bf16 mm {bf16_us:8.2f} us", flush=True)
        d = w4a16.dequantize_w4(qw.qweight, qw.scales, qw.zeros, g)
        if not torch.equal(d, wq64.to(torch.float32).to(torch.bfloat16)):
            print(f"WRONG DEQUANT {name}", file=sys.stderr)
            return 1
        torch.cuda.empty_cache()
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "group_size": g,
               "copy_gbps": round(bw, 1), "configs": configs}
    if args.write:
        cfg_file.write_text(json.dumps(payload, indent=1) + "\n")
        w4a16.tuned_configs.cache_clear()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w4a16_configs.json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n| shape | M | kernel | best config | triton us | % copy | tinygemm us | bf16 us |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if "triton_us" in r:
            print(f"| {r['shape']} | {r['m']} | {r.get('kernel', 'gemv')} | {tuple(r['best'])} | {r['triton_us']} | "
                  f"{r['pct_copy']} | "
                  f"{r['tinygemm_us']} | {r['bf16_us']} |")
    print(json.dumps({"bench": "w4a16_tune", **{k: v for k, v in payload.items() if k != "configs"}, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
