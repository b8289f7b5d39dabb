"""Knobs a backend cannot run are refused with a clear error: the onnxruntime backend of an INT4
bundle (no early exit, no token pruning) — with exit heads present in the bundle."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edgevlm.errors import InvalidRequestError
from edgevlm.types import OperatingPoint

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def onnx_engine(tmp_path_factory, exit_model_dir):
    from edgevlm.quantize.build import BuildOptions, build_bundle
    from edgevlm.runtime import Engine

    bundle = tmp_path_factory.mktemp("onnx") / "bundle"
    build_bundle(exit_model_dir, bundle, BuildOptions(method="rtn", onnx=True, calib=None))
    from edgevlm.quantize.calibrate import _add_to_manifest

    for name in ("exits.json", "exits.safetensors"):
        shutil.copy(exit_model_dir / name, bundle / name)
    _add_to_manifest(bundle, ["exits.json", "exits.safetensors"])  # a file the manifest does not list is refused
    return Engine.load(bundle, backend="onnx")


@pytest.mark.parametrize(
    ("op", "needle"),
    [
        (OperatingPoint(keep_ratio=0.5), "backend 'onnx' does not support token pruning"),
        (OperatingPoint(exit_threshold=0.5), "backend 'onnx' does not support early exit"),
        (OperatingPoint(exit_layer=1), "backend 'onnx' does not support early exit"),
    ],
)
def test_unsupported_knobs(onnx_engine, op, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        onnx_engine.ask(np.zeros((48, 64, 3), np.uint8), "what color ?", operating_point=op)


def test_supported_knobs_still_run(onnx_engine):
    img = np.zeros((48, 64, 3), np.uint8)
    a = onnx_engine.ask(img, "what color ?", max_new_tokens=2,
                        operating_point=OperatingPoint(keep_ratio=1.0, exit_layer=4, resolution_px=32))
    b = onnx_engine.ask(img, "what color ?", max_new_tokens=2, operating_point=OperatingPoint(resolution_px=32))
    assert a.text == b.text and a.stats.vision_tokens == b.stats.vision_tokens and a.stats.exit_layer is None
    with pytest.raises(InvalidRequestError, match="no exit classifier"):
        onnx_engine.classify(np.zeros((48, 64, 3), np.uint8))
