"""Monitors in the daemon: exit classifier on a looping video source, debounced events on a real
broker, monitors yielding to requests; the classifier is trained in the test (fit_classifier) to
tell red frames from green ones on the tiny real model."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest

from edgevlm.errors import ConfigError

torch = pytest.importorskip("torch")

RED, GREEN, BLUE = (220, 30, 30), (30, 200, 40), (40, 60, 220)
SEGMENT = 10  # frames per colour segment in the test video (10 fps: 1 s)


def _frame(rgb, rng, noise=12.0):
    img = np.empty((48, 64, 3), np.float32)
    img[:] = rgb
    img += rng.normal(0, noise, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def monitor_model(tmp_path_factory, plain_model_dir):
    """The tiny checkpoint plus exit heads whose classifiers detect red / green / blue frames."""
    from edgevlm.quantize.calibrate import fit_classifier
    from edgevlm.runtime import Engine
    from edgevlm.runtime.exits import ExitHeads, make_spec, save_exit_heads

    d = tmp_path_factory.mktemp("monitor_model") / "m"
    shutil.copytree(plain_model_dir, d)
    engine = Engine.load(d)
    heads = ExitHeads(make_spec(engine.config, exit_blocks=[1, 2], labels=["red", "green", "blue"], head_hidden=16))
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    images, targets = [], []
    for _ in range(6):
        for rgb, t in ((RED, [1, 0, 0]), (GREEN, [0, 1, 0]), (BLUE, [0, 0, 1]), ((90, 90, 90), [0, 0, 0])):
            images.append(_frame(rgb, rng))
            targets.append(t)
    acc = fit_classifier(engine, heads, images, np.asarray(targets), rung=64, steps=150)
    assert min(acc.values()) == 1.0, acc
    save_exit_heads(heads, d)
    return d


@pytest.fixture(scope="module")
def monitor_engine(monitor_model):
    from edgevlm.runtime import Engine

    return Engine.load(monitor_model)


def test_classifier_generalises(monitor_engine):
    rng = np.random.default_rng(99)
    for rgb, want in ((RED, "red"), (GREEN, "green"), (BLUE, "blue")):
        probs = monitor_engine.classify(_frame(rgb, rng), resolution_px=64, block=1)
        assert max(probs, key=probs.get) == want and probs[want] > 0.5, probs


@pytest.fixture
def video(tmp_path):
    import cv2

    path = tmp_path / "colours.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (64, 48))
    rng = np.random.default_rng(1)
    for i in range(4 * SEGMENT):
        rgb = RED if (i // SEGMENT) % 2 == 0 else GREEN
        writer.write(_frame(rgb, rng, noise=4.0)[:, :, ::-1].copy())
    writer.release()
    return path


class Events:
    def __init__(self, host, port, topic):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.items: list[dict] = []
        self.cond = threading.Condition()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        self.client.subscribe(topic, qos=1)

    def _on_message(self, client, userdata, msg):
        with self.cond:
            self.items.append(json.loads(msg.payload))
            self.cond.notify_all()

    def wait(self, n, timeout_s=30.0):
        with self.cond:
            self.cond.wait_for(lambda: len(self.items) >= n, timeout_s)
            return list(self.items)

    def close(self):
        self.client.disconnect()
        self.client.loop_stop()


def test_monitor_publishes_debounced_changes(run_daemon, mosquitto, monitor_engine, video):
    events = Events(mosquitto.host, mosquitto.port, "edgevlm/dev1/events/red_seen")
    time.sleep(0.2)
    try:
        daemon = run_daemon(
            monitor_engine,
            sources=[{"name": "cam", "uri": str(video)}],
            monitors=[{"name": "red_seen", "source": "cam", "labels": ["red"], "fps": 20, "debounce_frames": 2,
                       "resolution_px": 64, "exit_layer": 1}],
            controller={"enabled": False},
        )
        got = events.wait(4, timeout_s=30)
    finally:
        events.close()
    assert len(got) >= 4, got
    for prev, ev in zip(got, got[1:], strict=False):
        assert ev["previous"] == prev["present"] and ev["present"] != prev["present"]
        assert ev["frame_ts"] > prev["frame_ts"]
    for ev in got:
        red_segment = (ev["frame_index"] // SEGMENT) % 2 == 0
        assert ev["present"] == (["red"] if red_segment else []), ev
        assert ev["labels"] == {"red": red_segment}
        assert ev["monitor"] == "red_seen" and ev["source"] == "cam" and ev["exit_layer"] == 1
        assert ev["resolution_px"] == 64 and 0 <= ev["scores"]["red"] <= 1
    assert got[0]["previous"] is None
    snap = daemon.scheduler.monitors.snapshot()["red_seen"]
    assert snap["events"] >= 4 and snap["errors"] == 0 and snap["ticks"] >= 8


def test_requests_go_first(run_daemon, mosquitto, monitor_engine, video):
    """With a monitor due all the time (60 fps), requests are still answered, and every tick runs
    only while the queue is empty."""
    from edgevlm import Client

    daemon = run_daemon(
        monitor_engine,
        sources=[{"name": "cam", "uri": str(video)}],
        monitors=[{"name": "busy", "source": "cam", "labels": ["green"], "fps": 60, "resolution_px": 64}],
        controller={"enabled": False},
    )
    sched = daemon.scheduler
    seen_queue: list[int] = []
    original = sched.monitors.run_due

    def spy(engine):
        seen_queue.append(sched.queue_size())
        return original(engine)

    sched.monitors.run_due = spy
    with Client(mosquitto.host, mosquitto.port, "dev1") as c:
        answers = [c.ask("what color ?", source="cam", max_new_tokens=2) for _ in range(3)]
    assert all(a.source == "cam" for a in answers)
    deadline = time.monotonic() + 10  # on a loaded machine the first tick may come after the answers
    while not seen_queue and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen_queue and set(seen_queue) == {0}


def test_monitor_label_unknown_fails_startup(run_daemon, monitor_engine, video):
    with pytest.raises(ConfigError, match=r"monitors\[0\].labels: unknown label"):
        run_daemon(monitor_engine, sources=[{"name": "cam", "uri": str(video)}],
                   monitors=[{"name": "m", "source": "cam", "labels": ["purple"]}])


def test_monitor_without_classifier_fails_startup(run_daemon, plain_engine, video):
    with pytest.raises(ConfigError, match="no exit classifier"):
        run_daemon(plain_engine, sources=[{"name": "cam", "uri": str(video)}],
                   monitors=[{"name": "m", "source": "cam", "labels": ["red"]}])


def test_monitor_bad_exit_layer_fails_startup(run_daemon, monitor_engine, video):
    with pytest.raises(ConfigError, match=r"monitors\[0\].exit_layer: no classifier after block 3"):
        run_daemon(monitor_engine, sources=[{"name": "cam", "uri": str(video)}],
                   monitors=[{"name": "m", "source": "cam", "labels": ["red"], "exit_layer": 3}])


def test_monitor_resolution_out_of_range_fails_startup(run_daemon, monitor_engine, video):
    """monitors[].resolution_px above MAX_RESOLUTION_PX was accepted and then warned on every tick forever;
    one below the patch size ran the classifier on a patch-sized image without a word. Both now fail
    like the other monitor keys: config (and --check-config) and start-up name monitors[0].resolution_px."""
    from edgevlm.config import parse_daemon_config
    from edgevlm.types import MAX_RESOLUTION_PX

    mon = {"name": "m", "source": "cam", "labels": ["red"]}
    with pytest.raises(ConfigError, match=rf"monitors\[0\]\.resolution_px: .*{MAX_RESOLUTION_PX}"):
        parse_daemon_config({"sources": [{"name": "cam", "uri": str(video)}],
                             "monitors": [{**mon, "resolution_px": MAX_RESOLUTION_PX + 1}]})
    patch = monitor_engine.patch_size_px
    with pytest.raises(ConfigError, match=rf"^monitors\[0\]\.resolution_px: {patch - 1} px is below the model's "
                                          rf"patch size \({patch} px\)"):
        run_daemon(monitor_engine, sources=[{"name": "cam", "uri": str(video)}],
                   monitors=[{**mon, "resolution_px": patch - 1}])


class ScriptedSource:
    """A source whose newest frame the test sets (the SourceManager/FrameSource reading interface)."""

    def __init__(self):
        self.frame = None

    def get(self, name):
        return self

    def latest(self):
        return self.frame


def test_debounce_suppresses_flicker(monitor_engine):
    """Frames red, red, green (one frame only), red, green, green: with debounce 2 the states
    published are [red] then [] — the one-frame flicker is never published, a repeated frame
    (same seq) is skipped."""
    from edgevlm.config import MonitorConfig
    from edgevlm.daemon.monitors import MonitorRunner
    from edgevlm.daemon.sources import CapturedFrame

    src = ScriptedSource()
    published = []
    runner = MonitorRunner([MonitorConfig(name="m", source="cam", labels=["red"], fps=60, debounce_frames=2,
                                          resolution_px=64, exit_layer=1)],
                           src, lambda t, p: published.append((t, json.loads(p))), prefix="edgevlm", device_id="d")
    runner.attach(monitor_engine)
    rng = np.random.default_rng(7)
    script = [RED, RED, GREEN, RED, GREEN, GREEN, GREEN]
    for seq, rgb in enumerate(script, start=1):
        src.frame = CapturedFrame("cam", _frame(rgb, rng), ts=1000.0 + seq, pos_ms=None, index=seq, seq=seq)
        for _ in range(2):  # the second tick sees the same frame: skipped
            runner.states[0].next_due = 0.0
            runner.run_due(monitor_engine)
    assert [p["present"] for _, p in published] == [["red"], []]
    assert [p["frame_index"] for _, p in published] == [2, 6]  # the frames that completed the debounce
    assert published[0][0] == "edgevlm/d/events/m"
    snap = runner.snapshot()["m"]
    assert snap["ticks"] == 7 and snap["skipped"] == 7 and snap["events"] == 2 and snap["present"] == []
