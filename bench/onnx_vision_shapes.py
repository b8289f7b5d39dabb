"""CPU: the ONNX vision graphs of Qwen2.5-VL, Qwen3-VL and SmolVLM2 at the public models' vision widths.

    .venv/bin/python bench/onnx_vision_shapes.py [--depth 8] [--iters 3] [--families qwen2_5_vl qwen3_vl smolvlm]

For each family a vision tower with the widths of a public checkpoint (Qwen2.5-VL-3B: hidden 1280,
16 heads of 80, MLP 3420, window 112 px; Qwen3-VL-2B: hidden 1024, 16 heads, MLP 4096, 48 x 48
position grid, DeepStack; SmolVLM2-2.2B: SigLIP-so400m 1152 / 4304, 384 px tiles of 14 px patches,
pixel shuffle 3), random bf16 weights (``--depth`` blocks, the full-attention / DeepStack blocks
spread over them) is built in memory, exported with :mod:`edgevlm.quantize.onnx_vision_export`, and
run by onnxruntime (CPU provider, host-side feeds of :mod:`edgevlm.runtime.backends.onnx_vision`)
against the PyTorch tower (float32) at two rungs of a 4:3 image (448 and 896 px; SmolVLM: 5 and 13
tiles). ONE graph serves both rungs. Prints a table (error = ``max|ort - torch| / max(1, max|torch|)``
over every output, median latency), then one JSON line. Timings on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from edgevlm.quantize.onnx_graph import BundleTensors, save_model
from edgevlm.quantize.onnx_vision_export import VISION_GRAPHS
from edgevlm.runtime.backends.onnx_vision import VisionGraph


def _spread(depth: int, k: int) -> tuple[int, ...]:
    """``k`` block indexes spread over ``depth`` blocks, last block included (as the public configs)."""
    return tuple(depth - 1 - i * (depth // k) for i in reversed(range(k)))


def _family(name: str, depth: int):
    """(config namespace, torch tower callable, tensors by runtime name, inputs per rung)."""
    torch.manual_seed(0)
    if name == "qwen2_5_vl":
        from edgevlm.runtime.models.qwen2_5_vl.config import Qwen25VisionConfig
        from edgevlm.runtime.models.qwen2_5_vl.vision import Qwen25VisionTower

        vc = Qwen25VisionConfig(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                out_hidden_size=2048, fullatt_block_indexes=_spread(depth, 4))
        tower = Qwen25VisionTower(vc).to(torch.bfloat16).float().eval()
        tensors = {"visual." + k: v.to(torch.bfloat16) for k, v in tower.state_dict().items()}
        grids = {448: (1, 24, 32), 896: (1, 48, 64)}  # 4:3 image, 14 px patches
        k_in = 3 * 2 * 14 * 14
        return SimpleNamespace(vision=vc), lambda px, g: [tower(px, g)], tensors, grids, k_in
    if name == "qwen3_vl":
        from edgevlm.runtime.models.qwen3_vl.config import Qwen3VLVisionConfig
        from edgevlm.runtime.models.qwen3_vl.vision import Qwen3VLVisionTower

        vc = Qwen3VLVisionConfig(depth=depth, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                 out_hidden_size=2048, deepstack_visual_indexes=_spread(depth - 1, 3))
        tower = Qwen3VLVisionTower(vc).to(torch.bfloat16).float().eval()
        tensors = {"visual." + k: v.to(torch.bfloat16) for k, v in tower.state_dict().items()}
        grids = {448: (1, 20, 28), 896: (1, 42, 56)}  # 4:3 image, 16 px patches
        k_in = 3 * 2 * 16 * 16

        def run(px, g):
            main, deepstack = tower(px, g)
            return [main, *deepstack]

        return SimpleNamespace(vision=vc), run, tensors, grids, k_in
    from edgevlm.runtime.models.blocks.siglip_config import SiglipVisionConfig
    from edgevlm.runtime.models.smolvlm.vision import Connector, SmolVLMVisionTransformer

    vc = replace(SiglipVisionConfig(), hidden_size=1152, intermediate_size=4304, num_hidden_layers=depth,
                 num_attention_heads=16, image_size=384, patch_size=14)
    cfg = SimpleNamespace(vision=vc, scale_factor=3, text=SimpleNamespace(hidden_size=2048))
    vision = SmolVLMVisionTransformer(vc).to(torch.bfloat16).float().eval()
    connector = Connector(cfg).to(torch.bfloat16).float().eval()
    tensors = {"vision_model." + k: v.to(torch.bfloat16) for k, v in vision.state_dict().items()}
    tensors.update({"connector." + k: v.to(torch.bfloat16) for k, v in connector.state_dict().items()})
    return cfg, lambda px, g: [connector(vision(px))], tensors, {448: 5, 896: 13}, None


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--families", nargs="+", default=list(VISION_GRAPHS))
    args = ap.parse_args(argv)
    rows, record = [], {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in args.families:
            cfg, tower, tensors, rungs, k_in = _family(name, args.depth)
            t0 = time.perf_counter()
            path = Path(tmp) / f"{name}.onnx"
            save_model(VISION_GRAPHS[name](BundleTensors.from_tensors(tensors), cfg), path)
            export_s = time.perf_counter() - t0
            graph = VisionGraph(path, name, cfg, ["CPUExecutionProvider"])
            gen = torch.Generator().manual_seed(0)
            for rung, shape in rungs.items():
                if k_in is None:  # SmolVLM: tiles of 384 px
                    px, grid = torch.randn(shape, 3, 384, 384, generator=gen), None
                    label = f"{shape} tiles"
                else:
                    grid = torch.tensor([shape])
                    px = torch.randn(int(grid.prod()), k_in, generator=gen)
                    label = "x".join(map(str, shape))
                want = tower(px, grid)
                got = graph.run(px, grid_thw=grid)
                err = max(float((a - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in zip(got, want,
                                                                                                      strict=True))
                torch_ms = _median_ms(lambda t=tower, px=px, grid=grid: t(px, grid), args.iters)
                ort_ms = _median_ms(lambda g=graph, px=px, grid=grid: g.run(px, grid_thw=grid), args.iters)
                rows.append((name, rung, label, err, torch_ms, ort_ms, export_s))
                record[f"{name}_{rung}"] = {"input": label, "max_error": err, "torch_ms": torch_ms, "ort_ms": ort_ms}
    print(f"{'family':<11} {'rung_px':>7} {'input':>12} {'max_error':>10} {'torch_ms':>9} {'ort_ms':>8} "
          f"{'export_s':>8}")
    for name, rung, label, err, t_ms, o_ms, e_s in rows:
        print(f"{name:<11} {rung:>7} {label:>12} {err:>10.2e} {t_ms:>9.0f} {o_ms:>8.0f} {e_s:>8.1f}")
    print(json.dumps({"bench": "onnx_vision_shapes", "depth": args.depth, "threads": torch.get_num_threads(),
                      "results": record}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
