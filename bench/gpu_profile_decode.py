#!/usr/bin/env python3
"""Where the time of one graph-captured decode step goes, kernel by kernel (torch.profiler).

Builds a bench model (``--model``: llava-7b, small or demo; random weights, bf16), optionally with
W4A16 decoder weights (``--w4``), captures the batch-1 decode step at ``--kv-len`` attended
positions, replays it under the profiler and prints the kernels by total GPU time (per step),
with the step's GPU time from CUDA events, for the plain layer loop and the fused Triton decode
kernels side by side. Ends with one JSON line. Usage::

    python3 bench/gpu_profile_decode.py --model llava-7b --w4 [--kv-len 1024] [--top 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch


def profile_step(be, kv_len: int, steps: int = 10) -> tuple[float, list[tuple[str, float, int]]]:
    from torch.profiler import ProfilerActivity, profile

    from edgevlm.quantize.benchmark import event_ms

    be.graphs.tokens[:1].fill_(7)
    be.graphs.positions[:1].fill_(kv_len // 2)
    step_ms = event_ms(lambda: be.graphs.replay(1, kv_len), be.device, warmup=5, iters=30)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            be.graphs.replay(1, kv_len)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per[ev.name][0] += ev.device_time / steps
            per[ev.name][1] += 1
    rows = sorted(((name[:90], us, n // steps) for name, (us, n) in per.items()), key=lambda r: -r[1])
    return step_ms, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava-7b")
    ap.add_argument("--w4", action="store_true", help="W4A16 decoder weights")
    ap.add_argument("--kv-len", type=int, default=1024)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args(argv)
    from bench_support import use_package  # bench/ is sys.path[0] when run as a script

    use_package()
    from edgevlm.quantize.bench_models import build_models, quantize_decoder_w4
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    if not torch.cuda.is_available():
        print("gpu_profile_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    model, _, _ = build_models(args.model, device=dev, dtype=torch.bfloat16, max_seq_len=args.kv_len, with_hf=False)
    if args.w4:
        quantize_decoder_w4(model)
    result = {"bench": "gpu_profile_decode", "model": args.model, "w4": args.w4, "kv_len": args.kv_len}
    for fused in (False, True):
        be = TorchBackend(model, cuda_graphs=True, fused_decode=fused)
        be.graphs.capture(1, args.kv_len)
        step_ms, rows = profile_step(be, args.kv_len)
        total_us = sum(r[1] for r in rows)
        n_kernels = sum(r[2] for r in rows)
        label = "fused" if model.language_model.fused_decode else "plain"
        print(f"\n{args.model} {'W4A16' if args.w4 else 'bf16'} {label}: step {step_ms:.3f} ms (events), "
              f"kernel time {total_us / 1e3:.3f} ms, {n_kernels} kernels per step")
        print(f"{'kernel':90s} {'us/step':>9s} {'calls':>6s}")
        for name, us, n in rows[: args.top]:
            print(f"{name:90s} {us:9.1f} {n:6d}")
        result[label] = {"step_ms": step_ms, "kernel_ms": total_us / 1e3, "kernels": n_kernels,
                         "top": [[n, round(us, 1), c] for n, us, c in rows[: args.top]]}
        be.graphs = None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
