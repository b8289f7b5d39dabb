"""Daemon config: YAML loading, defaults, and errors that name the key path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from edgevlm.config import DaemonConfig, load_daemon_config, parse_daemon_config, source_kind
from edgevlm.errors import ConfigError
from edgevlm.validation import StrictModel


def _load(tmp_path: Path, text: str) -> DaemonConfig:
    path = tmp_path / "edgevlm.yaml"
    path.write_text(text)
    return load_daemon_config(path)


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    msg = str(info.value)
    assert "\n" not in msg
    assert info.value.details["file"].endswith("edgevlm.yaml")
    return msg


def test_full_config(tmp_path: Path) -> None:
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "scene.mp4").write_bytes(b"x")
    cfg = _load(
        tmp_path,
        """
mqtt:
  host: broker.local
  port: 8883
  prefix: fleet/edgevlm
  device_id: robot-7
  keepalive_s: 20
  qos: 2
  username: robot
  password: secret
  reconnect_min_delay_s: 0.5
  reconnect_max_delay_s: 10
model:
  path: models/demo
  device: cuda:0
  dtype: bfloat16
sources:
  - {name: front, uri: 0}
  - {name: rear, uri: /dev/video2}
  - {name: dock, uri: "rtsp://10.0.0.5:8554/dock"}
  - {name: sim, uri: clips/scene.mp4, fps: 12.5}
  - {name: csi, uri: "nvarguscamerasrc ! nvvidconv ! videoconvert ! appsink"}
