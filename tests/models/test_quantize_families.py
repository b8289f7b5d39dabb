"""`edgevlm quantize` on the registry's families beyond LLaVA (Qwen2.5-VL, Qwen3-VL, SmolVLM2).

Tiny random checkpoints from the families' own test builders (transformers' models, saved) are
quantized W4A16 (RTN and AWQ with the demo calibration scenes, group size 32 because the tiny
decoders' in_features are 64/128) with the vision encoder kept 16-bit; the bundle loads through the
registry (``Engine.load``) and answers, and its prefill logits stay within a tolerance of the 16-bit
model's on the same image and prompt. The ONNX export is refused for these families with one
WARNING line while the torch bundle is still built; ``--vision int4`` is one line, exit 2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from edgevlm.quantize.build import BuildOptions, build_bundle  # noqa: E402
from edgevlm.runtime.bundle import read_manifest  # noqa: E402
from edgevlm.runtime.engine import Engine  # noqa: E402

HERE = Path(__file__).parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_quantize_families_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(family: str, folder: Path) -> Path:
    if family == "qwen2_5_vl":
        _module("test_qwen2_5_vl").write_tiny_qwen2_5_vl(folder)
    elif family == "qwen3_vl":
        _module("test_qwen3_vl").write_tiny_qwen3_vl(folder)
    else:
        pytest.importorskip("num2words")
        _module("test_smolvlm").build_checkpoint(folder)
    return folder


FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _write(request.param, tmp_path_factory.mktemp(request.param))


def _image() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(96, 128, 3), dtype=np.uint8)


def _prefill_logits(engine: Engine, image: np.ndarray, question: str) -> torch.Tensor:
    """Last-position prefill logits ``(V,)`` float32 of one request, through the family's interfaces."""
    model = engine.backend.model
    vision = engine.processor.prepare([image])
    ids = engine.tokenizer.encode_request(question, vision, engine.processor)
    input_ids = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        feats = model.encode_vision(vision)
        pos, _ = model.position_ids(input_ids, vision)
        embeds = model.embed(input_ids, feats)
        logits = model.prefill(embeds) if pos is None else model.prefill(embeds, position_ids=pos)
    return logits[0].float()


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_bundle_loads_answers_and_keeps_the_logits(checkpoint, method, tmp_path, caplog):
    family, src = checkpoint
    opts = BuildOptions(method=method, group_size=32, calib="demo", calib_samples=2, awq_grid=4)
    with caplog.at_level("WARNING", logger="edgevlm.quantize.build"):
        result = build_bundle(src, tmp_path / "bundle", opts)
    # ONNX: one warning line naming the family and what is supported; the torch bundle is built
    warned = [r.getMessage() for r in caplog.records if "ONNX export" in r.getMessage()]
    assert len(warned) == 1 and family in warned[0] and "llava" in warned[0]
    manifest = read_manifest(result.bundle_dir)
    assert "onnx" in manifest.artifacts and "not built" in manifest.artifacts["onnx"]
    int4 = [d for d in manifest.layers if d.action == "int4"]
    assert int4 and all(d.name.startswith("language_model.layers.") for d in int4)
    assert all(d.group_size == 32 and d.method == method for d in int4)
    kept = [d for d in manifest.layers if d.action == "keep"]
    assert any(not d.name.startswith("language_model.") for d in kept)  # the vision tower stays 16-bit
    if method == "awq":
        assert manifest.calibration.samples == 2 and manifest.calibration.tokens > 0
        assert all(d.awq_alpha is not None and d.rel_error is not None for d in int4)

    image, question = _image(), "how many shapes are there?"
    ref = Engine.load(src, device="cpu", dtype="float32")
    q = Engine.load(result.bundle_dir, device="cpu", dtype="float32")
    n_int4 = sum(type(m).__name__ == "Int4Linear" for m in q.backend.model.modules())
    assert n_int4 == len(int4)
    answer = q.ask(image, question, max_new_tokens=4)
    assert isinstance(answer.text, str) and answer.stats.new_tokens >= 1

    a, b = _prefill_logits(ref, image, question), _prefill_logits(q, image, question)
    rel = float((a - b).abs().max() / a.abs().max())
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    # random tiny weights (every weight moved by N(0, 0.3)) are far harder on 4 bits than trained ones
    assert 0 < rel < 0.5 and cos > 0.9, (rel, cos)


