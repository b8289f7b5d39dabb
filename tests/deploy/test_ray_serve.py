"""``edgevlm serve-ray`` on this CPU: 2 Ray Serve replicas of the tiny model behind the OpenAI API.

Real Ray (a local instance, 2 CPUs), real replicas loading the tiny random checkpoint, the real
``openai`` client: answers equal ``Engine.ask`` on the same image; a replica killed with SIGKILL in
the middle of a load loses no request (the ingress sends it to the other replica); streaming works
through the replica's generator; a camera request is ``UNKNOWN_SOURCE`` (replicas have no cameras).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _png(seed: int) -> tuple[str, np.ndarray]:
    import cv2

    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".png", img[:, :, ::-1].copy())
    assert ok
    return f"data:image/png;base64,{base64.b64encode(buf.tobytes()).decode()}", img


def _messages(uri: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is in the picture ?"},
                                         {"type": "image_url", "image_url": {"url": uri}}]}]


@pytest.fixture(scope="module")
def ray_app(tiny_model_dir):
    import ray
    from ray import serve

    from edgevlm.config import DaemonConfig
    from edgevlm.daemon.ray_serve import run

    port = _free_port()
    cfg = DaemonConfig.model_validate({
        "model": {"path": str(tiny_model_dir), "device": "cpu", "cpu_threads": 1},
        "http": {"port": port, "model_name": "tiny"},
        "defaults": {"max_new_tokens": 6, "timeout_ms": 120000},
        "ray": {"min_replicas": 2, "max_replicas": 2, "num_cpus_per_replica": 0.5, "request_retries": 3},
    })
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def serve_forever() -> None:
        try:
            run(cfg, stop_event=stop, ready=ready)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=serve_forever, daemon=True)
    thread.start()
    assert ready.wait(240), "serve-ray did not come up"
    assert not errors, errors
    handle = serve.get_deployment_handle("engine", app_name="edgevlm")
    yield port, handle
    stop.set()
    thread.join(60)


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def test_answers_equal_the_engine(ray_app, tiny_engine) -> None:
    port, _ = ray_app
    client = _client(port)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"  # GET /v1/models/{id}, as edgevlm serve's API
    with pytest.raises(openai.NotFoundError) as not_found:
        client.models.retrieve("other")
    assert not_found.value.body["code"] == "model_not_found" and "'tiny'" in not_found.value.body["message"]
    for seed in range(3):
        uri, img = _png(seed)
        out = client.chat.completions.create(model="tiny", messages=_messages(uri), max_tokens=6)
        assert out.choices[0].message.content == tiny_engine.ask(img, "what is in the picture ?",
                                                                 max_new_tokens=6).text


def test_streaming_through_a_replica(ray_app, tiny_engine) -> None:
    port, _ = ray_app
    uri, img = _png(7)
    chunks = list(_client(port).chat.completions.create(model="tiny", messages=_messages(uri), max_tokens=6,
                                                       stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tiny_engine.ask(img, "what is in the picture ?", max_new_tokens=6).text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_camera_request_is_unknown_source(ray_app) -> None:
    port, _ = ray_app
    with pytest.raises(openai.NotFoundError) as info:
        _client(port).chat.completions.create(model="tiny", messages=_messages("edgevlm://sources/front"))
    assert info.value.body["code"] == "UNKNOWN_SOURCE" and "no cameras" in info.value.body["message"]


def test_replica_killed_mid_load_loses_nothing(ray_app, tiny_engine) -> None:
    port, handle = ray_app
    pids: set[int] = set()
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        pids.add(handle.pid.remote().result())
    assert len(pids) == 2, f"expected 2 replicas, saw {pids}"
    victim = sorted(pids)[0]
    client = _client(port)
    inputs = [_png(100 + i) for i in range(40)]
    results: dict[int, str] = {}
    served: dict[int, str] = {}
    failures: list[BaseException] = []

    def ask(i: int) -> None:
        uri, _ = inputs[i]
        try:
            out = client.chat.completions.create(model="tiny", messages=_messages(uri), max_tokens=6)
            results[i] = out.choices[0].message.content
            served[i] = out.model_extra["edgevlm"]["stats"]["served_by"]
        except BaseException as exc:  # noqa: BLE001 - collected, asserted below
            failures.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    # the load is under way and both replicas have answered (the router may send the first few to one replica:
    # killing then made "both replicas answered" below a race, seen once on a 2-core CI machine)
    while (len(results) < 3 or len(set(served.values())) < 2) and time.monotonic() < deadline + 60:
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not failures, failures
    assert len(results) == len(inputs)  # 0 lost
    assert len(set(served.values())) >= 2  # both replicas answered (the victim before it died)
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)  # it really died mid-load
    # requests the victim held were sent to the other replica by the ingress (replica_retries) or,
    # when not yet started there, re-routed by Ray's own router: either way none was lost
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30).read())
    assert health["status"] == "ok" and isinstance(health["replica_retries"], int)
    for i, (_, img) in enumerate(inputs):
        assert results[i] == tiny_engine.ask(img, "what is in the picture ?", max_new_tokens=6).text
