"""``edgevlm serve --check-config`` runs the daemon's start-up checks (edgevlm.daemon.preflight):
what the daemon would refuse, --check-config refuses, one line, exit 2 (issue 11)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
torch = pytest.importorskip("torch")

from edgevlm.cli import main  # noqa: E402
from edgevlm.config import SourceConfig  # noqa: E402


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "model", seed=4)


@pytest.fixture(scope="module")
def bundle(tiny_src, tmp_path_factory) -> Path:
    pytest.importorskip("onnxruntime")
    from edgevlm.quantize.build import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("b") / "bundle"
    return build_bundle(tiny_src, out, BuildOptions(method="rtn", calib=None)).bundle_dir


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("v") / "cam.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (32, 24))
    for i in range(3):
        writer.write(np.full((24, 32, 3), 40 * i, np.uint8))
    writer.release()
    return path


def _config(tmp_path: Path, *, model: str = "", sources: str = "") -> Path:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("mqtt:\n  host: 127.0.0.1\n  port: 1\nmetrics:\n  listen: null\n"
                   + (f"model:\n{model}" if model else "") + (f"sources:\n{sources}" if sources else ""))
    return cfg


def _check(cfg: Path, capsys) -> tuple[int, str]:
    code = main(["serve", "--check-config", str(cfg)])
    captured = capsys.readouterr()
    if code != 0:
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgevlm: error: "), captured.err
        assert captured.out == ""
        return code, lines[0].removeprefix("edgevlm: error: ")
    return code, captured.out.strip()


def _copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    return dst


def test_good_bundle_and_video_are_ok(bundle, video, tmp_path, capsys):
    cfg = _config(tmp_path, model=f"  path: {bundle}\n  backend: onnx\n", sources=f"  - name: front\n    uri: {video}\n")
    code, out = _check(cfg, capsys)
    assert code == 0 and out.startswith(f"{cfg}: OK (broker 127.0.0.1:1, device_id ")
    assert out.endswith(f"sources: front, model: {bundle})")


@pytest.mark.parametrize("bad_path", ["../outside.json", "/etc/hostname"])
def test_manifest_path_leaving_the_bundle(bundle, tmp_path, capsys, bad_path):
    dst = _copy(bundle, tmp_path)
    raw = json.loads((dst / "manifest.json").read_text())
    raw["files"].append({"path": bad_path, "sha256": "0" * 64, "size_bytes": 1})
    (dst / "manifest.json").write_text(json.dumps(raw))
    code, err = _check(_config(tmp_path, model=f"  path: {dst}\n"), capsys)
    assert code == 2
    assert err == f"model.path: {dst}: file listed in manifest.json {bad_path!r} leaves the bundle (absolute path or '..')"


def test_corrupted_onnx_graph(bundle, tmp_path, capsys):
    dst = _copy(bundle, tmp_path)
    data = bytearray((dst / "onnx" / "vision.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (dst / "onnx" / "vision.onnx").write_bytes(bytes(data))
    code, err = _check(_config(tmp_path, model=f"  path: {dst}\n  backend: onnx\n"), capsys)
    assert code == 2
    assert err.startswith(f"model.path: bundle {dst}: file onnx/vision.onnx does not match its SHA-256 in manifest.json")


def test_text_file_as_a_video(tmp_path, capsys):
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 20)
    code, err = _check(_config(tmp_path, sources=f"  - name: front\n    uri: {text}\n"), capsys)
    assert code == 2
    assert err == (f"sources[0].uri: {text} is not a video OpenCV can decode (cannot open it or read its first "
                   "frame) (source 'front')")


@pytest.mark.parametrize("kind", ["text", "truncated"])
def test_undecodable_video_is_one_line_on_stderr(tmp_path, kind):
    """As a process: OpenCV's ``[ WARN ...] cap.cpp`` and FFmpeg's ``moov atom not found`` lines do not reach
    stderr; the CLI's one line does (exit 2)."""
    video = tmp_path / "cam.mp4"
    if kind == "text":
        video.write_text("this is not a video\n" * 20)
    else:  # a recording cut short: the container's index (moov) missing
        video.write_bytes((Path(__file__).resolve().parents[1] / "runtime/demo/media/scenes.mp4").read_bytes()[:100_000])
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"sources: [{{name: front, uri: {video}}}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCV_")}
    res = subprocess.run([sys.executable, "-m", "edgevlm.cli", "serve", "--check-config", str(cfg)],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [f"edgevlm: error: sources[0].uri: {video} is not a video OpenCV can decode "
                                       "(cannot open it or read its first frame) (source 'front')"], res.stderr


def test_folder_as_a_video(tmp_path, capsys):
    code, err = _check(_config(tmp_path, sources="  - name: front\n    uri: /tmp\n"), capsys)
    assert code == 2 and err == "sources[0].uri: /tmp is a folder, not a video file"


@pytest.mark.parametrize("uri", ["0", "/dev/video97"])
def test_missing_camera_device(tmp_path, capsys, uri):
    dev = "/dev/video0" if uri == "0" else uri
    if os.path.exists(dev):
        pytest.skip(f"{dev} exists on this machine")
    code, err = _check(_config(tmp_path, sources=f"  - name: usb\n    uri: {uri}\n"), capsys)
    assert code == 2
    assert err.startswith(f"sources[0].uri: {dev} does not exist (no camera there: is it plugged in?")
    assert err.endswith("(source 'usb')")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda(tmp_path, capsys, device):
    code, err = _check(_config(tmp_path, model=f"  device: '{device}'\n"), capsys)
    assert code == 2
    assert err.startswith(f"model.device: {device!r} but CUDA is not available on this machine")


def test_chat_template_that_does_not_compile(tiny_src, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_src, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if %}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, err = _check(_config(tmp_path, model=f"  path: {model}\n"), capsys)
    assert code == 2 and err.startswith("model.path: chat template does not compile: ")


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("exits.json", "{bad", "exits.json: not valid JSON ("),
    ("frontier.json", '{"points": 5}', "frontier.json: created_utc: required key missing"),
])
def test_broken_exits_or_frontier_file(tiny_src, tmp_path, capsys, name, text, needle):
    """``serve`` refuses these at start-up (the loader reads exits.json, the controller frontier.json), so
    ``--check-config`` must too: it used to call the folder OK."""
    model = tmp_path / "model"
    shutil.copytree(tiny_src, model)
    (model / name).write_text(text)
    code, err = _check(_config(tmp_path, model=f"  path: {model}\n"), capsys)
    assert code == 2 and err.startswith(f"model.path: {model}/") and needle in err, err
    if name == "frontier.json":  # read by the controller only: without one it is not a problem
        cfg = _config(tmp_path, model=f"  path: {model}\n")
        cfg.write_text(cfg.read_text() + "controller:\n  enabled: false\n")
        assert _check(cfg, capsys)[0] == 0


