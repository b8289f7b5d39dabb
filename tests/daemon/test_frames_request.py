"""Requests about several recent frames of a source (``frames`` / ``frames_s``) through a real daemon,
a real mosquitto and a real video file: the tiny Qwen2.5-VL checkpoint gets them as one video (its
answer equals the Engine's on the same decoded frames and media times, which tests/models checks
against transformers' generate); the tiny LLaVA model (one image only) answers INVALID_REQUEST
naming the limit; bad values are INVALID_REQUEST on the wire."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("transformers")

from edgevlm.client import Client  # noqa: E402
from tests.models.test_qwen2_5_vl import write_tiny_qwen2_5_vl  # noqa: E402

REQUEST_TOPIC = "edgevlm/dev1/request"
PROMPT = "What is happening in this video?"


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    from edgevlm.runtime import Engine

    return Engine.load(write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen_frames")))


def _decoded(path) -> list[np.ndarray]:
    """The video's frames as the source decodes them (OpenCV, RGB)."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, bgr = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    cap.release()
    return frames


def _roundtrip(raw, body: dict) -> dict:
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    raw.publish(REQUEST_TOPIC, json.dumps(body).encode(), response_topic=reply, correlation=b"c")
    return json.loads(raw.wait_messages(reply, 1, timeout_s=60)[0].payload)


def _expected(engine, decoded, newest: int, n: int, max_new_tokens: int) -> str:
    frames = decoded[newest - n + 1:newest + 1]
    return engine.ask(frames, PROMPT, max_new_tokens=max_new_tokens,
                      frame_timestamps_s=[0.1 * i for i in range(n)] if n > 1 else None).text


def _ask_in_one_loop(raw, body: dict, n_min: int) -> dict:
    """The response to ``body`` whose frames lie within one pass of the looping file (retried)."""
    for _ in range(3):
        resp = _roundtrip(raw, body)
        assert resp["ok"], resp
        if resp["frame"]["index"] >= resp["frame"]["frames"] - 1 >= n_min - 1:
            return resp
    raise AssertionError(f"no response within one loop of the file: {resp}")


def test_frames_and_frames_s_answer_as_the_engine_on_those_frames(start_daemon, qwen_engine, make_video,
                                                                  raw_client, mosquitto, wait_until):
    path = make_video(n_frames=60, fps=10.0, size=(112, 84))
    daemon = start_daemon(engine=qwen_engine, sources=[{"name": "cam", "uri": str(path)}],
                          defaults={"max_new_tokens": 6, "timeout_ms": 60000})
    src = daemon.sources.get("cam")
    wait_until(lambda: (f := src.latest()) is not None and f.index is not None and f.index >= 6, 20, "6 frames")
    decoded = _decoded(path)
    raw = raw_client()

    resp = _ask_in_one_loop(raw, {"prompt": PROMPT, "source": "cam", "frames": 4}, 4)
    f = resp["frame"]
    assert f["frames"] == 4 and f["first_ts"] < f["ts"]
    assert resp["text"] == _expected(qwen_engine, decoded, f["index"], 4, 6)

    resp = _ask_in_one_loop(raw, {"prompt": PROMPT, "source": "cam", "frames_s": 0.25}, 2)
    f = resp["frame"]
    assert 2 <= f["frames"] <= 4  # 10 fps paced playback: about 3 frames in 0.25 s
    assert f["ts"] - f["first_ts"] <= 0.25 + 1e-6
    assert resp["text"] == _expected(qwen_engine, decoded, f["index"], f["frames"], 6)

    with Client(mosquitto.host, mosquitto.port, "dev1") as client:  # the SDK's frames=
        for _ in range(3):
            answer = client.ask(PROMPT, source="cam", frames=3, timeout_s=60)
            newest = round(answer.frame_pos_ms / 100.0)
            if newest >= 2:
                break
        assert answer.text == _expected(qwen_engine, decoded, newest, 3, 6)


