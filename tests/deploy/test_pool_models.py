"""A pool whose members serve different models (real mosquitto, two real daemons, the tiny checkpoint).

The broker hands a pool request to any member of the shared subscription, so a request naming a model
only one member serves used to reach the other member half the time and be refused there with
``INVALID_REQUEST`` "not served here". Members now announce the id a request's ``model`` names
(``model_id`` in their retained status) and watch each other's statuses: a member handed a pool
request for a model another online member serves passes it on, unchanged, to that member's own
request topic, which answers the requester on its Response Topic with its Correlation Data.
"""

from __future__ import annotations

import base64
import json
import time
import uuid

import numpy as np
import pytest
from mqtt_support import RecordingClient

from edgevlm.client import encode_png

pytestmark = pytest.mark.slow


def _daemon(port: int, device_id: str, engine, model_name: str):
    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.app import Daemon

    cfg = DaemonConfig.model_validate({
        "mqtt": {"host": "127.0.0.1", "port": port, "device_id": device_id, "pool": "gpu",
                 "reconnect_min_delay_s": 0.2, "reconnect_max_delay_s": 1.0},
        "http": {"model_name": model_name}, "queue_max_size": 16,
        "defaults": {"max_new_tokens": 2, "timeout_ms": 30000}, "metrics": {"listen": None}})
    d = Daemon(cfg, engine=engine)
    d.start()
    assert d.wait_ready(20)
    return d


def test_a_request_for_one_members_model_reaches_that_member(mosquitto, tiny_model_dir, tiny_engine) -> None:
    from edgevlm.runtime import Engine

    a = _daemon(mosquitto.port, "a", tiny_engine, "model-a")
    b = _daemon(mosquitto.port, "b", Engine.load(tiny_model_dir, device="cpu"), "model-b")
    w = RecordingClient(mosquitto.host, mosquitto.port)
    try:
        w.subscribe("edgevlm/+/status")
        deadline = time.monotonic() + 10
        while True:  # both members know each other's model
            ids = {d: m.get("model_id") for d, m in ((t.split("/")[1], json.loads(x.payload))
                                                     for t, xs in w.messages.items() for x in xs)}  # fmt: skip
            if ids == {"a": "model-a", "b": "model-b"} and len(a.bridge._peers) == 1 and len(b.bridge._peers) == 1:
                break
            assert time.monotonic() < deadline, ids
            time.sleep(0.05)
        png = base64.b64encode(encode_png(np.zeros((16, 16, 3), np.uint8))).decode()
        resp = f"test/resp/{uuid.uuid4().hex}"
        w.subscribe(resp)
        asks = {f"b-{i}".encode(): "model-b" for i in range(6)} | {f"a-{i}".encode(): "model-a" for i in range(2)}
        asks[b"nobody"] = "model-c"
        for corr, model in asks.items():
            body = {"prompt": "what?", "image_b64": png, "model": model, "max_new_tokens": 2}
            w.publish("edgevlm/pools/gpu/request", json.dumps(body).encode(), response_topic=resp, correlation=corr)
        msgs = w.wait_messages(resp, len(asks), 20)
        time.sleep(0.3)  # nothing answered twice
        got = {bytes(m.properties.CorrelationData): json.loads(m.payload) for m in w.messages[resp]}
        assert len(w.messages[resp]) == len(asks) == len(got), [m.payload[:80] for m in msgs]
        for corr, model in asks.items():
            if model == "model-c":  # served by no member: a typed refusal, as before
                assert got[corr]["error"]["code"] == "INVALID_REQUEST"
                assert "'model-c' is not served here" in got[corr]["error"]["message"]
            else:
                assert got[corr]["ok"], got[corr]
        # each question ran on the member serving its model; the broker gave some to the other one,
        # which handed them on (mosquitto hands a shared subscription's messages round robin)
        assert a.scheduler.counters.get("responses_ok") == 2
        assert b.scheduler.counters.get("responses_ok") == 6
        assert a.scheduler.counters.get("forwarded_to_member") + b.scheduler.counters.get("forwarded_to_member") >= 1
    finally:
        w.client.disconnect()
        a.stop()
        b.stop()