queue_max_size: 8
defaults: {max_new_tokens: 16, timeout_ms: 9223372036854775807}
log_level: debug
""",
    )
    assert cfg.mqtt.port == 8883 and cfg.mqtt.qos == 2 and cfg.mqtt.prefix == "fleet/edgevlm"
    assert cfg.mqtt.effective_client_id == "edgevlm-daemon-robot-7"
    assert cfg.model.path == (tmp_path / "models" / "demo").resolve()
    assert cfg.model.device == "cuda:0" and cfg.model.dtype == "bfloat16"
    assert [s.kind for s in cfg.sources] == ["v4l2", "v4l2", "stream", "file", "gstreamer"]
    assert cfg.sources[0].uri == 0
    assert cfg.sources[3].uri == str((tmp_path / "clips" / "scene.mp4").resolve())
    assert cfg.sources[3].fps == 12.5
    assert cfg.queue_max_size == 8
    assert cfg.defaults.timeout_ms == 9223372036854775807
    assert cfg.log_level == "DEBUG"


def test_defaults(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "mqtt: {device_id: r1}\n")
    assert (cfg.mqtt.host, cfg.mqtt.port, cfg.mqtt.prefix, cfg.mqtt.qos) == ("localhost", 1883, "edgevlm", 1)
    assert cfg.model.path is None and cfg.model.backend == "torch" and cfg.model.device == "cpu"
    assert cfg.sources == [] and cfg.queue_max_size == 4 and cfg.log_level == "INFO"
    # an empty file is a valid all-defaults config
    assert _load(tmp_path, "").mqtt.port == 1883


def test_client_id_unique_per_device(tmp_path: Path) -> None:
    a = _load(tmp_path, "mqtt: {device_id: r1}\n").mqtt.effective_client_id
    b = _load(tmp_path, "mqtt: {device_id: r2}\n").mqtt.effective_client_id
    assert a != b
    assert _load(tmp_path, "mqtt: {device_id: r1, client_id: custom}\n").mqtt.effective_client_id == "custom"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mqtt:\n  prot: 1884\n", "mqtt.prot: unknown key"),
        ("mqtts: {}\n", "mqtts: unknown key"),
        ("mqtt: {port: 70000}\n", "mqtt.port: Input should be less than or equal to 65535"),
        ("mqtt: {port: eighty}\n", "mqtt.port: Input should be a valid integer"),
        ("mqtt: {port: 1883.0}\n", "mqtt.port: Input should be a valid integer"),
        ("mqtt: {port: '1883'}\n", "mqtt.port: Input should be a valid integer"),
        ("mqtt: {qos: 3}\n", "mqtt.qos: "),
        ("mqtt: {device_id: a/b}\n", "mqtt.device_id: "),
        ("mqtt: {prefix: 'a/#'}\n", "mqtt.prefix: "),
        ("mqtt: {password: x}\n", "mqtt.password: needs a username"),
        ("mqtt: {reconnect_min_delay_s: 5, reconnect_max_delay_s: 1}\n", "mqtt.reconnect_max_delay_s: "),
        ("model: {device: gpu}\n", "model.device: "),
        ("model: {dtype: int3}\n", "model.dtype: "),
        ("model: {pth: x}\n", "model.pth: unknown key"),
        ("sources:\n  - {name: a, uri: 0}\n  - {name: b}\n", "sources[1].uri: required key missing"),
        ("sources:\n  - {name: a, uri: 0, fpss: 3}\n", "sources[0].fpss: unknown key"),
        ("sources:\n  - {name: 'a b', uri: 0}\n", "sources[0].name: "),
        ("sources:\n  - {name: a, uri: -1}\n", "sources[0].uri: "),
        ("sources:\n  - {name: a, uri: 0}\n  - {name: a, uri: 1}\n", "sources[1].name: duplicate source name 'a'"),
        ("sources:\n  - {name: a, uri: missing.mp4}\n", "sources[0].uri: video file not found: "),
        ("sources: {name: a}\n", "sources: Input should be a valid list"),
        ("queue_max_size: 0\n", "queue_max_size: "),
        ("defaults: {timeout_ms: -1}\n", "defaults.timeout_ms: "),
        ("log_level: loud\n", "log_level: "),
        ("- 1\n- 2\n", "$: expected a mapping at the top level"),
        ("mqtt: [1\n", "$: YAML syntax error at line 2 column 1"),
        # Strict everywhere: a string is not a number, a float not an integer, 1 not a boolean.
        ("queue_max_size: '4'\n", "queue_max_size: Input should be a valid integer"),
        ("queue_max_size: 4.0\n", "queue_max_size: Input should be a valid integer"),
        ("mqtt: {keepalive_s: '30'}\n", "mqtt.keepalive_s: Input should be a valid integer"),
        ("defaults: {max_new_tokens: '32'}\n", "defaults.max_new_tokens: Input should be a valid integer"),
        ("sources:\n  - {name: a, uri: 0, fps: '5'}\n", "sources[0].fps: Input should be a valid number"),
        ("controller: {enabled: 'yes'}\n", "controller.enabled: Input should be a valid boolean"),
        ("controller: {enabled: 1}\n", "controller.enabled: Input should be a valid boolean"),
        # A key given twice is an error naming it and both lines (PyYAML alone keeps the last).
        ("mqtt:\n  port: 1883\n  host: a\n  port: 1884\n",
         "$: duplicate key 'port' at line 4 column 3 (first at line 2)"),
        ("queue_max_size: 4\nqueue_max_size: 8\n", "$: duplicate key 'queue_max_size' at line 2 column 1 (first at line 1)"),
        ("sources:\n  - name: a\n    uri: 0\n    name: b\n", "$: duplicate key 'name' at line 4 column 5 (first at line 2)"),
        # YAML 1.1's yes/on are not booleans (YAML 1.2, and the README: only true/false)
        ("http:\n  enabled: yes\n", "http.enabled"),
        ("http:\n  enabled: on\n", "http.enabled"),
        ("offload:\n  pool: '#'\n", "offload.pool"),
        ("mqtt:\n  pool: gpu\n  pool_group: a/b\n", "mqtt.pool_group: pool_group must be"),
    ],
)
def test_errors_name_the_key_path(tmp_path: Path, text: str, expected: str) -> None:
    assert _error(tmp_path, text).startswith(expected)


def _schemas(model: type, seen: dict[str, type]) -> dict[str, type]:
    """Every StrictModel reachable from ``model`` through its fields (lists and optionals too)."""
    import typing

    seen[model.__name__] = model
    stack = [f.annotation for f in model.model_fields.values()]
    while stack:
        ann = stack.pop()
        if isinstance(ann, type) and issubclass(ann, StrictModel):
            if ann.__name__ not in seen:
                _schemas(ann, seen)
        else:
            stack.extend(typing.get_args(ann))
    return seen


def _scalar_kinds(annotation: object) -> set[type]:
    import typing

    args = typing.get_args(annotation) or (annotation,)
    if str in args:  # a name or a number (an audio device, a camera uri): strings are valid
        return set()
    return {a for a in args if a in (int, float, bool)}


def test_every_number_and_boolean_of_every_schema_refuses_strings() -> None:
    from edgevlm.profile import FrontierFile, Profile

    models = _schemas(DaemonConfig, {}) | _schemas(Profile, {}) | _schemas(FrontierFile, {})
    checked = []
    for name, model in sorted(models.items()):
        assert issubclass(model, StrictModel), name
        for field, info in model.model_fields.items():
            for kind in _scalar_kinds(info.annotation):
                bad = {"true" if kind is bool else "1"}
                bad.add(1 if kind is bool else "1")
                for value in bad:
                    with pytest.raises(ValidationError) as exc:
                        model.model_validate({field: value})
                    locs = [e["loc"][:1] for e in exc.value.errors() if e["type"] != "missing"]
                    assert (field,) in locs, (name, field, value)
                checked.append(f"{name}.{field}")
    assert {"DaemonConfig.queue_max_size", "MqttConfig.keepalive_s", "DefaultsConfig.max_new_tokens",
            "MqttConfig.port", "SourceConfig.fps", "RuntimeConfig.cuda_graphs"} <= set(checked)  # fmt: skip
    assert len(checked) > 60


def test_yaml_merge_keys_may_still_be_overridden() -> None:
    from edgevlm.validation import load_yaml

    text = "base: &b {host: a, port: 1884}\nmqtt:\n  <<: *b\n  port: 1885\n"
    assert load_yaml(text)["mqtt"] == {"host": "a", "port": 1885}


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_daemon_config(tmp_path / "nope.yaml")


def test_source_kind() -> None:
    assert source_kind(3) == "v4l2"
    assert source_kind("/dev/video10") == "v4l2"
    assert source_kind("rtsp://cam/stream") == "stream"
    assert source_kind("videotestsrc ! videoconvert ! appsink") == "gstreamer"
    assert source_kind("/data/clip.mp4") == "file"


def test_every_field_has_a_description() -> None:
    from edgevlm.config import DefaultsConfig, ModelConfig, MqttConfig, SourceConfig, TlsConfig

    for model in (DaemonConfig, MqttConfig, ModelConfig, SourceConfig, DefaultsConfig, TlsConfig):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
        assert model.model_config.get("extra") == "forbid"


def test_model_cpu_threads_and_backend_names(tmp_path):
    """cpu_threads is bounded; backend names are the runtime's own (torch, onnx, tensorrt)."""
    from edgevlm.config import DaemonConfig

    ok = DaemonConfig.model_validate({"model": {"cpu_threads": 2, "backend": "onnx", "path": "/models/bundle"}})
    assert ok.model.cpu_threads == 2 and ok.model.backend == "onnx"
    with pytest.raises(ValidationError, match="'onnx' runs engine bundles only, and model.path is null"):
        DaemonConfig.model_validate({"model": {"backend": "onnx"}})  # the demo model is not a bundle
    with pytest.raises(ValidationError):
        DaemonConfig.model_validate({"model": {"cpu_threads": 0}})
    with pytest.raises(ValidationError):
        DaemonConfig.model_validate({"model": {"backend": "onnxruntime"}})


