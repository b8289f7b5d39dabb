"""Engine bundles from the command line, as a fresh-clone user meets them: ``edgevlm quantize``
input checks and file modes, ``edgevlm ask --backend``, ``serve --check-config`` with a bundle-only
backend, and ``ask`` argument errors (one line, exit 2).

A tiny random checkpoint is quantized by the real CLI (RTN, with the ONNX export) once per module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_support import one_line_error

cv2 = pytest.importorskip("cv2")
pytest.importorskip("torch")

from edgevlm.cli import main  # noqa: E402

QUESTION = "what color is the circle?"
UMASK = 0o027  # not the usual 022: modes must follow the umask, not a hard-coded 0644


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "model", seed=3, resolution_ladder=[64, 32])


@pytest.fixture(scope="module")
def bundle(tiny_src, tmp_path_factory) -> Path:
    """``edgevlm quantize SRC --out B --method rtn`` (ONNX artifacts included), under umask 027."""
    pytest.importorskip("onnxruntime")
    out = tmp_path_factory.mktemp("bundles") / "rtn"
    old = os.umask(UMASK)
    try:
        assert main(["quantize", str(tiny_src), "--out", str(out), "--method", "rtn"]) == 0
    finally:
        os.umask(old)
    return out


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> Path:
    y, x = np.mgrid[0:48, 0:64]
    bgr = np.stack([x * 4, y * 5, np.full_like(x, 120)], axis=-1).astype(np.uint8)
    cv2.circle(bgr, (20, 20), 9, (0, 0, 230), -1)
    path = tmp_path_factory.mktemp("img") / "scene.png"
    assert cv2.imwrite(str(path), bgr)
    return path


# ------------------------------------------------------------------------------ quantize


def test_bundle_files_get_umask_modes(bundle):
    files = sorted(p for p in bundle.rglob("*") if p.is_file())
    names = {p.relative_to(bundle).as_posix() for p in files}
    assert {"manifest.json", "model.safetensors", "onnx/vision.onnx", "onnx/vision.onnx.data",
            "onnx/decoder.onnx", "onnx/decoder.onnx.data"} <= names
    modes = {p.relative_to(bundle).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == {name: oct(0o666 & ~UMASK) for name in names}
    dirs = [bundle, *(p for p in bundle.rglob("*") if p.is_dir())]
    assert {oct(d.stat().st_mode & 0o777) for d in dirs} == {oct(0o777 & ~UMASK)}


def test_quantize_missing_folder_is_reported_before_calibration(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["quantize", str(missing), "--out", str(tmp_path / "x")]) == 2  # AWQ, the default
    assert one_line_error(capsys) == f"model folder {missing} does not exist"
    image = tmp_path / "scene.jpg"
    image.write_bytes(b"\xff\xd8")
    assert main(["quantize", str(image), "--out", str(tmp_path / "x")]) == 2
    assert one_line_error(capsys) == f"{image} is not a folder (expected a model folder with config.json)"
    assert not (tmp_path / "x").exists()


def test_quantize_bundle_input_is_reported_before_calibration(bundle, tmp_path, capsys):
    assert main(["quantize", str(bundle), "--out", str(tmp_path / "x")]) == 2  # AWQ without --calib
    assert one_line_error(capsys) == f"{bundle} is already an engine bundle; quantize the 16-bit source model"


def test_quantize_awq_without_calib_still_says_so(tiny_src, tmp_path, capsys):
    assert main(["quantize", str(tiny_src), "--out", str(tmp_path / "x")]) == 2
    assert one_line_error(capsys).startswith("AWQ needs calibration data: --calib DIR")


def test_quantize_names_an_unsupported_family_before_the_options(tmp_path, tiny_src, capsys):
    import json
    import shutil

    src = tmp_path / "gemma"
    shutil.copytree(tiny_src, src)
    (src / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    assert main(["quantize", str(src), "--out", str(tmp_path / "b")]) == 2  # awq without --calib, too
    assert one_line_error(capsys).startswith("config.json: model_type 'paligemma' is not supported; supported: llava")


def test_quantize_checks_the_output_folder_before_any_work(tmp_path, tiny_src, capsys):
    for out, why in [(tmp_path / "missing" / "b", "does not exist"), (Path("/proc/edgevlm-b"), "cannot write in /proc")]:
        assert main(["quantize", str(tiny_src), "--out", str(out), "--method", "rtn"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no plan: nothing was quantized
        assert captured.err.startswith(f"edgevlm: error: --out {out}: ") and why in captured.err


def test_quantize_checks_the_chat_template_before_any_work(tmp_path, capsys):
    """issue 11: a checkpoint whose template does not compile used to become a bundle that cannot answer."""
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", chat_template="{% for m in messages %}{{ m.content }")
    out = tmp_path / "b"
    assert main(["quantize", str(src), "--out", str(out), "--method", "rtn"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no plan printed: nothing was quantized
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgevlm: error: {src}: chat template does not compile: ")
    assert "checked before quantizing" in lines[0] and not out.exists()
    # a template that compiles but cannot render a user turn, and a broken tokenizer.json, too
    write_tiny_checkpoint(src, chat_template="{{ raise_exception('no') }}")
    assert main(["quantize", str(src), "--out", str(out), "--method", "rtn"]) == 2
    assert "chat template cannot render a user turn" in one_line_error(capsys)
    (src / "tokenizer.json").write_text("{")
    assert main(["quantize", str(src), "--out", str(out), "--method", "rtn"]) == 2
    assert "tokenizer.json: cannot load tokenizer" in one_line_error(capsys)


def test_quantize_summary_counts_every_file_and_writes_its_own_readme(tmp_path, capsys):
    from edgevlm.runtime.bundle import read_manifest
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", seed=3)
    (src / "README.md").write_text("# tiny\n\nfloat16 weights, 99 % accurate.\n")
    out = tmp_path / "b"
    assert main(["quantize", str(src), "--out", str(out), "--method", "rtn", "--json"]) == 0
    stdout = capsys.readouterr().out
    files = [p for p in out.rglob("*") if p.is_file()]
    size_mb = sum(p.stat().st_size for p in files) / 1e6
    assert f"{size_mb:.2f} MB in {len(files)} files" in stdout
    assert json.loads(stdout.strip().splitlines()[-1])["files"] == len(files)
    assert "ONNX vs PyTorch" in stdout and "max error" in stdout
    readme = (out / "README.md").read_text()
    assert "float16 weights" not in readme and "INT4 (RTN, group size 128" in readme
    assert any(e.path == "README.md" for e in read_manifest(out).files)  # covered by the hashes


# ------------------------------------------------------------------------------ ask


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_ask_backend_runs_the_bundle(bundle, image_path, backend, capsys):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.image import load_image

    expected = Engine.load(bundle, backend=backend).ask(load_image(image_path), QUESTION, max_new_tokens=4)
    code = main(["ask", "--json", "--image", str(image_path), "--model", str(bundle), "--backend", backend,
                 "--max-new-tokens", "4", QUESTION])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["model"]["backend"] == backend and out["stats"]["backend"] == backend
    assert out["answer"] == expected.text and out["stats"]["new_tokens"] == expected.stats.new_tokens


def test_ask_onnx_backend_on_a_checkpoint_folder(tiny_src, image_path, capsys):
    code = main(["ask", "--image", str(image_path), "--model", str(tiny_src), "--backend", "onnx", QUESTION])
    assert code == 2
    assert one_line_error(capsys) == (f"{tiny_src} is not an engine bundle: the onnx backend runs bundles built "
                                       "by `edgevlm quantize` (ONNX artifacts in onnx/)")


def test_ask_unknown_backend(image_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ask", "--image", str(image_path), "--backend", "onnxruntime", QUESTION])
    assert exc.value.code == 2
    assert one_line_error(capsys).startswith("argument --backend: invalid choice: 'onnxruntime'")


def test_ask_model_that_is_a_file(image_path, capsys):
    assert main(["ask", "--image", str(image_path), "--model", str(image_path), QUESTION]) == 2
    assert one_line_error(capsys) == f"{image_path} is not a folder (expected a model folder with config.json)"


@pytest.mark.parametrize("resolution", [1, 7, 15])
def test_ask_resolution_below_the_patch_size(tiny_src, image_path, resolution, capsys):
    code = main(["ask", "--image", str(image_path), "--model", str(tiny_src), "--resolution", str(resolution),
                 QUESTION])
    assert code == 2
    assert one_line_error(capsys) == (f"--resolution {resolution} px is below the model's patch size (16 px): "
                                       "use at least 16 (the model's resolution ladder: 32, 64 px)")


@pytest.mark.parametrize("resolution", [8193, 100000])
def test_ask_resolution_above_the_largest_is_refused_before_any_allocation(tiny_src, image_path, resolution, capsys):
    code = main(["ask", "--image", str(image_path), "--model", str(tiny_src), "--resolution", str(resolution),
                 QUESTION])
    assert code == 2
    assert one_line_error(capsys) == f"--resolution {resolution} px is above the largest input resolution, 8192 px"


def test_ask_resolution_at_the_patch_size_runs(tiny_src, image_path, capsys):
    code = main(["ask", "--json", "--image", str(image_path), "--model", str(tiny_src), "--resolution", "16",
                 "--max-new-tokens", "2", QUESTION])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["stats"]["vision_tokens"] == 1


# ------------------------------------------------------------------------------ serve --check-config


def _config(tmp_path: Path, model: str) -> Path:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"mqtt:\n  host: 127.0.0.1\n  port: 1\nmodel:\n{model}metrics:\n  listen: null\n")
    return cfg


NULL_PATH = ("model.backend: '{b}' runs engine bundles only, and model.path is null (the shipped demo model, "
             "not a bundle): set model.path to a bundle built by `edgevlm quantize`, or use backend 'torch'")


@pytest.mark.parametrize("mode", ["--check-config", "--config"])
@pytest.mark.parametrize(("model", "message"), [
    ("  path: null\n  backend: onnx\n", NULL_PATH.format(b="onnx")),
    ("  backend: onnx\n", NULL_PATH.format(b="onnx")),
    ("  path: null\n  backend: tensorrt\n  device: cuda\n", NULL_PATH.format(b="tensorrt")),
    ("  path: /models/b\n  backend: tensorrt\n", "model.device: backend 'tensorrt' needs a CUDA device, got 'cpu'"),
    # was: accepted, and the daemon ran float32 (the ONNX graphs' precision) without a word
    ("  path: /models/b\n  backend: onnx\n  dtype: bfloat16\n",
     "model.dtype: backend 'onnx' runs float32 only (its graphs compute in float32), got 'bfloat16'; "
     "use float32 or leave it unset"),
    ("  path: /models/b\n  backend: tensorrt\n  device: cuda\n  dtype: float16\n",
     "model.dtype: backend 'tensorrt' runs float32 only (its engines' precision is fixed when the bundle is built; "
     "float32 in and out), got 'float16'; use float32 or leave it unset"),
])
def test_bundle_backend_without_a_bundle_is_refused(tmp_path, mode, model, message, capsys):
    assert main(["serve", mode, str(_config(tmp_path, model))]) == 2
    assert one_line_error(capsys) == message


def test_check_config_onnx_on_a_checkpoint_folder(tiny_src, tmp_path, capsys):
    assert main(["serve", "--check-config", str(_config(tmp_path, f"  path: {tiny_src}\n  backend: onnx\n"))]) == 2
    assert one_line_error(capsys) == (
        f"model.path: {tiny_src} is not an engine bundle (no manifest.json): backend 'onnx' runs bundles built by "
        "`edgevlm quantize`; use backend 'torch' for a checkpoint folder")


def test_check_config_onnx_on_a_bundle_without_onnx(bundle, tmp_path, capsys):
    import shutil

    no_onnx = tmp_path / "no-onnx"
    shutil.copytree(bundle, no_onnx)
    shutil.rmtree(no_onnx / "onnx")
    assert main(["serve", "--check-config", str(_config(tmp_path, f"  path: {no_onnx}\n  backend: onnx\n"))]) == 2
    assert one_line_error(capsys) == f"model.path: bundle {no_onnx} has no onnx/vision.onnx, which backend 'onnx' needs"
    assert main(["serve", "--check-config",
                 str(_config(tmp_path, f"  path: {bundle}\n  backend: tensorrt\n  device: cuda\n"))]) == 2
    assert one_line_error(capsys) == (f"model.path: bundle {bundle} has no tensorrt/vision.engine, which backend "
                                       "'tensorrt' needs")


def test_check_config_onnx_on_a_bundle_is_ok(bundle, tmp_path, capsys):
    cfg = _config(tmp_path, f"  path: {bundle}\n  backend: onnx\n")
    assert main(["serve", "--check-config", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{cfg}: OK (broker 127.0.0.1:1, device_id {_device_id(cfg)}, sources: none, model: {bundle})")


def _device_id(cfg: Path) -> str:
    from edgevlm.config import load_daemon_config

    return load_daemon_config(cfg).mqtt.device_id


def test_a_frontier_measured_on_a_bundle_keeps_it_loadable_and_serves_onnx(bundle, tmp_path, capsys):
    """`python -m edgevlm.quantize.frontier BUNDLE` (what the daemon's log suggests) wrote frontier.json
    without listing it in manifest.json, so the bundle no longer loaded ('frontier.json is not listed in
    manifest.json'). And the stored frontier could hold only token-pruning points, none of which the ONNX
    backend runs. Now the manifest lists it, and the ONNX engine's controller takes the plain points."""
    import shutil

    from edgevlm.config import parse_daemon_config
    from edgevlm.daemon.budget import build_controller
    from edgevlm.profile import load_frontier
    from edgevlm.quantize import frontier
    from edgevlm.runtime import Engine
    from edgevlm.runtime.bundle import read_manifest, verify_bundle

    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    assert frontier.main([str(b), "--n", "2", "--rungs", "64", "32", "--keep-ratios", "1.0", "0.25", "--caps"]) == 0
    capsys.readouterr()
    assert {"frontier.json", "frontier.png"} <= {e.path for e in read_manifest(b).files}
    verify_bundle(b)  # every hash, the new files' included
    record = load_frontier(b / "frontier.json")
    plain = {p.name for p in record.frontier if p.keep_ratio is None}
    assert plain and plain <= {"r64", "r32"}  # the plain points' own frontier is stored
    engine = Engine.load(b, backend="onnx")
    bc = build_controller(parse_daemon_config({}), engine)
    assert bc.source == str(b / "frontier.json") and {p.name for p in bc.points} <= plain


def test_an_interrupt_before_the_manifest_lists_a_new_frontier_leaves_the_bundle_as_it_was(bundle, tmp_path,
                                                                                           monkeypatch, capsys):
    """frontier.json was written, then the manifest updated in a second step: an interrupt (Ctrl-C, SIGTERM)
    between the two left a frontier.json the manifest did not list, and the bundle no longer loaded. Now the
    two files and the manifest are replaced together; the fault injected: the interrupt arrives while the
    manifest is being staged."""
    import shutil

    from edgevlm.quantize import calibrate, frontier
    from edgevlm.runtime.bundle import verify_bundle

    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    before = sorted(p.name for p in b.iterdir())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "add_to_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        frontier.main([str(b), "--n", "2", "--rungs", "32", "--caps"])
    capsys.readouterr()
    assert sorted(p.name for p in b.iterdir()) == before  # no frontier.json, no temporary file
    verify_bundle(b)


def test_quantize_overwrite_replaces_a_bundle_only_never_other_files(tiny_src, bundle, tmp_path, capsys):
    """Was: --overwrite deleted whatever --out named: `--out proj --overwrite` for the model in proj/model
    deleted the source checkpoint and every other file in proj; a folder of anything else went the same way."""
    import shutil

    proj = tmp_path / "proj"
    shutil.copytree(tiny_src, proj / "model")
    (proj / "notes.txt").write_text("keep me")
    assert main(["quantize", str(proj / "model"), "--out", str(proj), "--overwrite", "--method", "rtn"]) == 2
    assert one_line_error(capsys) == f"output folder {proj} holds the model folder {proj / 'model'} (choose another --out)"
    other = tmp_path / "other"
    other.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (other / name).write_text(name)
    assert main(["quantize", str(tiny_src), "--out", str(other), "--overwrite", "--method", "rtn"]) == 2
    assert one_line_error(capsys) == (f"--overwrite replaces an engine bundle, and output folder {other} is not one "
                                       "(no manifest.json; it holds a.txt, b.txt, c.txt and 1 more): choose another --out")
    assert sorted(p.name for p in other.iterdir()) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    assert (proj / "notes.txt").read_text() == "keep me" and (proj / "model" / "config.json").is_file()
    # an earlier bundle is what --overwrite replaces
    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    (old / "stale.txt").write_text("from the old build")
    assert main(["quantize", str(tiny_src), "--out", str(old), "--overwrite", "--method", "rtn", "--no-onnx"]) == 0
    capsys.readouterr()
    assert (old / "manifest.json").is_file() and not (old / "stale.txt").exists() and not (old / "onnx").exists()
