"""Knobs a backend cannot run are refused with a clear error: the onnxruntime backend of an INT4
bundle (no early exit, no token pruning) — with exit heads present in the bundle, through the
Engine and through `edgevlm ask`."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from edgevlm.errors import InvalidRequestError
from edgevlm.types import OperatingPoint

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory, exit_model_dir):
    """An RTN bundle with ONNX graphs and valid exit heads (listed in its manifest)."""
    from edgevlm.quantize.build import BuildOptions, build_bundle

    bundle = tmp_path_factory.mktemp("onnx") / "bundle"
    build_bundle(exit_model_dir, bundle, BuildOptions(method="rtn", onnx=True, calib=None))
    from edgevlm.atomic_files import AtomicFiles
    from edgevlm.quantize.calibrate import add_to_manifest

    for name in ("exits.json", "exits.safetensors"):
        shutil.copy(exit_model_dir / name, bundle / name)
    with AtomicFiles() as group:  # a file the manifest does not list is refused
        add_to_manifest(bundle, ["exits.json", "exits.safetensors"], group)
    return bundle


@pytest.fixture(scope="module")
def onnx_engine(onnx_bundle):
    from edgevlm.runtime import Engine

    return Engine.load(onnx_bundle, backend="onnx")


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


@pytest.mark.parametrize("flag", [["--exit-layer", "2"], ["--exit-threshold", "0.5"]])
def test_ask_exit_flags_on_the_onnx_backend_name_the_backend(onnx_bundle, tmp_path, flag):
    """`edgevlm ask --backend onnx --exit-layer/--exit-threshold` on a bundle whose exit heads are
    valid (the torch backend exits with them) names the backend; it said the heads "were
    calibrated for other weights" ("rerun `edgevlm calibrate`"), which rerunning never fixed."""
    import cv2

    img = tmp_path / "cam.png"
    cv2.imwrite(str(img), np.full((48, 64, 3), 120, np.uint8))
    ask = [sys.executable, "-m", "edgevlm.cli", "ask", "--image", str(img), "--model", str(onnx_bundle),
           "--max-new-tokens", "2", *flag, "what color ?"]
    res = subprocess.run([*ask[:6], "--backend", "onnx", *ask[6:]], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and res.stdout == "" and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.splitlines() == [f"edgevlm: error: {flag[0]}: backend 'onnx' does not support early exit "
                                       "(the torch backend does)"]
    torch_res = subprocess.run(ask, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert torch_res.returncode == 0, torch_res.stderr  # the same heads serve the torch backend
