"""Qwen2.5-VL against transformers (fp32, CPU): preprocessing, position ids, vision tower, prefill logits,
greedy decoding, and bad input.

The checkpoint is tiny and random but has the real structure: built with transformers'
``Qwen2_5_VLConfig`` + ``save_pretrained``, a byte-level BPE tokenizer holding Qwen's special tokens
(``tests/models/conftest.py``), the hub's chat template and ``preprocessor_config.json`` keys. Window
attention is present: ``window_size`` 56 px = 2x2 merged patches, full attention only in blocks 1 and 3
of 4, so a 112 x 196 px image splits into 8 windows.
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

from parity_support import map_checkpoint  # noqa: E402

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError  # noqa: E402
from edgevlm.runtime.models.qwen2_5_vl.config import parse_config  # noqa: E402
from edgevlm.runtime.models.qwen2_5_vl.model import Qwen25VLModel  # noqa: E402
from edgevlm.runtime.models.qwen2_5_vl.processor import Qwen25VLProcessor  # noqa: E402
from edgevlm.runtime.models.qwen2_5_vl.vision import vision_layout  # noqa: E402
from edgevlm.runtime.models.qwen2_5_vl.weights import WEIGHT_RULES  # noqa: E402
from edgevlm.runtime.models.qwen_vl.preprocess import (  # noqa: E402
    QwenPixelConfig,
    read_pixel_configs,
    sample_frame_indices,
    smart_resize,
)

QUESTION = "how many shapes are there?"
IMAGE_SIZES = [(120, 200), (100, 100)]  # (H, W): non-square; not a multiple of 28 px
REL_TOL = 1e-4


def _tokenizer_builder():
    """tests/models/conftest.py's builder, loaded by path (pytest's importlib mode gives conftest
    modules no importable name)."""
    spec = importlib.util.spec_from_file_location("qwen_tokenizer_builder", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_qwen_tokenizer


#: preprocessor_config.json as Qwen/Qwen2.5-VL-*-Instruct ships it (max_pixels 12845056).
HUB_PREPROCESSOR_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


def write_tiny_qwen2_5_vl(folder: Path, seed: int = 0, tie: bool = False) -> Path:
    """Write the checkpoint into ``folder`` and return it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = _tokenizer_builder()(folder)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1, 3], tokens_per_second=2, in_channels=3),
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         tie_word_embeddings=tie),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger than the 0.02 init, so that logits are not near-uniform (greedy ties)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(HUB_PREPROCESSOR_CONFIG, indent=2))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    gen.pop("bos_token_id", None)
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def ref(ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


class _Files:  # the two ModelFiles fields the processor reads
    def __init__(self, folder):
        self.model_dir = folder
        self.config = parse_config(json.loads((folder / "config.json").read_text()))


@pytest.fixture(scope="module")
def proc(ckpt):
    return Qwen25VLProcessor.from_files(_Files(ckpt))


def load_model(folder) -> Qwen25VLModel:
    """Our model with the checkpoint's weights mapped through WEIGHT_RULES (first rule that matches)."""
    from safetensors.torch import load_file

    model = Qwen25VLModel(parse_config(json.loads((folder / "config.json").read_text())))
    state = map_checkpoint(load_file(folder / "model.safetensors"), WEIGHT_RULES, every_key_ruled=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "language_model.lm_head.weight" for k in missing), (missing, unexpected)
    model.eval()
    model.setup_caches(1, 1024)
    return model


@pytest.fixture(scope="module")
def ours(ckpt):
    return load_model(ckpt)


def image(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def video_frames(n=4, h=84, w=112, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def chat_text(hf_tok, parts):
    messages = [{"role": "user", "content": [{"type": p} for p in parts] + [{"type": "text", "text": QUESTION}]}]
    return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def ref_inputs(ckpt, hf_tok, vision, text):
    ids = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]])
    cfg = json.loads((ckpt / "config.json").read_text())
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == cfg["image_token_id"]] = 1
    types[ids == cfg["video_token_id"]] = 2
    kw = {"input_ids": ids, "mm_token_type_ids": types, "attention_mask": torch.ones_like(ids)}
    img = [i for i, k in enumerate(vision.kinds) if k == "image"]
    vid = [i for i, k in enumerate(vision.kinds) if k == "video"]
    starts = np.cumsum([0] + [int(np.prod(g)) for g in vision.grid_thw.tolist()])
    if img:
        kw["pixel_values"] = torch.cat([vision.pixel_values[starts[i]:starts[i + 1]] for i in img])
        kw["image_grid_thw"] = vision.grid_thw[img]
    if vid:
        kw["pixel_values_videos"] = torch.cat([vision.pixel_values[starts[i]:starts[i + 1]] for i in vid])
        kw["video_grid_thw"] = vision.grid_thw[vid]
        kw["second_per_grid_ts"] = torch.tensor([vision.extras["second_per_grid_ts"][i] for i in vid])
    return kw


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ---- config -----------------------------------------------------------------------------------------

