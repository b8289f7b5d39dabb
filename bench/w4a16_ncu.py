#!/usr/bin/env python3
"""Why a W4A16 decode kernel runs below the memory bandwidth: Nsight Compute counters per kernel variant.

For each weight shape, activation rows M and launch configuration (``kind:a,b,tpc``, the
``config`` of :func:`edgevlm.runtime.kernels.w4a16_mma.w4a16_mma`; ``table`` = the launch table's
choice for the lean build), the script runs the kernel under ``ncu`` (a child process of this file
in ``--probe`` mode; only the launches between ``cudaProfilerStart`` / ``Stop`` are profiled, each
over another weight copy so that L2 holds none of it) and reports the median of ``--launches``
launches: duration, DRAM read throughput, issue-slot use, warp latency per issued instruction and
its long-scoreboard (global memory) part, achieved occupancy, registers, waves. The 2026-12-02
profile (``bench/results/w4a16_kernel_h200_20261202.md``, session 10) found the lean kernel waiting
on its weight loads half the time at 37 % of DRAM bandwidth; this is the instrument to see whether
a variant changes that, before timing it.

``--clock-control none`` (the default here) keeps the GPU's own clocks, so durations compare with the
CUDA-graph timings of ``bench/w4a16_kernel.py``; ``base`` is ncu's default (base SM clock).

Prints a table, then one JSON line. Needs a CUDA GPU, the extension's toolchain and ``ncu`` (exits 2
with one line where one is missing). Usage::

    python3 bench/w4a16_ncu.py [--shapes 7b.qkv,7b.o] [--ms 1,8] \\
        [--configs table,reg:4,2,1,bulk:8,8,1] [--launches 3]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (for bench_support), also when imported
from bench_support import SHAPES, print_result, use_package  # noqa: E402

GROUP_SIZE = 128
METRICS = {  # column -> Nsight Compute metric
    "us": "gpu__time_duration.sum",
    "dram_pct": "dram__bytes_read.sum.pct_of_peak_sustained_elapsed",
    "dram_gbps": "dram__bytes_read.sum.per_second",
    "issue_pct": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "long_sb": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "wait": "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "lg_throttle": "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "waves": "launch__waves_per_multiprocessor",
}
STALL_METRICS = {  # column -> metric, read where the report has it (reports before session 11 do not)
    "short_sb": "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "mio_throttle": "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
    "math_pipe": "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "not_selected": "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio",
    "no_instruction": "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio",
    "dispatch": "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio",
    "selected": "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
    "inst_executed": "smsp__inst_executed.sum",
}
"""Further stall reasons (warps per issued instruction, as ``long_sb``) and the instructions executed: what a
variant without weight loads in its loop (the cp.async ring) waits on instead."""
UNIT_SCALE = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3,
              "byte/s": 1e-9, "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}


def parse_config(text: str) -> tuple[str, int, int, int] | str:
    """``"table"`` or ``"kind:a,b,tpc"`` -> ``"table"`` or ``(kind, a, b, tpc)``; raises ``ValueError``."""
    if text == "table":
        return text
    kind, _, rest = text.partition(":")
    parts = rest.split(",")
    if kind not in ("reg", "lean", "bulk", "async") or len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"a config is 'table' or kind:a,b,tpc with kind reg / lean / bulk / async, got {text!r}")
    a, b, tpc = (int(p) for p in parts)
    return kind, a, b, tpc


def split_configs(text: str) -> list:
    """``"table,reg:4,2,1,bulk:8,8,1"`` -> ``["table", ("reg", 4, 2, 1), ("bulk", 8, 8, 1)]`` (a kind starts an entry)."""
    out, cur = [], []
    for tok in text.split(","):
        if tok == "table" or ":" in tok:
            if cur:
                out.append(parse_config(",".join(cur)))
            cur = [tok]
        else:
            cur.append(tok)
    if cur:
        out.append(parse_config(",".join(cur)))
    return out


def read_raw_csv(path: Path) -> list[dict[str, float | str]]:
    """The rows of ``ncu --page raw --csv`` (a header row of metric names, a row of units, one row per
    profiled kernel), each as ``{column: value}`` for :data:`METRICS`' columns plus ``kernel``; times in
    µs, throughputs in GB/s, the rest as reported. Raises ``ValueError`` when a metric column is missing."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None or len(rows) < start + 2:
        raise ValueError(f"{path}: not an ncu raw CSV (no 'Kernel Name' header)")
    header, units = rows[start], rows[start + 1]
    missing = [m for m in METRICS.values() if m not in header]
    if missing:
        raise ValueError(f"{path}: metrics missing from the report: {', '.join(missing)}")
    out = []
    for r in rows[start + 2:]:
        row: dict[str, float | str] = {"kernel": r[header.index("Kernel Name")]}
        for col, metric in (*METRICS.items(), *((c, m) for c, m in STALL_METRICS.items() if m in header)):
            i = header.index(metric)
            value = float(r[i].replace(",", "")) if r[i] else math.nan
            row[col] = value * UNIT_SCALE.get(units[i].strip(), 1.0) if col in ("us", "dram_gbps") else value
        out.append(row)
    return out


