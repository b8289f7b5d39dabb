"""Host time of the batched model path (continuous batching's admission) and its answers against ``Engine.ask``.

    python3 bench/batching_host_time.py [--device cuda] [--items 64] [--rows 32]

Loads the demo model with ``--rows`` KV-cache rows (CUDA graphs and the fused vision stem on CUDA, as the
h100 profile), answers ``--items`` demo evaluation items through a
:class:`~edgevlm.runtime.batching.ContinuousBatcher` (uint8 pixels normalised on the device, one group per
admission) and checks every answer equals ``Engine.ask``'s, then times, for 1 / 8 / 32 requests, the batched
vision encode, the batched prefill with its first tokens, and ``Engine.prepare`` (uint8) per request, on the
host clock around synchronised calls (median of 20 after 3 warm-ups). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _median_ms(fn, sync, n: int = 20) -> float:
    for _ in range(3):
        fn()
        sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args(argv)

    from edgevlm.runtime import Engine
    from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest
    from edgevlm.runtime.demo import scenes

    cuda = args.device.startswith("cuda")
    options = {"max_batch_size": args.rows, **({"cuda_graphs": True, "fused_vision_stem": True} if cuda else {})}
    eng = Engine.load(None, device=args.device, backend_options=options)
    be = eng.backend
    items = list(scenes.eval_set(args.items, 0))
    norm = (tuple(eng.image_mean), tuple(eng.image_std))
    preps = [eng.prepare(it.image, it.qa.question, max_new_tokens=8, uint8_pixels=True) for it in items]
    reqs = [GenerationRequest(p.ids, p.vision.pixel_values, max_new_tokens=8, eos_token_ids=eng.eos_token_ids,
                              pixel_norm=norm) for p in preps]
    res = ContinuousBatcher(be, token_budget=1 << 20).run(reqs)
    batched = [eng.tokenizer.decode(r.tokens).strip() for r in res]
    asked = [eng.ask(it.image, it.qa.question, max_new_tokens=8).text.strip() for it in items]
    same = sum(a == b for a, b in zip(batched, asked, strict=True))
    right = sum(a == it.qa.answer for a, it in zip(batched, items, strict=True))
    rows = []
    for n in (1, 8, 32):
        if n > min(args.rows, len(items)):
            continue
        px = [p.vision.pixel_values for p in preps[:n]]
        ids = [p.ids for p in preps[:n]]
        feats = be.encode_images(px, normalize=norm)
        encode = _median_ms(lambda px=px: be.encode_images(px, normalize=norm), be.synchronize)
        prefill = _median_ms(lambda ids=ids, feats=feats, n=n: be.prefill_images_batch(ids, feats, list(range(n)))
                             .argmax(-1).tolist(), be.synchronize)
        prepare = _median_ms(lambda n=n: [eng.prepare(it.image, it.qa.question, uint8_pixels=True)
                                          for it in items[:n]], lambda: None, 5) / n
        rows.append({"requests": n, "encode_ms": round(encode, 3), "prefill_ms": round(prefill, 3),
                     "prepare_ms_per_request": round(prepare, 3)})
    print(f"demo model on {args.device}: batched answers equal Engine.ask for {same}/{len(items)}, right {right}")
    print("| requests | vision encode ms | prefill + first tokens ms | prepare ms / request |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['requests']} | {r['encode_ms']:.2f} | {r['prefill_ms']:.2f} | {r['prepare_ms_per_request']:.2f} |")
    print(json.dumps({"bench": "batching_host_time", "device": args.device, "items": len(items), "same_as_ask": same,
                      "right": right, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
