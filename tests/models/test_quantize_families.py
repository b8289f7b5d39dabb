"""`edgevlm quantize` on the registry's families beyond LLaVA (Qwen2.5-VL, Qwen3-VL, SmolVLM2).

Tiny random checkpoints from the families' own test builders (transformers' models, saved) are
quantized W4A16 (RTN and AWQ with the demo calibration scenes, group size 32 because the tiny
decoders' in_features are 64/128) with the vision encoder kept 16-bit; the bundle loads through the
registry (``Engine.load``) and answers, and its prefill logits stay within a tolerance of the 16-bit
model's on the same image and prompt. ``onnx/vision.onnx`` and ``onnx/decoder.onnx`` are built for
every family, checked against the PyTorch modules at build time (recorded in the manifest); the
vision graph equals the tower on real images at two resolution rungs, a corrupted graph refuses the
bundle, and ``--backend onnx`` answers as the torch backend; ``--vision int4`` is one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from family_support import load_test_module, write_checkpoint  # noqa: E402

from edgevlm.quantize.build import BuildOptions, build_bundle  # noqa: E402
from edgevlm.runtime.bundle import read_manifest  # noqa: E402
from edgevlm.runtime.engine import Engine  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


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
    # ONNX: vision.onnx + decoder.onnx, checked at build time, no warning; TensorRT is LLaVA-only
    assert not [r for r in caplog.records if "onnx" in r.getMessage().lower()]
    manifest = read_manifest(result.bundle_dir)
    assert manifest.artifacts["onnx"] == "onnx/"
    assert manifest.artifacts["tensorrt"] == f"not built (the TensorRT build is LLaVA-only; no engine for {family})"
    assert manifest.onnx_check is not None and manifest.onnx_check.passed and manifest.onnx_check.decoder
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


def test_config_keeps_the_ladder_and_onnx_backend_needs_the_graph(checkpoint, tmp_path):
    family, src = checkpoint
    result = build_bundle(src, tmp_path / "bundle", BuildOptions(method="rtn", group_size=32, onnx=False,
                                                                 tensorrt=False))
    raw = json.loads((result.bundle_dir / "config.json").read_text())
    src_raw = json.loads((src / "config.json").read_text())
    assert raw.get("edgevlm", {}).get("resolution_ladder") == (result.manifest.resolution_ladder or
                                                               src_raw.get("edgevlm", {}).get("resolution_ladder"))
    from edgevlm.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"bundle .* has no onnx/vision.onnx \(rebuild it without --no-onnx\)"):
        Engine.load(result.bundle_dir, backend="onnx")
    with pytest.raises(ModelLoadError, match="is not an engine bundle"):
        Engine.load(src, backend="onnx")


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
    assert err[0] == f"edgevlm: error: {flags[0]}: this model has no exit heads (run `edgevlm calibrate` on it)"


def test_quantize_cli_builds_the_bundle(checkpoint, tmp_path, capsys):
    from edgevlm.quantize.cli import main

    family, src = checkpoint
    rc = main([str(src), "--out", str(tmp_path / "b"), "--method", "rtn", "--group-size", "32", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    data = json.loads(out[-1])
    assert data["int4_layers"] > 0 and (tmp_path / "b" / "manifest.json").is_file()
    assert 0 < data["onnx_check_max_error"] < 1e-4  # both graphs checked against PyTorch by the CLI build


def test_llava_awq_runner_uses_the_checkpoints_rope(tmp_path):
    """LLaVA's AWQ calibration replays the decoder layers with the text config's own RoPE
    frequencies (``rope_inv_freq``: Llama-3's scaling here), so the replay reproduces the 16-bit
    prefill logits; default-theta tables would not."""
    from edgevlm.quantize.build import _calibration_inputs, _decoder_runner
    from edgevlm.quantize.shards import CheckpointReader
    from edgevlm.runtime.loader import read_model_files

    llava = load_test_module("test_llava.py")
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


# ------------------------------------------------------------------------------ ONNX vision graphs
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

#: ORT vs PyTorch on these tiny towers, both float32 (measured 4e-7 .. 3e-6 of the output scale)
ONNX_TOL = 1e-4


@pytest.fixture(scope="module")
def onnx_bundle(checkpoint, tmp_path_factory) -> tuple[str, Path]:
    family, src = checkpoint
    out = tmp_path_factory.mktemp(f"onnx_{family}") / "bundle"
    return family, build_bundle(src, out, BuildOptions(method="rtn", group_size=32)).bundle_dir


def test_onnx_graphs_are_built_and_the_check_recorded(onnx_bundle):
    from edgevlm.quantize.onnx_check import DECODE_STEPS, TOLERANCE

    family, bundle = onnx_bundle
    m = read_manifest(bundle)
    paths = {f.path for f in m.files}
    assert {"onnx/vision.onnx", "onnx/vision.onnx.data", "onnx/decoder.onnx", "onnx/decoder.onnx.data"} <= paths
    check = m.onnx_check
    assert check.passed and check.onnxruntime == ort.__version__
    assert check.tolerance == TOLERANCE and len(check.vision) >= 2
    assert all(v.max_error < ONNX_TOL and v.max_abs_torch > 0.1 for v in check.vision)
    dec = check.decoder
    assert dec.decode_steps == DECODE_STEPS and dec.prompt_tokens > 10 and dec.max_abs_torch > 0.1
    assert dec.prefill_max_error < ONNX_TOL and dec.decode_max_error < ONNX_TOL
    # decoder graph: INT4 layers as MatMulNBits, M-RoPE positions (3, 1, T), Qwen3-VL's DeepStack inputs
    graph = onnx.load(str(bundle / "onnx" / "decoder.onnx"), load_external_data=False).graph
    n_int4 = sum(d.action == "int4" and d.name.startswith("language_model.") for d in m.layers)
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == n_int4 > 0
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert inputs["position_ids"] == ([1, "seq"] if family == "smolvlm" else [3, 1, "seq"])
    assert sorted(n for n in inputs if n.startswith("layer_add.")) == (
        ["layer_add.0", "layer_add.1"] if family == "qwen3_vl" else [])
    if family == "smolvlm":  # tile counts: one tile, several, and a padded one
        assert [v.n_tiles for v in check.vision] == [1, 3, 2] and check.vision[-1].padded
    else:  # patch grids: a square image, a non-square one, a two-frame video
        grids = [v.grid_thw[0] for v in check.vision]
        assert grids[0][1] == grids[0][2] and grids[1][1] != grids[1][2] and grids[2][0] == 2
        patch = _files(bundle).config.vision.patch_size
        assert all((v.height_px, v.width_px) == (g[1] * patch, g[2] * patch) for v, g in zip(check.vision, grids, strict=True))
    # one shape-generic graph: every input dimension but the channels is symbolic
    graph = onnx.load(str(bundle / "onnx" / "vision.onnx"), load_external_data=False).graph
    pixels = next(i for i in graph.input if i.name == "pixel_values")
    dims = [d.dim_param or d.dim_value for d in pixels.type.tensor_type.shape.dim]
    assert dims[0] in ("n_patches", "n_tiles") and isinstance(dims[0], str)
    outputs = [o.name for o in graph.output]
    assert outputs == (["image_features", "deepstack.0", "deepstack.1"] if family == "qwen3_vl" else ["image_features"])


@pytest.mark.parametrize("rungs", [(64, 112)])
def test_vision_onnx_equals_pytorch_at_two_rungs(onnx_bundle, rungs):
    """The processor's real input for a non-square image at two ladder rungs (different patch grids /
    tile counts) through ONE vision.onnx session equals the PyTorch tower of the same bundle."""
    from edgevlm.runtime.backends.onnx_vision import VisionGraph

    family, bundle = onnx_bundle
    engine = Engine.load(bundle, device="cpu", dtype="float32")
    model = engine.backend.model
    graph = VisionGraph(bundle / "onnx" / "vision.onnx", family, _files(bundle).config, ["CPUExecutionProvider"])
    image = _image()  # 96 x 128: non-square
    shapes = set()
    for rung in rungs:
        vision = engine.processor.prepare([image], resolution_px=rung)
        with torch.no_grad():
            if family == "smolvlm":
                want = [model.encode_tiles(vision.pixel_values)]
            else:
                out = model.visual(vision.pixel_values, vision.grid_thw)
                want = [out] if family == "qwen2_5_vl" else [out[0], *out[1]]
        got = graph.run(vision.pixel_values, grid_thw=vision.grid_thw)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b.float(), rtol=ONNX_TOL, atol=ONNX_TOL * float(b.abs().max()))
        shapes.add(tuple(vision.pixel_values.shape))
        if family != "smolvlm":
            t, h, w = vision.grid_thw[0].tolist()
            assert h != w  # the non-square image keeps a non-square grid
    assert len(shapes) == 2  # the two rungs fed different shapes to the same session


def _files(bundle):
    from edgevlm.runtime.loader import read_model_files

    return read_model_files(bundle)


def _negate_patch_weight(model):
    """A corrupted weight: the patch embedding's signs flipped (raw 16- or 32-bit floats)."""
    init = next(i for i in model.graph.initializer if i.name.startswith("patch_w"))
    raw = np.frombuffer(init.raw_data, dtype=np.uint16 if init.data_type != onnx.TensorProto.FLOAT else np.uint32)
    init.raw_data = (raw ^ raw.dtype.type(1 << (8 * raw.itemsize - 1))).tobytes()
    return model


