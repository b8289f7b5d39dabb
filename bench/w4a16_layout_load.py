#!/usr/bin/env python3
"""Load-time cost of the tensor-core INT4 layout on CPU: repack at load vs read the bundle's stored copy.

For each of the four LLaVA-1.5-7B decoder shapes (fused qkv 12288x4096, o 4096x4096, fused gate_up
22016x4096, down 4096x11008; group size 128, random codes) it times, median of ``--repeats``:

* ``repack_ms``: :func:`edgevlm.runtime.int4_format.repack_int4_mma` of the canonical tensors (what the
  runtime does at load without a stored copy; on CUDA it runs on the GPU, so this CPU number is the
  upper end, e.g. a Jetson whose weights are repacked before they move);
* ``read_ms``: reading the stored ``mma_qweight`` + ``mma_meta`` from a safetensors file (warm page
  cache: the file was just written) with ``safe_open(...).get_tensor``;
* ``sha256_ms``: hashing that file's bytes, the cost :func:`edgevlm.runtime.bundle.verify_bundle` adds
  for the stored copy on every load (any device: the hashes are checked before the layout is used).

The 7B line scales one layer of each shape by 32 decoder layers. Prints a table, then one JSON line.

Usage: ``python bench/w4a16_layout_load.py [--repeats 3] [--shapes qkv,o,gate_up,down]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
GROUP = 128
LAYERS_7B = 32


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from edgevlm.runtime.bundle import sha256_file
    from edgevlm.runtime.int4_format import repack_int4_mma

    rows = []
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
            scales = (torch.rand(n, k // GROUP, generator=gen) + 0.01).to(torch.float16)
            zeros = torch.randint(0, 16, (n, k // GROUP), generator=gen, dtype=torch.uint8)
            repack_ms = _median_ms(lambda q=qweight, s=scales, z=zeros: repack_int4_mma(q, s, z, GROUP), args.repeats)
            qw, meta = repack_int4_mma(qweight, scales, zeros, GROUP)
            path = Path(tmp) / f"{name}.safetensors"
            save_file({"w.mma_qweight": qw, "w.mma_meta": meta}, str(path))

            def read(path=path):
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    return [f.get_tensor(key).clone() for key in f.keys()]  # clone: materialise the mmap

            read_ms = _median_ms(read, args.repeats)
            sha_ms = _median_ms(lambda path=path: sha256_file(path), args.repeats)
            rows.append(dict(shape=name, n=n, k=k, layout_mb=path.stat().st_size / 1e6, repack_ms=repack_ms,
                             read_ms=read_ms, sha256_ms=sha_ms))
    print(f"W4A16 mma layout, CPU ({torch.get_num_threads()} threads, torch {torch.__version__}), group size {GROUP}")
    print(f"{'shape':<8} {'N x K':>12} {'layout MB':>10} {'repack ms':>10} {'read ms':>9} {'sha256 ms':>10}")
    for r in rows:
        print(f"{r['shape']:<8} {r['n']:>6}x{r['k']:<5} {r['layout_mb']:>10.1f} {r['repack_ms']:>10.1f} "
              f"{r['read_ms']:>9.1f} {r['sha256_ms']:>10.1f}")
    total = {key: LAYERS_7B * sum(r[key] for r in rows) for key in ("layout_mb", "repack_ms", "read_ms", "sha256_ms")}
    print(f"{'7B x32':<8} {'':>12} {total['layout_mb']:>10.0f} {total['repack_ms']:>10.0f} {total['read_ms']:>9.0f} "
          f"{total['sha256_ms']:>10.0f}")
    print(json.dumps({"bench": "w4a16_layout_load", "device": "cpu", "threads": torch.get_num_threads(),
                      "group_size": GROUP, "rows": rows, "llava7b": total}))


if __name__ == "__main__":
    main()
