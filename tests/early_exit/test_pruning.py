"""Visual-token pruning: counts, order-preserving selection, CLS attention scores against an explicit
softmax, and the real engine with keep_ratio (vision tokens, prompt size, features)."""

from __future__ import annotations

import pytest

from edgevlm.types import OperatingPoint

torch = pytest.importorskip("torch")

from edgevlm.runtime.preprocess import CLIP_MEAN, CLIP_STD, preprocess  # noqa: E402
from edgevlm.runtime.pruning import feature_norm_scores, pruned_count, select_tokens  # noqa: E402

PROMPT = "how many shapes are there ?"


@pytest.mark.parametrize(
    ("n", "ratio", "k"),
    [(432, 0.5, 216), (432, 0.25, 108), (432, 1.0, 432), (432, None, 432), (10, 0.01, 1), (12, 0.34, 5), (0, 0.5, 0)],
)
def test_pruned_count(n, ratio, k):
    assert pruned_count(n, ratio) == k


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_pruned_count_rejects(ratio):
    with pytest.raises(ValueError, match="keep_ratio"):
        pruned_count(10, ratio)


def test_select_keeps_top_k_in_order():
    tokens = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 2)
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.0, 0.5], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    kept, index = select_tokens(tokens, scores, 0.5)
    assert index.tolist() == [[1, 3, 5], [0, 1, 2]]  # ascending; ties keep the earlier tokens
    assert torch.equal(kept[0], tokens[0, [1, 3, 5]]) and torch.equal(kept[1], tokens[1, [0, 1, 2]])
    with pytest.raises(ValueError, match="scores shape"):
        select_tokens(tokens, scores[:, :5], 0.5)
    same, idx = select_tokens(tokens, scores, 1.0)
    assert same is tokens and idx.tolist()[0] == list(range(6))


def test_cls_attention_matches_explicit_softmax(exit_engine):
    block = exit_engine.backend.model.vision_tower.encoder.layers[0]
    attn = block.self_attn
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y, cls = block.forward_with_cls_attention(x)
        torch.testing.assert_close(y, block(x))
        h = block.layer_norm1(x)
        q = attn.q_proj(h).view(2, 7, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(2, 7, attn.n_heads, attn.head_dim).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-1, -2) / attn.head_dim**0.5, dim=-1)  # (B, H, T, T)
    torch.testing.assert_close(cls, probs[:, :, 0].mean(1))
    torch.testing.assert_close(cls.sum(-1), torch.ones(2))


def _manual_pruned(model, px, ratio, score):
    enc = model.vision_tower.encoder
    x = enc.pre_layrnorm(enc.embeddings(px))
    for blk in enc.layers[:-1]:
        x = blk(x)
    x, cls = enc.layers[-1].forward_with_cls_attention(x)
    patches = x[:, 1:]
    s = cls[:, 1:] if score == "cls_attention" else feature_norm_scores(patches)
    k = pruned_count(patches.shape[1], ratio)
    idx = torch.sort(torch.topk(s, k, dim=1).indices, dim=1).values
    return model.vision_tower.projector(patches[0, idx[0]][None])


@pytest.mark.parametrize("score", ["cls_attention", "feature_norm"])
def test_engine_prunes_before_projector(exit_engine, frames, score):
    model = exit_engine.backend.model
    px = torch.from_numpy(preprocess(frames[2], 64, 16, CLIP_MEAN, CLIP_STD))[None]
    model.prune_score = score
    try:
        with torch.inference_mode():
            got = exit_engine.backend.encode_image(px, operating_point=OperatingPoint(keep_ratio=0.5))
            want = _manual_pruned(model, px, 0.5, score)
    finally:
        model.prune_score = "cls_attention"
    assert got.shape == (1, 6, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_engine_stats_and_prompt(exit_engine, frames):
    full = exit_engine.ask(frames[0], PROMPT, max_new_tokens=3)
    same = exit_engine.ask(frames[0], PROMPT, max_new_tokens=3, operating_point=OperatingPoint(keep_ratio=1.0))
    assert same.text == full.text and same.stats.vision_tokens == full.stats.vision_tokens == 12
    half = exit_engine.ask(frames[0], PROMPT, max_new_tokens=3, operating_point=OperatingPoint(keep_ratio=0.5))
    assert half.stats.vision_tokens == 6 and half.stats.prompt_tokens == full.stats.prompt_tokens
    both = exit_engine.ask(frames[0], PROMPT, max_new_tokens=3,
                           operating_point=OperatingPoint(keep_ratio=0.25, exit_layer=2))
    assert both.stats.vision_tokens == 3 and both.stats.exit_layer == 2


def test_bad_prune_score(exit_engine, frames):
    from edgevlm.runtime.vision import encode_adaptive

    px = torch.from_numpy(preprocess(frames[0], 64, 16, CLIP_MEAN, CLIP_STD))[None]
    with pytest.raises(ValueError, match="prune_score"):
        encode_adaptive(exit_engine.backend.model.vision_tower, px, keep_ratio=0.5, prune_score="random")


def test_pruned_tokens_keep_their_rope_distances(exit_engine, frames):
    """The prompt's positions after pruning: vision tokens at (first slot + original index - pruned),
    everything else at its slot; the prefill equals a manual decoder pass at positions shifted to
    be non-negative (RoPE attention only sees differences), read from the decoder's own tables."""
    from edgevlm.quantize.calibrate import decoder_logits

    model = exit_engine.backend.model
    px = torch.from_numpy(preprocess(frames[2], 64, 16, CLIP_MEAN, CLIP_STD))[None]
    with torch.inference_mode():
        feats, info = model.encode_image_adaptive(px, OperatingPoint(keep_ratio=0.5))
        kept = info.kept_index[0]
        ids = exit_engine.tokenizer.encode_prompt(PROMPT, len(kept))
        emb = model.embed(torch.tensor([ids]), feats)
        positions = model._rope_positions.clone()
        start = ids.index(model.cfg.image_token_id)
        want_pos = list(range(len(ids)))
        for i, k in enumerate(kept):
            want_pos[start + i] = start + k - (12 - len(kept))
        assert positions.tolist() == want_pos
        got = model.prefill(emb)  # consumes the positions
        assert model._rope_positions is None
        dec = model.language_model
        shift = -min(want_pos)
        saved = dec.rope_cos, dec.rope_sin
        idx = torch.tensor(want_pos) + shift
        dec.rope_cos, dec.rope_sin = saved[0][idx], saved[1][idx]
        try:
            ref = decoder_logits(dec, emb)[:, -1]
        finally:
            dec.rope_cos, dec.rope_sin = saved
        plain = model.prefill(emb)  # no positions pending: consecutive slots
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)


def test_compact_positions_option(exit_engine, frames):
    model = exit_engine.backend.model
    op = OperatingPoint(keep_ratio=0.5)
    original = exit_engine.ask(frames[1], PROMPT, max_new_tokens=4, operating_point=op)
    model.prune_positions = "compact"
    try:
        compact = exit_engine.ask(frames[1], PROMPT, max_new_tokens=4, operating_point=op)
        assert model._pruned is None and model._rope_positions is None
    finally:
        model.prune_positions = "original"
    assert original.stats.vision_tokens == compact.stats.vision_tokens == 6
    again = exit_engine.ask(frames[1], PROMPT, max_new_tokens=4, operating_point=op)
    assert again.text == original.text
