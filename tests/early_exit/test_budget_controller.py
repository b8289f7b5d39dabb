"""The daemon's BudgetController (edgevlm.daemon.budget): budgets, slowdown hints, refit, and the
frontier sources of build_controller (profile, frontier.json, resolution ladder)."""

from __future__ import annotations

import json

import pytest

from edgevlm.config import parse_daemon_config
from edgevlm.daemon.budget import BudgetController, build_controller, runnable, same_vision_tokens
from edgevlm.errors import ConfigError, DeadlineExceededError
from edgevlm.profile import FrontierPoint
from edgevlm.runtime.policy import Controller, PointProfile
from edgevlm.types import OperatingPoint, Stats

# accuracy, vision, prefill, tpot (ms); 5 tokens -> +4 tpot
POINTS = [
    PointProfile(OperatingPoint(name="r384", resolution_px=384), 0.97, 60.0, 40.0, 5.0),  # 120 ms
    PointProfile(OperatingPoint(name="r256", resolution_px=256), 0.93, 25.0, 20.0, 5.0),  # 65 ms
    PointProfile(OperatingPoint(name="r128", resolution_px=128), 0.70, 6.0, 8.0, 5.0),  # 34 ms
]


def make(default=500.0):
    return BudgetController(Controller(POINTS), default_budget_ms=default, source="test")


def test_budget_and_deadline_of_a_request():
    from edgevlm.protocol import NO_DEADLINE_MS

    bc = make(500)
    inf = float("inf")
    # no budget_ms: plan for the default (capped by the timeout), refuse only past the timeout
    assert bc.budget_for(None) == (500, inf)
    assert bc.budget_for(None, 10000) == (500, 10000)
    assert bc.budget_for(None, 300) == (300, 300)
    assert bc.budget_for(None, NO_DEADLINE_MS) == (500, inf)
    # budget_ms: the target and the refusal limit, never past the timeout
    assert bc.budget_for(200) == (200, 200)
    assert bc.budget_for(200, 10000) == (200, 200)
    assert bc.budget_for(2000, 300) == (300, 300)


def test_without_budget_the_cheapest_runs_until_the_timeout():
    bc = make(20)  # a default budget no point meets: r128 is predicted 34 ms
    budget, deadline = bc.budget_for(None, 10000)
    c = bc.choose(budget, max_new_tokens=5, queue_wait_ms=0, deadline_ms=deadline)
    assert c.point.name == "r128" and c.predicted_ms == pytest.approx(34) and c.budget_ms == 20
    assert c.deadline_ms == 10000
    c = bc.choose(budget, max_new_tokens=5, queue_wait_ms=9000, deadline_ms=deadline)  # 9034 <= 10000
    assert c.point.name == "r128" and c.predicted_ms == pytest.approx(9034) and c.service_ms == pytest.approx(34)
    budget, deadline = bc.budget_for(None, 30)  # the timeout itself is shorter than the cheapest point
    with pytest.raises(DeadlineExceededError) as exc:
        bc.choose(budget, max_new_tokens=5, queue_wait_ms=0, deadline_ms=deadline)
    assert exc.value.details["timeout_ms"] == 30 and exc.value.details["cheapest_predicted_ms"] == pytest.approx(34)
    assert exc.value.message.startswith("timeout_ms 30 cannot be met")
    assert "budget_ms" not in exc.value.details and exc.value.details["planned_budget_ms"] == 20
    # with budget_ms the budget is the refusal limit (issue 4: refused at once rather than late)
    budget, deadline = bc.budget_for(20, 10000)
    with pytest.raises(DeadlineExceededError) as exc:
        bc.choose(budget, max_new_tokens=5, queue_wait_ms=0, deadline_ms=deadline, requested_budget_ms=20)
    assert "timeout_ms" not in exc.value.details and exc.value.details["budget_ms"] == 20
    assert exc.value.message.startswith("budget_ms 20 cannot be met")


