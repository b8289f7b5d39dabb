"""``edgevlm bench``: edgevlm vs Hugging Face transformers, side by side, on the same weights.

Models: random weights in published shapes, built without downloads — LLaVA
(:mod:`edgevlm.quantize.bench_models`: LLaVA-1.5-7B, a ViT-B/16 + 0.5B decoder, the tiny test model,
the shipped demo model) and the Qwen2.5-VL, Qwen3-VL, SmolVLM2 and InternVL families
(:mod:`edgevlm.quantize.bench_families`: Qwen2.5-VL-3B, Qwen3-VL-2B / 8B, SmolVLM2-2.2B, InternVL3-1B
and ``tiny-*`` CPU configs) — or ``--model DIR``, a checkpoint folder of any registered family, with
its real weights. Implementations: transformers' ``...ForConditionalGeneration`` (SDPA attention)
and edgevlm variants (:data:`VARIANTS`: 16-bit or W4A16 decoder weights; 16-bit, INT4 or FP8 KV
cache; CUDA-graph decode on GPU). LLaVA models measure, after warm-up, as medians:

* ``ttft_ms``: float32 pixels on the host -> first token id on the host (vision, embed, prefill,
  argmax); the image preprocessing and tokenisation the engine also does are left out (both sides);
* ``tpot_ms`` and ``decode_tok_s``: per-token time of a greedy batch-1 decode loop as the engine
  runs it (edgevlm: ``greedy_tokens``, each step's token and slot fed on the device and step k + 1
  queued before the host reads token k; transformers: ``generate`` with its dynamic and its static
  cache, the faster reported); ``decode_tok_s_host_fed``: the same loop with the token fed back
  through the host each step (``decode`` + ``argmax``); ``step_gpu_ms``: one CUDA-graph replay
  alone (CUDA events); ``batch_tok_s``: tokens/s of batched greedy decode at each batch size (the
  continuous batcher's ``greedy_step`` chain; ``batch_tok_s_host_fed``: ``decode_batch`` + argmax);
* ``vision_img_s``: vision encoder + projector images/s at the vision batch, and its TFLOP/s as a
  fraction of the bf16 matrix-multiply rate measured first;
* ``peak_mb``: the implementation's weights plus the peak of everything it allocated while running;
* ``kv_bytes_per_token`` and ``gbps``/``copy_frac``: bytes one decode step must read (decoder
  weights + the attended KV cache) over ``tpot_ms``, against the device-to-device copy bandwidth
  (bytes read + written) measured first.

The other families give one row per input size (``--sizes``, the family's own preprocessing) and
decode batch, with ``vision_ms``, ``ttft_ms``, ``tpot_ms``, ``decode_tok_s``, ``peak_mb`` and
``copy_frac`` as defined in :mod:`edgevlm.quantize.bench_families`, and a prefill-logit parity
check against transformers in fp32 per model.

Prints a table, then one JSON line (device, date, versions, rows) on stdout. Files are written only
where asked: ``--out FILE`` (the JSON line) and ``--results-dir DIR`` (the JSON, indented, as
``DIR/bench_<device>_<UTC time>.json``); by default nothing is written (the default used to be
``bench/results`` under the current directory, which left a file in the source tree of a checkout).
Runs on CPU with the tiny models (``edgevlm bench --device cpu``).
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
    VARIANTS,
    bench_edgevlm,
    bench_hf,
    event_ms,
    make_inputs,
    measure_ceilings,
    vision_flops,
    wall_ms,
)

logger = logging.getLogger(__name__)

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
              batch_sizes: list[int], vision_batch: int, ceilings: dict, seed: int = 0,
              model_dir: Path | None = None) -> list[dict]:
    """All rows of one LLaVA model (``name`` from :data:`~edgevlm.quantize.bench_models.MODEL_NAMES`,
    or with ``model_dir`` a checkpoint folder's real weights, ``name`` its label); a variant that fails
    gives a row with ``error`` (the others still run)."""
    import torch

    from edgevlm.quantize.bench_models import (
        build_from_dir,
        build_models,
        decoder_weight_bytes,
        quantize_decoder_w4,
        quantize_lm_head_w4,
        shallow_copy_model,
    )

    max_seq_len = 0
    rows: list[dict] = []
    t0 = time.perf_counter()
    if model_dir is not None:
        ours, hf, cfg = build_from_dir(model_dir, device=device, dtype=dtype, max_seq_len=64, with_hf=with_hf)
    else:
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
    w4: dict = {}  # weights kind -> the quantized copy
    cuda = device.type == "cuda"
    if cuda:  # what TorchBackend does on CUDA, done here so that peak memory counts it once
        ours.language_model.fuse_projections()
        ours.language_model.enable_fused_decode()
    for variant in variants:
        weights, kv = VARIANTS[variant]
        try:
            if weights != "16bit" and weights not in w4:
                w4[weights] = shallow_copy_model(ours, max_seq_len)
                quantize_decoder_w4(w4[weights])
                if weights == "w4-head":
                    quantize_lm_head_w4(w4[weights])
                if cuda:
                    w4[weights].language_model.fuse_projections()
                    w4[weights].language_model.enable_fused_decode()
            model = w4.get(weights, ours)
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


#: table columns: (row key, heading, format); a column shows when some row has its value
COLUMNS = (("model", "model", "{}"), ("impl", "impl", "{}"), ("size", "size", "{}"), ("batch", "B", "{}"),
           ("vision_tokens", "vis_tok", "{}"), ("vision_ms", "vis_ms", "{:.2f}"), ("ttft_ms", "ttft_ms", "{:.1f}"),
           ("tpot_ms", "tpot_ms", "{:.2f}"), ("decode_tok_s", "tok/s", "{:.1f}"), ("step_gpu_ms", "step_ms", "{:.3f}"),
           ("vision_img_s", "vis_img/s", "{:.1f}"), ("vision_mm_frac", "vis_mm", "{:.2f}"),
           ("peak_mb", "peak_mb", "{:.0f}"), ("kv_bytes_per_token", "kv_B/tok", "{:d}"), ("gbps", "GB/s", "{:.0f}"),
           ("copy_frac", "copy%", "{:.2f}"))


def format_table(rows: list[dict], parity: dict | None = None) -> str:
    """Fixed-width table of the columns some row has (``-`` where a row lacks one; LLaVA rows' batched
    decode and errors after the row), then one ``parity <model>: ...`` line per model of ``parity``."""
    cols = [c for c in COLUMNS if c[0] in ("model", "impl") or any(r.get(c[0]) is not None for r in rows)]
    cells = [[("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in cols] for r in rows]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, (_, h, _) in enumerate(cols)]
    lines = [" ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths, strict=True))]
    for r, row_cells in zip(rows, cells, strict=True):
        line = " ".join(c.rjust(w) for c, w in zip(row_cells, widths, strict=True))
        if r.get("batch_tok_s"):
            line += "  batch tok/s " + ", ".join(f"B{b}={v:.0f}" for b, v in r["batch_tok_s"].items())
        if r.get("decode_tok_s_host_fed"):
            fed = {"1": r["decode_tok_s_host_fed"], **(r.get("batch_tok_s_host_fed") or {})}
            line += "  host-fed tok/s " + ", ".join(f"B{b}={v:.0f}" for b, v in fed.items())
        if r.get("error"):
            line += "  ERROR " + r["error"][:120]
        lines.append(line)
    for name, p in (parity or {}).items():
        lines.append(f"parity {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in p.items()))
    return "\n".join(lines)


def save_results(summary: dict, results_dir: Path) -> Path:
    """Write ``summary`` as JSON to ``results_dir/bench_<device>_<UTC time>.json``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in (summary.get("gpu") or summary["device"])).strip("-").lower()
    stamp = summary["date"].replace(":", "").replace("-", "")[:15]
    path = results_dir / f"bench_{slug}_{stamp}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def run(*, models: list[str | Path], device: str = "cuda", dtype: str | None = None,
        variants: list[str] | None = None, with_hf: bool = True, new_tokens: int | None = None, n_text: int = 32,
        batch_sizes: list[int] | None = None, vision_batch: int | None = None, ceilings: dict | None = None,
        sizes: list[tuple[int, int]] | None = None, do_parity: bool = True) -> dict:
    """Benchmark ``models`` on ``device``; returns the summary dict (rows, parity, ceilings, goals,
    versions). A model is a name of :data:`MODEL_NAMES` (random weights) or a :class:`~pathlib.Path`,
    a checkpoint folder of a registered family (its real weights; label: the folder's name). LLaVA
    models run :func:`run_model` (``vision_batch``, ``batch_sizes`` as batched decode in one row), the
    other families :func:`edgevlm.quantize.bench_families.run_family` (one row per input size of
    ``sizes`` (W, H) px and decode batch of ``batch_sizes``; prefill-logit parity with ``do_parity``).
    Defaults depend on the device (GPU: bf16, 64 new tokens, batches 1/8/32, vision batch 32, sizes
    448x448 and 1280x720; CPU: float32, 8 new tokens, batches 1/4, vision batch 2, size 64x64)."""
    import torch

    from edgevlm.quantize import bench_families

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch_dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                   "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
                   None: torch.bfloat16 if cuda else torch.float32}[dtype]
    variants = variants or list(VARIANTS)
    new_tokens = new_tokens or (64 if cuda else 8)
    batch_sizes = batch_sizes or ([1, 8, 32] if cuda else [1, 4])
    vision_batch = vision_batch or (32 if cuda else 2)
    sizes = sizes or ([(448, 448), (1280, 720)] if cuda else [(64, 64)])
    t0 = time.perf_counter()
    ceilings = ceilings or measure_ceilings(dev)
    rows: list[dict] = []
    parity: dict = {}
    for model in models:
        label = model.name if isinstance(model, Path) else model
        try:
            files = None
            if isinstance(model, Path):
                from edgevlm.runtime.loader import read_model_files

                files = read_model_files(model)
            if (files is None and model not in bench_families.FAMILY_MODEL_NAMES) or (
                    files is not None and files.family.name == "llava"):
                rows += run_model(label, device=dev, dtype=torch_dtype, variants=variants, with_hf=with_hf,
                                  new_tokens=new_tokens, n_text=n_text, batch_sizes=batch_sizes,
                                  vision_batch=vision_batch, ceilings=ceilings,
                                  model_dir=None if files is None else files.model_dir)
                continue
            got, par = bench_families.run_family(
                label, device=dev, dtype=torch_dtype, variants=variants, with_hf=with_hf, sizes=sizes,
                batch_sizes=batch_sizes, new_tokens=new_tokens, n_text=n_text, do_parity=do_parity,
                ceilings=ceilings, files=files)
            rows += got
            if par:
                parity[label] = par
        except Exception as exc:  # noqa: BLE001 - e.g. the demo model missing; keep the other models
            logger.warning("model %s: %s", label, exc)
            rows.append({"model": label, "impl": "-", "error": f"{type(exc).__name__}: {exc}"[:300]})
    return {
        "bench": "edgevlm_bench", "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if cuda else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dtype": str(torch_dtype).removeprefix("torch."), "versions": versions(), **ceilings,
        "rows": rows, "parity": parity, "goals": goals(rows, ceilings), "wall_s": round(time.perf_counter() - t0, 1),
    }


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _csv_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        m = re.fullmatch(r"(\d+)x(\d+)", item.lower())
        if not m or min(int(m[1]), int(m[2])) < 1:
            raise argparse.ArgumentTypeError(f"expected WxH sizes in px, e.g. 448x448,1280x720, got {text!r}")
        out.append((int(m[1]), int(m[2])))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one WxH size")
    return out


