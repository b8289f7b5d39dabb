#!/usr/bin/env python3
"""Time to first token of one request of the M-RoPE / DeepStack / Gemma 3 families: eager prefill vs the
prefill CUDA graph (``TorchBackend.prefill`` with ``cuda_graphs``: every family's hooks as graph inputs,
:mod:`edgevlm.runtime.prefill_graphs`).

Per model (:mod:`edgevlm.quantize.bench_families`: the published configs, random weights, bf16): one
random frame of ``--size`` px through the family's processor and ``--text`` random text tokens
(``make_request``), then on two backends over the same weights, ``eager`` (``cuda_graphs=False``) and
``graphs`` (the default): the TTFT as the harness measures it (``encode_vision`` + ``position_ids`` +
``embed`` + ``prefill`` + ``argmax`` -> host; median, min, max of ``--iters`` after ``--warmup``) and the
prefill alone (synchronised wall clock, median). The eager backend runs first (the graphed backend
turns the model's vision-tower graphs on, which both then share). A table, then one JSON line. Usage
(on a CUDA GPU; ``--device cpu`` with ``tiny-*`` models is a smoke test, both paths eager)::

    python3 bench/ttft_families.py [--models qwen3-vl-2b,qwen2.5-vl-3b] [--size 448x448] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def measure(model, ids, vision, args, device) -> dict:
    """``{path: row}`` for the ``eager`` then ``graphs`` backends over ``model`` (module docstring)."""
    import torch

    from edgevlm.runtime.backends.torch_backend import TorchBackend

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows = {}
    for path in ("eager", "graphs"):
        be = TorchBackend(model, cuda_graphs=path == "graphs" and device.type == "cuda")

        def ttft(record=None, be=be) -> int:
            feats = be.encode_vision(vision)
            pos, _ = be.position_ids(ids, vision)
            embeds = be.embed(ids, feats)
            if record is not None:
                sync()
                t = time.perf_counter()
            logits = be.prefill(embeds) if pos is None else be.prefill(embeds, position_ids=pos)
            tok = int(logits[0].argmax())
            if record is not None:
                record.append((time.perf_counter() - t) * 1e3)
            return tok

        for _ in range(args.warmup):
            ttft()
        walls, prefill = [], []
        for _ in range(args.iters):
            sync()
            t = time.perf_counter()
            tok = ttft()
            walls.append((time.perf_counter() - t) * 1e3)
        for _ in range(args.iters):
            ttft(prefill)
        graphs = be._prefill_graphs
        rows[path] = {"ttft_ms": round(statistics.median(walls), 2), "ttft_min_ms": round(min(walls), 2),
                      "ttft_max_ms": round(max(walls), 2), "prefill_ms": round(statistics.median(prefill), 2),
                      "token": tok, "prefill_graphs": 0 if graphs is None else len(graphs),
                      "eager_keys": 0 if graphs is None else len(graphs._eager)}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-vl-2b,qwen2.5-vl-3b")
    ap.add_argument("--size", default="448x448", help="frame W x H px")
    ap.add_argument("--text", type=int, default=32, help="prompt text tokens")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    from bench_support import print_result, use_package  # bench/ is sys.path[0] when run as a script

    use_package()
    import torch

    from edgevlm.quantize.bench_families import build, make_request

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ttft_families: needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w, h = (int(v) for v in args.size.lower().split("x"))
    result = {"bench": "ttft_families", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "torch": torch.__version__, "size_px": [w, h], "iters": args.iters,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "models": {}}
    print(f"{'model':16s} {'positions':>9s} {'path':7s} {'ttft ms (min-max)':>24s} {'prefill ms':>10s} token")
    for name in [m for m in args.models.split(",") if m]:
        t0 = time.perf_counter()
        ours, hf, files = build(name, device, dtype, max_seq_len=1024)
        del hf  # ours holds the same tensors
        ids, vision = make_request(files, (w, h), n_text=args.text)
        ids = ids.to(device)
        rows = measure(ours, ids, vision, args, device)
        result["models"][name] = {"positions": ids.shape[1], "build_s": round(time.perf_counter() - t0, 1), **rows}
        for path, r in rows.items():
            print(f"{name:16s} {ids.shape[1]:9d} {path:7s} {r['ttft_ms']:8.2f} ({r['ttft_min_ms']:.2f}-"
                  f"{r['ttft_max_ms']:.2f}) {r['prefill_ms']:10.2f} {r['token']}", flush=True)
        del ours
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
