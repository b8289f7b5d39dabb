"""Engine bundles: build from a tiny checkpoint, manifest, hash verification, Engine.load, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from edgevlm.errors import ConfigError, ModelLoadError
from edgevlm.quantize.build import BuildOptions, build_bundle
from edgevlm.runtime.bundle import MANIFEST_NAME, read_manifest, verify_bundle
from edgevlm.runtime.int4 import Int4Linear, dequantize_int4, set_int4_kernel

RTN = BuildOptions(method="rtn", onnx=False, calib=None)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from edgevlm.runtime.testing import write_tiny_checkpoint

    # text hidden 192 = 1.5 x 128: q/k/v/gate/up fall back to group size 64; down_proj (384) keeps 128
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src"), seed=1, resolution_ladder=[32, 64],
                                 text_hidden=192, vision_hidden=64, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def rtn_bundle(tiny_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "rtn"
    plans = []
    result = build_bundle(tiny_src, out, RTN, on_plan=plans.append)
    assert len(plans) == 1
    return result


@pytest.fixture(scope="module")
def awq_bundle(tiny_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "awq"
    opts = BuildOptions(method="awq", calib="demo", calib_samples=3, vision="int4", onnx=False)
    return build_bundle(tiny_src, out, opts)


def _source_tensors(src):
    from safetensors.torch import load_file

    return load_file(str(src / "model.safetensors"))


def test_manifest_records_the_build(rtn_bundle, tiny_src):
    m = read_manifest(rtn_bundle.bundle_dir)
    assert m.format_version == 1 and m.scheme == "W4A16" and m.method == "rtn" and m.group_size == 128
    assert m.resolution_ladder == [64, 32] and m.patch_size_px == 16
    assert m.source.path == str(tiny_src.resolve()) and len(m.source.sha256) == 64
    assert {f.path for f in m.files} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert "torch" in m.versions and "python" in m.versions
    assert m.stats["peak_rss_mb"] > 0 and m.stats["quantize_time_s"] > 0
    by_name = {d.name: d for d in m.layers}
    q = by_name["language_model.layers.0.self_attn.q_proj"]
    assert (q.action, q.group_size, q.in_features) == ("int4", 64, 192) and "not divisible by 128" in q.reason
    assert by_name["language_model.layers.1.mlp.down_proj"].group_size == 128
    assert by_name["language_model.lm_head"].action == "keep"
    assert by_name["vision_tower.encoder.layers.0.mlp.fc1"].action == "keep"  # --vision fp16 (default)
    assert by_name["vision_tower.projector.linear_1"].action == "keep"
    assert m.stats["decoder_linear_int4_bytes"] / m.stats["decoder_linear_16bit_bytes"] < 0.30
    assert m.artifacts["tensorrt"] == ("not built (it builds from the ONNX export, which --no-onnx skipped); the bundle "
                                       "is complete for torch")  # the fixture builds without ONNX
    cfg = json.loads((rtn_bundle.bundle_dir / "config.json").read_text())
    assert cfg["edgevlm"]["resolution_ladder"] == [64, 32]


def test_stored_weights_are_rtn_of_the_source(rtn_bundle, tiny_src):
    from safetensors.torch import load_file

    src = _source_tensors(tiny_src)
    out = load_file(str(rtn_bundle.bundle_dir / "model.safetensors"))
    key = "language_model.model.layers.1.mlp.gate_proj"
    qw, scales, zeros = out[key + ".qweight"], out[key + ".scales"], out[key + ".zeros"]
    assert (qw.dtype, scales.dtype, zeros.dtype) == (torch.uint8, torch.float16, torch.uint8)
    assert key + ".weight" not in out
    w = src[key + ".weight"].double()
    deq = dequantize_int4(qw, scales, zeros, 64, torch.float64)
    step = scales.double().repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    emb = "language_model.model.embed_tokens.weight"
    assert out[emb].dtype == torch.bfloat16 and torch.equal(out[emb], src[emb].to(torch.bfloat16))
    assert not any(k.startswith("vision_tower.post_layernorm") for k in out)  # unused by the runtime


def test_engine_runs_bundle_like_in_memory_quantization(rtn_bundle, tiny_src):
    """Engine.load(bundle) == source model quantized in memory with quantize_ (same plan)."""
    from edgevlm.quantize import Int4WeightOnlyConfig, quantize_
    from edgevlm.runtime import Engine
    from edgevlm.runtime.loader import load_model, read_model_files

    engine = Engine.load(rtn_bundle.bundle_dir)
    model = engine.backend.model
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 14
    assert engine.resolution_ladder == [32, 64]
    ref = load_model(read_model_files(tiny_src), device=torch.device("cpu"), dtype=torch.float32, max_seq_len=256)
    quantize_(ref, Int4WeightOnlyConfig(group_size=128),
              filter_fn=lambda m, fqn: fqn.startswith("language_model.layers."))
    with torch.no_grad():  # the tensors kept 16-bit went through bfloat16 in the bundle
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    set_int4_kernel(model, "dequant")
    set_int4_kernel(ref, "dequant")
    ids = torch.tensor([[1, 4, 4, 4, 4, 4, 4, 7, 9, 11]])  # 6 image tokens: 32x48 px = 2x3 patches
    pixels = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids, pixels)
        want = ref(ids, pixels)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    image = np.random.default_rng(3).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    set_int4_kernel(model, "auto")
    answer = engine.ask(image, "how many circles are there?", max_new_tokens=4)
    assert answer.stats.new_tokens >= 1 and answer.stats.backend == "torch"


def test_awq_bundle_folds_and_loads(awq_bundle):
    from edgevlm.runtime import Engine

    m = awq_bundle.manifest
    assert m.calibration.source == "demo" and m.calibration.samples == 3 and m.calibration.tokens > 0
    by_name = {d.name: d for d in m.layers}
    fc1 = by_name["vision_tower.encoder.layers.0.mlp.fc1"]
    assert fc1.action == "int4" and fc1.method == "awq"
    for d in m.layers:
        if d.action != "int4":
            continue
        assert d.awq_scale in ("folded", "input_scale", "none")
        if d.name.endswith(("o_proj", "out_proj", "fc2", "down_proj", "fc1")):  # one-layer groups: never worse
            assert d.rel_error <= d.rel_error_rtn + 1e-12
        if d.name.endswith(("k_proj", "v_proj")):  # q/k/v share one input, so one alpha (total error decides)
            assert d.awq_alpha == by_name[d.name[:-6] + "q_proj"].awq_alpha
    fc2 = by_name["vision_tower.encoder.layers.0.mlp.fc2"]  # after GELU: nothing to fold into
    assert fc2.awq_scale in ("input_scale", "none")
    o_proj = by_name["language_model.layers.0.self_attn.o_proj"]  # GQA (2 kv heads): not foldable
    assert o_proj.awq_scale in ("input_scale", "none") and o_proj.awq_fold_into is None
    engine = Engine.load(awq_bundle.bundle_dir)
    n_input_scale = sum(isinstance(x, Int4Linear) and x.input_scale is not None for x in engine.backend.model.modules())
    assert n_input_scale == sum(d.awq_scale == "input_scale" for d in m.layers)
    image = np.zeros((40, 40, 3), np.uint8)
    assert engine.ask(image, "describe the scene.", max_new_tokens=3).stats.new_tokens >= 1


# ------------------------------------------------------------------------------ verification
def _copy(bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundle.bundle_dir, dst)
    return dst


def test_tampered_file_is_refused_by_name(rtn_bundle, tmp_path):
    from edgevlm.runtime import Engine

    dst = _copy(rtn_bundle, tmp_path)
    data = bytearray((dst / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (dst / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.safetensors does not match its SHA-256"):
        Engine.load(dst)


def test_missing_file_is_refused_by_name(rtn_bundle, tmp_path):
    dst = _copy(rtn_bundle, tmp_path)
    (dst / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer_config.json listed in manifest.json is missing"):
        verify_bundle(dst)


def test_bad_manifests_are_refused(rtn_bundle, tmp_path):
    dst = _copy(rtn_bundle, tmp_path)
    raw = json.loads((dst / MANIFEST_NAME).read_text())
    (dst / MANIFEST_NAME).write_text(json.dumps({**raw, "format_version": 2}))
    with pytest.raises(ModelLoadError, match="format_version 2 is not supported"):
        verify_bundle(dst)
    (dst / MANIFEST_NAME).write_text(json.dumps({**raw, "files": [{"path": "../x", "sha256": "0", "size_bytes": 1}]}))
    with pytest.raises(ModelLoadError, match="leaves the bundle"):
        verify_bundle(dst)
    (dst / MANIFEST_NAME).write_text(json.dumps({**raw, "method": "gptq"}))
    with pytest.raises(ModelLoadError, match="method"):
        verify_bundle(dst)
    # another INT4 layout (a bundle of another edgevlm): loaded without a word, its nibbles misread
    from edgevlm.runtime import Engine

    (dst / MANIFEST_NAME).write_text(json.dumps({**raw, "int4_layout": "canonical-v2: qweight int32 (out, in/8)"}))
    with pytest.raises(ModelLoadError) as err:
        Engine.load(dst)
    assert str(err.value) == (f"{dst / MANIFEST_NAME}: INT4 layout 'canonical-v2' is not the one this edgevlm reads "
                              "(canonical-v1); rebuild the bundle with this version's `edgevlm quantize`")
    (dst / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        verify_bundle(dst)


def _relist(dst, rel):
    """Record ``rel`` in the manifest with its real SHA-256 (what an attacker who edits the
    manifest too would do): only the confinement rule can refuse it then."""
    from edgevlm.runtime.bundle import sha256_file

    raw = json.loads((dst / MANIFEST_NAME).read_text())
    raw["files"] = [e for e in raw["files"] if e["path"] != rel] + [
        {"path": rel, "sha256": sha256_file(dst / rel), "size_bytes": (dst / rel).stat().st_size}]
    (dst / MANIFEST_NAME).write_text(json.dumps(raw))


def test_index_pointing_outside_the_bundle_is_refused(rtn_bundle, tmp_path):
    """issue 11: a weight map naming ../outside/model.safetensors loaded weights no hash covered."""
    from edgevlm.runtime import Engine

    dst = _copy(rtn_bundle, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    data = bytearray((dst / "model.safetensors").read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n:] = bytes(len(data) - 8 - n)  # zeroed weights, header intact
    (outside / "model.safetensors").write_bytes(bytes(data))
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": {k: "../outside/model.safetensors" for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model.safetensors.index.json is not listed in manifest.json"):
        Engine.load(dst)
    _relist(dst, "model.safetensors.index.json")  # the manifest edited as well
    with pytest.raises(ModelLoadError, match=r"'../outside/model.safetensors' leaves the bundle"):
        Engine.load(dst)
    with pytest.raises(ModelLoadError, match="leaves the bundle"):
        verify_bundle(dst)


def test_symlink_out_of_the_bundle_is_refused_even_with_the_right_hash(rtn_bundle, tmp_path):
    from edgevlm.runtime import Engine

    dst = _copy(rtn_bundle, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(dst / "tokenizer.json", outside)  # byte-identical: the SHA-256 still matches
    (dst / "tokenizer.json").unlink()
    (dst / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ModelLoadError, match=r"tokenizer.json resolves to .*elsewhere.json, outside the bundle"):
        Engine.load(dst)
    with pytest.raises(ModelLoadError, match="outside the bundle"):
        verify_bundle(dst)
    # a symlink folder out of the bundle (onnx/ -> elsewhere) is refused the same way
    dst2 = tmp_path / "b2"
    shutil.copytree(rtn_bundle.bundle_dir, dst2)
    (tmp_path / "onnx_elsewhere").mkdir()
    (tmp_path / "onnx_elsewhere" / "vision.onnx").write_bytes(b"x")
    (dst2 / "onnx").symlink_to(tmp_path / "onnx_elsewhere")
    with pytest.raises(ModelLoadError, match=r"folder onnx resolves to .*onnx_elsewhere, outside the bundle"):
        verify_bundle(dst2)


def test_unlisted_loaded_file_in_a_bundle_is_refused(rtn_bundle, tmp_path):
    from edgevlm.runtime import Engine

    dst = _copy(rtn_bundle, tmp_path)
    (dst / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # read before tokenizer_config's
    with pytest.raises(ModelLoadError, match=r"chat_template.jinja is not listed in manifest.json"):
        Engine.load(dst)
    (dst / "chat_template.jinja").unlink()
    (dst / "NOTES.txt").write_text("not read by the runtime: only a warning")
    verify_bundle(dst)


def test_checkpoint_folder_symlinks_must_stay_inside(tiny_src, tmp_path):
    from edgevlm.model_folder import check_model_folder
    from edgevlm.runtime import Engine

    model = tmp_path / "model"
    shutil.copytree(tiny_src, model)
    real = tmp_path / "weights.safetensors"
    (model / "model.safetensors").rename(real)
    (model / "model.safetensors").symlink_to(real)
    with pytest.raises(ModelLoadError, match=r"model.safetensors resolves to .*weights.safetensors, outside the "
                                             r"model folder"):
        check_model_folder(model)
    # inside the folder is fine
    (model / "model.safetensors").unlink()
    (model / "weights").mkdir()
    real.rename(model / "weights" / "w.safetensors")
    (model / "model.safetensors").symlink_to(Path("weights") / "w.safetensors")
    assert Engine.load(model).ask(np.zeros((32, 32, 3), np.uint8), "hi", max_new_tokens=1).stats.new_tokens == 1


def test_hugging_face_cache_snapshot_symlinks_are_accepted(tiny_src, tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    from edgevlm.runtime import Engine
    from edgevlm.runtime.bundle import sha256_file

    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_src.iterdir():
        blob = blobs / sha256_file(f)
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert Engine.load(snap).ask(np.zeros((32, 32, 3), np.uint8), "hi", max_new_tokens=1).stats.new_tokens == 1
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").symlink_to(tiny_src / "tokenizer.json")  # outside the repository's blobs
    with pytest.raises(ModelLoadError, match="outside the model folder"):
        Engine.load(snap)


def test_ask_on_a_tampered_bundle_is_one_line(rtn_bundle, tmp_path, capsys):
    from edgevlm.cli import main

    dst = _copy(rtn_bundle, tmp_path)
    (tmp_path / "x.safetensors").write_bytes((dst / "model.safetensors").read_bytes())
    (dst / "model.safetensors").unlink()
    (dst / "model.safetensors").symlink_to(tmp_path / "x.safetensors")
    image = tmp_path / "i.png"
    import cv2

    cv2.imwrite(str(image), np.zeros((32, 32, 3), np.uint8))
    assert main(["ask", "--image", str(image), "--model", str(dst), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgevlm: error: ") and "outside the bundle" in err and "\n" not in err


@pytest.mark.parametrize("damage", ["manifest deleted", "layer kept", "layers emptied"])
def test_int4_weights_the_manifest_does_not_declare_are_named(rtn_bundle, tmp_path, capsys, damage):
    """A bundle copied without manifest.json, or whose manifest no longer lists an INT4 layer as
    INT4 (edited by hand: the manifest hashes the other files, not itself), is refused naming
    that: it was "checkpoint ... has tensors the llava runtime does not know: ...qweight"."""
    from edgevlm.cli import main

    dst = _copy(rtn_bundle, tmp_path)
    raw = json.loads((dst / MANIFEST_NAME).read_text())
    int4 = [d for d in raw["layers"] if d["action"] == "int4"]
    if damage == "manifest deleted":
        (dst / MANIFEST_NAME).unlink()
        needle = "holds INT4 layers (" + min(d["source_key"] for d in int4)
        tail = "but no manifest.json: an engine bundle whose manifest.json is missing"
    else:
        if damage == "layer kept":
            int4[-1]["action"] = "keep"
        else:
            raw["layers"] = []
        (dst / MANIFEST_NAME).write_text(json.dumps(raw))
        needle = "the weights hold INT4 layers that manifest.json does not list as INT4 ("
        needle += int4[-1]["source_key"] if damage == "layer kept" else min(d["source_key"] for d in int4)
        tail = "manifest.json was edited or comes from another build (rebuild the bundle)"
    image = tmp_path / "i.png"
    import cv2

    cv2.imwrite(str(image), np.zeros((32, 32, 3), np.uint8))
    assert main(["ask", "--image", str(image), "--model", str(dst), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgevlm: error: ") and "\n" not in err, err
    assert needle in err and tail in err and "does not know" not in err, err
    if damage == "manifest deleted":  # `serve --check-config` says it too (it passed such a folder)
        cfg = tmp_path / "daemon.yaml"
        cfg.write_text(f"mqtt:\n  host: 127.0.0.1\n  port: 1\nmodel:\n  path: {dst}\nmetrics:\n  listen: null\n")
        assert main(["serve", "--check-config", str(cfg)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("edgevlm: error: model.path: ") and needle in err and tail in err, err


def test_build_refuses_bad_inputs(rtn_bundle, tiny_src, tmp_path):
    with pytest.raises(ConfigError, match=r"exists and is not empty \(choose another --out, or --overwrite to "
                                          r"replace it\)$"):  # was: no word of --overwrite
        build_bundle(tiny_src, rtn_bundle.bundle_dir, RTN)
    a_file = tmp_path / "scene.png"
    a_file.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        build_bundle(tiny_src, a_file, RTN)
    with pytest.raises(ModelLoadError, match="already an engine bundle"):
        build_bundle(rtn_bundle.bundle_dir, tmp_path / "again", RTN)
    with pytest.raises(ModelLoadError, match="does not exist"):
        build_bundle(tmp_path / "nothing", tmp_path / "out", RTN)
    with pytest.raises(ConfigError, match="calibration data"):
        build_bundle(tiny_src, tmp_path / "out", BuildOptions(method="awq", calib=None))
    with pytest.raises(ConfigError, match="group size"):
        build_bundle(tiny_src, tmp_path / "out", BuildOptions(method="rtn", group_size=100))
    with pytest.raises(ConfigError, match="no prompts.txt"):
        (tmp_path / "calib").mkdir()
        import cv2

        cv2.imwrite(str(tmp_path / "calib" / "a.png"), np.zeros((20, 30, 3), np.uint8))
        build_bundle(tiny_src, tmp_path / "out", BuildOptions(method="awq", calib=str(tmp_path / "calib")))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# ------------------------------------------------------------------------------ CLI
def test_cli_builds_with_folder_calibration(tiny_src, tmp_path, capsys):
    import cv2

    from edgevlm.quantize.cli import main

    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        cv2.imwrite(str(calib / f"{i}.png"), rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
    (calib / "prompts.txt").write_text("# comment\nhow many circles are there?\tone\n\nwhat is this?\n")
    rc = main([str(tiny_src), "--out", str(tmp_path / "b"), "--calib", str(calib), "--group-size", "64",
               "--no-onnx", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rule / reason" in out and "peak RAM" in out and "decoder linear weights" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["method"] == "awq" and summary["group_size"] == 64 and summary["int4_layers"] == 14
    assert summary["decoder_linear_ratio"] < 0.30 and summary["peak_rss_mb"] > 0
    assert read_manifest(tmp_path / "b").calibration.samples == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["{src}", "--out", "{tmp}/o", "--method", "rtn", "--profile", "no-such"], "profile 'no-such' not found"),
        (["{src}", "--out", "{tmp}/o"], "AWQ needs calibration data"),
        (["{tmp}/missing", "--out", "{tmp}/o", "--method", "rtn"], "does not exist"),
        (["{src}", "--out", "{tmp}/o", "--calib", "{tmp}/nocalib"], "calibration folder"),
        (["{src}", "--out", "{tmp}/o", "--calib", "{src}/config.json"], "config.json is a file, not a folder"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tiny_src, tmp_path, capsys, args, needle):
    from edgevlm.quantize.cli import main

    argv = [a.format(src=tiny_src, tmp=tmp_path) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgevlm: error:") and needle in err and err.count("\n") == 1


def test_cli_rejects_bad_group_size(tiny_src, tmp_path, capsys):
    from edgevlm.quantize.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(tiny_src), "--out", str(tmp_path / "o"), "--group-size", "100"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_calibration_folder_errors(tmp_path):
    import cv2

    from edgevlm.errors import InvalidImageError
    from edgevlm.quantize.calib import folder_samples

    with pytest.raises(ConfigError, match="has no images"):
        folder_samples(tmp_path)
    cv2.imwrite(str(tmp_path / "a.png"), np.full((20, 30, 3), 200, np.uint8))
    (tmp_path / "prompts.txt").write_text("# only a comment\n\n")
    with pytest.raises(ConfigError, match="has no prompts"):
        folder_samples(tmp_path)
    (tmp_path / "prompts.txt").write_text("what is this?\n")
    (tmp_path / "b.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    with pytest.raises(InvalidImageError, match="b.jpg"):
        folder_samples(tmp_path)
    (tmp_path / "b.jpg").unlink()
    samples = folder_samples(tmp_path)
    assert len(samples) == 1 and samples[0].prompt == "what is this?" and samples[0].image.shape == (20, 30, 3)


@pytest.mark.parametrize("layout", ["transformers5", "legacy"])
def test_other_checkpoint_layouts_shards_and_lm_head(tmp_path, layout):
    from safetensors import safe_open

    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", seed=3, layout=layout, text_hidden=128)
    opts = BuildOptions(method="rtn", onnx=False, lm_head=True, max_shard_mb=0.1)
    res = build_bundle(src, tmp_path / "b", opts)
    index = json.loads((res.bundle_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((res.bundle_dir / s).is_file() for s in shards)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        src_keys = set(f.keys())
    head = "lm_head" if layout == "transformers5" else "language_model.lm_head"
    assert head + ".weight" in src_keys and head + ".qweight" in index["weight_map"]  # source key names kept
    lm = next(d for d in res.manifest.layers if d.name == "language_model.lm_head")
    assert lm.action == "int4" and lm.method == "rtn"
    engine = Engine.load(res.bundle_dir)
    assert sum(isinstance(m, Int4Linear) for m in engine.backend.model.modules()) == 15
    assert engine.ask(np.zeros((32, 32, 3), np.uint8), "what is this?", max_new_tokens=2).stats.new_tokens >= 1


def test_calibration_outputs_of_the_source_are_not_copied(tmp_path):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", seed=4)
    (src / "exits.json").write_text("{}")  # fingerprinted to the 16-bit weights: would not load
    (src / "exits.safetensors").write_bytes(b"x")
    (src / "frontier.json").write_text("{}")
    (src / "notes.txt").write_text("kept")
    res = build_bundle(src, tmp_path / "b", RTN)
    names = {f.path for f in res.manifest.files}
    assert "notes.txt" in names and not names & {"exits.json", "exits.safetensors", "frontier.json"}
    assert "edgevlm calibrate" in res.manifest.artifacts["calibration"]
    Engine.load(res.bundle_dir)