#: caps on the sizes ``edgevlm bench`` accepts (beyond them a run only exhausts memory)
MAX_BENCH_BATCH = 1024
MAX_BENCH_PROMPT_TOKENS = 32768


def _output_problem(results_dir: str, out: str) -> str | None:
    """Why ``--results-dir`` (created here, as the run would at its end) or ``--out`` (a file in an
    existing folder) cannot be written, or None; checked before minutes of measuring."""
    import os

    if results_dir:
        try:
            Path(results_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--results-dir: cannot create {results_dir}: {exc.strerror or exc}"
    if out:
        path = Path(out)
        if path.is_dir():
            return f"--out: {out} is a folder"
        if not path.parent.is_dir():
            return f"--out: folder {path.parent} does not exist"
        if not os.access(path.parent, os.W_OK):
            return f"--out: folder {path.parent} is not writable"
    return None


def _csv_choice(choices):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or 'empty'}; choose from {', '.join(choices)}")
        return values
    return parse


def _checkpoint(path: str) -> Path | str:
    """``path`` if it is a checkpoint folder transformers and edgevlm both load, else the one-line reason."""
    from edgevlm.errors import ModelLoadError
    from edgevlm.model_folder import check_model_folder
    from edgevlm.runtime.bundle import is_bundle
    from edgevlm.runtime.loader import read_model_files

    if is_bundle(path):
        return f"--model: {path} is an edgevlm bundle; bench compares against transformers, so give the checkpoint"
    try:
        model_dir = read_model_files(path).model_dir  # first: its model_type check names the registry
        check_model_folder(model_dir)  # then what it does not check: a bundle copied without its manifest.json
        return model_dir
    except ModelLoadError as exc:
        return f"--model: {exc.message}"


