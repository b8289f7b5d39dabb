"""The demo end to end: real mosquitto, the real daemon in a subprocess, the SDK and mosquitto_rr.

``test_demo_with_shipped_model`` is ``make demo`` itself (``edgevlm demo``) on the bundled scene
video and the shipped demo model; it skips only while those files are absent.
``test_demo_pipeline_with_tiny_model`` runs the same code path on a tiny random checkpoint and a
still video whose ground truth is that engine's own answer on the decoded frame, so the whole
pipeline (broker, daemon, camera, SDK, mosquitto_rr, grading) is checked even without the demo
weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
pytest.importorskip("torch")

from process_support import reaped, stop  # noqa: E402

from edgevlm.daemon import demo  # noqa: E402

pytestmark = pytest.mark.mqtt

QUESTIONS = {
    "how many shapes are there?": "count_total",
    "what color is the circle?": "colour",
    "is the red circle on the left or the right?": "position_lr",
    "describe the scene.": "describe",
}


def _require_mosquitto() -> None:
    broker, rr = demo.find_mosquitto()
    if not (broker and rr):
        pytest.fail(f"mosquitto/mosquitto_rr not found: {demo.INSTALL_COMMAND}", pytrace=False)


def _demo_assets_present() -> tuple[bool, str]:
    from edgevlm.runtime import demo as assets

    for path in (assets.model_dir() / "config.json", assets.video_path(), assets.scenes_json_path()):
        if not path.is_file():
            return False, f"demo assets not shipped yet: {path} is missing"
    if not any(assets.model_dir().glob("*.safetensors")):
        return False, f"demo model weights not shipped yet: no *.safetensors in {assets.model_dir()}"
    return True, ""


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoint, a 3 s still MJPG video, and a sidecar with that engine's own answers."""
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("demo")
    model = write_tiny_checkpoint(d / "model", seed=5)
    bgr = np.full((48, 64, 3), 60, np.uint8)
    cv2.circle(bgr, (18, 20), 9, (0, 0, 230), -1)
    video = d / "cam.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for _ in range(30):
        writer.write(bgr)
    writer.release()
    cap = cv2.VideoCapture(str(video))
    ok, frame = cap.read()
    cap.release()
    assert ok
    engine = Engine.load(model)
    rgb = np.ascontiguousarray(frame[:, :, ::-1])
    qas = [
        {"question": q, "kind": k, "answer": engine.ask(rgb, q, max_new_tokens=32).text}
        for q, k in QUESTIONS.items()
    ]
    sidecar = d / "cam.json"
    sidecar.write_text(json.dumps({"segments": [{"start_ms": 0, "end_ms": 3000, "questions": qas}]}))
    return {"model": model, "video": video, "sidecar": sidecar}


def test_demo_pipeline_with_tiny_model(tiny_setup: dict[str, Path], capsys) -> None:
    _require_mosquitto()
    code = demo.run_demo(
        model_dir=tiny_setup["model"], video=tiny_setup["video"], ground_truth=tiny_setup["sidecar"],
        timeout_s=240, json_out=True,
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "demo: OK" in out.out
    result = json.loads(out.out.strip().splitlines()[-1])
    rows = result["rows"]
    assert result["ok"] is True and result["problems"] == []
    assert [r["via"] for r in rows].count("mosquitto_rr") == 1
    assert [r["question"] for r in rows] == [
        "how many shapes are there?",  # the probe
        "what color is the circle?",  # follow-ups by kind, from the segment on screen
        "is the red circle on the left or the right?",
        "describe the scene.",
        "how many shapes are there?",  # mosquitto_rr
    ]
    expected = {
        qa["question"]: qa["answer"]
        for qa in json.loads(tiny_setup["sidecar"].read_text())["segments"][0]["questions"]
    }
    for r in rows:
        assert r["error"] is None
        assert r["answer"] == expected[r["question"]] and r["correct"] is True
        assert 0.0 <= r["frame_pos_ms"] < 3000.0
        assert r["e2e_ms"] > 0 and r["rtt_ms"] >= r["e2e_ms"]
    assert result["right"] == result["checked"] == len(rows)
    # The table has a header, a rule and one line per question.
    table = [
        line
        for line in out.out.splitlines()
        if line.startswith(("#", "-  ", *(f"{i} " for i in range(1, 10))))
    ]
    assert len(table) == 2 + len(rows)


def test_demo_fails_when_the_daemon_cannot_load_the_model(
    tiny_setup: dict[str, Path], tmp_path: Path, capsys
) -> None:
    _require_mosquitto()
    broken = tmp_path / "broken-model"  # passes the folder check (intact weights), fails to load (no model_type)
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    for weights in tiny_setup["model"].glob("*.safetensors"):
        shutil.copy(weights, broken / weights.name)
    code = demo.run_demo(
        model_dir=broken, video=tiny_setup["video"], ground_truth=tiny_setup["sidecar"], timeout_s=120
    )
    out = capsys.readouterr()
    assert code == 1
    assert "demo: FAILED" in out.out
    assert "the daemon exited with status" in out.err


def test_demo_missing_video(tmp_path: Path, tiny_setup: dict[str, Path], capsys) -> None:
    code = demo.run_demo(
        model_dir=tiny_setup["model"], video=tmp_path / "none.mp4", ground_truth=tiny_setup["sidecar"]
    )
    assert code == 2
    assert "camera video not found" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "file", "no_weights"])
