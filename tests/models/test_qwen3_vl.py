"""Qwen3-VL parity with transformers (``Qwen3VLForConditionalGeneration`` / ``Qwen3VLProcessor``), fp32, CPU.

A tiny random checkpoint in the real config structure (``Qwen3VLConfig`` + ``save_pretrained``: q/k norm,
interleaved M-RoPE, two DeepStack layers), with the hub's Qwen3-VL chat template and a tiny tokenizer
with Qwen's special tokens (``tests/models/conftest.py``), and the hub's processor files. Every weight
is perturbed from its initial value (norm weights are not 1) so that each one is exercised.

transformers' video processor needs torchvision, which this environment does not have: video pixel
values are ours (E's ``resize_frames`` = torch's antialiased bicubic, what torchvision calls), the
model and the prompt text around them are checked against transformers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from parity_support import map_checkpoint  # noqa: E402

from edgevlm.errors import InvalidImageError, InvalidRequestError, ModelLoadError  # noqa: E402
from edgevlm.runtime.models.qwen3_vl.config import parse_config  # noqa: E402
from edgevlm.runtime.models.qwen3_vl.model import Qwen3VLModel  # noqa: E402
from edgevlm.runtime.models.qwen3_vl.processor import (  # noqa: E402
    patch_times_s,
    sample_frames,
    video_target_size,
)

#: chat_template of Qwen/Qwen3-VL-8B-Instruct as the hub ships it (5292 bytes, SHA-256 pinned below).
QWEN3_VL_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
QWEN3_VL_CHAT_TEMPLATE_SHA256 = "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"


def _tokenizer_builder():
    """tests/models/conftest.py's tokenizer builder (a plain function, loaded by path: pytest's
    importlib mode gives conftest modules no importable name)."""
    spec = importlib.util.spec_from_file_location("qwen_tokenizer_builder", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_qwen_tokenizer


#: processor files of Qwen/Qwen3-VL-2B-Instruct as the hub ships them.
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
}
QUESTION = "how many shapes are there?"
VIDEO_TIMES_S = [0.0, 0.5, 1.0, 1.5]  # 4 frames at 2 fps


class Checkpoint:
    def __init__(self, folder: Path, ids: dict[str, int]) -> None:
        self.folder, self.ids = folder, ids
        self.hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.cfg = parse_config(json.loads((folder / "config.json").read_text()))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Checkpoint:
    folder = tmp_path_factory.mktemp("qwen3_vl")
    return Checkpoint(folder, write_tiny_qwen3_vl(folder))


def write_tiny_qwen3_vl(folder: Path) -> dict[str, int]:
    """Write the tiny Qwen3-VL checkpoint (transformers' own model, saved) into ``folder``; returns
    the special-token ids."""
    ids = _tokenizer_builder()(folder, chat_template=QWEN3_VL_CHAT_TEMPLATE)
    config = transformers.Qwen3VLConfig(
        vision_config=dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 2]),
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # every weight away from its init (norms not 1, biases not 0)
            p.add_(torch.randn_like(p) * 0.3)
        # no single-byte tokens in answers: they decode to partial UTF-8, the merges to readable text
        model.lm_head.weight[:256] = 0
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG))
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"], "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "top_k": 20, "top_p": 0.8, "temperature": 0.7}))
    return ids


def _ours(ck: Checkpoint) -> Qwen3VLModel:
    """Our model with the checkpoint's weights mapped by the family's weight rules."""

    from safetensors.torch import load_file

    from edgevlm.runtime.models.qwen3_vl.weights import WEIGHT_RULES

    state = map_checkpoint(load_file(ck.folder / "model.safetensors"), WEIGHT_RULES, every_key_ruled=True)
    model = Qwen3VLModel(ck.cfg)
    model.load_state_dict(state, strict=True)
    model.eval().setup_caches(1, 1024)
    return model


@pytest.fixture(scope="module")
def ours(ckpt) -> Qwen3VLModel:
    return _ours(ckpt)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x + y) % 256], -1)
    return np.clip(img + rng.integers(-20, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def _video(seed: int = 3) -> list[np.ndarray]:
    return [_image(70, 100, seed + i) for i in range(4)]  # 70x100 px: resized to 64x96


def _processor(ck: Checkpoint):
    from edgevlm.runtime.models.qwen3_vl import make_processor_for_folder

    return make_processor_for_folder(ck.folder, ck.cfg)


def _hf_processor(ck: Checkpoint, video_inputs=None):
    """transformers' Qwen3VLProcessor with its Pillow image processor. Its video processor needs
    torchvision (absent here): ``video_inputs`` (our ``pixel_values_videos``/``video_grid_thw`` +
    metadata) stand in for its output, so the prompt text is still built by transformers' code."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(ck.folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ck.folder)

    class _VideoOutput:  # stands in for Qwen3VLVideoProcessor (needs torchvision)
        merge_size = 2
        temporal_patch_size = 2

        def __call__(self, videos, **kwargs):
            return dict(video_inputs)

    check = ProcessorMixin.check_argument_for_proper_class
    try:  # the class check looks the video processor up in a registry that needs torchvision
        ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: type(arg)
        proc = transformers.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                             video_processor=_VideoOutput(), chat_template=QWEN3_VL_CHAT_TEMPLATE)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return proc