@pytest.mark.parametrize("extra, needle", [
    ({"frames": 0}, "frames"), ({"frames": 33}, "frames"), ({"frames": 2.0}, "frames"), ({"frames": "2"}, "frames"),
    ({"frames": True}, "frames"), ({"frames_s": 0}, "frames_s"), ({"frames_s": 10.5}, "frames_s"),
    ({"frames_s": "1"}, "frames_s"), ({"frames": 2, "frames_s": 1.0}, "at most one of"),
])
def test_bad_frames_values_are_invalid_request(start_daemon, raw_client, make_video, extra, needle):
    start_daemon(sources=[{"name": "cam", "uri": str(make_video())}])
    resp = _roundtrip(raw_client(), {"prompt": PROMPT, "source": "cam", **extra})
    assert not resp["ok"] and resp["error"]["code"] == "INVALID_REQUEST" and needle in resp["error"]["message"]


def test_frames_of_an_inline_image_is_invalid_request(start_daemon, raw_client):
    start_daemon()
    resp = _roundtrip(raw_client(), {"prompt": PROMPT, "image_b64": "aGk=", "frames": 2})
    assert resp["error"]["code"] == "INVALID_REQUEST" and "of a 'source'" in resp["error"]["message"]


def test_frames_to_a_one_image_model_is_invalid_request_naming_the_limit(start_daemon, raw_client, make_video,
                                                                         wait_until):
    daemon = start_daemon(sources=[{"name": "cam", "uri": str(make_video(n_frames=30))}])  # the tiny LLaVA
    wait_until(lambda: (f := daemon.sources.get("cam").latest()) is not None and f.seq >= 3, 20, "3 frames")
    raw = raw_client()
    reply = f"test/replies/{uuid.uuid4().hex}"
    raw.subscribe(reply)
    raw.publish(REQUEST_TOPIC, json.dumps({"prompt": PROMPT, "source": "cam", "frames": 3}).encode(),
                response_topic=reply, correlation=b"c")
    wire = raw.wait_messages(reply, 1, timeout_s=60)[0].payload  # the bytes on the wire
    resp = json.loads(wire)
    assert resp["error"]["code"] == "INVALID_REQUEST"
    assert "llava family takes one image per request" in resp["error"]["message"]
    assert "at most 1 frame" in resp["error"]["message"]
    # a reason as the other refusals have (frame_gone, prompt_too_long); its details were empty
    assert resp["error"]["details"] == {"reason": "too_many_frames", "frames": 3, "max_frames": 1}, wire
    time.sleep(0.05)
    assert _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frames": 1})["ok"]  # one frame is one image


def test_questions_about_one_source_frame_share_its_vision_tokens(start_daemon, qwen_engine, make_video,
                                                                 raw_client, wait_until):
    """With the engine's vision cache on, the daemon names a source frame by its seq: a second
    question about the same frame reuses the vision tokens, answering as without the cache."""
    path = make_video(n_frames=6, fps=10.0, size=(112, 84))
    daemon = start_daemon(engine=qwen_engine, sources=[{"name": "cam", "uri": str(path), "fps": 0.5}],
                          defaults={"max_new_tokens": 6, "timeout_ms": 60000})
    wait_until(lambda: daemon.sources.get("cam").latest() is not None, 20, "a frame")
    raw = raw_client()
    qwen_engine.set_vision_cache(16)
    try:
        for _ in range(3):
            first = _roundtrip(raw, {"prompt": PROMPT, "source": "cam"})
            second = _roundtrip(raw, {"prompt": "describe the scene.", "source": "cam"})
            if first["frame"]["ts"] == second["frame"]["ts"]:
                break
        assert first["frame"]["ts"] == second["frame"]["ts"], "no two answers about one frame"
        assert qwen_engine.vision_cache.hits >= 1
        assert {k[0][:2] for k in qwen_engine.vision_cache.keys()} == {("source", "cam")}  # named by seq, not hash
        frame = _decoded(path)[first["frame"]["index"]]
        qwen_engine.set_vision_cache(None)
        assert second["text"] == qwen_engine.ask(frame, "describe the scene.", max_new_tokens=6).text
    finally:
        qwen_engine.set_vision_cache(None)


# ---- a frames_s window on a family limited to N images (Gemma 3, SmolVLM, InternVL: max_images 8)


