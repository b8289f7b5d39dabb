"""``bench/daemon_throughput.py`` run as its docstring says: the documented CPU batching command batches.

Found by a new user: the docstring said ``--rows 8`` turns on CPU batching, and ``--device cpu --rows 8``
measured mean batch 1.00 (``--batching auto`` leaves ``model.continuous_batching`` off on CPU)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "daemon_throughput.py"


def _documented_cpu_batching_flags() -> list[str]:
    """The flags after "CPU batching" in the module docstring (read as text: the bench is a script)."""
    source = BENCH.read_text()
    doc = source.split('"""', 2)[1]
    m = re.search(r"CPU batching: ``([^`]+)``", " ".join(doc.split()))
    assert m, "the docstring names no CPU batching command"
    return shlex.split(m.group(1))


def test_documented_cpu_batching_command_batches(tmp_path: Path) -> None:
    flags = _documented_cpu_batching_flags()
    assert "--device" in flags and flags[flags.index("--device") + 1] == "cpu"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *flags, "--clients", "4", "--duration-s", "2", "--warmup-s", "1",
         "--max-new-tokens", "4", "--threads", "1"],
        capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = result["results"]
    assert row["errors"] == {} and row["answers"] > 0
    assert row["mean_batch_size"] > 1.0, row  # 4 closed-loop clients over >= 2 rows share decode steps
