"""The LLaVA family as users have it, against transformers: tiny random checkpoints built with
transformers' config classes and ``save_pretrained`` (model + ``LlavaProcessor``, the llava-hf chat
template written as the hub ships it, in ``chat_template.json``), for CLIP + Llama, SigLIP +
Mistral (an ``image_size`` that is not a multiple of the patch, 'full' selection, two feature
layers), CLIP + Qwen2 (q/k/v bias) and CLIP + Llama-3 (rope ``llama3``).

Compared with transformers in fp32: pixel values (<= 1e-5) and token ids (equal) against
``LlavaProcessor`` for the same image and question, prefill logits (<= 1e-4 relative) against
``LlavaForConditionalGeneration`` at two image sizes (one non-square), 16 greedy tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from edgevlm.errors import ModelLoadError  # noqa: E402
from edgevlm.runtime.testing import build_tokenizer_json  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

#: llava-hf/llava-1.5-7b-hf's chat_template.json (with transformers' {% generation %} tag)
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
IMAGE_TOKEN_ID = 4  # "<image>" in build_tokenizer_json
QUESTION = "how many red circles are there ?"
SIZES = [(40, 40), (36, 60)]  # (H, W) of the camera image: square, non-square
MAX_REL_ERR = 1e-4

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=3)
VARIANTS = {
    "clip-llama": ("clip", transformers.LlamaConfig, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "siglip-mistral": ("siglip", transformers.MistralConfig, {"sliding_window": 4096}),
    "clip-qwen2": ("clip", transformers.Qwen2Config, {}),
    "clip-llama3": ("clip", transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
}


def build_llava(out: Path, vision: str, text_cls, text_extra: dict, *, seed: int = 0,
                image_size: int | None = None, patch_size: int = 8, with_processor: bool = True) -> Path:
    """save_pretrained a random LlavaForConditionalGeneration and its LlavaProcessor into ``out``."""
    tok_json = build_tokenizer_json()
    vocab = len(json.loads(tok_json)["model"]["vocab"])
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    if vision == "clip":
        size = image_size or 32
        vc = transformers.CLIPVisionConfig(**small, image_size=size, patch_size=patch_size)
        layer, strategy, extra_tokens = -2, "default", 1
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    else:  # image_size 30 with patch 8: a 3 x 3 grid, 6 border pixels dropped (floored as transformers)
        size = image_size or 30
        vc = transformers.SiglipVisionConfig(**small, image_size=size, patch_size=patch_size)
        layer, strategy, extra_tokens = [-3, -1], "full", 0
        image_processor = transformers.SiglipImageProcessorPil(size={"height": size, "width": size})
    tc = text_cls(vocab_size=vocab, **TEXT, **text_extra)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE_TOKEN_ID,
                                   vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # O(1) activations, so that logits are well spread
        for name, p in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "position_embedding.weight")):
                p.normal_(0.0, 0.2 if "position" in name else 1.0)
            elif p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(tok_json)
    if with_processor:
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token="<s>",
                                                   eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
        proc = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch_size,
                                           vision_feature_select_strategy=strategy,
                                           num_additional_image_tokens=extra_tokens, chat_template=LLAVA_HF_TEMPLATE)
        proc.save_pretrained(out)
        (out / "chat_template.jinja").unlink(missing_ok=True)  # the hub ships chat_template.json
        (out / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_HF_TEMPLATE}))
    return out


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def _hf_inputs(proc, image: np.ndarray, question: str = QUESTION):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    return proc(images=image, text=text, return_tensors="pt")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    from edgevlm.runtime import Engine

    vision, text_cls, extra = VARIANTS[request.param]
    out = build_llava(tmp_path_factory.mktemp(request.param), vision, text_cls, extra)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    proc = transformers.AutoProcessor.from_pretrained(out)
    return request.param, hf, proc, Engine.load(out, device="cpu")


@pytest.mark.parametrize("hw", SIZES, ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_pixels_ids_and_prefill_logits_match_transformers(variant, hw):
    name, hf, proc, engine = variant
    image = _image(*hw)
    ref = _hf_inputs(proc, image)
    p = engine.prepare(image, QUESTION)
    assert p.vision.pixel_values.shape == ref["pixel_values"].shape
    assert float((p.vision.pixel_values - ref["pixel_values"]).abs().max()) <= 1e-5
    assert p.ids == ref["input_ids"][0].tolist()
    model = engine.backend.model
    with torch.inference_mode():
        expected = hf(**ref).logits  # (1, T, V)
        ours = model(torch.tensor([p.ids]), p.vision)
    assert ours.shape == expected.shape
    assert rel_err(ours, expected) <= MAX_REL_ERR, name
    assert float(expected.std()) > 0.1  # well-spread logits: the comparison means something


def test_greedy_16_tokens_match_transformers(variant):
    name, hf, proc, engine = variant
    image = _image(*SIZES[1], seed=3)
    ref = _hf_inputs(proc, image)
    with torch.inference_mode():
        out = hf.generate(**ref, max_new_tokens=16, do_sample=False)[0, ref["input_ids"].shape[1]:]
    answer = engine.ask(image, QUESTION, max_new_tokens=16)
    assert answer.stats.new_tokens == len(out), name
    assert answer.text == proc.tokenizer.decode(out, skip_special_tokens=True), name


def test_ladder_rung_keeps_the_aspect_ratio_and_still_matches_the_model(variant):
    """The deliberate difference: at a rung the whole frame is kept on a non-square patch grid
    (transformers would crop it square); the model is still transformers' on those pixels."""
    name, hf, proc, engine = variant
    image = _image(36, 60, seed=4)
    p = engine.prepare(image, QUESTION, operating_point=OperatingPoint(name="r32", resolution_px=32))
    h, w = p.vision.input_sizes_px[0]
    assert w > h and (h, w) != tuple(_hf_inputs(proc, image)["pixel_values"].shape[-2:])
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([p.ids]), pixel_values=p.vision.pixel_values,
                      interpolate_pos_encoding=True).logits
        ours = engine.backend.model(torch.tensor([p.ids]), p.vision)
    assert rel_err(ours, expected) <= MAX_REL_ERR, name


