"""Where a Qwen-VL decode step, the vision tower and TTFT spend their time (issue 12 §8), our model only.

For each model of ``--models`` (shapes of :data:`edgevlm.quantize.bench_families.CONFIGS`, random weights, no transformers
model built): TPOT of the graph-replayed decode step with the fused Triton step off and on (bf16, and
W4A16 RTN), its GPU time by CUDA events over a graph replay, the kernels one eager step launches
(``torch.profiler``) and the host syncs around it; at each ``--sizes`` input, the vision tower's time
and its top kernels, and TTFT split into vision / positions + embed / prefill. Prints a table, then
one JSON line; ``--out DIR`` writes ``profile.json`` and ``profile.md`` there.

Usage: ``python3 bench/profile_families.py --models qwen3-vl-2b --out $OUT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from edgevlm.quantize import bench_families as gf
from edgevlm.quantize.bench_measure import event_ms, measure_ceilings, wall_ms
from edgevlm.quantize.bench_models import decoder_weight_bytes, init_random_, quantize_decoder_w4

logger = logging.getLogger("profile_families")


def build_ours(name: str, device: torch.device, dtype: torch.dtype, max_seq_len: int = 4096):
    """Our model of ``name`` with random weights (no transformers model) and its ModelFiles."""
    _, files = gf.model_files(name)
    family, cfg = files.family, files.config
    with torch.device("meta"):
        model = family.build_model(cfg)
    model = model.to_empty(device=device).to(dtype)
    init_random_(model, 0)
    if cfg.tie_word_embeddings:
        model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.setup_caches(1, max_seq_len)
    return model, files


def kernels_of(fn, top: int = 8) -> dict:
    """Kernels ``fn()`` launches on the GPU: count, summed GPU ms, the ``top`` costliest (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_ms = sum(e.self_device_time_total for e in rows) / 1e3
    n = sum(e.count for e in rows)
    rows.sort(key=lambda e: -e.self_device_time_total)
    syncs = sum(e.count for e in prof.key_averages() if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                 "aten::item", "aten::_local_scalar_dense"))
    return {"kernels": n, "gpu_ms": total_ms, "host_syncs": syncs,
            "top": [(e.key[:70], round(e.self_device_time_total / 1e3, 3), e.count) for e in rows[:top]]}


