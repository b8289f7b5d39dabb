"""Our LLaVA runtime against transformers' LlavaForConditionalGeneration on the same weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from edgevlm.runtime.loader import load_model, read_model_files  # noqa: E402
from edgevlm.runtime.preprocess import preprocess  # noqa: E402

VARIANTS = {
    # LLaVA-1.5 style: penultimate layer, CLS dropped, grouped-query attention, separate lm_head.
    "penultimate-gqa": dict(feature_layer=-2, strategy="default", kv_heads=2, tie=False),
    # Multi-layer features concatenated, CLS kept, multi-head attention, tied embeddings.
    "multilayer-full-tied": dict(feature_layer=[1, -1], strategy="full", kv_heads=4, tie=True, seed=1),
}
RESOLUTIONS = [(64, 64), (48, 96), (80, 112)]  # (H, W): native square, non-square smaller, non-square larger
MAX_REL_ERR = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (relative to the logits' scale)."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory, hf_builder):
    out = hf_builder(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    files = read_model_files(out)
    ours = load_model(files, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=256)
    return out, hf, ours


def _inputs(ours, h: int, w: int, seed: int = 0):
    n = ours.vision_tower.num_vision_tokens(h, w)
    ids = torch.tensor([[1, 12, 13, 14] + [4] * n + [15, 16, 17, 18, 19, 20]])  # (1, T)
    pixels = torch.randn(1, 3, h, w, generator=torch.Generator().manual_seed(seed))
    return ids, pixels


@pytest.mark.parametrize("hw", RESOLUTIONS, ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_prefill_logits_match_transformers(checkpoint, hw):
    _, hf, ours = checkpoint
    ids, pixels = _inputs(ours, *hw)
    with torch.inference_mode():
        ref = hf(input_ids=ids, pixel_values=pixels, interpolate_pos_encoding=True).logits  # (1, T, V)
        out = ours(ids, pixels)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= MAX_REL_ERR
    assert float(ref.std()) > 0.1  # well-spread logits, so the comparison means something


@pytest.mark.parametrize("hw", RESOLUTIONS[:2], ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_decode_steps_over_static_cache_match_transformers(checkpoint, hw):
    _, hf, ours = checkpoint
    ids, pixels = _inputs(ours, *hw, seed=1)
    t, k = ids.shape[1], 4  # prefill t-k tokens, then decode k tokens one at a time
    with torch.inference_mode():
        ref = hf(input_ids=ids, pixel_values=pixels, interpolate_pos_encoding=True).logits[0]  # (T, V)
        embeds = ours.embed(ids[:, : t - k], ours.encode_image(pixels))
        logits = [ours.prefill(embeds)[0]]
        for pos in range(t - k, t):
            logits.append(ours.decode(ids[:, pos : pos + 1], torch.tensor([pos]))[0])
    for i, got in enumerate(logits):
        assert rel_err(got, ref[t - k - 1 + i]) <= MAX_REL_ERR


@pytest.mark.parametrize("resolution_px", [64, 96])
def test_greedy_generation_matches_transformers_generate(checkpoint, image, resolution_px, monkeypatch):
    from edgevlm.runtime import Engine
    from edgevlm.types import OperatingPoint

    out, hf, _ = checkpoint
    engine = Engine.load(out, device="cpu", max_seq_len=256)
    prompt, n_new = "how many red circles are there ?", 12
    pixels = torch.from_numpy(preprocess(image, resolution_px, 16))[None]  # (1, 3, H, W), non-square
    h, w = pixels.shape[-2:]
    assert h != w
    ids = engine.tokenizer.encode_prompt(prompt, engine.num_vision_tokens(h, w))
    input_ids = torch.tensor([ids])
    # generate() rejects interpolate_pos_encoding as a model kwarg; switch it on in the embeddings.
    embeddings = next(m for m in hf.modules() if type(m).__name__ == "CLIPVisionEmbeddings")
    original = embeddings.forward
    monkeypatch.setattr(embeddings, "forward", lambda pv, **_: original(pv, interpolate_pos_encoding=True))
    with torch.inference_mode():
        gen = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                          max_new_tokens=n_new, do_sample=False)
    ref_ids = gen[0, len(ids):].tolist()
    assert len(set(ref_ids)) >= 2  # not a degenerate repetition: the comparison has content

    # Token for token through the backend boundary (prefill + static-cache decode).
    be = engine.backend
    logits = be.prefill(be.embed(input_ids, be.encode_image(pixels)))
    our_ids = []
    for pos in range(len(ids), len(ids) + len(ref_ids)):
        our_ids.append(int(logits[0].argmax()))
        logits = be.decode(our_ids[-1], pos)
    assert our_ids == ref_ids

    # And end to end through the engine (its own preprocessing, tokenising, EOS handling, text).
    answer = engine.ask(image, prompt, max_new_tokens=n_new,
                        operating_point=OperatingPoint(resolution_px=resolution_px))
    eos = engine.eos_token_ids
    expected_ids = ref_ids[: next((i for i, t in enumerate(ref_ids) if t in eos), len(ref_ids))]
    assert answer.text == engine.tokenizer.decode(expected_ids).strip()
    assert answer.stats.new_tokens == len(ref_ids)
    assert (answer.stats.input_height_px, answer.stats.input_width_px) == (h, w)