def _messages(n_images: int, video: bool) -> list[dict]:
    content = [{"type": "image"} for _ in range(n_images)]
    if video:
        content.append({"type": "video"})
    return [{"role": "user", "content": content + [{"type": "text", "text": QUESTION}]}]


def _hf_inputs(ck: Checkpoint, images: list[np.ndarray], vision=None):
    """transformers' processor output for the images (and our video, see _hf_processor)."""
    video_inputs = None
    if vision is not None and "video" in vision.kinds:
        from transformers.video_utils import VideoMetadata

        k = vision.kinds.index("video")
        off = int(vision.grid_thw[:k].prod(-1).sum())
        video_inputs = {
            "pixel_values_videos": vision.pixel_values[off:],
            "video_grid_thw": vision.grid_thw[k:k + 1],
            "video_metadata": [VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])],
        }
    proc = _hf_processor(ck, video_inputs)
    text = proc.apply_chat_template(_messages(len(images), video_inputs is not None), add_generation_prompt=True,
                                    tokenize=False)
    kwargs = {"images": images} if images else {}
    if video_inputs is not None:
        kwargs["videos"] = [np.stack(_video())]
    return proc(text=[text], return_tensors="pt", **kwargs)


def _skip_where_hf_wraps_the_video_twice(ck: Checkpoint, ref_ids: torch.Tensor, vision) -> None:
    """transformers 5.x before 5.25 kept the chat template's ``<|vision_start|>..<|vision_end|>`` around a video's
    per-frame runs (one more pair than 4.57's processor and 5.25's, which reverted it; our prompt follows those):
    no reference for our prompt there."""
    if "video" not in vision.kinds:
        return
    start = transformers.AutoTokenizer.from_pretrained(ck.folder).convert_tokens_to_ids("<|vision_start|>")
    frames = int(vision.grid_thw[list(vision.kinds).index("video")][0])
    if int((ref_ids == start).sum()) == frames + len(vision.kinds):  # each frame's pair + one around the video
        pytest.skip(f"transformers {transformers.__version__} wraps the video's frames in one more "
                    "<|vision_start|>..<|vision_end|> (5.x before 5.25)")


def _our_ids(ck: Checkpoint, vision) -> torch.Tensor:
    """Our prompt (the runtime's tokenizer: chat template with one content part per item,
    the family's expand_prompt, tokenised)."""
    from edgevlm.runtime.tokenizer import VLMTokenizer

    tok = VLMTokenizer.from_dir(ck.folder, ck.cfg.image_token_id)
    return torch.tensor([tok.encode_request(QUESTION, vision, _processor(ck))])


# ---- tests ----------------------------------------------------------------------------------------


def test_chat_template_is_the_hubs():
    assert hashlib.sha256(QWEN3_VL_CHAT_TEMPLATE.encode()).hexdigest() == QWEN3_VL_CHAT_TEMPLATE_SHA256


def test_config_reads_the_saved_structure(ckpt):
    cfg = ckpt.cfg
    assert cfg.vision.deepstack_visual_indexes == (0, 2)
    assert cfg.vision.grid_side == 8 and cfg.vision.merged_patch_px == 32
    assert cfg.text.qk_norm and cfg.text.mrope_interleaved and cfg.text.mrope_section == (6, 5, 5)
    assert cfg.text.rope_theta == 5000000.0 and cfg.text.head_dim == 32
    assert cfg.image_token_id == ckpt.ids["<|image_pad|>"] and cfg.video_token_id == ckpt.ids["<|video_pad|>"]


