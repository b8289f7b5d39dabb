#!/usr/bin/env python3
"""Where the time to first token of one request goes: host launches or GPU work (issue 15's TTFT goal).

Builds the LLaVA-1.5-7B-shape model the way ``bench/w4a16_kernel.py``'s model section does (random
weights, bf16; then the decoder's linears RTN W4A16 group 128) and measures, for bf16 and W4A16, the
harness's TTFT (``edgevlm bench``: float32 pixels on the host -> first token id on the host, 336 px, a
32-token prompt: 609 positions) by two paths of :class:`~edgevlm.runtime.backends.torch_backend.TorchBackend`:

* ``eager`` -- ``encode_image`` + ``embed`` + ``prefill`` (the single-request entry points, what the
  harness and :class:`~edgevlm.runtime.engine.Engine` call) on a backend without CUDA graphs (every
  kernel launched from Python: the single path before 2026-12-02),
* ``single`` -- the same entry points with CUDA graphs (the default: the tower and the prefill replay
  graphs where the family's prefill is the plain causal one),
* ``batched`` -- ``encode_images`` + ``prefill_images_batch`` with one request (the continuous
  batcher's entry points: the vision tower and the prefill replay CUDA graphs).

Per (weights, path): the wall-clock TTFT (median, min, max of ``--iters`` after ``--warmup``), the
vision and prefill parts by wall clock (synchronised) and by CUDA events, and under ``torch.profiler``
the GPU kernels of one prefill grouped (``dequant``: the W4A16 dequantizer, ``gemm``, ``attention``,
``norm``, ``elementwise``, ``other``) with their busy time: wall minus busy is host time the GPU waited
for. A table, then one JSON line. Usage (on a CUDA GPU)::

    python3 bench/ttft_breakdown.py [--iters 15] [--paths single,batched] [--weights bf16,w4] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

GROUPS = ("dequant", "gemm", "attention", "norm", "elementwise", "other")


def group_of(name: str) -> str:
    """The group of a prefill CUDA kernel name (module docstring)."""
    n = name.lower()
    if "dequant" in n or "w4a16" in n:
        return "dequant"
    if any(k in n for k in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_", "sm80_")):
        return "gemm"
    if "attn" in n or "attention" in n or "rope" in n or "flash" in n or "sdpa" in n or "softmax" in n:
        return "attention"
    if "rms" in n or "norm" in n:
        return "norm"
    if any(k in n for k in ("silu", "gelu", "elementwise", "vectorized", "fill", "copy", "index", "arange",
                            "compare", "reduce", "cat", "where", "embedding", "scatter", "mul", "add")):
        return "elementwise"
    return "other"


def profile_call(fn) -> dict:
    """GPU kernels of one ``fn()`` under torch.profiler: µs and count per group and the busy time
    (``decode_step_breakdown.profile_replays``, this script's groups)."""
    from decode_step_breakdown import profile_replays  # bench/ is sys.path[0] when run as a script

    groups, _ = profile_replays(fn, 1, group_of, GROUPS)
    busy = groups.pop("_busy_us")
    return {"busy_us": round(busy, 1),
            "groups": {k: {"us": round(v[0], 1), "kernels": int(v[1])} for k, v in groups.items() if v[1]}}


def measure(model, weights: str, ids: list[int], pixels, paths: list[str], args, result: dict) -> None:
    """Time the TTFT paths of ``model`` (see the module docstring); appends rows to ``result``."""
    import torch

    from edgevlm.quantize.bench_measure import event_ms
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    dev = model.device
    be = TorchBackend(model, max_batch_size=1)
    be_eager = TorchBackend(model, max_batch_size=1, cuda_graphs=False)
    ids_dev = torch.tensor([ids], device=dev)

    def sync_ms(t: float) -> float:
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def single(record=None, be=be):
        t = time.perf_counter()
        feats = be.encode_image(pixels)
        if record is not None:
            record["vision_ms"] = sync_ms(t)
            t = time.perf_counter()
        tok = int(be.prefill(be.embed(ids_dev, feats))[0].argmax())
        if record is not None:
            record["prefill_ms"] = sync_ms(t)
        return tok

    def eager(record=None):
        return single(record, be_eager)

    def batched(record=None):
        t = time.perf_counter()
        feats = be.encode_images([pixels])
        if record is not None:
            record["vision_ms"] = sync_ms(t)
            t = time.perf_counter()
        tok = int(be.prefill_images_batch([ids], feats, [0])[0].argmax())
        if record is not None:
            record["prefill_ms"] = sync_ms(t)
        return tok

    fns = {"eager": eager, "single": single, "batched": batched}
    tokens = {}
    for path in paths:
        fn = fns[path]
        for _ in range(args.warmup):
            fn()
        walls, vis, pre = [], [], []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            tokens[path] = fn()
            walls.append((time.perf_counter() - t) * 1e3)
        for _ in range(max(3, args.iters // 3)):
            rec: dict = {}
            fn(rec)
            vis.append(rec["vision_ms"])
            pre.append(rec["prefill_ms"])
        # GPU time of the same calls by events (the host may run ahead: events time the GPU stream)
        event = event_ms(fn, dev, warmup=0, iters=5)
        if path in ("single", "eager"):
            b = be if path == "single" else be_eager
            feats = b.encode_image(pixels)
            emb = b.embed(ids_dev, feats)
            prof = profile_call(lambda b=b, emb=emb: b.prefill(emb))
            prof_vis = profile_call(lambda b=b: b.encode_image(pixels))
        else:
            feats = be.encode_images([pixels])
            prof = profile_call(lambda feats=feats: be.prefill_images_batch([ids], feats, [0]))
            prof_vis = profile_call(lambda: be.encode_images([pixels]))
        run = {"weights": weights, "path": path, "ttft_ms": round(statistics.median(walls), 2),
               "ttft_min_ms": round(min(walls), 2), "ttft_max_ms": round(max(walls), 2),
               "vision_wall_ms": round(statistics.median(vis), 2), "prefill_wall_ms": round(statistics.median(pre), 2),
               "event_ms": round(event, 2), "prefill_gpu": prof, "vision_gpu": prof_vis,
               "token": tokens[path]}
        result["runs"].append(run)
        print(f"{weights:5s} {path:8s} ttft {run['ttft_ms']:7.2f} ms (min {run['ttft_min_ms']:.2f}, max "
              f"{run['ttft_max_ms']:.2f}); vision wall {run['vision_wall_ms']:.2f} (GPU busy "
              f"{prof_vis['busy_us'] / 1e3:.2f}); prefill wall {run['prefill_wall_ms']:.2f} (GPU busy "
              f"{prof['busy_us'] / 1e3:.2f}); events {run['event_ms']:.2f}", flush=True)
        print("      prefill kernels: " + "; ".join(f"{g} {v['us'] / 1e3:.2f} ms x{v['kernels']}"
                                                 for g, v in prof["groups"].items()), flush=True)
    if len(tokens) > 1:
        result.setdefault("same_token", {})[weights] = len(set(tokens.values())) == 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava-7b")
    ap.add_argument("--text", type=int, default=32, help="prompt text tokens (the bench's 32)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--paths", default="eager,single,batched")
    ap.add_argument("--weights", default="bf16,w4")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    from bench_support import print_result, use_package  # bench/ is sys.path[0] when run as a script

    use_package()
    import torch

    from edgevlm.quantize.bench_measure import make_inputs
    from edgevlm.quantize.bench_models import build_models, quantize_decoder_w4

    if not torch.cuda.is_available():
        print("ttft_breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    model, _, cfg = build_models(args.model, device=dev, dtype=torch.bfloat16, max_seq_len=64, with_hf=False)
    ids, pixels = make_inputs(cfg, args.text)
    max_seq = ((len(ids) + 32 + 16 + 255) // 256) * 256  # the bench harness's cache length
    model.setup_caches(1, max_seq)
    paths = [p for p in args.paths.split(",") if p]
    result = {"bench": "ttft_breakdown", "model": args.model, "gpu": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "positions": len(ids), "iters": args.iters,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    print(f"{args.model}: {len(ids)} positions, built in {time.perf_counter() - t0:.1f} s", flush=True)
    for weights in [w for w in args.weights.split(",") if w]:
        if weights == "w4":
            quantize_decoder_w4(model)
        measure(model, weights, ids, pixels, paths, args, result)
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
