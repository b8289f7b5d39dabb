"""Early exit and token pruning on a tower without a CLS token (LLaVA with a SigLIP tower).

The pooled exit heads read ``LN(mean of the patch tokens)`` in the CLS slot (``has_cls_token: false``
in ``exits.json``) and pruning scores tokens by their feature norm, so ``edgevlm calibrate`` and
``edgevlm ask --exit-layer/--exit-threshold/--keep-ratio`` run on a tiny transformers-built
LLaVA-SigLIP checkpoint."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from edgevlm.quantize import calibrate  # noqa: E402
from edgevlm.runtime.exits import PooledHead  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

FAST = ["--steps", "3", "--batch-size", "2", "--agreement-images", "5", "--questions-per-image", "1",
        "--no-frontier", "--threads", "1", "--kd-steps", "0"]


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location(
        "_siglip_exits_llava", Path(__file__).parents[1] / "models" / "test_llava.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("llava_siglip")
    module.build_llava(out, "siglip", transformers.MistralConfig, {}, image_size=64, patch_size=8)
    return out


def test_pooled_head_without_cls_reads_the_patch_mean():
    torch.manual_seed(0)
    with_cls = PooledHead(16, 8, 3, 4, 1e-6, has_cls=True)
    without = PooledHead(16, 8, 3, 4, 1e-6, has_cls=False)
    without.load_state_dict(with_cls.state_dict())
    x = torch.randn(2, 12, 16)  # (B, 3*4 patches, D), no CLS
    pooled = without.pool(x, (3, 4))
    want = with_cls.pool(torch.cat([x.mean(dim=1, keepdim=True), x], dim=1), (3, 4))
    torch.testing.assert_close(pooled, want)
    assert pooled.shape == (2, 7 * 16 + 1)
    with pytest.raises(ValueError, match="12 patch tokens do not form a 3x3 grid"):
        without.pool(x, (3, 3))


def test_calibrate_and_ask_on_a_siglip_tower(siglip_dir, tmp_path, capsys):
    from edgevlm.runtime.engine import Engine

    model = tmp_path / "model"
    shutil.copytree(siglip_dir, model)
    assert calibrate.main([str(model), *FAST]) == 0
    spec = json.loads((model / "exits.json").read_text())
    assert spec["has_cls_token"] is False and spec["exit_blocks"] == [1]

    engine = Engine.load(model)
    assert engine.exit_points == [1]
    image = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    full = engine.ask(image, "what is it", max_new_tokens=3)
    early = engine.ask(image, "what is it", max_new_tokens=3,
                       operating_point=OperatingPoint(name="exit1", exit_layer=1))
    assert early.stats.exit_layer == 1 and early.text
    assert full.stats.vision_tokens == early.stats.vision_tokens == 64  # 8x8 patches, no CLS
    gated = engine.ask(image, "what is it", max_new_tokens=3,
                       operating_point=OperatingPoint(name="gate", exit_threshold=0.0))
    assert gated.stats.exit_layer == 1 and gated.stats.exit_confidence is not None  # threshold 0: first exit
    pruned = engine.ask(image, "what is it", max_new_tokens=3,
                        operating_point=OperatingPoint(name="half", exit_layer=1, keep_ratio=0.5))
    assert pruned.stats.vision_tokens == 32 and pruned.stats.exit_layer == 1