@pytest.mark.parametrize(
    ("budget_ms", "timeout_ms", "message", "details"),
    [
        # the default budget (500) is above the timeout: the timeout is the limit, no budget_ms
        (None, 10, "timeout_ms 10 cannot be met", {"planned_budget_ms": 10, "timeout_ms": 10, "limit": "timeout_ms"}),
        # a budget_ms longer than timeout_ms: the timeout is the limit, the request's budget kept
        (5000, 10, "timeout_ms 10 cannot be met", {"planned_budget_ms": 10, "timeout_ms": 10, "budget_ms": 5000,
                                                  "limit": "timeout_ms"}),
        (10, 5000, "budget_ms 10 cannot be met", {"planned_budget_ms": 10, "budget_ms": 10}),
        (10, 10, "budget_ms 10 cannot be met", {"planned_budget_ms": 10, "budget_ms": 10}),
        (10, None, "budget_ms 10 cannot be met", {"planned_budget_ms": 10, "budget_ms": 10}),
    ],
)
def test_refusal_names_the_limiting_field(budget_ms, timeout_ms, message, details):
    bc = make(500)
    budget, deadline = bc.budget_for(budget_ms, timeout_ms)
    with pytest.raises(DeadlineExceededError) as exc:
        bc.choose(budget, max_new_tokens=5, queue_wait_ms=0, deadline_ms=deadline, requested_budget_ms=budget_ms)
    assert exc.value.message == (f"{message}: the cheapest operating point is predicted to take 34 ms "
                                 "(queue wait 0 ms included)")
    assert exc.value.details == {"cheapest_predicted_ms": 34.0, "queue_wait_ms": 0.0, "slowdown_hint": 1.0,
                                 "slowdown": 1.0, **details}
    assert all(type(v) is int for k, v in exc.value.details.items() if k in ("budget_ms", "timeout_ms"))


def test_choose_includes_queue_wait():
    bc = make()
    c = bc.choose(200, max_new_tokens=5, queue_wait_ms=0)
    assert c.point.name == "r384" and c.predicted_ms == pytest.approx(120) and c.service_ms == pytest.approx(120)
    c = bc.choose(200, max_new_tokens=5, queue_wait_ms=80)  # 200 ms after 0.9 headroom: 180 >= 80 + 65
    assert c.point.name == "r256" and c.predicted_ms == pytest.approx(145) and c.service_ms == pytest.approx(65)


def test_refusal_reports_cheapest_with_queue():
    bc = make()
    with pytest.raises(DeadlineExceededError) as exc:
        bc.choose(50, max_new_tokens=5, queue_wait_ms=30)
    assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(64.0)  # 30 + 34
    assert exc.value.details["queue_wait_ms"] == 30


def test_cheapest_runs_when_it_fits_without_headroom():
    bc = make()
    c = bc.choose(36, max_new_tokens=5, queue_wait_ms=0)  # r128: 34 ms > 0.9 x 36 but <= 36
    assert c.point.name == "r128" and c.predicted_ms == pytest.approx(34) and c.service_ms == pytest.approx(34)
    with pytest.raises(DeadlineExceededError):
        bc.choose(33, max_new_tokens=5, queue_wait_ms=0)


def test_slowdown_hint_scales_predictions_and_refusals():
    bc = make()
    bc.hint_slowdown(2.0)
    c = bc.choose(200, max_new_tokens=5, queue_wait_ms=0)  # r384 would be 240 ms now
    assert c.point.name == "r256" and c.predicted_ms == pytest.approx(130)
    assert bc.service_ms(POINTS[0].point, 5) == pytest.approx(240)
    with pytest.raises(DeadlineExceededError) as exc:
        bc.choose(60, max_new_tokens=5, queue_wait_ms=0)
    assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(68.0)
    assert exc.value.details["slowdown_hint"] == 2.0
    for bad in (0, -1, float("nan"), float("inf"), "x"):
        bc.hint_slowdown(bad)  # ignored
    assert bc.slowdown_hint == 2.0 and bc.service_ms(POINTS[0].point, 5) == pytest.approx(240)
    bc.hint_slowdown(0.5)  # faster than nominal is not a throttling signal: counts as 1
    assert bc.slowdown_hint == 1.0 and bc.service_ms(POINTS[0].point, 5) == pytest.approx(120)