def test_config_reads_the_real_structure(ckpt):
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    assert cfg.text.qkv_bias and not cfg.text.o_bias
    assert cfg.text.mrope_section == (2, 3, 3) and cfg.text.rope_theta == 1e6
    assert cfg.vision.fullatt_block_indexes == (1, 3) and cfg.vision.window_units == 2
    assert cfg.image_token_id == 312 and cfg.video_token_id == 313


def test_config_reads_the_hub_4x_layout(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    legacy = dict(raw, **{k: v for k, v in text.items() if k != "model_type"},
                  rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    legacy["vision_config"] = dict(raw["vision_config"], in_chans=3)
    legacy["vision_config"].pop("in_channels")
    assert parse_config(legacy) == parse_config(json.loads((ckpt / "config.json").read_text()))


@pytest.mark.parametrize(("path", "value", "needle"), [
    (("vision_config", "fullatt_block_indexes"), [9], "vision_config.fullatt_block_indexes"),
    (("vision_config", "window_size"), 10, "vision_config.window_size"),
    (("vision_config", "hidden_act"), "swish3", "vision_config.hidden_act"),
    (("text_config", "rope_parameters"), {"rope_type": "default", "rope_theta": 1e6}, "mrope_section"),
    (("image_token_id",), 4000, "image_token_id"),
])
def test_config_error_names_the_key(ckpt, path, value, needle):
    raw = json.loads((ckpt / "config.json").read_text())
    d = raw
    for key in path[:-1]:
        d = d[key]
    d[path[-1]] = value
    with pytest.raises(ModelLoadError, match=re.escape(needle)):
        parse_config(raw)


def test_processor_config_nested_and_missing(tmp_path, caplog):
    nested = {"image_processor": {"size": {"shortest_edge": 1000, "longest_edge": 50000}, "image_mean": [0.5] * 3,
                                  "image_std": [0.25] * 3, "patch_size": 14, "merge_size": 2},
              "video_processor": {"size": {"shortest_edge": 2000, "longest_edge": 60000}, "fps": 2.0,
                                  "do_sample_frames": True}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    image, video = read_pixel_configs(tmp_path, patch_size=14, temporal_patch_size=2, merge_size=2)
    assert (image.min_pixels, image.max_pixels, image.image_mean, image.image_std) == (1000, 50000, (0.5,) * 3, (0.25,) * 3)
    assert (video.min_pixels, video.max_pixels, video.fps, video.do_sample_frames) == (2000, 60000, 2.0, True)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 16}}))
    with pytest.raises(ModelLoadError, match="patch_size 16 differs"):
        read_pixel_configs(tmp_path, patch_size=14, temporal_patch_size=2, merge_size=2)
    (tmp_path / "processor_config.json").unlink()
    with caplog.at_level("WARNING"):
        image, video = read_pixel_configs(tmp_path, patch_size=14, temporal_patch_size=2, merge_size=2)
    assert "no processor_config.json or preprocessor_config.json" in caplog.text
    assert video.min_pixels == 128 * 28 * 28  # the video processor's own defaults