def test_a_480x640_frame_gets_what_transformers_gives(tmp_path):
    """CLIP-336 settings (llava-1.5): shortest edge 336 (bicubic), center crop 336: 576 tokens."""
    from edgevlm.runtime.loader import read_image_processor
    from edgevlm.runtime.models.llava.config import parse_config
    from edgevlm.runtime.models.llava.processor import LlavaProcessor, image_processor_spec
    from edgevlm.runtime.tokenizer import VLMTokenizer

    out = build_llava(tmp_path, "clip", transformers.LlamaConfig, {}, image_size=336, patch_size=14)
    proc = transformers.AutoProcessor.from_pretrained(out)
    cfg = parse_config(json.loads((out / "config.json").read_text()))
    ours = LlavaProcessor(cfg, image_processor_spec(read_image_processor(out), cfg), "<image>")
    tok = VLMTokenizer.from_dir(out, IMAGE_TOKEN_ID)
    frame = _image(480, 640, seed=5)
    ref = _hf_inputs(proc, frame)
    vision = ours.prepare([frame])
    assert vision.tokens_per_item == [576] and vision.input_sizes_px == [(336, 336)]
    assert float((vision.pixel_values - ref["pixel_values"]).abs().max()) <= 1e-5
    assert tok.encode_request(QUESTION, vision, ours) == ref["input_ids"][0].tolist()


def test_prompt_holding_the_image_token_is_refused(variant):
    from edgevlm.errors import InvalidRequestError

    _, _, _, engine = variant
    with pytest.raises(InvalidRequestError, match="must not contain the image token"):
        engine.prepare(_image(40, 40), "what is <image> here ?")


def test_unsupported_model_type_names_the_supported_families(tmp_path):
    from edgevlm.runtime import Engine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "paligemma", "text_config": {}}))
    with pytest.raises(ModelLoadError, match=r"model_type 'paligemma' is not supported; supported: llava \(llava\)"):
        Engine.load(tmp_path)