def decode_row(model, ids, vision, device, new_tokens: int, label: str, fused: bool) -> dict:
    """TPOT, graph-replay time and eager kernels of one decode configuration (``fused``: the Triton step)."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    be = TorchBackend(model, fused_decode=fused)
    ids_dev = ids.to(device)
    feats = be.encode_vision(vision)
    pos, delta = be.position_ids(ids_dev, vision)
    tok0 = int(be.prefill(be.embed(ids_dev, feats), position_ids=pos)[0].argmax())
    t = ids.shape[1]

    def loop():
        tok, p = tok0, t
        for _ in range(new_tokens):
            tok = int(be.decode(tok, p, rope_offset=delta)[0].argmax())
            p += 1

    tpot = wall_ms(loop, device, warmup=1, iters=5) / new_tokens
    kv_len = be.kv_len_for(t + 1)
    be.graphs.tokens[:1].fill_(tok0)
    be.graphs.positions[:1].fill_(t)
    be.graphs.rope_offsets[:1].fill_(delta)
    replay_ms = event_ms(lambda: be.graphs.replay(1, kv_len), device, warmup=3, iters=20)
    dec = model.language_model
    tok_t = torch.tensor([[tok0]], device=device)
    pos_t = torch.tensor([t], device=device)
    off = torch.tensor([delta], device=device)
    eager = kernels_of(lambda: dec.decode_step(tok_t, pos_t, kv_len, off))
    w = decoder_weight_bytes(model)
    be.graphs = None
    return {"model": label, "fused_decode": dec.fused_decode, "tpot_ms": tpot, "tok_s": 1e3 / tpot,
            "graph_replay_ms": replay_ms, "host_ms_per_step": tpot - replay_ms,
            "eager_kernels": eager["kernels"], "eager_gpu_ms": eager["gpu_ms"],
            "weight_mb": w / 2**20, "replay_gbps": w / replay_ms / 1e6, "top": eager["top"]}


def decode_rows(model, files, ids, vision, device, new_tokens: int, label: str) -> list[dict]:
    return [decode_row(model, ids, vision, device, new_tokens, label, fused) for fused in (False, True)]


def vision_row(be, model, files, size: tuple[int, int], device, label: str) -> dict:
    """Vision time (events, wall, kernels), positions + embed, prefill and TTFT at input ``size`` (W, H)."""
    ids, vision = gf.make_request(files, size)
    ids_dev = ids.to(device)
    deepstack = hasattr(model, "_deepstack")  # Qwen3-VL: prefill consumes the last encode's features
    vis_ms = event_ms(lambda: be.encode_vision(vision), device, warmup=2, iters=5)
    vis_wall = wall_ms(lambda: be.encode_vision(vision), device, warmup=1, iters=5)
    k = kernels_of(lambda: be.encode_vision(vision))
    feats = be.encode_vision(vision)

    def pos_embed():
        pos, _ = be.position_ids(ids_dev, vision)
        return be.embed(ids_dev, feats), pos

    pe_ms = wall_ms(pos_embed, device, warmup=1, iters=5)

    def prefill():
        if deepstack:
            be.encode_vision(vision)
        e, pos = pos_embed()
        return int(be.prefill(e, position_ids=pos)[0].argmax())

    both_ms = wall_ms(prefill, device, warmup=1, iters=5)

    def first():
        f = be.encode_vision(vision)
        pos, _ = be.position_ids(ids_dev, vision)
        return int(be.prefill(be.embed(ids_dev, f), position_ids=pos)[0].argmax())

    ttft = wall_ms(first, device, warmup=2, iters=5)
    e, pos = pos_embed()
    pk = kernels_of(lambda: be.prefill(e, position_ids=pos))
    w, h = size
    return {"model": label, "size": f"{w}x{h}", "vision_tokens": vision.num_tokens, "prompt": ids.shape[1],
            "vision_ms": vis_ms, "vision_wall_ms": vis_wall, "vision_kernels": k["kernels"],
            "vision_gpu_ms": k["gpu_ms"], "vision_syncs": k["host_syncs"], "pos_embed_ms": pe_ms,
            "prefill_ms_est": both_ms - pe_ms - (vis_wall if deepstack else 0),
            "prefill_kernels": pk["kernels"], "prefill_gpu_ms": pk["gpu_ms"], "ttft_ms": ttft,
            "vision_top": k["top"], "prefill_top": pk["top"]}


def vision_rows(model, files, sizes, device, label) -> list[dict]:
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    be = TorchBackend(model)
    out = [vision_row(be, model, files, size, device, label) for size in sizes]
    be.graphs = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-vl-2b")
    ap.add_argument("--sizes", default="448x448,1280x720")
    ap.add_argument("--decode-models", default="qwen3-vl-2b", help="models whose decode step is profiled")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    t0 = time.perf_counter()
    res = {"ceilings": measure_ceilings(dev), "decode": [], "vision": []}
    for name in args.models.split(","):
        model, files = build_ours(name, dev, torch.bfloat16)
        try:
            res["vision"] += vision_rows(model, files, sizes, dev, name)
        except Exception:  # noqa: BLE001 - keep the decode part
            logger.exception("vision %s", name)
        if name in args.decode_models.split(","):
            ids, vision = gf.make_request(files, sizes[0])
            try:
                res["decode"] += decode_rows(model, files, ids, vision, dev, args.new_tokens, name)
                quantize_decoder_w4(model)
                res["decode"] += decode_rows(model, files, ids, vision, dev, args.new_tokens, name + "-w4")
            except Exception:  # noqa: BLE001
                logger.exception("decode %s", name)
        del model
        torch.cuda.empty_cache()
    res["wall_s"] = time.perf_counter() - t0
    lines = ["| model | fused step | TPOT ms | tok/s | graph replay ms | host ms/step | eager kernels | "
             "eager GPU ms | weights MB | replay GB/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["decode"]:
        lines.append(f"| {r['model']} | {r['fused_decode']} | {r['tpot_ms']:.3f} | {r['tok_s']:.0f} | "
                     f"{r['graph_replay_ms']:.3f} | {r['host_ms_per_step']:.3f} | {r['eager_kernels']} | "
                     f"{r['eager_gpu_ms']:.3f} | {r['weight_mb']:.0f} | {r['replay_gbps']:.0f} |")
    lines += ["", "| model | input | vision tokens | vision ms (events) | vision wall ms | vision kernels | "
              "vision GPU ms | syncs | pos+embed ms | prefill ms | prefill kernels | prefill GPU ms | TTFT ms |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["vision"]:
        lines.append(f"| {r['model']} | {r['size']} | {r['vision_tokens']} | {r['vision_ms']:.1f} | "
                     f"{r['vision_wall_ms']:.1f} | {r['vision_kernels']} | {r['vision_gpu_ms']:.1f} | "
                     f"{r['vision_syncs']} | {r['pos_embed_ms']:.1f} | {r['prefill_ms_est']:.1f} | "
                     f"{r['prefill_kernels']} | {r['prefill_gpu_ms']:.1f} | {r['ttft_ms']:.1f} |")
    lines.append("")
    for r in res["decode"]:
        lines.append(f"top kernels, eager decode step {r['model']} fused={r['fused_decode']}: {r['top']}")
    for r in res["vision"]:
        lines.append(f"top kernels, vision {r['model']} {r['size']}: {r['vision_top']}")
        lines.append(f"top kernels, prefill {r['model']} {r['size']}: {r['prefill_top']}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.md").write_text(table + "\n")
        (Path(args.out) / "profile.json").write_text(json.dumps(res) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k == "wall_s"}))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
