"""CPU: where torch's int4 kernel beats dequantize + dense matmul (sets ``int4.CPU_KERNEL_MAX_M``).

    .venv/bin/python bench/quantize_cpu_kernels.py [--iters 20]

For ~0.5B-decoder layer shapes and M = 1..256 activation rows it times, per call:
``kernel`` (``aten._weight_int4pack_mm_for_cpu``, activations cast to bf16), ``dequant``
(dequantize the canonical weight to the activation dtype + ``F.linear``), and the dense 16-bit
baseline ``F.linear`` with a resident weight of that dtype. Prints a table, then one JSON line.
Timings on a shared machine are noisy: read the crossover, not the digits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from edgevlm.runtime import int4
from edgevlm.runtime.int4 import Int4Linear

SHAPES = [(3456, 1280), (1280, 3456), (1280, 1280)]  # (out, in) of the ~0.5B bench decoder


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64, 256])
    args = ap.parse_args(argv)
    conv = int4.kernel_convention(torch.device("cpu"))
    if conv is None:
        print("this torch has no CPU int4 kernel", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, convention {conv}")
    header = f"{'N x K':>11} {'dtype':>9} {'M':>4} {'kernel ms':>9} {'dequant ms':>10} {'dense ms':>8} {'best':>7}"
    print(header)
    print("-" * len(header))
    results = []
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        layer = Int4Linear.from_int4(int4.quantize_int4(w, 128), None)
        packed, sz = layer._kernel_tensors(conv)
        for dtype in (torch.float32, torch.bfloat16):
            dense_w = w.to(dtype)
            for m in args.m:
                x = torch.randn(m, k, dtype=dtype)
                t_kernel = _time_ms(lambda x=x, p=packed, s=sz: int4._kernel_mm(conv, x.to(torch.bfloat16), p, 128, s)
                                    .to(x.dtype), args.iters)
                t_deq = _time_ms(lambda x=x, f=layer: F.linear(x, f.dequantized_weight(x.dtype)), args.iters)
                t_dense = _time_ms(lambda x=x, dw=dense_w: F.linear(x, dw), args.iters)
                best = "kernel" if t_kernel <= t_deq else "dequant"
                results.append(dict(shape=f"{n}x{k}", dtype=str(dtype).removeprefix("torch."), m=m,
                                    kernel_ms=t_kernel, dequant_ms=t_deq, dense_ms=t_dense, best=best))
                print(f"{n:>5}x{k:<5} {results[-1]['dtype']:>9} {m:>4} {t_kernel:9.3f} {t_deq:10.3f} "
                      f"{t_dense:8.3f} {best:>7}")
    crossover = min((r["m"] for r in results if r["best"] == "dequant"), default=None)
    print(f"smallest M where dequantize + matmul wins: {crossover} (CPU_KERNEL_MAX_M = {int4.CPU_KERNEL_MAX_M})")
    print(json.dumps({"bench": "quantize_cpu_kernels", "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "cpu_kernel_max_m": int4.CPU_KERNEL_MAX_M, "first_dequant_win_m": crossover,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