# ---- preprocessing vs transformers ------------------------------------------------------------------

@pytest.mark.parametrize(("h", "w"), IMAGE_SIZES + [(5, 7), (30, 3000)])
def test_pixels_equal_transformers_image_processor(ckpt, proc, h, w):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
    img = image(h, w)
    want = hf(images=[img], return_tensors="pt")
    got = proc.prepare([img])
    assert got.grid_thw.tolist() == want["image_grid_thw"].tolist()
    assert got.pixel_values.shape == want["pixel_values"].shape
    assert float((got.pixel_values - want["pixel_values"]).abs().max()) <= 1e-5
    assert got.tokens_per_item == [int(want["image_grid_thw"].prod()) // 4]


def hf_image_processor(ckpt, video_output: dict | None = None):
    """transformers' Qwen2_5_VLProcessor with its Pillow image processor. Its video processor needs
    torchvision (absent in CI): a stand-in returning ``video_output`` (our video pixels, grid and the
    frames' metadata) takes its place, so the prompt expansion, the image pixels and
    ``second_per_grid_ts`` come from transformers' own code."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class _NoVideo:
        merge_size = 2
        temporal_patch_size = 2

        def __call__(self, videos, **kwargs):
            return dict(video_output)

    check = ProcessorMixin.check_argument_for_proper_class
    try:  # the class check looks the video processor up in a registry that needs torchvision
        ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: type(arg)
        return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(ckpt),
                                   tokenizer=AutoTokenizer.from_pretrained(ckpt), video_processor=_NoVideo(),
                                   chat_template=(ckpt / "chat_template.jinja").read_text())
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


@pytest.mark.parametrize(("h", "w"), IMAGE_SIZES)
def test_token_ids_and_pixels_equal_transformers_processor(ckpt, proc, h, w):
    from tokenizers import Tokenizer

    hf = hf_image_processor(ckpt)
    img = image(h, w)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = hf(text=[text], images=[img], return_tensors="pt")
    vision = proc.prepare([img])
    got = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(proc.expand_prompt(text, vision),
                                                                   add_special_tokens=False).ids
    assert got == want["input_ids"][0].tolist()
    assert got.count(proc.cfg.image_token_id) == vision.tokens_per_item[0] > 1
    assert vision.grid_thw.tolist() == want["image_grid_thw"].tolist()
    assert float((vision.pixel_values - want["pixel_values"]).abs().max()) <= 1e-5


def test_full_transformers_processor_when_torchvision_is_installed(ckpt, proc):
    """transformers' Qwen2_5_VLProcessor needs torchvision (its video processor); where it is installed,
    compare an image + 4-frame video prompt end to end: video pixels, grids, second_per_grid_ts, token ids."""
    pytest.importorskip("torchvision")
    from tokenizers import Tokenizer
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    hf = AutoProcessor.from_pretrained(ckpt)
    frames = video_frames()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = hf(text=[text], images=[image(120, 200)], videos=[np.stack(frames)], return_tensors="pt",
              video_metadata=[VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])],
              do_sample_frames=False, cap_pixels_per_frame=False)
    got = proc.prepare([image(120, 200)], video=frames, video_timestamps_s=[0.0, 0.5, 1.0, 1.5])
    assert got.grid_thw.tolist() == want["image_grid_thw"].tolist() + want["video_grid_thw"].tolist()
    n_img = int(want["image_grid_thw"].prod())
    assert float((got.pixel_values[:n_img] - want["pixel_values"]).abs().max()) <= 0.1  # torchvision backend
    assert float((got.pixel_values[n_img:] - want["pixel_values_videos"]).abs().max()) <= 1e-5
    assert got.extras["second_per_grid_ts"][1] == pytest.approx(float(want["second_per_grid_ts"][0]))
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(proc.expand_prompt(text, got),
                                                                   add_special_tokens=False).ids
    assert ids == want["input_ids"][0].tolist()


def test_video_patchify_repeats_an_odd_last_frame(proc):
    four = proc.prepare([], video=video_frames(4))
    three = proc.prepare([], video=video_frames(4)[:3])
    assert four.grid_thw.tolist() == three.grid_thw.tolist()  # 3 frames -> 2 temporal patches
    p, tp = 14, 2
    rows = three.pixel_values.reshape(-1, 3, tp, p, p)
    n_first = int(np.prod(three.grid_thw[0, 1:].tolist()))
    last = rows[n_first:]  # second temporal patch: frame 2 and its copy
    assert torch.equal(last[:, :, 0], last[:, :, 1])
    assert torch.equal(four.pixel_values[:n_first], three.pixel_values[:n_first])


def test_frame_sampling_rules():
    cfg = QwenPixelConfig(min_frames=4, max_frames=768)
    assert sample_frame_indices(30, video_fps=10.0, cfg=cfg, fps=2.0) == [0, 5, 10, 15, 20, 25]
    assert sample_frame_indices(10, video_fps=10.0, cfg=cfg, fps=1.0) == [0, 2, 5, 7]  # min_frames 4
    assert sample_frame_indices(9, video_fps=None, cfg=cfg, num_frames=5) == [0, 2, 4, 6]  # round(2.5) * 2 = 4
    assert sample_frame_indices(7, video_fps=None, cfg=cfg) == list(range(7))
    with pytest.raises(InvalidRequestError, match="timestamps"):
        sample_frame_indices(30, video_fps=None, cfg=cfg, fps=2.0)


# ---- model vs transformers ----------------------------------------------------------------------------

def test_window_attention_splits_the_grid(proc, ours):
    vision = proc.prepare([image(120, 200)])  # 112 x 196 px: 8 x 14 patches, 4 x 7 merged units
    layout = vision_layout(vision.grid_thw, ours.cfg.vision)
    assert layout.cu_window_seqlens.numel() - 1 == 8  # 2 x 4 windows of <= 2 x 2 merged units
    assert layout.cu_seqlens.tolist() == [0, 112]
    assert not torch.equal(layout.window_index, torch.arange(28))


def test_position_ids_equal_transformers(ckpt, proc, hf_tok, ref, ours):
    # 0.5 fps: a temporal patch spans 4 s = 8 positions at tokens_per_second 2
    vision = proc.prepare([image(120, 200)], video=video_frames(), video_timestamps_s=[0.0, 2.0, 4.0, 6.0])
    text = proc.expand_prompt(chat_text(hf_tok, ["image", "video"]), vision)
    kw = ref_inputs(ckpt, hf_tok, vision, text)
    want, want_delta = ref.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"], kw["image_grid_thw"],
                                                kw["video_grid_thw"], kw["second_per_grid_ts"])
    got, delta = ours.position_ids(kw["input_ids"], vision)
    assert torch.equal(got, want)
    assert delta == int(want_delta)
    video_t = got[0, 0][kw["input_ids"][0] == ours.cfg.video_token_id].unique()
    assert (video_t[1:] - video_t[:-1]).tolist() == [8]  # temporal positions follow the timestamps


@pytest.mark.parametrize("case", ["image_120x200", "image_100x100", "video_4_frames"])
def test_prefill_logits_match_transformers(ckpt, proc, hf_tok, ref, ours, case):
    if case.startswith("image"):
        h, w = (int(v) for v in case.split("_")[1].split("x"))
        vision, parts = proc.prepare([image(h, w)]), ["image"]
    else:
        vision = proc.prepare([], video=video_frames(), video_timestamps_s=[0.0, 0.5, 1.0, 1.5])
        parts = ["video"]
    text = proc.expand_prompt(chat_text(hf_tok, parts), vision)
    kw = ref_inputs(ckpt, hf_tok, vision, text)
    with torch.no_grad():
        want = ref(**kw).logits
        got = ours(kw["input_ids"], vision)
    assert got.shape == want.shape
    assert rel_err(got, want) <= REL_TOL


@pytest.mark.parametrize("case", ["image", "video"])
def test_greedy_tokens_equal_transformers_generate(ckpt, proc, hf_tok, ref, ours, case):
    if case == "image":
        vision, parts = proc.prepare([image(120, 200, seed=3)]), ["image"]
    else:
        vision, parts = proc.prepare([], video=video_frames(seed=4), video_timestamps_s=[0.0, 0.5, 1.0, 1.5]), ["video"]
    text = proc.expand_prompt(chat_text(hf_tok, parts), vision)
    kw = ref_inputs(ckpt, hf_tok, vision, text)
    with torch.no_grad():
        want = ref.generate(**kw, max_new_tokens=16, do_sample=False)[0, kw["input_ids"].shape[1]:].tolist()
        ids = kw["input_ids"]
        positions, delta = ours.position_ids(ids, vision)
        logits = ours.prefill(ours.embed(ids, ours.encode_vision(vision)), position_ids=positions)
        got = []
        eos = set(ref.generation_config.eos_token_id)
        slot = ids.shape[1]
        while len(got) < 16:
            token = int(logits.argmax(-1))
            got.append(token)
            if token in eos:
                break
            logits = ours.decode(torch.tensor([[token]]), torch.tensor([slot]), rope_offset=delta)
            slot += 1
    assert got == want
    assert len(got) == 16  # no early EOS: 16 compared tokens


# ---- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("h", "w"), [(1, 1), (3, 20), (10, 10), (1, 150), (150, 1)])
def test_small_and_thin_images_are_resized_by_the_rules(proc, ours, h, w):
    vision = proc.prepare([image(h, w)])
    t, gh, gw = vision.grid_thw[0].tolist()
    assert t == 1 and gh >= 2 and gw >= 2 and gh % 2 == 0 and gw % 2 == 0
    assert vision.pixel_values.shape[0] == gh * gw > 0
    assert ours.encode_vision(vision).shape == (gh * gw // 4, 64)


@pytest.mark.parametrize(("h", "w"), [(1, 201), (300, 1), (2, 1000)])
def test_aspect_ratio_above_200_is_an_invalid_image(proc, h, w):
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        proc.prepare([image(h, w)])


def test_not_an_rgb_image_is_an_invalid_image(proc):
    with pytest.raises(InvalidImageError, match="empty image"):
        proc.prepare([np.zeros((0, 5, 3), np.uint8)])
    with pytest.raises(InvalidImageError, match="uint8 RGB"):
        proc.prepare([np.zeros((5, 5), np.uint8)])
    with pytest.raises(InvalidImageError):
        smart_resize(0, 10, 28, 3136, 1 << 20)


def test_bad_video_and_placeholders_are_invalid_requests(proc, hf_tok):
    with pytest.raises(InvalidRequestError, match="timestamps"):
        proc.prepare([], video=video_frames(), video_timestamps_s=[0.0, 1.0])
    with pytest.raises(InvalidRequestError, match="increase"):
        proc.prepare([], video=video_frames(), video_timestamps_s=[0.0, 1.0, 1.0, 2.0])
    with pytest.raises(InvalidRequestError, match="differ in size"):
        proc.prepare([], video=video_frames(2) + video_frames(2, h=56))
    vision = proc.prepare([image(100, 100)])
    with pytest.raises(InvalidRequestError, match="placeholders"):
        proc.expand_prompt(chat_text(hf_tok, ["image"]).replace(QUESTION, "<|image_pad|>"), vision)


def test_resolution_rung_is_a_max_pixels_step(proc):
    img = image(480, 640)
    full = proc.prepare([img])
    rung = proc.prepare([img], resolution_px=224)
    assert rung.tokens_per_item[0] < full.tokens_per_item[0]
    h, w = rung.input_sizes_px[0]
    assert h * w <= 224 * 224 and abs(w / h - 640 / 480) < 0.25
    assert HUB_PREPROCESSOR_CONFIG["max_pixels"] == proc.image.max_pixels


# ---- shared pieces and the registry ----------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_tables_equal_transformers_rotary_embeddings(interleaved):
    from edgevlm.runtime.models.qwen_vl.rope import mrope_cos_sin

    head_dim, section = 16, [2, 3, 3]
    if interleaved:
        from transformers import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary

        cfg = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                                rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": section,
                                                 "mrope_interleaved": True})
    else:
        from transformers import Qwen2_5_VLTextConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Rotary

        cfg = Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": section})
    rotary = Rotary(cfg)
    positions = torch.randint(0, 300, (3, 1, 40))
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = mrope_cos_sin(positions[:, 0], rotary.inv_freq, tuple(section), interleaved)
    assert torch.allclose(cos, want_cos[0], atol=1e-6) and torch.allclose(sin, want_sin[0], atol=1e-6)


def test_tied_embeddings_checkpoint(tmp_path, hf_tok):
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = write_tiny_qwen2_5_vl(tmp_path / "tied", seed=5, tie=True)
    ours = load_model(folder)
    assert ours.language_model.lm_head.weight is ours.language_model.embed_tokens.weight
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    proc = Qwen25VLProcessor.from_files(_Files(folder))
    vision = proc.prepare([image(120, 200)])
    text = proc.expand_prompt(chat_text(hf_tok, ["image"]), vision)
    kw = ref_inputs(folder, hf_tok, vision, text)
    with torch.no_grad():
        assert rel_err(ours(kw["input_ids"], vision), ref(**kw).logits) <= REL_TOL


def test_family_is_registered():
    from edgevlm.runtime.models import FAMILIES, family_for

    family = family_for({"model_type": "qwen2_5_vl"})
    assert FAMILIES["qwen2_5_vl"] == "edgevlm.runtime.models.qwen2_5_vl"
    with pytest.raises(ModelLoadError, match=r"supported: .*qwen2_5_vl \(qwen2_5_vl\)"):
        family_for({"model_type": "qwen9_vl"})
    assert family.model_types == ("qwen2_5_vl",) and family.supports_video
    assert family.weight_rules is WEIGHT_RULES
    with torch.device("meta"):  # the family builds our model (imported only then: the registry is torch-free)
        assert isinstance(family.build_model(parse_config(HUB_3B_CONFIG)), Qwen25VLModel)


# ---- through the Engine and the CLI -----------------------------------------------------------------------

def hf_answer(ckpt, ref, hf_tok, engine, img, n_new):
    vision = engine.processor.prepare([img])
    text = engine.processor.expand_prompt(chat_text(hf_tok, ["image"]), vision)
    kw = ref_inputs(ckpt, hf_tok, vision, text)
    with torch.no_grad():
        out = ref.generate(**kw, max_new_tokens=n_new, do_sample=False)[0, kw["input_ids"].shape[1]:].tolist()
    return out, engine.tokenizer.decode(out).strip(), vision


@pytest.fixture(scope="module")
def engine(ckpt):
    from edgevlm.runtime.engine import Engine

    return Engine.load(ckpt)


def test_engine_ask_answers_as_transformers(ckpt, ref, hf_tok, engine):
    assert engine.family.name == "qwen2_5_vl"
    img = image(120, 200, seed=3)
    answer = engine.ask(img, QUESTION, max_new_tokens=16)
    ids, want, vision = hf_answer(ckpt, ref, hf_tok, engine, img, 16)
    assert answer.text == want
    assert answer.stats.new_tokens == len(ids) == 16
    assert answer.stats.vision_tokens == vision.num_tokens == 28
    assert (answer.stats.input_height_px, answer.stats.input_width_px) == (112, 196)


def test_cli_ask_with_a_qwen_checkpoint(ckpt, ref, hf_tok, engine, tmp_path, capsys):
    import subprocess
    import sys

    import cv2

    from edgevlm.cli import main

    img = image(120, 200, seed=3)
    png = tmp_path / "frame.png"
    cv2.imwrite(str(png), img[:, :, ::-1])  # RGB -> BGR for OpenCV
    res = subprocess.run([sys.executable, "-m", "edgevlm.cli", "ask", "--model", str(ckpt), "--image", str(png),
                          "--max-new-tokens", "8", "--json", QUESTION],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["answer"] == hf_answer(ckpt, ref, hf_tok, engine, img, 8)[1]
    wide = tmp_path / "wide.png"
    cv2.imwrite(str(wide), np.zeros((2, 500, 3), np.uint8))  # 250:1
    code = main(["ask", "--model", str(ckpt), "--image", str(wide), QUESTION])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("edgevlm: error: ") and "aspect ratio" in err


#: config.json of Qwen/Qwen2.5-VL-3B-Instruct as the hub ships it (transformers 4.x layout).
HUB_3B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}


def test_real_3b_config_builds_the_parameters_transformers_has():
    """The hub's 3B config, and transformers 5's re-save of it, parse to one config whose model (built on
    the meta device) has exactly transformers' parameters, names mapped by WEIGHT_RULES, shapes equal."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = parse_config(HUB_3B_CONFIG)
    resaved = Qwen2_5_VLConfig(**HUB_3B_CONFIG).to_dict()
    assert parse_config(json.loads(json.dumps(resaved))) == cfg
    assert cfg.tie_word_embeddings and cfg.text.head_dim == 128 and cfg.text.num_key_value_heads == 2
    assert cfg.vision.tokens_per_second == 2 and cfg.text.sliding_window is None
    with torch.device("meta"):
        ours = Qwen25VLModel(cfg)
        ref = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**HUB_3B_CONFIG))
    want = {name: tuple(p.shape) for name, p in map_checkpoint(ref.state_dict(), WEIGHT_RULES).items()}
    got = {name: tuple(p.shape) for name, p in ours.state_dict().items()}
    assert got == want


