"""``edgevlm quantize`` and ``edgevlm calibrate`` stopped by a signal while they run: SIGTERM (``kill``,
``systemctl stop``, a CI job's timeout) is handled as SIGINT (Ctrl-C): what the run created is removed
(the bundle's ``.partial`` folder, calibrate's new ``--out`` folder), exit status 130 and one line,
``edgevlm: interrupted``, on stderr. Was: SIGTERM killed the process at once and left an empty
``BUNDLE.partial`` or ``--out`` folder behind.

Each case is the real CLI in a subprocess, a slow step injected (it prints ``SLOW``, then sleeps), and
a real signal. Run: ``.venv/bin/python -m pytest -q tests/quantize/test_interrupt.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from process_support import reaped, stop  # noqa: E402

from edgevlm.cli_args import EXIT_INTERRUPTED  # noqa: E402

# The step after the quantized weights are written into BUNDLE.partial (quantize), the training after
# --out is created (calibrate), made slow: each says when it starts, then sleeps. SIGINT is given its
# usual handler first: a suite started as a shell's background job (`make test &`) inherits SIGINT
# ignored, and Python then leaves it ignored (a background job is not meant to get the terminal's Ctrl-C).
RUN_SLOW = """\
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import edgevlm.quantize.build as build, edgevlm.quantize.calibrate as calibrate
def slow(*args, **kwargs):
    print("SLOW", flush=True)
    time.sleep(120)
build._copy_side_files = slow
calibrate.calibrate = slow
from edgevlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "model", seed=3)


def _interrupt(argv: list[str], sig: signal.Signals) -> tuple[int, str]:
    """Run ``edgevlm *argv`` with the slow step, send ``sig`` once it is in that step; exit status and stderr."""
    proc = subprocess.Popen([sys.executable, "-c", RUN_SLOW, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    with reaped(proc):
        lines = [proc.stdout.readline()]
        while lines[-1] and lines[-1].strip() != "SLOW":
            lines.append(proc.stdout.readline())
        assert lines[-1].strip() == "SLOW", (lines, proc.stderr.read())
        sent = time.monotonic()
        _, err = stop(proc, sig)
        assert time.monotonic() - sent < 30  # stopped, not slept through
    return proc.returncode, err


def _assert_interrupted(code: int, err: str) -> None:
    assert code == EXIT_INTERRUPTED, err
    lines = err.splitlines()  # quantize's progress lines come before it
    assert lines[-1] == "edgevlm: interrupted" and lines.count("edgevlm: interrupted") == 1, err
    assert "Traceback" not in err and "error" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_quantize_interrupted_leaves_no_partial_bundle(tiny_src, tmp_path, sig):
    out = tmp_path / "bundle"
    code, err = _interrupt(["quantize", str(tiny_src), "--out", str(out), "--method", "rtn", "--no-onnx"], sig)
    _assert_interrupted(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither bundle nor bundle.partial


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_calibrate_interrupted_removes_the_out_folder_it_created(tiny_src, tmp_path, sig):
    out = tmp_path / "heads" / "run1"
    code, err = _interrupt(["calibrate", str(tiny_src), "--out", str(out), "--no-frontier"], sig)
    _assert_interrupted(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nor its parent, created with it


def test_calibrate_interrupted_keeps_an_out_folder_that_was_there(tiny_src, tmp_path):
    out = tmp_path / "heads"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = _interrupt(["calibrate", str(tiny_src), "--out", str(out), "--no-frontier"], signal.SIGTERM)
    _assert_interrupted(code, err)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