def test_hint_is_not_counted_twice():
    bc = make()
    bc.hint_slowdown(2.0)
    for _ in range(15):  # the device is 2x slower, as the hint says
        bc.observe(POINTS[0].point, Stats(vision_ms=120, prefill_ms=80, tpot_ms=10, new_tokens=5))
    assert bc.service_ms(POINTS[0].point, 5) == pytest.approx(240, rel=1e-6)  # not 4x
    assert bc.controller.slowdown == pytest.approx(1.0)  # the hint explained it all
    bc.hint_slowdown(1.0)  # telemetry says the clocks are back
    assert bc.service_ms(POINTS[0].point, 5) == pytest.approx(120, rel=1e-6)


def test_overhead_is_added():
    bc = make()
    for _ in range(30):
        bc.observe_overhead(10.0)
    assert bc.overhead_ms == pytest.approx(10.0, rel=1e-3)
    c = bc.choose(200, max_new_tokens=5, queue_wait_ms=0)
    assert c.point.name == "r384" and c.predicted_ms == pytest.approx(130, rel=1e-3)
    assert bc.service_ms(POINTS[1].point, 5) == pytest.approx(75, rel=1e-3)
    with pytest.raises(DeadlineExceededError) as exc:
        bc.choose(40, max_new_tokens=5, queue_wait_ms=0)
    assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(44.0, rel=1e-3)


def test_refit_steps_down_to_what_still_fits():
    bc = make()
    c = bc.choose(1000, max_new_tokens=5, queue_wait_ms=0)
    assert c.point.name == "r384"
    assert bc.refit(c, 1000, max_new_tokens=5)[0].name == "r384"
    p, ms = bc.refit(c, 100, max_new_tokens=5)  # 90 ms usable: r256 (65 ms)
    assert p.name == "r256" and ms == pytest.approx(65)
    p, ms = bc.refit(c, 10, max_new_tokens=5)  # nothing fits: the cheapest
    assert p.name == "r128" and ms == pytest.approx(34)


def test_refit_passes_over_the_points_a_prompt_did_not_fit_and_those_with_as_many_vision_tokens():
    exit_384 = PointProfile(OperatingPoint(name="r384-x2", resolution_px=384, exit_layer=2), 0.95, 30.0, 40.0, 5.0)
    bc = BudgetController(Controller([*POINTS, exit_384]), default_budget_ms=500, source="test")
    c = bc.choose(1000, max_new_tokens=5, queue_wait_ms=0)
    assert [p.name for p in bc.points] == ["r384", "r384-x2", "r256", "r128"] and c.point.name == "r384"
    r384, r256, r128 = (p.point for p in POINTS)
    # r384 overflowed: its early exit has as many vision tokens; r256 is the most accurate left that fits
    p, ms = bc.refit(c, 1000, max_new_tokens=5, too_long=[r384])
    assert p.name == "r256" and ms == pytest.approx(65)
    p, ms = bc.refit(c, 50, max_new_tokens=5, too_long=[r384])  # within the budget left: 45 ms -> r128
    assert p.name == "r128" and ms == pytest.approx(34)
    p, _ = bc.refit(c, 10, max_new_tokens=5, too_long=[r384, r128])  # none fits the budget: the cheapest left
    assert p.name == "r256"
    assert bc.refit(c, 1000, max_new_tokens=5, too_long=[r384, r256, r128]) is None
    assert same_vision_tokens(r384, exit_384.point)
    assert same_vision_tokens(r256, r256.model_copy(update={"keep_ratio": 1.0, "max_new_tokens": 8}))
    assert not same_vision_tokens(r256, r256.model_copy(update={"keep_ratio": 0.5}))


def test_runnable_needs_exit_heads():
    class E:
        exit_points: list[int] = []

    full = FrontierPoint(name="a", accuracy=0.9, vision_ms=1, prefill_ms=1, tpot_ms=1)
    ex = FrontierPoint(name="b", exit_threshold=0.8, accuracy=0.9, vision_ms=1, prefill_ms=1, tpot_ms=1)
    assert runnable(E(), full) and not runnable(E(), ex)
    E.exit_points = [2]
    assert runnable(E(), ex)
    assert not runnable(E(), FrontierPoint(name="c", exit_layer=3, accuracy=1, vision_ms=1, prefill_ms=1, tpot_ms=1))


# ------------------------------------------------------------------------------ build_controller


