"""Checkpoint metadata that used to crash the loader or be silently ignored (found by trying the CLI):
a zero / negative size, a zero ``num_key_value_heads`` (ZeroDivisionError), a non-object 4.x
``rope_scaling`` (``dict("linear")``), a non-positive ``rms_norm_eps``, and Gemma 3's
``mm_tokens_per_image: 0`` (modulo by zero) were ``internal error: ...`` with exit 1 (or a torch
warning before the error line); a preprocessor_config.json / processor_config.json that is not a JSON
object was ignored. Each is now a :class:`ModelLoadError` naming the key or file, one line, exit 2.

Run: ``.venv/bin/python -m pytest -q tests/runtime/test_config_sizes.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import parse_text_config
from edgevlm.runtime.models.gemma3.config import parse_config as parse_gemma3

DEMO = Path(__file__).resolve().parents[2] / "runtime" / "demo" / "model"


@pytest.mark.parametrize(("key", "value"), [
    ("hidden_size", 0), ("hidden_size", -64), ("intermediate_size", 0), ("intermediate_size", -1),
    ("num_hidden_layers", 0), ("num_attention_heads", 0), ("num_key_value_heads", 0), ("head_dim", 0),
    ("vocab_size", 0), ("max_position_embeddings", -5),
])
def test_non_positive_decoder_size_names_the_key(key, value):
    with pytest.raises(ModelLoadError, match=f"text_config.{key} must be positive, got {value}"):
        parse_text_config({"model_type": "llama", key: value})


@pytest.mark.parametrize("eps", [0.0, -1e-6])
def test_non_positive_rms_norm_eps_is_refused(eps):
    with pytest.raises(ModelLoadError, match="text_config.rms_norm_eps must be positive"):
        parse_text_config({"model_type": "llama", "rms_norm_eps": eps})


@pytest.mark.parametrize("scaling", ["linear", 5, [1, 2]])
def test_rope_scaling_that_is_not_an_object_is_refused(scaling):
    with pytest.raises(ModelLoadError, match="text_config.rope_scaling must be an object or null"):
        parse_text_config({"model_type": "llama", "rope_scaling": scaling})
    # Gemma 3's 4.x layout (rope_theta + rope_scaling for the full layers) reads it itself
    with pytest.raises(ModelLoadError, match="text_config.rope_scaling must be an object or null"):
        parse_gemma3({"model_type": "gemma3", "text_config": {"rope_scaling": scaling}})


def test_rope_scaling_null_or_object_still_loads():
    assert parse_text_config({"model_type": "llama", "rope_scaling": None}).rope_type == "default"
    cfg = parse_text_config({"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 2.0)


@pytest.mark.parametrize("mm", [0, -4, 10**400])
def test_gemma3_mm_tokens_per_image_not_a_pooled_grid(mm):
    with pytest.raises(ModelLoadError, match="mm_tokens_per_image .* is not a square whose side divides"):
        parse_gemma3({"model_type": "gemma3", "mm_tokens_per_image": mm})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_key_value_heads", 0, "text_config.num_key_value_heads must be positive, got 0"),
    ("hidden_size", -256, "text_config.hidden_size must be positive, got -256"),
    ("hidden_size", 0, "text_config.hidden_size must be positive, got 0"),
    ("rope_scaling", "linear", "text_config.rope_scaling must be an object or null, got 'linear'"),
])
def test_bad_size_is_one_line_exit_2_at_the_cli(tmp_path, capsys, key, value, message):
    pytest.importorskip("torch")
    from PIL import Image

    from edgevlm.cli import main

    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder)
    raw = json.loads((folder / "config.json").read_text())
    if key == "rope_scaling":
        raw["text_config"].pop("rope_parameters")
    raw["text_config"][key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    assert main(["ask", "--model", str(folder), "--image", str(image), "hi"]) == 2
    err = capsys.readouterr().err
    assert err == f"edgevlm: error: config.json: {message}\n"


@pytest.mark.parametrize(("name", "text", "kind"), [
    ("preprocessor_config.json", "[]", "an array"), ("preprocessor_config.json", '"x"', "a string"),
    ("processor_config.json", "[1]", "an array"), ("processor_config.json", "5", "a number"),
])
def test_image_processor_file_that_is_not_an_object_is_refused(tmp_path, capsys, name, text, kind):
    """Was: silently ignored, the model loaded with a WARNING that the checkpoint *has no*
    preprocessor_config.json and ran on default pixels."""
    pytest.importorskip("torch")
    from PIL import Image

    from edgevlm.cli import main
    from edgevlm.runtime.loader import read_model_files

    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder)
    (folder / name).write_text(text)
    with pytest.raises(ModelLoadError, match=f"{name}: expected a JSON object, got {kind}"):
        read_model_files(folder)
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    assert main(["ask", "--model", str(folder), "--image", str(image), "hi"]) == 2
    assert capsys.readouterr().err == f"edgevlm: error: {folder / name}: expected a JSON object, got {kind}\n"