def test_serve_warns_about_a_missing_camera_and_goes_on(tiny_src, tmp_path):
    """At start-up a source problem is a WARNING, not a refusal (a camera may come later): the
    daemon goes on to load its model (here one that then fails to load, so that the run ends)."""
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_src, model)
    tensors = load_file(model / "model.safetensors")
    del tensors[sorted(tensors)[0]]
    save_file(tensors, model / "model.safetensors")
    cfg = _config(tmp_path, model=f"  path: {model}\n", sources="  - name: usb\n    uri: /dev/video97\n")
    res = subprocess.run([sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    warning = next(line for line in res.stderr.splitlines() if "WARNING" in line)
    assert "sources[0].uri: /dev/video97 does not exist" in warning and "starting anyway" in warning
    assert res.stderr.splitlines()[-1].startswith(f"edgevlm: error: model: cannot load {model} on cpu: ")


def test_weight_map_pointing_outside_the_bundle(bundle, tmp_path, capsys):
    """The issue's attack, through --check-config and serve: refused before anything starts."""
    dst = _copy(bundle, tmp_path)
    (tmp_path / "outside").mkdir()
    shutil.copy(dst / "model.safetensors", tmp_path / "outside" / "model.safetensors")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside/model.safetensors"}}))
    for mode in ("--check-config", "--config"):
        assert main(["serve", mode, str(_config(tmp_path, model=f"  path: {dst}\n"))]) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err == (f"edgevlm: error: model.path: bundle {dst}: model.safetensors.index.json is not listed in "
                       "manifest.json, so no SHA-256 covers it (a file added after the build is refused: remove it, "
                       "or rebuild the bundle)")


# ---- the image processor's settings: what the family's processor refuses at load, --check-config refuses


@pytest.fixture(scope="module")
def gemma3_src(tmp_path_factory) -> Path:
    from family_support import write_checkpoint

    return write_checkpoint("gemma3", tmp_path_factory.mktemp("g3") / "model")


def _edit_preprocessor(src: Path, tmp_path: Path, edit) -> Path:
    model = tmp_path / "model"
    shutil.copytree(src, model)
    pre = json.loads((model / "preprocessor_config.json").read_text())
    (model / "preprocessor_config.json").write_text(json.dumps(edit(pre)))
    return model


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda pre: {**pre, "image_mean": [0.5, 0.5]}, "image_mean"),
    (lambda pre: {**pre, "do_pan_and_scan": True}, "do_pan_and_scan true is not supported"),
    (lambda pre: {**pre, "size": {"height": 224, "width": 224}}, "is not the encoder's"),
    (lambda pre: [pre], "preprocessor_config.json: expected a JSON object, got an array"),
], ids=["two-value-mean", "pan-and-scan", "wrong-size", "not-an-object"])
def test_gemma3_image_processor_file_the_load_refuses(gemma3_src, tmp_path, capsys, edit, needle):
    """Found by a new user: these files passed ``--check-config`` as OK, then ``serve`` refused the model
    (one line, exit 2). Now --check-config runs the family's image-processor reader, the load's own code."""
    from edgevlm.errors import ModelLoadError
    from edgevlm.runtime import Engine

    model = _edit_preprocessor(gemma3_src, tmp_path, edit)
    with pytest.raises(ModelLoadError) as load:
        Engine.load(model)
    code, err = _check(_config(tmp_path, model=f"  path: {model}\n"), capsys)
    assert code == 2 and err == f"model.path: {load.value.message}" and needle in err, (err, load.value.message)


