"""``edgevlm bench``: edgevlm vs Hugging Face transformers, side by side, on the same weights.

For each model (:mod:`edgevlm.quantize.bench_models`: random weights in LLaVA-1.5-7B's and a
ViT-B/16 + 0.5B decoder's sizes, the tiny test model, the demo model) and each implementation —
transformers' ``LlavaForConditionalGeneration`` (SDPA attention, ``generate`` with its dynamic and
its static cache, the faster reported) and edgevlm variants (16-bit or W4A16 decoder weights; 16-bit,
INT4 or FP8 KV cache; CUDA-graph decode on GPU) — it measures, after warm-up, as medians:

* ``ttft_ms``: float32 pixels on the host -> first token id on the host (vision, embed, prefill,
  argmax); the image preprocessing and tokenisation the engine also does are left out (both sides);
* ``tpot_ms`` and ``decode_tok_s``: per-token time of a greedy batch-1 decode loop with the token
  fed back through the host each step (what the engine does); ``step_gpu_ms``: one CUDA-graph replay
  alone (CUDA events); ``batch_tok_s``: tokens/s of batched decode at each batch size;
* ``vision_img_s``: vision encoder + projector images/s at the vision batch, and its TFLOP/s as a
  fraction of the bf16 matrix-multiply rate measured first;
* ``peak_mb``: the implementation's weights plus the peak of everything it allocated while running;
* ``kv_bytes_per_token`` and ``gbps``/``copy_frac``: bytes one decode step must read (decoder
  weights + the attended KV cache) over ``tpot_ms``, against the device-to-device copy bandwidth
  (bytes read + written) measured first.

Prints a table, then one JSON line; saves the JSON under ``bench/results/`` with device, date and
versions. Runs on CPU with the tiny model (``edgevlm bench --device cpu``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import platform
import re
import sys
import time
from pathlib import Path

from edgevlm.cli_args import OneLineParser, fail
from edgevlm.quantize.bench_measure import (  # noqa: F401  (re-exported: the measurements, for bench/*.py)
    bench_edgevlm,
    bench_hf,
    event_ms,
    make_inputs,
    measure_ceilings,
    vision_flops,
    wall_ms,
)

logger = logging.getLogger(__name__)

VARIANTS = {  # name -> (decoder weights, kv_cache_dtype)
    "edgevlm": ("16bit", None),
    "edgevlm-w4": ("w4", None),
    "edgevlm-w4-kv4": ("w4", "int4"),
    "edgevlm-w4-kv8": ("w4", "fp8_e4m3"),
}


# ---------------------------------------------------------------------------- driver
def versions() -> dict:
    """Library versions and the machine, for the results file."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "platform": platform.platform()}
    for name in ("transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    try:
        from edgevlm import __version__

        out["edgevlm"] = __version__
    except ImportError:  # pragma: no cover
        out["edgevlm"] = None
    return out


def run_model(name: str, *, device, dtype, variants: list[str], with_hf: bool, new_tokens: int, n_text: int,
              batch_sizes: list[int], vision_batch: int, ceilings: dict, seed: int = 0) -> list[dict]:
    """All rows of one model; a variant that fails gives a row with ``error`` (the others still run)."""
    import torch

    from edgevlm.quantize.bench_models import (
        build_models,
        decoder_weight_bytes,
        quantize_decoder_w4,
        shallow_copy_model,
    )

    max_seq_len = 0
    rows: list[dict] = []
    t0 = time.perf_counter()
    ours, hf, cfg = build_models(name, device=device, dtype=dtype, max_seq_len=64, with_hf=with_hf, seed=seed)
    ids, pixels = make_inputs(cfg, n_text, seed)
    max_seq_len = ((len(ids) + new_tokens + 16 + 255) // 256) * 256
    ours.setup_caches(1, max_seq_len)
    logger.info("built %s in %.1f s", name, time.perf_counter() - t0)
    from edgevlm.runtime.kv_cache import kv_bytes_per_token

    tc = cfg.text
    common = {"model": name, "prompt_tokens": len(ids), "new_tokens": new_tokens,
              "params_m": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1),
              "kv16_bytes_per_token": kv_bytes_per_token("bf16", tc.num_hidden_layers, tc.num_key_value_heads,
                                                         tc.head_dim)}
    if hf is not None:
        try:
            row = bench_hf(hf, cfg, ids=ids, pixels=pixels, new_tokens=min(max(new_tokens, 8), 32),
                           vision_batch=vision_batch, device=device, ceilings=ceilings)
        except Exception as exc:  # noqa: BLE001 - keep the edgevlm rows
            logger.exception("transformers on %s failed", name)
            row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append({**common, "impl": "transformers", **row})
    w4 = None
    cuda = device.type == "cuda"
    if cuda:  # what TorchBackend does on CUDA, done here so that peak memory counts it once
        ours.language_model.fuse_projections()
        ours.language_model.enable_fused_decode()
    for variant in variants:
        weights, kv = VARIANTS[variant]
        try:
            if weights == "w4" and w4 is None:
                w4 = shallow_copy_model(ours, max_seq_len)
                quantize_decoder_w4(w4)
                if cuda:
                    w4.language_model.fuse_projections()
                    w4.language_model.enable_fused_decode()
            model = w4 if weights == "w4" else ours
            row = bench_edgevlm(model, cfg, kv_cache_dtype=kv, ids=ids, pixels=pixels, new_tokens=new_tokens,
                                batch_sizes=batch_sizes, vision_batch=vision_batch, device=device, ceilings=ceilings,
                                weight_bytes=decoder_weight_bytes(model))
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others
            logger.exception("%s on %s failed", variant, name)
            row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append({**common, "impl": variant, **row})
    del ours, hf, w4
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def goals(rows: list[dict], ceilings: dict) -> dict:
    """The issue's targets, evaluated where the rows exist (None = not measured)."""
    def get(model, impl, key):
        for r in rows:
            if r["model"] == model and r["impl"] == impl and key in r:
                return r[key]
        return None

    out = {}
    hf7 = get("llava-7b", "transformers", "decode_tok_s")
    w4 = get("llava-7b", "edgevlm-w4", "decode_tok_s")
    out["7b_w4_copy_frac>=0.5"] = get("llava-7b", "edgevlm-w4", "copy_frac")
    out["7b_w4_vs_hf>=20x"] = w4 / hf7 if w4 and hf7 else None
    small = [r.get("decode_tok_s") for r in rows if r["model"] == "small" and r["impl"] != "transformers"]
    out["small_decode_tok_s>=1000"] = max([s for s in small if s], default=None)
    ttft = [r.get("ttft_ms") for r in rows if r["model"] == "llava-7b" and r["impl"] != "transformers"]
    out["7b_ttft_ms<=30"] = min([s for s in ttft if s], default=None)
    out["vitl_b32_mm_frac>=0.5"] = get("llava-7b", "edgevlm", "vision_mm_frac")
    for m in ("llava-7b", "small", "demo", "tiny"):
        kv16, kv4 = get(m, "edgevlm-w4-kv4", "kv16_bytes_per_token"), get(m, "edgevlm-w4-kv4", "kv_bytes_per_token")
        if kv16 and kv4:
            out[f"{m}_kv16/kv4>=3.5"] = kv16 / kv4
    return out


COLUMNS = (("model", "{:>8}"), ("impl", "{:>15}"), ("ttft_ms", "{:8.1f}"), ("tpot_ms", "{:8.2f}"),
           ("decode_tok_s", "{:9.1f}"), ("step_gpu_ms", "{:8.3f}"), ("vision_img_s", "{:9.1f}"),
           ("vision_mm_frac", "{:6.2f}"), ("peak_mb", "{:8.0f}"), ("kv_bytes_per_token", "{:8d}"),
           ("gbps", "{:7.0f}"), ("copy_frac", "{:6.2f}"))


def format_table(rows: list[dict]) -> str:
    """Fixed-width table of the main columns (``-`` where a value is missing)."""
    heads = ["model", "impl", "ttft_ms", "tpot_ms", "tok/s", "step_ms", "vis_img/s", "vis_mm", "peak_mb",
             "kv_B/tok", "GB/s", "copy%"]
    widths = [len(f.format(0 if "d}" in f else (0.0 if "f}" in f else ""))) for _, f in COLUMNS]
    lines = [" ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    for r in rows:
        cells = []
        for (key, fmt), w in zip(COLUMNS, widths, strict=True):
            v = r.get(key)
            cells.append(fmt.format(v) if v is not None else "-".rjust(w))
        line = " ".join(cells)
        if r.get("batch_tok_s"):
            line += "  batch tok/s " + ", ".join(f"B{b}={v:.0f}" for b, v in r["batch_tok_s"].items())
        if r.get("error"):
            line += "  ERROR " + r["error"][:120]
        lines.append(line)
    return "\n".join(lines)


def save_results(summary: dict, results_dir: Path) -> Path:
    """Write ``summary`` as JSON to ``results_dir/bench_<device>_<UTC time>.json``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in (summary.get("gpu") or summary["device"])).strip("-").lower()
    stamp = summary["date"].replace(":", "").replace("-", "")[:15]
    path = results_dir / f"bench_{slug}_{stamp}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def run(*, models: list[str], device: str = "cuda", dtype: str | None = None, variants: list[str] | None = None,
        with_hf: bool = True, new_tokens: int | None = None, n_text: int = 32, batch_sizes: list[int] | None = None,
        vision_batch: int | None = None, ceilings: dict | None = None) -> dict:
    """Benchmark ``models`` on ``device``; returns the summary dict (rows, ceilings, goals, versions).
    Defaults depend on the device (GPU: bf16, 64 new tokens, batches 1/8/32, vision batch 32;
    CPU: float32, 8 new tokens, batches 1/4, vision batch 2)."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch_dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                   "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
                   None: torch.bfloat16 if cuda else torch.float32}[dtype]
    variants = variants or list(VARIANTS)
    new_tokens = new_tokens or (64 if cuda else 8)
    batch_sizes = batch_sizes or ([1, 8, 32] if cuda else [1, 4])
    vision_batch = vision_batch or (32 if cuda else 2)
    t0 = time.perf_counter()
    ceilings = ceilings or measure_ceilings(dev)
    rows: list[dict] = []
    for name in models:
        try:
            rows += run_model(name, device=dev, dtype=torch_dtype, variants=variants, with_hf=with_hf,
                              new_tokens=new_tokens, n_text=n_text, batch_sizes=batch_sizes,
                              vision_batch=vision_batch, ceilings=ceilings)
        except Exception as exc:  # noqa: BLE001 - e.g. the demo model missing; keep the other models
            logger.warning("model %s: %s", name, exc)
            rows.append({"model": name, "impl": "-", "error": f"{type(exc).__name__}: {exc}"[:300]})
    return {
        "bench": "edgevlm_bench", "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if cuda else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dtype": str(torch_dtype).removeprefix("torch."), "versions": versions(), **ceilings,
        "rows": rows, "goals": goals(rows, ceilings), "wall_s": round(time.perf_counter() - t0, 1),
    }


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _csv_choice(choices):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or 'empty'}; choose from {', '.join(choices)}")
        return values
    return parse


