#!/usr/bin/env python3
"""Fit exit heads to the *frozen* demo model on a CUDA GPU (issue 4) and write them to ``$OUT``.

    OUT=/some/dir python3 bench/calibrate_gpu.py [--tiny] [--device cuda] [extra calibrate options]

The shipped heads come from early-exit training instead (``bench/train_demo_exits_gpu.sh``, which
starts its adapters from heads made by this script for the previous weights); this script is the
recipe for a model whose weights stay as they are.

Runs :func:`edgevlm.quantize.calibrate.main` on the shipped demo model (``runtime/demo/model``)
from this checkout without installing it (``edgevlm`` and ``edgevlm.runtime`` are imported from
the source folders), with the recipe below, and writes ``exits.safetensors``, ``exits.json`` and
``calibrate.log`` into ``$OUT``; copy the first two into ``runtime/demo/model/`` and run
``bench/early_exit.py`` / the frontier on the CPU that serves (latency is a property of that
machine, not of the GPU). The model runs in float32 on the GPU (no TF32), so the teacher answers
of the agreement phase are the ones the CPU float32 runtime gives, up to reduction order.

Recipe (exits after blocks 2 and 3 of 6; adapter = one narrow attention layer of 128 channels +
an MLP of 512; question-conditioned confidence heads; rungs weighted 2:1:1:1 towards 384 px):
3000 feature steps x 64 images, 1500 answer-distillation steps x 64 images x 2 questions, 6000
agreement images x 4 questions (80/20 split by image for the threshold). ``--time-budget-s 380``
stops each phase early if the machine is slower than expected, so the run ends in about 7 min.
``--tiny`` (for a CPU dry run) shrinks everything to a few steps.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RECIPE = ["--exit-blocks", "2", "3", "--adapter-attn-dim", "128", "--adapter-hidden", "512", "--question-conditioned",
          "--rungs", "384", "384", "256", "192", "128", "--steps", "3000", "--batch-size", "64", "--kd-steps", "1500",
          "--agreement-images", "6000", "--questions-per-image", "4", "--max-answer-change", "0.01",
          "--time-budget-s", "380", "--dtype", "float32", "--no-frontier"]
TINY = ["--steps", "2", "--batch-size", "4", "--kd-steps", "2", "--agreement-images", "12", "--questions-per-image", "2",
        "--time-budget-s", "300"]


def bootstrap_imports() -> None:
    """Import ``edgevlm`` and ``edgevlm.runtime`` from this checkout even without ``pip install -e .``."""
    sys.path.insert(0, str(REPO))
    try:
        import edgevlm.quantize.calibrate  # noqa: F401
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("edgevlm.runtime", REPO / "runtime" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "runtime")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["edgevlm.runtime"] = module
    spec.loader.exec_module(module)


def main(argv: list[str]) -> int:
    tiny = "--tiny" in argv
    argv = [a for a in argv if a != "--tiny"]
    out = Path(os.environ.get("OUT") or "/tmp/calibrate_gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if tiny and "--device" not in argv else "cuda"
    bootstrap_imports()
    import torch

    from edgevlm.quantize import calibrate

    if device == "cuda" and "--device" not in argv:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    workers = str(max(1, min(14, (os.cpu_count() or 2) - 2)))
    args = [str(REPO / "runtime" / "demo" / "model"), *RECIPE, *(TINY if tiny else []), "--device", device,
            "--workers", "0" if tiny else workers, "--out", str(out), *argv]
    log = open(out / "calibrate.log", "w")  # noqa: SIM115 (closed at exit)

    class Tee:
        def write(self, s: str) -> int:
            log.write(s)
            log.flush()
            return sys.__stderr__.write(s)

        def flush(self) -> None:
            sys.__stderr__.flush()

    sys.stderr = Tee()
    t0 = time.perf_counter()
    print("calibrate " + " ".join(args), file=sys.stderr, flush=True)
    rc = calibrate.main(args)
    print(f"calibrate_gpu: rc {rc}, {time.perf_counter() - t0:.0f} s, files in {out}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
