"""Gemma 3 family (edgevlm.runtime.models.gemma3) against transformers, fp32 on the CPU.

A tiny random checkpoint in Gemma 3's real layout is built with transformers' ``Gemma3Config`` (a
``siglip_vision_model`` tower of 112 px / 14 px patches, so an 8 x 8 grid pooled 2 x 2 to 16 vision
tokens per image; a ``gemma3_text`` decoder with three layers sliding / full / sliding, a sliding
window of 8 positions, shorter than the prompt and than one image's run, the full layers' RoPE
linear-scaled by 8 and the sliding layers' own base, ``query_pre_attn_scalar`` 24, GQA, tied
embeddings) and ``save_pretrained``, with ``preprocessor_config.json`` (``Gemma3ImageProcessorPil``
at the hub's settings: bilinear, mean / std 0.5), a Gemma-style ``tokenizer.json`` (BPE with byte
fallback, the ``" " -> "▁"`` normaliser, ``<bos>`` post-processor, the turn and image special
tokens) with the hub's ``tokenizer_config.json`` keys, the hub's chat template and
``generation_config.json``. Checked: pixel values (<= 1e-5) and token ids (equal) against
``Gemma3Processor.apply_chat_template``, prefill logits (<= 1e-4 relative) at two non-square images
and with two images, 16 greedy tokens against ``Gemma3ForConditionalGeneration.generate``,
``Engine.ask`` and ``edgevlm ask``, INT4 bundles (RTN, AWQ), continuous batching (batched = single),
early exit / token pruning on the SigLIP tower, bad configs.

Run: ``.venv/bin/python -m pytest -q tests/models/test_gemma3.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from parity_support import hf_greedy, map_checkpoint, max_rel_error, our_greedy  # noqa: E402

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError  # noqa: E402
from edgevlm.runtime.models.gemma3 import WEIGHT_RULES  # noqa: E402
from edgevlm.runtime.models.gemma3.config import parse_config  # noqa: E402
from edgevlm.runtime.models.gemma3.model import Gemma3Model  # noqa: E402
from edgevlm.runtime.models.gemma3.processor import Gemma3Processor  # noqa: E402

TOL = 1e-4
QUESTION = "how many shapes are there?"
IMAGE_PX, PATCH_PX, MM_TOKENS, SLIDING_WINDOW = 112, 14, 16, 8

#: the chat template of google/gemma-3-*-it (chat_template.json of the hub's processor)
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
#: Gemma's first ids (tokenizer.json of google/gemma-3-*), then the 256 byte-fallback pieces
GEMMA_HEAD = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA_SPECIAL = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
_CORPUS = (
    "You are a helpful assistant.",
    "how many shapes are there? what color is the triangle? describe the scene.",
    "is the red circle on the left or the right? the top or the bottom? yes no 0 1 2 3",
    "What is happening in this picture? The robot picks up a green cube and a yellow box.",
    "user model",
)


def build_gemma_tokenizer(folder: Path) -> dict[str, int]:
    """Write a Gemma-style ``tokenizer.json`` (the pieces of transformers' ``GemmaTokenizer``: BPE
    with byte fallback, normaliser ``" " -> "▁"``, ``Split(" ", merged_with_previous)``, the
    ``▁``/byte-fallback/fuse decoder, a ``<bos> $A`` post-processor), trained on a few sentences, and
    the hub's ``tokenizer_config.json`` keys; returns ``{token: id}`` of the special tokens."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    norm = normalizers.Replace(" ", "▁")
    pre = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer, trainer_tok.pre_tokenizer = norm, pre
    trainer_tok.train_from_iterator(list(_CORPUS), trainer=trainers.BpeTrainer(vocab_size=200, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(list(GEMMA_HEAD) + [f"<0x{b:02X}>" for b in range(256)])}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer, tok.pre_tokenizer = norm, pre
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_HEAD + GEMMA_SPECIAL])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    images = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": True, "add_eos_token": False,
              **images, "extra_special_tokens": images, "spaces_between_special_tokens": False,
              "clean_up_tokenization_spaces": False, "padding_side": "left"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return {t: tok.token_to_id(t) for t in GEMMA_HEAD + GEMMA_SPECIAL}


def text_config(vocab_size: int, **over) -> dict:
    return {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
            "sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            "max_position_embeddings": 4096, **over}


def build_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 3 checkpoint (see the module docstring) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = build_gemma_tokenizer(folder)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_PX, patch_size=PATCH_PX, vision_use_head=False)
    cfg = transformers.Gemma3Config(
        text_config=text_config(max(ids.values()) + 1, eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]]),
        vision_config=vision, mm_tokens_per_image=MM_TOKENS, image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # every weight away from its init (norm offsets not 0)
            p.add_(torch.randn_like(p) * (0.3 if p.dim() < 2 else 0.2))
        # tied and scaled by sqrt(hidden): small token embeddings, or the last token echoes itself
        model.model.language_model.embed_tokens.weight.mul_(0.25)
        # no byte-fallback pieces in answers: they decode to partial UTF-8, the merges to readable text
        model.model.language_model.embed_tokens.weight[:261] *= 0.01  # and no <pad> / <bos> ...
        model.model.language_model.embed_tokens.weight[-len(GEMMA_SPECIAL):] *= 0.01  # ... or turn markers
    model.save_pretrained(folder)
    transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_PX, "width": IMAGE_PX}, resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ).save_pretrained(folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre.update(image_seq_length=MM_TOKENS, processor_class="Gemma3Processor")  # as the hub's file
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": MM_TOKENS,
                                                              "processor_class": "Gemma3Processor"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "pad_token_id": 0}))
    return folder