def test_tokenizer_and_model_with_image_and_video_equal_transformers(ckpt, proc, ref):
    """The runtime's tokenizer (chat template with an image and a video content part) + our processor give
    transformers' Qwen2_5_VLProcessor ids, and our model its logits, for an image + 4-frame video prompt."""
    from transformers.video_utils import VideoMetadata

    from edgevlm.runtime.tokenizer import VLMTokenizer

    img, frames = image(120, 200), video_frames()
    vision = proc.prepare([img], video=frames, video_timestamps_s=[0.0, 0.5, 1.0, 1.5])
    n_img = int(vision.grid_thw[0].prod())
    hf = hf_image_processor(ckpt, {"pixel_values_videos": vision.pixel_values[n_img:],
                                   "video_grid_thw": vision.grid_thw[1:],
                                   "video_metadata": [VideoMetadata(total_num_frames=4, fps=2.0,
                                                                    frames_indices=[0, 1, 2, 3])]})
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = hf(text=[text], images=[img], videos=[np.stack(frames)], return_tensors="pt")
    assert want["second_per_grid_ts"].tolist() == vision.extras["second_per_grid_ts"][1:]
    tok = VLMTokenizer.from_dir(ckpt, proc.cfg.image_token_id)
    ids = tok.encode_request(QUESTION, vision, proc)
    assert ids == want["input_ids"][0].tolist()
    ours = load_model(ckpt)
    with torch.no_grad():
        got = ours(torch.tensor([ids]), vision)
        ref_logits = ref(input_ids=want["input_ids"], attention_mask=want["attention_mask"],
                         mm_token_type_ids=want["mm_token_type_ids"], pixel_values=want["pixel_values"],
                         image_grid_thw=want["image_grid_thw"], pixel_values_videos=want["pixel_values_videos"],
                         video_grid_thw=want["video_grid_thw"],
                         second_per_grid_ts=want["second_per_grid_ts"]).logits
    assert rel_err(got, ref_logits) <= REL_TOL


