"""The controller inside the daemon, over a real mosquitto broker with the SDK: budget_ms picks the
operating point, refusals are immediate with the cheapest prediction, the queue wait counts, the
slowdown hint scales predictions; config errors name the key."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from edgevlm import Client
from edgevlm.config import parse_daemon_config
from edgevlm.errors import ConfigError, DeadlineExceededError
from edgevlm.types import OperatingPoint

PROMPT = "what color is the circle ?"
BIG = {"name": "big", "resolution_px": 64, "accuracy": 0.9, "vision_ms": 300.0, "prefill_ms": 100.0, "tpot_ms": 10.0}
SMALL = {"name": "small", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 20.0, "prefill_ms": 20.0, "tpot_ms": 10.0}


@pytest.fixture
def frontier_path(tmp_path):
    data = {"created_utc": "2025-01-01T00:00:00+00:00", "model": "tiny", "device": "cpu float32 torch",
            "eval_items": 1, "eval_seed": 1000, "points": [BIG, SMALL], "frontier": [BIG, SMALL]}
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def image():
    return np.random.default_rng(5).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)


def _client(mosquitto):
    return Client(mosquitto.host, mosquitto.port, "dev1")


def _expected(engine, image, point):
    op = OperatingPoint(name=point["name"], resolution_px=point["resolution_px"])
    return engine.ask(image, PROMPT, max_new_tokens=4, operating_point=op).text


def test_budget_picks_the_point(run_daemon, mosquitto, plain_engine, frontier_path, image):
    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path)})
    with _client(mosquitto) as c:
        # big: 300 + 100 + 3 * 10 = 430 ms predicted; fits 1000 * 0.9
        a = c.ask(PROMPT, image=image, budget_ms=1000, max_new_tokens=4)
        assert a.stats.operating_point == "big" and a.stats.budget_ms == 1000
        assert a.stats.predicted_ms == pytest.approx(430, rel=0.01)
        assert a.text == _expected(plain_engine, image, BIG)
        # the live measurement moves the shared slowdown (alpha 0.3) and big's own figures slowly
        # (alpha/4): whatever the first request took, big stays above 270 ms and small below
        b = c.ask(PROMPT, image=image, budget_ms=300, max_new_tokens=4)
        assert b.stats.operating_point == "small" and b.stats.budget_ms == 300
        assert b.stats.predicted_ms <= 270
        assert b.text == _expected(plain_engine, image, SMALL)
    assert daemon.counters.get("responses_ok") == 2


def test_impossible_budget_is_refused_at_once(run_daemon, mosquitto, plain_engine, frontier_path, image):
    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path)})
    cheapest = daemon.scheduler.controller.service_ms(OperatingPoint(name="small"), 4)
    assert cheapest == pytest.approx(70.0)  # 20 + 20 + 3 * 10
    with _client(mosquitto) as c, pytest.raises(DeadlineExceededError) as exc:
        c.ask(PROMPT, image=image, budget_ms=10, max_new_tokens=4)
    assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(70.0)
    assert exc.value.details["budget_ms"] == 10
    assert daemon.counters.get("deadline_refused") == 1
    assert daemon.counters.get("responses_ok") == 0  # the engine never ran


def test_queue_wait_counts(run_daemon, mosquitto, plain_engine, frontier_path, image):
    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path)})
    results: dict[str, object] = {}
    with _client(mosquitto) as c1, _client(mosquitto) as c2:
        with daemon.scheduler.paused():
            t = threading.Thread(target=lambda: results.setdefault("a", c1.ask(PROMPT, image=image, budget_ms=5000,
                                                                                 max_new_tokens=4)))
            t.start()
            for _ in range(500):
                if daemon.scheduler.queue_size() == 1:
                    break
                threading.Event().wait(0.01)
            assert daemon.scheduler.queue_size() == 1
            wait = daemon.scheduler.predicted_wait_ms()
            assert wait == pytest.approx(430, rel=0.01)  # the queued request runs 'big'
            # alone, small (70 ms) would fit 200 ms; behind 430 ms of queue nothing does
            with pytest.raises(DeadlineExceededError) as exc:
                c2.ask(PROMPT, image=image, budget_ms=200, max_new_tokens=4)
            assert exc.value.details["queue_wait_ms"] == pytest.approx(430, rel=0.01)
            assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(500, rel=0.01)
        t.join(30)
    assert results["a"].stats.operating_point == "big"


def test_slowdown_hint(run_daemon, mosquitto, plain_engine, frontier_path, image):
    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path)})
    daemon.scheduler.controller.hint_slowdown(3.0)  # what the tegrastats throttling detector calls
    with _client(mosquitto) as c:
        a = c.ask(PROMPT, image=image, budget_ms=1000, max_new_tokens=4)  # big: 3 x 430 > 900
        assert a.stats.operating_point == "small"
        assert a.stats.predicted_ms == pytest.approx(210, rel=0.01)
        with pytest.raises(DeadlineExceededError) as exc:
            c.ask(PROMPT, image=image, budget_ms=100, max_new_tokens=4)
        assert exc.value.details["slowdown_hint"] == 3.0


def test_controller_off_runs_the_default(run_daemon, mosquitto, plain_engine, image):
    run_daemon(plain_engine, controller={"enabled": False})
    with _client(mosquitto) as c:
        a = c.ask(PROMPT, image=image, budget_ms=1, max_new_tokens=4)
    assert a.stats.operating_point == "default" and a.stats.budget_ms is None
    assert a.text == plain_engine.ask(image, PROMPT, max_new_tokens=4).text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"controller": {"alfa": 0.3}}, "controller.alfa: unknown key"),
        ({"controller": {"headroom": 1.5}}, "controller.headroom"),
        ({"controller": {"frontier": "/nonexistent/frontier.json"}}, "controller.frontier: file not found"),
        ({"profile": "no-such-device"}, "profile: profile 'no-such-device' not found"),
        ({"monitors": [{"name": "m", "source": "cam", "labels": ["red"]}]}, "monitors[0].source: unknown source"),
        ({"monitors": [{"name": "m/x", "source": "cam", "labels": ["red"]}]}, "monitors[0].name"),
        ({"monitors": [{"name": "m", "source": "cam", "labels": []}]}, "monitors[0].labels"),
    ],
)
def test_config_errors_name_the_key(extra, needle):
    with pytest.raises(ConfigError) as exc:
        parse_daemon_config(extra)
    assert needle in str(exc.value)


def test_profile_path_and_name(tmp_path):
    assert parse_daemon_config({"profile": "jetson-agx-orin-64gb"}).profile == "jetson-agx-orin-64gb"
    bad = tmp_path / "p.yaml"
    bad.write_text("name: p\n")
    with pytest.raises(ConfigError, match="profile: .*required"):
        parse_daemon_config({"profile": str(bad)})