@pytest.fixture(scope="module")
def gemma3_engine(tmp_path_factory):
    from family_support import write_checkpoint

    from edgevlm.runtime import Engine

    return Engine.load(write_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3_frames") / "model"))


def _http_chat(daemon, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{daemon.http.port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_frames_s_window_is_sampled_to_the_family_image_limit(start_daemon, gemma3_engine, make_video, raw_client,
                                                              wait_until):
    """Found by a new user: ``frames_s: 1`` on a 10 fps camera asked a Gemma 3 model (at most 8 images) about
    the 11 frames of the window and got INVALID_REQUEST "11 frames: ... at most 8 frame(s)", a count never
    sent. The window is a time span: it is sampled to 8 frames evenly spaced in it (the oldest and the newest
    kept), on the MQTT wire and the HTTP API alike; ``stats.window_frames`` says how many it held."""
    import urllib.request

    from edgevlm.daemon.sources import evenly_spaced

    path = make_video(n_frames=60, fps=10.0, size=(112, 84))
    daemon = start_daemon(engine=gemma3_engine, sources=[{"name": "cam", "uri": str(path)}],
                          defaults={"max_new_tokens": 6, "timeout_ms": 60000}, http={"enabled": True, "port": 0})
    src = daemon.sources.get("cam")
    wait_until(lambda: (f := src.latest()) is not None and f.index is not None and f.index >= 12, 20, "13 frames")
    decoded = _decoded(path)
    raw = raw_client()
    for _ in range(5):  # a response whose window lies within one pass of the looping file
        resp = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frames_s": 1})
        assert resp["ok"], resp
        window, newest = resp["stats"]["window_frames"], resp["frame"]["index"]
        if newest >= window - 1:
            break
        time.sleep(0.3)
    assert resp["frame"]["frames"] == 8 and 9 <= window <= 12, resp  # about 11 frames in 1 s at 10 fps
    assert resp["frame"]["ts"] - resp["frame"]["first_ts"] <= 1.0 + 1e-6
    sampled = evenly_spaced(decoded[newest - window + 1:newest + 1], 8)
    assert resp["text"] == gemma3_engine.ask(sampled, PROMPT, max_new_tokens=6).text

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http.port}/v1/models", timeout=30) as models:
        model_id = json.loads(models.read())["data"][0]["id"]
    out = _http_chat(daemon, {"model": model_id, "max_tokens": 6, "frames_s": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "edgevlm://sources/cam"}}, {"type": "text", "text": PROMPT}]}]})
    ext = out["edgevlm"]
    assert out["choices"][0]["message"]["content"] and ext["frame"]["frames"] == 8, out
    assert 9 <= ext["stats"]["window_frames"] <= 12

    # a window within the limit is sent whole, and a count the caller chose is not sampled: over the limit
    # it is refused naming it
    resp = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frames_s": 0.25})
    assert resp["ok"] and 2 <= resp["frame"]["frames"] <= 4 and "window_frames" not in resp["stats"], resp
    resp = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frames": 9})
    assert resp["error"]["code"] == "INVALID_REQUEST" and "at most 8 frame(s)" in resp["error"]["message"], resp
    assert resp["error"]["details"] == {"reason": "too_many_frames", "frames": 9, "max_frames": 8}, resp


def test_evenly_spaced_keeps_exactly_n_in_order_the_oldest_and_newest_and_no_duplicate() -> None:
    from edgevlm.daemon.sources import evenly_spaced

    for length in range(0, 41):
        frames = list(range(length))
        for n in range(1, length + 3):
            got = evenly_spaced(frames, n)  # type: ignore[arg-type]
            assert len(got) == min(n, length), (length, n)
            assert got == sorted(set(got)), (length, n)  # in order, no frame twice
            if length and n >= 2:
                assert got[0] == 0 and got[-1] == length - 1, (length, n)
            if length and n == 1:
                assert got == [length - 1], length  # one frame: the newest
    with pytest.raises(ValueError, match="n must be >= 1"):
        evenly_spaced([1, 2], 0)  # type: ignore[list-item]


