"""The resample / image_mean / image_std keys both tiling processors (SmolVLM, InternVL) read through
one reader (:func:`edgevlm.runtime.models.blocks.pil_tiles.read_pil_settings`): bad values name the key."""

import re

import numpy as np
import pytest

from edgevlm.errors import InvalidImageError, ModelLoadError
from edgevlm.runtime.models.internvl import config as internvl_config
from edgevlm.runtime.models.internvl import processor as internvl_processor
from edgevlm.runtime.models.smolvlm import config as smolvlm_config
from edgevlm.runtime.models.smolvlm import processor as smolvlm_processor

VISION = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
          "image_size": 56, "patch_size": 14}
FAMILIES = {
    "internvl": (internvl_processor, internvl_config.parse_config(
        {"model_type": "internvl", "vision_config": VISION, "text_config": {}}), {"size": {"height": 56, "width": 56}}),
    "smolvlm": (smolvlm_processor, smolvlm_config.parse_config(
        {"model_type": "smolvlm", "vision_config": VISION, "text_config": {"vocab_size": 200}, "image_token_id": 100}),
        {"max_image_size": {"longest_edge": 56}}),
}
PROCESSORS = {"internvl": internvl_processor.InternVLProcessor, "smolvlm": smolvlm_processor.SmolVLMProcessor}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("patch", "message"), [
    ({"resample": 9}, "image processor config: resample 9 is not a Pillow filter code"),
    ({"image_std": [0.5, 0, 0.5]}, "image processor config: image_std must not contain 0"),
    ({"image_mean": [0.5, 0.5]}, "image processor config: image_mean must be a list of 3 numbers, got [0.5, 0.5]"),
    ({"image_std": "0.5"}, "image processor config: image_std must be a list of 3 numbers, got '0.5'"),
])
def test_bad_pil_setting_names_the_key(family, patch, message, tmp_path):
    module, cfg, base = FAMILIES[family]
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        module.read_image_processor_config({**base, **patch}, tmp_path, cfg)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pil_settings_are_read(family, tmp_path):
    module, cfg, base = FAMILIES[family]
    ic = module.read_image_processor_config({**base, "resample": 2, "image_mean": 0.25, "image_std": [1, 2, 4]},
                                            tmp_path, cfg)
    assert (ic.resample, ic.image_mean, ic.image_std) == (2, (0.25, 0.25, 0.25), (1.0, 2.0, 4.0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("image", "message"), [
    (np.zeros((8, 8), np.uint8), "image must be an (H, W, 3) uint8 RGB array, got (8, 8) uint8"),
    (np.zeros((8, 8, 3), np.float32), "image must be an (H, W, 3) uint8 RGB array, got (8, 8, 3) float32"),
    ([[0, 0, 0]], "image must be an (H, W, 3) uint8 RGB array, got None list"),
    (np.zeros((0, 8, 3), np.uint8), "image has zero size 0x8"),
])
def test_a_bad_image_is_refused_before_tiling(family, image, message, tmp_path):
    module, cfg, base = FAMILIES[family]
    processor = PROCESSORS[family](cfg, module.read_image_processor_config(base, tmp_path, cfg))
    with pytest.raises(InvalidImageError, match=re.escape(message)):
        processor.preprocess_image(image)
    tiles = processor.preprocess_image(np.asfortranarray(np.full((56, 56, 3), 255, np.uint8)))
    x = tiles[0] if family == "internvl" else tiles.pixel_values
    assert x.shape[-3:] == (3, 56, 56) and np.isfinite(x).all()