def main(argv: list[str] | None = None) -> int:
    """``edgevlm bench`` entry point; returns the exit code (2 for bad arguments / no CUDA, after
    one line ``edgevlm: error: ...`` on stderr)."""
    from edgevlm.quantize.bench_models import MODEL_NAMES

    ap = OneLineParser(prog="edgevlm bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--models", type=_csv_choice(MODEL_NAMES), default=None,
                    help=f"comma-separated, from {', '.join(MODEL_NAMES)} (default: GPU small,llava-7b,demo; CPU tiny)")
    ap.add_argument("--variants", type=_csv_choice(tuple(VARIANTS)), default=None,
                    help=f"edgevlm variants, from {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per measurement")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="text tokens in the prompt (plus the image)")
    ap.add_argument("--batch-sizes", type=_csv_ints, default=None, help="decode batch sizes, e.g. 1,8,32")
    ap.add_argument("--vision-batch", type=int, default=None, help="images per vision-encoder batch")
    ap.add_argument("--results-dir", default="bench/results", help="where the JSON goes ('' = don't save)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        return fail("edgevlm bench needs torch: pip install 'edgevlm[runtime]'")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        return fail(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        return fail("CUDA is not available (use --device cpu)")
    for flag in ("new_tokens", "vision_batch"):
        value = getattr(args, flag)
        if value is not None and value < 2:
            return fail(f"--{flag.replace('_', '-')} must be >= 2")
    if args.prompt_tokens < 4:
        return fail("--prompt-tokens must be >= 4")
    with_hf = not args.no_hf
    if with_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: edgevlm rows only", file=sys.stderr)
            with_hf = False
    models = args.models or (["small", "llava-7b", "demo"] if device.startswith("cuda") else ["tiny"])
    summary = run(models=models, device=device, dtype=args.dtype, variants=args.variants, with_hf=with_hf,
                  new_tokens=args.new_tokens, n_text=args.prompt_tokens, batch_sizes=args.batch_sizes,
                  vision_batch=args.vision_batch)
    print(f"device={summary['gpu'] or summary['device']} dtype={summary['dtype']} "
          f"copy={summary['copy_gbps']:.0f} GB/s matmul={summary['matmul_tflops']:.1f} TFLOP/s "
          f"torch={summary['versions']['torch']} transformers={summary['versions']['transformers']}")
    print(format_table(summary["rows"]))
    if args.results_dir:
        summary["saved_to"] = str(save_results(summary, Path(args.results_dir)))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