def test_gemma3_good_image_processor_file_is_ok(gemma3_src, tmp_path, capsys):
    code, out = _check(_config(tmp_path, model=f"  path: {gemma3_src}\n"), capsys)
    assert code == 0, out


def test_llava_preprocessor_config_not_an_object(tiny_src, tmp_path, capsys):
    model = _edit_preprocessor(tiny_src, tmp_path, lambda pre: "clip")
    code, err = _check(_config(tmp_path, model=f"  path: {model}\n"), capsys)
    assert code == 2 and err == f"model.path: {model}/preprocessor_config.json: expected a JSON object, got a string", err


def test_readme_local_daemon_config_is_valid(tmp_path, capsys):
    """The README's "run one on this machine" daemon.yaml (the bundled video as camera) passes --check-config."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    start = text.index("cat > daemon.yaml <<'YAML'\n") + len("cat > daemon.yaml <<'YAML'\n")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(text[start:text.index("\nYAML\n", start) + 1])
    video = tmp_path / "runtime" / "demo" / "media" / "scenes.mp4"  # a relative uri: from the config file's folder
    video.parent.mkdir(parents=True)
    video.symlink_to(root / "runtime" / "demo" / "media" / "scenes.mp4")
    code, out = _check(cfg, capsys)
    assert (code, out) == (0, f"{cfg}: OK (broker localhost:1883, device_id robot-1, sources: front, model: demo)")


@pytest.mark.parametrize(
    ("monitor", "model", "expected"),
    [
        ("{name: m, source: cam, labels: [purple]}", "", "monitors[0].labels: unknown label(s) ['purple'] (the model "
         "has ['red', 'green'"),
        ("{name: m, source: cam, labels: [red], exit_layer: 4}", "", "monitors[0].exit_layer: no classifier after "
         "block 4 (classifier blocks: [2, 3, 6])"),
        ("{name: m, source: cam, labels: [red]}", "tiny", "monitors: the model has no exit classifier (run `edgevlm "
         "calibrate` on it)"),
    ],
)
def test_monitor_the_model_cannot_run_is_refused_as_serve_refuses_it(tmp_path, capsys, video, tiny_src, monitor,
                                                                      model, expected) -> None:  # fmt: skip
    """A monitor's labels and classifier block are checked against the model's exits.json: --check-config said OK
    and ``serve`` then refused to start ("model: cannot load the demo model on cpu: cannot load the model:
    ConfigError: monitors[0].labels: ...")."""
    cfg = _config(tmp_path, model=f"  path: {tiny_src}\n" if model else "",
                  sources=f"  - {{name: cam, uri: {video}}}\n")
    cfg.write_text(cfg.read_text() + f"monitors:\n  - {monitor}\n")
    code, err = _check(cfg, capsys)
    assert code == 2 and err.startswith(expected), err


def test_monitor_the_model_can_run_passes(tmp_path, capsys, video) -> None:
    cfg = _config(tmp_path, sources=f"  - {{name: cam, uri: {video}}}\n")
    cfg.write_text(cfg.read_text() + "monitors:\n  - {name: m, source: cam, labels: [red, large bottom], exit_layer: 3}\n")
    code, out = _check(cfg, capsys)
    assert code == 0, out


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ('mqtt:\n  host: "broker .local"\n', "mqtt.host: not a host name or address: 'broker .local'"),
        ('mqtt:\n  host: "a\\0b"\n', "mqtt.host: not a host name or address: 'a\\x00b'"),
        ('mqtt:\n  host: "mqtt://broker.local"\n', "mqtt.host: not a host name or address: 'mqtt://broker.local'"),
        ('offload:\n  pool: gpu\n  host: "cloud broker"\n', "offload.host: not a host name or address: 'cloud broker'"),
    ],
)
def test_broker_host_that_is_not_a_host_name_is_refused(tmp_path, capsys, section, expected) -> None:
    """A broker host with a space, a control character or a URL's '/' was OK here, and the daemon then retried
    'cannot resolve the host name' for ever (http.host was already checked this way)."""
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("metrics:\n  listen: null\n" + section)
    code, err = _check(cfg, capsys)
    assert (code, err) == (2, expected)


