"""The start-up checks of ``edgevlm serve``, which ``edgevlm serve --check-config`` runs too.

:func:`preflight` is the one function both use, so a config that ``--check-config`` calls OK is
one the daemon starts with. It checks what can be checked without loading the weights into memory:

- **model** (:func:`check_model`): ``model.path`` looks loadable
  (:func:`edgevlm.model_folder.check_config_model_path`: ``config.json``, safetensors headers,
  every loaded file inside the folder and, for a bundle, listed in the manifest, the backend's
  artifacts); an engine bundle's manifest (no ``..`` or absolute paths) and, with
  ``verify_hashes``, the SHA-256 of every file (a corrupted ``onnx/vision.onnx`` is named);
  ``config.json`` parses as a supported model; the image processor's settings
  (``processor_config.json`` / ``preprocessor_config.json``) are what the family's processor accepts
  at load (``ModelFamily.read_image_config``: a JSON object, ``image_mean`` of 3 values, Gemma 3's
  ``size`` and ``do_pan_and_scan``, ...); the tokenizer loads and the chat template compiles
  and renders; ``exits.json`` (when present) is JSON, the ``monitors`` name its labels and classifier
  blocks (:func:`_check_monitors`), and the frontier the controller will read
  (``controller.frontier``, else the folder's ``frontier.json``) validates and names no ``exit_layer``
  past the vision encoder's depth; ``model.device`` exists (CUDA available, ``cuda:N`` within the device count); the
  backend's library imports (onnxruntime, tensorrt). A failure raises ConfigError naming the key:
  the daemon cannot serve without its model.
- **sources** (:func:`check_sources`): a video file is a file OpenCV decodes a frame from (not a
  folder, not a text file); a V4L2 camera's device node exists, is a character device,
  readable and writable by this user, and a V4L2 video capture device (VIDIOC_QUERYCAP); a GStreamer pipeline read through gst-launch-1.0 has a frame
  size and its ``gst_launch`` executable is there; ``capture: opencv`` needs an OpenCV built with GStreamer; an audio source's WAV file has a supported format and samples. Network streams, GStreamer pipelines and CSI cameras are not probed (they may come up
  after the daemon). A failure is a one-line problem naming the key.

Nothing here imports torch unless ``model.device`` is CUDA, nor OpenCV unless a source is a video
file or a GStreamer pipeline (``tokenizers`` and ``jinja2`` are imported to check the tokenizer and
chat template).

What the modes do with the result: ``--check-config`` refuses the first problem of either kind
(one line, exit 2). ``serve`` refuses a model problem the same way, and logs each source problem
as a WARNING and starts: a camera may be plugged in later, and the source's supervisor keeps
reopening it (requests for that source get its error meanwhile). At start-up the bundle's hashes
are verified once, by the model load itself (``verify_hashes=False`` here), not twice.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

from edgevlm.config import DaemonConfig
from edgevlm.errors import ConfigError, ModelLoadError

__all__ = ["check_model", "check_sources", "check_tls", "preflight"]

logger = logging.getLogger(__name__)

BACKEND_LIBRARIES = {"onnx": ("onnxruntime", "onnx"), "tensorrt": ("tensorrt", "tensorrt")}
"""model.backend -> (module imported, pip extra of edgevlm)."""


def check_model(cfg: DaemonConfig, *, verify_hashes: bool = True) -> None:
    """The model checks of :func:`preflight` (see the module docstring).

    Raises:
        ConfigError: ``model.path: ...``, ``model.device: ...`` or ``model.backend: ...``.
    """
    from edgevlm.model_folder import check_config_model_path

    check_config_model_path(cfg)  # torch-free: folder, config.json, weights' headers, confinement
    m = cfg.model
    if m.backend in BACKEND_LIBRARIES:
        module, extra = BACKEND_LIBRARIES[m.backend]
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(f"model.backend: {m.backend!r} needs {module}, which is not installed "
                              f"(pip install 'edgevlm[{extra}]')") from None
    _check_device(m.device)
    if m.path is None:
        from edgevlm.runtime.demo import model_dir

        path = model_dir()
    else:
        path = Path(m.path)
    try:
        from edgevlm.model_folder import read_json
        from edgevlm.runtime.bundle import is_bundle, read_manifest, verify_bundle
        from edgevlm.runtime.models import family_for
        from edgevlm.runtime.tokenizer import VLMTokenizer

        if is_bundle(path) and verify_hashes:
            verify_bundle(path)  # manifest paths and every file's SHA-256
        elif is_bundle(path):
            read_manifest(path)
        raw = read_json(path / "config.json")
        family = family_for(raw)
        model_cfg = family.parse_config(raw)  # what the loader parses (torch-free)
        family.read_image_config(path, model_cfg)  # what the processor reads at load (torch-free)
        VLMTokenizer.from_dir(path, model_cfg.image_token_id, family=family.name)
        exits = read_json(path / "exits.json", required=False)  # the loader parses it (its schema needs torch)
    except ModelLoadError as exc:
        raise ConfigError(f"model.path: {exc.message}") from None
    _check_frontier(cfg, path, model_cfg)
    _check_monitors(cfg, exits if m.backend == "torch" and family.adaptive_vision else None)


def _check_monitors(cfg: DaemonConfig, exits: object) -> None:
    """The monitors against the exit classifier the model will have (``exits``: its ``exits.json``; None when
    it has none, or its backend loads none), as :meth:`edgevlm.daemon.monitors.Monitors.attach` checks them once
    the model has loaded (:func:`edgevlm.daemon.monitors.check_monitors`, the one rule for both)."""
    from edgevlm.daemon.monitors import check_monitors

    if not cfg.monitors:
        return
    ok = isinstance(exits, dict)
    check_monitors(list(cfg.monitors), list(exits.get("labels") or []) if ok else [],
                   list(exits.get("classifier_blocks") or []) if ok else [])


def _check_frontier(cfg: DaemonConfig, model_path: Path, model_cfg: object) -> None:
    """The frontier the controller reads at start-up (:func:`edgevlm.daemon.budget.build_controller`):
    ``controller.frontier``, else the model folder's ``frontier.json``, must validate,
    ``controller.frontier`` must have been measured on this model's weights, and the frontier the controller
    takes must name no ``exit_layer`` past the vision encoder's depth (``model_cfg``: the parsed config.json;
    :func:`edgevlm.daemon.budget.check_frontier_depth`)."""
    from edgevlm.daemon.budget import (
        check_frontier_depth,
        check_frontier_weights,
        measured_on,
        vision_blocks_of,
    )
    from edgevlm.profile import load_frontier

    cc = cfg.controller
    if not cc.enabled:
        return
    key, path = ("controller.frontier", Path(cc.frontier)) if cc.frontier is not None else (
        "model.path", model_path / "frontier.json")
    if cc.frontier is None and not path.is_file():
        return
    try:
        record = load_frontier(path)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc.message}") from None
    if cc.frontier is not None:
        check_frontier_weights(record, cc.frontier, model_path)
    elif not measured_on(record, model_path):  # the controller does not take it (a warning at start-up)
        return
    check_frontier_depth(record.frontier, f"{key}: {path}", vision_blocks_of(model_cfg))


def _check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"model.device: {device!r} but CUDA is not available on this machine "
                          f"(torch {torch.__version__}; use model.device: cpu)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device: {device!r} but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")


def _v4l2_problem(uri: int | str) -> str | None:
    dev = f"/dev/video{uri}" if isinstance(uri, int) else str(uri)
    try:
        mode = os.stat(dev).st_mode
    except FileNotFoundError:
        return f"{dev} does not exist (no camera there: is it plugged in? `ls /dev/video*` lists the cameras)"
    except OSError as exc:
        return f"{dev}: cannot stat ({exc.strerror})"
    if not stat.S_ISCHR(mode):
        return f"{dev} is not a video device (not a character device)"
    if not os.access(dev, os.R_OK | os.W_OK):
        return f"{dev} is not readable and writable by this user (add the user to group video)"
    from edgevlm.daemon.v4l2 import capture_device_problem

    return capture_device_problem(dev)


def _video_file_problem(path: str) -> str | None:
    p = Path(path)
    if p.is_dir():
        return f"{p} is a folder, not a video file"
    if not p.is_file():
        return f"video file not found: {p}"
    from edgevlm.daemon.capture_base import _cv2

    try:
        cv2 = _cv2()  # OpenCV and FFmpeg quieted: the problem is this function's one line
    except ImportError:
        return f"{p}: reading video files needs OpenCV (pip install 'edgevlm[runtime]')"
    cap = cv2.VideoCapture(str(p), cv2.CAP_FFMPEG)
    try:
        ok = cap.isOpened() and cap.read()[0]
    finally:
        cap.release()
    if not ok:
        return f"{p} is not a video OpenCV can decode (cannot open it or read its first frame)"
    return None


def _gst_launch_problem(src) -> str | None:
    """A GStreamer pipeline read through gst-launch-1.0 needs its frame size (the config's ``width`` and
    ``height``, or its caps'), as the source's capture backend does when it opens it."""
    from edgevlm.daemon.capture import capture_path, subprocess_pipeline

    if capture_path(src) != "gst-launch-subprocess":
        return None
    try:
        subprocess_pipeline(src)
    except ValueError as exc:
        return str(exc).removeprefix(f"source {src.name}: ")
    return None


def _capture_problem(src) -> tuple[str, str] | None:
    """How a GStreamer or CSI source will be read must be there: ``capture: opencv`` needs an OpenCV built with
    GStreamer (the PyPI wheels are not: every open failed with "cannot open", for ever), and the gst-launch-1.0
    path its ``gst_launch`` executable (else every open failed with "gst-launch-1.0 not found"). Returns
    ``(key, problem)``."""
    from edgevlm.daemon.capture import capture_path, opencv_has_gstreamer

    if src.kind not in ("gstreamer", "csi"):
        return None
    if src.capture == "opencv" and not opencv_has_gstreamer():
        return "capture", ("'opencv' reads the pipeline through OpenCV's GStreamer backend, and this OpenCV "
                           "was built without GStreamer; use capture: auto or subprocess (gst-launch-1.0)")
    if capture_path(src) != "gst-launch-subprocess":
        return None
    exe = shutil.which(src.gst_launch)
    if exe is None:
        if os.sep in src.gst_launch and os.path.isfile(src.gst_launch):
            return "gst_launch", f"{src.gst_launch} is not executable"
        return "gst_launch", (f"{src.gst_launch} not found (apt-get install gstreamer1.0-tools); OpenCV lacks "
                              "GStreamer, so the pipeline is read through it" if src.capture == "auto" else
                              f"{src.gst_launch} not found (apt-get install gstreamer1.0-tools)")  # fmt: skip
    return None


def check_sources(cfg: DaemonConfig) -> list[str]:
    """The source checks of :func:`preflight`: one ``sources[i].uri: ...`` line per problem."""
    problems = []
    for i, src in enumerate(cfg.sources):
        problem = None
        if src.kind == "v4l2":
            problem = _v4l2_problem(src.uri)
        elif src.kind == "file":
            problem = _video_file_problem(str(src.uri))
        elif src.kind == "gstreamer":
            problem = _gst_launch_problem(src)
        if problem is not None:
            problems.append(f"sources[{i}].uri: {problem} (source {src.name!r})")
            continue
        capture = _capture_problem(src)
        if capture is not None:
            problems.append(f"sources[{i}].{capture[0]}: {capture[1]} (source {src.name!r})")
    for i, mic in enumerate(cfg.audio):
        if mic.file is not None:
            problem = _wav_problem(mic.file)
            if problem is not None:
                problems.append(f"audio[{i}].file: {problem} (audio source {mic.name!r})")
    return problems


def _wav_problem(path: Path) -> str | None:
    """An audio source's WAV file is what its source plays: RIFF/WAVE with a supported format and samples
    (read from its chunk headers only)."""
    from edgevlm.daemon.wav import WavFormatError, read_wav_info

    try:
        _, frames = read_wav_info(path)
    except WavFormatError as exc:
        return exc.message
    except OSError as exc:
        return f"{path}: cannot read it ({exc.strerror or exc})"
    return f"{path}: no audio frames" if frames == 0 else None


def preflight(cfg: DaemonConfig, *, verify_hashes: bool = True) -> list[str]:
    """Run the start-up checks (see the module docstring).

    Returns:
        The source problems, one line each (``--check-config`` refuses the first; ``serve``
        logs them and starts).

    Raises:
        ConfigError: the model cannot be served, or ``mqtt.tls``'s files cannot be loaded (the message names
            the key).
    """
    check_model(cfg, verify_hashes=verify_hashes)
    check_tls(cfg)
    return check_sources(cfg)


def check_tls(cfg: DaemonConfig) -> None:
    """``mqtt.tls``'s files are what paho's ``tls_set`` loads at connect: readable, the CA file PEM certificates,
    the client certificate with its key (a text file as ``ca_certs`` failed the start-up after the model load,
    naming neither the key nor the file).

    Raises:
        ConfigError: ``mqtt.tls.<key>: <file>: <reason>``.
    """
    from edgevlm.client import tls_files_problem

    tls = cfg.mqtt.tls
    if tls is None:
        return
    problem = tls_files_problem(*(str(p) if p is not None else None for p in (tls.ca_certs, tls.certfile, tls.keyfile)))
    if problem is not None:
        raise ConfigError(f"mqtt.tls.{problem[0]}: {problem[1]}")
