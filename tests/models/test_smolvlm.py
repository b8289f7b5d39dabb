"""SmolVLM2 family (edgevlm.runtime.models.smolvlm) against transformers, fp32 on the CPU.

A tiny random checkpoint in SmolVLM2's real layout is built with transformers' ``SmolVLMConfig`` (a
``smolvlm_vision`` vision config, a ``llama`` text config, tied embeddings, scale_factor 2, image
splitting on: 64 px tiles, longest edge 192 px so up to 3 x 3 tiles + the global image) and
``save_pretrained``, plus ``preprocessor_config.json`` (transformers' ``SmolVLMImageProcessorPil``), a
byte-level BPE ``tokenizer.json`` built with the tokenizers library holding SmolVLM's special tokens
(``<row_i_col_j>`` included), ``processor_config.json`` (``image_seq_len``) and SmolVLM2's
``chat_template.json``. Checked: pixel values (<= 1e-5) and token ids (equal) against transformers'
``SmolVLMProcessor``, prefill logits (<= 1e-4 relative) and 16 greedy tokens against
``SmolVLMForConditionalGeneration`` at a non-square image and one whose sides are not multiples of
the tile, the padded-tile vision path, bad configs and bad images.
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
pytest.importorskip("num2words")  # transformers' SmolVLMProcessor needs it

from parity_support import hf_greedy, map_checkpoint, max_rel_error, our_greedy  # noqa: E402

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError  # noqa: E402
from edgevlm.runtime.models.smolvlm import WEIGHT_RULES  # noqa: E402
from edgevlm.runtime.models.smolvlm.config import parse_config  # noqa: E402
from edgevlm.runtime.models.smolvlm.model import SmolVLMModel  # noqa: E402
from edgevlm.runtime.models.smolvlm.processor import SmolVLMProcessor  # noqa: E402
from edgevlm.runtime.models.smolvlm.vision import patch_attention_mask  # noqa: E402

TOL = 1e-4
QUESTION = "What is in the image?"
#: SmolVLM2's chat template (chat_template.json of HuggingFaceTB/SmolVLM2-*-Instruct)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] "
    "== 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == "
    "'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}"
    "{{ '<video>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                  "<end_of_utterance>", "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
TILE_PX, LONGEST_EDGE_PX, IMAGE_SEQ_LEN = 64, 192, 4  # image_seq_len = (64 / 16)^2 / 2^2


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS[:1], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["User: What is in the image? Assistant: a red circle on the left and a blue square.\n",
              "how many shapes are there? describe the scene. yes no 0 1 2 3 top bottom green triangle"]
    tok.train_from_iterator(corpus * 10, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def build_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write the tiny SmolVLM2 checkpoint (see the module docstring) into ``folder``."""
    from transformers import (
        LlamaConfig,
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessorPil,
    )
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

    tok = _tokenizer()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                            pad_token="<|im_end|>", unk_token="<|endoftext|>").save_pretrained(folder)
    vision = SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=TILE_PX, patch_size=16)
    text = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=2048, bos_token_id=tok.token_to_id("<|im_start|>"),
                       eos_token_id=tok.token_to_id("<end_of_utterance>"))
    cfg = SmolVLMConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                        image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # wider than the default init, so that logits are far from ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": LONGEST_EDGE_PX},
                             max_image_size={"longest_edge": TILE_PX}).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": IMAGE_SEQ_LEN,
                                                              "processor_class": "SmolVLMProcessor"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder


