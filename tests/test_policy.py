"""The latency controller (edgevlm.runtime.policy): choice, learning, hysteresis, refusal."""

from __future__ import annotations

import sys

import pytest

from edgevlm.errors import DeadlineExceededError
from edgevlm.runtime.policy import Controller, PointProfile
from edgevlm.types import OperatingPoint, Stats

# accuracy, vision, prefill, tpot (ms)
FRONTIER = [
    PointProfile(OperatingPoint(name="r384", resolution_px=384), 0.97, 60.0, 40.0, 5.0),
    PointProfile(OperatingPoint(name="r256", resolution_px=256), 0.93, 25.0, 20.0, 5.0),
    PointProfile(OperatingPoint(name="r128", resolution_px=128), 0.70, 6.0, 8.0, 5.0),
]


def stats(vision, prefill, tpot, n=5):
    return Stats(vision_ms=vision, prefill_ms=prefill, tpot_ms=tpot, new_tokens=n)


def test_controller_is_torch_free():
    assert "edgevlm.runtime.policy" in sys.modules
    import subprocess

    code = "import sys, edgevlm.runtime.policy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_picks_most_accurate_that_fits():
    c = Controller(FRONTIER)
    # r384 with 5 tokens: 60 + 40 + 4*5 = 120 ms; with headroom 0.9 needs budget >= 133.3
    assert c.choose(140, max_new_tokens=5).point.name == "r384"
    c = Controller(FRONTIER)
    d = c.choose(100, max_new_tokens=5)  # r256: 25 + 20 + 20 = 65
    assert d.point.name == "r256"
    assert d.predicted_ms == pytest.approx(65.0)
    assert d.alternatives["r384"] == pytest.approx(120.0)


def test_queue_wait_is_added():
    c = Controller(FRONTIER)
    assert c.choose(140, max_new_tokens=5, queue_wait_ms=50).point.name == "r256"


def test_point_token_cap_applies():
    capped = [
        PointProfile(OperatingPoint(name="short", max_new_tokens=2), 0.9, 10.0, 10.0, 10.0),
    ]
    c = Controller(capped)
    # budget 34 ms (30.6 with the headroom) affords 2 tokens (10 + 10 + 1 x 10), not 3
    d = c.choose(34, max_new_tokens=50)
    assert d.point.max_new_tokens == 2 and d.predicted_ms == pytest.approx(30.0)


def test_a_cap_never_cuts_what_the_budget_affords():
    capped = [PointProfile(OperatingPoint(name="short", max_new_tokens=2), 0.9, 10.0, 10.0, 10.0)]
    c = Controller(capped)
    # budget 100 ms (90 with the headroom): 20 ms + (n - 1) x 10 ms fits up to n = 8
    d = c.choose(100, max_new_tokens=50)
    assert (d.point.name, d.point.max_new_tokens) == ("short", 8)
    assert d.predicted_ms == pytest.approx(90.0)
    # the request's own cap is lower than what the budget affords: the engine stops there, the
    # prediction counts it, and the point's cap is still raised (never lowered)
    d = c.choose(100, max_new_tokens=4)
    assert d.point.max_new_tokens == 8 and d.predicted_ms == pytest.approx(50.0)
    # a budget affording the protocol's whole range removes the cap
    from edgevlm.protocol import MAX_NEW_TOKENS_LIMIT

    assert c.choose((20 + MAX_NEW_TOKENS_LIMIT * 10) / 0.9 + 1, max_new_tokens=50).point.max_new_tokens is None
    assert c.lift_cap(capped[0].point, 34).max_new_tokens == 2  # lift_cap: the same rule, later
    assert c.lift_cap(capped[0].point, 100).max_new_tokens == 8
    assert c.lift_cap(OperatingPoint(name="unknown", max_new_tokens=2), 1e6).max_new_tokens == 2


def test_the_demo_frontiers_t16_points_answer_in_full_under_a_large_budget():
    # The demo model's real frontier: every point on it is a 't16' point (capped at 16 tokens),
    # the uncapped twin has the same accuracy and per-token latency but a worse worst case.
    from edgevlm.profile import load_frontier
    from edgevlm.quantize.frontier import point_profiles
    from edgevlm.runtime.demo import model_dir

    record = load_frontier(model_dir() / "frontier.json")
    assert all(p.max_new_tokens == 16 for p in record.frontier)
    d = Controller(point_profiles(record.frontier)).choose(60_000, max_new_tokens=64)
    best = max(record.frontier, key=lambda p: (p.accuracy, -(p.vision_ms + p.prefill_ms)))
    assert d.point.name == best.name and d.point.max_new_tokens is None  # was 16: answers cut at 16 tokens
    twin = next(p for p in record.points if p.name == best.name.removesuffix("-t16"))
    assert (twin.max_new_tokens, twin.accuracy, twin.tpot_ms) == (None, best.accuracy, best.tpot_ms)
    assert d.predicted_ms == pytest.approx(best.vision_ms + best.prefill_ms + 63 * best.tpot_ms, abs=0.01)
    # a budget that affords 16 tokens at that point but not 17 keeps its cap at 16
    tight_ms = (best.vision_ms + best.prefill_ms + 15.5 * best.tpot_ms) / 0.9
    d = Controller(point_profiles(record.frontier)).choose(tight_ms, max_new_tokens=64)
    assert (d.point.name, d.point.max_new_tokens) == (best.name, 16)


