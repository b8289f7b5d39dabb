"""The shipped demo model as an INT4 bundle: built by the CLI, same answers on the torch and onnx
backends at every rung of its ladder (skipped when the demo weights are not there)."""

from __future__ import annotations

import pytest

from edgevlm.runtime.demo import model_dir

pytestmark = pytest.mark.skipif(not (model_dir() / "model.safetensors").is_file(), reason="no demo weights")


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from edgevlm.quantize.cli import main

    out = tmp_path_factory.mktemp("demo") / "bundle"
    assert main([str(model_dir()), "--out", str(out), "--method", "rtn"]) == 0
    return out


def test_demo_bundle_answers_agree_across_backends(demo_bundle):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.bundle import read_manifest
    from edgevlm.runtime.demo import scenes
    from edgevlm.runtime.int4 import set_int4_kernel
    from edgevlm.types import OperatingPoint

    m = read_manifest(demo_bundle)
    assert m.resolution_ladder == [384, 256, 192, 128]
    assert m.stats["decoder_linear_int4_bytes"] / m.stats["decoder_linear_16bit_bytes"] < 0.30
    torch_engine = Engine.load(demo_bundle)
    set_int4_kernel(torch_engine.backend.model, "dequant")  # float32 throughout, like the ONNX graphs
    onnx_engine = Engine.load(demo_bundle, backend="onnx")
    items = scenes.eval_set(3, seed=1000)
    for rung in (384, 128):  # top and bottom rung (every rung: test_onnx.py on a tiny model)
        op = OperatingPoint(resolution_px=rung)
        for it in items:
            a = torch_engine.ask(it.image, it.qa.question, max_new_tokens=16, operating_point=op)
            b = onnx_engine.ask(it.image, it.qa.question, max_new_tokens=16, operating_point=op)
            assert a.text == b.text, (rung, it.qa.question)
            assert a.stats.vision_tokens == b.stats.vision_tokens


def test_demo_bundle_readme_and_onnx_check(demo_bundle):
    """issue 11: the demo model's README (float16 weights) is not copied; the bundle's own says INT4;
    the ONNX graphs were checked against PyTorch at three sizes (native 384 px, non-square, off-native)."""
    from edgevlm.runtime.bundle import read_manifest

    readme = (demo_bundle / "README.md").read_text()
    assert readme.startswith("# INT4 engine bundle of model") and "W4A16" in readme and "RTN" in readme
    assert (model_dir() / "README.md").read_text() != readme
    check = read_manifest(demo_bundle).onnx_check
    assert [(v.height_px, v.width_px) for v in check.vision] == [(384, 384), (224, 384), (368, 368)]
    worst = max([v.max_error for v in check.vision] + [check.decoder.prefill_max_error, check.decoder.decode_max_error])
    assert worst < 1e-4