def _hf_processor(folder: Path):
    """transformers' SmolVLMProcessor of the checkpoint. This environment has no torchvision, which
    only SmolVLM's *video* processor needs, so it is built with ``video_processor=None``."""
    from transformers import PreTrainedTokenizerFast, SmolVLMImageProcessorPil
    from transformers import SmolVLMProcessor as HFSmolVLMProcessor

    class ImageOnlyProcessor(HFSmolVLMProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    return ImageOnlyProcessor(image_processor=SmolVLMImageProcessorPil.from_pretrained(folder),
                              tokenizer=PreTrainedTokenizerFast.from_pretrained(folder), video_processor=None,
                              image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def _hf_inputs(hf_processor, image: np.ndarray, question: str = QUESTION) -> dict:
    """The chat template rendered as SmolVLMProcessor.apply_chat_template renders it, then the processor."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = hf_processor.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True)
    return hf_processor(text=[text], images=[[image]], return_tensors="pt")


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8)


def _load(folder: Path) -> SmolVLMModel:
    """Our model with the checkpoint's weights, mapped by name through WEIGHT_RULES."""
    from safetensors.torch import load_file

    cfg = parse_config(json.loads((folder / "config.json").read_text()))
    model = SmolVLMModel(cfg).eval()
    state = map_checkpoint(load_file(str(folder / "model.safetensors")), WEIGHT_RULES)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == ["language_model.lm_head.weight"]  # tied: not stored
    model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.setup_caches(1, 512)
    return model


def _our_ids(folder: Path, processor: SmolVLMProcessor, vision, question: str = QUESTION) -> list[int]:
    """Our prompt ids: edgevlm's tokenizer renders the chat template with one part per item and
    tokenises the family's expansion (the Engine's path)."""
    from edgevlm.runtime.tokenizer import VLMTokenizer

    return VLMTokenizer.from_dir(folder, processor.cfg.image_token_id).encode_request(question, vision, processor)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("smolvlm2"))


@pytest.fixture(scope="module")
def hf(ckpt):
    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(ckpt).eval()
    return model, _hf_processor(ckpt)


@pytest.fixture(scope="module")
def ours(ckpt):
    model = _load(ckpt)
    return model, SmolVLMProcessor.from_dir(ckpt, model.cfg)


# ---- preprocessing and prompt ------------------------------------------------------------------

@pytest.mark.parametrize("size", [(100, 150), (77, 45), (64, 64), (300, 200), (7, 11), (2000, 10), (10, 2000)])
def test_pixel_values_and_token_ids_match_processor(ckpt, hf, ours, size):
    """(7, 11): smaller than one 16 px patch, scaled up; (2000, 10): 200:1, one tile row."""
    _, hf_proc = hf
    _, proc = ours
    img = _image(*size)
    ref = _hf_inputs(hf_proc, img)
    vision = proc.prepare([img])
    ref_pixels = ref["pixel_values"][0]  # (N_tiles, 3, 64, 64)
    assert vision.pixel_values.shape == ref_pixels.shape
    assert float((vision.pixel_values - ref_pixels).abs().max()) <= 1e-5
    assert bool(ref["pixel_attention_mask"].all())  # one image: the processor pads nothing
    assert _our_ids(ckpt, proc, vision) == ref["input_ids"][0].tolist()
    assert vision.tokens_per_item == [IMAGE_SEQ_LEN * ref_pixels.shape[0]]
    assert vision.kinds == ["image"]


def test_two_images_match_processor(ckpt, hf, ours):
    """Several images in one prompt: tiles concatenated in order, one expansion per <image>."""
    _, hf_proc = hf
    _, proc = ours
    images = [_image(100, 150, seed=5), _image(40, 40, seed=6)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    text = hf_proc.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True)
    ref = hf_proc(text=[text], images=[images], return_tensors="pt")
    vision = proc.prepare(images)
    assert vision.pixel_values.shape == ref["pixel_values"][0].shape  # 7 + 10 tiles
    assert float((vision.pixel_values - ref["pixel_values"][0]).abs().max()) <= 1e-5
    assert vision.tokens_per_item == [7 * IMAGE_SEQ_LEN, 10 * IMAGE_SEQ_LEN]
    assert _our_ids(ckpt, proc, vision) == ref["input_ids"][0].tolist()


def test_image_token_in_the_question_is_invalid_request(ckpt, ours):
    _, proc = ours
    with pytest.raises(InvalidRequestError, match="placeholders"):
        _our_ids(ckpt, proc, proc.prepare([_image(64, 64)]), question="look: <image>")


def test_tile_grid_and_prompt_string(ours):
    _, proc = ours
    vision = proc.prepare([_image(100, 150)])  # -> 128 x 192: 2 rows x 3 cols + global
    assert (vision.extras["rows"], vision.extras["cols"]) == ([2], [3])
    assert vision.input_sizes_px == [(128, 192)]
    text = proc.expand_prompt("A<image>B", vision)
    run = "<image>" * IMAGE_SEQ_LEN
    assert text.startswith(f"A<fake_token_around_image><row_1_col_1>{run}<fake_token_around_image><row_1_col_2>")
    assert f"<row_1_col_3>{run}\n<fake_token_around_image><row_2_col_1>" in text
    assert text.endswith(f"<row_2_col_3>{run}\n\n<fake_token_around_image><global-img>{run}<fake_token_around_image>B")


def test_resolution_rung_sets_the_longest_edge(ours):
    """A rung replaces size.longest_edge: 64 px -> the global image only (one tile of tokens)."""
    _, proc = ours
    vision = proc.prepare([_image(100, 150)], resolution_px=64)
    assert vision.pixel_values.shape == (1, 3, 64, 64)
    assert (vision.extras["rows"], vision.extras["cols"]) == ([0], [0])
    assert vision.tokens_per_item == [IMAGE_SEQ_LEN]
    assert proc.expand_prompt("<image>", vision) == (
        "<fake_token_around_image><global-img>" + "<image>" * IMAGE_SEQ_LEN + "<fake_token_around_image>")


# ---- model parity ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(100, 150), (77, 45)])
def test_prefill_logits_match_transformers(ckpt, hf, ours, size):
    """(100, 150): non-square; (77, 45): neither side a multiple of the 64 px tile."""
    hf_model, hf_proc = hf
    model, proc = ours
    img = _image(*size, seed=1)
    ref = _hf_inputs(hf_proc, img)
    vision = proc.prepare([img])
    ids = torch.tensor([_our_ids(ckpt, proc, vision)])
    with torch.no_grad():
        ref_logits = hf_model(**ref).logits  # (1, T, V)
        logits = model(ids, vision)
    assert logits.shape == ref_logits.shape
    assert float(ref_logits.std()) > 0.1  # a real signal, not a constant
    assert max_rel_error(logits, ref_logits) <= TOL


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


def test_padded_tiles_match_transformers_vision(ckpt, hf, ours):
    """Tiles with padding (as in a batch of images of different sizes): bucketed positions over the
    valid patches and a patch attention mask, against transformers' SmolVLMVisionTransformer."""
    hf_model, _ = hf
    model, _ = ours
    torch.manual_seed(0)
    pixel_mask = torch.ones(3, TILE_PX, TILE_PX, dtype=torch.bool)
    pixel_mask[0, 40:, :] = False
    pixel_mask[1, :, 20:] = False
    pixel_mask[2, 33:, 17:] = False
    x = torch.randn(3, 3, TILE_PX, TILE_PX) * pixel_mask[:, None]
    patch_mask = patch_attention_mask(pixel_mask, 16)
    assert patch_mask.sum().item() < 3 * 16
    with torch.no_grad():
        ref = hf_model.model.vision_model(pixel_values=x, patch_attention_mask=patch_mask).last_hidden_state
        ours_ = model.vision_model(x, patch_mask)
    assert float((ours_ - ref).abs().max() / ref.abs().max()) <= TOL


def test_idefics3_checkpoint_matches_transformers(tmp_path):
    """model_type idefics3 (the same layout): logits of Idefics3ForConditionalGeneration, untied head."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=TILE_PX, patch_size=16)
    text = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    ref = Idefics3ForConditionalGeneration(Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                                          scale_factor=2, image_token_id=7)).eval()
    ref.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    cfg = parse_config(json.loads((tmp_path / "config.json").read_text()))
    assert not cfg.tie_word_embeddings
    model = SmolVLMModel(cfg).eval()
    state = {}
    for key, t in load_file(str(tmp_path / "model.safetensors")).items():
        for pattern, repl in WEIGHT_RULES:
            if re.search(pattern, key):
                if repl is not None:
                    state[re.sub(pattern, repl, key)] = t
                break
    model.load_state_dict(state, strict=True)
    model.setup_caches(1, 64)
    ids = torch.tensor([[1, 2, 3] + [7] * 2 * IMAGE_SEQ_LEN + [4, 5]])
    pixels = torch.randn(1, 2, 3, TILE_PX, TILE_PX)
    from edgevlm.runtime.models.base import VisionInput

    vision = VisionInput(pixels[0], [2 * IMAGE_SEQ_LEN], ["image"])
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, pixel_values=pixels).logits
        logits = model(ids, vision)
    assert max_rel_error(logits, ref_logits) <= TOL


# ---- through the Engine and the CLI ------------------------------------------------------------

def _same_answer(ours: str, expected: str) -> bool:
    """Equal texts up to what the Engine does to every answer: surrounding whitespace stripped, and an
    incomplete UTF-8 sequence left at the very end of a length-limited generation (random weights pick
    lone byte tokens) not emitted, where transformers' ``decode`` renders U+FFFD."""
    return ours == re.sub(r"[\s\ufffd]+$", "", expected).strip()


def _hf_answer(hf, image: np.ndarray, max_new_tokens: int) -> str:
    hf_model, hf_proc = hf
    ref = _hf_inputs(hf_proc, image)
    with torch.no_grad():
        out = hf_model.generate(**ref, max_new_tokens=max_new_tokens, do_sample=False)
    return hf_proc.tokenizer.decode(out[0, ref["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(ckpt):
    from edgevlm.runtime import Engine

    return Engine.load(ckpt)


@pytest.mark.parametrize("size", [(100, 150), (77, 45)])
def test_engine_ask_answers_as_transformers(engine, hf, size):
    assert engine.family.name == "smolvlm"
    img = _image(*size, seed=3)
    answer = engine.ask(img, QUESTION, max_new_tokens=16)
    expected = _hf_answer(hf, img, 16)
    assert len(answer.text) > 3
    assert _same_answer(answer.text, expected), (answer.text, expected)
    n_tiles = engine.processor.prepare([img]).pixel_values.shape[0]
    assert answer.stats.vision_tokens == IMAGE_SEQ_LEN * n_tiles


@pytest.mark.parametrize("size", [(2000, 10), (1, 1)])
def test_engine_answers_extreme_images(engine, hf, size):
    """200:1 and 1 x 1 px through the whole Engine: resized into tiles, answered as transformers does
    (1 x 1 is checked against our own rules only: transformers reads a (1, 1, 3) array as channels-first)."""
    img = _image(*size, seed=7)
    answer = engine.ask(img, QUESTION, max_new_tokens=8)
    assert answer.stats.new_tokens == 8 or answer.stats.finish_reason == "stop"
    if size != (1, 1):
        assert _same_answer(answer.text, _hf_answer(hf, img, 8))


def test_early_exit_needs_exit_heads_and_pruning_runs(engine):
    """SmolVLM has early exit (tests/early_exit/test_vit_exits.py): without exit heads an exit is
    refused; token pruning needs none."""
    from edgevlm.types import OperatingPoint

    with pytest.raises(InvalidRequestError, match="no exit heads"):
        engine.ask(_image(64, 64), QUESTION, max_new_tokens=2, operating_point=OperatingPoint(name="x", exit_layer=1))
    full = engine.ask(_image(64, 64), QUESTION, max_new_tokens=2)
    half = engine.ask(_image(64, 64), QUESTION, max_new_tokens=2, operating_point=OperatingPoint(name="x", keep_ratio=0.5))
    assert half.stats.vision_tokens * 2 == full.stats.vision_tokens


def test_cli_ask_answers_as_transformers(ckpt, hf, tmp_path, capsys):
    """``edgevlm ask --model DIR --image PNG --json`` (the CLI's main, in-process)."""
    from PIL import Image

    from edgevlm.cli import main

    img = _image(90, 120, seed=4)
    path = tmp_path / "frame.png"
    Image.fromarray(img).save(path)
    code = main(["ask", "--model", str(ckpt), "--image", str(path), "--max-new-tokens", "16", "--json", QUESTION])
    out = capsys.readouterr().out
    assert code == 0, out
    answer = json.loads(out)["answer"]
    assert len(answer) > 3 and _same_answer(answer, _hf_answer(hf, img, 16))


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(1, 1), (1, 2000), (2000, 1), (3, 600), (5000, 25)])
def test_tiny_and_extreme_aspect_images_are_resized(ours, size):
    """Smaller than a patch, or 200:1 and beyond: resized by SmolVLM's rules into whole tiles."""
    model, proc = ours
    vision = proc.prepare([_image(*size)])
    n = vision.pixel_values.shape[0]
    assert vision.pixel_values.shape[1:] == (3, TILE_PX, TILE_PX) and n >= 1
    rows, cols = vision.extras["rows"][0], vision.extras["cols"][0]
    assert n == (rows * cols + 1 if rows else 1)
    with torch.no_grad():
        feats = model.encode_vision(vision)
    assert feats.shape == (n * IMAGE_SEQ_LEN, 64) and bool(torch.isfinite(feats).all())


@pytest.mark.parametrize("image", [np.zeros((0, 5, 3), np.uint8), np.zeros((5, 0, 3), np.uint8),
                                   np.zeros((4, 4), np.uint8), np.zeros((4, 4, 3), np.float32),
                                   np.zeros((4, 4, 4), np.uint8)])
def test_unusable_image_is_invalid_image_error(ours, image):
    _, proc = ours
    with pytest.raises(InvalidImageError, match="image"):
        proc.prepare([image])


def test_video_is_invalid_request(ours):
    _, proc = ours
    with pytest.raises(InvalidRequestError, match="video"):
        proc.prepare([], video=[_image(64, 64)] * 4, video_timestamps_s=[0.0, 0.5, 1.0, 1.5])


def test_placeholder_count_mismatch_is_invalid_request(ours):
    _, proc = ours
    vision = proc.prepare([_image(64, 64)])
    with pytest.raises(InvalidRequestError, match="2 <image> placeholders for 1 images"):
        proc.expand_prompt("<image><image>", vision)


# ---- config ------------------------------------------------------------------------------------

def test_config_fields(ckpt):
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    assert cfg.tie_word_embeddings and cfg.scale_factor == 2 and cfg.image_seq_len == IMAGE_SEQ_LEN
    assert cfg.vision.patch_size == 16 and not cfg.vision.vision_use_head
    assert cfg.video_token_id is None and cfg.resolution_ladder == ()
    raw = json.loads((ckpt / "config.json").read_text())
    assert parse_config({**raw, "model_type": "idefics3",
                         "vision_config": {**raw["vision_config"], "model_type": "idefics3_vision"}}).scale_factor == 2


#: config.json / preprocessor_config.json / processor_config.json of HuggingFaceTB/SmolVLM2-500M-Video-Instruct
#: (model card values, transformers 4.47 layout: vision and text configs leave most keys to the defaults)
SMOLVLM2_500M_CONFIG = {
    "architectures": ["SmolVLMForConditionalGeneration"], "image_token_id": 49190, "model_type": "smolvlm",
    "pad_token_id": 128002, "scale_factor": 4, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.47.1", "use_cache": False, "vocab_size": 49280,
    "text_config": {"architectures": ["VLlama3ForCausalLM"], "head_dim": 64, "hidden_size": 960,
                    "intermediate_size": 2560, "is_llama_config": True, "max_position_embeddings": 8192,
                    "model_type": "llama", "neftune_noise_alpha": 0.0, "num_attention_heads": 15,
                    "num_hidden_layers": 32, "num_key_value_heads": 5, "pad_token_id": 2, "pixel_shuffle_factor": 4,
                    "qk_layer_norms": False, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_theta": 100000,
                    "torch_dtype": "bfloat16", "use_resampler": False, "vocab_size": 49280},
    "vision_config": {"hidden_size": 768, "image_size": 512, "max_image_size": {"longest_edge": 512},
                      "model_type": "smolvlm_vision", "num_attention_heads": 12, "patch_size": 16,
                      "size": {"longest_edge": 2048}, "tie_word_embeddings": False, "use_base_siglip": False},
}
SMOLVLM2_500M_PREPROCESSOR = {
    "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "SmolVLMImageProcessor",
    "image_std": [0.5, 0.5, 0.5], "max_image_size": {"longest_edge": 512}, "processor_class": "SmolVLMProcessor",
    "resample": 1, "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 2048},
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 512}},
}


