"""The OpenAI-compatible HTTP API through the real ``openai`` client (sync, async, streaming) and curl.

A real daemon (real mosquitto, the shipped demo model on frames of the bundled scene video) serves
``http:`` on a free loopback port; answers must equal ``Engine.ask`` on the same frame and question.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import subprocess
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

QUESTION = "describe the scene."


@pytest.fixture(scope="module")
def demo_engine():
    from edgevlm.runtime import Engine

    return Engine.load(None, device="cpu")


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    """The middle frame of the first three segments of the bundled scene video (RGB)."""
    import cv2

    from edgevlm.runtime import demo

    truth = json.loads(demo.scenes_json_path().read_text())
    wanted = [(s["start_frame"] + s["end_frame"]) // 2 for s in truth["segments"][:3]]
    cap = cv2.VideoCapture(str(demo.video_path()))
    out, index = {}, 0
    ok, bgr = cap.read()
    while ok and len(out) < len(wanted):
        if index in wanted:
            out[index] = bgr[:, :, ::-1].copy()
        index += 1
        ok, bgr = cap.read()
    cap.release()
    return [out[i] for i in wanted]


def data_uri(rgb: np.ndarray, ext: str = ".jpg") -> str:
    import cv2

    ok, buf = cv2.imencode(ext, rgb[:, :, ::-1].copy())
    assert ok
    mime = "image/jpeg" if ext == ".jpg" else "image/png"
    return f"data:{mime};base64,{base64.b64encode(buf.tobytes()).decode()}"


def decoded(uri: str) -> np.ndarray:
    """What the daemon decodes from a data URI (the engine's reference input)."""
    from edgevlm.runtime.image import decode_image

    return decode_image(base64.b64decode(uri.split(",", 1)[1]))


def user(text: str, *urls: str, text_first: bool = False) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    txt = [{"type": "text", "text": text}]
    return [{"role": "user", "content": txt + parts if text_first else parts + txt}]


@pytest.fixture
def http_daemon(start_daemon, demo_engine, make_video):
    def _start(**http):
        return start_daemon(engine=demo_engine, defaults={"max_new_tokens": 16, "timeout_ms": 120000},
                            http={"enabled": True, "port": 0, **http},
                            sources=[{"name": "front", "uri": str(make_video(n_frames=6, size=(64, 48)))}])
    return _start


def client_for(daemon, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http.port}/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, **kw)


def test_sync_client_answers_like_the_engine(http_daemon, demo_engine, frames) -> None:
    daemon = http_daemon()
    client = client_for(daemon)
    assert [m.id for m in client.models.list().data] == ["edgevlm-demo"]
    for frame in frames:
        uri = data_uri(frame)
        expected = demo_engine.ask(decoded(uri), QUESTION, max_new_tokens=16)
        out = client.chat.completions.create(model="edgevlm-demo", messages=user(QUESTION, uri), max_tokens=16)
        assert out.choices[0].message.content == expected.text
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == expected.stats.new_tokens
        assert out.usage.prompt_tokens == expected.stats.prompt_tokens + expected.stats.vision_tokens
        stats = out.model_extra["edgevlm"]["stats"]
        assert stats["e2e_ms"] > 0 and stats["vision_tokens"] == expected.stats.vision_tokens


