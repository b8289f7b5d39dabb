"""Operating-point frontier: Pareto selection, token caps, frontier.json round trip into the
controller, the PNG plot, the profile schema additions, CLI errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgevlm.errors import ConfigError
from edgevlm.profile import FrontierPoint, load_frontier, load_profile

torch = pytest.importorskip("torch")

from edgevlm.quantize import frontier  # noqa: E402


def P(name, acc, e2e, **kw):
    return FrontierPoint(name=name, accuracy=acc, vision_ms=e2e / 2, prefill_ms=e2e / 4, tpot_ms=1.0, e2e_ms=e2e, **kw)


def test_pareto_keeps_non_dominated():
    pts = [P("a", 0.95, 100), P("b", 0.90, 60), P("c", 0.90, 80), P("d", 0.97, 150), P("e", 0.5, 20),
           P("f", 0.96, 300), P("g", 0.5, 20)]
    assert [p.name for p in frontier.pareto(pts)] == ["e", "b", "a", "d"]


def test_frontier_keeps_the_full_depth_points_own_frontier():
    """An exit point as accurate as the full-depth one and cheaper dominates it; the stored frontier
    still carries the full-depth point (for a model/backend without exit heads), and the controller
    picks the cheaper of the two equally accurate points."""
    from edgevlm.runtime.policy import Controller

    pts = [P("r384", 0.98, 130), P("r384-x0.95", 0.98, 90, exit_threshold=0.95), P("r256", 0.97, 55),
           P("r256-x0.95", 0.96, 40, exit_threshold=0.95), P("r128", 0.90, 25), P("r192", 0.89, 30)]
    assert [p.name for p in frontier.pareto(pts)] == ["r128", "r256-x0.95", "r256", "r384-x0.95"]
    assert [p.name for p in frontier.frontier_points(pts)] == ["r128", "r256-x0.95", "r256", "r384-x0.95", "r384"]
    full_depth = [p for p in frontier.frontier_points(pts) if p.exit_threshold is None]
    assert [p.name for p in full_depth] == ["r128", "r256", "r384"]
    chosen = Controller(frontier.point_profiles(frontier.frontier_points(pts))).choose(1e9, max_new_tokens=4)
    assert chosen.point.name == "r384-x0.95"


def test_frontier_keeps_the_plain_points_own_frontier():
    """A token-pruning point as accurate as the plain one and cheaper dominates it, and it is no exit point, so
    the full-depth frontier kept it alone: a backend that neither exits nor prunes (ONNX Runtime) found no
    point it runs in frontier.json. The plain points' own frontier is stored too."""
    pts = [P("r64", 0.9, 100), P("r64-k0.5", 0.9, 60, keep_ratio=0.5), P("r32", 0.5, 40),
           P("r32-k0.5", 0.5, 20, keep_ratio=0.5), P("r64-x", 0.9, 30, exit_threshold=0.5)]
    assert [p.name for p in frontier.frontier_points(pts)] == ["r32-k0.5", "r64-x", "r32", "r64-k0.5", "r64"]
    plain = [p.name for p in frontier.frontier_points(pts) if p.keep_ratio is None and p.exit_threshold is None]
    assert plain == ["r32", "r64"]


def test_point_names():
    assert frontier.point_name(384, None, None, None) == "r384"
    assert frontier.point_name(256, 0.75, 0.5, 16) == "r256-x0.75-k0.5-t16"
    assert frontier.point_name(128, None, 1.0, None) == "r128"


def test_plot_png(tmp_path):
    import cv2

    pts = [P("a", 0.95, 100), P("b", 0.9, 60), P("c", 0.7, 90)]
    path = frontier.plot(pts, frontier.pareto(pts), tmp_path / "f.png")
    img = cv2.imread(str(path))
    assert img.shape == (600, 960, 3)
    blue = (img[:, :, 0] > 180) & (img[:, :, 2] < 80)  # BGR: the frontier is drawn blue
    assert blue.sum() > 50


def test_nice_ticks():
    from edgevlm.quantize.plot import nice_ticks

    assert nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(60, 100, 4) == [60, 70, 80, 90, 100]
    assert nice_ticks(0, 0.3, 3) == [0, 0.1, 0.2, 0.3]


