"""Exit heads: file format, loading errors, early exit in the real engine (features checked against a
manual computation with the model's own modules), per-sample exits in a batch, the classifier."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError
from edgevlm.types import OperatingPoint

torch = pytest.importorskip("torch")

from edgevlm.runtime.exits import (  # noqa: E402
    EXITS_JSON,
    EXITS_WEIGHTS,
    ExitHeads,
    load_exit_heads,
    make_spec,
    read_spec,
)
from edgevlm.runtime.loader import read_model_files  # noqa: E402
from edgevlm.runtime.preprocess import CLIP_MEAN, CLIP_STD, preprocess  # noqa: E402

PROMPT = "what color is the circle ?"


def _pixels(image, res=64):
    return torch.from_numpy(preprocess(image, res, 16, CLIP_MEAN, CLIP_STD))[None]


def _grid(pixels):
    return pixels.shape[-2] // 16, pixels.shape[-1] // 16


def _states(model, pixels):
    enc = model.vision_tower.encoder
    x = enc.pre_layrnorm(enc.embeddings(pixels))
    out = [x]
    for blk in enc.layers:
        x = blk(x)
        out.append(x)
    return out


# ------------------------------------------------------------------------------------ format


def test_make_spec_checks_blocks(exit_engine):
    cfg = exit_engine.config
    spec = make_spec(cfg, exit_blocks=[1, 3], labels=["a"])
    assert spec.classifier_blocks == [1, 3, 4] and spec.feature_dim == 32 and spec.vision_blocks == 4
    for bad in ([], [2, 1], [0, 1], [4], [1, 1]):
        with pytest.raises(ValueError, match="exit blocks"):
            make_spec(cfg, exit_blocks=bad, labels=[])


def test_round_trip(exit_model_dir, exit_engine):
    spec = read_spec(exit_model_dir)
    assert spec.exit_blocks == [1, 2] and spec.labels == ["red", "green", "blue"]
    heads = load_exit_heads(exit_model_dir, exit_engine.config)
    from safetensors.torch import load_file

    saved = load_file(str(exit_model_dir / EXITS_WEIGHTS))
    assert set(saved) == set(heads.state_dict())
    for k, v in heads.state_dict().items():
        assert saved[k].dtype == torch.float16 and torch.equal(v, saved[k].float()), k
    assert exit_engine.exit_points == [1, 2] and exit_engine.labels == ["red", "green", "blue"]


def test_no_heads_is_none(plain_model_dir, plain_engine):
    assert load_exit_heads(plain_model_dir, plain_engine.config) is None
    assert plain_engine.exit_points == [] and plain_engine.labels == []


@pytest.fixture
def broken_dir(tmp_path, exit_model_dir):
    d = tmp_path / "m"
    shutil.copytree(exit_model_dir, d)
    return d


def test_bad_json(broken_dir, exit_engine):
    (broken_dir / EXITS_JSON).write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_exit_heads(broken_dir, exit_engine.config)


def test_unknown_key(broken_dir, exit_engine):
    raw = json.loads((broken_dir / EXITS_JSON).read_text())
    raw["colour"] = 1
    (broken_dir / EXITS_JSON).write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="colour: unknown key"):
        load_exit_heads(broken_dir, exit_engine.config)


def test_heads_of_another_model(broken_dir, exit_engine):
    raw = json.loads((broken_dir / EXITS_JSON).read_text())
    raw["vision_hidden_size"] = 64
    (broken_dir / EXITS_JSON).write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="vision_hidden_size is 64 but the model has 32"):
        load_exit_heads(broken_dir, exit_engine.config)


def test_exit_block_out_of_range(broken_dir, exit_engine):
    raw = json.loads((broken_dir / EXITS_JSON).read_text())
    raw["exit_blocks"] = [1, 4]
    (broken_dir / EXITS_JSON).write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="exit_blocks"):
        load_exit_heads(broken_dir, exit_engine.config)


def test_missing_and_misshapen_tensors(broken_dir, exit_engine):
    from safetensors.torch import load_file, save_file

    state = load_file(str(broken_dir / EXITS_WEIGHTS))
    dropped = dict(state)
    dropped.pop("adapters.2.fc1.weight")
    save_file(dropped, str(broken_dir / EXITS_WEIGHTS))
    with pytest.raises(ModelLoadError, match="missing tensors adapters.2.fc1.weight"):
        load_exit_heads(broken_dir, exit_engine.config)
    bad = dict(state)
    bad["confidence.1.fc2.weight"] = torch.zeros(2, 16)
    save_file(bad, str(broken_dir / EXITS_WEIGHTS))
    with pytest.raises(ModelLoadError, match=r"confidence.1.fc2.weight has shape \(2, 16\)"):
        load_exit_heads(broken_dir, exit_engine.config)
    (broken_dir / EXITS_WEIGHTS).write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="cannot read exit heads"):
        load_exit_heads(broken_dir, exit_engine.config)


def test_engine_load_fails_on_broken_heads(broken_dir):
    from edgevlm.runtime import Engine

    (broken_dir / EXITS_JSON).write_text("[]")
    with pytest.raises(ModelLoadError, match=EXITS_JSON):
        Engine.load(broken_dir)


# ------------------------------------------------------------------------------- early exit


@pytest.mark.parametrize("block", [1, 2])
def test_forced_exit_features_match_manual(exit_engine, frames, block):
    model = exit_engine.backend.model
    px = _pixels(frames[0])
    with torch.inference_mode():
        states = _states(model, px)
        want = model.vision_tower.projector(model.exit_heads.adapt(block, states[block])[:, 1:])
        got = exit_engine.backend.encode_image(px, operating_point=OperatingPoint(exit_layer=block))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    info = exit_engine.backend.last_vision_info
    assert info.exit_layers == [block] and info.blocks_run == block and info.tokens_kept == 12  # 48x64 px: 3 x 4 patches
    assert info.exit_confidences == [None]  # a forced exit consults no confidence head (none reported)


def test_full_depth_equals_plain_forward(exit_engine, frames):
    model = exit_engine.backend.model
    px = _pixels(frames[1])
    with torch.inference_mode():
        want = model.encode_image(px)
        got = exit_engine.backend.encode_image(px, operating_point=OperatingPoint(exit_threshold=1.0))
    conf = exit_engine.backend.last_vision_info.exit_confidences[0]
    assert conf < 1.0  # a sigmoid never reaches 1.0 here: the encoder ran to the end
    assert exit_engine.backend.last_vision_info.exit_layers == [None]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_threshold_picks_first_confident_exit(exit_engine, frames):
    model = exit_engine.backend.model
    px = _pixels(frames[2])
    with torch.inference_mode():
        states = _states(model, px)
        c1 = float(model.exit_heads.confidence_at(1, states[1], _grid(px))[0])
        c2 = float(model.exit_heads.confidence_at(2, states[2], _grid(px))[0])
    cases = [(0.0, 1)]
    if c2 > c1:
        cases.append(((c1 + c2) / 2, 2))  # block 1 below, block 2 above
    cases.append((max(c1, c2) + 1e-4, None))
    for threshold, expected in cases:
        a = exit_engine.ask(frames[2], PROMPT, max_new_tokens=3,
                            operating_point=OperatingPoint(name="t", exit_threshold=threshold))
        assert a.stats.exit_layer == expected, (threshold, c1, c2)
        assert a.stats.operating_point == "t"
    # exit_layer caps the exit points consulted: threshold 0 with exit_layer 2 still exits at 1
    a = exit_engine.ask(frames[2], PROMPT, max_new_tokens=3,
                        operating_point=OperatingPoint(exit_threshold=0.0, exit_layer=2))
    assert a.stats.exit_layer == 1


def test_answers_differ_only_through_features(exit_engine, frames):
    """Full-depth answers are unchanged by exit heads being loaded; exit answers are reproducible."""
    plain = exit_engine.ask(frames[0], PROMPT, max_new_tokens=5)
    deep = exit_engine.ask(frames[0], PROMPT, max_new_tokens=5, operating_point=OperatingPoint(exit_layer=4))
    assert deep.text == plain.text and deep.stats.exit_layer is None
    e1 = exit_engine.ask(frames[0], PROMPT, max_new_tokens=5, operating_point=OperatingPoint(exit_layer=1))
    e1b = exit_engine.ask(frames[0], PROMPT, max_new_tokens=5, operating_point=OperatingPoint(exit_layer=1))
    assert e1.text == e1b.text and e1.stats.exit_layer == 1


def test_batch_exits_per_sample(exit_engine, frames):
    from edgevlm.runtime.vision import encode_adaptive

    model = exit_engine.backend.model
    px = torch.cat([_pixels(frames[0]), _pixels(frames[1])])
    with torch.inference_mode():
        states = _states(model, px)
        c1 = model.exit_heads.confidence_at(1, states[1], _grid(px))
        assert abs(float(c1[0] - c1[1])) > 1e-4
        threshold = float(c1.mean())
        feats, info = encode_adaptive(model.vision_tower, px, exit_heads=model.exit_heads, exit_threshold=threshold,
                                      exit_layer=1)
        solo = [encode_adaptive(model.vision_tower, px[i : i + 1], exit_heads=model.exit_heads,
                                exit_threshold=threshold, exit_layer=1)[0] for i in range(2)]
    hi = int(c1.argmax())
    assert info.exit_layers[hi] == 1 and info.exit_layers[1 - hi] is None
    torch.testing.assert_close(feats, torch.cat(solo), rtol=1e-5, atol=1e-6)


def test_exit_errors(exit_engine, plain_engine, frames):
    with pytest.raises(InvalidRequestError, match="exit_layer 3 is not an exit point"):
        exit_engine.ask(frames[0], PROMPT, operating_point=OperatingPoint(exit_layer=3))
    with pytest.raises(InvalidRequestError, match="no exit heads"):
        plain_engine.ask(frames[0], PROMPT, operating_point=OperatingPoint(exit_threshold=0.5))
    with pytest.raises(InvalidRequestError, match="no exit heads"):
        plain_engine.ask(frames[0], PROMPT, operating_point=OperatingPoint(exit_layer=1))
    # full depth asked explicitly is fine without heads
    a = plain_engine.ask(frames[0], PROMPT, max_new_tokens=2, operating_point=OperatingPoint(exit_layer=4))
    assert a.stats.exit_layer is None


# ------------------------------------------------------------------------------- classifier


def test_classify_matches_manual(exit_engine, frames):
    model = exit_engine.backend.model
    for block in (None, 1, 2, 4):
        got = exit_engine.classify(frames[1], resolution_px=32, block=block)
        with torch.inference_mode():
            px = _pixels(frames[1], 32)
            states = _states(model, px)
            want = model.exit_heads.classify(block or 1, states[block or 1], _grid(px))[0]
        assert list(got) == ["red", "green", "blue"]
        np.testing.assert_allclose(list(got.values()), want.tolist(), rtol=1e-5, atol=1e-6)


def test_classify_errors(exit_engine, plain_engine, frames):
    with pytest.raises(InvalidRequestError, match="no classifier after block 3"):
        exit_engine.classify(frames[0], block=3)
    with pytest.raises(InvalidRequestError, match="no exit classifier"):
        plain_engine.classify(frames[0])
    with pytest.raises(InvalidImageError):
        exit_engine.classify(np.zeros((4, 4), np.uint8))


def test_heads_module_shapes(exit_engine):
    heads = ExitHeads(make_spec(read_model_files(exit_engine.model_dir).config, exit_blocks=[2], labels=[]))
    heads.adapters["2"].reset_to_identity()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(heads.adapt(2, x), x)  # identity at initialisation
    assert heads.confidence_at(2, x, (2, 2)).shape == (2,) and not heads.classifiers
    with pytest.raises(ValueError, match="do not form a 3x2 grid"):
        heads.confidence_at(2, x, (3, 2))


def test_quadrant_pooling():
    """The pooled head's quadrant maxima come from the right corner of the patch grid."""
    from edgevlm.runtime.exits import PooledHead

    head = PooledHead(dim=2, hidden=4, n_out=1, grid_side=4, eps=1e-5)
    with torch.no_grad():
        head.norm.weight.fill_(1.0)
        head.norm.bias.zero_()
    x = torch.zeros(1, 1 + 3 * 4, 2)
    x[0, 1:, 0], x[0, 1:, 1] = -1.0, 1.0  # every patch normalises to (-1, 1)
    x[0, 1 + 2 * 4 + 3] = torch.tensor([1.0, -1.0])  # bottom-right patch (row 2, col 3) flipped
    pooled = head.pool(x, (3, 4))  # [mean, max, cls, TL, TR, BL, BR, s]
    quads = pooled[0, 6:14].view(4, 2)
    assert quads[:3, 0].tolist() == pytest.approx([-1.0, -1.0, -1.0], abs=1e-3)
    assert quads[3, 0].item() == pytest.approx(1.0, abs=1e-3)
    assert pooled[0, -1].item() == pytest.approx(12**0.5 / 4)