def _frontier_file(path, points):
    data = {"created_utc": "2025-01-01T00:00:00+00:00", "model": "m", "device": "cpu float32 torch",
            "eval_items": 10, "eval_seed": 1000, "points": points, "frontier": points}
    path.write_text(json.dumps(data))
    return path


def test_build_from_frontier_file(tmp_path, plain_engine):
    f = _frontier_file(tmp_path / "frontier.json", [
        {"name": "big", "resolution_px": 64, "accuracy": 0.9, "vision_ms": 50, "prefill_ms": 50, "tpot_ms": 5},
        {"name": "small", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5},
        {"name": "exit", "exit_threshold": 0.5, "accuracy": 0.7, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5},
    ])
    cfg = parse_daemon_config({"controller": {"frontier": str(f), "default_budget_ms": 777}})
    bc = build_controller(cfg, plain_engine)
    assert [p.name for p in bc.points] == ["big", "small"]  # 'exit' dropped: no exit heads
    assert bc.default_budget_ms == 777 and bc.source == str(f)


def test_dominated_full_depth_point_serves_a_model_without_exits(tmp_path, plain_engine, exit_engine):
    """frontier.json carries the full-depth points' own frontier: a model without exit heads still
    gets the top rung; a model with them keeps only the Pareto points it can run."""
    f = _frontier_file(tmp_path / "frontier.json", [
        {"name": "r64-x", "resolution_px": 64, "exit_threshold": 0.5, "accuracy": 0.9, "vision_ms": 20,
         "prefill_ms": 20, "tpot_ms": 5},
        {"name": "r64", "resolution_px": 64, "accuracy": 0.9, "vision_ms": 50, "prefill_ms": 20, "tpot_ms": 5},
        {"name": "r32-k", "resolution_px": 32, "keep_ratio": 0.5, "accuracy": 0.4, "vision_ms": 4, "prefill_ms": 2,
         "tpot_ms": 5},
        {"name": "r32", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5},
    ])
    cfg = parse_daemon_config({"controller": {"frontier": str(f)}})
    assert [p.name for p in build_controller(cfg, plain_engine).points] == ["r64", "r32", "r32-k"]
    assert [p.name for p in build_controller(cfg, exit_engine).points] == ["r64-x", "r32", "r32-k"]
    # batching: the exit and pruning points (one image at a time) are left out, the plain rungs serve
    assert [p.name for p in build_controller(cfg, exit_engine, batched=True).points] == ["r64", "r32"]
    assert [p.name for p in build_controller(cfg, plain_engine, batched=True).points] == ["r64", "r32"]


def test_pruning_points_need_a_pruning_backend():
    from types import SimpleNamespace

    from edgevlm.profile import FrontierPoint

    p = FrontierPoint(name="k", resolution_px=32, keep_ratio=0.5, accuracy=0.5, vision_ms=1, prefill_ms=1, tpot_ms=1)
    assert not runnable(SimpleNamespace(backend=SimpleNamespace(supports_pruning=False), exit_points=[]), p)
    assert runnable(SimpleNamespace(backend=SimpleNamespace(supports_pruning=True), exit_points=[]), p)


def test_build_all_points_unrunnable(tmp_path, plain_engine):
    f = _frontier_file(tmp_path / "frontier.json", [
        {"name": "exit", "exit_threshold": 0.5, "accuracy": 0.7, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5},
    ])
    cfg = parse_daemon_config({"controller": {"frontier": str(f)}})
    with pytest.raises(ConfigError, match="no operating point"):
        build_controller(cfg, plain_engine)


def test_a_model_frontier_with_no_point_this_engine_runs_falls_back_to_the_ladder(tmp_path, plain_model_dir, caplog):
    """Was: serve refused to start ('no operating point of .../frontier.json can run on this model') while
    --check-config said OK, e.g. an INT4 bundle served on ONNX Runtime whose frontier.json held only token
    pruning points. The model's own frontier.json is a starting point, not a setting: the ladder is measured."""
    import logging
    import shutil

    from edgevlm.runtime import Engine

    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    _frontier_file(d / "frontier.json", [
        {"name": "x", "resolution_px": 32, "exit_threshold": 0.5, "accuracy": 0.7, "vision_ms": 5, "prefill_ms": 5,
         "tpot_ms": 5}])
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.budget"):
        bc = build_controller(parse_daemon_config({}), Engine.load(d))
    assert [p.name for p in bc.points] == ["r64", "r32"] and bc.source == "resolution ladder measured at start-up"
    assert f"no operating point of {d / 'frontier.json'} can run on this model/backend; measuring the resolution " \
           "ladder" in caplog.text