def main(argv: list[str] | None = None) -> int:
    """``edgevlm bench`` entry point; returns the exit code (2 for bad arguments, a folder that is not
    a checkpoint, or no CUDA, after one line ``edgevlm: error: ...`` on stderr)."""
    from edgevlm.quantize.bench_families import FAMILY_MODEL_NAMES
    from edgevlm.quantize.bench_models import MODEL_NAMES as LLAVA_NAMES
    from edgevlm.runtime.models import FAMILIES

    names = (*LLAVA_NAMES, *FAMILY_MODEL_NAMES)
    ap = OneLineParser(prog="edgevlm bench", description=__doc__.split("\n")[0],
                       epilog="Prints a table, then one JSON line on stdout; writes files only where asked "
                              "(--out, --results-dir), nothing by default.")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--models", type=_csv_choice(names), default=None,
                    help=f"comma-separated, from {', '.join(names)} (random weights in the published shapes; "
                         "tiny*: CPU sizes; default: GPU small,llava-7b,demo; CPU tiny)")
    ap.add_argument("--model", metavar="DIR", default=None,
                    help=f"a checkpoint folder of a registered family ({', '.join(FAMILIES)}): "
                         "its real weights, ours vs transformers' from_pretrained")
    ap.add_argument("--variants", type=_csv_choice(tuple(VARIANTS)), default=None,
                    help=f"edgevlm variants, from {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per measurement")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="text tokens in the prompt (plus the image)")
    ap.add_argument("--batch-sizes", type=_csv_ints, default=None,
                    help="decode batch sizes, e.g. 1,8,32 (default GPU 1,8,32; CPU 1,4)")
    ap.add_argument("--vision-batch", type=int, default=None, help="images per vision-encoder batch (LLaVA models)")
    ap.add_argument("--sizes", type=_csv_sizes, default=None,
                    help="input frame sizes W x H px of the non-LLaVA families (default GPU 448x448,1280x720; CPU 64x64)")
    ap.add_argument("--no-parity", action="store_true",
                    help="skip the prefill-logit parity check against transformers in fp32 (non-LLaVA families)")
    ap.add_argument("--results-dir", metavar="DIR", default="",
                    help="also save the JSON as DIR/bench_<device>_<UTC time>.json (DIR created if missing; "
                         "default: not saved)")
    ap.add_argument("--out", metavar="FILE", default="",
                    help="also write the JSON line to FILE (its folder must exist; default: stdout only)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        return fail("edgevlm bench needs torch: pip install 'edgevlm[runtime]'")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        return fail(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    from edgevlm.protocol import MAX_NEW_TOKENS_LIMIT

    for flag, high in (("new_tokens", MAX_NEW_TOKENS_LIMIT), ("vision_batch", MAX_BENCH_BATCH)):
        value = getattr(args, flag)
        if value is not None and not 2 <= value <= high:
            return fail(f"--{flag.replace('_', '-')} must be in [2, {high}], got {value}")
    if not 4 <= args.prompt_tokens <= MAX_BENCH_PROMPT_TOKENS:
        return fail(f"--prompt-tokens must be in [4, {MAX_BENCH_PROMPT_TOKENS}], got {args.prompt_tokens}")
    if args.batch_sizes and not all(1 <= b <= MAX_BENCH_BATCH for b in args.batch_sizes):
        return fail(f"--batch-sizes must be in [1, {MAX_BENCH_BATCH}], got {','.join(map(str, args.batch_sizes))}")
    problem = _output_problem(args.results_dir, args.out)
    if problem:
        return fail(problem)
    models: list[str | Path] = list(args.models or [])
    if args.model is not None:
        folder = _checkpoint(args.model)
        if isinstance(folder, str):
            return fail(folder)
        models.append(folder)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        return fail("CUDA is not available (use --device cpu)")
    with_hf = not args.no_hf
    if with_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: edgevlm rows only", file=sys.stderr)
            with_hf = False
    models = models or (["small", "llava-7b", "demo"] if device.startswith("cuda") else ["tiny"])
    summary = run(models=models, device=device, dtype=args.dtype, variants=args.variants, with_hf=with_hf,
                  new_tokens=args.new_tokens, n_text=args.prompt_tokens, batch_sizes=args.batch_sizes,
                  vision_batch=args.vision_batch, sizes=args.sizes, do_parity=not args.no_parity)
    print(f"device={summary['gpu'] or summary['device']} dtype={summary['dtype']} "
          f"copy={summary['copy_gbps']:.0f} GB/s matmul={summary['matmul_tflops']:.1f} TFLOP/s "
          f"torch={summary['versions']['torch']} transformers={summary['versions']['transformers']}")
    print(format_table(summary["rows"], summary["parity"]))
    if args.results_dir:
        summary["saved_to"] = str(save_results(summary, Path(args.results_dir)))
    line = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
