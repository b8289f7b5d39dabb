"""Every family reads its special token ids through one reader (:func:`edgevlm.runtime.config.token_id`):
a value that is not an int below the decoder's vocab_size is refused naming the key."""

import re

import pytest

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.models.internvl.config import parse_config as internvl
from edgevlm.runtime.models.llava.config import parse_config as llava
from edgevlm.runtime.models.smolvlm.config import parse_config as smolvlm

VISION = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
          "image_size": 56, "patch_size": 14}
RAW = {
    "llava": (llava, {"model_type": "llava", "vision_config": VISION, "text_config": {"vocab_size": 200}}),
    "internvl": (internvl, {"model_type": "internvl", "vision_config": VISION, "text_config": {"vocab_size": 200}}),
    "smolvlm": (smolvlm, {"model_type": "smolvlm", "vision_config": VISION, "text_config": {"vocab_size": 200}}),
}


@pytest.mark.parametrize("family", sorted(RAW))
@pytest.mark.parametrize("bad", [200, -1, "7", True, 7.0])
def test_bad_image_token_id_names_the_key_and_vocab(family, bad):
    parse, raw = RAW[family]
    with pytest.raises(ModelLoadError, match=re.escape(f"image_token_id {bad!r} is not a token id of the vocabulary "
                                                       "(vocab_size 200)")):
        parse({**raw, "image_token_id": bad})


@pytest.mark.parametrize("family", sorted(RAW))
def test_image_token_id_is_read(family):
    parse, raw = RAW[family]
    assert parse({**raw, "image_token_id": 199}).image_token_id == 199


def test_llava_reads_the_legacy_image_token_index():
    parse, raw = RAW["llava"]
    assert parse({**raw, "image_token_index": 42}).image_token_id == 42
    with pytest.raises(ModelLoadError, match=re.escape("image_token_id 500 is not a token id")):
        parse({**raw, "image_token_index": 500})