def test_a_checkpoint_without_normalisation_is_a_warning(tmp_path, caplog):
    from edgevlm.runtime import Engine

    out = build_llava(tmp_path, "clip", transformers.LlamaConfig, {}, with_processor=False)
    with caplog.at_level(logging.WARNING, logger="edgevlm.runtime.models.llava.processor"):
        engine = Engine.load(out)
    assert any("no image_mean/image_std" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert engine.image_mean == (0.48145466, 0.4578275, 0.40821073)  # CLIP's, said in the warning


@pytest.mark.parametrize("name", ["siglip-mistral", "clip-qwen2"])
def test_int4_bundle_onnx_graphs_match_torch(name, tmp_path):
    """`edgevlm quantize` on a SigLIP tower (patch conv bias, no CLS, no pre-LN) and on a decoder with
    q/k/v bias: the bundle's ONNX vision and decoder graphs give the torch backend's numbers."""
    pytest.importorskip("onnxruntime")
    from edgevlm.quantize.build import BuildOptions, build_bundle
    from edgevlm.runtime import Engine
    from edgevlm.runtime.int4 import set_int4_kernel

    vision, text_cls, extra = VARIANTS[name]
    src = build_llava(tmp_path / "src", vision, text_cls, extra)
    bundle = build_bundle(src, tmp_path / "bundle", BuildOptions(method="rtn", group_size=32)).bundle_dir
    ours, ort_engine = Engine.load(bundle), Engine.load(bundle, backend="onnx")
    set_int4_kernel(ours.backend.model, "dequant")  # float32 everywhere, like the ONNX graphs
    p = ours.prepare(_image(36, 60, seed=6), QUESTION)
    ids = torch.tensor([p.ids])
    with torch.inference_mode():
        feats = ours.backend.encode_image(p.vision.pixel_values)  # (1, N, D)
        feats_ort = ort_engine.backend.encode_image(p.vision.pixel_values)
        logits = ours.backend.prefill(ours.backend.embed(ids, feats))
        logits_ort = ort_engine.backend.prefill(ort_engine.backend.embed(ids, feats_ort))
    assert rel_err(feats_ort, feats) <= 1e-4 and rel_err(logits_ort, logits) <= 1e-4
    assert ours.ask(_image(36, 60), QUESTION, max_new_tokens=6).text == \
        ort_engine.ask(_image(36, 60), QUESTION, max_new_tokens=6).text


def test_a_family_without_the_llava_pixel_path_batches_and_refuses_adaptive_knobs(monkeypatch, caplog, tmp_path):
    """A family with ``adaptive_vision=False`` and ``batched_pixels=False`` (here LLaVA's own parts
    under those flags): the torch backend keeps its ``max_batch_size`` cache rows (every family
    batches, no fallback WARNING), and early exit / pruning knobs are refused."""
    import dataclasses

    from edgevlm.errors import InvalidRequestError
    from edgevlm.runtime import Engine
    from edgevlm.runtime.models.llava import FAMILY
    from edgevlm.runtime.testing import write_tiny_checkpoint

    plain = dataclasses.replace(FAMILY, name="plain", adaptive_vision=False, batched_pixels=False)
    monkeypatch.setattr("edgevlm.runtime.loader.family_for", lambda raw: plain)
    with caplog.at_level(logging.WARNING, logger="edgevlm.runtime.backends.torch_backend"):
        engine = Engine.load(write_tiny_checkpoint(tmp_path), backend_options={"max_batch_size": 4})
    assert engine.backend.max_batch_size == 4
    assert not [r for r in caplog.records if "one request at a time" in r.getMessage()]
    with pytest.raises(InvalidRequestError, match="not supported for the plain family"):
        engine.prepare(_image(40, 40), "hi", operating_point=OperatingPoint(name="p", keep_ratio=0.5))
    assert engine.ask(_image(40, 40), "hi", max_new_tokens=2).stats.new_tokens >= 1