# ---- several frames through the Engine: one video --------------------------------------------------------

def test_engine_ask_about_frames_answers_as_transformers_video(ckpt, ref, hf_tok, engine):
    """A list of frames with capture times goes to Qwen2.5-VL as one video (video pads, M-RoPE over
    time from second_per_grid_ts): the Engine's answer equals transformers' generate on that video."""
    frames, ts = video_frames(4), [10.0, 10.5, 11.0, 11.5]
    answer = engine.ask(frames, QUESTION, max_new_tokens=12, frame_timestamps_s=ts)
    vision = engine.processor.prepare([], video=frames, video_timestamps_s=ts)
    assert vision.kinds == ["video"] and vision.extras["second_per_grid_ts"] == [1.0]  # 2 frames per patch at 2 fps
    kw = ref_inputs(ckpt, hf_tok, vision, engine.processor.expand_prompt(chat_text(hf_tok, ["video"]), vision))
    with torch.no_grad():
        out = ref.generate(**kw, max_new_tokens=12, do_sample=False)[0, kw["input_ids"].shape[1]:].tolist()
    assert answer.text == engine.tokenizer.decode(out).strip()
    assert answer.stats.new_tokens == len(out) and answer.stats.vision_tokens == vision.num_tokens
    # the frame rate reaches the model: the same frames at 1 fps prefill other positions
    slow = engine.prepare(frames, QUESTION, frame_timestamps_s=[0.0, 1.0, 2.0, 3.0])
    assert slow.vision.extras["second_per_grid_ts"] == [2.0]