def test_streaming_deltas_concatenate_to_the_answer(http_daemon, demo_engine, frames) -> None:
    daemon = http_daemon()
    uri = data_uri(frames[0])
    expected = demo_engine.ask(decoded(uri), QUESTION, max_new_tokens=16).text
    chunks = list(client_for(daemon).chat.completions.create(
        model="edgevlm-demo", messages=user(QUESTION, uri), max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(content) == expected
    assert len(content) >= 2  # streamed, not one block
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_async_client(http_daemon, demo_engine, frames) -> None:
    daemon = http_daemon()
    uris = [data_uri(f) for f in frames[:2]]

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{daemon.http.port}/v1", api_key="none",
                                    max_retries=0)
        outs = await asyncio.gather(*[client.chat.completions.create(
            model="edgevlm-demo", messages=user(QUESTION, u), max_tokens=16) for u in uris])
        await client.close()
        return [o.choices[0].message.content for o in outs]

    got = asyncio.run(ask_all())
    assert got == [demo_engine.ask(decoded(u), QUESTION, max_new_tokens=16).text for u in uris]


def test_stop_strings_cut_the_answer(http_daemon, demo_engine, frames) -> None:
    daemon = http_daemon()
    uri = data_uri(frames[0])
    full = demo_engine.ask(decoded(uri), QUESTION, max_new_tokens=16).text
    assert " " in full
    first_word = full.split(" ")[0]
    out = client_for(daemon).chat.completions.create(model="edgevlm-demo", messages=user(QUESTION, uri),
                                                    max_tokens=16, stop=[" "])
    assert out.choices[0].message.content == first_word


def test_camera_reference_answers_about_the_newest_frame(http_daemon) -> None:
    daemon = http_daemon()
    out = client_for(daemon).chat.completions.create(
        model="edgevlm-demo", messages=user("how many shapes are there?", "edgevlm://sources/front"), max_tokens=4)
    assert out.choices[0].message.content
    assert out.model_extra["edgevlm"]["frame"]["source"] == "front"


def test_camera_frame_seq_asks_about_that_frame_again(http_daemon) -> None:
    """The HTTP answer names its frame's ``seq`` (edgevlm.frame.seq); ``frame_seq`` (an extension
    field, as on the MQTT wire) asks about that frame again, or is refused as frame_gone (was: silently
    dropped, the answer about the newest frame)."""
    daemon = http_daemon()
    client = client_for(daemon)
    first = client.chat.completions.create(
        model="edgevlm-demo", messages=user(QUESTION, "edgevlm://sources/front"), max_tokens=4)
    seq = first.model_extra["edgevlm"]["frame"]["seq"]
    time.sleep(0.5)  # the camera moves on
    again = client.chat.completions.create(model="edgevlm-demo", messages=user(QUESTION, "edgevlm://sources/front"),
                                           max_tokens=4, extra_body={"frame_seq": seq})
    assert again.model_extra["edgevlm"]["frame"]["seq"] == seq
    status, body = _error(lambda: client.chat.completions.create(
        model="edgevlm-demo", messages=user(QUESTION, "edgevlm://sources/front"), max_tokens=4,
        extra_body={"frame_seq": 10**12}))
    assert (status, body["code"]) == (400, "INVALID_REQUEST") and "frame_seq" in body["message"], body


def test_frigate_genai_request_shape(http_daemon, demo_engine, frames) -> None:
    """Frigate's OpenAI provider: text first, then one image_url part per frame (detail low), newest last."""
    daemon = http_daemon(multiple_images="last")
    uris = [data_uri(f) for f in frames[:2]]
    prompt = "describe the scene."
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}] + [
        {"type": "image_url", "image_url": {"url": u, "detail": "low"}} for u in uris]}]
    out = client_for(daemon).chat.completions.create(model="edgevlm-demo", messages=messages, timeout=60,
                                                    max_tokens=16)
    assert out.choices[0].message.content == demo_engine.ask(decoded(uris[-1]), prompt, max_new_tokens=16).text


