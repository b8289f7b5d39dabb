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
from edgevlm.cli import build_parser, main  # noqa: E402

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
    png = files["scene.png"].read_bytes()
    (d / "flipped.png").write_bytes(_flip_middle(png))
    noise = (np.random.default_rng(0).random((64, 80, 3)) * 255).astype(np.uint8)
    (d / "flipped.jpg").write_bytes(_flip_middle(cv2.imencode(".jpg", noise)[1].tobytes()))  # makes markers
    for name in ("truncated.jpg", "garbage.png", "empty.jpg", "flipped.png", "flipped.jpg"):
        files[name] = d / name
    return files


def _flip_middle(data: bytes, n: int = 40) -> bytes:
    """Bytes XORed in the middle of a file: damaged, not truncated (a fresh-clone user's test)."""
    out = bytearray(data)
    for i in range(len(out) // 2, len(out) // 2 + n):
        out[i] ^= 0x5A
    return bytes(out)


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
    assert res.stdout.count("\n") == 1  # one JSON object on one line
    out = json.loads(res.stdout)
    # The README's shape: top-level answer (the text), stats, model (+ the question asked).
    assert set(out) == {"answer", "stats", "model", "question"}
    assert out["answer"] == expected and out["question"] == QUESTION
    stats = out["stats"]
    assert (stats["input_width_px"], stats["input_height_px"]) == (64, 48)
    assert 1 <= stats["new_tokens"] <= MAX_NEW_TOKENS
    assert stats["e2e_ms"] >= stats["ttft_ms"] > 0
    assert stats["vision_tokens"] == 12 and stats["backend"] == "torch"
    assert None not in stats.values() and "exit_layer" not in stats  # no nulls, as on the wire
    assert out["model"]["model_dir"] == str(tiny_model)
    assert out["model"]["backend"] == "torch" and out["model"]["device"] == "cpu"
    assert out["model"]["dtype"] == "float32" and out["model"]["resolution_ladder"] == [64]


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


def test_ask_stream_json_prints_deltas_then_the_final_object(tiny_model: Path, image_files: dict[str, Path],
                                                             capsys) -> None:  # fmt: skip
    expected = _expected_text(tiny_model, image_files["scene.png"], QUESTION)
    code = main(["ask", "--stream", "--json", "--image", str(image_files["scene.png"]), "--model", str(tiny_model),
                 "--max-new-tokens", str(MAX_NEW_TOKENS), QUESTION])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = [json.loads(line) for line in out.out.splitlines()]  # every line is one JSON object
    *deltas, final = lines
    assert len(deltas) >= 2 and all(list(d) == ["delta"] and isinstance(d["delta"], str) for d in deltas)
    assert "".join(d["delta"] for d in deltas) == final["answer"] == expected
    assert final["question"] == QUESTION and final["stats"]["new_tokens"] == MAX_NEW_TOKENS


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
        answer = json.loads(code_out.stdout)["answer"]
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
        ("flipped.png", "corrupt PNG image: chunk 'IDAT' at byte"),  # and no "libpng error: ..." line
        ("flipped.jpg", "corrupt JPEG image: "),
    ],
)
def test_bad_image_file_is_one_line_exit_2(name: str, needle: str, image_files: dict[str, Path]) -> None:
    res = run_cli("ask", "--image", str(image_files[name]), "what is this?")
    line = assert_one_line_error(res, needle, name)
    assert "truncated" not in line or name == "truncated.jpg"