# ---- continuous batching without KV-cache rows (found by trying `edgevlm serve` on the CPU) --------------


def test_continuous_batching_without_rows_is_refused_at_check_config(tmp_path, capsys):
    """``model.continuous_batching: true`` with no ``model.max_batch_size`` on the CPU used to pass
    ``--check-config`` and start a daemon that only logged a warning and served one request at a time
    (an explicit ``max_batch_size: 1`` was already refused): now one line, exit 2."""
    from edgevlm.cli import main
    from edgevlm.config import ConfigError, parse_daemon_config

    with pytest.raises(ConfigError, match=r"model.continuous_batching: needs model.max_batch_size >= 2 .*"
                                          r"without it a model on 'cpu' gets 1 row"):
        parse_daemon_config({"model": {"continuous_batching": True}})
    cfg = parse_daemon_config({"model": {"continuous_batching": True, "max_batch_size": 4}})
    assert cfg.model.max_batch_size == 4
    assert parse_daemon_config({"model": {"continuous_batching": False}}).model.continuous_batching is False
    path = tmp_path / "daemon.yaml"
    path.write_text("model:\n  continuous_batching: true\n")
    assert main(["serve", "--check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgevlm: error: model.continuous_batching: needs model.max_batch_size >= 2")
    assert err.count("\n") == 1


def test_continuous_batching_on_cuda_takes_the_profile_rows():
    from edgevlm.config import ConfigError, parse_daemon_config

    cfg = parse_daemon_config({"profile": "h100", "model": {"device": "cuda", "continuous_batching": True}})
    assert cfg.model.max_batch_size is None  # the profile's rows (>= 2) are used
    with pytest.raises(ConfigError, match=r"model.continuous_batching: needs model.max_batch_size >= 2 .*profile cpu "
                                          r"is not a CUDA profile"):
        parse_daemon_config({"profile": "cpu", "model": {"device": "cuda", "continuous_batching": True}})
    with pytest.raises(ConfigError, match=r"model.continuous_batching: .*a model on 'cpu' gets 1 row"):
        parse_daemon_config({"profile": "h100", "model": {"device": "cpu", "continuous_batching": True}})



def test_model_path_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """``model.path: ~/models/x`` is under the home folder, as a source's ``uri: ~/x.mp4`` is (it was taken relative
    to the config file's folder: ``<config dir>/~/models/x``)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = parse_daemon_config({"model": {"path": "~/models/x"}}, base_dir=tmp_path / "etc")
    assert cfg.model.path == tmp_path / "home" / "models" / "x"
    assert parse_daemon_config({"model": {"path": "m"}}, base_dir=tmp_path).model.path == tmp_path / "m"


@pytest.mark.parametrize(("profile", "device", "warned"), [
    ("h100", "cpu", "profile: 'h100' is a cuda profile and model.device is 'cpu': its GPU runtime settings are not "
                    "used, and its default budget and frontier were measured on another device"),
    ("cpu", "cuda", "profile: 'cpu' is a cpu profile and model.device is 'cuda': its runtime settings are CPU ones, "
                    "and its default budget and frontier were measured on another device"),
    ("h100", "cuda:1", None),
    ("cpu", "cpu", None),
])
def test_a_profile_for_another_device_is_warned(caplog, profile, device, warned) -> None:
    # was: accepted without a word (found by helper 36); still accepted: a laptop may try a robot's config
    import logging

    from edgevlm.profile import jetson_host

    if profile == "h100" and warned is None and jetson_host() != (None, None):
        pytest.skip("on a Jetson a cloud profile is warned (test_a_jetson_profile_on_a_host_that_is_not_...)")
    with caplog.at_level(logging.WARNING, logger="edgevlm.config"):
        cfg = parse_daemon_config({"profile": profile, "model": {"device": device}})
    assert cfg.profile == profile
    assert [r.getMessage() for r in caplog.records if r.name == "edgevlm.config"] == ([warned] if warned else [])



def _host(root: Path, *, model: bytes | None = None, release: str | None = None) -> Path:
    """A host tree for :func:`edgevlm.profile.jetson_host`: its device-tree model and L4T release file."""
    if model is not None:
        (root / "proc/device-tree").mkdir(parents=True)
        (root / "proc/device-tree/model").write_bytes(model)
    if release is not None:
        (root / "etc").mkdir(parents=True)
        (root / "etc/nv_tegra_release").write_text(release)
    return root


def test_a_jetson_profile_on_a_host_that_is_not_a_jetson_is_warned(tmp_path) -> None:
    """Found by a new user: a Jetson profile (its memory size, runtime settings, budget and frontier measured
    on an Orin) on a CUDA server was taken without a word; only a profile for another device than
    model.device was warned. The same rule now names the profile and what the host is; a cloud profile on a
    Jetson is warned alike. The shipped profile files, host trees as the doctor reads them (``root``)."""
    from edgevlm.profile import load_profile, profile_mismatch

    nx, h100 = load_profile("jetson-orin-nx-16gb"), load_profile("h100")
    server = _host(tmp_path / "server")
    pi = _host(tmp_path / "pi", model=b"Raspberry Pi 4 Model B Rev 1.4\0")
    release = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n"
    orin = _host(tmp_path / "orin", model=b"NVIDIA Jetson AGX Orin Developer Kit\0", release=release)
    l4t_only = _host(tmp_path / "container", release="# R35 (release), REVISION: 5.0, GCID: 1\n")
    not_a_jetson = ("profile: 'jetson-orin-nx-16gb' is a Jetson profile and this host is not a Jetson (no "
                    "/proc/device-tree/model naming one, no /etc/nv_tegra_release): its memory_mb, runtime "
                    "settings, default budget and frontier were measured on a Jetson")  # fmt: skip
    assert profile_mismatch(nx, "cuda", root=server) == not_a_jetson
    assert profile_mismatch(nx, "cuda:0", root=pi) == not_a_jetson
    assert profile_mismatch(nx, "cuda", root=orin) is None
    assert profile_mismatch(nx, "cuda", root=l4t_only) is None  # a container without the device tree
    assert profile_mismatch(nx, "cpu", root=server).startswith(  # the device rule first: one warning
        "profile: 'jetson-orin-nx-16gb' is a cuda profile and model.device is 'cpu': its GPU runtime")
    assert profile_mismatch(h100, "cuda", root=orin) == (
        "profile: 'h100' is a cloud GPU profile and this host is a Jetson (NVIDIA Jetson AGX Orin Developer "
        "Kit): its memory_mb, runtime settings, default budget and frontier were measured on another device")
    assert profile_mismatch(h100, "cuda", root=l4t_only).startswith(
        "profile: 'h100' is a cloud GPU profile and this host is a Jetson (# R35 (release), REVISION: 5.0")
    assert profile_mismatch(h100, "cuda", root=server) is None
    assert profile_mismatch(load_profile("cpu"), "cpu", root=orin) is None


def test_serve_check_config_warns_of_a_jetson_profile_off_a_jetson_once(tmp_path) -> None:
    """The real CLI on this host (not a Jetson): ``serve --check-config`` passes and logs the warning once."""
    import subprocess
    import sys

    from edgevlm.profile import jetson_host

    if jetson_host() != (None, None):
        pytest.skip("this host is a Jetson")
    cfg = tmp_path / "edgevlm.yaml"
    cfg.write_text("profile: jetson-agx-orin-64gb\nmodel: {device: cuda}\nmetrics: {listen: null}\n")
    run = subprocess.run([sys.executable, "-m", "edgevlm.cli", "serve", "--check-config", str(cfg)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode in (0, 2), run.stderr[-2000:]  # 2: no CUDA on this machine (preflight's own line)
    warned = [ln for ln in run.stderr.splitlines() if "is a Jetson profile" in ln]
    assert len(warned) == 1, run.stderr
    assert warned[0].endswith(
        "profile: 'jetson-agx-orin-64gb' is a Jetson profile and this host is not a Jetson (no "
        "/proc/device-tree/model naming one, no /etc/nv_tegra_release): its memory_mb, runtime settings, "
        "default budget and frontier were measured on a Jetson"
    )


def test_serve_ray_refuses_a_target_its_replicas_can_never_reach(tmp_path) -> None:
    """``ray.target_ongoing_requests`` above ``ray.max_ongoing_requests``: a replica never holds more than the
    latter, so the autoscaler never adds a replica; was accepted and Ray Serve started (the real CLI, before Ray)."""
    import subprocess
    import sys

    cfg = tmp_path / "ray.yaml"
    cfg.write_text("ray: {target_ongoing_requests: 10, max_ongoing_requests: 2}\n")
    run = subprocess.run([sys.executable, "-m", "edgevlm.cli", "serve-ray", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [
        "edgevlm: error: ray.target_ongoing_requests: 10 is above max_ongoing_requests 2 (a replica never "
        "reaches it, so autoscaling never adds one)"]
    assert parse_daemon_config({"ray": {"target_ongoing_requests": 2, "max_ongoing_requests": 2}}).ray.max_ongoing_requests == 2


def test_serve_ray_names_the_settings_it_ignores(tmp_path, caplog) -> None:
    """Found by a new user: ``serve-ray`` started without a word on settings only ``edgevlm serve`` reads
    (``mqtt.pool``: no pool membership). The decision, without starting Ray: the keys the file sets outside
    what serve-ray reads, in the file's order; defaults and empty sections are not named."""
    import logging

    from edgevlm.config import load_daemon_config
    from edgevlm.daemon.ray_serve import ignored_settings, warn_ignored_settings

    cfg = tmp_path / "shared.yaml"
    cfg.write_text("mqtt: {host: broker.local, device_id: gpu-1, pool: gpus}\nsources: []\nqueue_max_size: 16\n"
                   "model: {device: cpu, continuous_batching: false, max_batch_size: 4}\nhttp: {enabled: false, "
                   "port: 8000}\nray: {min_replicas: 1}\ndefaults: {timeout_ms: 5000}\noffload: {pool: cloud}\n")  # fmt: skip
    config = load_daemon_config(cfg)
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.ray_serve"):
        assert warn_ignored_settings(config) == ["mqtt.host", "mqtt.device_id", "mqtt.pool", "model.continuous_batching",
                                                 "queue_max_size", "http.enabled", "offload.pool"]  # fmt: skip
    assert [r.getMessage() for r in caplog.records] == [
        "serve-ray: ignoring mqtt.host, mqtt.device_id, mqtt.pool, model.continuous_batching, queue_max_size, "
        f"http.enabled, offload.pool set in {cfg}: they configure edgevlm serve (serve-ray serves the HTTP API from "
        "model, profile, http, defaults, limits and ray only)"]  # fmt: skip
    caplog.clear()
    only_ray = parse_daemon_config({"model": {"device": "cpu", "max_batch_size": 2}, "http": {"enabled": True},
                                    "ray": {"max_replicas": 2}, "limits": {}, "log_level": "info"})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="edgevlm.daemon.ray_serve"):
        assert warn_ignored_settings(only_ray) == [] and ignored_settings(parse_daemon_config({})) == []
    assert not caplog.records


def test_a_profile_warning_is_said_at_start_not_again_on_each_reload(tmp_path, caplog) -> None:
    """Found by helper 43: since SIGHUP reads the config file again (to load a changed model.path), the
    profile warning of load_daemon_config was logged again on every reload. It is said when the daemon
    starts; the reload's re-read (ReloadManager, warn=False) reads the same file without it."""
    from edgevlm.daemon.reload import ReloadManager

    path = tmp_path / "d.yaml"
    path.write_text("profile: jetson-orin-nx-16gb\nmodel: {device: cpu}\n")
    with caplog.at_level(logging.WARNING, logger="edgevlm.config"):
        cfg = load_daemon_config(path)
    said = [r.getMessage() for r in caplog.records if "jetson-orin-nx-16gb" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("profile: 'jetson-orin-nx-16gb' is a cuda profile"), said
    caplog.clear()
    manager = ReloadManager(cfg, None, current_path=None, loader=lambda p: None)
    with caplog.at_level(logging.INFO):
        assert manager._reread_model_path("SIGHUP") is None  # the demo model, as configured
    assert [r.getMessage() for r in caplog.records] == []