def test_curl_models_and_chat(http_daemon, demo_engine, frames) -> None:
    daemon = http_daemon()
    base = f"http://127.0.0.1:{daemon.http.port}"
    models = json.loads(subprocess.run(["curl", "-sS", f"{base}/v1/models"], check=True, capture_output=True,
                                       text=True, timeout=30).stdout)
    assert models["data"][0]["id"] == "edgevlm-demo"
    health = json.loads(subprocess.run(["curl", "-sS", f"{base}/health"], check=True, capture_output=True,
                                       text=True, timeout=30).stdout)
    assert health["status"] == "ok"
    uri = data_uri(frames[1])
    body = json.dumps({"model": "edgevlm-demo", "messages": user(QUESTION, uri), "max_tokens": 16})
    res = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", "@-",
                          f"{base}/v1/chat/completions"], input=body, check=True, capture_output=True, text=True,
                         timeout=60)
    out = json.loads(res.stdout)
    assert out["choices"][0]["message"]["content"] == demo_engine.ask(decoded(uri), QUESTION, max_new_tokens=16).text
    sse = subprocess.run(["curl", "-sSN", "-H", "Content-Type: application/json", "-d", "@-",
                          f"{base}/v1/chat/completions"], input=json.dumps({**json.loads(body), "stream": True}),
                         check=True, capture_output=True, text=True, timeout=60).stdout
    events = [line[len("data: "):] for line in sse.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == out["choices"][0]["message"]["content"]


def test_models_retrieve_with_the_openai_client(http_daemon, monkeypatch) -> None:
    """``client.models.retrieve(id)`` (GET /v1/models/{id}, which tools call to check the model) answered 404
    "no route"; now the model object, 404 model_not_found for another id, 401 without the token."""
    monkeypatch.setenv("EDGEVLM_HTTP_API_KEY", "s3cret")
    daemon = http_daemon()
    client = client_for(daemon, api_key="s3cret")
    model = client.models.retrieve("edgevlm-demo")
    assert (model.id, model.object, model.owned_by) == ("edgevlm-demo", "model", "edgevlm")
    assert model.created == client.models.list().data[0].created
    status, body = _error(lambda: client.models.retrieve("gpt-4o"))
    assert (status, body["code"]) == (404, "model_not_found") and "edgevlm-demo" in body["message"], body
    status, body = _error(lambda: client_for(daemon).models.retrieve("edgevlm-demo"))
    assert (status, body["code"]) == (401, "invalid_api_key"), body


# ---------------------------------------------------------------------------------------- errors


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


def test_bad_inputs_are_openai_errors_with_edgevlm_codes(http_daemon, frames) -> None:
    daemon = http_daemon()
    client = client_for(daemon)
    uri = data_uri(frames[0])

    def ask(messages=None, **kw):
        return lambda: client.chat.completions.create(model=kw.pop("model", "edgevlm-demo"),
                                                      messages=messages or user(QUESTION, uri), **kw)

    cases = [
        (ask(user(QUESTION, "https://example.com/x.jpg")), 400, "INVALID_REQUEST", "network"),
        (ask(user(QUESTION, "data:image/jpeg;base64,@@@")), 400, "INVALID_REQUEST", "base64"),
        (ask(user(QUESTION, "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nxx").decode())),
         400, "INVALID_IMAGE", ""),
        (ask(user(QUESTION, "edgevlm://sources/rear")), 404, "UNKNOWN_SOURCE", "rear"),
        (ask(user(QUESTION, uri, uri)), 400, "INVALID_REQUEST", "http.multiple_images"),
        (ask(user(QUESTION)), 400, "INVALID_REQUEST", "no image"),
        (ask(n=2), 400, "INVALID_REQUEST", "n:"),
        (ask(temperature=3), 400, "INVALID_REQUEST", "temperature"),
        (ask(model="gpt-4o"), 404, "model_not_found", "edgevlm-demo"),
        (ask([{"role": "assistant", "content": "hi"}, *user(QUESTION, uri)]), 400, "INVALID_REQUEST", "role"),
        (ask(extra_body={"timeout_ms": 1}), 504, "DEADLINE_EXCEEDED", "timeout_ms"),
        (ask(max_tokens=-1), 400, "INVALID_REQUEST", "max_tokens: must be between 1 and 4096"),
        (ask(user(QUESTION, "data:image/png,abc")), 400, "INVALID_REQUEST", "data URIs must be base64"),
        (ask(user(QUESTION, "edgevlm://other/front")), 400, "INVALID_REQUEST", "edgevlm:// URIs name a camera"),
        # frames of a camera, as on the MQTT wire: the demo model (LLaVA-style) takes one image
        (ask(user(QUESTION, "edgevlm://sources/front"), extra_body={"frames": 4}), 400, "INVALID_REQUEST", "frames"),
        (ask(extra_body={"frames": 4}), 400, "INVALID_REQUEST", "frames"),  # frames need a camera source
        (ask(extra_body={"frames_s": "x"}), 400, "INVALID_REQUEST", "frames_s"),
    ]
    for call, status, code, needle in cases:
        got_status, body = _error(call)
        assert (got_status, body["code"]) == (status, code), body
        assert needle in body["message"], body
        assert isinstance(body["details"], dict), body  # always there, {} where the error has none
    # the daemon is still serving
    assert client.chat.completions.create(model="edgevlm-demo", messages=user(QUESTION, uri), max_tokens=4)
    # every refusal counted once in the daemon's events, as MQTT's are, whether the HTTP front door or the
    # scheduler refused it (one metrics system: edgevlm_events_total{event="errors_<code>"})
    for code in ("INVALID_REQUEST", "INVALID_IMAGE", "UNKNOWN_SOURCE", "DEADLINE_EXCEEDED"):
        assert daemon.counters.get(f"errors_{code}") == sum(c[2] == code for c in cases), code