def test_decoder_warnings_do_not_reach_the_terminal(tiny_model: Path, tmp_path: Path) -> None:
    """Damage inside a JPEG's entropy-coded data decodes (libjpeg pads it) with a warning that
    libjpeg prints on fd 2; ``ask`` keeps it off stderr (shown with -vv as a debug line)."""
    y, x = np.mgrid[0:48, 0:64]
    bgr = np.stack([x * 4, y * 5, np.full_like(x, 120)], axis=-1).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 95])
    data = buf.tobytes()
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    body = data[start:-2]
    path = tmp_path / "damaged.jpg"
    path.write_bytes(data[:start] + body[: len(body) // 2] + data[-2:])  # scan cut short, EOI kept
    res = run_cli("ask", "--image", str(path), "--model", str(tiny_model), "--max-new-tokens", "2", "q?")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    res = run_cli("-vv", "ask", "--image", str(path), "--model", str(tiny_model), "--max-new-tokens", "2", "q?")
    assert res.returncode == 0 and "image decoder: Corrupt JPEG data" in res.stderr


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
    assert_one_line_error(res, "--device: expected cpu, cuda or cuda:N, got 'tpu'")
    res = run_cli("ask", "--image", str(image_files["scene.png"]), "--device", "bogus", "q?")
    assert_one_line_error(res, "got 'bogus'")


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
    for name in ("cam.mp4", "rear.mp4"):  # real videos: --check-config decodes a frame of each
        writer = cv2.VideoWriter(str(tmp_path / name), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (32, 24))
        for _ in range(3):
            writer.write(np.full((24, 32, 3), 90, np.uint8))
        writer.release()
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(
        "mqtt:\n  host: 127.0.0.1\n  port: 18830\n  device_id: robot-7\n"
        "sources:\n  - name: front\n    uri: cam.mp4\n  - name: usb\n    uri: rear.mp4\n"
    )
    res = run_cli("serve", "--check-config", str(cfg), timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        f"{cfg}: OK (broker 127.0.0.1:18830, device_id robot-7, sources: front, usb, model: demo)"
    )


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


# ------------------------------------------------------------------------- serve: model.path


def _serve_config(tmp_path: Path, model: Path) -> Path:
    cfg = tmp_path / "daemon.yaml"
    # Port 1: nothing listens; the model is checked (and loaded) before the broker is contacted.
    cfg.write_text(f"mqtt:\n  host: 127.0.0.1\n  port: 1\nmodel:\n  path: {model}\nmetrics:\n  listen: null\n")
    return cfg


def _broken_models(tmp_path: Path, tiny_model: Path) -> dict[str, tuple[Path, str]]:
    """Model folders a user gets wrong, with the exact one-line error each must give."""
    import shutil

    out: dict[str, tuple[Path, str]] = {}
    missing = tmp_path / "no-such-model"
    out["missing"] = (missing, f"model.path: model folder {missing} does not exist")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    out["no config.json"] = (empty, f"model.path: model folder {empty} has no config.json")
    garbage = tmp_path / "garbage-weights"
    shutil.copytree(tiny_model, garbage)
    junk = b"\x89PNG this is not a safetensors file" * 100
    (garbage / "model.safetensors").write_bytes(junk)
    out["garbage weights"] = (
        garbage,
        f"model.path: {garbage / 'model.safetensors'}: not a safetensors file (header size field "
        f"{int.from_bytes(junk[:8], 'little')} is implausible)",
    )
    cut = tmp_path / "truncated-weights"
    shutil.copytree(tiny_model, cut)
    weights = cut / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    header_n = int.from_bytes(data[:8], "little")
    declared = len(data) - 8 - header_n
    out["truncated weights"] = (
        cut,
        f"model.path: {weights}: truncated safetensors file: the header declares {declared} bytes of tensor "
        f"data, the file holds {len(data) // 2 - 8 - header_n}",
    )
    return out


@pytest.mark.parametrize("case", ["missing", "no config.json", "garbage weights", "truncated weights"])
@pytest.mark.parametrize("mode", ["--check-config", "--config"])
def test_serve_model_that_cannot_load_is_one_line_exit_2(
    tmp_path: Path, tiny_model: Path, case: str, mode: str
) -> None:
    model, message = _broken_models(tmp_path, tiny_model)[case]
    res = run_cli("serve", mode, str(_serve_config(tmp_path, model)), timeout=120)
    assert assert_one_line_error(res) == f"edgevlm: error: {message}"


def test_serve_model_that_fails_while_loading_exits_2(tmp_path: Path, tiny_model: Path) -> None:
    """Intact files whose tensors do not match config.json pass the folder check and fail in the
    loader: still exit 2 and the error as the last line (after the daemon's start-up log lines)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model = tmp_path / "missing-tensor"
    shutil.copytree(tiny_model, model)
    tensors = load_file(model / "model.safetensors")
    dropped = sorted(k for k in tensors if k.endswith("post_attention_layernorm.weight"))[0]
    del tensors[dropped]
    save_file(tensors, model / "model.safetensors")
    cfg = _serve_config(tmp_path, model)
    assert run_cli("serve", "--check-config", str(cfg), timeout=60).returncode == 0  # looks loadable
    res = run_cli("serve", "--config", str(cfg), timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    last = res.stderr.splitlines()[-1]
    assert last.startswith(f"edgevlm: error: model: cannot load {model} on cpu: checkpoint {model} is missing tensor(s): ")
    assert "start-up failed" not in res.stderr  # reported once, by the CLI


def test_ask_with_early_exit_and_pruning_on_the_demo_model(image_files: dict[str, Path], capsys) -> None:
    """--exit-layer / --keep-ratio reach the engine: the answer and stats equal Engine.ask with the
    same operating point, and the stats say where the encoder stopped (no confidence: forced)."""
    from edgevlm.runtime import Engine
    from edgevlm.runtime.image import load_image
    from edgevlm.types import OperatingPoint

    image = image_files["scene.png"]
    op = OperatingPoint(name="cli", exit_layer=2, keep_ratio=0.5)
    want = Engine.load(None).ask(load_image(image), "describe the scene.", max_new_tokens=8, operating_point=op)
    code = main(["ask", "--json", "--image", str(image), "--exit-layer", "2", "--keep-ratio", "0.5",
                 "--max-new-tokens", "8", "describe", "the", "scene."])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["answer"] == want.text
    assert out["stats"]["exit_layer"] == 2 and "exit_confidence" not in out["stats"]  # forced: no head consulted
    assert out["stats"]["vision_tokens"] == want.stats.vision_tokens < 24 * 18


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--exit-threshold", "1.5"], "expected a number in [0, 1]"),
        (["--keep-ratio", "0"], "expected a number in (0, 1]"),
        (["--exit-layer", "0"], "--exit-layer"),
    ],
)
def test_ask_operating_point_option_errors(image_files: dict[str, Path], capsys, args, needle) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["ask", "--image", str(image_files["scene.png"]), *args, "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgevlm: error:") and needle in err[0], err


def test_ask_resolution_below_the_patch_on_a_model_without_a_ladder(tmp_path: Path, image_files: dict[str, Path],
                                                                    capsys) -> None:
    """A SmolVLM checkpoint has no resolution ladder: the message used to end in "(the model's resolution
    ladder:  px)"."""
    import re

    from family_support import write_checkpoint

    model = write_checkpoint("smolvlm", tmp_path / "smolvlm")
    capsys.readouterr()  # transformers' save_pretrained progress bar
    code = main(["ask", "--image", str(image_files["scene.png"]), "--model", str(model), "--resolution", "1", "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"edgevlm: error: --resolution 1 px is below the model's patch size "
                                          r"\((\d+) px\): use at least \1", err[0]), err


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_ask_seed_out_of_range_is_one_line_exit_2(tiny_model: Path, image_files: dict[str, Path], capsys,
                                                  seed) -> None:
    """``--seed`` past 2**64 used to end in ``internal error: ValueError: Overflow when unpacking long long``,
    exit 1."""
    code = main(["ask", "--image", str(image_files["scene.png"]), "--model", str(tiny_model), "--temperature", "0.7",
                 "--seed", seed, "--max-new-tokens", "2", "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"edgevlm: error: seed must be in [0, 9223372036854775807], got {seed}"], err


@pytest.mark.parametrize("layer", ["1", "9"])
def test_ask_early_exit_on_a_model_without_exit_heads(tiny_model: Path, image_files: dict[str, Path], capsys,
                                                      layer):
    code = main(["ask", "--image", str(image_files["scene.png"]), "--model", str(tiny_model), "--exit-layer", layer,
                 "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no exit heads" in err[0], err


@pytest.mark.parametrize("layer", ["1", "4", "6", "7"])
def test_ask_exit_layer_must_be_an_exit_point(image_files: dict[str, Path], capsys, layer):
    """The demo model exits after blocks 2 and 3 only: other blocks (the last one and beyond
    included, which would otherwise silently run at full depth) are refused in one line."""
    code = main(["ask", "--image", str(image_files["scene.png"]), "--exit-layer", layer, "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--exit-layer {layer} is not an exit point of this model (exit points: 2, 3)" in err[0]


def test_ask_text_stats_show_a_consulted_confidence(image_files: dict[str, Path], capsys):
    """A threshold no exit reaches: full depth, and the text stats still show the confidence."""
    code = main(["ask", "--image", str(image_files["scene.png"]), "--exit-threshold", "1", "--max-new-tokens", "2",
                 "hi"])
    assert code == 0
    out = capsys.readouterr().out
    assert "exit     none: full depth (last exit confidence 0." in out


def test_ask_stream_into_a_closed_pipe_is_not_an_error(tiny_model: Path, image_files: dict[str, Path]) -> None:
    """`edgevlm ask --stream ... | head -c 1`: the reader leaves early; no error line, exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgevlm.cli", "ask", "--stream", "--image", str(image_files["scene.png"]), "--model",
         str(tiny_model), "--max-new-tokens", "64", QUESTION],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err


@pytest.mark.parametrize(("args", "needle"), [
    (["--profile", "nope"], "profile 'nope' not found (known: "),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--time-budget-s", "nan"], "--time-budget-s must be > 0, got nan"),
    (["--adapter-hidden", "-1"], "argument --adapter-hidden: expected a positive integer, got -1"),
    (["--adapter-attn-dim", "-2"], "argument --adapter-attn-dim: expected an integer >= 0, got -2"),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),  # was torch's device list
])
def test_calibrate_bad_option_is_refused_before_the_model_loads(tmp_path: Path, capsys, args, needle) -> None:
    """Checked before anything loads or trains (the model folder does not even exist): ``--profile nope``
    used to be read by the frontier only after the whole training (minutes; the exit heads already
    written), ``--lr nan`` reached torch's optimizer (``Invalid learning rate: nan``) and
    ``--adapter-hidden -1`` printed a pydantic dump."""
    try:
        code = main(["calibrate", str(tmp_path / "no-model"), *args])
    except SystemExit as exc:  # argparse's own errors (OneLineParser: one line, status 2)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgevlm: error: ") and needle in err[0], err


@pytest.mark.parametrize("command", ["calibrate", "bench", "doctor", "quantize", "ask", "serve"])
def test_help_shows_no_rst_markup(command: str, capsys) -> None:
    try:
        code = main([command, "--help"])
    except SystemExit as exc:  # argparse's --help exits; sub-commands with their own parser return
        code = exc.code
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("usage: edgevlm")
    assert "``" not in out and ":class:`" not in out and ":func:`" not in out, out
    if command == "calibrate":
        assert "edgevlm calibrate MODEL_OR_BUNDLE: train the exit heads" in out
    if command == "quantize":  # every family quantizes: the help names each (it missed internvl)
        from edgevlm.runtime.models import FAMILIES

        listed = " ".join(out.split()).split("any registered family: ")[1].split(")")[0]
        assert listed.split(", ") == list(FAMILIES), listed


def test_plain_text_strips_inline_markup() -> None:
    from edgevlm.cli_args import plain_text

    rst = "``edgevlm x``: see :class:`~edgevlm.Client` and :func:`edgevlm.runtime.load`, **not** *this*; 2 * 3"
    assert plain_text(rst) == "edgevlm x: see Client and edgevlm.runtime.load, not this; 2 * 3"


@pytest.mark.parametrize(("flags", "named"), [
    (["--exit-layer", "1"], "--exit-layer"), (["--exit-threshold", "0.9"], "--exit-threshold"),
    (["--exit-layer", "1", "--exit-threshold", "0.9"], "--exit-layer / --exit-threshold"),
])
def test_ask_exit_flags_without_exit_heads_name_the_flag(tiny_model: Path, image_files: dict[str, Path], capsys,
                                                         flags, named):
    # was "operating point 'cli': this model has no exit heads ..." (the CLI's internal point name)
    code = main(["ask", "--image", str(image_files["scene.png"]), "--model", str(tiny_model), *flags, "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"edgevlm: error: {named}: this model has no exit heads (run `edgevlm calibrate` on it)"], err


@pytest.mark.parametrize("device", ["cpu"])
def test_ask_tensorrt_on_the_cpu_is_refused_before_anything_loads(image_files: dict[str, Path], capsys, device):
    # was "backend 'tensorrt' needs optional dependencies ... pip install 'edgevlm[tensorrt]'" on a CPU
    # machine: installing TensorRT would only lead to "needs a CUDA device"
    code = main(["ask", "--image", str(image_files["scene.png"]), "--backend", "tensorrt", "--device", device, "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"edgevlm: error: --device: backend 'tensorrt' needs a CUDA device, got '{device}'"], err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("backend", "device", "why"), [
    ("onnx", "cpu", "its graphs compute in float32"),
    ("tensorrt", "cuda", "its engines' precision is fixed when the bundle is built; float32 in and out"),
])
def test_ask_bundle_backend_with_a_16_bit_dtype_is_refused_before_anything_loads(
        tmp_path: Path, dtype: str, backend: str, device: str, why: str) -> None:
    # was: ran float32 without a word (onnx; tensorrt too, and it also ignored the flag); neither the
    # model nor the image exists here: the flags are refused first
    res = run_cli("ask", "--image", str(tmp_path / "none.png"), "--model", str(tmp_path / "no-model"),
                  "--backend", backend, "--device", device, "--dtype", dtype, "hi")
    line = assert_one_line_error(res)
    assert line == (f"edgevlm: error: --dtype: backend '{backend}' runs float32 only ({why}), got '{dtype}'; "
                    "use float32 or leave it unset")


def test_ask_onnx_backend_with_float32_goes_on_to_the_image(tmp_path: Path, capsys) -> None:
    code = main(["ask", "--image", str(tmp_path / "none.png"), "--backend", "onnx", "--dtype", "float32", "hi"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgevlm: error: ") and "none.png" in err[0], err


def test_serve_extra_argument_names_the_serve_usage(tmp_path: Path) -> None:
    # was: "... (see 'edgevlm --help')": argparse hands a subcommand's leftovers to the top-level parser
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("mqtt:\n  port: 1\n")
    res = run_cli("serve", "--check-config", str(cfg), "extra-arg")
    assert assert_one_line_error(res) == "edgevlm: error: unrecognized arguments: extra-arg (see 'edgevlm serve --help')"


@pytest.mark.parametrize(("argv", "extra"), [
    (["ask", "--image", "x.png", "--nope", "q"], "--nope"),
    (["serve", "--config", "c.yaml", "--dry-run", "x"], "--dry-run x"),
    (["serve-ray", "--config", "c.yaml", "more"], "more"),
    (["demo", "--json", "--model-dir", "m"], "--model-dir m"),
])
def test_unrecognized_arguments_name_the_subcommand_usage(argv: list[str], extra: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"edgevlm: error: unrecognized arguments: {extra} "
                                         f"(see 'edgevlm {argv[0]} --help')\n"), out.err


@pytest.mark.parametrize(("argv", "extra"), [
    (["--nope", "serve"], "--nope"),
    (["-vv", "--nope", "ask"], "--nope"),
    (["-vx", "ask", "q"], "-vx"),
    (["--verbose=2", "demo"], "--verbose=2"),
])
def test_unknown_option_before_the_subcommand_is_named(argv: list[str], extra: str, capsys) -> None:
    # was: `edgevlm --nope serve` -> "one of the arguments --config --check-config is required (see
    # 'edgevlm serve --help')": argparse kept --nope as a leftover and reported the subcommand first
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"edgevlm: error: unrecognized arguments: {extra} (see 'edgevlm --help')\n"


def test_known_options_before_the_subcommand_still_parse() -> None:
    args = build_parser().parse_args(["-vv", "--verbose", "ask", "--image", "x.png", "q"])
    assert (args.command, args.verbose, args.question) == ("ask", 3, ["q"])


def test_ask_help_does_not_say_llava_only(capsys):
    # was "model folder (Hugging Face LLaVA format)" while six families load (the help stays
    # registry-free: `edgevlm --help` imports nothing of edgevlm.runtime, tests/test_packaging.py)
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "LLaVA format" not in out and "checkpoint folder of any registered model family" in out, out


def test_calibrate_help_says_kd_steps_and_adapter_blocks_are_llava_only(capsys):
    # was "0 ... for the Qwen / SmolVLM families", while InternVL and Gemma 3 refuse them too
    from edgevlm.quantize.calibrate import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Qwen / SmolVLM families" not in out
    assert "(LLaVA only: default 100, 0 with --keep-adapters; the other families take 0)" in out
    assert "initialised from the encoder's last blocks (LLaVA only)" in out


@pytest.mark.parametrize("kind", ["file", "proc"])
def test_calibrate_unwritable_out_is_refused_before_training(tmp_path, capsys, kind):
    # was: the whole training ran (hours on a real model), then "[Errno 2] No such file or directory"
    from edgevlm.quantize.calibrate import main as calibrate_main

    out = tmp_path / "a-file" if kind == "file" else Path("/proc/edgevlm-calibrate-out")
    if kind == "file":
        out.write_text("x")
    import time

    demo = Path(__file__).resolve().parents[1] / "runtime" / "demo" / "model"
    t0 = time.perf_counter()
    assert calibrate_main([str(demo), "--out", str(out), "--no-frontier", "--steps", "1", "--agreement-images",
                           "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edgevlm: error: --out {out}: cannot create the folder (") and err.count("\n") == 1, err
    assert "calibrate:" not in err and time.perf_counter() - t0 < 60  # no training step ran