def _hf_processor(folder: Path):
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil
    from transformers import Gemma3Processor as HFGemma3Processor

    return HFGemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(folder),
                             tokenizer=AutoTokenizer.from_pretrained(folder), chat_template=CHAT_TEMPLATE,
                             image_seq_length=MM_TOKENS)


def _hf_inputs(hf_processor, images, question: str = QUESTION) -> dict:
    from PIL import Image

    images = images if isinstance(images, list) else [images]
    content = [{"type": "image", "image": Image.fromarray(im)} for im in images] + [{"type": "text", "text": question}]
    return hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, return_tensors="pt")


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8)


def _load(folder: Path) -> Gemma3Model:
    """Our model with the checkpoint's weights, mapped by name through WEIGHT_RULES."""
    from safetensors.torch import load_file

    cfg = parse_config(json.loads((folder / "config.json").read_text()))
    model = Gemma3Model(cfg).eval()
    state = map_checkpoint(load_file(str(folder / "model.safetensors")), WEIGHT_RULES, every_key_ruled=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == ["language_model.lm_head.weight"]  # tied: not stored
    model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.setup_caches(1, 256)
    return model


def _our_ids(folder: Path, processor: Gemma3Processor, vision, question: str = QUESTION) -> list[int]:
    from edgevlm.runtime.tokenizer import VLMTokenizer

    return VLMTokenizer.from_dir(folder, processor.cfg.image_token_id).encode_request(question, vision, processor)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def hf(ckpt):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, _hf_processor(ckpt)


@pytest.fixture(scope="module")
def ours(ckpt):
    model = _load(ckpt)
    return model, Gemma3Processor.from_dir(ckpt, model.cfg)


# ---- preprocessing and prompt ------------------------------------------------------------------

@pytest.mark.parametrize("size", [(100, 150), (112, 112), (7, 11), (900, 40)])
def test_pixel_values_and_token_ids_match_processor(ckpt, hf, ours, size):
    _, hf_proc = hf
    _, proc = ours
    img = _image(*size)
    ref = _hf_inputs(hf_proc, img)
    vision = proc.prepare([img])
    assert vision.pixel_values.shape == ref["pixel_values"].shape == (1, 3, IMAGE_PX, IMAGE_PX)
    assert float((vision.pixel_values - ref["pixel_values"]).abs().max()) <= 1e-5
    ids = _our_ids(ckpt, proc, vision)
    assert ids == ref["input_ids"][0].tolist()
    assert vision.tokens_per_item == [MM_TOKENS] and vision.kinds == ["image"]
    # the image run is what transformers marks as token type 1 (its bidirectional block)
    assert [int(i == proc.cfg.image_token_id) for i in ids] == ref["token_type_ids"][0].tolist()


def test_two_images_and_prompt_string(ckpt, hf, ours):
    _, hf_proc = hf
    _, proc = ours
    images = [_image(100, 150, seed=5), _image(40, 40, seed=6)]
    ref = _hf_inputs(hf_proc, images)
    vision = proc.prepare(images)
    assert float((vision.pixel_values - ref["pixel_values"]).abs().max()) <= 1e-5
    assert _our_ids(ckpt, proc, vision) == ref["input_ids"][0].tolist()
    run = "\n\n<start_of_image>" + "<image_soft_token>" * MM_TOKENS + "<end_of_image>\n\n"
    one = proc.prepare([images[0]])
    assert proc.expand_prompt("A<image_soft_token>\n  hi", one) == "A" + run + "hi"
    assert proc.expand_prompt("A<start_of_image>hi", one) == "A" + run + "hi"


# ---- model parity ------------------------------------------------------------------------------

def _check_prefill(hf, ours, ckpt, images):
    hf_model, hf_proc = hf
    model, proc = ours
    ref = _hf_inputs(hf_proc, images)
    vision = proc.prepare(images if isinstance(images, list) else [images])
    ids = torch.tensor([_our_ids(ckpt, proc, vision)])
    assert ids.shape[1] > 2 * SLIDING_WINDOW  # both kinds of layer matter
    with torch.no_grad():
        ref_logits = hf_model(**ref).logits  # (1, T, V)
        logits = model(ids, vision)
        causal = hf_model(input_ids=ref["input_ids"], pixel_values=ref["pixel_values"]).logits
    assert logits.shape == ref_logits.shape
    assert float(ref_logits.std()) > 0.1  # a real signal, not a constant
    err = max_rel_error(logits, ref_logits)
    assert err <= TOL, err
    assert max_rel_error(causal, ref_logits) > 1e-2  # the image block's bidirectional mask matters
    return err


@pytest.mark.parametrize("size", [(100, 150), (77, 45)])
def test_prefill_logits_match_transformers(ckpt, hf, ours, size):
    _check_prefill(hf, ours, ckpt, _image(*size, seed=1))


def test_prefill_logits_with_two_images_match_transformers(ckpt, hf, ours):
    _check_prefill(hf, ours, ckpt, [_image(100, 150, seed=5), _image(60, 40, seed=6)])


def test_bfloat16_prefill_is_as_close_to_float32_as_transformers_own(ckpt, hf):
    """In bfloat16 (the scaled embeddings rounded as transformers does, the norms in float32) our
    logits are no further from the float32 reference than transformers' bfloat16 model's (measured:
    both 1.5e-2, ours equal to transformers' bfloat16 logits)."""
    hf_model, hf_proc = hf
    model = _load(ckpt).to(torch.bfloat16)
    model.setup_caches(1, 256)
    proc = Gemma3Processor.from_dir(ckpt, model.cfg)
    img = _image(100, 150, seed=1)
    ref = _hf_inputs(hf_proc, img)
    vision = proc.prepare([img])
    hf16 = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref32 = hf_model(**ref).logits
        ref16 = hf16(**{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ref.items()}).logits
        ours16 = model(torch.tensor([_our_ids(ckpt, proc, vision)]), vision)
    assert max_rel_error(ours16.float(), ref32) <= max_rel_error(ref16.float(), ref32) * 1.1 + 1e-3

def test_greedy_16_tokens_match_generate(ckpt, hf, ours):
    hf_model, hf_proc = hf
    model, proc = ours
    img = _image(100, 150, seed=2)
    ref = _hf_inputs(hf_proc, img)
    expected = hf_greedy(hf_model, ref)
    vision = proc.prepare([img])
    tokens = our_greedy(model, torch.tensor([_our_ids(ckpt, proc, vision)]), vision)
    assert len(set(expected)) > 1
    assert tokens == expected


# ---- through the Engine and the CLI ------------------------------------------------------------

def _same_answer(ours: str, expected: str) -> bool:
    """Equal texts up to what the Engine does to every answer: surrounding whitespace stripped, and an
    incomplete UTF-8 sequence at the very end of a length-limited generation not emitted."""
    return ours == re.sub(r"[\s\ufffd]+$", "", expected).strip()


def _hf_answer(hf, images, max_new_tokens: int) -> str:
    hf_model, hf_proc = hf
    ref = _hf_inputs(hf_proc, images)
    with torch.no_grad():
        out = hf_model.generate(**ref, max_new_tokens=max_new_tokens, do_sample=False)
    return hf_proc.tokenizer.decode(out[0, ref["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(ckpt):
    from edgevlm.runtime import Engine

    return Engine.load(ckpt)


def test_engine_ask_answers_as_transformers(engine, hf):
    assert engine.family.name == "gemma3"
    img = _image(100, 150, seed=3)
    answer = engine.ask(img, QUESTION, max_new_tokens=16)
    expected = _hf_answer(hf, img, 16)
    assert len(answer.text) > 3
    assert _same_answer(answer.text, expected), (answer.text, expected)
    assert answer.stats.vision_tokens == MM_TOKENS
    frames = [_image(100, 150, seed=5), _image(60, 40, seed=6)]  # several frames: several images
    assert _same_answer(engine.ask(frames, QUESTION, max_new_tokens=12).text, _hf_answer(hf, frames, 12))


def test_cli_ask_answers_as_transformers(ckpt, hf, tmp_path, capsys):
    """``edgevlm ask --model DIR --image X.jpg "q"`` (the CLI's main, in-process)."""
    from PIL import Image

    from edgevlm.cli import main

    img = _image(90, 120, seed=4)
    path = tmp_path / "frame.png"  # lossless: the JPEG decoder is not what is compared
    Image.fromarray(img).save(path)
    code = main(["ask", "--model", str(ckpt), "--image", str(path), "--max-new-tokens", "16", "--json", QUESTION])
    out = capsys.readouterr().out
    assert code == 0, out
    answer = json.loads(out)["answer"]
    assert len(answer) > 3 and _same_answer(answer, _hf_answer(hf, img, 16))


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("image", [np.zeros((0, 5, 3), np.uint8), np.zeros((4, 4), np.uint8),
                                   np.zeros((4, 4, 3), np.float32)])
def test_unusable_image_is_invalid_image_error(ours, image):
    _, proc = ours
    with pytest.raises(InvalidImageError, match="image"):
        proc.prepare([image])


def test_video_and_placeholder_mismatch_are_invalid_request(ckpt, ours):
    _, proc = ours
    with pytest.raises(InvalidRequestError, match="video: gemma3 models take images only"):
        proc.prepare([], video=[_image(32, 32)] * 4, video_timestamps_s=[0.0, 0.5, 1.0, 1.5])
    vision = proc.prepare([_image(32, 32)])
    with pytest.raises(InvalidRequestError, match="2 <image_soft_token> placeholders for 1 images"):
        proc.expand_prompt("<image_soft_token>\n<image_soft_token>\n", vision)
    with pytest.raises(InvalidRequestError, match="placeholders"):
        _our_ids(ckpt, proc, vision, question="look: <image_soft_token>")


# ---- config ------------------------------------------------------------------------------------

def test_config_fields(ckpt):
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    t = cfg.text
    assert cfg.tie_word_embeddings and cfg.pool_kernel == 2 and cfg.image_seq_len == MM_TOKENS
    assert t.qk_norm and t.norm_unit_offset and t.sandwich_norms and t.hidden_act == "gelu_pytorch_tanh"
    assert t.embed_scale == 64 ** 0.5 and t.attn_scale == 24 ** -0.5 and t.sliding_layer_window == SLIDING_WINDOW
    assert t.sliding_window is None  # the KV cache is not bounded by the window
    assert t.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (t.rope_type, t.rope_factor, t.rope_theta, t.sliding_rope_theta) == ("linear", 8.0, 1e6, 1e4)


#: config.json of google/gemma-3-4b-it as the hub ships it (transformers 4.50 layout)
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_hub_gemma3_4b_config_reads_as_transformers_does():
    ref = transformers.Gemma3Config(**GEMMA3_4B_CONFIG)
    cfg = parse_config(GEMMA3_4B_CONFIG)
    rt, rv = ref.text_config, ref.vision_config
    t = cfg.text
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim, t.sliding_layer_window, t.rms_norm_eps) == (
        rt.vocab_size, rt.hidden_size, rt.num_hidden_layers, rt.num_attention_heads, rt.num_key_value_heads,
        rt.head_dim, rt.sliding_window, rt.rms_norm_eps)
    assert list(t.layer_types) == list(rt.layer_types) and t.layer_types.count("full_attention") == 5
    full, local = rt.rope_parameters["full_attention"], rt.rope_parameters["sliding_attention"]
    assert (t.rope_type, t.rope_factor, t.rope_theta) == (full["rope_type"], full["factor"], full["rope_theta"])
    assert t.sliding_rope_theta == local["rope_theta"] == 10000.0
    assert t.attn_scale == rt.query_pre_attn_scalar ** -0.5 and t.embed_scale == rt.hidden_size ** 0.5
    assert (cfg.vision.hidden_size, cfg.vision.num_hidden_layers, cfg.vision.grid_side) == (
        rv.hidden_size, rv.num_hidden_layers, rv.image_size // rv.patch_size)
    assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (
        ref.image_token_id, ref.boi_token_id, ref.eoi_token_id)
    assert cfg.pool_kernel == 4 and cfg.image_seq_len == 256
    with torch.device("meta"):
        model = Gemma3Model(cfg)
    assert model.multi_modal_projector.mm_input_projection_weight.shape == (1152, 2560)


@pytest.mark.parametrize(("patch", "message"), [
    ({"model_type": "paligemma"}, "model_type 'paligemma' is not supported (gemma3)"),
    ({"mm_tokens_per_image": 15}, "mm_tokens_per_image 15 is not a square"),
    ({"mm_tokens_per_image": 9}, "mm_tokens_per_image 9 is not a square whose side divides the 8x8"),
    ({"image_token_index": 10**6}, "image_token_index 1000000 is not a token id"),
    ({"vision_config": {"model_type": "clip_vision_model"}}, "vision_config.model_type 'clip_vision_model'"),
    ({"vision_config": {"image_size": 120}}, "vision_config.image_size 120 is not a multiple of patch_size 14"),
    ({"text_config": {"model_type": "gemma2"}}, "text_config.model_type 'gemma2' is not supported (gemma3_text)"),
    ({"text_config": {"final_logit_softcapping": 30.0}}, "text_config.final_logit_softcapping 30.0 is not supported"),
    ({"text_config": {"attn_logit_softcapping": 50.0}}, "text_config.attn_logit_softcapping 50.0 is not supported"),
    ({"text_config": {"use_bidirectional_attention": True}}, "text_config.use_bidirectional_attention true"),
    ({"text_config": {"layer_types": ["full_attention"]}}, "text_config.layer_types must list 3"),
    ({"text_config": {"sliding_window": 0}}, "text_config.sliding_window must be a positive int"),
    ({"text_config": {"hidden_activation": "swish"}}, "text_config.hidden_activation 'swish' is not supported"),
    ({"text_config": {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}},
     "text_config.rope_parameters.rope_type 'yarn' is not supported"),
    ({"text_config": {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}},
     "text_config.rope_parameters.sliding_attention.rope_type 'linear' is not supported"),
    ({"text_config": {"query_pre_attn_scalar": -1}}, "text_config.query_pre_attn_scalar must be a positive number"),
    ({"text_config": []}, "text_config must be an object"),
])
def test_bad_config_names_the_key(ckpt, patch, message):
    raw = json.loads((ckpt / "config.json").read_text())
    for key in ("vision_config", "text_config"):
        if isinstance(patch.get(key), dict):
            patch = {**patch, key: {**raw[key], **patch[key]}}
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        parse_config({**raw, **patch})


def test_bad_config_is_one_line_at_the_cli(ckpt, tmp_path, capsys):
    import shutil

    from edgevlm.cli import main

    folder = tmp_path / "bad"
    shutil.copytree(ckpt, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"]["final_logit_softcapping"] = 30.0
    (folder / "config.json").write_text(json.dumps(raw))
    path = tmp_path / "x.png"
    from PIL import Image

    Image.fromarray(_image(20, 20)).save(path)
    assert main(["ask", "--model", str(folder), "--image", str(path), QUESTION]) == 2
    err = capsys.readouterr().err
    assert "text_config.final_logit_softcapping" in err and err.strip().count("\n") == 0


def test_processor_settings_that_disagree_name_the_key(ckpt):
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    with pytest.raises(ModelLoadError, match="do_pan_and_scan true is not supported"):
        Gemma3Processor.from_dir(ckpt, cfg, {**pre, "do_pan_and_scan": True})
    with pytest.raises(ModelLoadError, match="size .* is not the encoder's 112x112 px input"):
        Gemma3Processor.from_dir(ckpt, cfg, {**pre, "size": {"height": 896, "width": 896}})
    with pytest.raises(ModelLoadError, match="image_seq_length 256 disagrees"):
        Gemma3Processor.from_dir(ckpt, cfg, {**pre, "image_seq_length": 256})


def test_hub_4x_checkpoint_names_map_onto_the_model(ckpt):
    """The hub's checkpoints (saved by transformers 4.50: ``vision_tower.vision_model.*``,
    ``language_model.model.*``) and transformers 5's names map onto the same parameters."""
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))
    hub = {re.sub(r"^vision_tower\.", "vision_tower.vision_model.", k): v for k, v in saved.items()}
    hub["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(64)[None]  # dropped
    want = set(Gemma3Model(parse_config(json.loads((ckpt / "config.json").read_text()))).state_dict())
    for state in (saved, hub):
        assert set(map_checkpoint(state, WEIGHT_RULES, every_key_ruled=True)) | {"language_model.lm_head.weight"} == want

def test_registry_serves_gemma3():
    from edgevlm.runtime.models import family_for

    assert family_for({"model_type": "gemma3"}).name == "gemma3"
    with pytest.raises(ModelLoadError, match=re.escape("gemma3 (gemma3)")):
        family_for({"model_type": "paligemma"})


# ---- INT4 bundle -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_int4_bundle_loads_and_answers(ckpt, engine, method, tmp_path, caplog):
    """``edgevlm quantize`` (W4A16 RTN / AWQ with the demo calibration scenes on the decoder, the vision
    tower and projector 16-bit): the bundle loads through the registry and answers close to the
    16-bit model; ``onnx/vision.onnx`` and ``onnx/decoder.onnx`` are built and checked against PyTorch
    at build time, and ``--backend onnx`` answers as the torch backend."""
    from edgevlm.quantize.build import BuildOptions, build_bundle
    from edgevlm.runtime import Engine
    from edgevlm.runtime.bundle import read_manifest

    with caplog.at_level("WARNING", logger="edgevlm.quantize.build"):
        result = build_bundle(ckpt, tmp_path / "bundle", BuildOptions(method=method, group_size=32, calib="demo",
                                                                      calib_samples=2, awq_grid=4))
    assert not [r for r in caplog.records if "onnx" in r.getMessage().lower()]
    manifest = read_manifest(result.bundle_dir)
    assert manifest.artifacts["onnx"] == "onnx/"
    check = manifest.onnx_check  # both graphs run against PyTorch at build time
    assert check is not None and check.passed and check.decoder and len(check.vision) == 2
    assert check.max_error < 1e-4
    int4 = [d for d in manifest.layers if d.action == "int4"]
    assert int4 and all(d.name.startswith("language_model.layers.") and d.group_size == 32 for d in int4)
    assert len(int4) == 3 * 7 and all(d.method == method for d in int4)
    if method == "awq":
        assert manifest.calibration.samples == 2 and manifest.calibration.tokens > 0
        assert all(d.awq_alpha is not None for d in int4)
        # nothing folds into Gemma's (1 + w) norms: those linears keep an explicit input scale
        assert not any((d.awq_fold_into or "").endswith("layernorm") for d in int4)
    assert any(d.action == "keep" and d.name.startswith("vision_tower.") for d in manifest.layers)
    q = Engine.load(result.bundle_dir, device="cpu", dtype="float32")
    assert q.family.name == "gemma3"
    assert sum(type(m).__name__ == "Int4Linear" for m in q.backend.model.modules()) == len(int4)
    img = _image(100, 150, seed=8)
    answer = q.ask(img, QUESTION, max_new_tokens=4)
    assert answer.stats.new_tokens >= 1 and answer.stats.vision_tokens == MM_TOKENS
    vision = q.processor.prepare([img])
    ids = torch.tensor([q.tokenizer.encode_request(QUESTION, vision, q.processor)])
    with torch.no_grad():
        got = q.backend.model.prefill(q.backend.model.embed(ids, q.backend.model.encode_vision(vision)))[0]
        want = engine.backend.model.prefill(engine.backend.model.embed(
            ids, engine.backend.model.encode_vision(vision)))[0]
    cos = float(torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=0))
    assert 0.9 < cos < 1.0, cos  # quantized (not identical), still close on random tiny weights
    if method == "rtn":  # --backend onnx: both graphs, the host's scaled embeddings and image blocks
        onnx = Engine.load(result.bundle_dir, backend="onnx")
        for size in ((100, 150), (40, 60)):
            img = _image(*size, seed=9)
            assert onnx.ask(img, QUESTION, max_new_tokens=8).text == q.ask(img, QUESTION, max_new_tokens=8).text



def test_quantize_cli_then_ask_the_bundle(ckpt, tmp_path, capsys):
    """``edgevlm quantize DIR --out B`` then ``edgevlm ask --model B --image X "q"`` (the CLI's main)."""
    from PIL import Image

    from edgevlm.cli import main

    bundle = tmp_path / "b"
    rc = main(["quantize", str(ckpt), "--out", str(bundle), "--method", "rtn", "--group-size", "32", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, out
    data = json.loads(out[-1])
    assert data["int4_layers"] == 3 * 7 and 0 < data["onnx_check_max_error"] < 1e-4
    path = tmp_path / "frame.png"
    Image.fromarray(_image(90, 120, seed=4)).save(path)
    assert main(["ask", "--model", str(bundle), "--image", str(path), "--max-new-tokens", "4", "--json", QUESTION]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["vision_tokens"] == MM_TOKENS

def test_awq_calibration_inputs_reproduce_the_16bit_prefill(ckpt, engine):
    """AWQ's calibration path (processor, tokenizer, encode_vision, embed, the decoder's recorded
    inputs incl. the sliding layers' RoPE tables and the image blocks) run through the 16-bit
    layers one by one, each with its own kind of attention, gives the model's own prefill logits."""
    from edgevlm.quantize.build import BuildOptions, _family_calibration_inputs
    from edgevlm.quantize.calib import load_samples
    from edgevlm.quantize.shards import CheckpointReader
    from edgevlm.runtime.loader import read_model_files

    files = read_model_files(ckpt)
    xs, run, _ = _family_calibration_inputs(files, CheckpointReader(files), BuildOptions(method="awq", calib="demo",
                                                                                          calib_samples=2), [])
    model = _load(ckpt)
    for j, sample in enumerate(load_samples("demo", 2)):
        vision = engine.processor.prepare([sample.image])
        ids = engine.tokenizer.encode_request(sample.prompt, vision, engine.processor)
        ids += engine.tokenizer.tok.encode(" " + sample.answer, add_special_tokens=False).ids
        assert len(ids) > 2 * SLIDING_WINDOW
        model.setup_caches(1, 256)  # the runner below swaps in caches of one sample's length
        with torch.no_grad():
            want = model.prefill(model.embed(torch.tensor([ids]), model.encode_vision(vision)))
            x = xs[j]
            for i, layer in enumerate(model.language_model.layers):
                x = run.add_after(i, j, run.for_layer(i)(layer, j, x))
            got = model.language_model.lm_head(model.language_model.norm(x[:, -1]))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

# ---- continuous batching (edgevlm.runtime.batching) --------------------------------------------

def _single_run(engine, prepared, n_steps: int):
    """The single-request path of ``Engine._run``: ``(logits (1 + n_steps, V), greedy tokens)``."""
    be = engine.backend
    ids = torch.tensor([prepared.ids])
    first = be.prefill(be.embed(ids, be.encode_vision(prepared.vision)))
    logits, tokens = [first.clone()], [int(first[0].argmax())]
    for i in range(n_steps):
        logits.append(be.decode(tokens[-1], len(prepared.ids) + i).clone())
        tokens.append(int(logits[-1][0].argmax()))
    return torch.cat(logits), tokens


BATCH_REQUESTS = [((100, 150), 1, "how many shapes are there?", 7), ((64, 64), 2, "describe the scene.", 4),
                  ((70, 100), 3, "is the red circle on the left or the right?", 5)]  # the last one: two images


def _batch_images(size, seed):
    return _image(*size, seed) if seed < 3 else [_image(*size, seed), _image(*size, seed + 1)]


def test_batched_prefill_and_decode_logits_equal_single_requests(ckpt):
    """Right-padded batched prefill with each row's image blocks (one row with two images) + batched
    decode over the sliding and full layers = one request at a time, within 1e-4."""
    from edgevlm.runtime import Engine

    single, batched = Engine.load(ckpt), Engine.load(ckpt, backend_options={"max_batch_size": 4})
    preps = [single.prepare(_batch_images(size, seed), q, max_new_tokens=n) for size, seed, q, n in BATCH_REQUESTS]
    refs = [_single_run(single, p, 6) for p in preps]
    be = batched.backend
    embeds, ids_of, states = [], [], []
    for p in preps:
        ids = torch.tensor([p.ids])
        feats, state = be.encode_vision_state(p.vision)
        embeds.append(be.embed(ids, feats))
        ids_of.append(ids)
        states.append(state)
    assert all(s is not None for s in states)  # so the batcher passes the ids (image blocks per row)
    rows = [2, 0, 1]
    first = be.prefill_batch(embeds, rows, input_ids=ids_of, vision_states=states)
    for i in range(3):
        torch.testing.assert_close(first[i : i + 1], refs[i][0][:1], rtol=1e-4, atol=1e-4)
    by_row = {row: i for i, row in enumerate(rows)}
    for step in range(6):
        order = [by_row[r] for r in range(3)]
        out = be.decode_batch([refs[i][1][step] for i in order], [len(preps[i].ids) + step for i in order])
        for r, i in enumerate(order):
            torch.testing.assert_close(out[r : r + 1], refs[i][0][step + 1 : step + 2], rtol=1e-4, atol=1e-4)


def test_continuous_batcher_tokens_equal_one_at_a_time_engine_ask(ckpt):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.batching import ContinuousBatcher, GenerationRequest

    single, batched = Engine.load(ckpt), Engine.load(ckpt, backend_options={"max_batch_size": 2})
    cases = [(_batch_images(size, seed), q, n) for size, seed, q, n in BATCH_REQUESTS]
    reqs = []
    for i, (im, q, n) in enumerate(cases):
        prep = batched.prepare(im, q, max_new_tokens=n)
        reqs.append(GenerationRequest(prep.ids, vision=prep.vision, max_new_tokens=n,
                                      eos_token_ids=batched.eos_token_ids, request_id=i))
    batcher = ContinuousBatcher(batched.backend)
    results = batcher.run(reqs)
    assert batcher.joins == 1 and max(r.batch_size for r in results) == 2
    for (im, q, n), res in zip(cases, results, strict=True):
        answer = single.ask(im, q, max_new_tokens=n)
        _, ref_tokens = _single_run(single, single.prepare(im, q, max_new_tokens=n), n - 1)
        assert res.tokens == ref_tokens[: answer.stats.new_tokens]
        assert single.tokenizer.decode(res.tokens).strip() == answer.text


# ---- early exit and token pruning on the SigLIP tower (edgevlm.runtime.adaptive) ---------------

def _random_heads(engine, blocks: list[int], seed: int = 0, query: bool = False):
    from edgevlm.runtime.exits import ExitHeads, make_spec

    heads = ExitHeads(make_spec(engine.config, exit_blocks=blocks, labels=[], head_hidden=16, confidence_query=query))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    engine.backend.model.attach_exit_heads(heads)
    return engine.backend.model.exit_heads


def test_forced_exit_equals_the_truncated_tower_plus_adapter(engine):
    import copy

    from edgevlm.types import OperatingPoint

    model = engine.backend.model
    heads = _random_heads(engine, [1])
    vision = engine.processor.prepare([_image(100, 150), _image(50, 60, seed=1)])
    with torch.no_grad():
        tokens, info = model.encode_vision_adaptive(vision, OperatingPoint(name="x", exit_layer=1))
        tower = copy.deepcopy(model.vision_tower)
        tower.encoder.layers = tower.encoder.layers[:1]
        tower.post_layernorm = torch.nn.Sequential(heads.adapters["1"], tower.post_layernorm)
        want = model.multi_modal_projector(tower(vision.pixel_values).last_hidden_state).reshape(-1, 64)
        full = model.encode_vision(vision)
        last, last_info = model.encode_vision_adaptive(vision, OperatingPoint(name="x", exit_layer=2))
    assert info.exit_layers == [1] and info.blocks_run == 1
    torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    assert (tokens - full).abs().max() > 1e-3  # the exit really changed the features
    assert last_info.exit_layers == [None] and torch.equal(last, full)  # at the last block: the full tower
    model.attach_exit_heads(None)


def test_confidence_head_reads_the_images_patches(engine):
    from edgevlm.runtime.adaptive import question_embedding
    from edgevlm.types import OperatingPoint

    model = engine.backend.model
    heads = _random_heads(engine, [1], seed=3, query=True)
    p = engine.prepare(_image(70, 100, 2), QUESTION, operating_point=OperatingPoint(name="g", exit_threshold=0.0))
    prompt = torch.tensor([p.ids])
    with torch.no_grad():
        run = model.exit_run(p.vision)
        x, grid = run.pooled_view(run.step())
        want = float(heads.confidence_at(1, x, grid, question_embedding(model, prompt))[0])
        _, info = model.encode_vision_adaptive(p.vision, p.operating_point, prompt)
    assert x.shape[:2] == (1, 64) and grid == (8, 8)  # no CLS: the 8 x 8 patches in raster order
    assert info.exit_layers == [1] and info.exit_confidences[0] == pytest.approx(want, abs=1e-6)
    model.attach_exit_heads(None)


def test_pruning_keeps_tokens_by_norm_and_the_prompt_matches(engine):
    from edgevlm.types import OperatingPoint

    model = engine.backend.model
    op = OperatingPoint(name="k", keep_ratio=0.5)
    image = _image(100, 150, 5)
    p = engine.prepare(image, QUESTION, operating_point=op)
    with torch.no_grad():
        full = model.encode_vision(p.vision)
        tokens, info = model.encode_vision_adaptive(p.vision, op)
    index = torch.tensor(info.kept_index[0])
    assert tokens.shape[0] == p.n_vision == MM_TOKENS // 2
    torch.testing.assert_close(tokens, full[index])
    norms = full.norm(dim=-1)
    assert float(norms[index].min()) >= float(norms.sort().values[MM_TOKENS // 2 - 1])
    assert sum(1 for i in p.ids if i == engine.config.image_token_id) == p.n_vision
    answer = engine.ask(image, QUESTION, max_new_tokens=3, operating_point=op)
    assert answer.stats.vision_tokens == MM_TOKENS // 2 and answer.stats.new_tokens >= 1


def test_calibrate_then_ask_with_the_exit(ckpt, tmp_path, capsys):
    """``edgevlm calibrate`` writes exit heads for Gemma 3's SigLIP tower and ``edgevlm ask`` runs them."""
    import shutil

    from PIL import Image

    from edgevlm.cli import main
    from edgevlm.quantize import calibrate
    from edgevlm.runtime.exits import read_spec

    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    assert calibrate.main([str(model), "--steps", "2", "--batch-size", "1", "--agreement-images", "5",
                           "--questions-per-image", "1", "--no-frontier", "--threads", "1", "--exit-blocks", "1"]) == 0
    spec = read_spec(model)
    assert spec.has_cls_token is False and spec.exit_blocks == [1] and spec.vision_blocks == 2
    path = tmp_path / "frame.png"
    Image.fromarray(_image(96, 128, 8)).save(path)
    capsys.readouterr()
    assert main(["ask", "--image", str(path), "--model", str(model), "--json", "--max-new-tokens", "3",
                 "--exit-layer", "1", "--keep-ratio", "0.5", QUESTION]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["exit_layer"] == 1 and stats["vision_tokens"] == MM_TOKENS // 2


@pytest.mark.parametrize("options", [{"fuse_projections": True}, {"kv_cache_dtype": "int4"}])
def test_fused_projections_and_int4_kv_cache_serve_gemma3(ckpt, options):
    """q/k/v and gate/up fused (the CUDA default; the q/k norms and both RoPE tables on the fused
    path) equal the plain layers; an INT4 KV cache answers and stays close."""
    from edgevlm.runtime import Engine

    base, other = Engine.load(ckpt), Engine.load(ckpt, backend_options=options)
    prep = base.prepare(_image(100, 150, seed=1), QUESTION, max_new_tokens=4)
    want, tokens = _single_run(base, prep, 3)
    got, _ = _single_run(other, prep, 3)
    if "fuse_projections" in options:
        assert other.backend.model.language_model.layers[0].self_attn.qkv_proj is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # prefill attends to the exact keys / values; decode reads the 4-bit cache
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert float((got - want).norm() / want.norm()) < 0.25


# ---- rolling KV caches of the sliding layers ----------------------------------------------------

def _decode_logits(model, ids: torch.Tensor, vision, n: int = 20) -> tuple[torch.Tensor, list[int]]:
    """Prefill + ``n`` greedy decode steps: the logits ``(1 + n, V)`` and the fed tokens."""
    with torch.no_grad():
        out = [model.prefill(model.embed(ids, model.encode_vision(vision)))]
        tokens = []
        for step in range(n):
            tokens.append(int(out[-1].argmax(-1)))
            out.append(model.decode(torch.tensor([[tokens[-1]]]), torch.tensor([ids.shape[1] + step])))
    return torch.cat(out), tokens


def test_sliding_layers_keep_a_window_sized_rolling_cache(ckpt, hf, ours):
    """The sliding layers' caches hold ``sliding_window`` (8) slots, the full layer's all 256; a
    prompt of 40 tokens (five windows) and 20 decode steps give the logits of the full-length caches
    (measured 3.3e-7 relative) and of transformers run over the same tokens with the image's
    token_type_ids (measured 5.4e-7; bound 1e-4)."""
    hf_model, hf_proc = hf
    model, proc = ours
    assert [layer.self_attn.kv_cache.k.shape[2] for layer in model.language_model.layers] == [SLIDING_WINDOW, 256,
                                                                                              SLIDING_WINDOW]
    assert [layer.self_attn.kv_cache.ring for layer in model.language_model.layers] == [True, False, True]
    full = _load(ckpt)
    full.setup_caches(1, 256, window_caches=False)
    assert all(layer.self_attn.kv_cache.k.shape[2] == 256 for layer in full.language_model.layers)
    img = _image(100, 150, seed=3)
    vision = proc.prepare([img])
    ids = torch.tensor([_our_ids(ckpt, proc, vision)])
    assert ids.shape[1] > 4 * SLIDING_WINDOW
    ring_logits, tokens = _decode_logits(model, ids, vision)
    full_logits, full_tokens = _decode_logits(full, ids, vision)
    assert tokens == full_tokens and len(set(tokens)) > 1
    assert max_rel_error(ring_logits, full_logits) <= 1e-5
    ref = _hf_inputs(hf_proc, img)
    seq = torch.cat([ref["input_ids"], torch.tensor([tokens[:-1]])], dim=1)  # prompt + the fed tokens
    types = torch.cat([ref["token_type_ids"], torch.zeros(1, len(tokens) - 1, dtype=torch.long)], dim=1)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=seq, pixel_values=ref["pixel_values"], token_type_ids=types,
                             attention_mask=torch.ones_like(seq)).logits[0, ids.shape[1] - 1:]  # (1 + n - 1, V)
    assert hf_logits.shape[0] == ring_logits.shape[0] - 1
    assert max_rel_error(ring_logits[:-1], hf_logits) <= TOL


def test_rolling_cache_refuses_a_continuation_prefill(ckpt):
    model = _load(ckpt)
    lm = model.language_model
    with torch.no_grad(), pytest.raises(ValueError, match="continuation prefill"):
        lm(lm.embed_tokens(torch.tensor([[5, 6, 7]])), torch.arange(3), prefill=False)
