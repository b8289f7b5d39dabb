"""ONNX artifacts (vision with dynamic H/W, decoder with past KV and MatMulNBits), the onnxruntime
backend, and the TensorRT profile/build guard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgevlm.errors import ModelLoadError  # noqa: E402
from edgevlm.quantize.build import BuildOptions, build_bundle  # noqa: E402
from edgevlm.runtime.int4 import set_int4_kernel  # noqa: E402

LADDER = [80, 64, 48]  # px; 64 is the native size of the tiny encoder (4x4 patches of 16 px)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path_factory.mktemp("src"), seed=2, resolution_ladder=LADDER,
                                text_hidden=192, vision_hidden=64, num_heads=4, num_kv_heads=2)
    out = tmp_path_factory.mktemp("b") / "bundle"
    # vision int4 too: MatMulNBits with AWQ input scales (fc2) and 3 blocks per row (odd zero-point packing)
    return build_bundle(src, out, BuildOptions(method="awq", calib="demo", calib_samples=2, vision="int4")).bundle_dir


@pytest.fixture(scope="module")
def torch_engine(bundle):
    from edgevlm.runtime import Engine

    engine = Engine.load(bundle)
    set_int4_kernel(engine.backend.model, "dequant")  # float32 everywhere, like the ONNX graphs
    return engine


@pytest.fixture(scope="module")
def onnx_engine(bundle):
    from edgevlm.runtime import Engine

    return Engine.load(bundle, backend="onnx")


def test_graphs_use_matmulnbits_and_dynamic_shapes(bundle):
    from edgevlm.runtime.bundle import read_manifest

    m = read_manifest(bundle)
    assert m.artifacts["onnx"] == "onnx/" and any(f.path == "onnx/decoder.onnx" for f in m.files)
    dec = onnx.load(str(bundle / "onnx" / "decoder.onnx"), load_external_data=False)
    nbits = [n for n in dec.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == sum(d.action == "int4" and d.name.startswith("language_model.") for d in m.layers) == 14
    attrs = {a.name: helper_value(a) for a in nbits[0].attribute}
    assert attrs["bits"] == 4 and attrs["K"] == 192 and attrs["block_size"] == 64 and nbits[0].domain == "com.microsoft"
    assert {i.name for i in dec.graph.input} >= {"inputs_embeds", "position_ids", "past.0.key", "past.1.value"}
    vis = onnx.load(str(bundle / "onnx" / "vision.onnx"), load_external_data=False)
    dims = [d.dim_param or d.dim_value for d in vis.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, "height", "width"]
    assert sum(n.op_type == "MatMulNBits" for n in vis.graph.node) == 12  # 2 blocks x 6 linears


def helper_value(attr):
    return onnx.helper.get_attribute_value(attr)


@pytest.mark.parametrize("rung", LADDER)
def test_vision_matches_pytorch_at_every_rung(torch_engine, onnx_engine, rung):
    from edgevlm.runtime.preprocess import preprocess

    image = np.random.default_rng(rung).integers(0, 256, (45, 100, 3), dtype=np.uint8)  # non-square
    pixels = torch.from_numpy(preprocess(image, rung, 16))[None]
    assert pixels.shape[2] != pixels.shape[3]
    with torch.no_grad():
        want = torch_engine.backend.encode_image(pixels)
    got = onnx_engine.backend.encode_image(pixels)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    square = torch.randn(1, 3, rung // 16 * 16, rung // 16 * 16, generator=torch.Generator().manual_seed(rung))
    torch.testing.assert_close(onnx_engine.backend.encode_image(square), torch_engine.backend.encode_image(square),
                               rtol=1e-4, atol=1e-4)


def test_decoder_prefill_and_decode_match_pytorch(torch_engine, onnx_engine):
    tb, ob = torch_engine.backend, onnx_engine.backend
    ids = torch.tensor([[1, 5, 4, 4, 4, 4, 9, 7]])
    feats = torch.randn(1, 4, 192, generator=torch.Generator().manual_seed(0))
    emb_t, emb_o = tb.embed(ids, feats), ob.embed(ids, feats)
    torch.testing.assert_close(emb_o, emb_t.float())
    torch.testing.assert_close(ob.prefill(emb_o), tb.prefill(emb_t), rtol=1e-4, atol=1e-4)
    for pos, tok in enumerate([11, 12, 13], start=8):
        torch.testing.assert_close(ob.decode(tok, pos), tb.decode(tok, pos), rtol=1e-4, atol=1e-4)
    # rewinding (decode at an earlier position) recomputes from the cache prefix
    torch.testing.assert_close(ob.decode(20, 9), tb.decode(20, 9), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="skips past"):
        ob.decode(3, 50)


def test_same_answers_across_backends(torch_engine, onnx_engine):
    from edgevlm.types import OperatingPoint

    image = np.random.default_rng(5).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    for rung in LADDER:
        op = OperatingPoint(resolution_px=rung)
        for prompt in ("how many circles are there?", "what color is the square?"):
            a = torch_engine.ask(image, prompt, max_new_tokens=6, operating_point=op)
            b = onnx_engine.ask(image, prompt, max_new_tokens=6, operating_point=op)
            assert a.text == b.text and b.stats.backend == "onnx"


def test_onnx_backend_errors(bundle, tmp_path):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    plain = write_tiny_checkpoint(tmp_path / "plain")
    with pytest.raises(ModelLoadError, match="not an engine bundle"):
        Engine.load(plain, backend="onnx")
    built = build_bundle(plain, tmp_path / "b", BuildOptions(method="rtn", onnx=False))
    no_onnx = built.bundle_dir
    assert built.notes[-1] == ("tensorrt: not built (it builds from the ONNX export, which --no-onnx skipped); "
                               "the bundle is complete for torch")  # not "for torch and onnx": no onnx/ was written
    with pytest.raises(ModelLoadError, match="no onnx/vision.onnx"):
        Engine.load(no_onnx, backend="onnx")
    from edgevlm.errors import InvalidRequestError
    from edgevlm.runtime.backends import load_backend
    from edgevlm.runtime.loader import read_model_files

    with pytest.raises(InvalidRequestError, match="takes no options"):
        load_backend("onnx", read_model_files(bundle), device=torch.device("cpu"), dtype=torch.float32,
                     max_seq_len=64, kv_cache_dtype="int4")


# ------------------------------------------------------------------------------ TensorRT
def test_vision_profile_spans_the_ladder():
    from edgevlm.quantize.tensorrt_build import check_profile, vision_profile

    mn, opt, mx = vision_profile([1024, 768, 512, 384], 14)
    assert mn == (1, 3, 196, 196) and opt == (1, 3, 770, 1022) and mx == (1, 3, 1022, 1022)
    assert all(v % 14 == 0 for v in mn[2:] + opt[2:] + mx[2:])
    assert vision_profile([384], 16) == ((1, 3, 192, 192), (1, 3, 288, 384), (1, 3, 384, 384))
    assert vision_profile([20], 16)[0] == (1, 3, 16, 16)  # never below one patch
    with pytest.raises(ValueError, match="min <= opt <= max"):
        check_profile((1, 3, 64, 64), (1, 3, 32, 64), (1, 3, 128, 128))
    with pytest.raises(ValueError, match="bad ladder"):
        vision_profile([], 16)
    with pytest.raises(ValueError, match="min_aspect"):
        vision_profile([384], 16, min_aspect=0.0)


def test_every_ladder_input_fits_the_profile():
    from edgevlm.quantize.tensorrt_build import vision_profile
    from edgevlm.runtime.preprocess import target_size

    ladder = [1024, 768, 512, 384]
    mn, _, mx = vision_profile(ladder, 14)
    for rung in ladder:
        for w, h in ((1920, 1080), (1280, 720), (640, 480), (480, 640), (1000, 1000), (2000, 1000)):
            tw, th = target_size(w, h, rung, 14)
            assert mn[2] <= th <= mx[2] and mn[3] <= tw <= mx[3]


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorrt") is not None, reason="tensorrt installed")
def test_tensorrt_missing_is_one_line_and_backend_errors(bundle):
    from edgevlm.quantize.tensorrt_build import build_tensorrt_engines
    from edgevlm.runtime import Engine
    from edgevlm.runtime.bundle import read_manifest

    note = build_tensorrt_engines(bundle, LADDER)
    assert note == "tensorrt: not built (tensorrt is not importable here); the bundle is complete for torch and onnx"
    assert build_tensorrt_engines(bundle / "onnx", LADDER) == (  # a folder without onnx/vision.onnx
        "tensorrt: not built (no onnx/vision.onnx to build from); the bundle is complete for torch")
    assert read_manifest(bundle).artifacts["tensorrt"].startswith("not built")
    from edgevlm.errors import InvalidRequestError
    from edgevlm.runtime.backends import load_backend
    from edgevlm.runtime.loader import read_model_files

    # on a CPU the device is named first: installing the extra would not make it run here
    with pytest.raises(InvalidRequestError, match=r"^device: backend 'tensorrt' needs a CUDA device, got 'cpu'$"):
        Engine.load(bundle, backend="tensorrt")
    with pytest.raises(ModelLoadError, match=r"pip install 'edgevlm\[tensorrt\]'"):  # the backend's own import
        load_backend("tensorrt", read_model_files(bundle), device=torch.device("cpu"), dtype=torch.float32,
                     max_seq_len=64)


# ------------------------------------------------------------------------------ export check (issue 11)
def test_manifest_records_the_onnx_check(bundle):
    from edgevlm.quantize.onnx_check import TOLERANCE
    from edgevlm.runtime.bundle import read_manifest

    check = read_manifest(bundle).onnx_check
    assert check is not None and check.passed and check.onnxruntime == ort.__version__
    sizes = [(v.height_px, v.width_px) for v in check.vision]
    assert len(sizes) >= 3
    assert any(h != w for h, w in sizes)  # non-square
    assert any(h == w and h != 64 for h, w in sizes)  # off the native 64 px
    assert (64, 64) in sizes
    errors = [v.max_error for v in check.vision] + [check.decoder.prefill_max_error, check.decoder.decode_max_error]
    assert max(errors) <= TOLERANCE and max(errors) < 1e-4  # measured: ~1e-6 on this model
    assert check.decoder.decode_steps == 3 and check.decoder.prompt_tokens > 4


def _swap_first_nibbles(model):
    """The classic packing bug: high and low nibble swapped in one MatMulNBits weight."""
    from onnx import numpy_helper

    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    b = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(((b << 4) | (b >> 4)).astype(np.uint8), init.name))
    return model


def _linear_resize(model):
    """Position embeddings resized bilinearly instead of bicubically: right at the native size only."""
    for n in model.graph.node:
        if n.op_type == "Resize":
            for a in n.attribute:
                if a.name == "mode":
                    a.s = b"linear"
    return model


@pytest.mark.parametrize(("graph", "fault", "message"), [
    ("build_decoder_graph", _swap_first_nibbles, r"onnx/decoder.onnx prefill \(\d+ positions\) differs from PyTorch"),
    ("build_vision_graph", _swap_first_nibbles, r"onnx/vision.onnx at 64x64 px differs from PyTorch"),
    ("build_vision_graph", _linear_resize, r"onnx/vision.onnx at \d+x64 px differs from PyTorch"),
])
def test_a_wrong_graph_is_refused_and_no_bundle_is_left(monkeypatch, tmp_path, graph, fault, message):
    from edgevlm.quantize import onnx_export
    from edgevlm.runtime.testing import write_tiny_checkpoint

    real = getattr(onnx_export, graph)
    monkeypatch.setattr(onnx_export, graph, lambda *a, **k: fault(real(*a, **k)))
    src = write_tiny_checkpoint(tmp_path / "src", seed=2, resolution_ladder=LADDER, text_hidden=192,
                                vision_hidden=64, num_heads=4, num_kv_heads=2)
    out = tmp_path / "bundle"
    with pytest.raises(ModelLoadError, match=message + r" by [0-9.e+-]+ of its scale \(tolerance 0.002\)"):
        build_bundle(src, out, BuildOptions(method="rtn", calib=None, vision="int4"))
    assert not out.exists() and not (tmp_path / "bundle.partial").exists()


def test_cli_refuses_a_wrong_graph_in_one_line(monkeypatch, tmp_path, capsys):
    from edgevlm.cli import main
    from edgevlm.quantize import onnx_export
    from edgevlm.runtime.testing import write_tiny_checkpoint

    real = onnx_export.build_decoder_graph
    monkeypatch.setattr(onnx_export, "build_decoder_graph", lambda *a, **k: _swap_first_nibbles(real(*a, **k)))
    src = write_tiny_checkpoint(tmp_path / "src", seed=2, text_hidden=192, num_heads=4, num_kv_heads=2)
    assert main(["quantize", str(src), "--out", str(tmp_path / "b"), "--method", "rtn"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "b").exists()
    lines = [line for line in err.splitlines() if not line.startswith("[")]  # the progress bar's lines
    assert len(lines) == 1 and lines[0].startswith("edgevlm: error: ONNX export check failed: onnx/decoder.onnx")
