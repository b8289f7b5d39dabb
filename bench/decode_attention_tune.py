#!/usr/bin/env python3
"""Tuning sweep of the decode step's attention kernel (``decode_attention`` in runtime/kernels/decode_fused.py)
over 16-bit (bf16) and fp8 (e4m3 + per-position fp16 scale) KV caches.

Cases: LLaVA-1.5-7B's attention (32 query heads, 32 KV heads, head_dim 128) and Qwen3-VL-8B's (32 query
heads, 8 KV heads, head_dim 128), batch 1, 8 and 32, every row at position ``--context`` (609: a 609-token
prompt, keys 0..609 attended) in the 768-position bucket, bf16 queries, bf16 and fp8 caches.

What is timed: one call per decoder layer over ``--layers`` (32) layers' own caches, captured in one CUDA graph
and replayed (``--reps`` replays, each timed with CUDA events; the median replay / layers = µs per call), so each
call reads its cache from HBM as a real step does (32 layers' caches are far larger than the 60 MB L2). The
split kernel and its combine are both in the time. GB/s = KV bytes the call reads (rows x KV heads x 610 keys x
head_dim x k and v, plus the fp8 scales) / time; an H200 copies ~4.2 TB/s.

Meta-parameters (keyword arguments of ``decode_attention``; ``AttentionConfig`` fields): ``block_n`` (keys per
loop step) 32/64/128, ``num_warps`` 2/4/8, ``num_stages`` (software pipelining) 2/3/4, ``ctas_per_sm`` (the
CTA budget that decides how many ways the keys are split: splits halve until rows x KV heads x splits <= budget
x SMs) 2/4/8. Searched in stages so the sweep fits ~120 s on an H200 (every Triton variant compiles once): A)
block_n x num_warps 2/4 at 3 stages and 4 CTAs/SM, B) num_stages and 8 warps at A's best (8 warps never won
stage A on the H200, 2026-12-02), C) ctas_per_sm at B's best, and for
fp8 D) the e4m3 conversion on the bits instead of the hardware's (``FP8_NATIVE``), E) each case's best on the
other model's case of the same batch and cache (for the suggested table). Each stage runs for every
case before the next starts; past ``--budget-s`` the later stages are skipped (the output says so). Finally the
default and each case's best are timed twice more, alternating; reported = the median of all their times.

Output: one table row per case (default config and time, best config and time, speedup, GB/s), the fp8/bf16
time ratios, a suggested ``ATTENTION_CONFIGS`` (decode_fused.py) per cache kind and batch bucket — the config
with the lowest summed time over both models among those measured for both, kept only where it beats the
default by more than 3% — then one JSON line with everything. Usage (CUDA GPU only; exits 2 otherwise)::

    python3 bench/decode_attention_tune.py [--out tune.json] [--budget-s 95] [--reps 25] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MODELS = {"llava-1.5-7b": (32, 32, 128), "qwen3-vl-8b": (32, 8, 128)}  # (query heads, KV heads, head_dim)
BATCHES = (1, 8, 32)
KINDS = ("bf16", "fp8")
BUCKET = 768
GRID_A = [(bn, w) for bn in (32, 64, 128) for w in (2, 4)]
STAGES = (2, 3, 4)  # 1 (no pipelining) never won on the H200 (two runs, 2026-12-02)
CTAS_PER_SM = (2, 4, 8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=609, help="each row's position (keys 0..context are attended)")
    ap.add_argument("--layers", type=int, default=32, help="layers' caches rotated through per replay")
    ap.add_argument("--reps", type=int, default=25, help="timed graph replays per configuration (median)")
    ap.add_argument("--budget-s", type=float, default=95.0, help="skip later search stages past this many seconds")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    from bench_support import use_package  # bench/ is sys.path[0] when run as a script

    use_package()
    import torch

    if not torch.cuda.is_available():
        print("decode_attention_tune: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 2
    from edgevlm.runtime.kernels import decode_fused as df

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cases = [(m, b, k) for m in MODELS for k in KINDS for b in BATCHES]
    times: dict[tuple, dict[tuple, list[float]]] = {c: {} for c in cases}  # case -> config -> [us, ...]
    splits: dict[tuple, dict[tuple, int]] = {c: {} for c in cases}
    skipped: list[str] = []
    state = {"caches": None, "key": None}

    def caches(model: str, kind: str):
        """``--layers`` layers' k/v caches (and fp8 scales) of 32 rows x 768 positions, random, allocated once
        per (model, kind); the previous ones are freed first."""
        if state["key"] == (model, kind):
            return state["caches"]
        state["caches"] = None
        torch.cuda.empty_cache()
        _, hkv, dh = MODELS[model]
        shape = (args.layers, max(BATCHES), hkv, BUCKET, dh)
        if kind == "bf16":
            k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            v = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            ks = vs = None
        else:  # random e4m3 bytes without the NaN codes (exponent field <= 14), scales ~ amax / 448
            k = (torch.randint(0, 256, shape, device=dev, dtype=torch.uint8) & 0x77).view(torch.float8_e4m3fn)
            v = (torch.randint(0, 256, shape, device=dev, dtype=torch.uint8) & 0x77).view(torch.float8_e4m3fn)
            ks = torch.full((*shape[:-1], 1), 0.01, device=dev, dtype=torch.float16)
            vs = torch.full((*shape[:-1], 1), 0.01, device=dev, dtype=torch.float16)
        state["caches"], state["key"] = (k, v, ks, vs), (model, kind)
        return state["caches"]

    def kv_bytes(model: str, batch: int, kind: str) -> int:
        _, hkv, dh = MODELS[model]
        keys = args.context + 1
        per_key = dh * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 2)  # values (+ the fp16 scale)
        return 2 * batch * hkv * keys * per_key  # k and v

    def measure(case: tuple, cfg: tuple) -> float:
        """µs per call of ``cfg = (block_n, num_warps, num_stages, ctas_per_sm, native)`` on ``case``."""
        model, batch, kind = case
        h, hkv, dh = MODELS[model]
        k, v, ks, vs = caches(model, kind)
        block_n, warps, stages, per_sm, native = cfg
        q = torch.randn(batch, h, 1, dh, device=dev, dtype=torch.bfloat16)
        pos = torch.full((batch,), args.context, device=dev, dtype=torch.int64)
        old_native = df.FP8_NATIVE
        df.FP8_NATIVE = native

        def step():
            for layer in range(args.layers):
                df.decode_attention(q, k[layer], v[layer], pos, BUCKET, block_n=block_n, num_warps=warps,
                                    num_stages=stages, cta_budget=per_sm * sms,
                                    k_scale=None if ks is None else ks[layer],
                                    v_scale=None if vs is None else vs[layer])

        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()  # compiles this variant (once per process)
                step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
        finally:
            df.FP8_NATIVE = old_native
        g.replay()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.reps)]
        for a, b in ev:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        us = statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3 / args.layers
        splits[case][cfg] = df.attention_splits(batch, hkv, BUCKET, block_n, 16, per_sm * sms)
        times[case].setdefault(cfg, []).append(us)
        del g
        return us

    def best(case: tuple) -> tuple:
        return min(times[case], key=lambda c: statistics.median(times[case][c]))

    def default_cfg(case: tuple) -> tuple:
        d = df.attention_config("16bit" if case[2] == "bf16" else "fp8", case[1])
        return (d.block_n, d.num_warps, d.num_stages, d.ctas_per_sm, None)

    stages = [
        ("A block_n x num_warps", lambda c: [(bn, w, 3, 4, None) for bn, w in GRID_A]),
        ("B num_stages, 8 warps", lambda c: [(*best(c)[:2], st, best(c)[3], None) for st in STAGES]
         + [(best(c)[0], 8, best(c)[2], best(c)[3], None)]),
        ("C ctas_per_sm", lambda c: [(*best(c)[:3], per_sm, None) for per_sm in CTAS_PER_SM]),
        ("D fp8 on the bits", lambda c: [(*best(c)[:4], False)] if c[2] == "fp8" else []),
        ("E the other model's best", lambda c: [best(o) for o in cases if o[1:] == c[1:] and o != c]),
    ]
    for name, configs in stages:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(name)
            continue
        for case in sorted(cases, key=lambda c: (c[0], c[2])):  # one cache allocation per (model, kind)
            for cfg in configs(case):
                if cfg not in times[case]:
                    measure(case, cfg)
    # final: default and best again, alternating, two rounds; reported = the median of all their times
    for _ in range(2):
        for case in sorted(cases, key=lambda c: (c[0], c[2])):
            for cfg in dict.fromkeys((default_cfg(case), best(case))):
                measure(case, cfg)

    def fmt(cfg: tuple) -> str:
        bn, w, st, per_sm, native = cfg
        return f"n{bn} w{w} s{st} c{per_sm}" + ("" if native is None else (" hw" if native else " bits"))

    rows = []
    for case in cases:
        model, batch, kind = case
        d, bcfg = default_cfg(case), best(case)
        d_us, b_us = statistics.median(times[case][d]), statistics.median(times[case][bcfg])
        nbytes = kv_bytes(model, batch, kind)
        rows.append({"model": model, "batch": batch, "cache": kind, "default": fmt(d), "default_us": round(d_us, 2),
                     "default_gbps": round(nbytes / d_us / 1e3, 1), "default_splits": splits[case][d],
                     "best": fmt(bcfg), "best_cfg": list(bcfg), "best_us": round(b_us, 2),
                     "best_gbps": round(nbytes / b_us / 1e3, 1), "best_splits": splits[case][bcfg],
                     "speedup": round(d_us / b_us, 3), "kv_mb": round(nbytes / 1e6, 2),
                     "configs_timed": len(times[case])})
    print(f"decode_attention_tune: {torch.cuda.get_device_name(dev)}, {sms} SMs, context {args.context} in a "
          f"{BUCKET} bucket, {args.layers} layers' caches per replay, median of {args.reps} replays; config = "
          "n<block_n> w<num_warps> s<num_stages> c<CTAs per SM> (hw/bits: fp8 conversion)")
    hdr = ["model", "batch", "cache", "KV MB", "default", "splits", "us", "GB/s", "best", "splits", "us", "GB/s",
           "speedup"]
    table = [[r["model"], r["batch"], r["cache"], r["kv_mb"], r["default"], r["default_splits"], r["default_us"],
              r["default_gbps"], r["best"], r["best_splits"], r["best_us"], r["best_gbps"], f"{r['speedup']:.2f}x"]
             for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *table, strict=True)]
    for line in [hdr, ["-" * w for w in widths], *table]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths, strict=True)))
    print("\nfp8 / bf16 time per call (default configs; < 1 = fp8 faster):")
    ratios = {}
    for model in MODELS:
        for batch in BATCHES:
            by = {r["cache"]: r for r in rows if r["model"] == model and r["batch"] == batch}
            ratios[f"{model}/b{batch}"] = round(by["fp8"]["default_us"] / by["bf16"]["default_us"], 3)
            print(f"  {model} batch {batch}: {ratios[f'{model}/b{batch}']:.2f} "
                  f"(best vs best {by['fp8']['best_us'] / by['bf16']['best_us']:.2f})")
    suggested = {}
    print("\nsuggested ATTENTION_CONFIGS (runtime/kernels/decode_fused.py); a batch bucket keeps the default "
          "unless a config measured on both models beats it by > 3% in summed time:")
    for kind in KINDS:
        rule = []
        for batch in BATCHES:
            both = [(m, batch, kind) for m in MODELS]
            common = set.intersection(*(set(times[c]) for c in both))
            total = {cfg: sum(statistics.median(times[c][cfg]) for c in both) for cfg in common}
            pick = min(total, key=total.get)
            d = default_cfg(both[0])
            if d in total and total[pick] > total[d] / 1.03:
                pick = d
            rule.append((batch, pick, round(total.get(d, float("nan")) / total[pick], 3)))
        suggested[kind] = [{"max_batch": b, "config": fmt(c), "block_n": c[0], "num_warps": c[1], "num_stages": c[2],
                            "ctas_per_sm": c[3], "fp8_native": c[4], "gain_vs_default": g} for b, c, g in rule]
        entries = ", ".join(f"({b if i < len(rule) - 1 else '1 << 30'}, AttentionConfig(block_n={c[0]}, "
                            f"num_warps={c[1]}, num_stages={c[2]}, ctas_per_sm={c[3]}))"
                            for i, (b, c, _) in enumerate(rule))
        print(f'    "{"16bit" if kind == "bf16" else "fp8"}": ({entries}),  # gains {[g for _, _, g in rule]}')
        natives = [c[4] for _, c, _ in rule if c[4] is not None]
        if natives:
            print(f"    (fp8: the best used the {'hardware' if natives[0] else 'bits'} e4m3 conversion: set FP8_NATIVE)")
    if skipped:
        print(f"\nskipped past --budget-s {args.budget_s}: stages {', '.join(skipped)}")
    elapsed = time.perf_counter() - t0
    print(f"\n{elapsed:.0f} s")
    result = {"bench": "decode_attention_tune", "device": torch.cuda.get_device_name(dev), "sms": sms,
              "context": args.context, "bucket": BUCKET, "layers": args.layers, "reps": args.reps,
              "rows": rows, "fp8_over_bf16": ratios, "suggested": suggested, "skipped_stages": skipped,
              "elapsed_s": round(elapsed, 1)}
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
