"""``edgevlm quantize`` options that did nothing or gave a wrong hint (found by trying the CLI on a
Gemma 3 checkpoint): ``--lm-head int4`` on a checkpoint whose head is tied to the embeddings was a
silent no-op (the bundle's summary and manifest said nothing); a non-LLaVA family's manifest told
the user to quantize the vision encoder "with --vision int4", which that family refuses.

Run: ``.venv/bin/python -m pytest -q tests/quantize/test_quantize_options.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from edgevlm.errors import ConfigError  # noqa: E402
from edgevlm.quantize.build import BuildOptions, build_bundle  # noqa: E402


def test_lm_head_int4_on_tied_embeddings_is_refused(tmp_path, capsys):
    from edgevlm.cli import main
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", seed=1, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"--lm-head int4: this checkpoint has no lm_head of its own"):
        build_bundle(src, tmp_path / "b", BuildOptions(method="rtn", onnx=False, lm_head=True))
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
    assert main(["quantize", str(src), "--out", str(tmp_path / "c"), "--method", "rtn", "--lm-head", "int4",
                 "--no-onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["edgevlm: error: --lm-head int4: this checkpoint has no lm_head of its own (tie_word_embeddings: "
                   "the head is the embedding matrix, which stays 16-bit); use --lm-head fp16"], err
    # an untied head is still quantized
    untied = write_tiny_checkpoint(tmp_path / "untied", seed=1)
    res = build_bundle(untied, tmp_path / "d", BuildOptions(method="rtn", onnx=False, lm_head=True))
    assert next(d for d in res.manifest.layers if d.name == "language_model.lm_head").action == "int4"


def test_non_llava_vision_reason_does_not_offer_vision_int4(tmp_path):
    from family_support import write_checkpoint

    src = write_checkpoint("gemma3", tmp_path / "gemma3")  # its tower is `vision_tower.*`, as LLaVA's
    res = build_bundle(src, tmp_path / "b", BuildOptions(method="rtn", onnx=False))
    vision = [d for d in res.manifest.layers if d.name.startswith("vision_tower.") and d.action == "keep"]
    assert vision and all(d.reason == "vision encoder stays 16-bit (this family's tower is not quantized)" for d in vision), vision[:2]
    assert not [d for d in res.manifest.layers if "--vision int4" in d.reason]
    assert "--vision int4" not in (res.bundle_dir / "README.md").read_text()


def test_int4_vision_is_a_family_capability():
    """Only LLaVA's registry entry quantizes its tower; the plan's hint follows the flag, not a name."""
    from edgevlm.quantize.plan import LinearInfo, plan_layers
    from edgevlm.runtime.models import FAMILIES, get_family

    assert [name for name in FAMILIES if get_family(name).int4_vision] == ["llava"]
    tower = [LinearInfo(name="vision_tower.encoder.layers.0.mlp.fc1", source_key="k", in_features=256,
                        out_features=512)]
    (kept,) = plan_layers(tower, group_size=128, method="rtn", int4_vision=False)
    assert kept.action == "keep" and "--vision int4" not in kept.reason
    (offered,) = plan_layers(tower, group_size=128, method="rtn")
    assert offered.action == "keep" and offered.reason.endswith("(quantize it with --vision int4)")
    (quantized,) = plan_layers(tower, group_size=128, method="rtn", vision="int4")
    assert quantized.action == "int4"


def test_a_ladder_rung_below_the_patch_size_is_refused_before_building(tmp_path, capsys):
    """A rung below the vision patch size (config.json's ``edgevlm.resolution_ladder``, a profile's
    ``resolution_ladder_px`` or ``BuildOptions.resolution_ladder``) was accepted: the bundle claimed a
    ladder of "8, 2, 1 px" whose small rungs all ran as one 16 px patch (rungs are rounded to the
    patch), while ``edgevlm ask --resolution 1`` on it was refused as below the patch size. Now
    quantize refuses it before building (no --out folder), and a checkpoint or bundle declaring
    one does not load (ask, serve --check-config: one line, exit 2)."""
    import json

    import cv2
    import numpy as np

    from edgevlm.cli import main
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", seed=1, resolution_ladder=[64, 2, 1])  # patch 16
    img = tmp_path / "cam.png"
    cv2.imwrite(str(img), np.full((40, 48, 3), 90, np.uint8))
    rule = "a rung is at least one patch"
    for argv in (["quantize", str(src), "--out", str(tmp_path / "b"), "--method", "rtn", "--no-onnx"],
                 ["ask", "--image", str(img), "--model", str(src), "hi"]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines() == [
            "edgevlm: error: config.json: edgevlm.resolution_ladder rung(s) 1, 2 px are below the vision patch "
            f"size (16 px): {rule}"], argv
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()

    ok = write_tiny_checkpoint(tmp_path / "ok", seed=1, resolution_ladder=[64, 32])
    profile = {  # a user's own profile file (YAML is a superset of JSON)
        "name": "mine", "description": "x", "device_class": "cpu", "device": "cpu", "dtype": "float32",
        "backends": ["torch"], "memory_mb": 1024, "memory_bandwidth_gbps": 10, "resolution_ladder_px": [64, 8],
        "default_budget_ms": 1000}
    (tmp_path / "mine.yaml").write_text(json.dumps(profile))
    assert main(["quantize", str(ok), "--out", str(tmp_path / "c"), "--method", "rtn", "--no-onnx",
                 "--profile", str(tmp_path / "mine.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"edgevlm: error: --profile {tmp_path / 'mine.yaml'}: resolution_ladder_px: rung(s) 8 px are below the "
        f"model's vision patch size (16 px): {rule}"]
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()
    with pytest.raises(ConfigError, match=r"^resolution_ladder: rung\(s\) 0, 4 px are below"):
        build_bundle(ok, tmp_path / "d", BuildOptions(method="rtn", onnx=False, resolution_ladder=[64, 4, 0]))
    assert not (tmp_path / "d").exists()
    # the rungs at or above the patch still build and load
    res = build_bundle(ok, tmp_path / "e", BuildOptions(method="rtn", onnx=False, resolution_ladder=[16, 64]))
    assert res.manifest.resolution_ladder == [64, 16]
    assert main(["ask", "--image", str(img), "--model", str(res.bundle_dir), "--max-new-tokens", "1", "hi"]) == 0