def test_stream_refused_before_the_first_token_is_an_http_error(http_daemon) -> None:
    daemon = http_daemon()
    status, body = _error(lambda: list(client_for(daemon).chat.completions.create(
        model="edgevlm-demo", messages=user(QUESTION, "edgevlm://sources/rear"), stream=True)))
    assert (status, body["code"]) == (404, "UNKNOWN_SOURCE")


def test_raw_http_errors(http_daemon) -> None:
    import urllib.error
    import urllib.request

    daemon = http_daemon(max_body_bytes=2048)
    url = f"http://127.0.0.1:{daemon.http.port}/v1/chat/completions"
    chat = ('{"model": "edgevlm-demo", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, '
            '{"type": "image_url", "image_url": {"url": "edgevlm://sources/front"}}]}], ')
    for payload, status, needle in [(b"{not json", 400, "malformed JSON"), (b"[1]", 400, "JSON object"),
                                    (b"x" * 4096, 413, "max_body_bytes"),
                                    ((chat + '"temperature": NaN}').encode(), 400,
                                     "$: malformed JSON: NaN is not a JSON number (RFC 8259 has no NaN or Infinity)"),
                                    # the MQTT wire's words for the same faults (protocol.parse_json_object)
                                    (b'\xff\xfe{"model": 1}', 400, "$: payload is not UTF-8"),
                                    (b"[" * 1020 + b"]" * 1020, 400, "$: malformed JSON: nested too deeply"),
                                    ((chat + '"temperature": -Infinity}').encode(), 400, "-Infinity is not a JSON"),
                                    ((chat + '"model": "edgevlm-demo"}').encode(), 400,  # was: served
                                     '$: malformed JSON: duplicate key "model" (a name may appear only once in an '
                                     'object)'),
                                    ((chat + '"temperature": "hot"}').encode(), 400,
                                     "temperature: must be a number, got a string"),
                                    ((chat + '"max_tokens": 2.5}').encode(), 400,
                                     "max_tokens: must be an integer, got 2.5"),
                                    # the refused-by-name options are strict too (True == 1, 0 == False)
                                    ((chat + '"n": true}').encode(), 400, "n: True is not supported by edgevlm"),
                                    ((chat + '"n": 1.0}').encode(), 400, "n: 1.0 is not supported by edgevlm"),
                                    ((chat + '"logprobs": 0}').encode(), 400, "logprobs: 0 is not supported"),
                                    ((chat + '"presence_penalty": false}').encode(), 400,
                                     "presence_penalty: False is not supported"),
                                    ((chat + '"stream": true, "stream_options": {"include_usage": "yes"}}').encode(),
                                     400, "stream_options.include_usage: must be a boolean")]:
        req = urllib.request.Request(url, data=payload, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == status
        error = json.loads(info.value.read())["error"]
        assert needle in error["message"] and error["code"] == "INVALID_REQUEST", error


def test_unknown_routes_and_methods_are_openai_errors(http_daemon) -> None:
    import urllib.error
    import urllib.request

    daemon = http_daemon()
    base = f"http://127.0.0.1:{daemon.http.port}"
    for req, status, code in [(urllib.request.Request(f"{base}/v1/nothing"), 404, "not_found"),
                              (urllib.request.Request(f"{base}/v1/chat/completions"), 405, "method_not_allowed")]:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        error = json.loads(info.value.read())["error"]
        assert info.value.code == status and error["code"] == code and error["details"] == {}


def test_client_that_disconnects_mid_body_leaves_no_traceback(http_daemon, caplog) -> None:
    import logging
    import socket

    caplog.set_level(logging.INFO)
    daemon = http_daemon()
    with socket.create_connection(("127.0.0.1", daemon.http.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\":")
    deadline = time.monotonic() + 10
    while "disconnected before sending the whole request body" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "disconnected before sending the whole request body" in caplog.text
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text
    assert json.loads(subprocess.run(["curl", "-sS", f"http://127.0.0.1:{daemon.http.port}/health"], check=True,
                                     capture_output=True, text=True, timeout=30).stdout)["status"] == "ok"


def test_bearer_token(http_daemon, frames, monkeypatch) -> None:
    monkeypatch.setenv("EDGEVLM_HTTP_API_KEY", "s3cret")
    daemon = http_daemon()
    status, body = _error(lambda: client_for(daemon, api_key="wrong").models.list())
    assert (status, body["code"]) == (401, "invalid_api_key")
    assert client_for(daemon, api_key="s3cret").models.list().data[0].id == "edgevlm-demo"
    out = client_for(daemon, api_key="s3cret").chat.completions.create(
        model="edgevlm-demo", messages=user(QUESTION, data_uri(frames[0])), max_tokens=4)
    assert out.choices[0].message.content


def test_busy_is_503_with_retry_hint(http_daemon, frames, wait_until) -> None:
    import threading

    daemon = http_daemon()
    client = client_for(daemon)
    uri = data_uri(frames[0])
    results: list = []

    def ask() -> None:
        results.append(_safe(lambda: client.chat.completions.create(
            model="edgevlm-demo", messages=user(QUESTION, uri), max_tokens=4)))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    with daemon.scheduler.paused():
        for t in threads[:4]:
            t.start()
        wait_until(lambda: daemon.scheduler.queue_size() == 4, what="4 queued requests")
        for t in threads[4:]:
            t.start()
        wait_until(lambda: len(results) == 2, what="2 BUSY answers")
    for t in threads:
        t.join(60)
    assert sorted(results, key=str) == [503, 503, "ok", "ok", "ok", "ok"]


def _safe(call):
    try:
        call()
        return "ok"
    except openai.APIStatusError as err:
        assert err.response.headers["x-should-retry"] == "true" and err.response.headers["retry-after"] == "1"
        return err.status_code


def test_port_in_use_leaves_mqtt_serving(start_daemon, demo_engine, mosquitto, caplog) -> None:
    import socket

    from edgevlm.client import Client

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        daemon = start_daemon(engine=demo_engine, http={"enabled": True, "port": port})
        assert daemon.http is None
        assert "http: cannot listen on 127.0.0.1 port" in caplog.text
        with Client(mosquitto.host, mosquitto.port, "dev1") as client:
            assert client.ask("how many shapes are there?", image=np.zeros((32, 32, 3), np.uint8), timeout_s=60)
    finally:
        blocker.close()


OPEN_ON_ALL = ("HTTP API on 0.0.0.0 takes requests without a token from any host that reaches it "
               "(EDGEVLM_HTTP_API_KEY is not set); set EDGEVLM_HTTP_API_KEY to require 'Authorization: Bearer <token>'")


@pytest.mark.parametrize(("host", "key", "expected"), [
    ("0.0.0.0", None, OPEN_ON_ALL),
    ("127.0.0.1", "", "HTTP API takes requests without a token: EDGEVLM_HTTP_API_KEY is set but empty"),
    ("127.0.0.1", None, None),
    ("0.0.0.0", "s3cret", None),
])
def test_serving_without_a_token_where_it_is_likely_a_mistake_is_warned(
        http_daemon, monkeypatch, caplog, host, key, expected) -> None:
    # was: an empty EDGEVLM_HTTP_API_KEY (a deployment tool's unset secret) or a 0.0.0.0 listener without
    # one served everyone without a word beyond the info line
    if key is None:
        monkeypatch.delenv("EDGEVLM_HTTP_API_KEY", raising=False)
    else:
        monkeypatch.setenv("EDGEVLM_HTTP_API_KEY", key)
    with caplog.at_level(logging.INFO, logger="edgevlm.daemon.openai_api"):
        daemon = http_daemon(host=host)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "edgevlm.daemon.openai_api" and r.levelno == logging.WARNING]
    assert warnings == ([] if expected is None else [expected])
    # the warning changes nothing: the API answers as configured
    assert client_for(daemon, api_key=key or "none").models.list().data[0].id == "edgevlm-demo"


@pytest.mark.parametrize(("host", "warned"), [("::1", False), ("localhost", False), ("127.0.0.2", False),
                                              ("192.168.1.20", True), ("robot.local", True), ("::", True)])
def test_open_access_warning_knows_loopback_addresses(monkeypatch, host: str, warned: bool) -> None:
    from edgevlm.config import HttpConfig

    monkeypatch.delenv("EDGEVLM_HTTP_API_KEY", raising=False)
    warning = HttpConfig(enabled=True, host=host).open_access_warning()
    assert (warning is not None) == warned, warning