def test_hub_smolvlm2_500m_config_reads_as_transformers_does(tmp_path):
    """The published config (4.x layout, defaults left out) gives the sizes transformers derives."""
    ref = transformers.SmolVLMConfig(**SMOLVLM2_500M_CONFIG)
    cfg = parse_config(SMOLVLM2_500M_CONFIG)
    rv, rt = ref.vision_config, ref.text_config
    assert (cfg.vision.hidden_size, cfg.vision.intermediate_size, cfg.vision.num_hidden_layers,
            cfg.vision.num_attention_heads, cfg.vision.image_size, cfg.vision.patch_size, cfg.vision.hidden_act,
            cfg.vision.layer_norm_eps) == (rv.hidden_size, rv.intermediate_size, rv.num_hidden_layers,
                                           rv.num_attention_heads, rv.image_size, rv.patch_size, rv.hidden_act,
                                           rv.layer_norm_eps)
    assert (cfg.text.hidden_size, cfg.text.num_hidden_layers, cfg.text.num_attention_heads,
            cfg.text.num_key_value_heads, cfg.text.head_dim, cfg.text.vocab_size, cfg.text.rms_norm_eps,
            cfg.text.rope_theta) == (rt.hidden_size, rt.num_hidden_layers, rt.num_attention_heads,
                                     rt.num_key_value_heads, rt.head_dim, rt.vocab_size, rt.rms_norm_eps, 100000.0)
    assert cfg.image_seq_len == int((rv.image_size // rv.patch_size) ** 2 / ref.scale_factor**2) == 64
    assert cfg.tie_word_embeddings is False and cfg.image_token_id == 49190
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64,
                                                                "processor_class": "SmolVLMProcessor"}))
    ic = SmolVLMProcessor.from_dir(tmp_path, cfg, SMOLVLM2_500M_PREPROCESSOR).image_cfg
    assert (ic.longest_edge_px, ic.tile_px, ic.resample, ic.image_seq_len) == (2048, 512, 1, 64)
    with torch.device("meta"):
        model = SmolVLMModel(cfg)
    assert model.connector.modality_projection.proj.weight.shape == (960, 768 * 16)