def test_the_daemon_loads_its_engine_with_the_configured_vision_cache(tiny_model_dir) -> None:
    # model.vision_cache_mb reaches the engine the daemon loads (at start and at a hot reload: load_engine)
    from edgevlm.config import parse_daemon_config
    from edgevlm.daemon.app import load_engine
    from edgevlm.errors import ConfigError

    def loaded(**model):
        return load_engine(parse_daemon_config({"model": {"path": str(tiny_model_dir), **model}}), tiny_model_dir)

    assert loaded().vision_cache.budget_bytes == 64 * 2**20  # on by default
    assert loaded(vision_cache_mb=0.5).vision_cache.budget_bytes == 2**19
    assert loaded(vision_cache_mb=0).vision_cache is None
    for bad in (-1, "64", True, 2e6, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="vision_cache_mb"):
            parse_daemon_config({"model": {"vision_cache_mb": bad}})


def test_questions_about_one_inline_image_share_its_vision_tokens_keyed_by_the_file(start_daemon, qwen_engine,
                                                                                    raw_client, encode_image):
    """An inline image is named by its file's hash (not its pixels'): the second question about the same
    JPEG reuses the vision tokens (stats.vision_cached) and answers as the engine does without the cache."""
    import base64
    import hashlib

    import cv2

    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)
    jpeg = encode_image(image, ".jpg")
    daemon = start_daemon(engine=qwen_engine, defaults={"max_new_tokens": 6, "timeout_ms": 60000})
    assert daemon.fronts is None
    raw = raw_client()
    qwen_engine.set_vision_cache(16)
    try:
        body = {"image_b64": base64.b64encode(jpeg).decode()}
        first = _roundtrip(raw, {**body, "prompt": PROMPT})
        second = _roundtrip(raw, {**body, "prompt": "describe the scene."})
        assert first["ok"] and second["ok"], (first, second)
        assert (first["stats"]["vision_cached"], second["stats"]["vision_cached"]) == (False, True)
        assert qwen_engine.vision_cache.keys() == [(("inline", hashlib.blake2b(jpeg, digest_size=16).hexdigest()),
                                                    *qwen_engine.vision_cache.keys()[0][1:])]
        pixels = cv2.cvtColor(cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        qwen_engine.set_vision_cache(None)
        assert second["text"] == qwen_engine.ask(pixels, "describe the scene.", max_new_tokens=6).text
    finally:
        qwen_engine.set_vision_cache(None)


def test_frame_seq_asks_again_about_the_frame_of_an_earlier_answer(start_daemon, qwen_engine, make_video,
                                                                    raw_client, wait_until):
    """A camera moves on between questions: frame_seq (an earlier answer's frame.seq) pins the frame, so
    several questions about one camera frame share its vision tokens; a frame the source no longer
    holds, or has not delivered, is refused INVALID_REQUEST (reason frame_gone) and the daemon goes on."""
    path = make_video(n_frames=6, fps=10.0, size=(112, 84))
    daemon = start_daemon(engine=qwen_engine, sources=[{"name": "cam", "uri": str(path)}],
                          defaults={"max_new_tokens": 6, "timeout_ms": 60000})
    wait_until(lambda: daemon.sources.get("cam").latest() is not None, 20, "a frame")
    raw = raw_client()
    qwen_engine.set_vision_cache(16)
    try:
        first = _roundtrip(raw, {"prompt": PROMPT, "source": "cam"})
        seq = first["frame"]["seq"]
        assert isinstance(seq, int) and seq >= 1
        wait_until(lambda: daemon.sources.get("cam").latest().seq > seq, 10, "the camera to move on")
        second = _roundtrip(raw, {"prompt": "describe the scene.", "source": "cam", "frame_seq": seq})
        assert second["ok"], second
        assert (second["frame"]["seq"], second["frame"]["ts"], second["frame"]["index"]) == (
            seq, first["frame"]["ts"], first["frame"]["index"])
        assert (first["stats"]["vision_cached"], second["stats"]["vision_cached"]) == (False, True)
        frame = _decoded(path)[first["frame"]["index"]]
        qwen_engine.set_vision_cache(None)
        assert second["text"] == qwen_engine.ask(frame, "describe the scene.", max_new_tokens=6).text
    finally:
        qwen_engine.set_vision_cache(None)
    # the ring keeps the last 32 frames: an old one is gone, a future one not there yet
    wait_until(lambda: daemon.sources.get("cam").latest().seq > seq + 40, 20, "40 more frames")
    gone = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frame_seq": seq})
    assert gone["ok"] is False and gone["error"]["code"] == "INVALID_REQUEST"
    details = gone["error"]["details"]
    assert details["reason"] == "frame_gone" and details["frame_seq"] == seq and details["oldest_seq"] > seq
    assert "no longer holds" in gone["error"]["message"]
    future = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frame_seq": 10**9})
    assert future["error"]["code"] == "INVALID_REQUEST" and "has not delivered" in future["error"]["message"]
    assert _roundtrip(raw, {"prompt": PROMPT, "source": "cam"})["ok"]  # and the daemon goes on


@pytest.mark.parametrize("body, message", [
    ({"image_b64": "aGVsbG8=", "frame_seq": 3}, "frame_seq: asks about a frame of a 'source'"),
    ({"source": "cam", "frame_seq": 3, "frames": 2}, "at most one of 'frame_seq'"),
    ({"source": "cam", "frame_seq": 3, "frames_s": 1.0}, "at most one of 'frame_seq'"),
    ({"source": "cam", "frame_seq": 0}, "frame_seq"),
    ({"source": "cam", "frame_seq": "3"}, "frame_seq"),
    ({"source": "cam", "frame_seq": True}, "frame_seq"),
])
def test_bad_frame_seq_is_invalid_request(body, message) -> None:
    from edgevlm.errors import InvalidRequestError
    from edgevlm.protocol import parse_request

    with pytest.raises(InvalidRequestError, match=message):
        parse_request(json.dumps({"schema_version": 1, "prompt": "what?", **body}).encode())


def test_the_sdk_asks_again_about_an_answers_frame(start_daemon, mosquitto, make_video, wait_until) -> None:
    from edgevlm import Client

    path = make_video(n_frames=6, fps=10.0, size=(64, 48))
    daemon = start_daemon(sources=[{"name": "cam", "uri": str(path)}], defaults={"max_new_tokens": 4})
    wait_until(lambda: daemon.sources.get("cam").latest() is not None, 20, "a frame")
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        first = client.ask("what colour?", source="cam", timeout_s=30)
        assert first.frame_seq is not None and first.source == "cam"
        wait_until(lambda: daemon.sources.get("cam").latest().seq > first.frame_seq, 10, "the camera to move on")
        again = client.ask("how many?", source="cam", frame_seq=first.frame_seq, timeout_s=30)
        assert (again.frame_seq, again.frame_ts, again.frame_pos_ms) == (first.frame_seq, first.frame_ts,
                                                                         first.frame_pos_ms)


# ---- the latency controller's choice for several frames (a video is never pruned)


def _frontier(tmp_path, *points: dict) -> str:
    """A hand-written frontier.json (no weights_fingerprint: used on any model) of ``points``."""
    record = {"created_utc": "2026-01-01T00:00:00Z", "model": "tiny-qwen2.5-vl", "device": "cpu float32 torch",
              "eval_items": 1, "eval_seed": 0, "points": list(points), "frontier": list(points)}
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps(record))
    return str(path)


