"""Quantize a random ~0.5B-parameter Llama-shaped decoder (in a tiny LLaVA) on the CPU: bundle
sizes, quantization time and peak RAM (RTN and AWQ), and CPU decode tokens/s and memory, 16-bit vs INT4.

    .venv/bin/python bench/quantize_llama05b.py [--workdir /tmp/edgevlm-05b] [--decode-tokens 32]

The checkpoint (bf16, ~1 GB: hidden 1536, MLP 3072, 24 layers, 24 heads / 4 KV heads, a 64 px
CLIP tower) is written once into ``--workdir``. Every measurement runs in a fresh subprocess so
peak RSS (``ru_maxrss``) belongs to that step alone; ``baseline`` is a process that only imports
torch and edgevlm. Decode speed: prefill 64 tokens, then ``--decode-tokens`` single-token steps
through the backend (``tokens/s = steps / time``). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, LAYERS, HEADS, KV_HEADS = 1536, 24, 24, 4


def write_checkpoint(out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from edgevlm.runtime.testing import write_tiny_checkpoint

    if (out / "model.safetensors").is_file():
        return out
    write_tiny_checkpoint(out, seed=0, text_hidden=HIDDEN, text_layers=LAYERS, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, vision_hidden=96, vision_layers=2, max_position_embeddings=2048)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(out / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _worker(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import torch

    from edgevlm.quantize.build import peak_rss_mb as rss_mb

    def current_rss_mb() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
        return float("nan")

    if args.worker == "baseline":
        import edgevlm.runtime.engine  # noqa: F401

        print(json.dumps({"peak_rss_mb": rss_mb()}))
        return
    if args.worker == "quantize":
        from edgevlm.quantize.build import BuildOptions, build_bundle

        t0 = time.perf_counter()
        res = build_bundle(args.model, args.out, BuildOptions(method=args.method, calib="demo", calib_samples=8,
                                                              onnx=False, overwrite=True))
        s = res.manifest.stats
        print(json.dumps({"time_s": time.perf_counter() - t0, "peak_rss_mb": rss_mb(),
                          "bundle_mb": sum(f.size_bytes for f in res.manifest.files) / 1e6,
                          "dec_int4_mb": s["decoder_linear_int4_bytes"] / 1e6,
                          "dec_16bit_mb": s["decoder_linear_16bit_bytes"] / 1e6}))
        return
    from edgevlm.runtime import Engine

    torch.manual_seed(0)
    engine = Engine.load(args.model, dtype=args.dtype, max_seq_len=256)
    be = engine.backend
    load_rss = current_rss_mb()
    emb = be.embed(torch.randint(5, 60, (1, 64)), None)
    be.prefill(emb)
    t0 = time.perf_counter()
    for i in range(args.decode_tokens):
        be.decode(7 + i % 40, 64 + i)
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens_per_s": args.decode_tokens / dt, "tpot_ms": 1e3 * dt / args.decode_tokens,
                      "rss_after_load_mb": load_rss, "rss_after_decode_mb": current_rss_mb(),
                      "peak_rss_mb": rss_mb()}))


THREADS = "1"


def _run(*argv: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"worker {argv} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgevlm-05b"))
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--skip-quantize", action="store_true", help="reuse the bundles already in --workdir")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker (default 1: on a shared machine OpenMP spin-waiting under "
                         "oversubscription makes multi-threaded timings meaningless)")
    ap.add_argument("--worker", choices=("baseline", "quantize", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    global THREADS
    THREADS = str(args.threads)
    if not (args.workdir / "src" / "model.safetensors").is_file():  # in a child: keep this process small
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                        f"import quantize_llama05b as b; b.write_checkpoint(b.Path({str(args.workdir / 'src')!r}))"],
                       check=True)
    src = args.workdir / "src"
    n_params = _param_count(src)
    src_mb = (src / "model.safetensors").stat().st_size / 1e6
    base = _run("--worker", "baseline")
    quant = {}
    for m in ("rtn", "awq"):
        if args.skip_quantize and (args.workdir / m / "manifest.json").is_file():
            st = json.loads((args.workdir / m / "manifest.json").read_text())["stats"]
            quant[m] = {"time_s": st["quantize_time_s"], "peak_rss_mb": st["peak_rss_mb"],
                        "bundle_mb": sum(f["size_bytes"] for f in json.loads(
                            (args.workdir / m / "manifest.json").read_text())["files"]) / 1e6,
                        "dec_int4_mb": st["decoder_linear_int4_bytes"] / 1e6,
                        "dec_16bit_mb": st["decoder_linear_16bit_bytes"] / 1e6}
        else:
            quant[m] = _run("--worker", "quantize", "--model", str(src), "--out", str(args.workdir / m), "--method", m)
    decode = {}
    for label, model, dtype in (("16-bit bf16", src, "bfloat16"), ("INT4 bf16", args.workdir / "awq", "bfloat16"),
                                ("16-bit fp32", src, "float32"), ("INT4 fp32", args.workdir / "awq", "float32")):
        decode[label] = _run("--worker", "decode", "--model", str(model), "--dtype", dtype,
                             "--decode-tokens", str(args.decode_tokens))
    print(f"random Llama-shaped decoder: {n_params / 1e6:.0f}M parameters, bf16 checkpoint {src_mb:.0f} MB, "
          f"{args.threads} torch thread(s) per worker")
    print(f"baseline process (torch + edgevlm imported): peak RSS {base['peak_rss_mb']:.0f} MB\n")
    print(f"{'quantize':<10} {'time s':>7} {'peak RSS MB':>11} {'bundle MB':>9} {'dec INT4 MB':>11} {'dec 16-bit MB':>13}")
    for m, q in quant.items():
        print(f"{m:<10} {q['time_s']:7.1f} {q['peak_rss_mb']:11.0f} {q['bundle_mb']:9.1f} {q['dec_int4_mb']:11.1f} "
              f"{q['dec_16bit_mb']:13.1f}")
    print(f"\n{'decode (CPU)':<14} {'tokens/s':>8} {'TPOT ms':>8} {'RSS after decode MB':>19} {'peak RSS MB':>11}")
    for label, d in decode.items():
        print(f"{label:<14} {d['tokens_per_s']:8.1f} {d['tpot_ms']:8.1f} {d['rss_after_decode_mb']:19.0f} "
              f"{d['peak_rss_mb']:11.0f}")
    print(json.dumps({"bench": "quantize_llama05b", "params_m": n_params / 1e6, "checkpoint_mb": src_mb,
                      "threads": args.threads,
                      "baseline_rss_mb": base["peak_rss_mb"], "quantize": quant, "decode": decode}))
    return 0


def _param_count(src: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    sys.exit(main())
