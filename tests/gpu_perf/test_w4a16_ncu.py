"""bench/w4a16_ncu.py off the GPU: its config syntax, its reading of an Nsight Compute raw CSV (a trimmed
report of the 2026-12-02 H200 profile, tests/fixtures/ncu_raw_w4a16.csv), the launch matching, and its
one-line refusals (exit 2)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "ncu_raw_w4a16.csv"


@pytest.fixture(scope="module")
def ncu_bench():
    spec = importlib.util.spec_from_file_location("w4a16_ncu", ROOT / "bench" / "w4a16_ncu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configs_split_into_table_and_kind_entries(ncu_bench):
    assert ncu_bench.split_configs("table,reg:4,2,1,bulk:8,8,2") == ["table", ("reg", 4, 2, 1), ("bulk", 8, 8, 2)]
    assert ncu_bench.split_configs("lean:16,3,1") == [("lean", 16, 3, 1)]
    for bad in ("fast:4,2,1", "reg:4,2", "reg:4,x,1", "bulk"):
        with pytest.raises(ValueError, match="kind:a,b,tpc"):
            ncu_bench.split_configs(bad)


def test_raw_csv_rows_in_microseconds_and_gbps(ncu_bench):
    rows = ncu_bench.read_raw_csv(FIXTURE)
    assert len(rows) == 2
    qkv = rows[0]
    assert qkv["kernel"].startswith("void w4a16_lean_kernel<1, 1, 2, 4, 2, 0>")
    assert qkv["us"] == pytest.approx(15.136)  # reported in us
    assert qkv["dram_gbps"] == pytest.approx(1768.085)  # reported in Tbyte/s
    assert qkv["dram_pct"] == pytest.approx(36.816587) and qkv["issue_pct"] == pytest.approx(42.791849)
    assert qkv["long_sb"] == pytest.approx(5.653672) and qkv["registers"] == 64 and qkv["waves"] == pytest.approx(0.73)


def test_raw_csv_without_a_metric_is_refused(ncu_bench, tmp_path):
    lines = FIXTURE.read_text().splitlines()
    cut = tmp_path / "cut.csv"
    cut.write_text("\n".join(",".join(line.split(",")[:-1]) for line in lines) + "\n")  # drop the waves column
    with pytest.raises(ValueError, match="launch__waves_per_multiprocessor"):
        ncu_bench.read_raw_csv(cut)
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu raw CSV"):
        ncu_bench.read_raw_csv(other)


def test_launches_are_matched_in_order_and_summarised_by_median(ncu_bench):
    rows = ncu_bench.read_raw_csv(FIXTURE)
    a = {"shape": "7b.qkv", "m": 1, "config": ["lean", 4, 2, 1], "asked": "table"}
    out = ncu_bench.summarize(rows, [a, a])
    assert len(out) == 1 and out[0]["kernel"] == "w4a16_lean_kernel<1, 1, 2, 4, 2, 0>"
    assert out[0]["us"] == pytest.approx((15.136 + 8.544) / 2, abs=1e-3)
    b = dict(a, config=["lean", 8, 4, 1])
    two = ncu_bench.summarize(rows, [a, b])
    assert [r["registers"] for r in two] == [64, 96] and not any(math.isnan(r["us"]) for r in two)
    with pytest.raises(ValueError, match="2 kernels profiled for 3 launches"):
        ncu_bench.summarize(rows, [a, a, a])
    json.dumps(out)  # the JSON line the script prints


@pytest.mark.parametrize("argv, says", [
    (["--configs", "fast:1,2,3"], "kind:a,b,tpc"),
    (["--shapes", "7b.nope"], "shapes must be of"),
    (["--launches", "0"], "--launches >= 1"),
    (["--ncu", "/nonexistent/ncu"], "ncu) not found"),
])
def test_bad_arguments_and_a_missing_ncu_exit_2_with_one_line(ncu_bench, capsys, argv, says):
    assert ncu_bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
