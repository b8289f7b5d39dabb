"""Phase 2 of `edgevlm calibrate` (quantize/exit_confidence.py) and the new calibrate options: the
cascade simulation and threshold choice on hand-made numbers, batched greedy decoding against the
KV-cache path, the worker pool's batches against inline ones, question-conditioned calibration,
the time budget, and one-line CLI errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.quantize import calibrate, calibrate_data  # noqa: E402
from edgevlm.quantize import exit_confidence as ec  # noqa: E402

FAST = ["--steps", "2", "--batch-size", "2", "--agreement-images", "6", "--questions-per-image", "2",
        "--no-frontier", "--threads", "1", "--kd-steps", "0"]


def test_cascade_table_and_recommendation():
    conf = {2: np.array([0.9, 0.9, 0.2, 0.2, 0.6]), 3: np.array([0.0, 0.95, 0.8, 0.1, 0.7])}
    agree = {2: np.array([1.0, 1.0, 0.0, 1.0, 0.0]), 3: np.array([1.0, 1.0, 1.0, 0.0, 1.0])}
    rows = {r["threshold"]: r for r in ec.cascade_table(conf, agree, 6, thresholds=[0.0, 0.5, 0.7, 0.85, 0.99])}
    assert rows[0.0] == {"threshold": 0.0, "exit_rates": {"2": 1.0, "3": 0.0}, "answer_change": 0.4,
                         "blocks_mean": 2.0, "pairs": 5, "changes": 2}
    # t=0.5: pairs 0, 1, 4 exit at 2 (pair 4 changes); pair 2 at 3 (unchanged); pair 3 runs all 6 blocks
    assert rows[0.5] == {"threshold": 0.5, "exit_rates": {"2": 0.6, "3": 0.2}, "answer_change": 0.2,
                         "blocks_mean": pytest.approx((2 + 2 + 3 + 6 + 2) / 5), "pairs": 5, "changes": 1}
    assert rows[0.7]["exit_rates"] == {"2": 0.4, "3": 0.4} and rows[0.7]["answer_change"] == 0.0
    assert rows[0.99]["exit_rates"] == {"2": 0.0, "3": 0.0} and rows[0.99]["blocks_mean"] == 6.0
    table = list(rows.values())
    assert ec.recommend_threshold(table, 0.0, delta=0) == 0.7  # point estimates
    assert ec.recommend_threshold(table, 0.2, delta=0) == 0.5
    assert ec.recommend_threshold(table, 1.0, delta=0) == 0.0
    nothing = [{"threshold": 0.9, "exit_rates": {"2": 0.0}, "answer_change": 0.0, "blocks_mean": 6.0}]
    assert ec.recommend_threshold(nothing, 0.01, delta=0) is None
    # Learn then Test: 5 pairs can never certify a 1% change rate at delta 0.1 ((0.99)^5 > 0.1) ...
    assert ec.recommend_threshold(table, 0.01, delta=0.1) is None
    assert table[-1]["p_value"] == pytest.approx(0.99**5, abs=1e-6)
    # ... but can certify 60% (P(Bin(5, 0.6) <= 0) = 0.4^5 ~ 0.01, <= 1: 0.087, <= 2: 0.317)
    assert ec.recommend_threshold(table, 0.6, delta=0.1) == 0.5
    assert rows[0.0]["p_value"] == pytest.approx(0.31744, abs=1e-5)


def test_binomial_cdf():
    from math import comb

    for n, k, p in [(10, 0, 0.01), (10, 3, 0.2), (50, 7, 0.1), (7, 7, 0.5), (30, 2, 0.0)]:
        want = sum(comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert ec.binomial_cdf(k, n, p) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert ec.binomial_cdf(-1, 5, 0.1) == 0.0 and ec.binomial_cdf(2, 5, 1.0) == 0.0
    # 2000 pairs with 10 changes (0.5%) reject "rate > 1%" clearly
    assert ec.binomial_cdf(10, 2000, 0.01) < 0.1 < ec.binomial_cdf(16, 2000, 0.01)


def test_batched_greedy_matches_kv_cache_path(plain_engine):
    from edgevlm.runtime.preprocess import preprocess

    e = plain_engine
    imgs = [calibrate.calibration_scene(5, i)[0] for i in range(2)]
    px = torch.from_numpy(np.stack([preprocess(im, 64, 16, e.image_mean, e.image_std) for im in imgs]))
    qs = ["describe the scene.", "how many red shapes are there?", "is there a green circle?"]
    with torch.inference_mode():
        feats = e.backend.model.encode_image(px)  # (2, N, D)
        prompts = [e.tokenizer.encode_prompt(q, feats.shape[1]) for q in qs]
        rows = torch.tensor([0, 1, 1])
        batched = ec.batched_greedy(e, prompts, feats[rows], max_new_tokens=6)
        single = [ec.greedy_tokens(e, p, feats[r : r + 1], max_new_tokens=6) for p, r in zip(prompts, rows.tolist(), strict=True)]
        assert batched == single
        assert len({len(p) for p in prompts}) > 1  # right padding was exercised
        assert ec.reproduces_batch(e, prompts, feats[rows], single) == [True, True, True]
        wrong = [a[:-1] + [(a[-1] + 1) % 50] for a in single]
        assert ec.reproduces_batch(e, prompts, feats[rows], [single[0], wrong[1], single[2]]) == [True, False, True]


def test_worker_batches_equal_inline(plain_engine):
    labels = calibrate.demo_labels()
    kw = dict(seed=3, offset=100, steps=3, batch_size=2, rungs=[64, 32], labels=labels, questions=2, total=5)
    inline = list(calibrate_data.BatchStream(plain_engine, workers=0, **kw))
    pooled = list(calibrate_data.BatchStream(plain_engine, workers=2, **kw))
    assert [b["pixels"].shape for b in inline] == [(2, 3, 48, 64), (2, 3, 32, 32), (1, 3, 48, 64)]
    for a, b in zip(inline, pooled, strict=True):
        np.testing.assert_array_equal(a["pixels"], b["pixels"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
        assert a["qas"] == b["qas"]
    _, scene, rng = calibrate.calibration_scene(3, 102)
    np.testing.assert_array_equal(inline[1]["labels"][0], calibrate.scene_labels(scene, labels))
    from edgevlm.runtime.demo import scenes

    assert inline[1]["qas"][0] == [(q.question, q.answer, q.kind) for q in scenes.sample_questions(scene, rng, 2)]


def test_question_conditioned_calibration(tmp_path, plain_model_dir):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.exits import read_spec
    from edgevlm.types import OperatingPoint

    out = tmp_path / "q"
    assert calibrate.main([str(plain_model_dir), *FAST, "--question-conditioned", "--kd-steps", "1",
                           "--adapter-attn-dim", "16", "--max-answer-change", "0.5", "--out", str(out)]) == 0
    spec = read_spec(out)
    assert spec.confidence_query_dim > 0 and spec.max_answer_change == 0.5
    assert spec.calibration["agreement_pairs"] == 12 and spec.calibration["kd_steps"] == 1
    assert [r.threshold for r in spec.cascade] == ec.CASCADE_THRESHOLDS
    assert spec.cascade[0].exit_rates == {"1": 1.0, "2": 0.0}  # threshold 0: everything exits at the first point
    assert spec.recommended_threshold is None or 0.0 <= spec.recommended_threshold < 1.0
    assert set(spec.exit_metrics["1"].agreement_by_kind) <= set(__import__(
        "edgevlm.runtime.demo.scenes", fromlist=["KINDS"]).KINDS)
    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    for f in out.iterdir():
        shutil.copy(f, d)
    a = Engine.load(d).ask(np.zeros((48, 64, 3), np.uint8), "describe the scene.", max_new_tokens=2,
                           operating_point=OperatingPoint(exit_threshold=0.0))
    assert a.stats.exit_layer == 1 and a.stats.exit_confidence is not None


def test_time_budget_stops_phases_early(tmp_path, plain_model_dir):
    from edgevlm.runtime.exits import read_spec

    out = tmp_path / "t"
    assert calibrate.main([str(plain_model_dir), "--steps", "500", "--batch-size", "2", "--kd-steps", "500",
                           "--agreement-images", "400", "--questions-per-image", "1", "--no-frontier",
                           "--threads", "1", "--time-budget-s", "0.5", "--out", str(out)]) == 0
    cal = read_spec(out).calibration
    assert cal["steps"] < 500 and cal["kd_steps"] < 500 and 1 <= cal["agreement_images"] < 400
    assert cal["time_budget_s"] == 0.5


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-answer-change", "2"], "--max-answer-change"),
        (["--workers", "-1"], "--workers"),
        (["--time-budget-s", "0"], "--time-budget-s"),
        (["--lr", "0"], "--lr"),
        (["--rungs", "8"], "rungs"),
        (["--risk-delta", "1"], "--risk-delta"),
        (["--steps", "0"], "--steps"),
        (["--init", "/nonexistent/heads", "--steps", "0"], "not found"),
        (["--keep-adapters"], "--keep-adapters needs --init"),
        (["--init", "/nonexistent/heads", "--exit-blocks", "1", "3"], "--exit-blocks: the heads' architecture comes"),
        (["--init", "/nonexistent/heads", "--adapter-hidden", "8", "--question-conditioned"],
         "--adapter-hidden, --question-conditioned: the heads' architecture comes from --init"),
        (["--init", "/nonexistent/heads", "--keep-adapters", "--kd-steps", "3"], "leave out --kd-steps"),
    ]
    + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "CUDA is not available")]),
)
def test_new_cli_errors_are_one_line(plain_model_dir, capsys, args, needle):
    try:  # checked in main(), or by the argument parser (which exits)
        code = calibrate.main([str(plain_model_dir), *FAST, *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgevlm: error:") and needle in err[-1]


def test_gpu_script_dry_run_recipe():
    """bench/calibrate_gpu.py's recipe parses with calibrate's own parser (what the lead runs)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "calibrate_gpu.py"
    spec = importlib.util.spec_from_file_location("calibrate_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = calibrate.build_parser().parse_args(["m", *mod.RECIPE, *mod.TINY])
    assert args.question_conditioned and args.exit_blocks == [2, 3] and args.adapter_attn_dim == 128
    assert args.time_budget_s == 300 and args.dtype == "float32" and args.no_frontier


def test_init_refits_confidence_only(tmp_path, plain_model_dir):
    """--init with --steps 0 --kd-steps 0 keeps the adapters bit for bit and refits the confidence."""
    from safetensors.torch import load_file

    from edgevlm.runtime.exits import read_spec

    first, second = tmp_path / "a", tmp_path / "b"
    assert calibrate.main([str(plain_model_dir), *FAST, "--question-conditioned", "--out", str(first)]) == 0
    assert calibrate.main([str(plain_model_dir), *FAST, "--init", str(first), "--steps", "0",
                           "--agreement-images", "8", "--seed", "1", "--out", str(second)]) == 0
    a, b = load_file(str(first / "exits.safetensors")), load_file(str(second / "exits.safetensors"))
    assert set(a) == set(b)
    for k in a:
        if k.startswith("adapters.") or k.startswith("classifiers."):
            assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("confidence."))
    spec = read_spec(second)
    assert spec.confidence_query_dim > 0 and spec.calibration["steps"] == 0
    assert spec.calibration["init"] == str(first) and spec.calibration["init_calibration"]["steps"] == 2
    assert spec.calibration["agreement_images"] == 8 and spec.risk_delta == 0.1


