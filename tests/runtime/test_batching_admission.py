"""Admission of the continuous batcher (edgevlm.runtime.batching) and the batched pixel path.

Real tiny LLaVA checkpoint on the CPU (float32). What is checked:

* a prefill group grows past ``token_budget`` once the measured admission cost says it fits
  ``prefill_budget_ms`` (and never without a time budget), and the tokens stay those of ``Engine.ask``;
* ``Engine.prepare(uint8_pixels=True)`` leaves the resized image as uint8 with the same prompt ids,
  and the device-side normalisation gives exactly the float pixels of the host path; requests of
  several resolutions, uint8 and float, share one group and answer as ``Engine.ask``;
* the prompt-ids cache returns the ids of a fresh tokenisation, and still refuses a bad prompt;
* bad calls of the batched backend entry points raise ``ValueError``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.errors import InvalidRequestError  # noqa: E402
from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

PROMPTS = ["what colour is the circle ?", "how many shapes are there ?", "describe the scene .", "is it red ?"]
N_NEW = 4


@pytest.fixture(scope="module")
def batch_engine(tiny_dir):
    from edgevlm.runtime import Engine

    return Engine.load(tiny_dir, device="cpu", backend_options={"max_batch_size": 8})


def _images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, size=(60, 100, 3), dtype=np.uint8) for _ in range(n)]


def _norm(engine) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return tuple(engine.image_mean), tuple(engine.image_std)


def _request(engine, image, prompt, op=None, uint8=True) -> GenerationRequest:
    p = engine.prepare(image, prompt, max_new_tokens=N_NEW, operating_point=op, uint8_pixels=uint8)
    return GenerationRequest(p.ids, p.vision.pixel_values, max_new_tokens=N_NEW, eos_token_ids=engine.eos_token_ids,
                             pixel_norm=_norm(engine) if uint8 else None)


def _asked(engine, image, prompt, op=None) -> str:
    return engine.ask(image, prompt, max_new_tokens=N_NEW, operating_point=op).text


def test_time_budget_lets_a_group_grow_past_the_token_budget(batch_engine) -> None:
    images = _images(7)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(7)]
    reqs = [_request(batch_engine, im, p) for im, p in zip(images, prompts, strict=True)]
    one = len(reqs[0].input_ids)
    # tokens alone: groups of one prompt each, one admission per step
    tokens_only = ContinuousBatcher(batch_engine.backend, token_budget=one)
    for r in reqs[:3]:
        tokens_only.submit(r)
    tokens_only.step()
    assert tokens_only.n_waiting == 2 and tokens_only.group_token_budget() == one
    tokens_only.run([])  # drain
    # a time budget far over the measured cost: after the first measured admission, all the rest at once
    timed = ContinuousBatcher(batch_engine.backend, token_budget=one, prefill_budget_ms=1e6)
    assert timed.group_token_budget() == one  # nothing measured yet
    for r in reqs:
        timed.submit(r)
    timed.step()
    assert timed.n_waiting == 6 and timed.n_running == 1
    assert timed.s_per_token is not None and timed.s_per_token > 0
    assert timed.group_token_budget() >= 6 * one
    timed.step()
    assert timed.n_waiting == 0
    # the results of the whole schedule are Engine.ask's
    again = ContinuousBatcher(batch_engine.backend, token_budget=one, prefill_budget_ms=1e6)
    res = again.run([_request(batch_engine, im, p) for im, p in zip(images, prompts, strict=True)])
    got = [batch_engine.tokenizer.decode(r.tokens) for r in res]
    assert got == [_asked(batch_engine, im, p) for im, p in zip(images, prompts, strict=True)]


def test_a_tiny_time_budget_keeps_the_token_budget(batch_engine) -> None:
    reqs = [_request(batch_engine, im, PROMPTS[0]) for im in _images(3)]
    one = len(reqs[0].input_ids)
    b = ContinuousBatcher(batch_engine.backend, token_budget=one, prefill_budget_ms=1e-6)
    for r in reqs:
        b.submit(r)
    b.step()
    b.step()
    assert b.group_token_budget() == one
    assert b.n_waiting == 1  # one admission per step, one prompt each


def test_bad_budgets_raise_value_error(batch_engine) -> None:
    with pytest.raises(ValueError, match="prefill_budget_ms"):
        ContinuousBatcher(batch_engine.backend, prefill_budget_ms=0)
    with pytest.raises(ValueError, match="prefill_budget_ms"):
        ContinuousBatcher(batch_engine.backend, prefill_budget_ms=-5.0)


def test_uint8_prepare_keeps_the_ids_and_normalises_to_the_float_pixels(batch_engine) -> None:
    image = _images(1)[0]
    for rung in (32, 64):
        op = OperatingPoint(name=f"r{rung}", resolution_px=rung)
        f = batch_engine.prepare(image, PROMPTS[1], operating_point=op)
        u = batch_engine.prepare(image, PROMPTS[1], operating_point=op, uint8_pixels=True)
        assert u.ids == f.ids and u.n_vision == f.n_vision
        assert u.vision.pixel_values.dtype == torch.uint8
        h, w = f.vision.pixel_values.shape[2:]
        assert tuple(u.vision.pixel_values.shape) == (1, h, w, 3)
        mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in _norm(batch_engine))
        x = (u.vision.pixel_values.permute(0, 3, 1, 2).float() * (1.0 / 255.0) - mean) / std
        assert torch.equal(x, f.vision.pixel_values)
    # early exit / pruning encode one image on the host path: float pixels
    pruned = OperatingPoint(name="p", resolution_px=64, keep_ratio=0.5)
    assert batch_engine.prepare(image, PROMPTS[1], operating_point=pruned,
                                uint8_pixels=True).vision.pixel_values.dtype == torch.float32


def test_mixed_resolutions_and_pixel_formats_in_one_group_answer_as_engine_ask(batch_engine) -> None:
    images = _images(6)
    ops = [OperatingPoint(name=f"r{r}", resolution_px=r) for r in (64, 32, 64, 32, 64, 64)]
    uint8 = [True, True, False, True, False, True]
    reqs = [_request(batch_engine, im, PROMPTS[i % 4], op, u)
            for i, (im, op, u) in enumerate(zip(images, ops, uint8, strict=True))]
    b = ContinuousBatcher(batch_engine.backend, token_budget=100_000)
    for r in reqs:
        b.submit(r)
    done = b.step()
    assert b.n_waiting == 0  # one admission took the six
    while b.n_running:
        done += b.step()
    by_key = {r.key: r for r in done}
    got = [batch_engine.tokenizer.decode(by_key[id(r)].tokens) for r in reqs]
    assert got == [_asked(batch_engine, im, PROMPTS[i % 4], op)
                   for i, (im, op) in enumerate(zip(images, ops, strict=True))]
    res = list(by_key.values())
    assert all(r.batch_size == 6 for r in res)


def test_prompt_ids_cache_gives_fresh_ids_and_still_refuses_bad_prompts(batch_engine) -> None:
    image = _images(1)[0]
    op32, op64 = (OperatingPoint(name=f"r{r}", resolution_px=r) for r in (32, 64))
    a = batch_engine.prepare(image, PROMPTS[2], operating_point=op64)
    b = batch_engine.prepare(image, PROMPTS[2], operating_point=op64)
    c = batch_engine.prepare(image, PROMPTS[2], operating_point=op32)
    vision = batch_engine.processor.prepare([image], resolution_px=64)
    fresh = batch_engine.tokenizer.encode_request(PROMPTS[2], vision, batch_engine.processor)
    assert a.ids == b.ids == fresh and a.ids is not b.ids
    assert c.n_vision < a.n_vision and len(c.ids) == len(a.ids) - (a.n_vision - c.n_vision)
    a.ids.append(-1)  # a caller's list is its own: the cache is not changed through it
    assert batch_engine.prepare(image, PROMPTS[2], operating_point=op64).ids == fresh
    token = batch_engine.processor.image_token
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="image token"):
            batch_engine.prepare(image, f"what is {token} ?", operating_point=op64)


def test_prompt_ids_cache_keeps_no_prompt_past_the_kv_cache(batch_engine) -> None:
    """A prompt too long for the KV cache is refused, and not remembered: the cache holds at most
    PROMPT_IDS_CACHE_SIZE entries of fewer than max_seq_len ids each (was: every refused prompt,
    of any length, was stored first, so a caller of the SDK could fill it with huge prompts)."""
    image = _images(1)[0]
    op = OperatingPoint(name="r64", resolution_px=64)
    before = dict(batch_engine._ids_cache)
    for i in range(3):
        long_prompt = f"{i} " + "red circle " * batch_engine.max_seq_len
        with pytest.raises(InvalidRequestError, match="KV cache|max_seq_len|too long|positions"):
            batch_engine.prepare(image, long_prompt, operating_point=op)
    assert dict(batch_engine._ids_cache) == before
    assert all(len(ids) < batch_engine.max_seq_len for ids in batch_engine._ids_cache.values())


def test_uint8_request_without_a_usable_pixel_norm_is_refused_at_submit(batch_engine) -> None:
    """uint8 pixels with no (or a malformed) pixel_norm are refused by submit with a typed error, and the
    other requests are served (was: accepted, then ValueError from encode_images inside step(), which
    fails every request of the group); lists as pixel_norm work like tuples (was: unhashable)."""
    images = _images(2)
    good = _request(batch_engine, images[0], PROMPTS[0])
    b = ContinuousBatcher(batch_engine.backend)
    for norm in (None, ((0.5,) * 3,), ((0.5,) * 3, (0.5, 0.5)), ((0.5,) * 3, (0.5, 0.0, 0.5)), ("abc", "def")):
        bad = _request(batch_engine, images[1], PROMPTS[1])
        bad.pixel_norm = norm
        with pytest.raises(InvalidRequestError, match="pixel_norm"):
            b.submit(bad)
    listed = _request(batch_engine, images[1], PROMPTS[1])
    listed.pixel_norm = tuple(list(part) for part in _norm(batch_engine))  # lists inside
    res = b.run([good, listed])
    tok = batch_engine.tokenizer
    assert [tok.decode(r.tokens).strip() for r in res] == [
        _asked(batch_engine, images[0], PROMPTS[0]).strip(), _asked(batch_engine, images[1], PROMPTS[1]).strip()]
    feats_list = batch_engine.backend.encode_images([listed.pixel_values], normalize=listed.pixel_norm)
    feats_tuple = batch_engine.backend.encode_images([listed.pixel_values], normalize=_norm(batch_engine))
    assert torch.equal(feats_list[0], feats_tuple[0])


def test_uint8_pixels_at_an_adaptive_point_answer_as_engine_ask(batch_engine) -> None:
    """A uint8 request at a token-pruning point goes the per-request vision path, whose encoder takes
    float pixels: normalised there with its pixel_norm, it answers as Engine.ask (was: the uint8
    (1, H, W, 3) tensor reached the patch convolution: RuntimeError inside step(), the group failed)."""
    image, prompt = _images(1)[0], PROMPTS[0]
    op = OperatingPoint(name="prune", keep_ratio=0.5)
    plain = batch_engine.prepare(image, prompt, max_new_tokens=N_NEW, uint8_pixels=True)
    pruned = batch_engine.prepare(image, prompt, max_new_tokens=N_NEW, operating_point=op)
    assert plain.vision.pixel_values.dtype == torch.uint8 and pruned.n_vision < plain.n_vision
    req = GenerationRequest(pruned.ids, plain.vision.pixel_values, max_new_tokens=N_NEW,
                            eos_token_ids=batch_engine.eos_token_ids, operating_point=op, pixel_norm=_norm(batch_engine))
    res = ContinuousBatcher(batch_engine.backend).run([req])
    assert res[0].tokens
    assert batch_engine.tokenizer.decode(res[0].tokens) == _asked(batch_engine, image, prompt, op)


def test_batched_entry_points_refuse_inconsistent_inputs(batch_engine) -> None:
    be = batch_engine.backend
    u = batch_engine.prepare(_images(1)[0], PROMPTS[0], uint8_pixels=True)
    with pytest.raises(ValueError, match="uint8"):
        be.encode_images([u.vision.pixel_values])
    for bad in ((0.5, 0.5), ((0.5,) * 3, (0.5, 0.5, 0.0))):  # two stds; a zero std (the batcher's one rule)
        with pytest.raises(ValueError, match="3 positive stds"):
            be.encode_images([u.vision.pixel_values], normalize=bad)
    feats = be.encode_images([u.vision.pixel_values], normalize=_norm(batch_engine))
    with pytest.raises(ValueError, match="cache rows"):
        be.prefill_images_batch([u.ids], feats, [0, 1])
    with pytest.raises(ValueError, match="outside"):
        be.prefill_images_batch([u.ids], feats, [be.max_batch_size])


@pytest.mark.parametrize("rows", [8, 3])
def test_bucket_padding_of_a_captured_prefill_keeps_the_answers(tiny_dir, rows, monkeypatch) -> None:
    """The padding a CUDA-graph prefill adds (rows to a power of two, length to a multiple of 64:
    :mod:`edgevlm.runtime.prefill_graphs`), run eagerly here: spare cache rows (8 rows) or the
    group's last prompt written again into its own row (3 rows: no spare row) change no answer."""
    from edgevlm.runtime import Engine
    from edgevlm.runtime.prefill_graphs import length_bucket, rows_bucket

    engine = Engine.load(tiny_dir, device="cpu", backend_options={"max_batch_size": rows})
    be = engine.backend
    seen: list[tuple[tuple[int, ...], list[int]]] = []
    lm = be.model.language_model

    def eager_padded(embeds, lengths, cache_rows):
        seen.append((tuple(embeds.shape[:2]), cache_rows.tolist()))
        return lm.prefill_batch(embeds, lengths, cache_rows)

    images = _images(3)
    want = [_asked(engine, im, PROMPTS[i]) for i, im in enumerate(images)]  # single eager requests
    monkeypatch.setattr(be, "_prefill_graphs_for_device", lambda: eager_padded)
    reqs = [_request(engine, im, PROMPTS[i]) for i, im in enumerate(images)]
    res = ContinuousBatcher(be, token_budget=100_000).run(reqs)
    got = [engine.tokenizer.decode(r.tokens) for r in res]
    assert got == want
    (shape, cache_rows), = seen
    longest = max(len(r.input_ids) for r in reqs)
    assert shape == (rows_bucket(3), length_bucket(longest, be.max_seq_len)) == (4, -(-longest // 64) * 64)
    assert cache_rows == ([0, 1, 2, 3] if rows == 8 else [0, 1, 2, 2])