def test_run_on_tiny_engine(tmp_path, exit_engine, capsys):
    grid = {"rungs": [64], "thresholds": [None, 0.0], "keep_ratios": [1.0, 0.5], "caps": [1]}
    written = frontier.run(exit_engine, tmp_path, n=3, grid=grid, progress=lambda m: None, show=print)
    assert written == ["frontier.json", "frontier.png"]
    record = load_frontier(tmp_path / "frontier.json")
    assert len(record.points) == 8 and record.eval_items == 3 and record.device == "cpu float32 torch"
    names = {p.name for p in record.points}
    assert {"r64", "r64-t1", "r64-k0.5", "r64-x0-k0.5-t1"} <= names
    by = {p.name: p for p in record.points}
    for p in record.points:
        if p.max_new_tokens == 1:  # one token: no decode step after the first
            assert p.e2e_ms == pytest.approx(p.vision_ms + p.prefill_ms, abs=1e-2)
            assert p.worst_case_ms == pytest.approx(p.vision_ms + p.prefill_ms, abs=1e-2)
        else:
            # each stored figure is rounded to 0.01 ms: 25 terms carry up to 0.005 ms each
            assert p.worst_case_ms == pytest.approx(p.vision_ms + p.prefill_ms + 23 * p.tpot_ms, abs=0.13)
            assert p.accuracy <= by[p.name.removesuffix("-t1")].accuracy
    assert by["r64-x0"].exit_rate == 1.0 and by["r64"].exit_rate is None
    assert [p.name for p in record.frontier] == [p.name for p in frontier.frontier_points(record.points)]
    assert {p.name for p in frontier.pareto(record.points)} <= {p.name for p in record.frontier}
    profiles = frontier.point_profiles(record.frontier)
    from edgevlm.runtime.policy import Controller

    d = Controller(profiles).choose(1e9, max_new_tokens=4)
    assert d.point.name == max(record.frontier, key=lambda p: (p.accuracy, -p.e2e_ms)).name
    out = capsys.readouterr().out
    assert "Pareto frontier of 8 grid points" in out and "| point |" in out


def test_frontier_cli_errors(capsys, tmp_path):
    assert frontier.main(["/nonexistent/model", "--n", "2"]) == 2
    assert capsys.readouterr().err.startswith("edgevlm frontier: error:")
    assert frontier.main([str(tmp_path), "--n", "0"]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err


def test_frontier_file_errors(tmp_path):
    f = tmp_path / "frontier.json"
    f.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_frontier(f)
    good = P("a", 0.9, 10).model_dump()
    f.write_text(json.dumps({"created_utc": "x", "model": "m", "device": "d", "eval_items": 1, "eval_seed": 1,
                             "points": [good], "frontier": [good, good]}))
    with pytest.raises(ConfigError, match="duplicate operating point names"):
        load_frontier(f)
    with pytest.raises(ConfigError, match="not found"):
        load_frontier(tmp_path / "missing.json")


# ----------------------------------------------------------------------------- profile schema

BASE = (
    "name: bad\ndevice_class: cpu\ndevice: cpu\ndtype: float32\nbackends: [torch]\nmemory_mb: 1\n"
    "memory_bandwidth_gbps: 1\nresolution_ladder_px: [384, 256]\ndefault_budget_ms: 100\n"
)


def _profile(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE + text)
    return path


def test_profile_operating_points(tmp_path):
    p = load_profile(_profile(tmp_path, "operating_points:\n  exit_blocks: [2, 3]\n  frontier:\n"
                                        "    - {name: a, resolution_px: 256, accuracy: 0.9, vision_ms: 1, "
                                        "prefill_ms: 1, tpot_ms: 1}\n"))
    assert p.operating_points.exit_blocks == [2, 3]
    assert p.operating_points.frontier[0].operating_point().resolution_px == 256


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("operating_points:\n  exit_blocks: [3, 2]\n", "exit_blocks"),
        ("operating_points:\n  keep_ratios: [0]\n", "keep_ratios"),
        ("operating_points:\n  exit_thresholds: [1.5]\n", "exit_thresholds"),
        ("operating_points:\n  colour: 1\n", "operating_points.colour: unknown key"),
        ("operating_points:\n  frontier:\n    - {name: a, resolution_px: 999, accuracy: 0.9, vision_ms: 1, "
         "prefill_ms: 1, tpot_ms: 1}\n", "outside resolution_ladder_px"),
        ("operating_points:\n  frontier:\n    - {name: a, accuracy: 1.5, vision_ms: 1, prefill_ms: 1, tpot_ms: 1}\n",
         "accuracy"),
    ],
)
def test_profile_operating_points_errors(tmp_path, text, needle):
    with pytest.raises(ConfigError) as exc:
        load_profile(_profile(tmp_path, text))
    assert needle in str(exc.value)


def test_shipped_profiles_have_knobs():
    from edgevlm.profile import profiles_dir

    for path in profiles_dir().glob("*.yaml"):
        ops = load_profile(path.stem).operating_points
        assert ops.keep_ratios and ops.exit_thresholds
        assert np.all(np.diff(ops.exit_blocks) > 0) if len(ops.exit_blocks) > 1 else True
