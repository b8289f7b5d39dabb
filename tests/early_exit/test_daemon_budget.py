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


# ------------------------------------------------------------------ requests without budget_ms


def test_without_budget_ms_the_timeout_is_the_deadline(run_daemon, mosquitto, plain_engine, frontier_path, image):
    # a default budget (50 ms) below the cheapest point's prediction (small: 70 ms)
    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path), "default_budget_ms": 50})
    with _client(mosquitto) as c:
        with pytest.raises(DeadlineExceededError) as exc:  # timeout 60 ms < 70 ms: refused at once
            c.ask(PROMPT, image=image, timeout_s=0.06, max_new_tokens=4)
        assert exc.value.details["timeout_ms"] == 60 and exc.value.details["planned_budget_ms"] == 50
        assert "budget_ms" not in exc.value.details  # the request gave none
        assert exc.value.details["cheapest_predicted_ms"] == pytest.approx(70.0)
        assert exc.value.message.startswith("timeout_ms 60 cannot be met")
        # the same request with a timeout the cheapest point can meet is answered, at that point
        a = c.ask(PROMPT, image=image, timeout_s=10, max_new_tokens=4)
        assert a.stats.operating_point == "small" and a.stats.budget_ms == 50
        assert a.stats.predicted_ms == pytest.approx(70.0, rel=0.01)
        assert a.text == _expected(plain_engine, image, SMALL)
        # a budget_ms longer than timeout_ms is capped by it: 300 ms, where only small fits
        b = c.ask(PROMPT, image=image, timeout_s=0.3, budget_ms=5000, max_new_tokens=4)
        assert b.stats.operating_point == "small" and b.stats.budget_ms == 300
    assert daemon.counters.get("deadline_refused") == 1 and daemon.counters.get("responses_ok") == 2


