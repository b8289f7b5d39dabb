"""Question-conditioned exit confidence: the heads read the prompt's embedding, the engine passes
the prompt, an unknown question never exits on confidence, and heads made for another text width
are refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.types import OperatingPoint  # noqa: E402


def _query_heads(model_dir, *, seed: int = 0):
    from edgevlm.runtime.exits import ExitHeads, make_spec, save_exit_heads
    from edgevlm.runtime.loader import read_model_files

    cfg = read_model_files(model_dir).config
    spec = make_spec(cfg, exit_blocks=[1, 2], labels=[], head_hidden=16, confidence_query=True)
    spec.recommended_threshold = 0.5
    heads = ExitHeads(spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else 0.03 * torch.randn(p.shape, generator=gen))
    save_exit_heads(heads, model_dir, dtype=torch.float32)
    return heads


@pytest.fixture(scope="module")
def query_engine(tmp_path_factory, plain_model_dir):
    from edgevlm.runtime import Engine

    d = tmp_path_factory.mktemp("query_heads") / "m"
    shutil.copytree(plain_model_dir, d)
    _query_heads(d)
    return Engine.load(d)


def test_spec_records_query_width(query_engine):
    spec = query_engine.backend.model.exit_heads.spec
    assert spec.confidence_query_dim == query_engine.config.text.hidden_size
    assert query_engine.backend.model.exit_heads.needs_query
    head = query_engine.backend.model.exit_heads.confidence["1"]
    assert head.fc1.in_features == 7 * query_engine.config.vision.hidden_size + 1 + spec.confidence_query_dim


def test_query_embedding_is_the_mean_of_text_tokens(query_engine):
    from edgevlm.runtime.exits import query_embedding

    model = query_engine.backend.model
    img = model.cfg.image_token_id
    ids = torch.tensor([[1, img, img, 7, 9]])
    with torch.no_grad():
        got = query_embedding(model.language_model.embed_tokens, ids, img)
        want = model.language_model.embed_tokens.weight[[1, 7, 9]].mean(0, keepdim=True)
    torch.testing.assert_close(got, want)


def test_engine_passes_the_question(query_engine, frames):
    """exit_confidence in the stats equals the head applied by hand to block 1's states and the
    prompt's embedding, and two questions give two confidences on the same image."""
    from edgevlm.runtime.exits import query_embedding
    from edgevlm.runtime.preprocess import preprocess

    e = query_engine
    model = e.backend.model
    op = OperatingPoint(exit_threshold=1.0)  # never confident enough: every exit head is consulted
    confs = {}
    for q in ("describe the scene.", "how many shapes are there?"):
        a = e.ask(frames[0], q, max_new_tokens=2, operating_point=op)
        assert a.stats.exit_layer is None
        px = torch.from_numpy(preprocess(frames[0], e.image_size_px, 16, e.image_mean, e.image_std))[None]
        with torch.no_grad():
            enc = model.vision_tower.encoder
            x = enc.layers[1](enc.layers[0](enc.stem(px)))  # the last exit consulted: block 2
            ids = torch.tensor([e.tokenizer.encode_prompt(q, a.stats.vision_tokens)])
            want = model.exit_heads.confidence_at(2, x, (px.shape[-2] // 16, px.shape[-1] // 16),
                                                  query_embedding(model.language_model.embed_tokens, ids,
                                                                  model.cfg.image_token_id))
        assert a.stats.exit_confidence == pytest.approx(float(want[0]), abs=1e-5)
        confs[q] = a.stats.exit_confidence
    assert len(set(confs.values())) == 2


def test_unknown_question_never_exits_on_confidence(query_engine):
    heads = query_engine.backend.model.exit_heads
    x = torch.randn(2, 1 + 12, query_engine.config.vision.hidden_size)
    assert heads.confidence_at(1, x, (3, 4)).tolist() == [0.0, 0.0]
    q = torch.randn(2, heads.spec.confidence_query_dim)
    c = heads.confidence_at(1, x, (3, 4), q)
    assert c.shape == (2,) and bool(((c > 0) & (c < 1)).all())
    with pytest.raises(ValueError, match="question embedding"):
        heads.confidence["1"](x, (3, 4))


def test_heads_for_another_text_width_are_refused(tmp_path, plain_model_dir):
    from edgevlm.errors import ModelLoadError
    from edgevlm.runtime.exits import load_exit_heads
    from edgevlm.runtime.loader import read_model_files

    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    _query_heads(d)
    raw = json.loads((d / "exits.json").read_text())
    raw["confidence_query_dim"] += 1
    (d / "exits.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="confidence_query_dim"):
        load_exit_heads(d, read_model_files(d).config)


def test_frontier_grid_includes_recommended_threshold(query_engine):
    from edgevlm.quantize import frontier

    assert frontier.recommended_threshold(query_engine) == 0.5
    assert 0.5 in frontier.grid_from_profile(query_engine, None)["thresholds"]


def test_batch_rows_keep_their_question(query_engine, frames):
    """A batch of two images with two questions: each row's confidence is its own question's."""
    from edgevlm.runtime.exits import query_embedding
    from edgevlm.runtime.preprocess import preprocess
    from edgevlm.runtime.vision import encode_adaptive

    e = query_engine
    model = e.backend.model
    px = torch.from_numpy(np.stack([preprocess(f, 64, 16, e.image_mean, e.image_std) for f in frames[:2]]))
    ids = torch.tensor([e.tokenizer.encode_prompt("describe the scene.", 12),
                        e.tokenizer.encode_prompt("describe the scene.", 12)])
    ids[1, -3] = 9  # a different text token in row 1
    q = query_embedding(model.language_model.embed_tokens, ids, model.cfg.image_token_id)
    with torch.no_grad():
        _, both = encode_adaptive(model.vision_tower, px, exit_heads=model.exit_heads, exit_threshold=1.0,
                                  exit_query=q)
        for row in range(2):
            _, one = encode_adaptive(model.vision_tower, px[row : row + 1], exit_heads=model.exit_heads,
                                     exit_threshold=1.0, exit_query=q[row : row + 1])
            assert both.exit_confidences[row] == pytest.approx(one.exit_confidences[0], abs=1e-5)


def test_saved_heads_are_world_readable(tmp_path, plain_model_dir):
    """The daemon runs as its own service user: shipped exit heads must not be owner-only (0600)."""
    d = tmp_path / "m"
    shutil.copytree(plain_model_dir, d)
    _query_heads(d)
    assert (d / "exits.safetensors").stat().st_mode & 0o044 == 0o044