def test_calibration_inputs_reproduce_the_16bit_prefill(checkpoint):
    """The family-independent calibration path (processor, tokenizer, encode_vision, position_ids,
    embed, the decoder's recorded inputs incl. multimodal RoPE tables and DeepStack adds) run
    through the 16-bit decoder layers one by one gives the model's own prefill logits."""
    from edgevlm.quantize.build import _family_calibration_inputs
    from edgevlm.quantize.calib import load_samples
    from edgevlm.quantize.shards import CheckpointReader
    from edgevlm.runtime.loader import read_model_files

    family, src = checkpoint
    files = read_model_files(src)
    opts = BuildOptions(method="awq", calib="demo", calib_samples=2)
    xs, run, info = _family_calibration_inputs(files, CheckpointReader(files), opts, [])
    assert len(xs) == 2 and info.tokens == sum(x.shape[1] for x in xs)
    ref = Engine.load(src, device="cpu", dtype="float32")
    model = ref.backend.model
    for j, s in enumerate(load_samples("demo", 2)):
        vision = ref.processor.prepare([s.image])
        ids = ref.tokenizer.encode_request(s.prompt, vision, ref.processor)
        ids += ref.tokenizer.tok.encode(" " + s.answer, add_special_tokens=False).ids
        input_ids = torch.tensor([ids])
        model.setup_caches(1, 1024)  # the runner below swaps in caches of one sample's length
        with torch.no_grad():
            feats = model.encode_vision(vision)
            pos, _ = model.position_ids(input_ids, vision)
            embeds = model.embed(input_ids, feats)
            want = model.prefill(embeds) if pos is None else model.prefill(embeds, position_ids=pos)
            x = xs[j]
            for i, layer in enumerate(model.language_model.layers):
                x = run.add_after(i, j, run(layer, j, x))
            got = model.language_model.lm_head(model.language_model.norm(x[:, -1]))
        assert x.shape[1] == len(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_vision_int4_is_one_line_exit_2(checkpoint, tmp_path, capsys):
    from edgevlm.quantize.cli import main

    family, src = checkpoint
    rc = main([str(src), "--out", str(tmp_path / "b"), "--method", "rtn", "--vision", "int4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("edgevlm: error:") and family in err[0] and "--vision fp16" in err[0]
    assert not (tmp_path / "b").exists()


def test_config_keeps_the_ladder_and_onnx_backend_refuses(checkpoint, tmp_path):
    family, src = checkpoint
    result = build_bundle(src, tmp_path / "bundle", BuildOptions(method="rtn", group_size=32, onnx=False,
                                                                 tensorrt=False))
    raw = json.loads((result.bundle_dir / "config.json").read_text())
    src_raw = json.loads((src / "config.json").read_text())
    assert raw.get("edgevlm", {}).get("resolution_ladder") == (result.manifest.resolution_ladder or
                                                               src_raw.get("edgevlm", {}).get("resolution_ladder"))
    from edgevlm.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=f"the onnx backend runs llava bundles only; .* is a {family} bundle"):
        Engine.load(result.bundle_dir, backend="onnx")


@pytest.mark.parametrize("flags", [["--exit-layer", "1"], ["--exit-threshold", "0.9"]])
def test_ask_exit_flags_without_exit_heads_are_one_line_exit_2(checkpoint, flags, tmp_path, capsys):
    from PIL import Image

    from edgevlm.cli import main

    family, src = checkpoint
    image = tmp_path / "scene.png"
    Image.fromarray(_image()).save(image)
    rc = main(["ask", "--image", str(image), "--model", str(src), *flags, "how many shapes are there?"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and captured.out == ""
    # early exit is supported for the family, but this checkpoint has no exit heads yet
    assert err[0] == "edgevlm: error: operating point 'cli': this model has no exit heads (run `edgevlm calibrate` on it)"


def test_quantize_cli_builds_the_bundle(checkpoint, tmp_path, capsys):
    from edgevlm.quantize.cli import main

    family, src = checkpoint
    rc = main([str(src), "--out", str(tmp_path / "b"), "--method", "rtn", "--group-size", "32", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    data = json.loads(out[-1])
    assert data["int4_layers"] > 0 and (tmp_path / "b" / "manifest.json").is_file()


def test_llava_awq_runner_uses_the_checkpoints_rope(tmp_path):
    """LLaVA's AWQ calibration replays the decoder layers with the text config's own RoPE
    frequencies (``rope_inv_freq``: Llama-3's scaling here), so the replay reproduces the 16-bit
    prefill logits; default-theta tables would not."""
    from edgevlm.quantize.build import _calibration_inputs, _decoder_runner
    from edgevlm.quantize.shards import CheckpointReader
    from edgevlm.runtime.loader import read_model_files

    llava = _module("test_llava")
    vision, text_cls, extra = llava.VARIANTS["clip-llama3"]
    src = llava.build_llava(tmp_path / "llama3", vision, text_cls, extra)
    files = read_model_files(src)
    assert files.config.text.rope_type == "llama3"
    opts = BuildOptions(method="awq", calib="demo", calib_samples=1)
    xs, _, _ = _calibration_inputs(files, CheckpointReader(files), opts, list(files.config.resolution_ladder), False)
    run = _decoder_runner(files, [x.shape[1] for x in xs])
    model = Engine.load(src, device="cpu", dtype="float32").backend.model
    with torch.no_grad():
        want = model.prefill(xs[0])
        x = xs[0]
        for i, layer in enumerate(model.language_model.layers):
            x = run.add_after(i, 0, run(layer, 0, x))
        got = model.language_model.lm_head(model.language_model.norm(x[:, -1]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
