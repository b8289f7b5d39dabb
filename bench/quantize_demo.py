"""INT4 on the demo model: exact-match accuracy per rung (16-bit vs RTN vs AWQ), cross-backend
agreement (torch vs onnxruntime), AWQ vs RTN output error, sizes, quantization time/RAM, CPU decode.

    .venv/bin/python bench/quantize_demo.py [--model DIR] [--n 300] [--workdir /tmp/edgevlm-qdemo]

Steps: ``edgevlm quantize`` the model with RTN and with AWQ (``--calib demo``; subprocesses, so the
peak RSS reported is that of the quantizer alone); answer the held-out scene set
(:func:`edgevlm.runtime.demo.scenes.eval_set`, seed 1000, greedy) at every rung of the model's
resolution ladder with the 16-bit model (float32 on CPU), the RTN bundle, the AWQ bundle on the
torch backend and the AWQ bundle on the onnx backend; compare; time 32 decode steps of each.
Also quantizes one synthetic layer with outlier input channels both ways (the AWQ paper's setting).
Prints tables and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def quantize(model: Path, out: Path, method: str) -> dict:
    cmd = [sys.executable, "-m", "edgevlm.quantize.cli", str(model), "--out", str(out), "--method", method,
           "--overwrite", "--json"] + (["--calib", "demo"] if method == "awq" else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"quantize {method} failed: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def answers(engine, items, rungs: list[int]) -> dict[int, list[str]]:
    from edgevlm.types import OperatingPoint

    out = {}
    for rung in rungs:
        op = OperatingPoint(name=f"r{rung}", resolution_px=rung)
        out[rung] = [engine.ask(it.image, it.qa.question, max_new_tokens=24, operating_point=op).text.strip()
                     for it in items]
    return out


def decode_tokens_per_s(engine, steps: int = 32) -> float:
    import torch

    be = engine.backend
    be.prefill(be.embed(torch.randint(5, 30, (1, 48)), None))
    t0 = time.perf_counter()
    for i in range(steps):
        be.decode(6 + i % 20, 48 + i)
    return steps / (time.perf_counter() - t0)


def outlier_layer_errors(seed: int = 0) -> dict:
    """Relative output MSE of RTN and AWQ on a 1024->1024 layer whose inputs have 1% outlier channels."""
    import torch
    from torch import nn

    from edgevlm.quantize import Int4WeightOnlyConfig, quantize_

    g = torch.Generator().manual_seed(seed)

    def inputs(n: int, s: int) -> torch.Tensor:
        x = torch.randn(n, 1024, generator=torch.Generator().manual_seed(s))
        x[:, ::100] *= 30.0
        return x

    w = torch.randn(1024, 1024, generator=g) * 0.02
    models = {}
    for method in ("rtn", "awq"):
        m = nn.Sequential(nn.Linear(1024, 1024, bias=False))
        m[0].weight.data.copy_(w)
        if method == "rtn":
            quantize_(m, Int4WeightOnlyConfig())
        else:
            quantize_(m, Int4WeightOnlyConfig(method="awq", step="prepare"))
            with torch.no_grad():
                for s in range(4):
                    m(inputs(512, s))
            quantize_(m, Int4WeightOnlyConfig(method="awq", step="convert"))
        models[method] = m
    x = inputs(1024, 99)  # held out
    ref = x @ w.T
    with torch.no_grad():
        return {k: ((m(x) - ref).pow(2).sum() / ref.pow(2).sum()).item() for k, m in models.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the shipped demo model")
    ap.add_argument("--n", type=int, default=300, help="held-out items per rung")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgevlm-qdemo"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see quantize_llama05b.py)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from edgevlm.runtime import Engine
    from edgevlm.runtime.demo import model_dir, scenes

    model = args.model or model_dir()
    if not (model / "config.json").is_file():
        print(f"no model at {model} (train the demo model first, or pass --model)", file=sys.stderr)
        return 2
    q = {m: quantize(model, args.workdir / m, m) for m in ("rtn", "awq")}
    engines = {"16-bit": Engine.load(model), "RTN": Engine.load(args.workdir / "rtn"),
               "AWQ": Engine.load(args.workdir / "awq"), "AWQ onnx": Engine.load(args.workdir / "awq", backend="onnx")}
    rungs = sorted(engines["16-bit"].resolution_ladder, reverse=True)
    items = scenes.eval_set(args.n, seed=1000)
    got = {name: answers(e, items, rungs) for name, e in engines.items()}
    acc = {name: {r: sum(a == it.qa.answer for a, it in zip(got[name][r], items, strict=True)) / len(items)
                  for r in rungs} for name in got}
    pairs = [("AWQ", "AWQ onnx"), ("16-bit", "AWQ"), ("16-bit", "RTN")]
    agree = {f"{a} vs {b}": sum(x == y for r in rungs for x, y in zip(got[a][r], got[b][r], strict=True))
             / (len(rungs) * len(items)) for a, b in pairs}
    speed = {}
    for name in ("16-bit", "AWQ"):
        speed[name + " fp32"] = decode_tokens_per_s(engines[name])
    for name, path in (("16-bit", model), ("AWQ", args.workdir / "awq")):
        speed[name + " bf16"] = decode_tokens_per_s(Engine.load(path, dtype="bfloat16"))
    speed["AWQ onnx fp32"] = decode_tokens_per_s(engines["AWQ onnx"])
    outlier = outlier_layer_errors()

    print(f"exact-match accuracy on {args.n} held-out items (greedy), per rung:")
    print(f"{'model':<10}" + "".join(f"{r:>9} px" for r in rungs))
    for name, row in acc.items():
        print(f"{name:<10}" + "".join(f"{100 * row[r]:11.1f}%" for r in rungs))
    print("\nanswer agreement over all rungs: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in agree.items()))
    print(f"\n{'':<8}{'time s':>8}{'peak RSS MB':>13}{'bundle MB':>11}{'dec INT4 MB':>13}{'dec 16-bit MB':>15}"
          f"{'ratio':>7}{'calib err AWQ/RTN':>20}")
    for m, s in q.items():
        err = f"{s['awq_mean_rel_error']:.3g}/{s['rtn_mean_rel_error']:.3g}" if "awq_mean_rel_error" in s else "-"
        print(f"{m:<8}{s['quantize_time_s']:8.1f}{s['peak_rss_mb']:13.0f}{s['bundle_mb']:11.2f}"
              f"{s['decoder_linear_int4_mb']:13.2f}{s['decoder_linear_16bit_mb']:15.2f}"
              f"{100 * s['decoder_linear_ratio']:6.1f}%{err:>20}")
    print("\nCPU decode tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in speed.items()))
    print(f"outlier-channel layer, relative output MSE: RTN {outlier['rtn']:.3g}, AWQ {outlier['awq']:.3g}")
    print(json.dumps({"bench": "quantize_demo", "model": str(model), "n": args.n, "rungs": rungs,
                      "accuracy": {k: {str(r): v for r, v in row.items()} for k, row in acc.items()},
                      "agreement": agree, "quantize": q, "decode_tokens_per_s": speed, "outlier_layer": outlier}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