# figures (ms) that no run on this machine moves across the 5 s budget: "full" never fits it, the pruning point
# (more accurate than "r112") always does
FULL = {"name": "full", "accuracy": 1.0, "vision_ms": 1e7, "prefill_ms": 10.0, "tpot_ms": 1.0}
PRUNED = {"name": "native-k0.25", "keep_ratio": 0.25, "accuracy": 0.9, "vision_ms": 500.0, "prefill_ms": 10.0,
          "tpot_ms": 1.0}
SMALL = {"name": "r112", "resolution_px": 112, "accuracy": 0.5, "vision_ms": 50.0, "prefill_ms": 10.0, "tpot_ms": 1.0}


def test_a_video_request_runs_at_a_point_without_token_pruning(start_daemon, qwen_engine, make_video, raw_client,
                                                               tmp_path, wait_until):
    """Found by a new user: under a budget whose best point prunes vision tokens, a ``frames`` request to
    Qwen2.5-VL (one video) got INVALID_REQUEST "operating point 'native-k0.25': token pruning takes an image,
    not a video": the controller's own choice. A video now runs at the best point it can (here r112), an
    image (or one frame) still at the pruning point, under the same budget; the refit at dequeue (batched
    admission too) passes over the pruning point for a video as well."""
    path = make_video(n_frames=60, fps=10.0, size=(112, 84))
    daemon = start_daemon(engine=qwen_engine, sources=[{"name": "cam", "uri": str(path)}],
                          defaults={"max_new_tokens": 2, "timeout_ms": 60000},
                          controller={"frontier": _frontier(tmp_path, FULL, PRUNED, SMALL)})
    ctl = daemon.scheduler.controller
    assert [p.name for p in ctl.points] == ["full", "native-k0.25", "r112"]
    wait_until(lambda: (f := daemon.sources.get("cam").latest()) is not None and f.seq >= 4, 20, "4 frames")
    raw = raw_client()
    ask = {"prompt": PROMPT, "source": "cam", "budget_ms": 5000}

    one = _roundtrip(raw, ask)  # one frame: an image
    assert one["ok"] and one["stats"]["operating_point"] == "native-k0.25", one
    assert one["stats"]["vision_tokens"] < qwen_engine.ask(_decoded(path)[0], PROMPT, max_new_tokens=1).stats.vision_tokens
    for extra in ({"frames": 3}, {"frames_s": 0.5}):
        video = _roundtrip(raw, {**ask, **extra})
        assert video["ok"], video
        assert video["stats"]["operating_point"] == "r112" and video["frame"]["frames"] >= 2, video
    assert _roundtrip(raw, {**ask, "frames": 1})["stats"]["operating_point"] == "native-k0.25"  # one frame: an image
    assert _roundtrip(raw, ask)["stats"]["operating_point"] == "native-k0.25"  # the video left the ceiling alone

    # the refit at dequeue, from the pruning point an image was given
    chosen = ctl.choose(5000, max_new_tokens=2, queue_wait_ms=0.0)
    assert chosen.point.name == "native-k0.25"
    assert ctl.refit(chosen, 5000, max_new_tokens=2)[0].name == "native-k0.25"
    assert ctl.refit(chosen, 5000, max_new_tokens=2, kinds=qwen_engine.vision_kinds(3))[0].name == "r112"


