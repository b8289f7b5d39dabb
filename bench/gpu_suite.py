#!/usr/bin/env python3
"""GPU suite for the cloud-profile CUDA paths (issue 6): correctness first, then timings.

Correctness (bf16 on the GPU against the eager path and a float64 reference; fresh random data):

* CUDA-graph decode vs eager decode (same tokens, teacher-forced) and vs a float64 model;
* batched prefill + batched graph decode of 4 prompts of different lengths vs one-at-a-time;
  the vision encoder batched across requests vs one image at a time;
* INT4 and FP8-e4m3 KV caches vs the bf16 cache (logits, greedy agreement, bytes per token);
* the W4A16 tinygemm linear (runtime/int4.py) vs a float64 matmul of its dequantized weight;
* the Triton fused patch-embedding + LayerNorm kernel vs the unfused path and float64
  (ViT-L/14 at 336 px, ViT-B/16 at 224 px, a non-square input; output poisoned with NaN first);
* SDPA restricted to the flash / mem-efficient backends (prefill and decode must run there).
* demo-set accuracy per KV precision (bench/gpu_kv_accuracy.py, 150 items) when the demo model is shipped.

Timings (CUDA events, warm-up, medians): eager vs graph decode step, fused vs unfused stem at
ViT-L/14 batch 32, then ``edgevlm bench`` (quantize/benchmark.py) on the small model, LLaVA-1.5-7B
and the demo model, side by side with transformers, as time allows.

Every section runs in its own try/except; the partial JSON is rewritten to ``$OUT/gpu_suite.json``
after each one. The whole run stops starting sections after ``GPU_SUITE_BUDGET_S`` (default 270 s).
Prints tables, then one JSON line (compact; everything is in ``$OUT/gpu_suite.json`` and the
``edgevlm bench`` results file beside it). Usage: ``python3 bench/gpu_suite.py``;
``GPU_SUITE_DEVICE=cpu`` runs the suite's code on CPU as a dry run (no graphs, no Triton).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()
BUDGET_S = float(os.environ.get("GPU_SUITE_BUDGET_S", "270"))
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
DEV = os.environ.get("GPU_SUITE_DEVICE", "cuda")  # "cpu": a dry run of the suite's code (no graphs/Triton)
RESULTS: dict = {"suite": "gpu_suite", "checks": [], "timings": {}, "sections": {}, "bench_rows": []}


def _bootstrap_imports() -> None:
    """Import ``edgevlm.runtime`` from this checkout even without ``pip install -e .``."""
    sys.path.insert(0, str(REPO))
    try:
        import edgevlm.runtime.loader  # noqa: F401
        return
    except ImportError:
        pass
    for pkg, folder in (("edgevlm.runtime", "runtime"),):
        spec = importlib.util.spec_from_file_location(pkg, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[pkg] = module
        spec.loader.exec_module(module)


def left_s() -> float:
    return BUDGET_S - (time.perf_counter() - T0)


def save() -> None:
    RESULTS["wall_s"] = round(time.perf_counter() - T0, 1)
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_suite.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


def section(name: str, min_left_s: float):
    def wrap(fn):
        def run(*args, **kwargs):
            if left_s() < min_left_s:
                RESULTS["sections"][name] = f"skipped ({left_s():.0f} s left)"
                print(f"[{name}] skipped: {left_s():.0f} s left", flush=True)
                return None
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                RESULTS["sections"][name] = f"ok {time.perf_counter() - t0:.1f} s"
                return out
            except Exception as exc:  # noqa: BLE001 - one failure must not lose the rest
                RESULTS["sections"][name] = f"FAILED {type(exc).__name__}: {exc}"[:400]
                print(f"[{name}] FAILED\n{traceback.format_exc()[-2000:]}", flush=True)
                return None
            finally:
                print(f"[{name}] {RESULTS['sections'].get(name)}", flush=True)
                save()
        return run
    return wrap


def check(name: str, value, limit, op: str = "<=") -> None:
    ok = value is not None and value == value and (value <= limit if op == "<=" else value >= limit)
    RESULTS["checks"].append({"check": name, "value": value, "limit": f"{op} {limit}", "pass": bool(ok)})


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64; inf when a holds NaN/Inf."""
    import torch

    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------- checks