def _rope_sin_as_cos(model):
    """The classic rotary bug: the cos table fed where the sin table belongs."""
    for node in model.graph.node:
        node.input[:] = ["rope_cos" if i == "rope_sin" else i for i in node.input]
    return model


def _swap_first_nibbles(model):
    """The classic INT4 packing bug: high and low nibble swapped in one MatMulNBits weight."""
    from onnx import numpy_helper

    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    b = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(((b << 4) | (b >> 4)).astype(np.uint8), init.name))
    return model


@pytest.mark.parametrize("fault", ["nibbles", "1-d rope"])
def test_a_wrong_decoder_graph_refuses_the_bundle(checkpoint, fault, monkeypatch, tmp_path):
    from edgevlm.errors import ModelLoadError
    from edgevlm.quantize import onnx_export

    family, src = checkpoint
    if fault == "nibbles":
        real = onnx_export.build_decoder_graph
        monkeypatch.setattr(onnx_export, "build_decoder_graph", lambda *a, **k: _swap_first_nibbles(real(*a, **k)))
    elif family == "smolvlm":
        pytest.skip("SmolVLM's decoder has 1-D RoPE")
    else:  # every frequency reads the temporal row: plain RoPE, wrong at the image tokens
        monkeypatch.setattr(onnx_export, "mrope_rows", lambda tc: np.zeros(tc.head_dim // 2, np.int64))
    out = tmp_path / "bundle"
    with pytest.raises(ModelLoadError, match=r"ONNX export check failed: onnx/decoder.onnx prefill \(\d+ positions\) "
                                             r"differs from PyTorch by [0-9.e+-]+ of its scale \(tolerance 0.002\)"):
        build_bundle(src, out, BuildOptions(method="rtn", group_size=32))
    assert not out.exists() and not (tmp_path / "bundle.partial").exists()


@pytest.mark.parametrize("fault", [_negate_patch_weight, _rope_sin_as_cos])
def test_a_corrupted_vision_graph_refuses_the_bundle(checkpoint, fault, monkeypatch, tmp_path):
    from edgevlm.errors import ModelLoadError
    from edgevlm.quantize import onnx_vision_export

    family, src = checkpoint
    if fault is _rope_sin_as_cos and family == "smolvlm":
        pytest.skip("SmolVLM's tower has no rotary embedding")
    real = onnx_vision_export.VISION_GRAPHS[family]
    monkeypatch.setitem(onnx_vision_export.VISION_GRAPHS, family, lambda *a: fault(real(*a)))
    out = tmp_path / "bundle"
    first = "1 tiles of 64x64 px" if family == "smolvlm" else r"grid_thw 1x\d+x\d+ \(image of \d+x\d+ px\)"
    with pytest.raises(ModelLoadError, match=r"ONNX export check failed: onnx/vision.onnx (image_features|deepstack.0) "
                                             rf"at {first} differs from PyTorch by [0-9.e+-]+ of its scale"):
        build_bundle(src, out, BuildOptions(method="rtn", group_size=32))
    assert not out.exists() and not (tmp_path / "bundle.partial").exists()


def test_onnx_backend_answers_as_the_torch_backend(onnx_bundle):
    """``--backend onnx`` on these bundles runs both graphs on onnxruntime (M-RoPE positions, Qwen3-VL's
    DeepStack as layer_add inputs; no decoder weights in torch): the same vision tokens within float32
    rounding, the same prefill logits, the same greedy answer."""
    family, bundle = onnx_bundle
    t = Engine.load(bundle, device="cpu", dtype="float32")
    o = Engine.load(bundle, device="cpu", dtype="float32", backend="onnx", max_seq_len=512)
    host = dict(o.backend.host.named_parameters())
    assert all(p.is_meta for n, p in host.items() if n != "language_model.embed_tokens.weight")
    image, question = _image(), "how many shapes are there?"
    vision = t.processor.prepare([image])
    with torch.no_grad():
        want = t.backend.encode_vision(vision)
    got = o.backend.encode_vision(vision)
    torch.testing.assert_close(got, want, rtol=ONNX_TOL, atol=ONNX_TOL * float(want.abs().max()))
    a, b = _prefill_logits(t, image, question), _prefill_logits_backend(o, image, question)
    torch.testing.assert_close(b, a, rtol=ONNX_TOL, atol=ONNX_TOL * float(a.abs().max()))
    ta = t.ask(image, question, max_new_tokens=4)
    oa = o.ask(image, question, max_new_tokens=4)
    assert oa.text == ta.text and oa.stats.backend == "onnx" and ta.stats.backend == "torch"
    frames = [np.random.default_rng(k).integers(0, 256, (64, 96, 3), dtype=np.uint8) for k in range(4)]
    ta = t.ask(frames, "what is happening?", max_new_tokens=4)  # a video (Qwen) or 4 images (SmolVLM)
    oa = o.ask(frames, "what is happening?", max_new_tokens=4)
    assert oa.text == ta.text and oa.stats.new_tokens == ta.stats.new_tokens >= 1
    with pytest.raises(ValueError, match="encodes a VisionInput"):
        o.backend.encode_image(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match="skips past the cached sequence"):
        o.backend.decode(5, 400)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        o.backend.prefill(torch.zeros(1, 513, t.config.text.hidden_size))
    if family == "smolvlm":
        with pytest.raises(ValueError, match="takes the slots as RoPE positions only"):
            o.backend.decode(5, 3, rope_offset=2)


def _prefill_logits_backend(engine: Engine, image: np.ndarray, question: str) -> torch.Tensor:
    """Last-position prefill logits ``(V,)`` through the Backend interface (what the Engine calls)."""
    be = engine.backend
    vision = engine.processor.prepare([image])
    ids = engine.tokenizer.encode_request(question, vision, engine.processor)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        feats = be.encode_vision(vision)
        pos, _ = be.position_ids(input_ids, vision)
        logits = be.prefill(be.embed(input_ids, feats), position_ids=pos)
    return logits[0].float()


def test_segment_tables_gather_and_scatter_back():
    """The attention-segment feeds: every patch appears once in its segment's row, the bias marks
    exactly the padding, and the scatter index puts every row back (the window layout of a 2-frame
    grid whose windows do not tile it)."""
    from edgevlm.runtime.backends.onnx_vision import segment_tables

    order = torch.tensor([4, 0, 3, 1, 2, 6, 5])  # segment position -> patch
    cu = torch.tensor([0, 3, 4, 7])  # segments of 3, 1 and 3 patches
    t = segment_tables("window", order, cu)
    assert t["window_index"].shape == (3, 3) and t["window_bias"].shape == (3, 3)
    assert t["window_index"].tolist() == [[4, 0, 3], [1, 0, 0], [2, 6, 5]]
    assert (t["window_bias"] == 0).tolist() == [[True] * 3, [True, False, False], [True] * 3]
    assert float(t["window_bias"].min()) == float(np.finfo(np.float32).min)
    rows = t["window_index"].reshape(-1)
    assert rows[t["window_scatter"]].tolist() == list(range(7))  # scatter inverts the gather


def test_vision_feeds_refuse_bad_inputs():
    from edgevlm.runtime.backends.onnx_vision import vision_feeds

    with pytest.raises(ValueError, match="needs grid_thw"):
        vision_feeds("qwen2_5_vl", None, torch.zeros(4, 1176))
    with pytest.raises(ValueError, match="4 patches do not match grid_thw"):
        vision_feeds("qwen3_vl", None, torch.zeros(4, 1536), grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="no ONNX vision graph for the llava family"):
        vision_feeds("llava", None, torch.zeros(1, 3, 64, 64))