def test_gstreamer_pipeline_without_a_frame_size_read_through_gst_launch_is_refused(tmp_path, capsys) -> None:
    """Read through a gst-launch-1.0 subprocess (OpenCV without GStreamer, or ``capture: subprocess``) a
    pipeline needs its frame size; without one --check-config said OK and the source never delivered a frame
    ("the frame size of ... is unknown; set width and height", once, at start)."""
    pipeline = "videotestsrc ! videoconvert ! appsink"
    cfg = _config(tmp_path, sources=f"  - {{name: gst, uri: '{pipeline}', capture: subprocess}}\n")
    code, err = _check(cfg, capsys)
    assert (code, err) == (2, f"sources[0].uri: the frame size of {pipeline!r} is unknown; set width and height "
                              "(needed to read raw frames from gst-launch-1.0) (source 'gst')")
    sized = _config(tmp_path, sources=f"  - {{name: gst, uri: '{pipeline}', capture: subprocess, width: 64, "
                                      "height: 48}\n")
    assert _check(sized, capsys)[0] == 0


def test_tls_file_that_is_not_a_certificate_is_refused_naming_the_key(tmp_path, capsys) -> None:
    """A CA file that is not a certificate passed --check-config; serve then failed after loading the model
    with "edgevlm: error: [X509: NO_CERTIFICATE_OR_CRL_FOUND] no certificate or crl found (_ssl.c:...)",
    naming neither the key nor the file."""
    bad = tmp_path / "ca.crt"
    bad.write_text("not a certificate\n")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"metrics:\n  listen: null\nmqtt:\n  port: 8883\n  tls:\n    ca_certs: {bad}\n")
    code, err = _check(cfg, capsys)
    assert code == 2 and err.startswith(f"mqtt.tls.ca_certs: {bad}: not a PEM CA certificate ("), err
    cfg.write_text(f"metrics:\n  listen: null\nmqtt:\n  port: 8883\n  tls:\n    certfile: {bad}\n")
    code, err = _check(cfg, capsys)
    assert code == 2 and err.startswith(f"mqtt.tls.certfile: {bad}: cannot load the certificate and its key ("), err
    proc = subprocess.run([sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(cfg)], capture_output=True,
                          text=True, timeout=120)  # serve refuses it the same way, before loading the model
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"edgevlm: error: mqtt.tls.certfile: {bad}: cannot load"), proc.stderr
    assert "loading model" not in proc.stderr, proc.stderr


def _wav(path: Path, chunks: bytes) -> Path:
    import struct

    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)
    return path


