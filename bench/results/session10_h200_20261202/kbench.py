"""A/B of the lean W4A16 kernel between two snapshots of the tree (run once per snapshot, label A / B): every
lean configuration x tiles per CTA on the 7B / Qwen3-VL-8B shapes at each M (CUDA-graph replays over weight
copies > 3x L2, median of 30), each output against its register-ring twin (bit equality) and float64. One JSON
line per shape and M (best configuration, µs, GB/s, the table's choice), then the layer sums.

    python3 kbench.py A 1,8,16
"""

import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from w4a16_marlin import graph_us  # noqa: E402 - the bench's CUDA-graph timer

from edgevlm.runtime import int4  # noqa: E402
from edgevlm.runtime.kernels import w4a16_mma as mk  # noqa: E402

SHAPES = {"7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008),
          "q8.qkv": (6144, 4096), "q8.gate_up": (24576, 4096), "q8.down": (4096, 12288)}


def main():
    label = sys.argv[1]
    ms = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,8,16").split(",")]
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    t0 = time.time()
    mk.load_extension(dev)
    print(label, "build+load", round(time.time() - t0, 1), "s", flush=True)
    sums = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        qw = int4.quantize_int4(w, 128)
        del w
        w64 = int4.dequantize_int4(qw.qweight, qw.scales, qw.zeros, 128, torch.float64)
        packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)
        nb = qw.nbytes()
        copies = [(packed.clone(), meta.clone()) for _ in range(max(2, math.ceil(3 * l2 / nb)))]
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.double() @ w64.T
            res = []
            for ks, d in mk.LEAN_CONFIGS:
                for tpc in (1, 2, 4):
                    c = ("lean", ks, d, tpc)
                    y = mk.w4a16_mma(x, packed, meta, 128, config=c, pdl=False)
                    twin = mk.w4a16_mma(x, packed, meta, 128, config=("reg", ks, 2, tpc), mode=2, pdl=False)
                    err = float((y.double() - ref).norm() / ref.norm())
                    us = graph_us([partial(mk.w4a16_mma, x, p, mt, 128, config=c, pdl=False) for p, mt in copies])
                    res.append((us, c, bool(torch.equal(y, twin)), err))
            tab = mk.mma_config(m, n, k, 128, lean=True)
            tab_us = next((u for u, c, _, _ in res if c == tab), None)
            best = min(res)
            model = name.split(".")[0]
            sums.setdefault(model, {}).setdefault(m, 0.0)
            sums[model][m] += best[0]
            print(json.dumps({"label": label, "shape": name, "m": m, "best_us": round(best[0], 2), "best": best[1][1:],
                              "gbps": round((nb + m * k * 2 + m * n * 2) / best[0] / 1e3, 1), "table": tab[1:],
                              "table_us": round(tab_us, 2) if tab_us else None,
                              "all_bit_equal_reg": all(s for _, _, s, _ in res), "max_err": max(e for *_, e in res),
                              "top3": [(round(u, 2), c[1:]) for u, c, _, _ in sorted(res)[:3]]}), flush=True)
    print(json.dumps({"label": label, "layer_sums_us": {k: {str(m): round(v, 2) for m, v in d.items()}
                                                         for k, d in sums.items()}}))


if __name__ == "__main__":
    main()
