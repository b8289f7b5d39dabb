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


def test_commented_csi_source_is_a_valid_gstreamer_source():
    # the commented-out CSI example must work when a user uncomments it
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("# - name: csi0"))
    block = "\n".join(re.sub(r"^(\s*)# ", r"\1", ln) for ln in lines[start : start + 2])
    src = yaml.safe_load(block)[0]
    cfg = parse_daemon_config({"sources": [{"name": src["name"], "uri": src["uri"]}]})
    assert cfg.sources[0].kind == "gstreamer"
    assert "nvarguscamerasrc sensor-id=0" in cfg.sources[0].uri and cfg.sources[0].uri.endswith(
        "max-buffers=1"
    )
