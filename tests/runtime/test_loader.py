"""Checkpoint loading: key layouts, shards, and every ModelLoadError path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from edgevlm.errors import InvalidRequestError, ModelLoadError  # noqa: E402
from edgevlm.runtime.loader import load_model, read_model_files  # noqa: E402
from edgevlm.runtime.testing import LAYOUTS, write_tiny_checkpoint  # noqa: E402


def _logits(model_dir, dtype=torch.float32):
    model = load_model(read_model_files(model_dir), device=torch.device("cpu"), dtype=dtype, max_seq_len=64)
    ids = torch.tensor([[1, 9, 10] + [4] * 8 + [11, 12]])
    pixels = torch.randn(1, 3, 32, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return model(ids, pixels)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_key_layout_loads_to_identical_logits(tmp_path, layout, tiny_dir):
    ckpt = write_tiny_checkpoint(tmp_path / layout, seed=0, resolution_ladder=[32, 64], layout=layout)
    with open(ckpt / "model.safetensors", "rb") as f:
        header = f.read(4096)
    marker = {"save_pretrained": b'"vision_tower.embeddings.', "transformers5": b'"model.language_model.',
              "legacy": b'"vision_tower.vision_model.'}[layout]
    assert marker in header
    assert torch.equal(_logits(ckpt), _logits(tiny_dir))


def test_legacy_layout_resaved_from_transformers_checkpoint(tmp_path, hf_builder):
    """A transformers-built checkpoint with its keys renamed to the 4.x layout and re-saved."""
    from safetensors.torch import load_file, save_file

    src = hf_builder(tmp_path / "hf", feature_layer=-2, strategy="default", kv_heads=2, tie=False)
    tensors = load_file(src / "model.safetensors")
    legacy = {}
    for key, t in tensors.items():
        key = key.removeprefix("model.")
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            key = "vision_tower.vision_model." + key[len("vision_tower."):]
        if key.startswith("language_model.") and not key.startswith(("language_model.model.", "language_model.lm_head")):
            key = "language_model.model." + key[len("language_model."):]
        if key.startswith("lm_head."):
            key = "language_model." + key
        legacy[key] = t
    assert "language_model.lm_head.weight" in legacy and "vision_tower.vision_model.pre_layrnorm.weight" in legacy
    dst = tmp_path / "legacy"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(legacy, dst / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(_logits(dst), _logits(src))


def test_sharded_checkpoint_loads(copy_dir, tiny_dir):
    from safetensors.torch import load_file, save_file

    ckpt = copy_dir(tiny_dir)
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, ckpt / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in ks})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_logits(ckpt), _logits(tiny_dir))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        read_model_files(ckpt)


def test_bf16_load_on_cpu_is_close_to_fp32(tiny_dir):
    ref, out = _logits(tiny_dir), _logits(tiny_dir, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - ref).abs().max() / ref.abs().max()) < 0.05


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(copy_dir, tiny_dir, missing):
    from edgevlm.runtime import Engine

    ckpt = copy_dir(tiny_dir)
    (ckpt / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing):
        Engine.load(ckpt)


def test_missing_folder(tmp_path):
    from edgevlm.runtime import Engine

    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.load(tmp_path / "nope")


def test_pickle_weights_are_refused(copy_dir, tiny_dir):
    ckpt = copy_dir(tiny_dir)
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*only safetensors"):
        read_model_files(ckpt)


def test_missing_tensor_is_named(copy_dir, tiny_dir):
    from safetensors.torch import load_file, save_file

    ckpt = copy_dir(tiny_dir)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["language_model.model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        _logits(ckpt)


def test_wrong_shape_and_unknown_tensor(copy_dir, tiny_dir):
    from safetensors.torch import load_file, save_file

    ckpt = copy_dir(tiny_dir)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["language_model.model.norm.weight"] = torch.ones(7)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"norm\.weight has shape \(7,\)"):
        _logits(ckpt)
    del tensors["language_model.model.norm.weight"]
    tensors["language_model.model.norm.weight"] = torch.ones(64)
    tensors["something.else"] = torch.ones(3)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match="something.else"):
        _logits(ckpt)


def test_corrupt_safetensors(copy_dir, tiny_dir):
    ckpt = copy_dir(tiny_dir)
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        _logits(ckpt)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(model_type="llava_next"), r"model_type 'llava_next' is not supported; supported: llava \(llava\)"),
        (lambda c: c.pop("text_config"), "text_config"),
        (lambda c: c["text_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
         "rope_type 'yarn' is not supported"),
        (lambda c: c["text_config"].update(rope_scaling={"type": "longrope", "factor": 2.0}, rope_parameters=None),
         "rope_type 'longrope' is not supported"),
        (lambda c: c["vision_config"].update(model_type="pixtral"), "vision_config.model_type .pixtral. is not supported"),
        (lambda c: c.update(vision_feature_layer=9), "vision_feature_layer"),
        (lambda c: c.update(vision_feature_select_strategy="cls"), "vision_feature_select_strategy"),
        (lambda c: c["text_config"].update(hidden_size="64"), "text_config.hidden_size"),
        (lambda c: c.update(edgevlm={"resolution_ladder": [64, -1]}), "resolution_ladder"),
    ],
)
def test_bad_config_is_refused_with_the_key(copy_dir, tiny_dir, edit, message):
    ckpt = copy_dir(tiny_dir)
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        read_model_files(ckpt)


def test_legacy_rope_theta_key_is_read(copy_dir, tiny_dir):
    ckpt = copy_dir(tiny_dir)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["text_config"]["rope_parameters"]
    cfg["text_config"]["rope_theta"] = 123.0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert read_model_files(ckpt).config.text.rope_theta == 123.0


def test_invalid_json_is_named(copy_dir, tiny_dir):
    ckpt = copy_dir(tiny_dir)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        read_model_files(ckpt)


def test_bad_load_arguments(tiny_dir):
    from edgevlm.runtime import Engine

    with pytest.raises(InvalidRequestError, match="dtype"):
        Engine.load(tiny_dir, dtype="int8")
    with pytest.raises(InvalidRequestError, match="unknown backend 'tflite'"):
        Engine.load(tiny_dir, backend="tflite")
    with pytest.raises(InvalidRequestError, match="device"):
        Engine.load(tiny_dir, device="tpu")
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        Engine.load(tiny_dir, max_seq_len=0)
    # was: loaded and ran in float32 without a word (the ONNX graphs compute in float32)
    with pytest.raises(InvalidRequestError, match=r"^dtype: backend 'onnx' runs float32 only \(.*\), got 'bfloat16'"):
        Engine.load(tiny_dir, backend="onnx", dtype=torch.bfloat16)
    with pytest.raises(InvalidRequestError, match=r"^device: backend 'tensorrt' needs a CUDA device, got 'cpu'$"):
        Engine.load(tiny_dir, backend="tensorrt")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            Engine.load(tiny_dir, device="cuda")


def test_runtime_package_import_is_lazy():
    code = "import sys, edgevlm.runtime; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_backend_import_errors_name_the_extra(tmp_path, monkeypatch, tiny_dir):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.backends import BACKENDS

    (tmp_path / "edgevlm_test_backend_missing_dep.py").write_text("import edgevlm_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "needs-dep", ("edgevlm_test_backend_missing_dep", "onnx"))
    monkeypatch.setitem(BACKENDS, "absent", ("edgevlm.runtime.backends.absent_backend", "onnx"))
    with pytest.raises(ModelLoadError, match=r"pip install 'edgevlm\[onnx\]'"):
        Engine.load(tiny_dir, backend="needs-dep")
    with pytest.raises(ModelLoadError, match="not part of this edgevlm build"):
        Engine.load(tiny_dir, backend="absent")
