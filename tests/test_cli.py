"""The ``edgevlm`` command line: real answers, and one-line errors (exit 2, never a traceback).

Error paths run the CLI in a subprocess, as a user would, and check stdout/stderr and the exit
status. Answers come from a real engine: the tiny random checkpoint of
:func:`edgevlm.runtime.testing.write_tiny_checkpoint` (checked against the same engine in-process)
and, when its weights are present, the shipped demo model (checked against the scene's ground truth).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
pytest.importorskip("torch")

from edgevlm import __version__  # noqa: E402
from edgevlm.cli import main  # noqa: E402

QUESTION = "what color is the circle?"
MAX_NEW_TOKENS = 4


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgevlm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("edgevlm: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert res.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> dict[str, Path]:
    """The same 48x64 picture as 8-bit JPEG, PNG, BMP, WebP and a 16-bit grey+alpha-free PNG."""
    d = tmp_path_factory.mktemp("images")
    y, x = np.mgrid[0:48, 0:64]
    bgr = np.stack([x * 4, y * 5, np.full_like(x, 120)], axis=-1).astype(np.uint8)
    cv2.circle(bgr, (20, 20), 9, (0, 0, 230), -1)
    files = {}
    for name, img, params in (
        ("scene.jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 95]),
        ("scene.png", bgr, []),
        ("scene.bmp", bgr, []),
        ("scene.webp", bgr, [cv2.IMWRITE_WEBP_QUALITY, 101]),
        ("scene16.png", bgr.astype(np.uint16) * 257, []),
        ("scene_rgba.png", np.dstack([bgr, np.full((48, 64), 255, np.uint8)]), []),
    ):
        path = d / name
        assert cv2.imwrite(str(path), img, params)
        files[name] = path
    jpg = files["scene.jpg"].read_bytes()
    (d / "truncated.jpg").write_bytes(jpg[: len(jpg) // 2])
    (d / "garbage.png").write_bytes(b"this is not an image at all\n" * 20)
    (d / "empty.jpg").write_bytes(b"")
    for name in ("truncated.jpg", "garbage.png", "empty.jpg"):
        files[name] = d / name
    return files


def _expected_text(model: Path, image_path: Path, question: str) -> str:
    from edgevlm.runtime import Engine
    from edgevlm.runtime.image import load_image

    engine = Engine.load(model)
    return engine.ask(load_image(image_path), question, max_new_tokens=MAX_NEW_TOKENS).text


# --------------------------------------------------------------------------------- answers


def test_version() -> None:
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"edgevlm {__version__}"


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "edgevlm"
    assert script.exists(), "pip install -e . installs the 'edgevlm' console script"
    res = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"edgevlm {__version__}"


def test_ask_prints_answer_and_stats(tiny_model: Path, image_files: dict[str, Path]) -> None:
    image = image_files["scene.png"]
    expected = _expected_text(tiny_model, image, QUESTION)
    res = run_cli(
        "ask",
        "--image",
        str(image),
        "--model",
        str(tiny_model),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        QUESTION,
    )
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == expected
    stats = "\n".join(lines[1:])
    assert "64x48 px" in stats  # the tiny model's 64 px rung, aspect ratio kept
    assert f"{MAX_NEW_TOKENS} new tokens" in stats or "finish_reason=stop" in stats
    for key in ("vision", "prefill", "ttft", "tpot", "e2e"):
        assert f"{key} " in stats and " ms" in stats


def test_ask_json(tiny_model: Path, image_files: dict[str, Path]) -> None:
    image = image_files["scene.jpg"]
    expected = _expected_text(tiny_model, image, QUESTION)
    res = run_cli(
        "ask", "--json", "--image", str(image), "--model", str(tiny_model),
        "--max-new-tokens", str(MAX_NEW_TOKENS), "what", "color", "is", "the", "circle?",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["answer"]["text"] == expected
    stats = out["answer"]["stats"]
    assert (stats["input_width_px"], stats["input_height_px"]) == (64, 48)
    assert 1 <= stats["new_tokens"] <= MAX_NEW_TOKENS
    assert stats["e2e_ms"] >= stats["ttft_ms"] > 0
    assert out["model"]["model_dir"] == str(tiny_model)
    assert out["model"]["backend"] == "torch" and out["model"]["device"] == "cpu"


@pytest.mark.parametrize("name", ["scene.jpg", "scene.bmp", "scene.webp", "scene16.png", "scene_rgba.png"])
def test_ask_every_format_in_process(
    name: str, tiny_model: Path, image_files: dict[str, Path], capsys
) -> None:
    """Each format answers like the 8-bit PNG of the same picture decoded by the same code."""
    expected = _expected_text(tiny_model, image_files[name], QUESTION)
    code = main(["ask", "--image", str(image_files[name]), "--model", str(tiny_model),
                 "--max-new-tokens", str(MAX_NEW_TOKENS), QUESTION])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.splitlines()[0] == expected


def test_ask_stream_matches_ask(tiny_model: Path, image_files: dict[str, Path], capsys) -> None:
    expected = _expected_text(tiny_model, image_files["scene.png"], QUESTION)
    code = main(["ask", "--stream", "--image", str(image_files["scene.png"]), "--model", str(tiny_model),
                 "--max-new-tokens", str(MAX_NEW_TOKENS), QUESTION])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.splitlines()[0] == expected


def _demo_model_present() -> bool:
    from edgevlm.runtime.demo import model_dir

    return (model_dir() / "config.json").is_file() and any(model_dir().glob("*.safetensors"))


@pytest.mark.skipif(
    not _demo_model_present(), reason="demo model weights not shipped yet (runtime/demo/model)"
)
def test_ask_demo_model_by_default(tmp_path: Path) -> None:
    """No --model: the shipped demo model answers count questions about rendered scenes."""
    from edgevlm.runtime.demo import scenes

    right, total = 0, 0
    for i in range(3):
        scene = scenes.generate_scene(np.random.default_rng(1234 + i))
        path = tmp_path / f"scene{i}.png"
        assert cv2.imwrite(str(path), scenes.render(scene)[:, :, ::-1])
        question = "how many shapes are there?"
        code_out = run_cli("ask", "--json", "--image", str(path), question)
        assert code_out.returncode == 0, code_out.stderr
        answer = json.loads(code_out.stdout)["answer"]["text"]
        total += 1
        right += answer.strip() == scenes.answer(scene, "count_total")
    assert right >= 2, f"{right}/{total} right"


# ---------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("truncated.jpg", "truncated JPEG"),
        ("garbage.png", "unrecognised image data"),
        ("empty.jpg", "empty image data"),
    ],
)
def test_bad_image_file_is_one_line_exit_2(name: str, needle: str, image_files: dict[str, Path]) -> None:
    res = run_cli("ask", "--image", str(image_files[name]), "what is this?")
    assert_one_line_error(res, needle, name)


def test_missing_and_directory_image(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("ask", "--image", str(tmp_path / "nope.jpg"), "q?"), "nope.jpg", "No such file"
    )
    assert_one_line_error(run_cli("ask", "--image", str(tmp_path), "q?"), "Is a directory")


def test_bad_model_folder(tmp_path: Path, image_files: dict[str, Path]) -> None:
    res = run_cli(
        "ask", "--image", str(image_files["scene.png"]), "--model", str(tmp_path / "no-model"), "q?"
    )
    assert_one_line_error(res, "no-model")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    res = run_cli("ask", "--image", str(image_files["scene.png"]), "--model", str(tmp_path / "broken"), "q?")
    assert_one_line_error(res)


def test_unavailable_device(tiny_model: Path, image_files: dict[str, Path]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    res = run_cli(
        "ask", "--image", str(image_files["scene.png"]), "--model", str(tiny_model), "--device", "cuda", "q?"
    )
    assert_one_line_error(res, "cuda")
    res = run_cli(
        "ask", "--image", str(image_files["scene.png"]), "--model", str(tiny_model), "--device", "tpu", "q?"
    )
    assert_one_line_error(res, "tpu")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["ask", "what?"], "--image"),
        (["ask", "--image", "x.png"], "question"),
        (["ask", "--image", "x.png", "--max-new-tokens", "0", "q?"], "--max-new-tokens"),
        (["ask", "--image", "x.png", "--max-new-tokens", "many", "q?"], "'many'"),
        (["ask", "--image", "x.png", "--resolution", "-5", "q?"], "--resolution"),
        (["ask", "--image", "x.png", "--temperature", "nan", "q?"], "--temperature"),
        (["ask", "--image", "x.png", "--dtype", "int3", "q?"], "--dtype"),
        (["ask", "--image", "x.png", "  "], "question is empty"),
        (["serve"], "--config"),
        (["serve", "--config", "a.yaml", "--check-config", "a.yaml"], "not allowed with"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args: list[str], needle: str) -> None:
    assert_one_line_error(run_cli(*args, timeout=60), needle)


# ------------------------------------------------------------------------------ serve config


def test_check_config_ok(tmp_path: Path) -> None:
    video = tmp_path / "cam.mp4"
    video.write_bytes(b"\x00" * 16)  # only existence is checked by --check-config
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(
        "mqtt:\n  host: 127.0.0.1\n  port: 18830\n  device_id: robot-7\n"
        "sources:\n  - name: front\n    uri: cam.mp4\n  - name: usb\n    uri: 0\n"
    )
    res = run_cli("serve", "--check-config", str(cfg), timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{cfg}: OK (broker 127.0.0.1:18830, device_id robot-7, sources: front, usb)"


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("mqtt:\n  host: localhost\n  prot: 1883\n", ("mqtt.prot", "unknown key")),
        ("mqtt:\n  port: 70000\n", ("mqtt.port",)),
        ("sources:\n  - name: front\n    uri: missing-video.mp4\n", ("sources[0].uri", "missing-video.mp4")),
        ("bogus_key: 1\n", ("bogus_key", "unknown key")),
        ("queue_max_size: 0\n", ("queue_max_size",)),
        ("mqtt: [unclosed\n", ("YAML syntax error", "line")),
    ],
)
def test_check_config_bad_key_is_one_line_exit_2(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(text)
    assert_one_line_error(run_cli("serve", "--check-config", str(cfg), timeout=60), *needles)


def test_check_config_missing_file(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("serve", "--check-config", str(tmp_path / "none.yaml"), timeout=60), "none.yaml"
    )


def test_serve_with_bad_config_does_not_start(tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("model:\n  dtype: float8\n")
    assert_one_line_error(run_cli("serve", "--config", str(cfg), timeout=60), "model.dtype")
