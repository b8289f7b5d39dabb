"""The checks Qwen2.5-VL's and Qwen3-VL's vision configs share (:mod:`edgevlm.runtime.models.qwen_vl.config`)
and the typed reader's message (:func:`edgevlm.runtime.config.get_typed`)."""

import re

import pytest

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import get_typed
from edgevlm.runtime.models.qwen_vl.config import check_rotary_heads, vision_rope_theta


@pytest.mark.parametrize(("vc", "message"), [
    ({"rope_parameters": [1]}, "vision_config.rope_parameters must be an object"),
    ({"rope_parameters": {"rope_type": "default"}}, "vision_config.rope_parameters.rope_type 'default' is not "
                                                    "supported (axial)"),
    ({"rope_parameters": {"rope_theta": 0}}, "vision_config.rope_parameters.rope_theta must be a positive number, got 0"),
    ({"rope_parameters": {"rope_theta": "1e4"}}, "rope_theta must be a positive number, got '1e4'"),
    ({"rope_parameters": {"rope_theta": True}}, "rope_theta must be a positive number, got True"),
])
def test_bad_vision_rope_names_the_key(vc, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        vision_rope_theta(vc, 10000.0)


def test_vision_rope_theta_is_read_or_defaulted():
    assert vision_rope_theta({}, 10000.0) == 10000.0
    assert vision_rope_theta({"rope_parameters": {"rope_type": "axial", "rope_theta": 500}}, 10000.0) == 500.0


@pytest.mark.parametrize(("hidden", "heads"), [(64, 3), (56, 4), (40, 4)])
def test_heads_that_do_not_split_in_four_are_refused(hidden, heads):
    with pytest.raises(ModelLoadError, match=re.escape("vision_config.hidden_size / num_heads must be a multiple of 4")):
        check_rotary_heads(hidden, heads)
    check_rotary_heads(64, 4)  # head_dim 16


def test_typed_reader_names_the_expected_type():
    with pytest.raises(ModelLoadError, match=re.escape("config.json: vision_config.depth has type str, expected int")):
        get_typed({"depth": "4"}, "depth", 2, int, "vision_config.")
    with pytest.raises(ModelLoadError, match=re.escape("eps has type str, expected int or float")):
        get_typed({"eps": "x"}, "eps", 1.0, (int, float), "")
    assert get_typed({"eps": 1}, "eps", 0.5, float, "") == 1.0 and get_typed({}, "depth", 2, int, "") == 2
