"""InternVL family (edgevlm.runtime.models.internvl) against transformers, fp32 on the CPU.

A tiny random checkpoint in InternVL3-hf's real layout is built with transformers' ``InternVLConfig``
(an ``internvl_vision`` InternViT with q/k norm and layer scale, a ``qwen2`` text config, tied
embeddings, downsample_ratio 0.5; 32 px tiles of 8 px patches, so 4 vision tokens a tile, up to 6
tiles + the thumbnail) and ``save_pretrained``, plus ``preprocessor_config.json``
(``GotOcr2ImageProcessorPil``, InternVL3-hf's settings at 32 px), a Qwen-style byte-level BPE
``tokenizer.json`` with InternVL's added tokens (``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ...)
and ``extra_special_tokens`` in ``tokenizer_config.json`` as the hub's, ``processor_config.json``
(``image_seq_length``) and the chat template of the hub's -hf checkpoints (transformers'
``convert_internvl_weights_to_hf.py``). Checked: pixel values (<= 1e-5) and token ids (equal)
against transformers' ``InternVLProcessor``, prefill logits (<= 1e-4 relative) and 16 greedy tokens
against ``InternVLForConditionalGeneration``, ``Engine.ask`` and ``edgevlm ask``, a Qwen3 decoder
(InternVL3.5), an INT4 bundle with its ONNX graphs, early exit / token pruning / ``edgevlm calibrate``, bad configs and
bad images.
"""

from __future__ import annotations

import importlib.util
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
from edgevlm.quantize.bench_families import CONFIGS  # noqa: E402
from edgevlm.runtime.models.internvl import WEIGHT_RULES  # noqa: E402
from edgevlm.runtime.models.internvl.config import parse_config  # noqa: E402
from edgevlm.runtime.models.internvl.model import InternVLModel  # noqa: E402
from edgevlm.runtime.models.internvl.processor import InternVLProcessor, tile_grid  # noqa: E402

TOL = 1e-4
QUESTION = "how many shapes are there?"
#: the chat template of OpenGVLab/InternVL3-*-hf (chat_template.jinja; transformers' conversion script)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
#: InternVL's tokens added to the Qwen2.5-VL tokenizer (write_tokenizer of the conversion script)
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>",
                   "<video>")
EXTRA_SPECIAL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
TILE_PX, PATCH_PX, MAX_TILES, IMAGE_SEQ_LEN = 32, 8, 6, 4  # (32 / 8 * 0.5)^2 = 4 tokens a tile


def _tokenizer_builder():
    """tests/models/conftest.py's tokenizer builder, loaded by path (pytest's importlib mode)."""
    spec = importlib.util.spec_from_file_location("internvl_tokenizer_builder", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_qwen_tokenizer


def build_checkpoint(folder: Path, text_model_type: str = "qwen2", seed: int = 0) -> Path:
    """Write the tiny InternVL checkpoint (see the module docstring) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer_builder()(folder, chat_template=CHAT_TEMPLATE, extra_special_tokens=INTERNVL_TOKENS)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["extra_special_tokens"] = EXTRA_SPECIAL_TOKENS
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=TILE_PX, patch_size=PATCH_PX, use_qk_norm=True, layer_scale_init_value=0.5)
    text = dict(model_type=text_model_type, vocab_size=max(ids.values()) + 1, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=4096,
                eos_token_id=ids["<|im_end|>"])
    cfg = transformers.InternVLConfig(vision_config=vision, text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
                                      downsample_ratio=0.5, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # every weight away from its init (norms not 1, biases not 0)
            p.add_(torch.randn_like(p) * (0.3 if p.dim() < 2 else 0.2))
        # no single-byte tokens in answers: they decode to partial UTF-8, the merges to readable text
        model.model.language_model.embed_tokens.weight[:256] *= 0.01
    model.save_pretrained(folder)
    transformers.GotOcr2ImageProcessorPil(
        size={"height": TILE_PX, "width": TILE_PX}, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
        max_patches=MAX_TILES).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": IMAGE_SEQ_LEN,
                                                              "processor_class": "InternVLProcessor"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    return folder


def _hf_processor(folder: Path):
    """transformers' InternVLProcessor of the checkpoint (its video processor needs torchvision,
    which this environment lacks: built with ``video_processor=None``)."""
    from transformers import AutoTokenizer, GotOcr2ImageProcessorPil
    from transformers import InternVLProcessor as HFInternVLProcessor

    class ImageOnlyProcessor(HFInternVLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    return ImageOnlyProcessor(image_processor=GotOcr2ImageProcessorPil.from_pretrained(folder),
                              tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None,
                              image_seq_length=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def _hf_inputs(hf_processor, images, question: str = QUESTION) -> dict:
    images = images if isinstance(images, list) else [images]
    messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]}]
    text = hf_processor.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True)
    return hf_processor(text=[text], images=images, return_tensors="pt")


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8)


def _load(folder: Path) -> InternVLModel:
    """Our model with the checkpoint's weights, mapped by name through WEIGHT_RULES."""
    from safetensors.torch import load_file

    cfg = parse_config(json.loads((folder / "config.json").read_text()))
    model = InternVLModel(cfg).eval()
    state = map_checkpoint(load_file(str(folder / "model.safetensors")), WEIGHT_RULES)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == ["language_model.lm_head.weight"]  # tied: not stored
    model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.setup_caches(1, 512)
    return model