def test_demo_bad_model_folder_is_a_usage_error(tmp_path: Path, tiny_setup: dict[str, Path], capsys, case) -> None:
    """Refused before a broker or daemon starts: one line, exit 2."""
    model = tmp_path / "model"
    if case == "file":
        model.write_text("not a folder")
    elif case == "no_weights":
        model.mkdir()
        shutil.copy(tiny_setup["model"] / "config.json", model / "config.json")
    code = demo.run_demo(model_dir=model, video=tiny_setup["video"], ground_truth=tiny_setup["sidecar"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    want = {"missing": f"edgevlm: error: model folder {model} does not exist\n",
            "file": f"edgevlm: error: {model} is not a folder (expected a model folder with config.json)\n",
            "no_weights": "edgevlm: error: "}[case]  # fmt: skip
    assert out.err.startswith(want) and out.err.count("\n") == 1, out.err


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
def test_demo_time_limit_must_be_positive(tiny_setup: dict[str, Path], capsys, timeout_s: float) -> None:
    code = demo.run_demo(model_dir=tiny_setup["model"], video=tiny_setup["video"],
                         ground_truth=tiny_setup["sidecar"], timeout_s=timeout_s)  # fmt: skip
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err == f"edgevlm: error: the time limit must be a number of seconds > 0, got {timeout_s}\n"


@pytest.mark.parametrize("argv", [["demo", "--timeout-s", "0"], ["demo", "--timeout-s", "nan"]])
def test_demo_command_line_refuses_a_zero_time_limit(argv: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", "edgevlm.cli", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    want = f"edgevlm: error: argument --timeout-s: expected a number > 0, got {argv[-1]} (see 'edgevlm demo --help')\n"
    assert res.stderr == want
    res = subprocess.run([sys.executable, "-m", "edgevlm.daemon.demo", *argv[1:]], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert (res.returncode, res.stdout, res.stderr) == (2, "", want)


def test_demo_interrupted_stops_broker_and_daemon(tiny_setup: dict[str, Path], capsys, monkeypatch) -> None:
    """Ctrl-C while the questions run: the daemon and the broker are stopped, exit 130 (as ``edgevlm ask``)."""
    _require_mosquitto()
    started: list = []

    def interrupted(port, rr, daemon, segments, deadline):
        started.append(daemon)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_ask_all", interrupted)
    code = demo.run_demo(model_dir=tiny_setup["model"], video=tiny_setup["video"],
                         ground_truth=tiny_setup["sidecar"], timeout_s=120)  # fmt: skip
    out = capsys.readouterr()
    assert code == 130
    assert out.err.endswith("demo: interrupted (broker and daemon stopped)\n") and "FAILED" not in out.out
    assert started and started[0].proc.poll() is not None  # the daemon process has exited


@pytest.mark.parametrize("text", ["{not json", '{"segments": [{"start_ms": 0}]}', "[]", '{"segments": 3}'])
def test_bad_ground_truth(tmp_path: Path, text: str) -> None:
    path = tmp_path / "gt.json"
    path.write_text(text)
    with pytest.raises(demo.DemoError, match="ground truth"):
        demo.load_ground_truth(path)


def test_segment_lookup_wraps_around_the_loop() -> None:
    segs = [demo.Segment(0, 2000, {"q": "a"}), demo.Segment(2000, 5000, {"q": "b"})]
    assert demo.segment_at(segs, 1999.0).answers["q"] == "a"
    assert demo.segment_at(segs, 2000.0).answers["q"] == "b"
    assert demo.segment_at(segs, 5000.0 + 10.0).answers["q"] == "a"  # second loop
    assert demo.segment_at(segs, None) is None


def test_missing_mosquitto_prints_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(demo.DemoError) as info:
        demo.ensure_mosquitto(path=str(tmp_path), extra_dirs=(), may_install=False)
    msg = str(info.value)
    assert "mosquitto and mosquitto-clients not installed" in msg
    assert demo.INSTALL_COMMAND in msg


def test_demo_with_shipped_model() -> None:
    """``make demo``'s command on the bundled video: exits 0 and prints right answers."""
    present, reason = _demo_assets_present()
    if not present:
        pytest.skip(reason)
    _require_mosquitto()
    res = subprocess.run(
        [sys.executable, "-m", "edgevlm.cli", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "demo: OK" in res.stdout and "Traceback" not in res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    assert len(rows) >= 4 and any(r["via"] == "mosquitto_rr" for r in rows)
    assert all(r["error"] is None and r["answer"] for r in rows)
    assert result["checked"] >= len(rows) - 1  # at most one question lands on a scene change
    assert result["right"] >= 0.75 * result["checked"]
    count = [r for r in rows if r["question"] == "how many shapes are there?" and r["correct"] is not None]
    assert count and all(r["answer"].strip() in {"1", "2", "3", "4"} for r in count)


def test_segment_grades_any_canonical_question_from_its_objects():
    """A question asked about one segment but answered on a frame of another is graded against
    the scene actually used, computed from the sidecar's objects."""
    from edgevlm.runtime.demo import scenes_json_path

    seg = demo.load_ground_truth(scenes_json_path())[0]  # one large yellow triangle, upper left
    assert [o["shape"] for o in seg.objects] == ["triangle"]
    assert seg.expected("how many red shapes are there?") == "0"
    assert seg.expected("is the yellow triangle on the left or the right?") == "left"
    assert seg.expected("is the yellow triangle at the top or the bottom?") == "top"
    assert seg.expected("describe the scene.") == "large yellow triangle"
    assert seg.expected("what color is the circle?") is None  # no circle: no exact answer
    assert seg.expected("what is the meaning of life?") is None


def test_demo_sigterm_stops_its_broker_and_daemon(tmp_path: Path) -> None:
    """``kill <edgevlm demo>`` (a CI job cancelled, ``timeout make demo``) while it runs: like Ctrl-C, its
    private broker and daemon are stopped and its temporary folder removed (they used to outlive it)."""
    import os
    import re
    import signal
    import time

    _require_mosquitto()
    proc = subprocess.Popen([sys.executable, "-m", "edgevlm.cli", "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    pids: list[int] = []
    with reaped(proc):
        for _ in range(2):
            line = proc.stdout.readline()
            match = re.search(r"\(pid (\d+)\)", line)
            assert match, line
            pids.append(int(match.group(1)))
        workdirs = [p for p in Path("/proc", str(pids[0]), "cmdline").read_bytes().split(b"\0") if b"edgevlm-demo-" in p]
        out, err = stop(proc)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if Path("/proc", str(pid)).exists()
                 and b"zombie" not in Path("/proc", str(pid), "status").read_bytes().lower()]
        time.sleep(0.1)
    for pid in alive:  # do not leak them from the test either
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"still running after the demo was stopped: {alive}"
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
    assert "demo: terminated (broker and daemon stopped)" in err and "Traceback" not in err, err
    assert workdirs and not any(Path(os.fsdecode(w)).parent.exists() for w in workdirs), workdirs
