"""The ViT geometry keys every CLIP-style tower reads through one parser
(:func:`edgevlm.runtime.models.blocks.vit_config.parse_vit_geometry`): LLaVA's CLIP, SigLIP and
InternViT name the bad key the same way and keep their own defaults."""

import re

import pytest

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.models.blocks.siglip_config import parse_siglip_vision_config
from edgevlm.runtime.models.internvl.config import InternVisionConfig
from edgevlm.runtime.models.internvl.config import _vision_config as internvl_vision_config
from edgevlm.runtime.models.llava.config import VisionConfig
from edgevlm.runtime.models.llava.config import _vision_config as llava_vision_config

PARSERS = {
    "clip": lambda vc: llava_vision_config({"model_type": "clip_vision_model", **vc}),
    "siglip": lambda vc: parse_siglip_vision_config({"model_type": "siglip_vision_model", **vc}),
    "internvit": lambda vc: internvl_vision_config({"model_type": "internvl_vision", **vc}),
}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "image_size": 56, "patch_size": 14}


@pytest.mark.parametrize("tower", sorted(PARSERS))
@pytest.mark.parametrize(("patch", "message"), [
    ({"hidden_size": "64"}, "vision_config.hidden_size has type str"),
    ({"layer_norm_eps": "1e-6"}, "vision_config.layer_norm_eps has type str"),
    ({"hidden_act": "swish"}, "vision_config.hidden_act 'swish' is not supported"),
    ({"num_attention_heads": 0}, "vision_config.num_attention_heads must be positive, got 0"),
    ({"num_channels": -3}, "vision_config.num_channels must be positive, got -3"),
    ({"num_attention_heads": 5}, "vision_config.hidden_size is not a multiple of num_attention_heads"),
])
def test_bad_geometry_names_the_key(tower, patch, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        PARSERS[tower]({**SMALL, **patch})


@pytest.mark.parametrize("tower", sorted(PARSERS))
def test_geometry_is_read_and_derived_alike(tower):
    cfg = PARSERS[tower]({**SMALL, "layer_norm_eps": 1})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.grid_side) == (64, 4, 16, 4)
    assert cfg.layer_norm_eps == 1.0 and isinstance(cfg.layer_norm_eps, float)


def test_each_tower_keeps_its_own_defaults():
    clip, intern = PARSERS["clip"]({}), PARSERS["internvit"]({})
    assert clip == VisionConfig() and (clip.patch_size, clip.hidden_act, clip.layer_norm_eps) == (32, "quick_gelu", 1e-5)
    assert intern == InternVisionConfig() and (intern.image_size, intern.patch_size, intern.hidden_size) == (448, 14, 1024)
    siglip = PARSERS["siglip"]({})
    assert (siglip.patch_size, siglip.hidden_act, siglip.vision_use_head) == (16, "gelu_pytorch_tanh", True)
    assert PARSERS["internvit"]({"image_size": [56, 56], "patch_size": [14, 14]}).grid_side == 4