def _our_ids(folder: Path, processor: InternVLProcessor, vision, question: str = QUESTION) -> list[int]:
    from edgevlm.runtime.tokenizer import VLMTokenizer

    return VLMTokenizer.from_dir(folder, processor.cfg.image_token_id).encode_request(question, vision, processor)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("internvl3"))


@pytest.fixture(scope="module")
def hf(ckpt):
    model = transformers.InternVLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, _hf_processor(ckpt)


@pytest.fixture(scope="module")
def ours(ckpt):
    model = _load(ckpt)
    return model, InternVLProcessor.from_dir(ckpt, model.cfg)


# ---- preprocessing and prompt ------------------------------------------------------------------

@pytest.mark.parametrize("size", [(100, 150), (64, 128), (32, 32), (7, 11), (2000, 10)])
def test_pixel_values_and_token_ids_match_processor(ckpt, hf, ours, size):
    """(100, 150): non-square, 3 x 2 tiles + thumbnail; (64, 128): 2 x 1 + thumbnail; (32, 32): one
    tile, no thumbnail; (7, 11): smaller than one 8 px patch, scaled up; (2000, 10): 200:1, 1 x 6."""
    _, hf_proc = hf
    _, proc = ours
    img = _image(*size)
    ref = _hf_inputs(hf_proc, img)
    vision = proc.prepare([img])
    assert vision.pixel_values.shape == ref["pixel_values"].shape
    assert float((vision.pixel_values - ref["pixel_values"]).abs().max()) <= 1e-5
    assert _our_ids(ckpt, proc, vision) == ref["input_ids"][0].tolist()
    assert vision.tokens_per_item == [IMAGE_SEQ_LEN * ref["pixel_values"].shape[0]]
    assert vision.kinds == ["image"]


