"""SigLIP vision block (edgevlm.runtime.models.blocks.siglip) against transformers' SiglipVisionModel, fp32.

A tiny random SiglipVisionModel is saved with ``save_pretrained`` and read back by name through the
block's ``WEIGHT_RULES``; last hidden state, every per-layer hidden state and the pooled output must
agree within 1e-4 relative (max abs error / max abs reference)."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from parity_support import map_checkpoint  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from edgevlm.errors import ModelLoadError  # noqa: E402
from edgevlm.runtime.models.blocks.siglip import WEIGHT_RULES, SiglipVisionTransformer  # noqa: E402
from edgevlm.runtime.models.blocks.siglip_config import parse_siglip_vision_config  # noqa: E402

TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _map(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return map_checkpoint(state, WEIGHT_RULES)


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    """(reference SiglipVisionModel, its raw config dict, its saved state) — image_size 60, patch 14:
    not a multiple, floored to a 4 x 4 grid as transformers does."""
    torch.manual_seed(0)
    hc = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, image_size=60, patch_size=14)
    ref = transformers.SiglipVisionModel(hc).eval()
    folder = tmp_path_factory.mktemp("siglip")
    ref.save_pretrained(folder)
    import json

    raw = json.loads((folder / "config.json").read_text())
    return ref, raw, load_file(str(folder / "model.safetensors"))


def _ours(raw: dict, state: dict, num_blocks: int | None = None) -> SiglipVisionTransformer:
    model = SiglipVisionTransformer(parse_siglip_vision_config(raw), num_blocks=num_blocks).eval()
    wanted = model.state_dict().keys()
    model.load_state_dict({k: v for k, v in _map(state).items() if k in wanted}, strict=True)
    return model


@pytest.mark.parametrize(("size", "interpolate"), [((60, 60), False), ((56, 98), True), ((70, 70), True),
                                                   ((64, 60), True)])
def test_matches_transformers(siglip, size, interpolate):
    ref, raw, state = siglip
    ours = _ours(raw, state)
    torch.manual_seed(1)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        r = ref(x, interpolate_pos_encoding=interpolate, output_hidden_states=True)
        o = ours(x, interpolate_pos_encoding=interpolate, output_hidden_states=True)
    assert o.last_hidden_state.shape == r.last_hidden_state.shape
    assert _rel(o.last_hidden_state, r.last_hidden_state) <= TOL
    assert _rel(o.pooler_output, r.pooler_output) <= TOL
    assert len(o.hidden_states) == len(r.hidden_states) == 4
    for a, b in zip(o.hidden_states, r.hidden_states, strict=True):
        assert _rel(a, b) <= TOL


def test_floored_grid(siglip):
    _, raw, _ = siglip
    cfg = parse_siglip_vision_config(raw)
    assert (cfg.grid_side, cfg.num_positions) == (4, 16)  # 60 // 14


def test_truncated_tower_matches_hidden_state(siglip):
    """LLaVA reads layer -2: a tower built with 2 of 3 blocks gives transformers' hidden_states[2]."""
    ref, raw, state = siglip
    ours = _ours(raw, state, num_blocks=2)
    assert ours.post_layernorm is None and ours.head is None
    x = torch.randn(1, 3, 60, 60)
    with torch.no_grad():
        r = ref(x, output_hidden_states=True)
        o = ours(x, output_hidden_states=True)
    assert o.last_hidden_state is None and len(o.hidden_states) == 3
    assert _rel(o.hidden_states[2], r.hidden_states[2]) <= TOL


def test_legacy_prefixed_names_map(siglip):
    _, raw, state = siglip
    legacy = {"vision_model." + k: v for k, v in state.items()}
    legacy["vision_model.embeddings.position_ids"] = torch.arange(16)[None]
    mapped = _map(legacy)
    assert set(mapped) == set(state)


def test_grid_mismatch_without_interpolation_is_value_error(siglip):
    _, raw, state = siglip
    ours = _ours(raw, state)
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        ours(torch.randn(1, 3, 56, 98))


def test_input_smaller_than_a_patch_is_value_error(siglip):
    _, raw, state = siglip
    ours = _ours(raw, state)
    with pytest.raises(ValueError, match="smaller than one 14x14 patch"):
        ours(torch.randn(1, 3, 10, 60), interpolate_pos_encoding=True)


@pytest.mark.parametrize(("patch", "message"), [
    ({"hidden_size": "64"}, "vision_config.hidden_size has type str"),
    ({"hidden_act": "swish"}, "vision_config.hidden_act 'swish' is not supported"),
    ({"num_attention_heads": 5}, "hidden_size is not a multiple of num_attention_heads"),
    ({"patch_size": 0}, "vision_config.patch_size must be positive"),
    ({"model_type": "clip_vision_model"}, "vision_config.model_type 'clip_vision_model' is not supported"),
])
def test_bad_config_names_the_key(siglip, patch, message):
    _, raw, _ = siglip
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        parse_siglip_vision_config({**raw, **patch})