def test_a_video_request_to_a_frontier_of_pruning_points_only_is_invalid_request(start_daemon, qwen_engine,
                                                                                   make_video, raw_client, tmp_path,
                                                                                   wait_until):
    """No point of the controller can run a video: INVALID_REQUEST naming the points and why (not the
    engine's refusal of a point the controller chose); an image is answered as before."""
    path = make_video(n_frames=60, fps=10.0, size=(112, 84))
    daemon = start_daemon(engine=qwen_engine, sources=[{"name": "cam", "uri": str(path)}],
                          defaults={"max_new_tokens": 2, "timeout_ms": 60000},
                          controller={"frontier": _frontier(tmp_path, PRUNED)})
    wait_until(lambda: (f := daemon.sources.get("cam").latest()) is not None and f.seq >= 4, 20, "4 frames")
    raw = raw_client()
    video = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "frames": 3, "budget_ms": 5000})
    assert not video["ok"] and video["error"]["code"] == "INVALID_REQUEST", video
    assert video["error"]["message"] == (
        "no operating point of the latency controller (native-k0.25) can run this request: token pruning takes an "
        "image, not a video (give the controller's frontier a point without early exit or token pruning)")
    assert video["error"]["details"] == {"reason": "no_operating_point", "points": ["native-k0.25"],
                                         "vision_kinds": ["video"]}
    image = _roundtrip(raw, {"prompt": PROMPT, "source": "cam", "budget_ms": 5000})
    assert image["ok"] and image["stats"]["operating_point"] == "native-k0.25", image