def test_init_refuses_heads_of_other_weights(tmp_path, plain_model_dir, capsys):
    import json

    first = tmp_path / "a"
    assert calibrate.main([str(plain_model_dir), *FAST, "--out", str(first)]) == 0
    raw = json.loads((first / "exits.json").read_text())
    raw["weights_fingerprint"] = "0" * 64
    (first / "exits.json").write_text(json.dumps(raw))
    assert calibrate.main([str(plain_model_dir), *FAST, "--init", str(first), "--steps", "0"]) == 2
    assert "other weights" in capsys.readouterr().err.strip().splitlines()[-1]


def test_keep_adapters_trains_only_classifiers_and_confidence(tmp_path, plain_model_dir):
    """--init --keep-adapters (adapters trained with the model): adapters bit for bit, classifiers
    and confidence refitted, the record says so; no answer distillation runs by default."""
    from safetensors.torch import load_file

    from edgevlm.runtime.exits import read_spec

    first, second = tmp_path / "a", tmp_path / "b"
    assert calibrate.main([str(plain_model_dir), *FAST, "--question-conditioned", "--out", str(first)]) == 0
    fast = [a for a in FAST if a not in ("--kd-steps", "0")]
    assert calibrate.main([str(plain_model_dir), *fast, "--init", str(first), "--keep-adapters",
                           "--seed", "1", "--out", str(second)]) == 0
    a, b = load_file(str(first / "exits.safetensors")), load_file(str(second / "exits.safetensors"))
    assert set(a) == set(b)
    for k in a:
        if k.startswith("adapters."):
            assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("classifiers."))
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("confidence."))
    rec = read_spec(second).calibration
    assert rec["kd_steps"] == 0 and rec["steps"] == 2 and rec["adapters"].startswith("kept from init")