def test_engine_frames_bad_values_are_invalid_request(engine):
    frames = video_frames(2)
    with pytest.raises(InvalidRequestError, match="must increase"):
        engine.ask(frames, QUESTION, frame_timestamps_s=[1.0, 1.0])
    with pytest.raises(InvalidRequestError, match="one per frame"):
        engine.ask(frames, QUESTION, frame_timestamps_s=[1.0])
    with pytest.raises(InvalidRequestError, match="not one image"):
        engine.ask(frames[0], QUESTION, frame_timestamps_s=[1.0])
    with pytest.raises(InvalidRequestError, match="no frames"):
        engine.ask([], QUESTION)
    with pytest.raises(InvalidRequestError, match="at most 64 frame"):
        engine.ask([frames[0]] * 65, QUESTION)
    with pytest.raises(InvalidImageError):
        engine.ask([frames[0], np.zeros((4, 4), np.uint8)], QUESTION)


def test_vision_cache_answers_as_without_it_for_images_and_video(engine):
    """M-RoPE families: cached vision tokens (image, and a video with its times) give the uncached answers."""
    img, frames, ts = image(120, 200, seed=4), video_frames(4), [0.0, 0.5, 1.0, 1.5]
    questions = [QUESTION, "describe the scene.", "what color is the triangle?", "yes or no?"]
    off = [engine.ask(img, q, max_new_tokens=6).text for q in questions]
    off_video = [engine.ask(frames, q, max_new_tokens=6, frame_timestamps_s=ts).text for q in questions[:2]]
    engine.set_vision_cache(16)
    try:
        assert [engine.ask(img, q, max_new_tokens=6).text for q in questions] == off
        assert [engine.ask(frames, q, max_new_tokens=6, frame_timestamps_s=ts).text for q in questions[:2]] == off_video
        assert (engine.vision_cache.misses, engine.vision_cache.hits) == (2, 4)
    finally:
        engine.set_vision_cache(None)
