#!/usr/bin/env python3
"""Decode attention over an INT4 KV cache on a CUDA GPU: the Triton kernel that reads the codes
(runtime/kernels/int4kv_attention.py) against the dequantize + SDPA path it replaces, and against
SDPA over a bf16 cache.

    python3 bench/gpu_int4kv.py [--kv-lens 1024,4096] [--iters 200] [--block-s 16,32,64,128]

For each shape (7B: 32 query / 32 KV heads, head_dim 128; a GQA shape: 14 / 2, head_dim 64) and
attended length, at batch 1 and 8: checks the kernel against dequantize + SDPA in float32 (max
relative error) and times one layer's attention, each variant captured in a CUDA graph and
replayed ``--iters`` times (median of 5 such runs; device/METHOD.md: graphs remove launch gaps,
medians the host noise). Bytes: the kernel reads codes + scales + zeros, 0.28x of a bf16 cache
(head_dim 128, group 64). The kernel's ``block_s`` is swept (``--block-s``; the fastest is
reported with the default's time), with ``--num-warps``. Then the fused decode-step write (``int4kv_write``) is checked
bit for bit against the torch quantization and timed against it. Prints tables and ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def graph_ms(fn, iters: int) -> float:
    """Median over 5 runs of the per-call time of ``fn`` replayed ``iters`` times in one CUDA graph."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-lens", default="1024,4096")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--block-s", default="16,32,64,128", help="kernel block sizes to sweep")
    ap.add_argument("--num-warps", default="2,4,8", help="kernel warps per program to sweep")
    ap.add_argument("--only-writes", action="store_true", help="skip the attention part")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from edgevlm.runtime.kernels.int4kv_attention import int4kv_decode_attention, int4kv_write
    from edgevlm.runtime.kv_cache import Int4KVCache, KVCache, decode_mask

    if not torch.cuda.is_available():
        print("gpu_int4kv: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    print("| shape | batch | kv_len | rel err vs dequant+SDPA (fp32) | kernel us | dequant+SDPA us | bf16 SDPA us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, h, hkv, dh in () if args.only_writes else (("7b", 32, 32, 128), ("gqa-0.5b", 14, 2, 64)):
        for kv_len in [int(x) for x in args.kv_lens.split(",")]:
            for b in (1, 8):
                cache = Int4KVCache(b, hkv, kv_len, dh, dtype=torch.bfloat16, device=dev)
                k = torch.randn(b, hkv, kv_len, dh, device=dev)
                v = torch.randn(b, hkv, kv_len, dh, device=dev)
                cache.write(torch.arange(kv_len, device=dev), k, v)
                plain = KVCache(b, hkv, kv_len, dh, dtype=torch.bfloat16, device=dev)
                plain.write(torch.arange(kv_len, device=dev), k, v)
                pos = torch.full((b,), kv_len - 1, device=dev, dtype=torch.long)
                pos[0] = kv_len // 2  # one row with stale slots past its position
                mask_b = decode_mask(pos[:, None], kv_len)
                add = torch.zeros(mask_b.shape, dtype=torch.bfloat16, device=dev).masked_fill_(~mask_b, float("-inf"))
                q32 = torch.randn(b, h, 1, dh, device=dev)
                kd, vd = cache.read(b, kv_len, torch.float32)
                rep = h // hkv
                ref = F.scaled_dot_product_attention(q32, kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1),
                                                     attn_mask=mask_b)
                got = int4kv_decode_attention(q32, cache, pos, kv_len)
                err = float((got - ref).norm() / ref.norm())
                q = q32.to(torch.bfloat16)
                qg = q.reshape(b, hkv, rep, dh)

                sweep = {}
                for bs in [int(x) for x in args.block_s.split(",")]:
                    for nw in [int(x) for x in args.num_warps.split(",")]:
                        e = float((int4kv_decode_attention(q32, cache, pos, kv_len, block_s=bs, num_warps=nw)
                                   - ref).norm() / ref.norm())
                        err = max(err, e)
                        sweep[f"{bs}x{nw}"] = graph_ms(
                            lambda q=q, cache=cache, pos=pos, kv_len=kv_len, bs=bs, nw=nw:
                            int4kv_decode_attention(q, cache, pos, kv_len, block_s=bs, num_warps=nw), args.iters) * 1000
                best_bs = min(sweep, key=sweep.get)

                def kernel(q=q, cache=cache, pos=pos, kv_len=kv_len):
                    return int4kv_decode_attention(q, cache, pos, kv_len)

                def dequant(q=qg, cache=cache, add=add, b=b, kv_len=kv_len):
                    kk, vv = cache.read(b, kv_len, torch.bfloat16)
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=add)

                def bf16(q=qg, plain=plain, add=add, b=b, kv_len=kv_len):
                    kk, vv = plain.read(b, kv_len, torch.bfloat16)
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=add)

                t = {n: graph_ms(f, args.iters) * 1000 for n, f in (("kernel", kernel), ("dequant_sdpa", dequant),
                                                                    ("bf16_sdpa", bf16))}
                row = {"shape": name, "batch": b, "kv_len": kv_len, "rel_err": err,
                       **{f"{n}_us": round(v, 2) for n, v in t.items()},
                       "sweep_us": {str(k): round(v, 2) for k, v in sweep.items()}, "best_block_s_x_warps": best_bs}
                rows.append(row)
                print(f"| {name} | {b} | {kv_len} | {err:.2e} | {t['kernel']:.1f} (best {sweep[best_bs]:.1f} at "
                      f"block_s x warps {best_bs}) | {t['dequant_sdpa']:.1f} | {t['bf16_sdpa']:.1f} |", flush=True)
    writes = []
    print("\n| write shape | batch | bit-exact | fused us | torch us |")
    print("|---|---:|---|---:|---:|")
    for name, hkv, dh in (("7b", 32, 128), ("gqa-0.5b", 2, 64)):
        for b in (1, 8):
            fused = Int4KVCache(b, hkv, 512, dh, dtype=torch.bfloat16, device=dev)
            plain = Int4KVCache(b, hkv, 512, dh, dtype=torch.bfloat16, device=dev)
            k = (3 * torch.randn(b, hkv, 1, dh, device=dev)).to(torch.bfloat16)
            v = torch.randn(b, hkv, 1, dh, device=dev).to(torch.bfloat16)
            pos = torch.randint(0, 512, (b, 1), device=dev)
            fused.write(pos, k, v)  # CUDA, T = 1: the fused kernel
            KVCache.write(plain, pos, k, v)  # the torch quantization
            exact = all(torch.equal(getattr(fused, n), getattr(plain, n))
                        for n in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"))
            tf = graph_ms(lambda c=fused, p=pos, k=k, v=v: int4kv_write(c, p, k, v), args.iters) * 1000
            tt = graph_ms(lambda c=plain, p=pos, k=k, v=v: KVCache.write(c, p, k, v), args.iters) * 1000
            writes.append({"shape": name, "batch": b, "bit_exact": exact, "fused_us": round(tf, 2),
                           "torch_us": round(tt, 2)})
            print(f"| {name} | {b} | {exact} | {tf:.1f} | {tt:.1f} |", flush=True)
    ok = all(r["rel_err"] < 1e-4 for r in rows) and all(w["bit_exact"] for w in writes)
    print(json.dumps({"bench": "gpu_int4kv", "gpu": torch.cuda.get_device_name(0), "all_close": ok, "rows": rows,
                      "writes": writes}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
