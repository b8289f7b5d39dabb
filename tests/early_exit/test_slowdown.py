"""The injected-slowdown test hook (edgevlm.runtime.slowdown): identical outputs, delegation, the
sleeps it asks for, bad factors."""

from __future__ import annotations

import pytest

from edgevlm.types import OperatingPoint

torch = pytest.importorskip("torch")


@pytest.fixture
def engine(exit_model_dir):
    from edgevlm.runtime import Engine

    return Engine.load(exit_model_dir)


def test_outputs_identical_and_sleeps_scaled(engine, frames, monkeypatch):
    from edgevlm.runtime import slowdown

    op = OperatingPoint(exit_layer=1, keep_ratio=0.5)
    want = engine.ask(frames[0], "what color ?", max_new_tokens=4, operating_point=op)
    hook = slowdown.inject_slowdown(engine, 3.0)
    assert slowdown.inject_slowdown(engine, 3.0) is hook  # wrapped once
    sleeps: list[float] = []
    monkeypatch.setattr(slowdown.time, "sleep", lambda s: sleeps.append(s))
    got = engine.ask(frames[0], "what color ?", max_new_tokens=4, operating_point=op)
    assert got.text == want.text and got.stats.exit_layer == 1 and got.stats.vision_tokens == 6
    # one sleep per encode_image and prefill, one per decode step; each 2x its call's duration
    assert len(sleeps) == 2 + (got.stats.new_tokens - 1) and all(s > 0 for s in sleeps)
    assert engine.exit_points == [1, 2] and engine.labels == ["red", "green", "blue"]  # delegated
    assert set(engine.classify(frames[0])) == {"red", "green", "blue"}
    hook.factor = 1.0
    sleeps.clear()
    engine.ask(frames[0], "what color ?", max_new_tokens=2)
    assert sleeps == []


def test_exit_threshold_points_run_through_the_hook(engine, frames):
    # an exit threshold makes the engine pass the prompt ids to encode_image: the hook forwards them
    from edgevlm.runtime.slowdown import inject_slowdown

    op = OperatingPoint(resolution_px=64, exit_threshold=0.0)
    want = engine.ask(frames[2], "what color ?", max_new_tokens=4, operating_point=op)
    inject_slowdown(engine, 1.5)
    got = engine.ask(frames[2], "what color ?", max_new_tokens=4, operating_point=op)
    assert got.text == want.text and got.stats.exit_layer == want.stats.exit_layer == 1


@pytest.mark.parametrize("bad", [0.5, 0.0, float("nan")])
def test_bad_factor(engine, bad):
    from edgevlm.runtime.slowdown import inject_slowdown

    with pytest.raises(ValueError, match="slowdown factor"):
        inject_slowdown(engine, bad)
