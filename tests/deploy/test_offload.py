"""Edge-to-pool offload through a mosquitto bridge (two real brokers, two real daemons).

The edge broker bridges the pool's request topic out to the cloud broker, and the pool's response
topics and the daemons' statuses back in (MQTT v5 bridge, so Response Topic and Correlation Data
survive). The edge daemon runs the demo model made 100x slower (``inject_slowdown`` plus the
controller's slowdown hint, as a throttled Orin); the pool member on the cloud broker runs it at full
speed. A request whose budget the edge cannot meet is answered by the pool within the budget, on the
requester's own Response Topic with its Correlation Data (the requester never knows); one naming a
model only the pool serves goes there too. With the pool gone, the edge refuses as it did before.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest

from edgevlm.client import Client
from edgevlm.errors import DeadlineExceededError, InvalidRequestError

pytestmark = pytest.mark.slow

QUESTION = "how many shapes are there?"


@pytest.fixture(scope="module")
def scene() -> tuple[np.ndarray, str]:
    """The middle frame of the scene video's first segment and the true answer to QUESTION."""
    import cv2

    from edgevlm.runtime import demo

    seg = json.loads(demo.scenes_json_path().read_text())["segments"][0]
    truth = next(q["answer"] for q in seg["questions"] if q["question"] == QUESTION)
    cap = cv2.VideoCapture(str(demo.video_path()))
    for _ in range((seg["start_frame"] + seg["end_frame"]) // 2 + 1):
        ok, bgr = cap.read()
    cap.release()
    assert ok
    return bgr[:, :, ::-1].copy(), truth


def _daemon(port: int, device_id: str, engine, **mqtt):
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon

    sections = {k: mqtt.pop(k) for k in ("offload", "http") if k in mqtt}
    cfg = DaemonConfig.model_validate({
        "mqtt": {"host": "127.0.0.1", "port": port, "device_id": device_id, "reconnect_min_delay_s": 0.2,
                 "reconnect_max_delay_s": 1.0, **mqtt},
        "defaults": {"max_new_tokens": 8, "timeout_ms": 60000}, "metrics": {"listen": None}, **sections})
    d = Daemon(cfg, engine=engine)
    d.start()
    assert d.wait_ready(20)
    return d


def test_offload_through_a_bridge(custom_broker, scene) -> None:
    frame, truth = scene
    from edgevlm.runtime import Engine
    from edgevlm.runtime.slowdown import inject_slowdown

    cloud = custom_broker.start(["allow_anonymous true", "set_tcp_nodelay true"], name="cloud")
    edge = custom_broker.start([
        "allow_anonymous true", "set_tcp_nodelay true",
        "connection cloud", f"address 127.0.0.1:{cloud}", "bridge_protocol_version mqttv50", "cleansession true",
        "topic edgevlm/pools/+/request out 1", "topic edgevlm/pools/+/response/# in 1", "topic edgevlm/+/status in 1",
    ], name="edge")
    slow_engine, fast_engine = Engine.load(None, device="cpu"), Engine.load(None, device="cpu")
    member = _daemon(cloud, "cloud-1", fast_engine, pool="gpu", http={"model_name": "big-model"})
    edge_daemon = _daemon(edge, "robot-1", slow_engine, offload={"pool": "gpu", "margin_ms": 50})
    try:
        inject_slowdown(slow_engine, 100.0)
        edge_daemon.scheduler.controller.hint_slowdown(100.0)
        deadline = time.monotonic() + 30
        while not edge_daemon.offload.available():  # the member's status crossed the bridge
            assert time.monotonic() < deadline, "the pool never came online at the edge"
            time.sleep(0.1)
        png = base64.b64encode(_png(frame)).decode()
        with Client("127.0.0.1", edge, "robot-1") as client:
            # the edge alone would need ~100x its normal time: the pool answers within the budget
            t0 = time.perf_counter()
            answer = client.ask(QUESTION, image=frame, budget_ms=800, timeout_s=30)
            rtt_ms = (time.perf_counter() - t0) * 1000
            assert answer.stats.offloaded_to == "gpu"
            assert answer.stats.offload_ms >= 0
            assert rtt_ms < 800
            assert answer.text.strip() == truth  # answered by the pool's model (the edge's is too slow)
            # a model only the pool serves
            body = {"prompt": QUESTION, "image_b64": png, "model": "big-model", "timeout_ms": 30000}
            other = client.ask(QUESTION, image=frame, model="big-model", timeout_s=30)
            assert other.stats.offloaded_to == "gpu" and other.text
            # the pool is gone: the edge refuses as without offload
            member.stop()
            while edge_daemon.offload.available():
                assert time.monotonic() < deadline + 30, "the member's offline status never reached the edge"
                time.sleep(0.1)
            with pytest.raises(DeadlineExceededError, match="budget_ms 800 cannot be met"):
                client.ask(QUESTION, image=frame, budget_ms=800, timeout_s=30)
            with pytest.raises(InvalidRequestError, match="'big-model' is not served here"):
                client.request(json.dumps(body).encode(), timeout_s=30)
    finally:
        edge_daemon.stop()
        member.stop()


def _png(rgb: np.ndarray) -> bytes:
    from edgevlm.client import encode_png

    return encode_png(rgb)