def test_build_from_ladder_and_profile_budget(plain_engine):
    bc = build_controller(parse_daemon_config({}), plain_engine)  # cpu profile, no frontier anywhere
    assert [p.name for p in bc.points] == ["r64", "r32"]
    assert bc.default_budget_ms == 2000  # profiles/cpu.yaml
    # the default is the planning target; the refusal limit of a request without budget_ms is its timeout
    assert bc.budget_for(None, 30000) == (2000, 30000) and bc.budget_for(None, 1500) == (1500, 1500)
    assert all(p.vision_ms > 0 and p.prefill_ms > 0 for p in bc.points)
    assert build_controller(parse_daemon_config({"controller": {"enabled": False}}), plain_engine) is None


def test_model_frontier_json_is_used(tmp_path, plain_model_dir):
    import shutil

    from edgevlm.runtime import Engine

    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    _frontier_file(d / "frontier.json", [
        {"name": "only", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5}])
    bc = build_controller(parse_daemon_config({}), Engine.load(d))
    assert [p.name for p in bc.points] == ["only"] and bc.source.endswith("frontier.json")


def test_bad_frontier_file(tmp_path, plain_engine):
    f = tmp_path / "frontier.json"
    f.write_text(json.dumps({"frontier": []}))
    cfg = parse_daemon_config({"controller": {"frontier": str(f)}})
    with pytest.raises(ConfigError, match="frontier.json: created_utc"):
        build_controller(cfg, plain_engine)


def test_frontier_point_of_zero_ms_is_refused(tmp_path, plain_engine):
    """A hand-edited frontier whose point takes 0 ms (vision and prefill) was taken: the controller
    predicted 0 ms, admitted a 1 ms budget and answered it tens of ms late (predicted_ms 0.0) until its
    EWMA caught up. Now the file is refused naming the point; a point with only one stage at 0 still loads."""
    zero = {"name": "z", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 0, "prefill_ms": 0, "tpot_ms": 0}
    f = _frontier_file(tmp_path / "frontier.json", [zero])
    cfg = parse_daemon_config({"controller": {"frontier": str(f)}})
    with pytest.raises(ConfigError, match=r"frontier\[0\] \('z'\): vision_ms \+ prefill_ms is 0"):
        build_controller(cfg, plain_engine)
    _frontier_file(f, [{**zero, "prefill_ms": 0.5}])
    bc = build_controller(cfg, plain_engine)
    assert bc.service_ms(bc.points[0].point, 4) > 0


