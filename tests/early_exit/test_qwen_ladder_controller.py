"""The latency controller on Qwen's resolution ladder, whose rungs are max_pixels steps
(``max_pixels = rung ** 2``, :mod:`edgevlm.runtime.models.qwen2_5_vl.processor`): under a tight
budget it picks the smaller rung, and that rung really runs with fewer pixels and vision tokens.

The two points are measured on this machine (``daemon.budget.ladder_points``, as the daemon does
when no frontier was measured; the fastest of three measurements per stage, since this CPU is
shared); the rungs are 36x apart in pixels, and the budget is for a one-token answer (vision +
prefill, where the rung's cost lies), so their predictions are far apart."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from edgevlm.daemon.budget import ladder_points  # noqa: E402
from edgevlm.runtime.engine import Engine  # noqa: E402
from edgevlm.runtime.policy import Controller, PointProfile  # noqa: E402

LADDER = [112, 672]


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory) -> Engine:
    spec = importlib.util.spec_from_file_location(
        "_ladder_qwen2_5_vl", Path(__file__).parents[1] / "models" / "test_qwen2_5_vl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = module.write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen_ladder"))
    raw = json.loads((folder / "config.json").read_text())
    raw["edgevlm"] = {"resolution_ladder": LADDER}
    (folder / "config.json").write_text(json.dumps(raw))
    return Engine.load(folder)


def test_tight_budget_picks_the_smaller_max_pixels_rung(qwen_engine):
    engine = qwen_engine
    assert engine.resolution_ladder == LADDER
    runs = [ladder_points(engine) for _ in range(3)]  # r672 first (most accurate), r112
    points = [PointProfile(ps[0].point, ps[0].accuracy, min(p.vision_ms for p in ps), min(p.prefill_ms for p in ps),
                           min(p.tpot_ms for p in ps)) for ps in zip(*runs, strict=True)]
    assert [p.point.resolution_px for p in points] == [672, 112]
    loose = Controller(points).choose(1e6, max_new_tokens=1)
    assert loose.point.resolution_px == 672  # room for the most accurate point
    big, small = loose.alternatives["r672"], loose.alternatives["r112"]
    assert small < big, loose.alternatives  # 36x fewer pixels cost less
    tight_ms = (small + big) / 2 / 0.9  # the default headroom is 0.9: only r112 fits
    tight = Controller(points).choose(tight_ms, max_new_tokens=1)
    assert tight.point.resolution_px == 112 and tight.predicted_ms <= tight_ms

    frame = np.random.default_rng(0).integers(0, 256, size=(480, 640, 3), dtype=np.uint8)
    at_small = engine.ask(frame, "describe", max_new_tokens=2, operating_point=tight.point).stats
    at_big = engine.ask(frame, "describe", max_new_tokens=2, operating_point=loose.point).stats
    assert at_small.input_height_px * at_small.input_width_px <= 112 * 112
    assert at_big.input_height_px * at_big.input_width_px <= 672 * 672
    assert at_small.input_height_px * at_small.input_width_px > 112 * 112 / 4  # a real step, not a floor
    assert at_small.vision_tokens * 8 <= at_big.vision_tokens
