"""The shipped demo model: files, format, size, and real answers through our runtime."""

from __future__ import annotations

import json
import re

import pytest

from edgevlm.runtime.demo import model_dir, scenes

# The shipped weights answer 8 of the first 18 held-out items right at the top rung (see
# runtime/demo/model/README.md); raise this when better weights are shipped.
MIN_RIGHT_OF_18 = 16

ANSWER_FORMS = {
    "count_total": re.compile(r"[0-9]"),
    "count_colour": re.compile(r"[0-9]"),
    "count_shape": re.compile(r"[0-9]"),
    "colour": re.compile("|".join(scenes.COLOURS)),
    "shape": re.compile("|".join(scenes.SHAPES)),
    "presence": re.compile("yes|no"),
    "position_lr": re.compile("left|right"),
    "position_tb": re.compile("top|bottom"),
}
_ITEM = f"(small|large) ({'|'.join(scenes.COLOURS)}) ({'|'.join(scenes.SHAPES)})"
ANSWER_FORMS["describe"] = re.compile(f"{_ITEM}( and {_ITEM})*")


def test_shipped_files_and_format():
    d = model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file(), name
    assert (d / "model.safetensors").stat().st_size <= 20_000_000
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llava" and cfg["vision_config"]["model_type"] == "clip_vision_model"
    assert cfg["text_config"]["model_type"] == "llama"
    assert cfg["vision_config"]["patch_size"] == 16 and cfg["vision_config"]["image_size"] == 384
    assert cfg["vision_feature_layer"] == -1 and cfg["vision_feature_select_strategy"] == "default"
    assert cfg["text_config"]["num_key_value_heads"] < cfg["text_config"]["num_attention_heads"]
    assert cfg["edgevlm"] == {"resolution_ladder": [384, 256, 192, 128]}
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "<image>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "</s>"


@pytest.fixture(scope="module")
def engine():
    from edgevlm.runtime import Engine

    return Engine.load()  # None = the shipped demo model


def test_engine_loads_the_shipped_model_by_default(engine):
    assert engine.model_dir.resolve() == model_dir().resolve()
    assert sorted(engine.resolution_ladder) == [128, 192, 256, 384]
    assert engine.patch_size_px == 16


def test_shipped_model_answers_held_out_questions(engine):
    items = scenes.eval_set(18, seed=1000)
    right = 0
    for it in items:
        text = engine.ask(it.image, it.qa.question, max_new_tokens=24).text.strip()
        assert ANSWER_FORMS[it.qa.kind].fullmatch(text), (it.qa.question, text)
        right += text == it.qa.answer
    assert right >= MIN_RIGHT_OF_18