def check_spec():
    from edgevlm.quantize.bench_models import ModelSpec

    # ViT with 196 patches + a 4-layer decoder shaped like the small model's layers (GQA 14/2)
    return ModelSpec(256, 2, 4, 1024, 224, 16, 896, 4, 14, 2, 4864, 32064)


def run_seq(be, ids, pixels, n_steps, forced=None):
    """Prefill then ``n_steps`` decode steps; returns (logits (1 + n, V) float64, greedy tokens)."""
    import torch

    ids_dev = torch.tensor([ids], device=be.device)
    logits = [be.prefill(be.embed(ids_dev, be.encode_image(pixels))).double()]
    toks = [int(logits[0][0].argmax())]
    pos = len(ids)
    for i in range(n_steps):
        tok = forced[i] if forced is not None else toks[-1]
        logits.append(be.decode(tok, pos).double().clone())
        toks.append(int(logits[-1][0].argmax()))
        pos += 1
    return torch.cat(logits), toks


@section("decode_graphs", 200)
def check_decode(ctx):
    import torch

    from edgevlm.quantize.bench_models import build_models, shallow_copy_model
    from edgevlm.quantize.benchmark import event_ms, make_inputs
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    dev = torch.device(DEV)
    model, _, cfg = build_models(check_spec(), device=dev, dtype=torch.bfloat16, max_seq_len=512, with_hf=False, seed=3)
    ctx.update(model=model, cfg=cfg)
    ids, px = make_inputs(cfg, 24, seed=1)
    unfused = TorchBackend(model, cuda_graphs=False, fuse_projections=False)
    lu, tu = run_seq(unfused, ids, px, 24)
    eager = TorchBackend(model, cuda_graphs=False, fuse_projections=True, fused_decode=False)  # fuses in place
    le, te = run_seq(eager, ids, px, 24, forced=tu[:-1])
    check("fused_qkv_gateup_vs_unfused_rel", rel(le, lu), 2e-2)
    # the fused Triton decode kernels (add+RMSNorm, RoPE+KV write, SiLU*up) vs the plain layer loop
    kernels = TorchBackend(model, cuda_graphs=True, fused_decode=True)
    RESULTS["timings"]["fused_decode_on"] = model.language_model.fused_decode
    lk, tk = run_seq(kernels, ids, px, 24, forced=tu[:-1])
    check("fused_decode_kernels_vs_plain_rel", rel(lk, le), 2e-2)
    pos_k = len(ids) + 24
    fused_ms = event_ms(lambda: kernels.decode(tk[-1], pos_k), dev, warmup=3, iters=20)
    kernels.graphs = None
    graph = TorchBackend(model, cuda_graphs=True, fused_decode=False)
    lg, tg = run_seq(graph, ids, px, 24, forced=tu[:-1])
    check("graph_vs_eager_decode_rel", rel(lg, le), 1e-3)
    check("graph_vs_eager_argmax_agree", sum(a == b for a, b in zip(tg, te, strict=True)) / len(te), 1.0, ">=")
    check("graphs_captured", len(graph.graphs) if graph.graphs is not None else 0, 1, ">=")
    ref = shallow_copy_model(model, 512).to(torch.float64)
    ref.language_model.setup_caches(1, 512)
    l64, t64 = run_seq(TorchBackend(ref, cuda_graphs=False), ids, px, 24, forced=tu[:-1])
    check("graph_bf16_vs_fp64_rel", rel(lg, l64), 3e-2)
    check("eager_bf16_vs_fp64_rel", rel(le, l64), 3e-2)
    del ref
    # launch overhead: one eager step vs one graph replay (same step)
    pos = len(ids) + 24
    eager_ms = event_ms(lambda: eager.decode(te[-1], pos), dev, warmup=3, iters=20)
    graph_ms = event_ms(lambda: graph.decode(te[-1], pos), dev, warmup=3, iters=20)
    RESULTS["timings"]["decode_step_4layer"] = {"eager_ms": eager_ms, "graph_ms": graph_ms,
                                                "speedup": eager_ms / graph_ms, "graph_fused_kernels_ms": fused_ms}
    ctx.update(ids=ids, px=px, logits_bf16=lg, tokens_bf16=tu)  # lg: graph logits with tu fed


