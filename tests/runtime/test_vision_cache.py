"""The per-frame vision cache (issue 13 §4): several questions about one frame run the vision encoder
once per operating point, with answers identical to the uncached engine; LRU within the budget."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.errors import InvalidRequestError  # noqa: E402
from edgevlm.runtime.vision_cache import VisionCache, content_key  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

QUESTIONS = ["what colour is the small circle ?", "how many shapes are there ?", "is there a square ?",
             "where is the red circle ?"]


@pytest.fixture
def cached_engine(tiny_dir):
    """A private engine (the vision cache is engine state), with the encoder calls counted."""
    from edgevlm.runtime import Engine

    eng = Engine.load(tiny_dir, device="cpu")
    real = eng.backend.encode_vision
    calls = []

    def counting(vision, **kw):
        calls.append(tuple(vision.pixel_values.shape))
        return real(vision, **kw)

    eng.backend.encode_vision = counting
    return eng, calls


def test_four_questions_about_one_frame_encode_once_and_answer_as_without_cache(cached_engine, image):
    eng, calls = cached_engine
    off = [eng.ask(image, q, max_new_tokens=8) for q in QUESTIONS]
    assert len(calls) == 4
    eng.set_vision_cache(16)
    calls.clear()
    on = [eng.ask(image.copy(), q, max_new_tokens=8) for q in QUESTIONS]  # same pixels, new arrays
    assert len(calls) == 1
    assert [a.text for a in on] == [a.text for a in off]
    assert [a.stats.vision_tokens for a in on] == [a.stats.vision_tokens for a in off]
    assert (eng.vision_cache.hits, eng.vision_cache.misses, len(eng.vision_cache)) == (3, 1, 1)
    # the answers say which ran the encoder (the latency controller learns nothing of the encoder from a hit)
    assert [a.stats.vision_cached for a in on] == [False, True, True, True]
    assert not any(a.stats.vision_cached for a in off)


def test_another_frame_or_operating_point_or_key_is_encoded_again(cached_engine, image):
    eng, calls = cached_engine
    eng.set_vision_cache(16)
    eng.ask(image, QUESTIONS[0], max_new_tokens=2)
    other = image.copy()
    other[0, 0, 0] ^= 1  # one pixel differs
    eng.ask(other, QUESTIONS[0], max_new_tokens=2)
    low = OperatingPoint(name="low", resolution_px=32)
    eng.ask(image, QUESTIONS[0], max_new_tokens=2, operating_point=low)
    eng.ask(image, QUESTIONS[1], max_new_tokens=2, operating_point=low)  # hit
    eng.ask(image, QUESTIONS[0], max_new_tokens=2, vision_key=("front", 7))
    eng.ask(other, QUESTIONS[1], max_new_tokens=2, vision_key=("front", 7))  # the key names the frame
    assert len(calls) == 4 and eng.vision_cache.hits == 2


def test_the_batched_prepare_makes_no_key(cached_engine, image, monkeypatch):
    # uint8_pixels (the batched encoder, which never reads the cache): no key, so no hash of the pixels
    import edgevlm.runtime.engine as engine_module

    eng, _ = cached_engine
    eng.set_vision_cache(16)
    hashed = []
    monkeypatch.setattr(engine_module, "content_key", lambda *a, **k: hashed.append(1) or content_key(*a, **k))
    assert eng.prepare(image, QUESTIONS[0], uint8_pixels=True).vision_key is None and hashed == []
    key = eng.prepare(image, QUESTIONS[0]).vision_key
    assert key is not None and key[0] == content_key([image]) and hashed == [1]


def test_lru_eviction_keeps_the_budget():
    cache = VisionCache(3 * 400)  # three (10, 10) float32 entries
    feats = [torch.full((10, 10), float(i)) for i in range(4)]
    for i in range(3):
        cache.put(i, feats[i])
    assert cache.get(0) is not None  # 0 is now the most recently used
    cache.put(3, feats[3])  # evicts 1
    assert cache.get(1) is None and cache.get(2) is not None and cache.get(3)[0].equal(feats[3])
    assert cache.bytes_used == 3 * 400 and cache.evictions == 1
    cache.put("big", torch.zeros(100, 100))  # larger than the budget: not stored, nothing evicted
    assert cache.get("big") is None and len(cache) == 3


def test_content_key_is_the_pixels_not_the_array():
    a = np.zeros((4, 5, 3), np.uint8)
    assert content_key([a]) == content_key([a.copy()]) != content_key([a[:, :4]])
    assert content_key([a, a]) != content_key([a]) and content_key([a], (0.0, 0.5)) != content_key([a])


@pytest.mark.parametrize("bad", [-1, "16", True, float("nan"), float("inf")])
def test_bad_budget_is_invalid_request(engine, bad):
    with pytest.raises(InvalidRequestError, match="vision cache budget"):
        engine.set_vision_cache(bad)
    assert engine.vision_cache is None


@pytest.fixture(scope="module")
def demo_engine():
    """The shipped demo model (LLaVA-style tower with calibrated, question-conditioned exit heads)."""
    from edgevlm.runtime import Engine, demo

    if not (demo.model_dir() / "model.safetensors").is_file():
        pytest.skip(f"the demo model is not in {demo.model_dir()}")
    return Engine.load(None, device="cpu")


def test_a_kept_encoder_walk_serves_llavas_next_early_exit_exactly(demo_engine, image):
    """LLaVA's tower (runtime.vision.encode_adaptive) with a VisionTrunk: exit at the first exit block,
    then walk to the end resuming there, then exit early again — each equal to the walk without the
    trunk, and every block run once in all."""
    from edgevlm.runtime.vision_cache import VisionTrunk

    eng = demo_engine
    be = eng.backend
    layers = be.model.vision_tower.encoder.layers
    n = eng.config.exit_geometry.vision_blocks
    early = OperatingPoint(name="early", resolution_px=384, exit_threshold=0.0)
    never = OperatingPoint(name="never", resolution_px=384, exit_threshold=1.0)
    p = eng.prepare(image, QUESTIONS[0], operating_point=early)
    prompt = torch.tensor([p.ids])
    want = {op.name: (be.encode_vision(p.vision, operating_point=op, prompt_ids=prompt), be.last_vision_info)
            for op in (early, never)}
    runs: list[int] = []
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: runs.append(k)) for k, layer in enumerate(layers, 1)]
    trunk = VisionTrunk()
    try:
        for op in (early, never, early):
            feats = be.encode_vision(p.vision, operating_point=op, prompt_ids=prompt, trunk=trunk)
            info = be.last_vision_info
            assert torch.equal(feats, want[op.name][0])
            assert (info.exit_layers, info.exit_confidences) == (want[op.name][1].exit_layers,
                                                                 want[op.name][1].exit_confidences)
    finally:
        for h in hooks:
            h.remove()
    first_exit = want["early"][1].exit_layers[0]
    assert first_exit is not None and want["never"][1].exit_layers == [None]
    assert runs == list(range(1, n + 1)) and trunk.blocks_run == n  # each block once, over three questions
    assert set(trunk.tokens) == {first_exit, n}  # the tokens of each exit made, for the next question
    with pytest.raises(ValueError, match="one image without pruning"):
        pruned = OperatingPoint(name="k", resolution_px=384, exit_threshold=0.5, keep_ratio=0.5)
        be.encode_vision(p.vision, operating_point=pruned, prompt_ids=prompt, trunk=VisionTrunk())


def test_the_demo_controllers_exit_point_answers_from_the_cache_as_without_it(demo_engine, image):
    """The point the latency controller picks for the demo model by default (r384-x0.95-t16, an
    exit_threshold point): with the cache on, the 2nd-4th questions about one frame run no encoder
    block (stats.vision_cached) and answer as without the cache."""
    eng = demo_engine
    op = OperatingPoint(name="r384-x0.95-t16", resolution_px=384, exit_threshold=0.95, max_new_tokens=16)
    eng.set_vision_cache(None)
    off = [eng.ask(image, q, max_new_tokens=8, operating_point=op) for q in QUESTIONS]
    eng.set_vision_cache(16)
    try:
        on = [eng.ask(image.copy(), q, max_new_tokens=8, operating_point=op) for q in QUESTIONS]
        assert [a.text for a in on] == [a.text for a in off]
        assert [(a.stats.exit_layer, a.stats.exit_confidence) for a in on] == [
            (a.stats.exit_layer, a.stats.exit_confidence) for a in off]
        n = eng.config.exit_geometry.vision_blocks
        depth = [a.stats.exit_layer or n for a in on]
        # the 2nd-4th read the frame's walk (running at most blocks past the deepest one reached before)
        assert [a.stats.vision_cached for a in on] == [False, True, True, True]
        assert max(depth) >= 1
        assert eng.vision_cache.keys()[0][-1] == "trunk"
    finally:
        eng.set_vision_cache(None)


def test_a_trunk_walked_under_an_exit_layer_cap_serves_an_uncapped_point_exactly(demo_engine, image):
    """exit_threshold with exit_layer consults only the exit blocks up to the cap, yet may walk to the
    end; the trunk it leaves (one cache key for every exit_threshold point) must still serve a point
    whose plan reads the deeper exit blocks (was: KeyError on the block the capped walk did not keep)."""
    from edgevlm.runtime.vision_cache import VisionTrunk

    eng = demo_engine
    be = eng.backend
    first = be.model.exit_heads.exit_blocks[0]
    capped = OperatingPoint(name="capped", resolution_px=384, exit_threshold=1.0, exit_layer=first)
    never = OperatingPoint(name="never", resolution_px=384, exit_threshold=1.0)
    p = eng.prepare(image, QUESTIONS[0], operating_point=never)
    prompt = torch.tensor([p.ids])
    want = be.encode_vision(p.vision, operating_point=never, prompt_ids=prompt)
    want_info = be.last_vision_info
    trunk = VisionTrunk()
    be.encode_vision(p.vision, operating_point=capped, prompt_ids=prompt, trunk=trunk)
    got = be.encode_vision(p.vision, operating_point=never, prompt_ids=prompt, trunk=trunk)
    assert torch.equal(got, want)
    assert be.last_vision_info == want_info
