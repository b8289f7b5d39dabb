"""Zero-fold A/B on the H200 (issue 15, session 8): the lean kernel of the working tree (zero point folded in
through a second mma) against the lean kernel as committed before it (built here as its own extension from
.scratch/zfold/dev/old/, namespace renamed) and the register ring, same process, interleaved.

  python3 ab.py --build-old      # build the old lean extension only (run in the background first)
  python3 ab.py [--out DIR]      # numerics table, per-layer and 4-matmul chain timings, a small config sweep
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = Path(os.environ.get("REPO", HERE.parents[2]))
SHAPES = {"7b": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],
          "qwen8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
          "qwen2b": [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144)]}
PARTS = ("qkv", "o", "gate_up", "down")


def build_old():
    import torch
    from torch.utils import cpp_extension

    cc = "".join(str(v) for v in torch.cuda.get_device_capability())
    d = Path("/tmp/zf_old_build")
    d.mkdir(exist_ok=True)
    ren = "-Dedgevlm_w4a16=edgevlm_w4a16_old"
    t = time.perf_counter()
    ext = cpp_extension.load(
        name="w4a16_lean_old_zf", sources=[str(HERE / "old" / "bind.cpp"), str(HERE / "old" / "w4a16_lean.cu")],
        extra_cflags=["-O3", ren], extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{cc},code=sm_{cc}",
                                                      "-DEDGEVLM_W4A16_LEAN", ren],
        build_directory=str(d), verbose=False)
    print(f"old lean extension ready in {time.perf_counter() - t:.1f} s", flush=True)
    return ext


def marlin():
    spec = importlib.util.spec_from_file_location("w4a16_marlin_bench", REPO / "bench" / "w4a16_marlin.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-old", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--skip-sweep", action="store_true")
    args = ap.parse_args()
    mar = marlin()
    mar.bootstrap_imports()
    if args.build_old:
        build_old()
        return 0
    import torch

    from edgevlm.runtime.int4_format import dequantize_int4, pack_int4, quantize_int4, repack_int4_mma
    from edgevlm.runtime.kernels import w4a16_mma as mk

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    assert mk.mma_status(dev, "lean") is None, mk.mma_status(dev, "lean")
    try:
        old = build_old()
    except Exception as exc:  # noqa: BLE001
        print(f"old lean extension unavailable: {exc}", flush=True)
        old = None
    res = {"numerics": [], "layers": [], "chain": [], "sweep": []}
    gen = torch.Generator(device=dev).manual_seed(7)

    # ---- numerics: new lean vs float64, vs the register ring; old lean == register ring (sanity)
    print("numerics: case | rel new-f64 | rel reg-f64 | rel new-reg | elems != reg | max |new-reg| in ulps "
          "(of |reg|) | old==reg", flush=True)
    for dtype in (torch.bfloat16, torch.float16):
        for g in (128, 64):
            n, k = 4096, 4096
            for offset in (0.0, 2.0):
                if offset:
                    codes = torch.randint(0, 16, (n, k), device=dev, generator=gen, dtype=torch.uint8)
                    zeros = torch.randint(0, 16, (n, k // g), device=dev, generator=gen, dtype=torch.uint8)
                    zeros[::2, ::2] = 0
                    zeros[1::2, 1::2] = 15
                    scales = (torch.rand(n, k // g, device=dev, generator=gen) * 0.004 + 5e-4).half()
                    qwt, sc, zz = pack_int4(codes), scales, zeros
                else:
                    qw = quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, g)
                    qwt, sc, zz = qw.qweight, qw.scales, qw.zeros
                packed, meta = repack_int4_mma(qwt, sc, zz, g)
                w64 = dequantize_int4(qwt, sc, zz, g, torch.float64)
                for m in (1, 8, 16):
                    x = (torch.randn(m, k, device=dev, generator=gen) + offset).to(dtype)
                    ref = x.double() @ w64.T
                    cfg = mk.mma_config(m, n, k, g, lean=True)
                    if cfg[0] != "lean":
                        cfg = ("lean", *mk.DEFAULT_LEAN_CONFIG)
                    y = mk.w4a16_mma(x, packed, meta, g, config=cfg)
                    y2 = mk.w4a16_mma(x, packed, meta, g, config=cfg)
                    twin = mk.w4a16_mma(x, packed, meta, g, config=("reg", cfg[1], 2, cfg[3]), mode=2)
                    diff = (y.float() - twin.float()).abs()
                    ulp = torch.where(twin == 0, torch.ones_like(diff), (twin.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)))
                    same_old = None
                    if old is not None:
                        yo = old.lean_old(x, packed, meta, g, cfg[1], cfg[2], cfg[3])
                        same_old = bool(torch.equal(yo, twin))
                    row = {"dtype": str(dtype)[6:], "g": g, "x_offset": offset, "m": m, "cfg": list(cfg),
                           "rel_new": rel(y, ref), "rel_reg": rel(twin, ref), "rel_new_reg": rel(y, twin),
                           "frac_diff": float((y != twin).float().mean()), "max_ulps": float((diff / ulp).max()),
                           "stable": bool(torch.equal(y, y2)), "old_eq_reg": same_old}
                    res["numerics"].append(row)
                    print(f"  {row['dtype']} g{g} off{offset:g} M={m} {tuple(cfg)}: {row['rel_new']:.3e} "
                          f"{row['rel_reg']:.3e} {row['rel_new_reg']:.2e} {row['frac_diff']:.4f} "
                          f"{row['max_ulps']:.2f} stable={row['stable']} old==reg={same_old}", flush=True)
    print(f"[numerics {time.perf_counter() - t0:.0f} s]", flush=True)

    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2 ** 20))
    g = 128

    def make(n, k, copies):
        qw = quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, g)
        p, mt = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
        return [(p.clone(), mt.clone()) for _ in range(copies)], qw.nbytes()

    def fns(cfg, x, cps, g=g):
        new = [partial(mk.w4a16_mma, x, p, mt, g, config=cfg, pdl=False) for p, mt in cps]
        fb = mk.mma_config(x.shape[0], cps[0][0].shape[0] * 16, x.shape[1], g, lean=False, bulk=True)
        reg = [partial(mk.w4a16_mma, x, p, mt, g, config=fb, pdl=False) for p, mt in cps]
        o = [partial(old.lean_old, x, p, mt, g, cfg[1], cfg[2], cfg[3]) for p, mt in cps] if old else None
        return new, o, reg, fb

    # ---- per layer: the table's lean configuration, new vs old (interleaved, best of 2 medians each) + the
    # table's non-lean fallback (register ring / bulk)
    print("layers: shape M cfg | new us (GB/s) | old us (GB/s) | new/old | reg-table us", flush=True)
    for model in ("7b", "qwen8b"):
        for (n, k), part in zip(SHAPES[model], PARTS, strict=False):
            cps, nbytes = make(n, k, mar.copies_for(n * k // 2, l2))
            for m in (1, 8, 16):
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                cfg = mk.mma_config(m, n, k, g, lean=True, bulk=True)
                if cfg[0] != "lean":  # the table's register-ring entry: its schedule on the lean kernel
                    cfg = ("lean", cfg[1], 2, cfg[3]) if (cfg[1], 2) in mk.LEAN_CONFIGS else ("lean", 8, 2, 1)
                new, o, reg, fb = fns(cfg, x, cps)
                tn, to = [], []
                for _ in range(2):
                    tn.append(mar.graph_us(new))
                    if o:
                        to.append(mar.graph_us(o))
                tr = mar.graph_us(reg)
                un, uo = min(tn), (min(to) if to else None)
                row = {"shape": f"{model}.{part}", "n": n, "k": k, "m": m, "cfg": list(cfg), "new_us": round(un, 2),
                       "old_us": round(uo, 2) if uo else None, "reg_cfg": list(fb), "reg_us": round(tr, 2),
                       "new_gbps": round(nbytes / un / 1e3, 1), "old_gbps": round(nbytes / uo / 1e3, 1) if uo else None,
                       "new_all": [round(v, 2) for v in tn], "old_all": [round(v, 2) for v in to]}
                res["layers"].append(row)
                print(f"  {model}.{part} {n}x{k} M={m} {tuple(cfg[1:])}: {un:.2f} ({row['new_gbps']}) | "
                      f"{uo if uo is None else round(uo, 2)} ({row['old_gbps']}) | "
                      f"{(un / uo if uo else float('nan')):.3f} | {tr:.2f} {tuple(fb)}", flush=True)
            del cps
            torch.cuda.empty_cache()
    print(f"[layers {time.perf_counter() - t0:.0f} s]", flush=True)

    # ---- a decoder layer's four matmuls back to back, table configurations: new vs old lean
    print("chain: model M | new us (GB/s) | old us (GB/s) | new/old", flush=True)
    for model in ("7b", "qwen8b", "qwen2b"):
        layer = []
        for n, k in SHAPES[model]:
            qw = quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, g)
            layer.append((n, k, *repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g), qw.nbytes()))
        lb = sum(e[4] for e in layer)
        copies = [[(n, k, p.clone(), mt.clone()) for n, k, p, mt, _ in layer] for _ in range(mar.copies_for(lb, l2))]
        for m in (1, 8, 16):
            xs = {k: torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16) for _, k, *_ in layer}
            new, olds, ok = [], [], True
            for cp in copies:
                for n, k, p, mt in cp:
                    cfg = mk.mma_config(m, n, k, g, lean=True, bulk=True)
                    new.append(partial(mk.w4a16_mma, xs[k], p, mt, g, config=cfg, pdl=False))
                    if cfg[0] == "lean" and old:
                        olds.append(partial(old.lean_old, xs[k], p, mt, g, cfg[1], cfg[2], cfg[3]))
                    else:  # a non-lean table entry: the same call in both
                        olds.append(partial(mk.w4a16_mma, xs[k], p, mt, g, config=cfg, pdl=False))
                        ok = ok and cfg[0] != "lean"
            tn, to = [], []
            for _ in range(3):
                tn.append(mar.graph_us(new) * 4)
                if old:
                    to.append(mar.graph_us(olds) * 4)
            un, uo = statistics.median(tn), (statistics.median(to) if to else None)
            row = {"model": model, "m": m, "new_us": round(un, 2), "old_us": round(uo, 2) if uo else None,
                   "new_gbps": round(lb / un / 1e3, 1), "old_gbps": round(lb / uo / 1e3, 1) if uo else None,
                   "new_all": [round(v, 2) for v in tn], "old_all": [round(v, 2) for v in to]}
            res["chain"].append(row)
            print(f"  {model} M={m}: {un:.2f} ({row['new_gbps']}) | {uo if uo is None else round(uo, 2)} "
                  f"({row['old_gbps']}) | {(un / uo if uo else float('nan')):.3f}", flush=True)
        del copies
        torch.cuda.empty_cache()
    print(f"[chain {time.perf_counter() - t0:.0f} s]", flush=True)
    (Path(args.out) / "zfold_ab.json").write_text(json.dumps(res, indent=1))

    # ---- does the fold move the best lean configuration? 7B shapes, every lean (KSPLIT, DEPTH) x tpc 1/2
    if not args.skip_sweep:
        print("sweep (new lean): shape M: best cfg us | table cfg us", flush=True)
        for (n, k), part in zip(SHAPES["7b"], PARTS, strict=False):
            cps, nbytes = make(n, k, mar.copies_for(n * k // 2, l2))
            for m in (1, 8, 16):
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                tab = mk.mma_config(m, n, k, g, lean=True, bulk=True)
                times = {}
                for ks, d in mk.LEAN_CONFIGS:
                    for tpc in (1, 2):
                        cfg = ("lean", ks, d, tpc)
                        times[cfg] = mar.graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=cfg, pdl=False)
                                                   for p, mt in cps])
                best = min(times, key=times.get)
                res["sweep"].append({"shape": f"7b.{part}", "m": m, "best": list(best), "best_us": round(times[best], 2),
                                     "table": list(tab), "table_us": round(times.get(tuple(tab), float("nan")), 2),
                                     "all": {str(c): round(t, 2) for c, t in times.items()}})
                print(f"  7b.{part} M={m}: {best[1:]} {times[best]:.2f} | {tuple(tab)} "
                      f"{times.get(tuple(tab), float('nan')):.2f}", flush=True)
            del cps
            torch.cuda.empty_cache()
        print(f"[sweep {time.perf_counter() - t0:.0f} s]", flush=True)
    (Path(args.out) / "zfold_ab.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