@section("batched", 150)
def check_batched(ctx):
    import torch

    from edgevlm.quantize.benchmark import make_inputs
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    model, cfg = ctx["model"], ctx["cfg"]
    prompts = [make_inputs(cfg, 6 + 7 * i, seed=20 + i) for i in range(4)]
    singles = []
    single_be = TorchBackend(model, cuda_graphs=False, max_batch_size=1)
    feats_single = []
    for ids, px in prompts:
        singles.append(run_seq(single_be, ids, px, 12))
        feats_single.append(single_be.encode_image(px))
    be = TorchBackend(model, cuda_graphs=True, max_batch_size=4)
    feats = be.encode_images([px for _, px in prompts])
    check("vision_batched_vs_single_rel", max(rel(f, s) for f, s in zip(feats, feats_single, strict=True)), 2e-2)
    embeds = [be.embed(torch.tensor([ids], device=be.device), f) for (ids, _), f in zip(prompts, feats, strict=True)]
    first = be.prefill_batch(embeds, [0, 1, 2, 3]).double()
    errs = [rel(first[i : i + 1], singles[i][0][0:1]) for i in range(4)]
    agree, total = 0, 0
    for step in range(12):
        toks = [singles[i][1][step] for i in range(4)]
        pos = [len(prompts[i][0]) + step for i in range(4)]
        out = be.decode_batch(toks, pos).double()
        for i in range(4):
            ref = singles[i][0][step + 1 : step + 2]
            errs.append(rel(out[i : i + 1], ref))
            agree += int(out[i].argmax()) == int(ref[0].argmax())
            total += 1
    check("batched_vs_single_max_rel", max(errs), 3e-2)
    check("batched_vs_single_argmax_agree", agree / total, 0.9, ">=")


@section("kv_precision", 120)
def check_kv(ctx):
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    model, ids, px = ctx["model"], ctx["ids"], ctx["px"]
    lb, tb = ctx["logits_bf16"], ctx["tokens_bf16"]
    base = model.language_model.layers[0].self_attn.kv_cache.bytes_per_token()
    for kv, limit in (("int4", 0.15), ("fp8_e4m3", 0.08)):
        be = TorchBackend(model, kv_cache_dtype=kv, cuda_graphs=True)
        lk, _ = run_seq(be, ids, px, 24, forced=tb[:-1])
        _, free = run_seq(be, ids, px, 24)
        per_tok = model.language_model.layers[0].self_attn.kv_cache.bytes_per_token()
        check(f"kv_{kv}_vs_bf16_rel", rel(lk, lb), limit)
        first_diff = next((i for i, (a, b) in enumerate(zip(free, tb, strict=True)) if a != b), len(tb))
        RESULTS["timings"][f"kv_{kv}"] = {"bytes_per_token_layer": per_tok, "bf16_bytes_per_token_layer": base,
                                          "ratio": base / per_tok, "greedy_first_divergence": first_diff}
    model.language_model.setup_caches(1, 512)


@section("int4_linear", 100)
def check_int4_linear(ctx):
    import torch

    from edgevlm.runtime.int4 import Int4Linear

    dev = torch.device(DEV)
    lin = torch.nn.Linear(4096, 11008, bias=False, device=dev, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, 0.0, 4096**-0.5)
    q = Int4Linear.from_linear(lin, 128)
    w64 = q.dequantized_weight(torch.float64)
    for m in (1, 8, 64, 600):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        check(f"int4_linear_m{m}_vs_fp64_rel", rel(q(x), x.double() @ w64.T), 1e-2)
    RESULTS["timings"]["int4_linear_path"] = {str(m): q.execution_path(m, dev) for m in (1, 64, 600)}


