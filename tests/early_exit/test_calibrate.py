"""`edgevlm calibrate` on real tiny checkpoints and an INT4 bundle (few steps): files written and
loadable, metrics recorded, bundle manifest updated; labels, agreement check, threshold table, CLI
errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.quantize import calibrate  # noqa: E402
from edgevlm.runtime.demo import scenes  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

FAST = ["--steps", "3", "--batch-size", "2", "--agreement-images", "5", "--questions-per-image", "1",
        "--no-frontier", "--threads", "1", "--kd-steps", "0"]


def test_default_exit_blocks():
    assert calibrate.default_exit_blocks(6) == [2, 3]
    assert calibrate.default_exit_blocks(12) == [4, 6]
    assert calibrate.default_exit_blocks(8) == [3, 4]
    assert calibrate.default_exit_blocks(2) == [1]
    assert calibrate.default_exit_blocks(1) == []


def test_scene_labels_follow_the_scene():
    labels = calibrate.demo_labels()
    assert len(labels) == len(set(labels)) == 39
    for i in range(20):
        _, scene, _ = calibrate.calibration_scene(7, i)
        y = dict(zip(labels, calibrate.scene_labels(scene, labels), strict=True))
        for o in scene.objects:
            assert y[o.colour] == y[o.shape] == y[f"{o.colour} {o.shape}"] == y[o.size] == 1.0
            lr = "left" if o.cx_px < scene.width_px / 2 else "right"
            assert y[lr] == 1.0 and (y[f"large {lr}"] == 1.0 or o.size == "small")
        colours = {o.colour for o in scene.objects}
        assert all(y[c] == (c in colours) for c in scenes.COLOUR_NAMES)
        assert sum(y[f"{c} {s}"] for c in scenes.COLOUR_NAMES for s in scenes.SHAPES) == len(
            {(o.colour, o.shape) for o in scene.objects})


def test_threshold_table():
    rows = {r["threshold"]: r for r in calibrate.threshold_table(np.array([0.9, 0.2, 0.6]), np.array([1.0, 0.0, 0.5]))}
    assert rows[0.0] == {"threshold": 0.0, "exit_rate": 1.0, "agreement": pytest.approx(0.5)}
    assert rows[0.5]["exit_rate"] == pytest.approx(2 / 3) and rows[0.5]["agreement"] == pytest.approx(2.5 / 3)
    assert rows[0.95] == {"threshold": 0.95, "exit_rate": 0.0, "agreement": 1.0}


def test_greedy_answer_reproduces_itself(plain_engine):
    from edgevlm.runtime.preprocess import preprocess

    image, scene, rng = calibrate.calibration_scene(0, 0)
    px = torch.from_numpy(preprocess(image, 64, 16, plain_engine.image_mean, plain_engine.image_std))[None]
    with torch.inference_mode():
        feats = plain_engine.backend.model.encode_image(px)
        ids = plain_engine.tokenizer.encode_prompt("how many shapes are there?", feats.shape[1])
        answer = calibrate.greedy_tokens(plain_engine, ids, feats, max_new_tokens=6)
        assert calibrate.reproduces(plain_engine, ids, feats, answer)
        assert not calibrate.reproduces(plain_engine, ids, feats, answer[:-1] + [(answer[-1] + 1) % 50])
    text = plain_engine.ask(image, "how many shapes are there?", max_new_tokens=6,
                            operating_point=OperatingPoint(resolution_px=64)).text
    assert plain_engine.tokenizer.decode(answer).strip() == text


def test_calibrate_model_folder(tmp_path, plain_model_dir, capsys):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.exits import read_spec

    out = tmp_path / "heads"
    assert calibrate.main([str(plain_model_dir), *FAST, "--out", str(out)]) == 0
    spec = read_spec(out)
    assert spec.exit_blocks == [1, 2] and spec.classifier_blocks == [1, 2, 4] and len(spec.labels) == 39
    assert set(spec.exit_metrics) == {"1", "2"}
    for m in spec.exit_metrics.values():
        assert len(m.thresholds) == 21 and -1 <= m.feature_cosine <= 1 and 0 <= m.forced_agreement <= 1
    assert spec.calibration["steps"] == 3 and spec.calibration["agreement_images"] == 5
    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    for f in out.iterdir():
        shutil.copy(f, d)
    engine = Engine.load(d)
    assert engine.exit_points == [1, 2] and len(engine.labels) == 39
    a = engine.ask(np.zeros((48, 64, 3), np.uint8), "describe the scene.", max_new_tokens=2,
                   operating_point=OperatingPoint(exit_threshold=0.0))
    assert a.stats.exit_layer == 1
    assert "wrote" in capsys.readouterr().err


def test_calibrate_bundle_updates_manifest(tmp_path, plain_model_dir):
    from edgevlm.quantize.build import BuildOptions, build_bundle
    from edgevlm.runtime.bundle import read_manifest, verify_bundle

    bundle = tmp_path / "bundle"
    build_bundle(plain_model_dir, bundle, BuildOptions(method="rtn", onnx=False, calib=None))
    assert calibrate.main([str(bundle), *FAST, "--exit-blocks", "2"]) == 0
    names = {e.path for e in read_manifest(bundle).files}
    assert {"exits.safetensors", "exits.json"} <= names
    verify_bundle(bundle)  # hashes match
    from edgevlm.runtime import Engine

    assert Engine.load(bundle).exit_points == [2]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["/nonexistent/model"], "does not exist"),
        (["{model}", "--steps", "0"], "--steps"),
        (["{model}", "--exit-blocks", "4"], "exit blocks"),
        (["{model}", "--agreement-images", "2"], "--agreement-images"),
    ],
)
def test_cli_errors_are_one_line(plain_model_dir, capsys, args, needle):
    argv = [a.replace("{model}", str(plain_model_dir)) for a in args] + ["--no-frontier"]
    assert calibrate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or err[-1].startswith("edgevlm: error:")
    assert err[-1].startswith("edgevlm: error:") and needle in err[-1]


def test_written_json_is_valid(tmp_path, plain_model_dir):
    out = tmp_path / "o"
    assert calibrate.main([str(plain_model_dir), *FAST, "--out", str(out), "--exit-blocks", "1", "3"]) == 0
    raw = json.loads((out / "exits.json").read_text())
    assert raw["format"] == "edgevlm-exits" and raw["exit_blocks"] == [1, 3]


def test_decoder_logits_match_prefill(plain_engine):
    model = plain_engine.backend.model
    emb = torch.randn(1, 20, model.cfg.text.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model.prefill(emb, all_logits=True)
        got = calibrate.decoder_logits(model.language_model, emb)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_answer_distillation_runs(tmp_path, plain_model_dir):
    from edgevlm.runtime.exits import read_spec

    out = tmp_path / "kd"
    assert calibrate.main([str(plain_model_dir), *FAST, "--kd-steps", "2", "--out", str(out),
                           "--adapter-attn-dim", "16", "--adapter-blocks", "1"]) == 0
    spec = read_spec(out)
    assert spec.calibration["kd_steps"] == 2 and spec.adapter_attn_dim == 16 and spec.adapter_blocks == 1
    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    for f in out.iterdir():
        shutil.copy(f, d)
    from edgevlm.runtime import Engine

    a = Engine.load(d).ask(np.zeros((48, 64, 3), np.uint8), "describe the scene.", max_new_tokens=2,
                           operating_point=OperatingPoint(exit_layer=1))
    assert a.stats.exit_layer == 1


def test_calibrate_out_folder_runs_the_frontier_with_the_new_heads(tmp_path, plain_model_dir, caplog):
    """--out elsewhere than the model: the heads just written are checked against the model's weights
    (not the output folder's, which has none) and the frontier measures exit points with them."""
    import json
    import logging

    out = tmp_path / "heads"
    argv = [str(plain_model_dir), *[a for a in FAST if a != "--no-frontier"], "--frontier-n", "2", "--out", str(out)]
    with caplog.at_level(logging.ERROR):
        assert calibrate.main(argv) == 0
    assert not [r for r in caplog.records if "other weights" in r.getMessage()]
    frontier = json.loads((out / "frontier.json").read_text())
    assert any(p.get("exit_threshold") is not None and p.get("exit_rate") is not None for p in frontier["points"])



@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kd-steps", "-3"], "--kd-steps: expected an integer >= 0, got -3"),
        (["--threads", "0"], "--threads: expected a positive integer, got 0"),
        (["--frontier-n", "0"], "--frontier-n: expected a positive integer, got 0"),
        (["--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
        (["--steps", "abc"], "--steps: expected an integer >= 0, got 'abc'"),
        (["--nosuch"], "unrecognized arguments: --nosuch"),
    ],
)
def test_bad_option_values_are_refused_before_any_work_in_one_line(plain_model_dir, capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        calibrate.main([str(plain_model_dir), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgevlm: error:") and needle in err[0]