@pytest.mark.parametrize(("patch", "message"), [
    ({"model_type": "llava"}, "model_type 'llava' is not supported (smolvlm, idefics3)"),
    ({"scale_factor": 3}, "scale_factor 3 does not divide the 4x4 patch grid"),
    ({"scale_factor": "2"}, "scale_factor has type str"),
    ({"image_token_id": 10**6}, "image_token_id 1000000 is not a token id"),
    ({"vision_config": {"model_type": "clip_vision_model"}}, "vision_config.model_type 'clip_vision_model'"),
    ({"text_config": {"model_type": "gpt2"}}, "text_config.model_type 'gpt2' is not supported"),
    ({"text_config": []}, "text_config must be an object"),
])
def test_bad_config_names_the_key(ckpt, patch, message):
    raw = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        parse_config({**raw, **patch})


def test_image_size_not_a_multiple_of_the_patch_is_floored_as_transformers_does():
    """SmolVLM2-2.2B's tower: 384 px at patch 14 is a 27 x 27 grid (the last 6 px are not read), as
    transformers' Idefics3 vision embeddings floor it; 27 / scale_factor 3 = 9 -> 81 tokens a tile."""
    raw = {"model_type": "smolvlm", "scale_factor": 3,
           "vision_config": {"model_type": "smolvlm_vision", "image_size": 384, "patch_size": 14, "hidden_size": 64,
                             "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4},
           "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                           "num_attention_heads": 4, "vocab_size": 50000}, "image_token_id": 49190}
    ref = transformers.SmolVLMConfig(**raw)
    cfg = parse_config(raw)
    assert cfg.vision.grid_side == ref.vision_config.image_size // ref.vision_config.patch_size == 27
    assert cfg.image_seq_len == int(27**2 / ref.scale_factor**2) == 81


def test_registry_serves_smolvlm_and_idefics3_and_names_them_when_refusing():
    from edgevlm.runtime.models import family_for

    assert family_for({"model_type": "smolvlm"}).name == family_for({"model_type": "idefics3"}).name == "smolvlm"
    with pytest.raises(ModelLoadError, match=re.escape("smolvlm (smolvlm, idefics3)")):
        family_for({"model_type": "paligemma"})


def test_processor_image_seq_len_mismatch_names_the_key(ckpt, tmp_path):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(ckpt, folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    cfg = parse_config(json.loads((folder / "config.json").read_text()))
    with pytest.raises(ModelLoadError, match="image_seq_len 64 disagrees"):
        SmolVLMProcessor.from_dir(folder, cfg)


# ---- several frames through the Engine: several images ------------------------------------------------

def test_engine_ask_about_frames_answers_as_transformers_images(engine, hf):
    """SmolVLM takes no video: a list of frames is several images, one <image> part each, in order."""
    hf_model, hf_proc = hf
    frames = [_image(100, 150, seed=5), _image(100, 150, seed=6)]
    answer = engine.ask(frames, QUESTION, max_new_tokens=12, frame_timestamps_s=[0.0, 0.5])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    text = hf_proc.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True)
    ref = hf_proc(text=[text], images=[frames], return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**ref, max_new_tokens=12, do_sample=False)
    expected = hf_proc.tokenizer.decode(out[0, ref["input_ids"].shape[1]:], skip_special_tokens=True)
    assert _same_answer(answer.text, expected), (answer.text, expected)
    assert answer.stats.vision_tokens == engine.processor.prepare(frames).num_tokens
    assert answer.stats.vision_tokens > engine.ask(frames[0], QUESTION, max_new_tokens=1).stats.vision_tokens
    with pytest.raises(InvalidRequestError, match="smolvlm family takes several images, at most 8 frame"):
        engine.ask(frames * 5, QUESTION)