@section("fused_stem", 90)
def check_fused_stem(ctx):
    import copy

    import torch

    from edgevlm.runtime.kernels.patch_embed_ln import FusedVisionStem, fused_patch_embed_layernorm
    from edgevlm.runtime.models.llava.config import VisionConfig
    from edgevlm.runtime.vision import VisionEmbeddings

    dev = torch.device(DEV)
    shapes = (("vitl14_336", 1024, 14, 336, (336, 336)), ("vitb16_224", 768, 16, 224, (224, 224)),
              ("vitl14_nonsquare", 1024, 14, 336, (224, 336)))
    for name, d, p, img, (h, w) in shapes:
        cfg = VisionConfig(hidden_size=d, patch_size=p, image_size=img, num_attention_heads=16, intermediate_size=4 * d)
        emb = VisionEmbeddings(cfg).to(dev)
        ln = torch.nn.LayerNorm(d).to(dev)
        with torch.no_grad():
            emb.patch_embedding.weight.normal_(0, (3 * p * p) ** -0.5)
            emb.class_embedding.normal_(0, 0.5)
            emb.position_embedding.weight.normal_(0, 0.5)
            ln.weight.normal_(1.0, 0.1)
            ln.bias.normal_(0.0, 0.1)
        emb64, ln64 = copy.deepcopy(emb).double(), copy.deepcopy(ln).double()
        emb, ln = emb.bfloat16(), ln.bfloat16()
        px = torch.randn(4, 3, h, w, device=dev)
        with torch.inference_mode():
            ref64 = ln64(emb64(px.bfloat16().double()))
            unfused = ln(emb(px))
            out = torch.full_like(unfused, float("nan"))
            pos = emb.position_embeddings(h // p, w // p)
            fused_patch_embed_layernorm(px, emb.patch_embedding.weight, emb.class_embedding, pos, ln.weight, ln.bias,
                                        ln.eps, out=out)
            via_module = FusedVisionStem(emb, ln)(px)
        check(f"fused_stem_{name}_vs_fp64_rel", rel(out, ref64), 1e-2)
        check(f"fused_stem_{name}_vs_unfused_rel", rel(out, unfused), 1e-2)
        check(f"fused_stem_{name}_module_vs_kernel_rel", rel(via_module, out), 1e-6)
        RESULTS["timings"][f"stem_{name}_unfused_vs_fp64_rel"] = rel(unfused, ref64)
        if name == "vitl14_336":
            ctx.update(stem=(emb, ln))


@section("fused_stem_in_encoder", 80)
def check_fused_encoder(ctx):
    import torch

    from edgevlm.runtime.backends.torch_backend import TorchBackend

    model, px = ctx["model"], ctx["px"]
    plain = TorchBackend(model, cuda_graphs=False).encode_image(px).clone()
    fused_be = TorchBackend(model, cuda_graphs=False, fused_vision_stem=True)
    fused = fused_be.encode_image(px)
    model.vision_tower.encoder.fused_stem = None
    check("encoder_fused_stem_vs_plain_rel", rel(fused, plain), 2e-2)
    del torch


@section("fused_stem_timing", 70)
def time_fused_stem(ctx):
    import torch

    from edgevlm.quantize.benchmark import event_ms
    from edgevlm.runtime.kernels.patch_embed_ln import FusedVisionStem

    emb, ln = ctx["stem"]
    stem = FusedVisionStem(emb, ln)
    dev = torch.device(DEV)
    sets = [torch.randn(32, 3, 336, 336, device=dev, dtype=torch.bfloat16) for _ in range(3)]  # rotate inputs
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % len(sets)
        return sets[i[0]]

    with torch.inference_mode():
        fused_ms = event_ms(lambda: stem(nxt()), dev, warmup=3, iters=20)
        unfused_ms = event_ms(lambda: stem.reference(nxt()), dev, warmup=3, iters=20)
    n = 32 * 576
    flops = 2 * n * 588 * 1024
    bytes_min = 32 * 3 * 336 * 336 * 2 + 32 * 577 * 1024 * 2
    RESULTS["timings"]["stem_vitl14_336_b32"] = {
        "fused_ms": fused_ms, "unfused_ms": unfused_ms, "speedup": unfused_ms / fused_ms,
        "fused_tflops": flops / fused_ms / 1e9, "fused_gbps_min_bytes": bytes_min / fused_ms / 1e6}


@section("sdpa_backends", 60)
def check_sdpa(ctx):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from edgevlm.runtime.backends.torch_backend import TorchBackend

    model, ids, px = ctx["model"], ctx["ids"], ctx["px"]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        be = TorchBackend(model, cuda_graphs=False)
        logits, _ = run_seq(be, ids, px, 4, forced=ctx["tokens_bf16"][:4])
    check("sdpa_flash_efficient_only_vs_default_rel", rel(logits, ctx["logits_bf16"][:5]), 3e-2)
    del torch


@section("kv_accuracy_demo", 45)
def kv_accuracy_demo():
    """Demo-set accuracy per KV precision (bench/gpu_kv_accuracy.py), when the demo model is shipped."""
    from edgevlm.runtime.demo import model_dir

    if not (Path(model_dir()) / "config.json").is_file():
        RESULTS["kv_accuracy"] = "demo model not in this tree"
        return
    spec = importlib.util.spec_from_file_location("gpu_kv_accuracy", REPO / "bench" / "gpu_kv_accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.measure(None, DEV, 150, None, ["model", "int4", "fp8_e4m3"])
    RESULTS["kv_accuracy"] = [{k: r[k] for k in ("kv", "kv_bytes_per_token", "accuracy", "delta_points",
                                                 "memory_ratio_vs_base", "eval_s")} for r in rows]


def run_bench(ceilings):
    from edgevlm.quantize import benchmark

    plan = (("small", 150), ("llava-7b", 110), ("demo", 25)) if DEV == "cuda" else (("tiny", 0),)
    for name, need in plan:
        if left_s() < need:
            RESULTS["sections"][f"bench_{name}"] = f"skipped ({left_s():.0f} s left)"
            continue

        @section(f"bench_{name}", need)
        def one(name=name):
            summary = benchmark.run(models=[name], device=DEV, ceilings=ceilings)
            RESULTS["bench_rows"].extend(summary["rows"])
            RESULTS["versions"] = summary["versions"]
            RESULTS["goals"] = benchmark.goals(RESULTS["bench_rows"], ceilings)
            print(benchmark.format_table(summary["rows"]), flush=True)
        one()


def main() -> int:
    _bootstrap_imports()
    import torch

    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_suite: CUDA is not available (GPU_SUITE_DEVICE=cpu for a dry run)", file=sys.stderr)
        return 2
    from edgevlm.quantize import benchmark

    cuda = DEV == "cuda"
    RESULTS.update(gpu=torch.cuda.get_device_name() if cuda else "cpu (dry run)",
                   capability=list(torch.cuda.get_device_capability()) if cuda else None,
                   torch=torch.__version__, versions=benchmark.versions())
    ceilings = benchmark.measure_ceilings(torch.device(DEV))
    RESULTS["ceilings"] = ceilings
    print(f"{RESULTS['gpu']} copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    ctx: dict = {}
    check_decode(ctx)
    if "model" in ctx:
        check_batched(ctx)
        check_kv(ctx)
    check_int4_linear(ctx)
    if cuda:
        check_fused_stem(ctx)
    if "model" in ctx:
        if cuda:
            check_fused_encoder(ctx)
        check_sdpa(ctx)
    if "stem" in ctx:
        time_fused_stem(ctx)
    ctx.clear()
    if cuda:
        torch.cuda.empty_cache()
    run_bench(ceilings)
    kv_accuracy_demo()
    save()
    print("\ncheck                                             value        limit   pass")
    for c in RESULTS["checks"]:
        v = c["value"]
        print(f"{c['check']:45} {v if isinstance(v, int) else f'{v:.3e}':>12} {c['limit']:>12} {c['pass']!s:>6}")
    print("\nsections: " + "; ".join(f"{k}: {v}" for k, v in RESULTS["sections"].items()))
    print("timings: " + json.dumps(RESULTS["timings"], default=str))
    if RESULTS["bench_rows"]:
        print(benchmark.format_table(RESULTS["bench_rows"]))
        if OUT is not None:
            summary = {"bench": "edgevlm_bench", "device": DEV, "gpu": RESULTS["gpu"],
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": RESULTS["versions"],
                       **ceilings, "rows": RESULTS["bench_rows"], "goals": RESULTS.get("goals")}
            benchmark.save_results(summary, OUT)
    RESULTS["all_checks_pass"] = all(c["pass"] for c in RESULTS["checks"])
    save()
    compact = {k: RESULTS[k] for k in ("gpu", "all_checks_pass", "goals", "kv_accuracy", "timings", "ceilings",
                                       "sections", "wall_s") if k in RESULTS}
    compact["failed_checks"] = [c for c in RESULTS["checks"] if not c["pass"]]
    compact["bench"] = [{k: r.get(k) for k in ("model", "impl", "ttft_ms", "tpot_ms", "decode_tok_s", "step_gpu_ms",
                                               "batch_tok_s", "vision_img_s", "vision_mm_frac", "peak_mb",
                                               "kv_bytes_per_token", "copy_frac", "error")}
                        for r in RESULTS["bench_rows"]]
    print(json.dumps(compact, default=str))  # the full results: $OUT/gpu_suite.json
    return 0


if __name__ == "__main__":
    sys.exit(main())