def test_frontier_exit_layer_past_the_encoder_depth_is_refused(tmp_path, exit_model_dir, exit_engine, capsys):
    """A frontier point with exit_layer 9 on a 4-block encoder was taken: with an exit_threshold it ran as if it
    had no exit_layer (every exit point consulted) under its name and measured latency; without one it was dropped
    as "cannot run". Now serve and --check-config refuse the file, one line naming the point and the encoder's
    depth; for controller.frontier and for the model's own frontier.json. exit_layer 4 (the last block) loads."""
    import shutil

    from edgevlm.cli import main
    from edgevlm.model_folder import weights_fingerprint
    from edgevlm.runtime import Engine

    good = {
        "name": "x2",
        "exit_layer": 2,
        "exit_threshold": 0.5,
        "accuracy": 0.8,
        "vision_ms": 4,
        "prefill_ms": 5,
        "tpot_ms": 1,
    }
    deep = {**good, "name": "x9", "exit_layer": 9, "accuracy": 0.9, "vision_ms": 5}
    f = _frontier_file(tmp_path / "frontier.json", [good, deep])
    cfg = parse_daemon_config({"controller": {"frontier": str(f)}})
    want = (
        f"controller.frontier: {f}: frontier[1] ('x9'): exit_layer 9 is past the vision encoder's depth "
        "(4 blocks: exit_layer 1..4)"
    )
    with pytest.raises(ConfigError) as info:
        build_controller(cfg, exit_engine)
    assert str(info.value) == want
    yaml = tmp_path / "daemon.yaml"
    yaml.write_text(
        f"mqtt: {{host: 127.0.0.1, port: 1}}\nmetrics: {{listen: null}}\n"
        f"model: {{path: {exit_model_dir}}}\ncontroller: {{frontier: {f}}}\n"
    )
    assert main(["serve", "--check-config", str(yaml)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"edgevlm: error: {want}"]

    _frontier_file(f, [good, {**deep, "exit_layer": 4}])  # the encoder's last block: within its depth
    points = build_controller(cfg, exit_engine).points
    assert sorted((p.name, p.point.exit_layer) for p in points) == [("x2", 2), ("x9", 4)]
    assert main(["serve", "--check-config", str(yaml)]) == 0
    capsys.readouterr()

    # the model's own frontier.json (measured on its weights), no controller.frontier
    model = tmp_path / "model"
    shutil.copytree(exit_model_dir, model)
    own = _frontier_file(model / "frontier.json", [good, deep])
    raw = json.loads(own.read_text())
    raw["weights_fingerprint"] = weights_fingerprint(model)
    own.write_text(json.dumps(raw))
    want = (
        f"model.path: {own}: frontier[1] ('x9'): exit_layer 9 is past the vision encoder's depth "
        "(4 blocks: exit_layer 1..4)"
    )
    with pytest.raises(ConfigError) as info:
        build_controller(parse_daemon_config({}), Engine.load(model))
    assert str(info.value) == want
    yaml.write_text(
        f"mqtt: {{host: 127.0.0.1, port: 1}}\nmetrics: {{listen: null}}\nmodel: {{path: {model}}}\n"
    )
    assert main(["serve", "--check-config", str(yaml)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"edgevlm: error: {want}"]


def test_profile_frontier_is_used(tmp_path, plain_engine):
    prof = tmp_path / "dev.yaml"
    prof.write_text(
        "name: dev\ndevice_class: cpu\ndevice: cpu\ndtype: float32\nbackends: [torch]\nmemory_mb: 1\n"
        "memory_bandwidth_gbps: 1\nresolution_ladder_px: [64, 32]\ndefault_budget_ms: 321\n"
        "operating_points:\n  frontier:\n"
        "    - {name: p64, resolution_px: 64, accuracy: 0.9, vision_ms: 9, prefill_ms: 9, tpot_ms: 1}\n"
        "    - {name: p32, resolution_px: 32, accuracy: 0.6, vision_ms: 3, prefill_ms: 3, tpot_ms: 1}\n")
    bc = build_controller(parse_daemon_config({"profile": str(prof)}), plain_engine)
    assert [p.name for p in bc.points] == ["p64", "p32"] and bc.source == "profile dev"
    assert bc.default_budget_ms == 321


def test_stale_model_frontier_is_ignored(tmp_path, plain_model_dir):
    import shutil

    from edgevlm.runtime import Engine

    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    f = _frontier_file(d / "frontier.json", [
        {"name": "only", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5}])
    raw = json.loads(f.read_text())
    raw["weights_fingerprint"] = "0" * 64  # measured on other weights
    f.write_text(json.dumps(raw))
    bc = build_controller(parse_daemon_config({}), Engine.load(d))
    assert bc.source == "resolution ladder measured at start-up"


def test_controller_frontier_of_another_model_is_refused(tmp_path, plain_model_dir, plain_engine, capsys):
    """controller.frontier measured on other weights (another model's frontier.json) was used as is: the
    model ran at that model's rungs under its latencies. Now serve and --check-config refuse it, one line
    naming controller.frontier, exit 2; the model's own frontier (same fingerprint) and a hand-written one
    (no fingerprint) are still taken."""
    from edgevlm.cli import main
    from edgevlm.model_folder import weights_fingerprint
    from edgevlm.runtime.testing import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "other", seed=7, vision_layers=4, resolution_ladder=[64, 32])
    point = {"name": "r32", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 5, "prefill_ms": 5, "tpot_ms": 5}
    f = _frontier_file(tmp_path / "frontier.json", [point])
    raw = json.loads(f.read_text())
    raw["weights_fingerprint"] = weights_fingerprint(other)
    f.write_text(json.dumps(raw))
    cfg = parse_daemon_config({"controller": {"frontier": str(f)}})
    with pytest.raises(ConfigError, match=r"^controller\.frontier: .*frontier\.json was measured on other weights"):
        build_controller(cfg, plain_engine)
    yaml = tmp_path / "daemon.yaml"
    yaml.write_text(f"mqtt: {{host: 127.0.0.1, port: 1}}\nmetrics: {{listen: null}}\n"
                    f"model: {{path: {plain_model_dir}}}\ncontroller: {{frontier: {f}}}\n")
    assert main(["serve", "--check-config", str(yaml)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("edgevlm: error: controller.frontier: ") and "other weights" in err[0]

    raw["weights_fingerprint"] = weights_fingerprint(plain_model_dir)  # this model's own: used
    f.write_text(json.dumps(raw))
    assert [p.name for p in build_controller(cfg, plain_engine).points] == ["r32"]
    assert main(["serve", "--check-config", str(yaml)]) == 0
    del raw["weights_fingerprint"]  # hand-written: not checked
    f.write_text(json.dumps(raw))
    assert [p.name for p in build_controller(cfg, plain_engine).points] == ["r32"]


def test_answer_length_is_learned_per_prompt():
    bc = make()
    assert bc.expected_tokens("is there a red circle?", 16) == 16  # never seen: worst case
    bc.observe(POINTS[1].point, Stats(vision_ms=25, prefill_ms=20, tpot_ms=5, new_tokens=2),
               prompt="is there a red circle?")
    bc.observe(POINTS[1].point, Stats(vision_ms=25, prefill_ms=20, tpot_ms=5, new_tokens=3),
               prompt="is there a red circle?")
    bc.observe(POINTS[1].point, Stats(vision_ms=25, prefill_ms=20, tpot_ms=5, new_tokens=2),
               prompt="is there a red circle?")
    assert bc.expected_tokens("is there a red circle?", 16) == 3  # the most seen
    assert bc.expected_tokens("is there a red circle?", 2) == 2  # never more than allowed
    assert bc.expected_tokens("describe the scene.", 16) == 16
    assert bc.expected_tokens(None, 7) == 7
    assert bc.expected_tokens("Is there a blue square?", 16) == 3  # same first two words
    bc.observe(POINTS[1].point, Stats(vision_ms=25, prefill_ms=20, tpot_ms=5, new_tokens=9),
               prompt="is there anything on the left?")
    assert bc.expected_tokens("is there a red circle?", 16) == 3  # its own history wins
    assert bc.expected_tokens("is there a blue square?", 16) == 9


def test_profile_frontier_of_another_model_is_not_used(plain_engine):
    # profiles/cpu.yaml ships the demo model's frontier (rungs 128-384); the tiny model's ladder is 64/32
    bc = build_controller(parse_daemon_config({"profile": "cpu"}), plain_engine)
    assert bc.source == "resolution ladder measured at start-up"
    assert [p.name for p in bc.points] == ["r64", "r32"]


def test_refit_at_dequeue_keeps_a_cap_lifted_only_as_far_as_the_budget_left_affords():
    capped = [PointProfile(OperatingPoint(name="r256-t16", resolution_px=256, max_new_tokens=16), 0.95, 20.0, 20.0, 5.0)]
    bc = BudgetController(Controller(capped), default_budget_ms=500, source="test")
    choice = bc.choose(30_000, max_new_tokens=64, queue_wait_ms=0)
    assert choice.point.max_new_tokens is None  # 30 s affords every token the protocol allows
    # at dequeue 200 ms are left: 0.9 x 200 = 180 ms = 40 + (n - 1) x 5 -> n = 29
    point, _ = bc.refit(choice, 200, max_new_tokens=64)
    assert (point.name, point.max_new_tokens) == ("r256-t16", 29)
    point, _ = bc.refit(choice, 100, max_new_tokens=64)  # 90 ms affords 11 tokens: the cap of 16 stays
    assert point.max_new_tokens == 16
