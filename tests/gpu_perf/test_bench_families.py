"""bench/gpu_families.py on CPU with tiny configs of each new family: it builds transformers' model and ours
over the same tensors, measures every implementation at two input sizes, prints the table then one JSON
line, and its parity check finds our fp32 prefill logits equal to transformers' (the H200 run is bf16)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_families.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_family_bench_runs_on_cpu_with_tiny_configs(tmp_path, capsys):
    bench = _script()
    out_file = tmp_path / "families.json"
    models = ["tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-smolvlm"]
    code = bench.main(["--device", "cpu", "--models", ",".join(models), "--sizes", "64x64,96x48",
                       "--new-tokens", "3", "--parity", "--batches", "1,2", "--out", str(out_file)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split(" | ") == list(bench.COLUMNS)  # the table's header, then rows, then the JSON line
    summary = json.loads(lines[-1])
    assert json.loads(out_file.read_text()) == summary
    rows = summary["rows"]
    assert sorted((r["model"], r["impl"], r["size"], r["batch"]) for r in rows) == sorted(
        (m, impl, s, b) for m in models for impl in ("transformers", "edgevlm", "edgevlm-w4") for s in ("64x64", "96x48")
        for b in (1, 2))
    for r in rows:
        assert "error" not in r, r
        assert r["vision_tokens"] > 0 and r["prompt_tokens"] > r["vision_tokens"]
        if r["batch"] == 1:  # vision and TTFT are measured at batch 1
            assert r["vision_ms"] > 0 and r["ttft_ms"] > 0
        if r["impl"] != "transformers":  # transformers' TPOT is a difference of two timings: noisy on a busy CPU
            assert r["tpot_ms"] > 0 and r["decode_tok_s"] > 0 and r["weight_bytes"] > 0
    w4 = {(r["model"], r["size"], r["batch"]): r["weight_bytes"] for r in rows if r["impl"] == "edgevlm-w4"}
    bf = {(r["model"], r["size"], r["batch"]): r["weight_bytes"] for r in rows if r["impl"] == "edgevlm"}
    assert all(w4[k] < bf[k] for k in bf)  # the W4A16 rows really ran INT4 decoder weights
    for m in models:  # fp32 on CPU: our prefill logits are transformers' own
        p = summary["parity"][m]
        assert p["ours_vs_fp32"] < 1e-4 and p["argmax_equal"], (m, p)


def test_real_configs_parse_in_both_runtimes():
    """The published shapes build transformers' configs and parse in our family registry."""
    from edgevlm.runtime.models import family_for

    bench = _script()
    for name in bench.CONFIGS:
        raw = bench.model_config(name)
        cfg_cls, _ = bench._hf_class(raw)
        cfg = family_for(raw).parse_config(cfg_cls(**raw).to_dict())
        assert cfg.text.num_hidden_layers in (24, 28, 36) and cfg.text.hidden_size in (2048, 4096)