def test_readme_mosquitto_rr_request_without_budget(run_daemon, mosquitto, plain_engine, frontier_path, image):
    import base64
    import shutil
    import subprocess

    from edgevlm.client import encode_png

    rr = shutil.which("mosquitto_rr")
    if rr is None:
        pytest.skip("mosquitto_rr not installed")
    run_daemon(plain_engine, controller={"frontier": str(frontier_path), "default_budget_ms": 50})
    body = {"prompt": PROMPT, "image_b64": base64.b64encode(encode_png(image)).decode(), "max_new_tokens": 4,
            "timeout_ms": 10000}
    out = subprocess.run([rr, "-h", mosquitto.host, "-p", str(mosquitto.port), "-q", "1", "-t", "edgevlm/dev1/request",
                          "-e", "edgevlm/dev1/response/my-shell", "-D", "publish", "correlation-data", "req-42",
                          "-W", "30", "-m", json.dumps(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    assert resp["ok"] is True, resp
    assert resp["stats"]["operating_point"] == "small" and resp["stats"]["budget_ms"] == 50
    assert resp["text"] == _expected(plain_engine, image, SMALL)


@pytest.mark.parametrize(
    ("extra", "message", "details"),
    [
        # no budget_ms: the default budget (cpu profile: 2000 ms) is capped to the timeout, which
        # is the limit the refusal names
        ({"timeout_ms": 10}, "timeout_ms 10", {"planned_budget_ms": 10, "timeout_ms": 10, "limit": "timeout_ms"}),
        ({"budget_ms": 5000, "timeout_ms": 10}, "timeout_ms 10",
         {"planned_budget_ms": 10, "timeout_ms": 10, "budget_ms": 5000, "limit": "timeout_ms"}),
        ({"budget_ms": 10, "timeout_ms": 5000}, "budget_ms 10", {"planned_budget_ms": 10, "budget_ms": 10}),
    ],
)
def test_refusal_on_the_wire_names_timeout_or_budget(run_daemon, mosquitto, plain_engine, frontier_path, image,
                                                     extra, message, details):
    import base64
    import shutil
    import subprocess

    from edgevlm.client import encode_png

    rr = shutil.which("mosquitto_rr")
    if rr is None:
        pytest.skip("mosquitto_rr not installed")
    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path)})
    assert daemon.scheduler.controller.default_budget_ms == 2000  # the cpu profile's
    body = {"prompt": PROMPT, "image_b64": base64.b64encode(encode_png(image)).decode(), "max_new_tokens": 4,
            **extra}
    out = subprocess.run([rr, "-h", mosquitto.host, "-p", str(mosquitto.port), "-q", "1", "-t", "edgevlm/dev1/request",
                          "-e", "edgevlm/dev1/response/h", "-D", "publish", "correlation-data", "r1",
                          "-W", "30", "-m", json.dumps(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    assert resp["ok"] is False and resp["error"]["code"] == "DEADLINE_EXCEEDED", resp
    assert resp["error"]["message"] == (f"{message} cannot be met: the cheapest operating point is predicted "
                                        "to take 70 ms (queue wait 0 ms included)")
    got = resp["error"]["details"]
    assert got.pop("cheapest_predicted_ms") == pytest.approx(70.0)
    assert got == {"queue_wait_ms": 0.0, "slowdown_hint": 1.0, "slowdown": 1.0, **details}
    assert daemon.counters.get("deadline_refused") == 1 and daemon.counters.get("responses_ok") == 0


FAST_BIG = {"name": "big", "resolution_px": 64, "accuracy": 0.9, "vision_ms": 4.0, "prefill_ms": 4.0, "tpot_ms": 1.0}
FAST_SMALL = {"name": "small", "resolution_px": 32, "accuracy": 0.5, "vision_ms": 1.0, "prefill_ms": 1.0,
              "tpot_ms": 1.0}


def test_slow_first_requests_do_not_make_the_daemon_refuse(run_daemon, mosquitto, plain_model_dir, tmp_path, image):
    """Outliers after start (torch warm-up, a co-located job) are clipped: later requests with a
    budget the device meets are admitted, not refused on a slowdown learned from three outliers."""
    from edgevlm.runtime import Engine
    from edgevlm.runtime.slowdown import inject_slowdown

    data = {"created_utc": "2025-01-01T00:00:00+00:00", "model": "tiny", "device": "cpu float32 torch",
            "eval_items": 1, "eval_seed": 1000, "points": [FAST_BIG, FAST_SMALL], "frontier": [FAST_BIG, FAST_SMALL]}
    (tmp_path / "fast.json").write_text(json.dumps(data))
    engine = Engine.load(plain_model_dir)
    hook = inject_slowdown(engine, 1.0)
    daemon = run_daemon(engine, controller={"frontier": str(tmp_path / "fast.json")})
    ctl = daemon.scheduler.controller
    with _client(mosquitto) as c:
        hook.factor = 60.0  # every stage takes 60x as long: far beyond the 3x one observation may count
        for _ in range(3):
            a = c.ask(PROMPT, image=image, max_new_tokens=4, timeout_s=30)  # no budget_ms: never refused
            assert a.text == _expected(engine, image, FAST_SMALL if a.stats.operating_point == "small" else FAST_BIG)
        assert ctl.controller.slowdown <= (0.7 + 0.3 * 3) ** 3 + 1e-9  # at most 1.6x per outlier
        hook.factor = 1.0
        # small is predicted <= 4.1 x (1 + 1 + 3 x 1) x 3 (its own figures moved <= 3x) = 62 ms: admitted
        # (without the clipping the slowdown would be at its cap of 50x: 250 ms, refused)
        answers = [c.ask(PROMPT, image=image, budget_ms=150, max_new_tokens=4) for _ in range(3)]
    assert all(x.stats.budget_ms == 150 for x in answers)
    assert daemon.counters.get("deadline_refused") == 0 and daemon.counters.get("responses_ok") == 6


def test_warm_up_logs_a_point_the_engine_refuses(exit_engine, caplog):
    from edgevlm.daemon.budget import warm_up
    from edgevlm.runtime.policy import PointProfile

    good = PointProfile(OperatingPoint(name="good", resolution_px=32), 0.9, 1, 1, 1)
    bad = PointProfile(OperatingPoint(name="bad", exit_layer=3), 0.5, 1, 1, 1)  # exits are at blocks 1 and 2
    with caplog.at_level("WARNING", logger="edgevlm.daemon.budget"):
        warm_up(exit_engine, [good, bad])  # logged, not raised: the daemon still starts
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and msgs[0].startswith("controller: warm-up of bad failed: InvalidRequestError")


def test_refusal_over_a_message_expiry_interval_names_it_not_timeout_ms(run_daemon, mosquitto, plain_engine,
                                                                       frontier_path, image) -> None:  # fmt: skip
    """A client that is not the SDK (mosquitto_rr, a C++ node) sets a Message Expiry Interval and no timeout_ms:
    the refusal named 'timeout_ms 5000', a field the request never had. It names the interval (details.limit
    'message_expiry', as a request that expires in the queue); a request's own timeout_ms is still named."""
    import base64

    import cv2
    from mqtt_support import RecordingClient
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    daemon = run_daemon(plain_engine, controller={"frontier": str(frontier_path)})
    daemon.scheduler.controller.hint_slowdown(50.0)  # the cheapest point: 3.5 s predicted
    raw = RecordingClient(mosquitto.host, mosquitto.port)
    try:
        raw.subscribe("test/budget")
        png = base64.b64encode(cv2.imencode(".png", image)[1].tobytes()).decode()
        for i, (extra, expiry_s) in enumerate([({}, 2), ({"timeout_ms": 3000}, None)]):
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic, props.CorrelationData = "test/budget", b"e%d" % i
            if expiry_s is not None:
                props.MessageExpiryInterval = expiry_s
            body = json.dumps({"prompt": PROMPT, "image_b64": png, **extra}).encode()
            raw.client.publish("edgevlm/dev1/request", body, qos=1, properties=props).wait_for_publish(5)
        by_corr = {m.properties.CorrelationData: json.loads(m.payload).get("error", {})
                   for m in raw.wait_messages("test/budget", 2, timeout_s=5)}  # fmt: skip
    finally:
        raw.close()
    expired, timed = by_corr[b"e0"], by_corr[b"e1"]
    assert expired["code"] == "DEADLINE_EXCEEDED" and expired["details"]["limit"] == "message_expiry", expired
    assert expired["message"].startswith("the Message Expiry Interval of 2000 ms cannot be met: "), expired
    assert "timeout_ms" not in expired["message"] and expired["details"]["timeout_ms"] == 2000
    assert timed["message"].startswith("timeout_ms 3000 cannot be met: ") and timed["details"]["limit"] == "timeout_ms"
    assert daemon.counters.get("deadline_refused") == 2 and daemon.counters.get("responses_ok") == 0
