"""The request's sampling knobs on the MQTT wire (``temperature``, ``top_p``, ``stop``, ``seed``).

Real daemon, real mosquitto, the shipped demo model: a stop string cuts the answer exactly where
``Engine.ask`` with the same stop string does; seeded sampling repeats; bad values are refused with
``INVALID_REQUEST`` naming the field.
"""

from __future__ import annotations

import base64
import json
import uuid

import numpy as np
import pytest

from edgevlm.protocol import parse_request

REQUEST_TOPIC = "edgevlm/dev1/request"
QUESTION = "describe the scene."


@pytest.fixture(scope="module")
def demo_engine():
    from edgevlm.runtime import Engine

    return Engine.load(None, device="cpu")


@pytest.fixture(scope="module")
def frame() -> np.ndarray:
    import cv2

    from edgevlm.runtime import demo

    cap = cv2.VideoCapture(str(demo.video_path()))
    for _ in range(15):
        ok, bgr = cap.read()
    cap.release()
    assert ok
    return bgr[:, :, ::-1].copy()


def _ask(raw, image_png: bytes, **fields) -> dict:
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    body = {"prompt": QUESTION, "image_b64": base64.b64encode(image_png).decode(), "max_new_tokens": 16, **fields}
    raw.publish(REQUEST_TOPIC, json.dumps(body).encode(), response_topic=reply, correlation=b"c")
    return json.loads(raw.wait_messages(reply, 1)[0].payload)


def test_stop_and_seeded_sampling_over_mqtt(start_daemon, raw_client, demo_engine, frame, encode_image) -> None:
    start_daemon(engine=demo_engine, defaults={"max_new_tokens": 16, "timeout_ms": 120000})
    raw = raw_client()
    png = encode_image(frame)
    full = demo_engine.ask(frame, QUESTION, max_new_tokens=16).text
    assert " " in full
    out = _ask(raw, png, stop=[" "])
    assert out["ok"] and out["text"] == full.split(" ")[0] == demo_engine.ask(
        frame, QUESTION, max_new_tokens=16, stop=[" "]).text
    sampled = [_ask(raw, png, temperature=1.5, top_p=0.9, seed=7)["text"] for _ in range(2)]
    assert sampled[0] == sampled[1] == demo_engine.ask(frame, QUESTION, max_new_tokens=16, temperature=1.5,
                                                       top_p=0.9, seed=7).text
    bad = _ask(raw, png, temperature="1")
    assert bad["error"]["code"] == "INVALID_REQUEST" and bad["error"]["message"].startswith("temperature")


def test_sdk_ask_sends_the_sampling_knobs(start_daemon, mosquitto, demo_engine, frame, encode_image) -> None:
    """``Client.ask(temperature=, top_p=, stop=, seed=)`` (the SDK used to take none of them: the wire's
    sampling was reachable only through ``client.request`` with hand-written JSON); ``request`` with a
    dict is a TypeError naming bytes."""
    from edgevlm import Client
    from edgevlm.errors import InvalidRequestError

    start_daemon(engine=demo_engine, defaults={"max_new_tokens": 16, "timeout_ms": 120000})
    png = encode_image(frame)
    with Client(mosquitto.host, mosquitto.port, device_id="dev1") as client:
        sampled = client.ask(QUESTION, image=png, max_new_tokens=16, temperature=1.5, top_p=0.9, seed=7, timeout_s=60)
        assert sampled.text == demo_engine.ask(frame, QUESTION, max_new_tokens=16, temperature=1.5, top_p=0.9,
                                               seed=7).text
        cut = client.ask(QUESTION, image=png, max_new_tokens=16, stop=[" "], timeout_s=60)
        assert cut.text == demo_engine.ask(frame, QUESTION, max_new_tokens=16, stop=[" "]).text and " " not in cut.text
        with pytest.raises(InvalidRequestError, match="^temperature"):
            client.ask(QUESTION, image=png, temperature=5)
        with pytest.raises(TypeError, match=r"payload must be the encoded request JSON \(bytes\), got dict"):
            client.request({"prompt": "hi", "source": "front"})


@pytest.mark.parametrize("field,value", [
    ("temperature", "1"), ("temperature", True), ("temperature", 2.5), ("temperature", -0.1),
    ("top_p", 0), ("top_p", 1.5), ("stop", "x"), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [1]), ("stop", [""]), ("stop", ["a", ""]),
    ("seed", -1), ("seed", 1.0),
])
def test_bad_sampling_fields_are_refused(field, value) -> None:
    from edgevlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        parse_request({"prompt": "hi", "source": "front", field: value})
    assert info.value.message.startswith(field)
