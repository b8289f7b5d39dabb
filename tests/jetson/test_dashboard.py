"""jetson/grafana-dashboard.json only queries metrics the daemon exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from edgevlm.daemon.metrics import Metrics
from edgevlm.daemon.tegrastats import ThrottleDetector, parse_line
from edgevlm.types import Stats

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "jetson" / "grafana-dashboard.json"
ORIN_LINE = (ROOT / "tests" / "fixtures" / "tegrastats" / "orin_r36.txt").read_text().splitlines()[2]


def exported_names() -> set[str]:
    m = Metrics(device_id="d")
    m.observe_answer(
        Stats(ttft_ms=30, e2e_ms=90, vision_ms=10, decode_ms=40, new_tokens=5, exit_layer=6), "OK"
    )
    m.set_operating_point("full")
    m.observe_source("front", fps=30, state="streaming", frame_age_s=0.01)
    m.source_reconnect("front")
    sample = parse_line(ORIN_LINE)
    m.observe_tegrastats(sample, ThrottleDetector().update(sample))
    text = m.exposition().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_is_valid_and_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    used = {n for e in exprs for n in re.findall(r"\bedgevlm_[a-z0-9_]+", e)}
    used |= {
        n for v in dash["templating"]["list"] for n in re.findall(r"\bedgevlm_[a-z0-9_]+", v.get("query", ""))
    }
    missing = used - exported_names()
    assert not missing, f"dashboard queries metrics the daemon does not export: {sorted(missing)}"
    # every panel has a unique id and a position
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all("gridPos" in p for p in dash["panels"])
    assert {"edgevlm_ttft_seconds_bucket", "edgevlm_jetson_temperature_celsius"} <= used