def test_init_that_is_a_file_is_refused_in_one_line(plain_model_dir, capsys):
    code = calibrate.main([str(plain_model_dir), *FAST, "--init", str(plain_model_dir / "config.json"), "--steps", "0"])
    assert code == 2
    assert "not a folder" in capsys.readouterr().err.strip().splitlines()[-1]


def test_keep_adapters_accepts_heads_of_other_weights_and_refits(tmp_path, plain_model_dir, capsys):
    """Heads fingerprinted to other weights (e.g. the 16-bit model behind an INT4 bundle): refused
    without --keep-adapters, kept with it (adapters bit for bit, a note on stderr, new fingerprint)."""
    import json

    from safetensors.torch import load_file

    from edgevlm.runtime.exits import read_spec, weights_fingerprint

    first, second = tmp_path / "a", tmp_path / "b"
    assert calibrate.main([str(plain_model_dir), *FAST, "--out", str(first)]) == 0
    raw = json.loads((first / "exits.json").read_text())
    raw["weights_fingerprint"] = "0" * 64
    (first / "exits.json").write_text(json.dumps(raw))
    fast = [a for a in FAST if a not in ("--kd-steps", "0")]
    assert calibrate.main([str(plain_model_dir), *fast, "--init", str(first), "--keep-adapters",
                           "--out", str(second)]) == 0
    err = capsys.readouterr().err
    assert "made for other weights" in err and "keeping its adapters" in err
    a, b = load_file(str(first / "exits.safetensors")), load_file(str(second / "exits.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("adapters."))
    assert read_spec(second).weights_fingerprint == weights_fingerprint(plain_model_dir)
