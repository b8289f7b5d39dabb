"""jetson/config.example.yaml validates against the daemon's config schema."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from edgevlm.config import load_daemon_config, parse_daemon_config

EXAMPLE = Path(__file__).resolve().parents[2] / "jetson" / "config.example.yaml"


def test_example_config_loads():
    cfg = load_daemon_config(EXAMPLE)
    assert cfg.mqtt.device_id == "robot-1" and cfg.mqtt.port == 1883
    assert cfg.model.device == "cuda" and cfg.model.dtype == "float16" and cfg.model.backend == "torch"
    assert [(s.name, s.uri, s.kind) for s in cfg.sources] == [("front", "/dev/video0", "v4l2")]


def _uncomment(start_marker: str, n_lines: int) -> str:
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(start_marker))
    return "\n".join(re.sub(r"^(\s*)# ?", r"\1", ln) for ln in lines[start : start + n_lines])


def test_commented_csi_source_is_a_valid_csi_source():
    # the commented-out CSI example must work when a user uncomments it
    src = yaml.safe_load(_uncomment("# - name: csi0", 6))[0]
    cfg = parse_daemon_config({"sources": [src]})
    from edgevlm.daemon.capture import csi_pipeline

    assert cfg.sources[0].kind == "csi" and cfg.sources[0].csi.sensor_id == 0
    assert csi_pipeline(cfg.sources[0]).startswith("nvarguscamerasrc sensor-id=0 ! video/x-raw(memory:NVMM),width=1280")


def test_commented_audio_section_is_valid():
    block = _uncomment("# audio:", 7)
    cfg = parse_daemon_config(yaml.safe_load(block))
    assert [a.name for a in cfg.audio] == ["mic"] and cfg.audio[0].sample_rate_hz == 16000
