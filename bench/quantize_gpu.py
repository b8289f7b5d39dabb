"""INT4 (W4A16) vs bf16 linear layers on a CUDA GPU, for 7B-class layer shapes.

Run on an H100/H200-class GPU (torch with CUDA)::

    .venv/bin/python bench/quantize_gpu.py [--iters 200] [--m 1 8 32 128]

For every shape (N x K = out x in: 4096x4096, 11008x4096 i.e. up/gate, 4096x11008 i.e. down) and
every M (rows of activations; M = 1 is decode's matrix-vector product) it times:

* ``bf16``: ``F.linear`` with a bf16 weight (cuBLAS);
* ``int4``: :class:`edgevlm.runtime.int4.Int4Linear` forward with its chosen path (tinygemm
  ``aten._weight_int4pack_mm`` up to ``CUDA_KERNEL_MAX_M`` rows, dequantize + cuBLAS above);
* ``int4_kernel``: the tinygemm op alone (forced, every M).

and reports achieved bandwidth = bytes of weights (+ activations) read / time, against the
device-to-device copy bandwidth measured here (``torch.Tensor.copy_`` of 1 GiB). First, the
int4-kernel convention is probed and every path is checked against a float64 reference (the
bench stops if any is wrong). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from edgevlm.runtime import int4
from edgevlm.runtime.int4 import Int4Linear

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out N, in K)


def _time_ms(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbps(iters: int) -> float:
    n = 1 << 30  # bytes
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters // 4 or 1)
    return 2 * n / (ms * 1e-3) / 1e9  # read + write


def check_correctness(layer: Int4Linear, m: int) -> float:
    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ layer.dequantized_weight(torch.float64).T
    y = layer(x).double()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: run this on a GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    conv = int4.kernel_convention(dev)
    copy_gbps = copy_bandwidth_gbps(args.iters)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  int4 kernel convention: {conv}")
    print(f"copy bandwidth (d2d, read+write): {copy_gbps:.0f} GB/s")
    results = []
    header = f"{'N x K':>12} {'M':>4} {'path':>12} {'bf16 us':>9} {'int4 us':>9} {'kernel us':>9} " \
             f"{'speedup':>7} {'bf16 GB/s':>9} {'int4 GB/s':>9} {'% copy':>6} {'rel err':>8}"
    print(header)
    print("-" * len(header))
    for n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev) * 0.02
        layer = Int4Linear.from_int4(int4.quantize_int4(w, args.group_size), None).to(dev)
        w_bf16 = w.to(torch.bfloat16)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            err = check_correctness(layer, m)
            if err > 2e-2:
                print(f"WRONG RESULT: {n}x{k} M={m} relative error {err:.3g}", file=sys.stderr)
                return 1
            t_bf16 = _time_ms(lambda x=x, w=w_bf16: F.linear(x, w), args.iters) * 1e3
            t_int4 = _time_ms(lambda x=x, f=layer: f(x), args.iters) * 1e3
            t_kernel = float("nan")
            if conv is not None:
                packed, sz = layer._kernel_tensors(conv)
                t_kernel = _time_ms(lambda x=x, p=packed, s=sz: int4._kernel_mm(conv, x, p, args.group_size, s),
                                    args.iters) * 1e3
            int4_bytes = layer.int4_weight().nbytes() + 2 * m * (k + n)
            best = min(t_int4, t_kernel) if conv else t_int4
            gbps = int4_bytes / (best * 1e-6) / 1e9
            bf16_gbps = (2 * n * k + 2 * m * (k + n)) / (t_bf16 * 1e-6) / 1e9
            r = dict(shape=f"{n}x{k}", m=m, path=layer.execution_path(m, dev), bf16_us=t_bf16, int4_us=t_int4,
                     int4_kernel_us=t_kernel, speedup=t_bf16 / t_int4, bf16_gbps=bf16_gbps, int4_gbps=gbps,
                     pct_copy=100 * gbps / copy_gbps, rel_err=err)
            results.append(r)
            print(f"{r['shape']:>12} {m:>4} {r['path']:>12} {t_bf16:9.1f} {t_int4:9.1f} {t_kernel:9.1f} "
                  f"{r['speedup']:7.2f} {bf16_gbps:9.0f} {gbps:9.0f} {r['pct_copy']:6.1f} {err:8.1e}")
    print(json.dumps({"bench": "quantize_gpu", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "convention": conv, "copy_gbps": copy_gbps, "group_size": args.group_size,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
