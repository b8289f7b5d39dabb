"""``edgevlm bench`` for the Qwen2.5-VL, Qwen3-VL, SmolVLM2, InternVL and Gemma 3 families: edgevlm vs transformers.

Models (:data:`FAMILY_MODEL_NAMES`): the published ``config.json`` values of Qwen2.5-VL-3B-Instruct,
Qwen3-VL-2B / 8B-Instruct, SmolVLM2-2.2B-Instruct, InternVL3-1B-hf and Gemma-3-4B-it (:data:`CONFIGS`; weights
random, only shapes and cost matter), the ``tiny-*`` configs of the same structure (CPU tests of
this harness), or a local checkpoint folder of a registered family (:func:`build_from_dir`, its
real weights). transformers' ``...ForConditionalGeneration`` is built (random weights: on the device,
``N(0, 1/fan_in)``; a folder: ``from_pretrained``) and edgevlm's family model (registry:
``edgevlm.runtime.models``) runs over the very same tensors (a folder: loaded a second time by
:func:`edgevlm.runtime.loader.load_model`) through
:class:`~edgevlm.runtime.backends.torch_backend.TorchBackend` (``encode_vision``, M-RoPE
``position_ids``, ``prefill``, CUDA-graph ``decode`` with the RoPE offset). transformers gets what its
processor returns besides the pixels: Qwen's ``mm_token_type_ids``, Gemma 3's ``token_type_ids`` (1 on
image tokens: each image attends to itself bidirectionally, as ours does). At each input size
(``(W, H)`` px random uint8 frame through the family's own preprocessing at the checkpoint's
defaults) and each decode batch, one row per implementation:

* ``vision_ms``: ``encode_vision`` (transformers: ``get_image_features``), CUDA events, batch 1;
* ``ttft_ms``: vision + embed + prefill + argmax to the host (transformers: one forward), batch 1;
* ``tpot_ms`` / ``decode_tok_s``: greedy loop, token through the host each step (transformers:
  ``generate``, dynamic cache, ``(t(n) - t(1)) / (n - 1)``); at a batch above 1, that many copies of
  the request decode together (ours: ``decode_batch``, one CUDA graph; tok/s counts every row);
* ``peak_mb`` (CUDA): the implementation's weights plus the peak of what it allocated while running;
* ``kv_bytes_per_token``, ``gbps`` / ``copy_frac``: decoder weight bytes + attended KV per step over
  TPOT, against the measured copy bandwidth;
* parity (:func:`parity`): last-position prefill logits, ``||x - ref|| / ||ref||`` against
  transformers in fp32 on the same weights, for ours and transformers in the run's dtype.

``edgevlm-w4*`` is the decoder's linears replaced in memory by RTN W4A16 ``Int4Linear`` (group 128;
in place, after the 16-bit rows), not an ``edgevlm quantize`` bundle; ``-kv4`` / ``-kv8`` add the
INT4 / FP8 KV cache.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from pathlib import Path

import numpy as np
import torch

from edgevlm.quantize.bench_measure import VARIANTS, event_ms, wall_ms
from edgevlm.quantize.bench_models import decoder_weight_bytes, init_random_, quantize_decoder_w4
from edgevlm.runtime.loader import ModelFiles, compile_weight_rules, map_weight_name
from edgevlm.runtime.models import family_for

logger = logging.getLogger(__name__)

_QWEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
             "vision_end_token_id": 151653, "image_token_id": 151655, "video_token_id": 151656}


def _qwen3(text: dict, vision: dict) -> dict:
    return {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"], **_QWEN_IDS,
            "tie_word_embeddings": text.pop("tie"),
            "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 151936, "head_dim": 128,
                            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                                "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                            "attention_bias": False, "tie_word_embeddings": False, **text},
            "vision_config": {"model_type": "qwen3_vl", "patch_size": 16, "temporal_patch_size": 2,
                              "spatial_merge_size": 2, "in_channels": 3, "hidden_act": "gelu_pytorch_tanh",
                              "num_position_embeddings": 2304, **vision}}


#: Published shapes (hub config.json values; weights random). Qwen2.5-VL-3B-Instruct: 36 x 2048 decoder,
#: 16 / 2 heads, MLP 11008, tied; ViT 32 x 1280, window 112 px, full attention at 7/15/23/31.
CONFIGS: dict[str, dict] = {
    "qwen2.5-vl-3b": {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"], **_QWEN_IDS,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 128000,
        "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 151936, "use_sliding_window": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                          "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "tokens_per_second": 2, "temporal_patch_size": 2},
    },
    # Qwen3-VL-2B-Instruct: 28 x 2048, 16 / 8 heads of 128, MLP 6144, tied; ViT 24 x 1024, DeepStack 5/11/17
    "qwen3-vl-2b": _qwen3({"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                           "num_attention_heads": 16, "num_key_value_heads": 8, "tie": True},
                          {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                           "out_hidden_size": 2048, "deepstack_visual_indexes": [5, 11, 17]}),
    # Qwen3-VL-8B-Instruct: 36 x 4096, 32 / 8 heads of 128, MLP 12288; ViT 27 x 1152, DeepStack 8/16/24
    "qwen3-vl-8b": _qwen3({"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "tie": False},
                          {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                           "out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24]}),
    # SmolVLM2-2.2B-Instruct: SmolLM2-1.7B (24 x 2048, 32 / 32 heads, MLP 8192, vocab 49280, theta 130000)
    # + SigLIP so400m (27 x 1152, MLP 4304, patch 14, 384 px tiles), pixel shuffle 3 (81 tokens per tile).
    # The hub's image_size 384 is not a multiple of 14 (transformers floors it to 27 x 27 patches) and our
    # SmolVLM config parser refuses that, so the tiles here are 378 px: the same 27 x 27 patches, same cost.
    "smolvlm2-2.2b": {
        "model_type": "smolvlm", "architectures": ["SmolVLMForConditionalGeneration"], "scale_factor": 3,
        "image_token_id": 49190, "tie_word_embeddings": False,
        "text_config": {"model_type": "llama", "vocab_size": 49280, "hidden_size": 2048, "intermediate_size": 8192,
                        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 16384,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 130000.0},
                        "tie_word_embeddings": False, "pad_token_id": 2},
        "vision_config": {"model_type": "smolvlm_vision", "hidden_size": 1152, "intermediate_size": 4304,
                          "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 378,
                          "num_channels": 3, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"},
    },
    # InternVL3-1B-hf: InternViT-300M (24 x 1024, MLP 4096, 448 px tiles of 14 px patches, layer scale) + pixel
    # shuffle 0.5 (256 tokens per tile, up to 12 tiles + a thumbnail) + Qwen2.5-0.5B (24 x 896, 14 / 2 heads,
    # MLP 4864, vocab 151674, tied); the values of tests/models/test_internvl.py's INTERNVL3_1B_CONFIG.
    "internvl3-1b": {
        "model_type": "internvl", "architectures": ["InternVLForConditionalGeneration"], "downsample_ratio": 0.5,
        "image_token_id": 151667, "image_seq_length": 256, "projector_hidden_act": "gelu",
        "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151674,
                        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                        "tie_word_embeddings": True, "eos_token_id": 151645},
        "vision_config": {"model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": [448, 448],
                          "patch_size": [14, 14], "layer_scale_init_value": 0.1, "norm_type": "layer_norm",
                          "use_qk_norm": False, "attention_bias": True, "use_mean_pooling": True},
    },
    # Gemma-3-4B-it (the hub's config.json; the rest are Gemma3TextConfig's defaults: 8 / 4 heads of 256,
    # query_pre_attn_scalar 256, vocab 262208, every 6th layer full, RoPE 1e6 / local 1e4): SigLIP so400m
    # (27 x 1152, 896 px, 14 px patches) pooled to 256 tokens + a 34 x 2560 decoder, MLP 10240, window 1024
    "gemma3-4b": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
        "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False},
    },
}
#: tiny CPU configs -> the published config whose structure they keep
TINY: dict[str, str] = {"tiny-qwen2.5-vl": "qwen2.5-vl-3b", "tiny-qwen3-vl": "qwen3-vl-2b",
                        "tiny-smolvlm": "smolvlm2-2.2b", "tiny-internvl": "internvl3-1b", "tiny-gemma3": "gemma3-4b"}
FAMILY_MODEL_NAMES = (*CONFIGS, *TINY)

#: SmolVLM2's image processor at the hub's settings (longest edge 4 x 384, 384 px tiles).
SMOLVLM_IMAGE_PROCESSOR = {"do_resize": True, "size": {"longest_edge": 1536}, "do_image_splitting": True,
                           "max_image_size": {"longest_edge": 384}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                           "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}
#: InternVL3-1B-hf's image processor (preprocessor_config.json: 448 px tiles, up to 12 + thumbnail, bicubic)
INTERNVL_IMAGE_PROCESSOR = {"do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 3,
                            "rescale_factor": 1 / 255, "image_mean": [0.485, 0.456, 0.406],
                            "image_std": [0.229, 0.224, 0.225], "max_patches": 12, "min_patches": 1}


def _image_processor(raw: dict) -> dict | None:
    """The image processor settings of a config built here (None: the family's defaults)."""
    if raw["model_type"] == "smolvlm":
        tile = raw["vision_config"]["image_size"]
        return {**SMOLVLM_IMAGE_PROCESSOR, "size": {"longest_edge": 4 * tile}, "max_image_size": {"longest_edge": tile}}
    if raw["model_type"] == "internvl":
        side = raw["vision_config"]["image_size"]
        side = side[0] if isinstance(side, list) else side
        return {**INTERNVL_IMAGE_PROCESSOR, "size": {"height": side, "width": side}, "max_patches": 6}
    return None


def _tiny(name: str) -> dict:
    """A tiny config of ``name``'s structure (CPU test of this harness): a 1024-token vocabulary, the
    special tokens at 1000-1005."""
    raw = copy.deepcopy(CONFIGS[name])
    small_ids = {"bos_token_id": 1000, "eos_token_id": 1001, "vision_start_token_id": 1002, "vision_end_token_id": 1003,
                 "image_token_id": 1004, "video_token_id": 1005}
    if name.startswith("gemma3"):
        raw.update(image_token_index=1004, boi_token_index=1002, eoi_token_index=1003, eos_token_id=[1001],
                   mm_tokens_per_image=16)
        raw["text_config"].update(vocab_size=1024)
    elif name.startswith("qwen"):
        raw.update(small_ids)
        (raw["text_config"] if "text_config" in raw else raw).update(vocab_size=1024)
    else:
        raw.update(image_token_id=1004)
        raw["text_config"].update(vocab_size=1024, eos_token_id=1001)
    if name == "qwen2.5-vl-3b":
        raw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        raw["vision_config"].update(depth=4, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=64,
                                    fullatt_block_indexes=[1, 3])
    elif name.startswith("qwen3"):
        raw["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32)
        raw["text_config"]["rope_parameters"]["mrope_section"] = [6, 5, 5]
        raw["vision_config"].update(depth=4, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=64,
                                    num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
    elif name == "gemma3-4b":  # sliding / full / sliding, window 8 (shorter than the prompt), 8 x 8 patches
        raw["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        raw["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=112)
    elif name == "internvl3-1b":
        raw["image_seq_length"] = 4  # (32 / 8 * 0.5)^2
        raw["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)
        raw["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=[32, 32], patch_size=[8, 8])
    else:
        raw["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)
        raw["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    patch_size=8, image_size=48)
    return raw


def model_config(name: str) -> dict:
    """The config dict of ``name`` (a key of :data:`CONFIGS` or :data:`TINY`); KeyError if unknown."""
    return _tiny(TINY[name]) if name in TINY else copy.deepcopy(CONFIGS[name])


def hf_class(model_type: str):
    """``(config class, model class)`` of transformers for a ``config.json`` ``model_type``; KeyError
    for a type this harness has no transformers reference for."""
    import transformers

    return {"qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
            "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
            "smolvlm": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration),
            "idefics3": (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration),
            "internvl": (transformers.InternVLConfig, transformers.InternVLForConditionalGeneration),
            "gemma3": (transformers.Gemma3Config, transformers.Gemma3ForConditionalGeneration),
            }[model_type]


def model_files(name: str) -> tuple[object, ModelFiles]:
    """``(transformers config, ModelFiles)`` of benchmark model ``name``: the config as transformers
    reads it, parsed by our family (no folder: ``model_dir`` does not exist)."""
    raw = model_config(name)
    cfg_cls, _ = hf_class(raw["model_type"])
    hf_cfg = cfg_cls(**raw)
    raw_saved = hf_cfg.to_dict()
    family = family_for(raw_saved)
    files = ModelFiles(model_dir=Path("/nonexistent"), raw_config=raw_saved, config=family.parse_config(raw_saved),
                       weight_files=[], family=family, image_processor=_image_processor(raw))
    return hf_cfg, files


def build(name: str, device: torch.device, dtype: torch.dtype, max_seq_len: int, seed: int = 0):
    """``(ours, hf, files)`` of benchmark model ``name``: transformers' model with random weights on
    ``device`` in ``dtype`` and ours over the same tensors, KV caches for ``max_seq_len`` positions.
    Raises RuntimeError if our model has a parameter transformers' state dict lacks."""
    hf_cfg, files = model_files(name)
    _, model_cls = hf_class(files.raw_config["model_type"])
    hf_cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = model_cls(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    hf = hf.eval().requires_grad_(False)
    init_random_(hf, seed)
    family, cfg = files.family, files.config
    with torch.device("meta"):
        ours = family.build_model(cfg)
    expected = set(ours.state_dict())
    rules = compile_weight_rules(family.weight_rules)
    tied = "language_model.lm_head.weight" if cfg.tie_word_embeddings else None
    mapped = {}
    for key, t in hf.state_dict().items():
        mapped_name = map_weight_name(key, rules)
        if mapped_name is not None and mapped_name in expected and mapped_name != tied:
            mapped[mapped_name] = t
    missing = sorted(expected - set(mapped) - {tied})
    if missing:
        raise RuntimeError(f"{name}: transformers' state dict lacks {missing[:3]}")
    ours.load_state_dict(mapped, strict=False, assign=True)
    if tied:
        ours.language_model.lm_head.weight = ours.language_model.embed_tokens.weight
    ours.eval().requires_grad_(False)
    ours.setup_caches(1, max_seq_len)
    return ours, hf, files


def build_from_dir(files: ModelFiles, device: torch.device, dtype: torch.dtype, max_seq_len: int):
    """``(ours, hf, files)`` of a checkpoint folder (``files`` from ``read_model_files``): ours by
    :func:`~edgevlm.runtime.loader.load_model`, transformers' by ``from_pretrained`` (SDPA), both
    with the folder's weights in ``dtype`` on ``device`` (two copies in memory)."""
    from edgevlm.runtime.loader import load_model

    ours = load_model(files, device=device, dtype=dtype, max_seq_len=max_seq_len)
    _, model_cls = hf_class(files.raw_config["model_type"])
    hf = model_cls.from_pretrained(files.model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    return ours, hf.eval().requires_grad_(False), files


def make_request(files: ModelFiles, size: tuple[int, int], n_text: int = 32, seed: int = 0):
    """``(ids (1, T) int64, vision)``: a random frame of ``size`` (W, H) px through the family's processor
    and ``n_text`` random text tokens around the vision tokens (Qwen: between vision start / end)."""
    rng = np.random.default_rng(seed)
    w, h = size
    proc = files.family.make_processor(files)
    vision = proc.prepare([rng.integers(0, 256, (h, w, 3), dtype=np.uint8)])
    cfg = files.config
    hi = min(cfg.text.vocab_size, 151000) - 1
    text = rng.integers(5, min(hi, cfg.image_token_id) - 1, n_text).tolist()
    mid = [cfg.image_token_id] * vision.num_tokens
    if getattr(cfg, "vision_start_token_id", None) is not None:
        mid = [cfg.vision_start_token_id, *mid, cfg.vision_start_token_id + 1]
    elif getattr(cfg, "boi_token_id", None) is not None:  # Gemma 3: <start_of_image> ... <end_of_image>
        mid = [cfg.boi_token_id, *mid, cfg.eoi_token_id]
    ids = text[: n_text // 2] + mid + text[n_text // 2:]
    return torch.tensor([ids]), vision


def _hf_inputs(hf, files, ids, vision, device, dtype, batch: int = 1) -> dict:
    """transformers' inputs for ``batch`` copies of the request (pixels and grids repeated)."""
    px = vision.pixel_values.to(device, dtype)
    ids = ids.expand(batch, -1)
    kw = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids, device=device)}
    if vision.grid_thw is not None:  # Qwen: (patches, C*T*p*p) rows and a grid per image
        mm = (ids == files.config.image_token_id).long().to(device)  # what the processor returns
        kw.update(pixel_values=px.repeat(batch, 1), image_grid_thw=vision.grid_thw.repeat(batch, 1).to(device),
                  mm_token_type_ids=mm)
    elif files.family.name == "internvl":  # (tiles of every image, 3, T, T)
        kw.update(pixel_values=px.repeat(batch, 1, 1, 1))
    elif files.family.name == "gemma3":  # (images, 3, S, S) and token types: 1 = image token (bidirectional runs)
        kw.update(pixel_values=px.repeat(batch, 1, 1, 1),
                  token_type_ids=(ids == files.config.image_token_id).long().to(device))
    else:  # SmolVLM: (batch, tiles, 3, T, T)
        kw.update(pixel_values=px.unsqueeze(0).repeat(batch, *([1] * px.dim())))
    return kw


def _hf_vision_kwargs(hf, kw: dict) -> dict:
    out = {k: v for k, v in kw.items() if k in ("pixel_values", "image_grid_thw")}
    if hf.config.model_type == "internvl":  # transformers' InternVL takes these from the caller
        out.update(vision_feature_layer=hf.config.vision_feature_layer,
                   vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
    return out


def _reps(device) -> dict:
    """Warm-up and timed calls of the vision and TTFT medians (fewer on the CPU, where the tiny
    models only test this harness)."""
    return {"warmup": 2, "iters": 5} if device.type == "cuda" else {"warmup": 1, "iters": 3}


def bench_ours(model, files, ids, vision, *, new_tokens: int, device, ceilings: dict, batch: int = 1,
               kv_cache_dtype: str | None = None) -> dict:
    """One row of ours at ``batch`` (1: vision, TTFT and decode; > 1: ``batch`` copies of the request
    decoding together through ``decode_batch``, the prompt prefilled once and its KV cache rows copied),
    with a ``kv_cache_dtype`` KV cache (None: the model's dtype). The caches are back to one 16-bit
    row afterwards."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    dec = model.language_model
    be = TorchBackend(model, max_batch_size=batch, kv_cache_dtype=kv_cache_dtype)
    ids_dev = ids.to(device)
    row: dict = {}

    def first():
        feats = be.encode_vision(vision)
        pos, delta = be.position_ids(ids_dev, vision)
        return int(be.prefill(be.embed(ids_dev, feats), position_ids=pos)[0].argmax()), delta

    try:
        if batch == 1:
            row["vision_ms"] = event_ms(lambda: be.encode_vision(vision), device, **_reps(device))
            row["ttft_ms"] = wall_ms(first, device, **_reps(device))
        tok0, delta = first()
        t = ids.shape[1]
        if batch > 1:  # the same request in every row: copy row 0's cache (codes, scales, zeros alike)
            for layer in dec.layers:
                for buf in layer.self_attn.kv_cache.buffers():
                    if buf.dim() >= 3 and buf.shape[0] == batch:
                        buf[1:batch, :, :t] = buf[:1, :, :t]

        def loop():
            tok, pos = tok0, t
            for _ in range(new_tokens):
                if batch == 1:
                    tok = int(be.decode(tok, pos, rope_offset=delta)[0].argmax())
                else:
                    toks = be.decode_batch([tok] * batch, [pos] * batch, [delta] * batch).argmax(-1).tolist()
                    tok = toks[0]
                pos += 1

        row["tpot_ms"] = wall_ms(loop, device, warmup=1, iters=3) / new_tokens
        row["decode_tok_s"] = batch * 1e3 / row["tpot_ms"]
        w_bytes = decoder_weight_bytes(model)
        kv_tok = sum(layer.self_attn.kv_cache.bytes_per_token() for layer in dec.layers)
        kv_len = be.kv_len_for(t + new_tokens)  # attended positions; a rolling cache (Gemma 3) its slots at most
        step = w_bytes + batch * sum(layer.self_attn.kv_cache.bytes_per_token()
                                     * min(kv_len, layer.self_attn.kv_cache.max_seq_len) for layer in dec.layers)
        row.update(weight_bytes=w_bytes, kv_bytes_per_token=kv_tok, bytes_per_step_mb=step / 2**20,
                   gbps=step / row["tpot_ms"] / 1e6)
        row["copy_frac"] = row["gbps"] / ceilings["copy_gbps"]
        if cuda:
            own = sum(p.numel() * p.element_size() for p in model.parameters())
            row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base + own) / 2**20
    finally:
        be.graphs = None
        if batch > 1 or kv_cache_dtype is not None:  # back to one 16-bit row for the next row
            for layer in dec.layers:
                layer.self_attn.kv_cache = None
            dec.setup_caches(1, dec.max_seq_len)
    return row


def bench_hf(hf, files, ids, vision, *, new_tokens: int, device, dtype, ceilings: dict, batch: int = 1) -> dict:
    """One row of transformers at ``batch`` (1: vision, TTFT and ``generate``; > 1: ``generate`` over
    ``batch`` copies of the request)."""
    from edgevlm.runtime.kv_cache import kv_bytes_per_token

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    kw = _hf_inputs(hf, files, ids, vision, device, dtype, batch)
    row: dict = {}
    with torch.inference_mode():
        if batch == 1:
            try:
                vis_kw = _hf_vision_kwargs(hf, kw)
                row["vision_ms"] = event_ms(lambda: hf.model.get_image_features(**vis_kw), device, **_reps(device))
            except Exception as exc:  # noqa: BLE001 - API differences between releases
                row["error_vision"] = f"{type(exc).__name__}: {exc}"[:200]
            row["ttft_ms"] = wall_ms(lambda: int(hf(**kw, logits_to_keep=1).logits[0, -1].argmax()), device,
                                     **_reps(device))

        def gen(n):
            return hf.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True,
                               pad_token_id=0)

        gen(2)
        t1 = wall_ms(lambda: gen(1), device, warmup=0, iters=3)
        tn = wall_ms(lambda: gen(new_tokens), device, warmup=0, iters=2)
    tc = files.config.text
    kv_tok = kv_bytes_per_token("fp32" if dtype == torch.float32 else "bf16", tc.num_hidden_layers,
                                tc.num_key_value_heads, tc.head_dim)
    row["kv_bytes_per_token"] = kv_tok
    tpot = (tn - t1) / (new_tokens - 1)
    if tpot > 0:  # else timing noise larger than the decode time (tiny model on a busy CPU)
        row["tpot_ms"] = tpot
        row["decode_tok_s"] = batch * 1e3 / tpot
        decoder = getattr(hf.model, "language_model", None) or hf.model.text_model  # SmolVLM: text_model
        w_bytes = sum(p.numel() * p.element_size() for p in decoder.layers.parameters())
        w_bytes += hf.lm_head.weight.numel() * hf.lm_head.weight.element_size()
        step = w_bytes + batch * (ids.shape[1] + new_tokens // 2) * kv_tok
        row.update(bytes_per_step_mb=step / 2**20, gbps=step / tpot / 1e6)
        row["copy_frac"] = row["gbps"] / ceilings["copy_gbps"]
    if cuda:
        own = sum(p.numel() * p.element_size() for p in hf.parameters())
        row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base + own) / 2**20
    return row


@torch.inference_mode()
def parity(ours, hf, files, ids, vision, device, dtype) -> dict:
    """Last-position prefill logits: ours and transformers in ``dtype`` vs transformers in fp32 (a copy),
    as relative L2 errors (``ours_vs_fp32``, ``hf_vs_fp32``, ``ours_vs_hf``) and ``argmax_equal``
    (ours vs the fp32 reference)."""
    kw = _hf_inputs(hf, files, ids, vision, device, dtype)
    hf_run = hf(**kw, logits_to_keep=1).logits[0, -1].double()
    ids_dev = ids.to(device)
    feats = ours.encode_vision(vision)
    pos, _ = ours.position_ids(ids_dev, vision)
    ours_logits = ours.prefill(ours.embed(ids_dev, feats), position_ids=pos)[0].double()
    if dtype == torch.float32:
        ref = hf_run
    else:
        hf32 = copy.deepcopy(hf).float()
        ref = hf32(**_hf_inputs(hf32, files, ids, vision, device, torch.float32), logits_to_keep=1).logits[0, -1]
        ref = ref.double()
        del hf32
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def rel(x, r):
        return float((x - r).norm() / r.norm())

    return {"ours_vs_fp32": rel(ours_logits, ref), "hf_vs_fp32": rel(hf_run, ref),
            "ours_vs_hf": rel(ours_logits, hf_run), "argmax_equal": int(ours_logits.argmax()) == int(ref.argmax())}


def run_family(name: str, *, device: torch.device, dtype: torch.dtype, variants: list[str], with_hf: bool,
               sizes: list[tuple[int, int]], batch_sizes: list[int], new_tokens: int, n_text: int,
               do_parity: bool, ceilings: dict, files: ModelFiles | None = None, seed: int = 0) -> tuple[list, dict]:
    """``(rows, parity)`` of one model: ``name`` from :data:`FAMILY_MODEL_NAMES` (random weights) or,
    with ``files`` (a checkpoint folder's, ``name`` its label), that folder's weights. One row per
    implementation x size x batch (a failing one carries ``error``, the others still run); ``parity``
    is :func:`parity` at the first size (empty without ``do_parity`` or transformers).
    Raises what building the model raises (RuntimeError, ModelLoadError, OSError)."""
    t0 = time.perf_counter()
    if files is None:
        ours, hf, files = build(name, device, dtype, max_seq_len=256, seed=seed)
    else:
        ours, hf, files = build_from_dir(files, device, dtype, 256)
    if not with_hf:
        del hf
        hf = None
    logger.info("built %s in %.1f s", name, time.perf_counter() - t0)
    reqs = {f"{w}x{h}": make_request(files, (w, h), n_text=n_text, seed=seed) for w, h in sizes}
    longest = max(ids.shape[1] for ids, _ in reqs.values()) + new_tokens + 16
    for layer in ours.language_model.layers:  # KV caches for the longest request, in 256-position steps
        layer.self_attn.kv_cache = None
    ours.setup_caches(1, -(-longest // 256) * 256)
    par: dict = {}
    if do_parity and hf is not None:
        first_size = next(iter(reqs))
        try:
            par = {"size": first_size, **parity(ours, hf, files, *reqs[first_size], device, dtype)}
        except Exception as exc:  # noqa: BLE001 - the speed rows still run
            logger.exception("parity %s", name)
            par = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    rows: list[dict] = []
    params_m = round(sum(p.numel() for p in ours.parameters()) / 1e6, 1)
    # VARIANTS' order: the 16-bit rows before the in-place W4A16 quantization
    impls = (["transformers"] if hf is not None else []) + [v for v in VARIANTS if v in variants]
    quantized = False
    for impl in impls:
        weights, kv = VARIANTS.get(impl, (None, None))
        if weights == "w4" and not quantized:
            quantized = True
            try:
                quantize_decoder_w4(ours)
            except Exception as exc:  # noqa: BLE001
                logger.exception("quantize %s", name)
                rows.append({"model": name, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:300]})
                break
        for (size, (ids, vision)), batch in itertools.product(reqs.items(), batch_sizes):
            common = {"model": name, "impl": impl, "size": size, "batch": batch, "prompt_tokens": ids.shape[1],
                      "vision_tokens": vision.num_tokens, "new_tokens": new_tokens, "params_m": params_m}
            try:
                if impl == "transformers":
                    row = bench_hf(hf, files, ids, vision, new_tokens=new_tokens, device=device, dtype=dtype,
                                   ceilings=ceilings, batch=batch)
                else:
                    row = bench_ours(ours, files, ids, vision, new_tokens=new_tokens, device=device,
                                     ceilings=ceilings, batch=batch, kv_cache_dtype=kv)
            except Exception as exc:  # noqa: BLE001 - one impl failing keeps the others
                logger.exception("%s %s %s", name, impl, size)
                row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append({**common, **row})
    del ours, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, par
