"""Real answers through the daemon: the shipped demo model on frames of the bundled scene video.

Fixed frames (the middle of a segment) are sent inline, so the test is deterministic (greedy
decoding, fixed weights): the daemon's answers must equal ``engine.ask`` on the same frame, and
match the video's ground truth (``scenes.json``) — the demo model is >= 95% accurate, the test
asks for all but at most one of its questions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgevlm.client import Client

KINDS = ("colour", "count_total", "shape")


@pytest.fixture(scope="module")
def demo_engine():
    from edgevlm.runtime import demo

    if not (demo.model_dir() / "model.safetensors").is_file():
        pytest.skip(f"the demo model is not in {demo.model_dir()} yet (engineer D ships it)")
    from edgevlm.runtime import Engine

    return Engine.load(None, device="cpu")


def _frames_and_questions(n_segments: int) -> list[tuple[np.ndarray, str, str]]:
    import cv2

    from edgevlm.runtime import demo

    truth = json.loads(demo.scenes_json_path().read_text())
    cap = cv2.VideoCapture(str(demo.video_path()))
    frames = []
    index = 0
    ok, bgr = cap.read()
    while ok:
        frames.append(bgr[:, :, ::-1].copy())
        index += 1
        ok, bgr = cap.read()
    cap.release()
    items = []
    for seg in truth["segments"][:n_segments]:
        frame = frames[(seg["start_frame"] + seg["end_frame"]) // 2]
        for qa in seg["questions"]:
            if qa["kind"] in KINDS:
                items.append((frame, qa["question"], qa["answer"]))
    return items


def _norm(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


def test_demo_model_answers_through_the_daemon(start_daemon, mosquitto, demo_engine) -> None:
    start_daemon(engine=demo_engine, defaults={"max_new_tokens": 16, "timeout_ms": 120000})
    items = _frames_and_questions(3)
    assert len(items) >= 6
    right = 0
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        for frame, question, truth in items:
            answer = client.ask(question, image=frame, timeout_s=120)
            assert answer.text == demo_engine.ask(frame, question, max_new_tokens=16).text
            right += _norm(answer.text) == _norm(truth)
    assert right >= len(items) - 1, f"{right}/{len(items)} right"


def test_demo_model_16bit_png_gives_the_8bit_answer(start_daemon, mosquitto, demo_engine, encode_image) -> None:
    start_daemon(engine=demo_engine, defaults={"max_new_tokens": 16, "timeout_ms": 120000})
    frame, question, truth = next(i for i in _frames_and_questions(1) if "colo" in i[1])
    png16 = encode_image(frame.astype(np.uint16) * 257, ".png")
    with Client(mosquitto.host, mosquitto.port, "dev1") as client:
        a16 = client.ask(question, image=png16, timeout_s=120).text
        a8 = client.ask(question, image=encode_image(frame, ".png"), timeout_s=120).text
    assert a16 == a8
    assert _norm(a16) == _norm(truth)


def test_questions_about_one_frame_share_its_encoder_walk_at_the_controllers_exit_point(
        start_daemon, mosquitto, demo_engine, encode_image) -> None:
    """The daemon's default for the demo model: the latency controller picks an exit_threshold point,
    and the vision cache keeps the frame's encoder walk for it: the later questions about one JPEG run
    no encoder block (stats.vision_cached) and answer as the engine does without the cache."""
    items = _frames_and_questions(1)
    frame = items[0][0]
    questions = [q for f, q, _ in items if f is frame][:4]
    jpeg = encode_image(frame, ".jpg")
    start_daemon(engine=demo_engine, defaults={"max_new_tokens": 16, "timeout_ms": 120000})
    demo_engine.set_vision_cache(16)
    try:
        with Client(mosquitto.host, mosquitto.port, "dev1") as client:
            answers = [client.ask(q, image=jpeg, timeout_s=120) for q in questions]
    finally:
        demo_engine.set_vision_cache(None)
    import cv2

    pixels = cv2.cvtColor(cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    points = {a.stats.operating_point for a in answers}
    assert all("-x" in name for name in points), points  # exit_threshold points (the demo frontier's)
    assert [a.stats.vision_cached for a in answers] == [False, True, True, True][:len(answers)]
    from edgevlm.profile import load_frontier
    from edgevlm.runtime import demo

    frontier = {p.name: p.operating_point() for p in load_frontier(demo.model_dir() / "frontier.json").points}
    for a, q in zip(answers, questions, strict=True):
        op = frontier[a.stats.operating_point].model_copy(update={"max_new_tokens": None})  # the cap is lifted
        assert a.text == demo_engine.ask(pixels, q, max_new_tokens=16, operating_point=op).text