def test_audio_file_that_is_not_a_playable_wav_is_refused(tmp_path, capsys) -> None:
    """An audio source's WAV file is read as its source will read it (a text file, a WAV without samples, an
    unsupported format): --check-config said OK and the source then failed for ever ("audio source 'mic' has no
    audio yet (WavFormatError: ...: no fmt chunk)"), as a video file OpenCV cannot decode is already refused."""
    import struct

    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16)
    cases = [
        (tmp_path / "text.wav", "not a RIFF/WAVE file"),
        (_wav(tmp_path / "nofmt.wav", b"data" + struct.pack("<I", 4) + b"\0" * 4), "no fmt chunk"),
        (_wav(tmp_path / "nodata.wav", fmt), "no data chunk"),
        (_wav(tmp_path / "empty.wav", fmt + b"data" + struct.pack("<I", 0)), "no audio frames"),
        (_wav(tmp_path / "alaw.wav", b"fmt " + struct.pack("<IHHIIHH", 16, 6, 1, 8000, 8000, 1, 8)
              + b"data" + struct.pack("<I", 2) + b"\0\0"), "unsupported format code 0x0006"),
    ]
    (tmp_path / "text.wav").write_text("hello\n")
    for path, reason in cases:
        cfg = tmp_path / "daemon.yaml"
        cfg.write_text(f"metrics:\n  listen: null\naudio:\n  - {{name: mic, file: {path}}}\n")
        code, err = _check(cfg, capsys)
        assert (code, err) == (2, f"audio[0].file: {path}: {reason} (audio source 'mic')") or (
            code == 2 and err.startswith(f"audio[0].file: {path}: {reason}")), err
    good = _wav(tmp_path / "good.wav", fmt + b"data" + struct.pack("<I", 3200) + b"\0" * 3200)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"metrics:\n  listen: null\naudio:\n  - {{name: mic, file: {good}}}\n")
    assert _check(cfg, capsys)[0] == 0


def test_gstreamer_source_that_cannot_be_read_here_is_refused_naming_the_key(tmp_path, capsys) -> None:
    """``capture: opencv`` on an OpenCV built without GStreamer, and a ``gst_launch`` that is not there or not
    executable, passed --check-config; the source then failed every open for ever ("cannot open '...'",
    "FileNotFoundError: ... not found", "PermissionError: ...")."""
    from edgevlm.daemon.capture import opencv_has_gstreamer

    pipeline = "videotestsrc ! video/x-raw,width=64,height=48 ! appsink"

    def check(extra: str) -> tuple[int, str]:
        return _check(_config(tmp_path, sources=f"  - {{name: gst, uri: '{pipeline}', {extra}}}\n"), capsys)

    missing = tmp_path / "no-such-gst-launch"
    assert check(f"capture: subprocess, gst_launch: {missing}") == (
        2, f"sources[0].gst_launch: {missing} not found (apt-get install gstreamer1.0-tools) (source 'gst')")
    not_a_program = tmp_path / "gst.txt"
    not_a_program.write_text("not a program\n")
    assert check(f"capture: subprocess, gst_launch: {not_a_program}") == (
        2, f"sources[0].gst_launch: {not_a_program} is not executable (source 'gst')")
    csi = _config(tmp_path, sources=f"  - {{name: cam, csi: {{sensor_id: 0}}, capture: subprocess, "
                                    f"gst_launch: {missing}}}\n")
    assert _check(csi, capsys)[1].startswith(f"sources[0].gst_launch: {missing} not found")
    if shutil.which("gst-launch-1.0") is not None:
        assert check("capture: subprocess")[0] == 0
    if not opencv_has_gstreamer():
        assert check("capture: opencv") == (
            2, "sources[0].capture: 'opencv' reads the pipeline through OpenCV's GStreamer backend, and this "
               "OpenCV was built without GStreamer; use capture: auto or subprocess (gst-launch-1.0) (source 'gst')")


def test_device_file_as_a_video_is_named_as_such_not_as_missing(tmp_path, capsys) -> None:
    """``uri: /dev/null`` (not /dev/videoN, so read as a video file) was 'video file not found: /dev/null'."""
    cfg = _config(tmp_path, sources="  - {name: cam, uri: /dev/null}\n")
    assert _check(cfg, capsys) == (2, "sources[0].uri: /dev/null is not a regular file, not a video file (a V4L2 "
                                      "camera is /dev/videoN or its index)")


