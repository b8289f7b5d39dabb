"""``edgevlm bench`` on the Qwen2.5-VL / Qwen3-VL / SmolVLM / InternVL families (quantize/bench_families.py), on
CPU: tiny configs of the published shapes (transformers' model and ours over the same random tensors) and
``--model DIR`` on a tiny checkpoint folder (real weights, both loaded from disk). Each prints the table, the
parity line and one JSON line; every implementation x size x batch row has positive timings, the W4A16 rows
really run INT4 decoder weights, and our fp32 prefill logits equal transformers' (the H200 runs are bf16).
bench/gpu_families.py, the old script, maps its flags onto ``edgevlm bench``."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_families.py"
PARITY_TOL = 1e-4  # fp32, same weights: our prefill logits are transformers' own (measured 0 to 1e-6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bench(argv, capsys, tmp_path):
    from edgevlm.quantize.benchmark import main

    out_file = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--new-tokens", "4", "--results-dir", str(tmp_path), "--out", str(out_file),
                 *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert json.loads(out_file.read_text()) == summary
    assert json.loads(next(tmp_path.glob("bench_cpu_*.json")).read_text())["rows"] == summary["rows"]
    return lines, summary


def _check_rows(summary, models, impls, sizes, batches):
    rows = summary["rows"]
    assert sorted((r["model"], r["impl"], r["size"], r["batch"]) for r in rows) == sorted(
        (m, i, s, b) for m in models for i in impls for s in sizes for b in batches)
    for r in rows:
        assert "error" not in r, r
        assert r["vision_tokens"] > 0 and r["prompt_tokens"] > r["vision_tokens"] and r["kv_bytes_per_token"] > 0
        if r["batch"] == 1:  # vision and TTFT are measured at batch 1
            assert r["vision_ms"] > 0 and r["ttft_ms"] > 0
        if r["impl"] != "transformers":  # transformers' TPOT is a difference of two timings: noisy on a busy CPU
            assert r["tpot_ms"] > 0 and r["decode_tok_s"] > 0 and r["weight_bytes"] > 0
    for m in models:
        p = summary["parity"][m]
        assert p["size"] == sizes[0] and p["ours_vs_fp32"] < PARITY_TOL and p["argmax_equal"], (m, p)
    return rows


def test_bench_family_models_on_cpu(tmp_path, capsys):
    from edgevlm.quantize.benchmark import VARIANTS

    models = ["tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-smolvlm"]
    lines, summary = _bench(["--models", ",".join(models), "--batch-sizes", "1,2", "--sizes", "96x48,64x64"],
                            capsys, tmp_path)
    head = lines[1].split()
    assert head[:5] == ["model", "impl", "size", "B", "vis_tok"] and "ttft_ms" in head  # the table, then the JSON
    assert any(line.startswith("parity tiny-qwen3-vl: ") for line in lines[2:-1])
    rows = _check_rows(summary, models, ("transformers", *VARIANTS), ("96x48", "64x64"), (1, 2))
    by = {(r["model"], r["impl"], r["size"], r["batch"]): r for r in rows}
    for (m, impl, s, b), r in by.items():
        bf = by[(m, "edgevlm", s, b)]
        if impl.startswith("edgevlm-w4"):  # INT4 decoder weights really ran
            assert r["weight_bytes"] < bf["weight_bytes"]
        if impl == "edgevlm-w4-kv4":  # and an INT4 KV cache (FP8: about half the 32-bit cache's bytes)
            assert r["kv_bytes_per_token"] * 3 < bf["kv_bytes_per_token"]
        if impl == "edgevlm-w4-kv8":
            assert r["kv_bytes_per_token"] * 2 < bf["kv_bytes_per_token"]


@pytest.mark.parametrize("family", ["internvl", "smolvlm", "qwen2_5_vl", "qwen3_vl"])
def test_bench_model_dir_runs_a_checkpoint_folder(family, tmp_path, capsys):
    from family_support import write_checkpoint

    folder = write_checkpoint(family, tmp_path / f"{family}-tiny")
    _, summary = _bench(["--model", str(folder), "--variants", "edgevlm,edgevlm-w4", "--batch-sizes", "1"], capsys,
                        tmp_path)
    rows = _check_rows(summary, [folder.name], ("transformers", "edgevlm", "edgevlm-w4"), ("64x64",), (1,))
    w4 = next(r for r in rows if r["impl"] == "edgevlm-w4")
    assert w4["weight_bytes"] < next(r for r in rows if r["impl"] == "edgevlm")["weight_bytes"]


def test_bench_model_dir_runs_a_llava_folder(perf_dir, tmp_path, capsys):
    _, summary = _bench(["--model", str(perf_dir), "--variants", "edgevlm", "--batch-sizes", "1,2",
                         "--vision-batch", "2"], capsys, tmp_path)
    rows = {r["impl"]: r for r in summary["rows"]}
    assert set(rows) == {"transformers", "edgevlm"} and all(r["model"] == perf_dir.name for r in rows.values())
    for r in rows.values():
        assert "error" not in r, r
        assert r["ttft_ms"] > 0 and r["vision_img_s"] > 0
    assert rows["edgevlm"]["tpot_ms"] > 0 and rows["edgevlm"]["batch_tok_s"]["2"] > 0


def test_help_lists_the_model_names(capsys):
    from edgevlm.quantize.bench_families import FAMILY_MODEL_NAMES
    from edgevlm.quantize.benchmark import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))  # argparse wraps at hyphens
    for name in ("tiny", "small", "llava-7b", "demo", "qwen2.5-vl-3b", "qwen3-vl-2b", "qwen3-vl-8b", "smolvlm2-2.2b",
                 "internvl3-1b", *FAMILY_MODEL_NAMES):
        assert name in text
    assert "--model DIR" in text


def test_model_dir_that_is_not_a_checkpoint_exits_2(tmp_path, capsys):
    from edgevlm.quantize.benchmark import main

    assert main(["--device", "cpu", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgevlm: error: --model: ") and "config.json" in err and err.count("\n") == 1
    assert main(["--device", "cpu", "--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"edgevlm: error: --model: model folder {tmp_path / 'missing'} does not exist\n"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    assert main(["--device", "cpu", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model_type 'paligemma' is not supported" in err and err.count("\n") == 1


def test_model_dir_that_is_a_bundle_exits_2(perf_dir, tmp_path, capsys):
    """An engine bundle has no transformers twin: refused in one line before anything is built."""
    import shutil

    from edgevlm.quantize.benchmark import main

    folder = shutil.copytree(perf_dir, tmp_path / "bundle")
    (folder / "manifest.json").write_text("{}")
    assert main(["--device", "cpu", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edgevlm: error: --model: {folder} is an edgevlm bundle") and err.count("\n") == 1


def test_model_dir_that_is_a_bundle_without_its_manifest_exits_2(perf_dir, tmp_path, capsys):
    """A bundle copied without manifest.json (its INT4 layers are no checkpoint's): was exit 0 with an
    ERROR row ("... has tensors the runtime does not know"); now refused in one line, naming the cause."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from edgevlm.quantize.benchmark import main

    folder = shutil.copytree(perf_dir, tmp_path / "bundle")
    weights = load_file(str(folder / "model.safetensors"))  # one layer as a bundle stores it
    weights["language_model.model.layers.0.mlp.down_proj.qweight"] = np.zeros((4, 2), np.uint8)
    save_file(weights, str(folder / "model.safetensors"))
    assert main(["--device", "cpu", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == (f"edgevlm: error: --model: {folder} holds INT4 layers (language_model.model.layers.0.mlp.down_proj)"
                   " but no manifest.json: an engine bundle whose manifest.json is missing (copy the whole bundle "
                   "again, or rebuild it with `edgevlm quantize`)\n")


def test_bad_sizes_exit_2(capsys):
    from edgevlm.quantize.benchmark import main

    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--models", "tiny-qwen3-vl", "--sizes", "64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("edgevlm: error: argument --sizes: expected WxH sizes") and err.count("\n") == 1


def _script():
    spec = importlib.util.spec_from_file_location("gpu_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_old_script_maps_onto_edgevlm_bench():
    """bench/results/gpu_families_h200_20261201.md's commands: the same runs through ``edgevlm bench``."""
    script = _script()
    assert script.edgevlm_bench_argv(["--batches", "1,8", "--parity"]) == [
        "--models", "qwen2.5-vl-3b,qwen3-vl-2b,qwen3-vl-8b,smolvlm2-2.2b", "--sizes", "448x448,1280x720",
        "--new-tokens", "32", "--batch-sizes", "1,8", "--results-dir", "", "--out", "",
        "--variants", "edgevlm,edgevlm-w4"]
    argv = script.edgevlm_bench_argv(["--models", "tiny-qwen3-vl", "--device", "cpu", "--impls", "edgevlm",
                                      "--out", "x.json"])
    assert argv[argv.index("--out") + 1] == "x.json" and argv[argv.index("--device") + 1] == "cpu"
    assert {"--no-parity", "--no-hf"} <= set(argv) and argv[-2:] == ["--variants", "edgevlm"]
    with pytest.raises(SystemExit) as exc:
        script.edgevlm_bench_argv(["--impls", "transformers"])
    assert exc.value.code == 2


def test_real_configs_parse_in_both_runtimes():
    """The published shapes build transformers' configs and parse in our family registry."""
    from edgevlm.quantize.bench_families import CONFIGS, model_files

    for name in CONFIGS:
        hf_cfg, files = model_files(name)
        text = files.config.text
        assert (text.num_hidden_layers, text.hidden_size) in ((24, 2048), (28, 2048), (36, 2048), (36, 4096), (24, 896),
                                                              (34, 2560))
        assert files.family.name == {"qwen2.5-vl-3b": "qwen2_5_vl", "qwen3-vl-2b": "qwen3_vl", "qwen3-vl-8b": "qwen3_vl",
                                     "smolvlm2-2.2b": "smolvlm", "internvl3-1b": "internvl", "gemma3-4b": "gemma3"}[name]
    assert model_files("internvl3-1b")[1].config.image_seq_len == 256
