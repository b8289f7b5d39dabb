"""`edgevlm bench` on CPU with the tiny model: it runs, prints a table and a JSON line, saves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_runs_on_cpu_and_saves_results(tmp_path, capsys):
    from edgevlm.quantize.benchmark import VARIANTS, main

    pytest.importorskip("transformers")
    code = main(["--device", "cpu", "--models", "tiny", "--new-tokens", "2", "--batch-sizes", "1,2",
                 "--vision-batch", "2", "--results-dir", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert "impl" in out[1] and "tiny" in out[2]  # the table precedes the JSON line
    rows = {r["impl"]: r for r in summary["rows"]}
    assert set(rows) == {"transformers", *VARIANTS}
    for impl, r in rows.items():
        assert "error" not in r, (impl, r.get("error"))
        assert r["ttft_ms"] > 0 and r["vision_img_s"] > 0 and r["kv_bytes_per_token"] > 0
        if impl != "transformers":  # its TPOT is a difference of two generate() timings: noisy on a busy CPU
            assert r["tpot_ms"] > 0 and r["decode_tok_s"] > 0
    assert rows["edgevlm"]["batch_tok_s"]["2"] > 0
    assert rows["edgevlm"]["decode_tok_s_host_fed"] > 0 and rows["edgevlm"]["batch_tok_s_host_fed"]["2"] > 0
    assert rows["edgevlm-w4-kv4"]["kv_bytes_per_token"] * 3 < rows["edgevlm"]["kv_bytes_per_token"]
    # the INT4 head (quantize --lm-head int4): the step reads fewer bytes than with the 16-bit head
    assert rows["edgevlm-w4-head4"]["bytes_per_step_mb"] < 0.75 * rows["edgevlm-w4"]["bytes_per_step_mb"]
    assert summary["copy_gbps"] > 0 and summary["versions"]["torch"] == torch.__version__
    saved = list(tmp_path.glob("bench_cpu_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["rows"] == summary["rows"]


@pytest.mark.parametrize("out", ["results/run.json", None], ids=["out", "stdout-only"])
def test_bench_writes_only_where_asked(tmp_path, monkeypatch, capsys, out):
    """``--results-dir`` defaulted to ``bench/results`` under the current directory: a run from a checkout
    (``edgevlm bench --device cpu --models tiny``) left ``bench/results/bench_cpu_<time>.json`` in the source
    tree. Now, run from a folder laid out as a checkout, nothing appears there (nor in this repository's
    bench/results): the table and the JSON line go to stdout, and the JSON line to ``--out`` when given."""
    from edgevlm.quantize.benchmark import main

    repo_results = Path(__file__).resolve().parents[2] / "bench" / "results"
    before = {p.name for p in repo_results.glob("bench_cpu_*.json")}
    checkout = tmp_path / "checkout"
    (checkout / "bench" / "results").mkdir(parents=True)
    (checkout / "results").mkdir()
    monkeypatch.chdir(checkout)
    argv = ["--device", "cpu", "--models", "tiny", "--no-hf", "--variants", "edgevlm", "--new-tokens", "2",
            "--batch-sizes", "1", "--vision-batch", "2"]
    assert main(argv + (["--out", out] if out else [])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("device=cpu dtype=float32 ")
    assert lines[1].split()[:3] == ["model", "impl", "ttft_ms"] and lines[2].split()[:2] == ["tiny", "edgevlm"]
    summary = json.loads(lines[-1])
    assert [(r["model"], r["impl"]) for r in summary["rows"]] == [("tiny", "edgevlm")] and "saved_to" not in summary
    written = sorted(str(p.relative_to(checkout)) for p in checkout.rglob("*") if p.is_file())
    assert written == ([out] if out else [])
    if out:
        assert (checkout / out).read_text() == lines[-1] + "\n"
    assert not any((checkout / "bench" / "results").iterdir())
    assert {p.name for p in repo_results.glob("bench_cpu_*.json")} == before


@pytest.mark.parametrize("argv", [["--models", "nope"], ["--batch-sizes", "0"], ["--variants", "x"]])
def test_bench_bad_arguments_exit_2(argv, capsys):
    from edgevlm.quantize.benchmark import main

    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edgevlm: error: argument {argv[0]}: ") and err.count("\n") == 1
    assert err.endswith("(see 'edgevlm bench --help')\n")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--device", "cpu", "--new-tokens", "1"], "edgevlm: error: --new-tokens must be in [2, 4096], got 1\n"),
        (["--device", "cpu", "--new-tokens", "99999999999"],
         "edgevlm: error: --new-tokens must be in [2, 4096], got 99999999999\n"),
        (["--device", "cpu", "--prompt-tokens", "2"], "edgevlm: error: --prompt-tokens must be in [4, 32768], got 2\n"),
        (["--device", "cpu", "--vision-batch", "0"], "edgevlm: error: --vision-batch must be in [2, 1024], got 0\n"),
        (["--device", "cpu", "--batch-sizes", "1,100000"],
         "edgevlm: error: --batch-sizes must be in [1, 1024], got 1,100000\n"),
        (["--device", "cpu", "--results-dir", "/proc/nope"],
         "edgevlm: error: --results-dir: cannot create /proc/nope: No such file or directory\n"),
        (["--device", "cpu", "--out", "/nonexistent-dir/x.json"],
         "edgevlm: error: --out: folder /nonexistent-dir does not exist\n"),
        (["--device", "gpu"], "edgevlm: error: --device: expected cpu, cuda or cuda:N, got 'gpu'\n"),
    ],
)
def test_bench_bad_values_return_2(argv, line, capsys):
    from edgevlm.quantize.benchmark import main

    assert main(argv) == 2
    assert capsys.readouterr().err == line


def test_bench_cuda_without_cuda_returns_2(capsys):
    from edgevlm.quantize.benchmark import main

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    assert main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err == "edgevlm: error: CUDA is not available (use --device cpu)\n"
