"""CUDA graphs of the Qwen3-VL and Qwen2.5-VL vision towers (runtime/vision_graphs.py): the replay equals the eager tower
at two geometries, outputs are fresh tensors (a later frame does not overwrite them), and the tower's
forward with a CPU grid is the same function as with a device grid. CUDA parts skip without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_families.py"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tiny(name: str, device: str):
    spec = importlib.util.spec_from_file_location("gpu_families", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ours, _, files = bench.build(name, torch.device(device), dtype, max_seq_len=256)
    return bench, ours, files


def test_vision_graphs_refuse_a_cpu_device():
    from edgevlm.runtime.vision_graphs import VisionGraphs

    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        VisionGraphs(lambda px, grid: px, torch.device("cpu"))


def test_tower_forward_same_with_cpu_and_device_grid():
    bench, ours, files = _tiny("tiny-qwen3-vl", "cpu")
    _, vision = bench.make_request(files, (96, 64))
    px = vision.pixel_values
    with torch.inference_mode():
        a, da = ours.visual(px, vision.grid_thw)
        b, db = ours.visual(px, vision.grid_thw.to(px.device))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(da) == len(db) == 2
    with pytest.raises(ValueError, match="do not match grid_thw"):
        ours.visual(px[:-4], vision.grid_thw)


@cuda
@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def test_graph_replay_equals_the_eager_tower(name):
    bench, ours, files = _tiny(name, "cuda")
    assert ours.enable_vision_graphs()
    reqs = [bench.make_request(files, size, seed=i)[1] for i, size in enumerate([(96, 64), (64, 64), (96, 64)])]

    def side():  # Qwen3-VL's DeepStack features of the last encode
        return [d.clone() for d in getattr(ours, "_deepstack", [])]

    with torch.inference_mode():
        outs = [(ours.encode_vision(vision), side()) for vision in reqs]
        assert len(ours.vision_graphs) == 2  # the third frame replays the first geometry
        graphs, ours.vision_graphs = ours.vision_graphs, None
        for (main, deep), vision in zip(outs, reqs, strict=True):  # earlier outputs were not overwritten
            ref = ours.encode_vision(vision)
            torch.testing.assert_close(main, ref)  # same kernels; bf16 tolerance in case an algorithm differs
            for d, r in zip(deep, side(), strict=True):
                torch.testing.assert_close(d, r)
    assert graphs.capture_ms and all(v > 0 for v in graphs.capture_ms.values())