def test_refuses_when_nothing_fits():
    c = Controller(FRONTIER)
    with pytest.raises(DeadlineExceededError) as exc:
        c.choose(10, max_new_tokens=5)
    assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(34.0)  # 6 + 8 + 4*5


def test_learns_a_device_slowdown_and_steps_down():
    c = Controller(FRONTIER, tail_quantile=0.5)  # plans for the median: the mean model alone
    assert c.choose(140, max_new_tokens=5).point.name == "r384"
    for _ in range(15):  # the device becomes 2x slower
        c.observe("r384", stats(120, 80, 10))
    # the sampled point predicts what it measured; most of the change is attributed device-wide,
    # so unsampled points' predictions move too (r256: 65 ms offline)
    assert c.predict_ms("r384", 5) == pytest.approx(240, rel=0.03)
    assert 1.75 <= c.slowdown <= 2.05
    assert 1.75 * 65 <= c.predict_ms("r256", 5) <= 2.05 * 65
    assert c.choose(120, max_new_tokens=5).point.name == "r128"
    assert c.ceiling.name == "r128"


def test_hysteresis_steps_up_one_point_after_streak():
    c = Controller(FRONTIER, step_up_after=3)
    # overload at a 100 ms budget: 50 ms of queue wait leaves room for r128 only (34 + 50 = 84 <= 90)
    assert c.choose(100, max_new_tokens=5, queue_wait_ms=50).point.name == "r128"
    # the queue drains: r256 (65) and then r384 (120) fit again at budgets near the ceiling's
    # (<= 1.25x), but the ceiling rises one point per 3 requests with room
    chosen = [c.choose(124, max_new_tokens=5).point.name for _ in range(4)]
    assert chosen == ["r128", "r128", "r256", "r256"]


def test_a_tight_budget_does_not_lower_the_accuracy_of_looser_ones():
    c = Controller(FRONTIER, step_up_after=3)
    assert c.choose(60, max_new_tokens=5).point.name == "r128"  # this request's own budget: r128
    assert c.ceiling.name == "r128"
    # a request with a generous budget right after it gets the most accurate point at once,
    # and does not move the ceiling set by the tight one
    assert c.choose(1000, max_new_tokens=5).point.name == "r384"
    assert c.ceiling.name == "r128"
    assert c.choose(74, max_new_tokens=5).point.name == "r128"  # r256 (65 ms) fits 74 x 0.9, but the ceiling holds


def test_live_measurements_replace_offline_figures():
    c = Controller(FRONTIER, alpha=0.5)
    for _ in range(20):
        c.observe("r128", stats(12, 16, 5))  # r128 is really 2x slower in vision+prefill
    # the others follow through the shared slowdown; r128 itself predicts what it measured
    assert c.predict_ms("r128", 5) == pytest.approx(12 + 16 + 20, rel=0.05)


def test_unknown_point_observation_is_ignored():
    c = Controller(FRONTIER)
    c.observe("nope", stats(1, 1, 1))
    assert c.slowdown == 1.0


def test_one_outlier_moves_the_model_at_most_max_step():
    c = Controller(FRONTIER)  # alpha 0.3
    c.observe("r384", stats(3000, 2000, 5))  # a torch first-call warm-up: 42x the 120 ms predicted
    assert c.slowdown == pytest.approx(0.7 + 0.3 * 3)  # clipped to 3x: 1.6, not 13.3
    # r384's own figures (divided by the slowdown) move towards at most 3x their value, at alpha / 4
    vision, prefill, tpot = 60 + 0.075 * (180 - 60), 40 + 0.075 * (120 - 40), 5 + 0.075 * (5 / 1.6 - 5)
    assert c.predict_ms("r384", 5) == pytest.approx(1.6 * (vision + prefill + 4 * tpot))
    for _ in range(20):
        c.observe("r384", stats(60, 40, 5))  # back to nominal
    assert c.predict_ms("r384", 5) == pytest.approx(120, rel=0.05)
    assert c.choose(140, max_new_tokens=5).point.name == "r384"


def test_noise_makes_the_choice_plan_for_the_tail():
    c = Controller(FRONTIER, window=20)
    assert c.tail == 1.0
    for k in range(40):  # every 4th request takes 1.5x as long: the noise of a shared CPU
        f = 1.5 if k % 4 == 3 else 1.0
        c.observe("r256", stats(25 * f, 20 * f, 5 * f))
    assert 1.3 <= c.tail <= 1.6
    mean = c.predict_ms("r256", 5)
    assert c.predict_ms("r256", 5, tail=True) == pytest.approx(mean * c.tail)
    d = c.choose(1000, max_new_tokens=5)
    assert d.predicted_ms == pytest.approx(c.predict_ms("r384", 5) * c.tail)
    # a budget the mean would fit but the tail does not: the controller steps down
    budget = (c.predict_ms("r384", 5) + 1) / 0.9
    assert c.choose(budget, max_new_tokens=5).point.name == "r256"


