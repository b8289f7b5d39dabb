#!/usr/bin/env python3
"""W4A16 decode GEMM on a CUDA GPU: the tensor-core kernel (runtime/kernels/w4a16_mma.cu) vs torch's
tinygemm int4 op vs a bf16 cuBLAS matmul, per layer at M = 1, 8, 16.

Shapes: LLaVA-1.5-7B / Llama-2-7B (fused qkv 12288x4096, o 4096x4096, fused gate_up 22016x4096, down
4096x11008) and the text decoders of Qwen3-VL-8B (hidden 4096, intermediate 12288, 32 query / 8 KV
heads of 128: qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288) and Qwen3-VL-2B
(hidden 2048, intermediate 6144, 16 / 8 heads of 128: qkv 4096x2048, o 2048x2048, gate_up
12288x2048, down 2048x6144); group size 128, asymmetric zero points (AWQ's scheme), random weights.

Correctness first: every (shape, M) is checked against a float64 matmul of the dequantized weight
(||y - ref|| / ||ref||, limit 3e-3), three runs must be bit-identical, and a bias/fp16/group-64 case
runs too. Timing: CUDA-graph replays of one call per weight copy, the copies rotated so that the
weights of one replay exceed 3x the L2 (each call reads its weights from HBM, METHOD.md); the median
replay over the copies. GB/s counts the canonical INT4 bytes (qweight + fp16 scales + uint8 zeros,
what tinygemm's numbers in issue 15 count) plus activations and outputs; bf16 counts its weight.

Usage::

    python3 bench/w4a16_marlin.py [--sweep] [--decode] [--quick]

``--sweep`` times every compiled (KSPLIT, DEPTH) launch configuration per shape and M; ``--decode``
runs the whole-model decode benchmark (LLaVA-1.5-7B shape, W4A16, batch 1 and 8) with the kernel off
and on. Prints tables, then one JSON line (also written to ``$OUT/w4a16_marlin.json`` when set).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (N out, K in)
    "7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008),
    "qwen8b.qkv": (6144, 4096), "qwen8b.o": (4096, 4096), "qwen8b.gate_up": (24576, 4096),
    "qwen8b.down": (4096, 12288),
    "qwen2b.qkv": (4096, 2048), "qwen2b.o": (2048, 2048), "qwen2b.gate_up": (12288, 2048),
    "qwen2b.down": (2048, 6144),
}
MS = (1, 8, 16)
TILES_PER_CTA = (1, 2, 4, 8)
REL_LIMIT = 3e-3


def bootstrap_imports() -> None:
    """Import ``edgevlm.runtime`` from this checkout (bench/gpu_suite.py's bootstrap)."""
    spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "bench" / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._bootstrap_imports()


def graph_us(calls, reps: int = 30) -> float:
    """Median µs per call of a CUDA graph that runs ``calls`` (zero-argument callables) once each."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return max(2, math.ceil(3 * l2_bytes / nbytes))


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time every compiled launch configuration")
    ap.add_argument("--decode", action="store_true", help="whole-model W4A16 decode, kernel off vs on")
    ap.add_argument("--quick", action="store_true", help="the four 7B shapes only")
    ap.add_argument("--decode-only", action="store_true", help="only the whole-model decode (kernel off vs on)")
    args = ap.parse_args(argv)
    bootstrap_imports()
    import torch

    if args.decode_only:
        decode = run_decode()
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "w4a16_decode.json").write_text(json.dumps(decode, indent=1) + "\n")
        print(json.dumps({"bench": "w4a16_marlin_decode", "decode": decode}))
        return 0
    import torch.nn.functional as F

    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16_mma as mk

    if not torch.cuda.is_available():
        print("w4a16_marlin: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(10):  # ramp the clocks
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    copy_gbps = 2 * (1 << 30) * 20 / (start.elapsed_time(end) * 1e-3) / 1e9
    del src, dst
    t0 = time.perf_counter()
    try:
        mk.load_extension(dev)
    except mk.MmaKernelUnavailable as exc:
        print(f"w4a16_marlin: kernel unavailable: {exc}", file=sys.stderr)
        return 1
    build_s = time.perf_counter() - t0
    print(f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, "
          f"copy {copy_gbps:.0f} GB/s; torch {torch.__version__}; extension ready in {build_s:.1f} s", flush=True)
    conv = int4.kernel_convention(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows, checks, sweep_rows = [], [], []
    tuned: dict[str, dict[str, list[int]]] = {}
    shapes = {k: v for k, v in SHAPES.items() if k.startswith("7b.")} if args.quick else SHAPES
    g = 128
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        qw = int4.quantize_int4(w, g)
        del w
        w64 = int4.dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
        wbf = w64.to(torch.bfloat16)
        packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
        tg_w = int4._pack_for_kernel(conv, qw.qweight) if conv else None
        tg_sz = int4._tinygemm_scales_and_zeros(qw.scales, qw.zeros, torch.bfloat16) if conv else None
        int4_bytes = qw.nbytes()
        r4 = copies_for(int4_bytes, l2)
        r16 = copies_for(n * k * 2, l2)
        mma_copies = [(packed.clone(), meta.clone()) for _ in range(r4)]
        tg_copies = [(tg_w.clone(), tg_sz.clone()) for _ in range(r4)] if conv else []
        bf_copies = [wbf.clone() for _ in range(r16)]
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.double() @ w64.T
            cfg = mk.mma_config(m, n, k, g)
            outs = [mk.w4a16_mma(x, packed, meta, g) for _ in range(3)]
            err = rel(outs[0], ref)
            stable = all(torch.equal(outs[0], o) for o in outs[1:])
            finite = bool(torch.isfinite(outs[0]).all())
            tg_err = rel(torch.ops.aten._weight_int4pack_mm(x, tg_w, g, tg_sz), ref) if conv else float("nan")
            checks.append({"shape": name, "m": m, "rel_err": err, "bit_stable": stable, "finite": finite,
                           "tinygemm_rel_err": tg_err, "pass": err <= REL_LIMIT and stable and finite})
            moved = int4_bytes + x.numel() * 2 + m * n * 2
            if args.sweep:
                mine = []
                for c in [(*kd, tpc) for kd in mk.MMA_CONFIGS for tpc in TILES_PER_CTA]:
                    y = mk.w4a16_mma(x, packed, meta, g, config=c)
                    c_err = rel(y, ref)
                    us = graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c) for p, mt in mma_copies])
                    row = {"shape": name, "m": m, "config": list(c), "us": round(us, 2),
                           "gbps": round(moved / us / 1e3, 1), "rel_err": c_err, "ok": c_err <= REL_LIMIT}
                    if m == 1 and name.startswith("7b."):  # the loads-only diagnostic: the streaming ceiling
                        lo = graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c, mode=1) for p, mt in mma_copies])
                        row["loads_only_us"] = round(lo, 2)
                        row["loads_only_gbps"] = round(moved / lo / 1e3, 1)
                    mine.append(row)
                sweep_rows.extend(mine)
                bad_cfg = [r["config"] for r in mine if not r["ok"]]
                if bad_cfg:
                    checks.append({"shape": name, "m": m, "rel_err": max(r["rel_err"] for r in mine),
                                   "bit_stable": True, "finite": True, "tinygemm_rel_err": None, "pass": False,
                                   "bad_configs": bad_cfg})
                best = min((r for r in mine if r["ok"]), key=lambda r: r["us"])
                cfg = tuple(best["config"])
                tuned.setdefault(f"{n}x{k}g{g}", {})[str(m)] = list(cfg)
                lo_best = min((r["loads_only_us"] for r in mine if "loads_only_us" in r), default=None)
                print(f"  sweep {name} M={m}: best {cfg} {best['us']} us ({best['gbps']} GB/s)"
                      + (f"; loads-only best {lo_best} us ({moved / lo_best / 1e3:.0f} GB/s)" if lo_best else "")
                      + "; top5 " + " ".join(f"{tuple(r['config'])}:{r['us']}"
                                             for r in sorted(mine, key=lambda r: r["us"])[:5]), flush=True)
            mma_us = graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=cfg) for p, mt in mma_copies])
            tg_us = graph_us([partial(torch.ops.aten._weight_int4pack_mm, x, a, g, b) for a, b in tg_copies]) \
                if conv else float("nan")
            bf_us = graph_us([partial(F.linear, x, wb) for wb in bf_copies])
            row = {"shape": name, "n": n, "k": k, "m": m, "config": list(cfg), "mma_us": round(mma_us, 2),
                   "tinygemm_us": round(tg_us, 2), "bf16_us": round(bf_us, 2),
                   "mma_gbps": round(moved / mma_us / 1e3, 1), "tinygemm_gbps": round(moved / tg_us / 1e3, 1),
                   "bf16_gbps": round((n * k * 2 + x.numel() * 2 + m * n * 2) / bf_us / 1e3, 1),
                   "mma_pct_copy": round(100 * moved / mma_us / 1e3 / copy_gbps, 1),
                   "speedup_vs_tinygemm": round(tg_us / mma_us, 2), "speedup_vs_bf16": round(bf_us / mma_us, 2),
                   "rel_err": err, "copies": [r4, r16]}
            rows.append(row)
            print(f"{name:15s} M={m:<3d} mma {mma_us:7.2f} us {row['mma_gbps']:7.1f} GB/s | tinygemm {tg_us:7.2f} us "
                  f"{row['tinygemm_gbps']:7.1f} | bf16 {bf_us:7.2f} us {row['bf16_gbps']:7.1f} | err {err:.2e} "
                  f"stable {stable}", flush=True)
        del mma_copies, tg_copies, bf_copies, w64, wbf
        torch.cuda.empty_cache()
    # extra correctness: bias, fp16 activations, group size 64, odd M
    n, k = 4096, 4096
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    for gsz in (64, 128):
        qw = int4.quantize_int4(w, gsz)
        w64 = int4.dequantize_int4(qw.qweight, qw.scales, qw.zeros, gsz, torch.float64)
        packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, gsz)
        bias = torch.randn(n, device=dev, generator=gen)
        for m in (1, 3, 9, 16):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
                ref = x.double() @ w64.T + bias.double()
                errs = [rel(mk.w4a16_mma(x, packed, meta, gsz, bias, config=(*c, tpc)), ref)
                        for c in mk.MMA_CONFIGS for tpc in (1, 3)]
                checks.append({"shape": f"bias.{n}x{k}.g{gsz}.{str(dtype)[6:]}", "m": m, "rel_err": max(errs),
                               "bit_stable": True, "finite": True, "tinygemm_rel_err": None,
                               "pass": max(errs) <= REL_LIMIT})
    # Int4Linear picks the kernel for decode and matches the float64 reference
    lin = torch.nn.Linear(4096, 11008, bias=True, device=dev, dtype=torch.bfloat16)
    q = int4.Int4Linear.from_linear(lin, 128)
    wq = q.dequantized_weight(torch.float64)
    for m in (1, 8, 16, 17):
        x = torch.randn(m, 4096, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.double() @ wq.T + q.bias.double()
        checks.append({"shape": "Int4Linear.11008x4096", "m": m, "path": q.execution_path(m, dev),
                       "rel_err": rel(q(x), ref), "bit_stable": True, "finite": True, "tinygemm_rel_err": None,
                       "pass": rel(q(x), ref) <= (REL_LIMIT if m <= 16 else 1e-2)
                       and (q.execution_path(m, dev) == "mma") == (m <= 16)})
    decode = run_decode() if args.decode else None
    print("\n| shape | M | mma µs | mma GB/s | % copy | tinygemm µs | tinygemm GB/s | bf16 µs | bf16 GB/s | vs tinygemm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['m']} | {r['mma_us']} | {r['mma_gbps']} | {r['mma_pct_copy']} | {r['tinygemm_us']} | "
              f"{r['tinygemm_gbps']} | {r['bf16_us']} | {r['bf16_gbps']} | {r['speedup_vs_tinygemm']}x |")
    bad = [c for c in checks if not c["pass"]]
    print(f"\nchecks: {len(checks) - len(bad)}/{len(checks)} pass; max rel err "
          f"{max(c['rel_err'] for c in checks):.2e}" + (f"; FAILED: {bad}" if bad else ""))
    payload = {"bench": "w4a16_marlin", "device": props.name, "torch": torch.__version__,
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "group_size": g,
               "copy_gbps": round(copy_gbps, 1), "l2_mib": l2 >> 20, "build_s": round(build_s, 1),
               "all_checks_pass": not bad, "rows": rows, "checks": checks, "sweep": sweep_rows, "decode": decode}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w4a16_marlin.json").write_text(json.dumps(payload, indent=1) + "\n")
        if tuned:
            Path(os.environ["OUT"], "w4a16_mma_configs.json").write_text(json.dumps(
                {"device": props.name, "torch": torch.__version__, "date": payload["date"], "group_size": g,
                 "source": "bench/w4a16_marlin.py --sweep", "configs": tuned}, indent=1) + "\n")
    print(json.dumps({k: v for k, v in payload.items() if k not in ("checks", "sweep")}))
    return 0 if not bad else 1


def run_decode() -> list[dict]:
    """Whole-model decode (LLaVA-1.5-7B shape, W4A16 weights, batch 1 and 8), the kernel off then on."""
    from edgevlm.quantize import benchmark

    out = []
    for flag in ("0", "1"):
        os.environ["EDGEVLM_W4A16_MMA"] = flag
        summary = benchmark.run(models=["llava-7b"], variants=["edgevlm-w4"], with_hf=False, batch_sizes=[1, 8],
                                new_tokens=32)
        for r in summary["rows"]:
            r = {k: r.get(k) for k in ("model", "impl", "ttft_ms", "tpot_ms", "decode_tok_s", "step_gpu_ms",
                                       "batch_tok_s", "copy_frac", "error")}
            r["mma_kernel"] = flag == "1"
            out.append(r)
            print(f"decode mma={flag}: {r}", flush=True)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