def test_tile_grid_follows_the_aspect_ratio():
    """Our grid choice equals transformers' ``get_optimal_tiled_canvas`` (ties included)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    assert tile_grid(100, 150, TILE_PX, 1, MAX_TILES) == (3, 2)  # (cols, rows)
    assert tile_grid(2000, 10, TILE_PX, 1, MAX_TILES) == (1, 6)
    assert tile_grid(700, 700, 448, 1, 12) == (2, 2)  # a tie (1x1, 2x2, 3x3) broken towards more tiles
    assert tile_grid(448, 448, 448, 1, 12) == (1, 1)  # ... while the image covers half of them
    rng = np.random.default_rng(0)
    for h, w in [(1, 1), (448, 896), (1080, 1920), (720, 1280), (10, 2000)] + [tuple(rng.integers(1, 3000, 2))
                                                                               for _ in range(200)]:
        for lo, hi in ((1, 12), (1, 6), (2, 9)):
            assert tile_grid(int(h), int(w), 448, lo, hi) == get_optimal_tiled_canvas((int(h), int(w)), (448, 448),
                                                                                        lo, hi)


def test_two_images_match_processor(ckpt, hf, ours):
    _, hf_proc = hf
    _, proc = ours
    images = [_image(100, 150, seed=5), _image(40, 40, seed=6)]
    ref = _hf_inputs(hf_proc, images)
    vision = proc.prepare(images)
    assert vision.pixel_values.shape == ref["pixel_values"].shape  # 7 + 1 tiles
    assert float((vision.pixel_values - ref["pixel_values"]).abs().max()) <= 1e-5
    assert vision.tokens_per_item == [7 * IMAGE_SEQ_LEN, IMAGE_SEQ_LEN]
    assert _our_ids(ckpt, proc, vision) == ref["input_ids"][0].tolist()


def test_prompt_string_and_resolution_rung(ours):
    _, proc = ours
    vision = proc.prepare([_image(100, 150)])
    assert vision.input_sizes_px == [(64, 96)]
    assert proc.expand_prompt("A<IMG_CONTEXT>\nB", vision) == "A<img>" + "<IMG_CONTEXT>" * 28 + "</img>\nB"
    one = proc.prepare([_image(100, 150)], resolution_px=TILE_PX)  # a rung of one tile: max_patches 1
    assert one.pixel_values.shape == (1, 3, TILE_PX, TILE_PX) and one.tokens_per_item == [IMAGE_SEQ_LEN]
    four = proc.prepare([_image(100, 150)], resolution_px=2 * TILE_PX)  # max_patches 4: 2 x 2 + thumbnail
    assert four.pixel_values.shape[0] == 5


# ---- model parity ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(100, 150), (77, 45)])
def test_prefill_logits_match_transformers(ckpt, hf, ours, size):
    """(100, 150): non-square; (77, 45): neither side a multiple of the 32 px tile."""
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


def test_internvl3_5_qwen3_decoder_and_layer_norm_tower_match_transformers(tmp_path):
    """InternVL3.5's layout: a Qwen3 decoder (q/k norm, no bias), here with an untied head, an RMSNorm
    tower without q/k norm and a final LayerNorm (use_mean_pooling false), features of the last
    block through it, and of block 1 (vision_feature_layer -2)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from edgevlm.runtime.models.base import VisionInput

    for layer, pooling, norm in ((-1, False, "rms_norm"), (-2, True, "layer_norm")):
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=TILE_PX, patch_size=PATCH_PX, norm_type=norm, use_mean_pooling=pooling,
                      attention_bias=True)
        text = dict(model_type="qwen3", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        torch.manual_seed(0)
        ref = InternVLForConditionalGeneration(InternVLConfig(
            vision_config=vision, text_config=text, image_token_id=7, vision_feature_layer=layer,
            tie_word_embeddings=False)).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        folder = tmp_path / f"l{-layer}"
        ref.save_pretrained(folder)
        cfg = parse_config(json.loads((folder / "config.json").read_text()))
        assert cfg.text.qk_norm and not cfg.text.qkv_bias and not cfg.tie_word_embeddings
        from safetensors.torch import load_file

        state = {}
        for key, t in load_file(str(folder / "model.safetensors")).items():
            for pattern, repl in WEIGHT_RULES:
                if re.search(pattern, key):
                    if repl is not None:
                        state[re.sub(pattern, repl, key)] = t
                    break
        model = InternVLModel(cfg).eval()
        model.load_state_dict(state, strict=True)
        model.setup_caches(1, 64)
        ids = torch.tensor([[1, 2, 3] + [7] * 2 * IMAGE_SEQ_LEN + [4, 5]])
        pixels = torch.randn(2, 3, TILE_PX, TILE_PX)
        with torch.no_grad():
            ref_logits = ref(input_ids=ids, pixel_values=pixels).logits
            logits = model(ids, VisionInput(pixels, [2 * IMAGE_SEQ_LEN], ["image"]))
        assert max_rel_error(logits, ref_logits) <= TOL, (layer, norm)
        _check_vision_graph(model, pixels)


def _check_vision_graph(model: InternVLModel, pixels: torch.Tensor) -> None:
    """``onnx/vision.onnx`` of ``model``'s weights (the bundle builder's graph) equals its ``encode_tiles``."""
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from edgevlm.quantize.onnx_graph import BundleTensors
    from edgevlm.quantize.onnx_vision_export import build_internvl_vision_graph

    graph = build_internvl_vision_graph(BundleTensors.from_tensors(dict(model.state_dict())), model.cfg)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(["image_features"], {"pixel_values": pixels.numpy()})
    with torch.no_grad():
        want = model.encode_tiles(pixels)
    assert float((torch.from_numpy(got) - want).abs().max() / want.abs().max()) <= 1e-5


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


@pytest.mark.parametrize("size", [(100, 150), (2000, 10)])
def test_engine_ask_answers_as_transformers(engine, hf, size):
    """A non-square frame and a 200:1 one (resized by InternVL's tiling)."""
    assert engine.family.name == "internvl"
    img = _image(*size, seed=3)
    answer = engine.ask(img, QUESTION, max_new_tokens=16)
    expected = _hf_answer(hf, img, 16)
    assert len(answer.text) > 3
    assert _same_answer(answer.text, expected), (answer.text, expected)
    assert answer.stats.vision_tokens == IMAGE_SEQ_LEN * engine.processor.prepare([img]).pixel_values.shape[0]


def test_engine_ask_about_frames_answers_as_transformers_images(engine, hf):
    """No video: a list of frames is several images, one <IMG_CONTEXT> part each, in order."""
    frames = [_image(100, 150, seed=5), _image(60, 40, seed=6)]
    answer = engine.ask(frames, QUESTION, max_new_tokens=12, frame_timestamps_s=[0.0, 0.5])
    assert _same_answer(answer.text, _hf_answer(hf, frames, 12))
    assert answer.stats.vision_tokens == engine.processor.prepare(frames).num_tokens
    with pytest.raises(InvalidRequestError, match="internvl family takes several images, at most 8 frame"):
        engine.ask(frames * 5, QUESTION)


def test_early_exit_without_exit_heads_is_refused_in_one_line(engine):
    from edgevlm.types import OperatingPoint

    engine.backend.model.attach_exit_heads(None)
    with pytest.raises(InvalidRequestError, match="no exit heads"):
        engine.ask(_image(32, 32), QUESTION, max_new_tokens=2, operating_point=OperatingPoint(name="x", exit_layer=1))


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


# ---- INT4 bundle -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_int4_bundle_with_onnx_graphs_loads_and_answers(ckpt, engine, method, tmp_path, caplog):
    """``edgevlm quantize`` (W4A16 RTN / AWQ with the demo calibration scenes on the decoder, the vision
    tower 16-bit): the bundle loads through the registry and answers; ``onnx/vision.onnx`` and
    ``onnx/decoder.onnx`` are built and checked against PyTorch at build time (no warning), and
    ``--backend onnx`` answers as the torch backend."""
    from edgevlm.quantize.build import BuildOptions, build_bundle
    from edgevlm.runtime import Engine
    from edgevlm.runtime.bundle import read_manifest

    with caplog.at_level("WARNING", logger="edgevlm.quantize.build"):
        result = build_bundle(ckpt, tmp_path / "bundle", BuildOptions(method=method, group_size=32, calib="demo",
                                                                      calib_samples=2, awq_grid=4))
    assert not [r for r in caplog.records if "onnx" in r.getMessage().lower()]
    manifest = read_manifest(result.bundle_dir)
    assert manifest.artifacts["onnx"] == "onnx/"
    check = manifest.onnx_check
    assert check is not None and check.passed and check.decoder and len(check.vision) == 2
    assert check.max_error < 1e-4
    int4 = [d for d in manifest.layers if d.action == "int4"]
    assert int4 and all(d.name.startswith("language_model.layers.") and d.group_size == 32 for d in int4)
    assert all(d.method == method for d in int4)
    if method == "awq":
        assert manifest.calibration.samples == 2 and manifest.calibration.tokens > 0
        assert all(d.awq_alpha is not None for d in int4)
    assert any(d.action == "keep" and d.name.startswith("vision_tower.") for d in manifest.layers)
    q = Engine.load(result.bundle_dir, device="cpu", dtype="float32")
    assert sum(type(m).__name__ == "Int4Linear" for m in q.backend.model.modules()) == len(int4)
    img = _image(100, 150, seed=8)
    answer = q.ask(img, QUESTION, max_new_tokens=4)
    assert answer.stats.new_tokens >= 1 and answer.stats.vision_tokens == engine.ask(img, QUESTION, max_new_tokens=1
                                                                                      ).stats.vision_tokens
    vision = q.processor.prepare([img])
    ids = torch.tensor([q.tokenizer.encode_request(QUESTION, vision, q.processor)])
    with torch.no_grad():
        got = q.backend.model.prefill(q.backend.model.embed(ids, q.backend.model.encode_vision(vision)))[0]
        want = engine.backend.model.prefill(engine.backend.model.embed(
            ids, engine.backend.model.encode_vision(vision)))[0]
    cos = float(torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=0))
    assert 0.9 < cos < 1.0  # quantized (not identical), still close on random tiny weights
    if method == "rtn":
        onnx = Engine.load(result.bundle_dir, backend="onnx")
        for size in ((100, 150), (32, 32)):
            img = _image(*size, seed=9)
            assert onnx.ask(img, QUESTION, max_new_tokens=8).text == q.ask(img, QUESTION, max_new_tokens=8).text


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(1, 1), (1, 2000), (2000, 1), (3, 600), (5000, 25)])
def test_tiny_and_extreme_aspect_images_are_resized(ours, size):
    """Smaller than a patch, or 200:1 and beyond: resized by InternVL's tiling into whole tiles."""
    model, proc = ours
    vision = proc.prepare([_image(*size)])
    n = vision.pixel_values.shape[0]
    assert vision.pixel_values.shape[1:] == (3, TILE_PX, TILE_PX) and 1 <= n <= MAX_TILES + 1
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