def test_heads_refuse_other_weights(broken_dir, exit_engine):
    from edgevlm.runtime.exits import weights_fingerprint

    raw = json.loads((broken_dir / EXITS_JSON).read_text())
    raw["weights_fingerprint"] = weights_fingerprint(broken_dir)
    (broken_dir / EXITS_JSON).write_text(json.dumps(raw))
    assert load_exit_heads(broken_dir, exit_engine.config) is not None
    weights = broken_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor: "retrained" weights
    weights.write_bytes(bytes(data))
    assert load_exit_heads(broken_dir, exit_engine.config) is None  # not used (logged), the model still loads
    from edgevlm.runtime import Engine

    assert Engine.load(broken_dir).exit_points == []


def test_heads_need_the_vision_config_for_blocks(exit_engine):
    heads_spec = make_spec(exit_engine.config, exit_blocks=[1], labels=[], adapter_blocks=1, adapter_attn_dim=8)
    with pytest.raises(ValueError, match="vision config"):
        ExitHeads(heads_spec)
    heads = ExitHeads(heads_spec, exit_engine.config.vision)
    heads.adapters["1"].reset_to_identity()
    blk = heads.adapters["1"].blocks[0]
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(heads.adapt(1, x), blk(x))  # attention + MLP start as no-ops after the block
    with pytest.raises(ValueError, match="multiple of 4 heads"):
        make_spec(exit_engine.config, exit_blocks=[1], labels=[], adapter_attn_dim=6)