def test_a_refusing_controller_forgets_a_stale_slowdown():
    now = [100.0]
    c = Controller(FRONTIER, stale_half_life_s=5.0, clock=lambda: now[0])
    for _ in range(30):
        c.observe("r128", stats(18, 24, 15))  # a co-located job makes the device 3x slower
    s = c.slowdown
    assert c.predict_ms("r128", 5) == pytest.approx(3 * 34, rel=0.02) and s > 2
    with pytest.raises(DeadlineExceededError):  # r128 needs ~100 ms now
        c.choose(80, max_new_tokens=5)
    assert c.slowdown == pytest.approx(s)  # nothing aged yet
    now[0] += 5.0  # one half-life of refusals, no measurement: half of the excess is forgotten
    assert c.slowdown == pytest.approx(1 + (s - 1) / 2)
    now[0] += 100.0
    assert c.slowdown == pytest.approx(1.0, abs=1e-3)
    d = c.choose(80, max_new_tokens=5)  # admitted again (~54 ms predicted), to be measured
    assert d.point.name == "r128"
    c.observe("r128", stats(6, 8, 5))  # the job is gone: the measurement confirms it
    after = c.slowdown
    assert after < 1.0  # 14 + 4 x 5 = 34 ms measured against the ~54 ms predicted
    now[0] += 100.0
    assert c.slowdown == after  # no refusal since: no ageing
    c2 = Controller(FRONTIER, clock=lambda: now[0])
    for _ in range(30):
        c2.observe("r128", stats(18, 24, 15))
    s2 = c2.slowdown
    now[0] += 100.0  # slow and idle, but not refusing: the evidence stands
    assert c2.slowdown == s2 and c2.predict_ms("r128", 5) == pytest.approx(3 * 34, rel=0.02)


@pytest.mark.parametrize(
    "kwargs",
    [{"frontier": []}, {"frontier": FRONTIER + FRONTIER[:1]}, {"frontier": FRONTIER, "alpha": 0},
     {"frontier": FRONTIER, "tail_quantile": 0.2}, {"frontier": FRONTIER, "window": 0},
     {"frontier": FRONTIER, "stale_half_life_s": 0}],
)
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        Controller(**kwargs)


def test_asks_adaptive_vision_is_one_rule_for_operating_and_frontier_points():
    """Early exit (a layer or a threshold) or a keep ratio below 1 sends an image through the
    per-request encoder; keep ratio 1, no exit, or no point at all keeps it in the batched encoder."""
    from edgevlm.profile import FrontierPoint
    from edgevlm.types import OperatingPoint, asks_adaptive_vision

    assert not asks_adaptive_vision(None)
    assert not asks_adaptive_vision(OperatingPoint())
    assert not asks_adaptive_vision(OperatingPoint(keep_ratio=1.0, resolution_px=256, max_new_tokens=8))
    assert asks_adaptive_vision(OperatingPoint(exit_layer=3))
    assert asks_adaptive_vision(OperatingPoint(exit_threshold=0.9))
    assert asks_adaptive_vision(OperatingPoint(keep_ratio=0.5))
    measured = {"accuracy": 0.9, "vision_ms": 3.0, "prefill_ms": 2.0, "tpot_ms": 1.0}
    assert not asks_adaptive_vision(FrontierPoint(name="r384", resolution_px=384, **measured))
    assert asks_adaptive_vision(FrontierPoint(name="r384-k0.25", resolution_px=384, keep_ratio=0.25, **measured))


def test_a_vision_cache_hit_teaches_the_controller_nothing_about_the_encoder():
    # three questions about one frame: the 2nd and 3rd ran no encoder (vision_ms ~0, vision_cached); the
    # first question about the next frame must still be predicted with the encoder's full time
    c = Controller(FRONTIER)
    before = c.predict_ms("r384", 5)  # 60 + 40 + 4 x 5 = 120 ms
    for _ in range(20):
        c.observe("r384", Stats(vision_ms=0.05, vision_cached=True, prefill_ms=40.0, tpot_ms=5.0, new_tokens=5))
    assert c.predict_ms("r384", 5) == pytest.approx(before)
    # the same hits reported without the flag would have pulled the prediction down
    wrong = Controller(FRONTIER)
    for _ in range(20):
        wrong.observe("r384", stats(0.05, 40.0, 5.0))
    assert wrong.predict_ms("r384", 5) < 0.8 * before
    # a slower device still shows through a hit's prefill and decode
    for _ in range(20):
        c.observe("r384", Stats(vision_ms=0.05, vision_cached=True, prefill_ms=80.0, tpot_ms=10.0, new_tokens=5))
    assert c.predict_ms("r384", 5) > 1.5 * before