def test_config_reads_the_hubs_4x_rope_spelling(ckpt):
    raw = json.loads((ckpt.folder / "config.json").read_text())
    params = raw["text_config"].pop("rope_parameters")
    raw["text_config"]["rope_theta"] = params.pop("rope_theta")
    raw["text_config"]["rope_scaling"] = params
    raw["vision_config"]["model_type"] = "qwen3_vl"  # as the hub's config.json says
    cfg = parse_config(raw)
    assert cfg.text == ckpt.cfg.text and cfg.vision == ckpt.cfg.vision


@pytest.mark.parametrize("edit, key", [
    (lambda r: r["vision_config"].update(deepstack_visual_indexes=[0, 9]), "deepstack_visual_indexes"),
    (lambda r: r["vision_config"].update(num_position_embeddings=60), "num_position_embeddings"),
    (lambda r: r["vision_config"].update(hidden_act="swish"), "vision_config.hidden_act"),
    (lambda r: r["vision_config"].update(out_hidden_size=32), "out_hidden_size"),
    (lambda r: r["vision_config"].update(depth="4"), "vision_config.depth"),
    (lambda r: r["text_config"]["rope_parameters"].update(mrope_interleaved=False), "mrope_interleaved"),
    (lambda r: r["text_config"]["rope_parameters"].pop("mrope_section"), "mrope_section"),
    (lambda r: r["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    (lambda r: r.update(image_token_id=100000), "image_token_id"),
    (lambda r: r.pop("text_config"), "text_config"),
])
def test_config_errors_name_the_key(ckpt, edit, key):
    raw = json.loads((ckpt.folder / "config.json").read_text())
    edit(raw)
    with pytest.raises(ModelLoadError, match=key):
        parse_config(raw)


@pytest.mark.parametrize("grid_thw", [[[1, 6, 10]], [[1, 4, 4], [2, 12, 6]], [[1, 14, 22]]])
def test_vision_tower_and_deepstack_match_transformers(ckpt, ours, grid_thw):
    grid = torch.tensor(grid_thw)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ckpt.hf.model.visual(pixels, grid_thw=grid, return_dict=True)
        main, deepstack = ours.visual(pixels, grid)
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for a, b in [(main, ref.pooler_output), *zip(deepstack, ref.deepstack_features, strict=True)]:
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("h, w", [(200, 300), (250, 250), (8, 8)])
def test_image_pixels_and_grid_match_transformers(ckpt, h, w):
    """Non-square, not a multiple of 32 px, and smaller than one merged patch (scaled up)."""
    image = _image(h, w, seed=h)
    vision = _processor(ckpt).prepare([image])
    ref = _hf_inputs(ckpt, [image])
    assert vision.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert vision.pixel_values.shape == ref["pixel_values"].shape
    assert (vision.pixel_values - ref["pixel_values"]).abs().max() <= 1e-5
    assert vision.tokens_per_item == [int(ref["image_grid_thw"].prod()) // 4]


@pytest.mark.parametrize("case", ["non_square", "not_32", "video"])
def test_token_ids_match_transformers_processor(ckpt, case):
    images = {"non_square": [_image(200, 300, 1)], "not_32": [_image(250, 250, 2)], "video": []}[case]
    proc = _processor(ckpt)
    vision = proc.prepare(images, video=_video() if case == "video" else None,
                          video_timestamps_s=VIDEO_TIMES_S if case == "video" else None)
    ref = _hf_inputs(ckpt, images, vision)
    _skip_where_hf_wraps_the_video_twice(ckpt, ref["input_ids"], vision)
    assert _our_ids(ckpt, vision).tolist() == ref["input_ids"].tolist()
    if case == "video":
        assert vision.grid_thw.tolist() == [[2, 4, 6]]
        assert vision.extras["patch_times_s"] == [[0.25, 1.25]]


@pytest.mark.parametrize("case", ["non_square", "not_32", "video"])
def test_prefill_logits_match_transformers(ckpt, ours, case):
    images = {"non_square": [_image(200, 300, 1)], "not_32": [_image(250, 250, 2)], "video": []}[case]
    vision = _processor(ckpt).prepare(images, video=_video() if case == "video" else None,
                                      video_timestamps_s=VIDEO_TIMES_S if case == "video" else None)
    ref_in = _hf_inputs(ckpt, images, vision)
    with torch.no_grad():
        ref = ckpt.hf(**ref_in).logits
        got = ours(ref_in["input_ids"], vision)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_greedy_16_tokens_match_generate(ckpt, ours):
    images = [_image(200, 300, 1)]
    vision = _processor(ckpt).prepare(images)
    ref_in = _hf_inputs(ckpt, images, vision)
    n = ref_in["input_ids"].shape[1]
    with torch.no_grad():
        ref = ckpt.hf.generate(**ref_in, do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, n:].tolist()
        ids = ref_in["input_ids"]
        embeds = ours.embed(ids, ours.encode_vision(vision))
        pos, delta = ours.position_ids(ids, vision)
        logits = ours.prefill(embeds, position_ids=pos)
        eos = set(json.loads((ckpt.folder / "generation_config.json").read_text())["eos_token_id"])
        got = []
        for step in range(16):
            logits[:, sorted(eos)] = float("-inf")  # min_new_tokens=16: transformers masks EOS throughout
            token = int(logits.argmax(-1))
            got.append(token)
            logits = ours.decode(torch.tensor([[token]]), torch.tensor([n + step]), rope_offset=delta)
    assert delta != 0  # the image makes M-RoPE positions differ from the cache slots
    assert got == ref


def test_video_size_rule_counts_frames():
    from edgevlm.runtime.models.qwen_vl.preprocess import QWEN3_VIDEO_DEFAULTS as cfg

    # numbers worked from Qwen3VLVideoProcessor's smart_resize (factor 32, temporal factor 2)
    assert video_target_size(4, 70, 100, cfg) == (160, 224)  # below min_pixels 128*32*32: scaled up
    small = replace(cfg, min_pixels=4096, max_pixels=4 * 64 * 96)
    assert video_target_size(4, 70, 100, small) == (64, 96)
    assert video_target_size(8, 70, 100, small) == (32, 64)  # twice the frames: the area budget halves
    assert video_target_size(4, 10, 100, small) == (32, 224)  # a side below 32 px is scaled up first
    with pytest.raises(InvalidRequestError, match="at least 2"):
        video_target_size(1, 64, 64, small)
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        video_target_size(4, 32, 32 * 201, small)


def test_frame_sampling_and_timestamps_follow_transformers():
    from edgevlm.runtime.models.qwen_vl.preprocess import QWEN3_VIDEO_DEFAULTS as cfg

    assert sample_frames(4, 2.0, cfg) == [0, 1, 2, 3]
    assert sample_frames(60, 30.0, cfg) == [0, 20, 39, 59]  # int(60 / 30 * 2) = 4 frames, round(linspace)
    assert sample_frames(300, 30.0, cfg) == np.linspace(0, 299, 20).round().astype(int).tolist()
    times = [i / 30.0 for i in sample_frames(61, 30.0, cfg)]
    ref = transformers.Qwen3VLProcessor._calculate_timestamps(None, sample_frames(61, 30.0, cfg), 30.0, 2)
    assert patch_times_s(times, 2) == pytest.approx(ref)
    assert patch_times_s([0.0, 0.5, 1.0], 2) == [0.25, 1.0]  # odd count: the last frame repeated


def test_bad_input_is_a_typed_error(ckpt):
    proc = _processor(ckpt)
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        proc.prepare([_image(1, 300, 0)])
    with pytest.raises(InvalidRequestError, match="at least 2"):
        proc.prepare([], video=[_image(64, 64, 0)], video_timestamps_s=[0.0])
    with pytest.raises(InvalidRequestError, match="timestamps"):
        proc.prepare([], video=_video(), video_timestamps_s=[0.0, 1.0])
    with pytest.raises(InvalidRequestError, match="differ in size"):
        proc.prepare([], video=[_image(64, 64, 0), _image(64, 96, 0)])
    with pytest.raises(InvalidImageError):
        proc.prepare([np.zeros((10, 10), np.uint8)])


def test_resolution_rung_is_a_max_pixels_step(ckpt):
    proc = _processor(ckpt)
    image = _image(480, 640, 5)
    full = proc.prepare([image])
    rung = proc.prepare([image], resolution_px=128)  # max_pixels 128 * 128
    (t, h, w), = rung.grid_thw.tolist()
    assert h * w * 16 * 16 <= 128 * 128 < full.grid_thw.prod().item() * 16 * 16
    assert rung.tokens_per_item[0] == h * w // 4 and rung.input_sizes_px == [(h * 16, w * 16)]
    video = proc.prepare([], video=_video(), video_timestamps_s=VIDEO_TIMES_S, resolution_px=32)
    assert video.grid_thw.tolist() == [[2, 2, 2]]  # one merged patch per frame: 4 * 32 * 32 px
    with pytest.raises(InvalidRequestError, match="resolution_px"):
        proc.prepare([image], resolution_px=0)


def test_registry_serves_qwen3_vl_and_refuses_moe(ckpt):
    from edgevlm.runtime.models import family_for

    raw = json.loads((ckpt.folder / "config.json").read_text())
    assert family_for(raw).name == "qwen3_vl"
    with pytest.raises(ModelLoadError, match=r"model_type 'qwen3_vl_moe' is not supported; supported: .*qwen3_vl"):
        family_for({**raw, "model_type": "qwen3_vl_moe"})


def _transformers_answer(ck: Checkpoint, image: np.ndarray, max_new_tokens: int) -> str:
    ref_in = _hf_inputs(ck, [image])
    with torch.no_grad():
        out = ck.hf.generate(**ref_in, do_sample=False, max_new_tokens=max_new_tokens)
    tok = transformers.AutoTokenizer.from_pretrained(ck.folder)
    return tok.decode(out[0, ref_in["input_ids"].shape[1]:], skip_special_tokens=True)


def test_engine_answers_as_transformers(ckpt):
    from edgevlm.runtime import Engine

    engine = Engine.load(ckpt.folder)
    for image in (_image(200, 300, 1), _image(250, 250, 2)):
        expected = _transformers_answer(ckpt, image, 16)
        answer = engine.ask(image, QUESTION, max_new_tokens=16)
        assert len(set(expected)) >= 5  # a varied answer, not one token repeated
        assert answer.text == expected.strip()  # the Engine strips surrounding whitespace
        assert answer.stats.vision_tokens == _processor(ckpt).prepare([image]).tokens_per_item[0]


def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "edgevlm.cli", *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_cli_ask_with_the_checkpoint(ckpt, tmp_path):
    from PIL import Image

    image = _image(200, 300, 1)
    path = tmp_path / "frame.png"
    Image.fromarray(image).save(path)
    expected = _transformers_answer(ckpt, image, 8)
    res = _cli("ask", "--image", str(path), "--model", str(ckpt.folder), "--max-new-tokens", "8", QUESTION)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == expected.strip()
    # early exit needs exit heads (`edgevlm calibrate`): without them, one line, exit 2
    res = _cli("ask", "--image", str(path), "--model", str(ckpt.folder), "--exit-layer", "2", QUESTION)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("edgevlm: error:") and "no exit heads" in res.stderr


def test_engine_ask_about_frames_answers_as_transformers_video(ckpt):
    """A list of frames with capture times goes to Qwen3-VL as one video (timestamps in the prompt,
    M-RoPE over time): the Engine's answer equals transformers' generate on that video."""
    from edgevlm.runtime import Engine

    engine = Engine.load(ckpt.folder)
    answer = engine.ask(_video(), QUESTION, max_new_tokens=12, frame_timestamps_s=VIDEO_TIMES_S)
    vision = _processor(ckpt).prepare([], video=_video(), video_timestamps_s=VIDEO_TIMES_S)
    ref_in = _hf_inputs(ckpt, [], vision)
    _skip_where_hf_wraps_the_video_twice(ckpt, ref_in["input_ids"], vision)
    with torch.no_grad():
        out = ckpt.hf.generate(**ref_in, do_sample=False, max_new_tokens=12)
    expected = transformers.AutoTokenizer.from_pretrained(ckpt.folder).decode(
        out[0, ref_in["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.text == expected.strip()
    assert answer.stats.vision_tokens == vision.num_tokens
    engine.set_vision_cache(16)  # Qwen3-VL's DeepStack state: never cached, same answer
    assert engine.ask(_video(), QUESTION, max_new_tokens=12, frame_timestamps_s=VIDEO_TIMES_S).text == answer.text
    assert len(engine.vision_cache) == 0