def test_character_device_that_is_not_a_v4l2_camera_is_refused(tmp_path, capsys) -> None:
    """A /dev/videoN that is a character device but not V4L2 (here /dev/null's device) passed --check-config;
    the source then failed every open for ever ("cannot open '/dev/videoN'"). VIDIOC_QUERYCAP says so."""
    from edgevlm.daemon.v4l2 import capture_device_problem

    assert capture_device_problem("/dev/null") == (
        "/dev/null is not a V4L2 device (VIDIOC_QUERYCAP: Inappropriate ioctl for device)")
    if os.geteuid() != 0 or not os.access("/dev", os.W_OK):
        pytest.skip("a /dev/videoN node of another device needs root")
    dev = Path(f"/dev/video{4000 + os.getpid() % 90}")  # not a number another test uses
    if dev.exists() or dev.is_symlink():
        pytest.skip(f"{dev} exists")
    os.mknod(dev, 0o660 | 0o020000, os.makedev(1, 3))  # a character device: major 1, minor 3 (/dev/null's)
    try:
        cfg = _config(tmp_path, sources=f"  - {{name: usb, uri: {dev}}}\n")
        assert _check(cfg, capsys) == (2, f"sources[0].uri: {dev} is not a V4L2 device (VIDIOC_QUERYCAP: "
                                          "Inappropriate ioctl for device) (source 'usb')")
    finally:
        dev.unlink()


def test_size_and_rate_a_source_would_ignore_are_refused_naming_the_key(tmp_path, capsys, video) -> None:
    """``width`` / ``height`` / ``fps`` on a video file or a network stream (and ``fps`` on a GStreamer
    pipeline) passed --check-config and were silently ignored: a file and a stream are decoded at their own
    size, a stream and a pipeline run at their own rate. Where they apply they still pass: ``fps`` paces a
    video file, the size scales a GStreamer pipeline on either capture path (OpenCV's as gst-launch-1.0's)."""
    pipeline = "videotestsrc ! video/x-raw,width=64,height=48 ! appsink"
    refused = [
        (f"{{name: cam, uri: {video}, width: 640}}", "sources[0].width: a video file is decoded at its own size; "
         "width applies to V4L2/CSI cameras (the size requested from the device) and to a GStreamer pipeline "
         "(the size its frames are scaled to); remove it"),
        (f"{{name: cam, uri: {video}, fps: 5, height: 480}}", "sources[0].height: a video file is decoded at its "
         "own size"),
        ("{name: dock, uri: 'rtsp://127.0.0.1:1/x', width: 640, height: 480}", "sources[0].width: a network "
         "stream is decoded at the size it is sent; width applies to V4L2/CSI cameras"),
        ("{name: dock, uri: 'rtsp://127.0.0.1:1/x', fps: 15}", "sources[0].fps: a network stream arrives at its "
         "sender's rate; fps applies to V4L2/CSI cameras (the rate requested from the device) and paces a video "
         "file; remove it"),
        (f"{{name: gst, uri: '{pipeline}', capture: subprocess, fps: 15}}", "sources[0].fps: a GStreamer pipeline "
         "runs at the framerate of its caps (set framerate=N/1 in them)"),
    ]
    for source, message in refused:
        code, err = _check(_config(tmp_path, sources=f"  - {source}\n"), capsys)
        assert code == 2 and err.startswith(message), (source, err)
    assert _check(_config(tmp_path, sources=f"  - {{name: cam, uri: {video}, fps: 5}}\n"), capsys)[0] == 0
    # a V4L2 camera is asked for width x height together: one alone was silently not applied
    for key, other in (("width", "height"), ("height", "width")):
        with pytest.raises(ValueError, match=rf"{key}: a V4L2 camera is asked for a frame size as width and "
                                             rf"height together, so {key} alone would be ignored; set {other} too"):
            SourceConfig(name="usb", uri="/dev/video0", **{key: 640})
    assert SourceConfig(name="usb", uri=0, width=640, height=480).width == 640
    for capture in ("auto", "opencv", "subprocess"):  # each path scales the pipeline's frames to the size
        assert SourceConfig(name="gst", uri=pipeline, capture=capture, height=24).height == 24
    if shutil.which("gst-launch-1.0") is not None:
        sized = f"  - {{name: gst, uri: '{pipeline}', capture: subprocess, width: 32, height: 24}}\n"
        assert _check(_config(tmp_path, sources=sized), capsys)[0] == 0