def test_video_and_placeholder_mismatch_are_invalid_request(ckpt, ours):
    _, proc = ours
    with pytest.raises(InvalidRequestError, match="video: internvl models take images only"):
        proc.prepare([], video=[_image(32, 32)] * 4, video_timestamps_s=[0.0, 0.5, 1.0, 1.5])
    vision = proc.prepare([_image(32, 32)])
    with pytest.raises(InvalidRequestError, match="2 <IMG_CONTEXT> placeholders for 1 images"):
        proc.expand_prompt("<IMG_CONTEXT><IMG_CONTEXT>", vision)
    with pytest.raises(InvalidRequestError, match="placeholders"):
        _our_ids(ckpt, proc, vision, question="look: <IMG_CONTEXT>")
    with pytest.raises(InvalidRequestError, match="resolution_px"):
        proc.prepare([_image(32, 32)], resolution_px=0)


# ---- config ------------------------------------------------------------------------------------

def test_config_fields(ckpt):
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    assert cfg.tie_word_embeddings and cfg.scale_factor == 2 and cfg.image_seq_len == IMAGE_SEQ_LEN
    assert cfg.vision.use_qk_norm and cfg.vision.patch_size == PATCH_PX and cfg.feature_index == 2
    assert cfg.text.qkv_bias and not cfg.text.qk_norm  # Qwen2
    assert cfg.video_token_id is None and cfg.resolution_ladder == ()