def probe(args) -> int:
    """Inside ncu: the launches, profiled between cudaProfilerStart / Stop; their labels go to ``--sequence``."""
    use_package()
    import torch

    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16_mma as mk

    dev = torch.device("cuda")
    mk.load_extension(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    plan = []  # (label, call) in launch order
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        qw = int4.quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, GROUP_SIZE)
        packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, GROUP_SIZE)
        copies = [(packed.clone(), meta.clone()) for _ in range(max(2, math.ceil(2 * l2 / qw.nbytes())))]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            for cfg in split_configs(args.configs):
                c = mk.mma_config(m, n, k, GROUP_SIZE, bulk=True, lean=mk.lean_build()) if cfg == "table" else cfg
                label = {"shape": name, "m": m, "config": list(c), "asked": "table" if cfg == "table" else "given"}
                for i in range(args.launches):
                    p, mt = copies[i % len(copies)]
                    plan.append((label, lambda x=x, p=p, mt=mt, c=c: mk.w4a16_mma(x, p, mt, GROUP_SIZE, config=c,
                                                                                pdl=False)))
    for _, call in plan:  # warm: builds, lazy set-up, first-launch costs outside the profile
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, call in plan:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    Path(args.sequence).write_text(json.dumps([label for label, _ in plan]))
    return 0


def summarize(kernels: list[dict], labels: list[dict]) -> list[dict]:
    """Median per (shape, M, config) of the profiled launches, matched to ``labels`` in launch order.
    Raises ``ValueError`` when the counts differ (a launch not profiled, or an extra kernel)."""
    if len(kernels) != len(labels):
        raise ValueError(f"{len(kernels)} kernels profiled for {len(labels)} launches")
    groups: dict[str, list[dict]] = {}
    for label, row in zip(labels, kernels, strict=True):
        groups.setdefault(json.dumps(label, sort_keys=True), []).append(row)
    out = []
    for key, rows in groups.items():
        label = json.loads(key)
        label["kernel"] = str(rows[0]["kernel"]).split("(")[0].replace("void ", "")
        for col in (*METRICS, *STALL_METRICS):
            if col in rows[0]:
                label[col] = round(statistics.median(float(r[col]) for r in rows), 3)
        out.append(label)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="7b.qkv,7b.o,7b.gate_up,7b.down", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="1", help="activation rows")
    ap.add_argument("--configs", default="table,reg:4,2,1,bulk:4,8,1,bulk:8,8,1",
                    help="'table' and/or kind:a,b,tpc entries (reg / lean / bulk / async)")
    ap.add_argument("--launches", type=int, default=3, help="profiled launches per (shape, M, config)")
    ap.add_argument("--clock-control", default="none", choices=("none", "base"))
    ap.add_argument("--ncu", default=os.environ.get("NCU", ""), help="the ncu binary (default: on PATH or CUDA_HOME)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sequence", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        split_configs(args.configs)
        if any(s not in SHAPES for s in args.shapes.split(",")) or args.launches < 1:
            raise ValueError(f"shapes must be of {', '.join(SHAPES)} and --launches >= 1")
    except ValueError as exc:
        print(f"w4a16_ncu: {exc}", file=sys.stderr)
        return 2
    if args.probe:
        return probe(args)
    ncu = args.ncu or shutil.which("ncu") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ncu"))
    if not Path(ncu).exists() and not shutil.which(ncu):
        print("w4a16_ncu: Nsight Compute (ncu) not found: set --ncu or NCU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        seq, rep = Path(tmp, "sequence.json"), Path(tmp, "report")
        child = [sys.executable, str(Path(__file__).resolve()), "--probe", "--shapes", args.shapes, "--ms", args.ms,
                 "--configs", args.configs, "--launches", str(args.launches), "--sequence", str(seq)]
        cmd = [ncu, "--target-processes", "all", "--profile-from-start", "off", "--clock-control", args.clock_control,
               "-k", "regex:w4a16", "--metrics", ",".join((*METRICS.values(), *STALL_METRICS.values())), "-o", str(rep), *child]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not seq.exists():
            print(f"w4a16_ncu: the profiled run failed (rc {run.returncode}): {(run.stdout + run.stderr)[-800:]}",
                  file=sys.stderr)
            return 2
        raw = Path(tmp, "raw.csv")
        with open(raw, "w") as f:
            subprocess.run([ncu, "--import", f"{rep}.ncu-rep", "--page", "raw", "--csv"], stdout=f, check=True)
        try:
            rows = summarize(read_raw_csv(raw), json.loads(seq.read_text()))
        except ValueError as exc:
            print(f"w4a16_ncu: {exc}", file=sys.stderr)
            return 2
    cols = ("shape", "m", "config", "us", "dram_pct", "dram_gbps", "issue_pct", "cycles_per_issue", "long_sb", "wait",
            "barrier", "lg_throttle", "occupancy_pct", "registers", "waves", *STALL_METRICS)
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c)) for c in cols))
    print_result({"bench": "w4a16_ncu", "clock_control": args.clock_control, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