#: config.json of OpenGVLab/InternVL3-1B-hf as transformers 5.24 reads it (sizes of the model card:
#: InternViT-300M at 448 px, Qwen2.5-0.5B), keys at their defaults left out; one copy, the bench's
INTERNVL3_1B_CONFIG = {k: v for k, v in CONFIGS["internvl3-1b"].items() if k != "tie_word_embeddings"}


def test_hub_internvl3_1b_config_reads_as_transformers_does():
    ref = transformers.InternVLConfig(**INTERNVL3_1B_CONFIG)
    cfg = parse_config(INTERNVL3_1B_CONFIG)
    rv, rt = ref.vision_config, ref.text_config
    assert (cfg.vision.hidden_size, cfg.vision.num_hidden_layers, cfg.vision.image_size, cfg.vision.patch_size,
            cfg.vision.layer_norm_eps, cfg.vision.attention_bias) == (
        rv.hidden_size, rv.num_hidden_layers, rv.image_size[0], rv.patch_size[0], rv.layer_norm_eps, rv.attention_bias)
    assert (cfg.text.hidden_size, cfg.text.num_key_value_heads, cfg.text.head_dim, cfg.text.rope_theta) == (
        rt.hidden_size, rt.num_key_value_heads, rt.hidden_size // rt.num_attention_heads, 1000000.0)
    assert cfg.image_seq_len == ref.image_seq_length == 256 and cfg.tie_word_embeddings == ref.tie_word_embeddings
    with torch.device("meta"):
        model = InternVLModel(cfg)
    assert model.multi_modal_projector.linear_1.weight.shape == (896, 4096)


@pytest.mark.parametrize(("patch", "message"), [
    ({"model_type": "llava"}, "model_type 'llava' is not supported (internvl)"),
    ({"downsample_ratio": 0.3}, "downsample_ratio 0.3 does not merge whole patches"),
    ({"downsample_ratio": "0.5"}, "downsample_ratio must be a number"),
    ({"image_token_id": 10**6}, "image_token_id 1000000 is not a token id"),
    ({"vision_feature_layer": [-1, -2]}, "vision_feature_layer [-1, -2] is not supported"),
    ({"vision_feature_layer": 0}, "vision_feature_layer 0 selects the patch embeddings"),
    ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full' is not supported"),
    ({"projector_hidden_act": "swish"}, "projector_hidden_act 'swish' is not supported"),
    ({"vision_config": {"model_type": "clip_vision_model"}}, "vision_config.model_type 'clip_vision_model'"),
    ({"vision_config": {"norm_type": "batch_norm"}}, "vision_config.norm_type 'batch_norm' is not supported"),
    ({"vision_config": {"image_size": [448, 224]}}, "vision_config.image_size [448, 224] is not square"),
    ({"text_config": {"model_type": "gpt_oss"}}, "text_config.model_type 'gpt_oss' is not supported"),
    ({"text_config": []}, "text_config must be an object"),
])
def test_bad_config_names_the_key(ckpt, patch, message):
    raw = json.loads((ckpt / "config.json").read_text())
    for key in ("vision_config", "text_config"):
        if isinstance(patch.get(key), dict):
            patch = {**patch, key: {**raw[key], **patch[key]}}
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        parse_config({**raw, **patch})


def test_registry_serves_internvl_and_names_it_when_refusing():
    from edgevlm.runtime.models import family_for

    assert family_for({"model_type": "internvl"}).name == "internvl"
    with pytest.raises(ModelLoadError, match=re.escape("internvl (internvl)")):
        family_for({"model_type": "paligemma"})


def test_processor_settings_that_disagree_name_the_key(ckpt, tmp_path):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(ckpt, folder)
    cfg = parse_config(json.loads((folder / "config.json").read_text()))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    with pytest.raises(ModelLoadError, match="image_seq_length 256 disagrees"):
        InternVLProcessor.from_dir(folder, cfg)
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": IMAGE_SEQ_LEN}))
    with pytest.raises(ModelLoadError, match="size .* is not the encoder's 32x32 px tile"):
        InternVLProcessor.from_dir(folder, cfg, {**pre, "size": {"height": 448, "width": 448}})
    with pytest.raises(ModelLoadError, match="min_patches 3 / max_patches 2"):
        InternVLProcessor.from_dir(folder, cfg, {**pre, "min_patches": 3, "max_patches": 2})


# ---- early exit and token pruning (edgevlm.runtime.adaptive) -----------------------------------

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

    from edgevlm.runtime.models.internvl.vision import tiles_to_tokens
    from edgevlm.types import OperatingPoint

    model = engine.backend.model
    heads = _random_heads(engine, [1])
    vision = engine.processor.prepare([_image(100, 150)])
    with torch.no_grad():
        tokens, info = model.encode_vision_adaptive(vision, OperatingPoint(name="x", exit_layer=1))
        tower = copy.deepcopy(model.vision_tower)
        tower.encoder.layer = tower.encoder.layer[:1]
        tower.layernorm = torch.nn.Sequential(heads.adapters["1"], tower.layernorm)
        want = tiles_to_tokens(tower(vision.pixel_values, 1), model.multi_modal_projector, 2).reshape(-1, 64)
        full = model.encode_vision(vision)
        last, last_info = model.encode_vision_adaptive(vision, OperatingPoint(name="x", exit_layer=2))
    assert info.exit_layers == [1] and info.blocks_run == 1
    torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    assert (tokens - full).abs().max() > 1e-3  # the exit really changed the features
    assert last_info.exit_layers == [None] and torch.equal(last, full)  # at the last block: the full tower
    model.attach_exit_heads(None)


def test_confidence_head_reads_the_thumbnail_with_its_cls_token(engine):
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
    assert x.shape[:2] == (1, 1 + grid[0] * grid[1]) and grid == (4, 4)
    assert info.exit_layers == [1] and info.exit_confidences[0] == pytest.approx(want, abs=1e-6)
    model.attach_exit_heads(None)


def test_pruning_keeps_each_tiles_share_by_norm_and_the_prompt_matches(engine):
    from edgevlm.types import OperatingPoint

    model = engine.backend.model
    op = OperatingPoint(name="k", keep_ratio=0.5)
    image = _image(100, 150, 5)
    p = engine.prepare(image, QUESTION, operating_point=op)
    with torch.no_grad():
        full = model.encode_vision(p.vision)
        tokens, info = model.encode_vision_adaptive(p.vision, op)
    index = torch.tensor(info.kept_index[0])
    assert tokens.shape[0] == p.n_vision == 7 * 2  # 7 tiles, 2 of 4 tokens each
    torch.testing.assert_close(tokens, full[index])
    norms = full.norm(dim=-1)
    for t in range(7):
        kept = index[(index >= 4 * t) & (index < 4 * t + 4)]
        assert len(kept) == 2 and float(norms[kept].min()) >= float(norms[4 * t:4 * t + 4].sort().values[1])
    assert sum(1 for i in p.ids if i == engine.config.image_token_id) == p.n_vision
    answer = engine.ask(image, QUESTION, max_new_tokens=3, operating_point=op)
    assert answer.stats.vision_tokens == 14 and answer.stats.new_tokens >= 1


def test_calibrate_then_ask_with_the_exit(ckpt, tmp_path, capsys):
    """``edgevlm calibrate`` writes exit heads for InternViT (CLS token kept) and ``edgevlm ask``
    runs them."""
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
    assert spec.has_cls_token is True and spec.exit_blocks == [1] and spec.vision_blocks == 2
    path = tmp_path / "frame.png"
    Image.fromarray(_image(96, 128, 8)).save(path)
    capsys.readouterr()
    assert main(["ask", "--image", str(path), "--model", str(model), "--json", "--max-new-tokens", "3",
                 "--exit-layer", "1", "--keep-ratio", "0.5", QUESTION]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["exit_layer"] == 1 and stats["vision_tokens"] == 7 * 2  # 3 x 2 tiles + thumbnail, half each


#: preprocessor_config.json of OpenGVLab/InternVL3-1B-hf (GotOcr2ImageProcessorFast's keys as saved)
INTERNVL3_1B_PREPROCESSOR = {
    "crop_size": None, "crop_to_patches": False, "data_format": "channels_first", "default_to_square": True,
    "device": None, "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
    "do_resize": True, "image_mean": [0.485, 0.456, 0.406], "image_processor_type": "GotOcr2ImageProcessorFast",
    "image_std": [0.229, 0.224, 0.225], "input_data_format": None, "max_patches": 12, "min_patches": 1,
    "processor_class": "InternVLProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
    "return_tensors": None, "size": {"height": 448, "width": 448},
}


def test_hub_internvl3_1b_processor_settings(tmp_path):
    """The hub's settings read as transformers' processor runs them: 448 px tiles, up to 12 + a
    thumbnail (``InternVLProcessor`` turns ``crop_to_patches`` on), bicubic, ImageNet mean/std."""
    cfg = parse_config(INTERNVL3_1B_CONFIG)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256,
                                                                "processor_class": "InternVLProcessor"}))
    ic = InternVLProcessor.from_dir(tmp_path, cfg, INTERNVL3_1B_PREPROCESSOR).image_cfg
    assert (ic.tile_px, ic.crop_to_patches, ic.min_patches, ic.max_patches, ic.resample, ic.image_seq_len) == (
        448, True, 1, 12, 3, 256)
    assert ic.image_mean == (0.485, 0.456, 0.406) and ic.image_std == (0.229, 0.224, 0.225)
    vision = InternVLProcessor(cfg, ic).prepare([_image(480, 640)])
    assert vision.pixel_values.shape == (13, 3, 448, 448) and vision.tokens_per_item == [13 * 256]  # 4 x 3 + 1
