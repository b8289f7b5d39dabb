"""Qwen2.5-VL / Qwen3-VL / SmolVLM2 in real shapes with random weights: edgevlm vs transformers.

For each model (configs below, written from the published ``config.json`` values) transformers'
``...ForConditionalGeneration`` is built on the device with random weights; edgevlm's family model
(registry: ``edgevlm.runtime.models``) gets the very same tensors through the family's weight rules and
runs through :class:`~edgevlm.runtime.backends.torch_backend.TorchBackend` (what ``Engine`` drives:
``encode_vision``, M-RoPE ``position_ids``, ``prefill``, CUDA-graph ``decode`` with the RoPE offset).
At each input size (random uint8 frame, the family's own preprocessing at its defaults), batch 1:

* ``vision_ms``: ``encode_vision`` (transformers: ``get_image_features``), CUDA events;
* ``ttft_ms``: vision + embed + prefill + argmax to the host (transformers: one forward);
* ``decode_tok_s``: greedy loop, token through the host each step (transformers: ``generate``,
  dynamic cache, ``(t(n) - t(1)) / (n - 1)``); at ``--batches`` above 1, that many copies of the
  request decode together (ours: ``decode_batch``, one CUDA graph; tok/s counts every row; vision
  and TTFT are measured at batch 1 only);
* ``peak_mb``: the implementation's weights plus the peak of what it allocated while running;
* ``copy_frac``: decoder weight bytes + attended KV per step / TPOT over the measured copy bandwidth;
* parity (``--parity``): last-position prefill logits, ``||x - ref|| / ||ref||`` against transformers
  in fp32 on the same weights, for ours in bf16 and transformers in bf16 (issue 12 §6).

``edgevlm-w4`` is the decoder's linears replaced in memory by RTN W4A16 ``Int4Linear`` (group 128),
not an ``edgevlm quantize`` bundle. Prints a table, then one JSON line; ``--out`` saves the JSON.
Usage: ``python3 bench/gpu_families.py [--models ...] [--sizes 448x448,1280x720] [--parity]``;
``--models tiny-qwen3-vl,...`` runs on the CPU (the suite's test of this harness).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import sys
import time

import numpy as np
import torch

from edgevlm.quantize.bench_measure import event_ms, measure_ceilings, wall_ms
from edgevlm.quantize.bench_models import decoder_weight_bytes, init_random_, quantize_decoder_w4
from edgevlm.runtime.loader import ModelFiles, compile_weight_rules, map_weight_name
from edgevlm.runtime.models import family_for

logger = logging.getLogger("gpu_families")

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
}
#: SmolVLM2's image processor at the hub's settings (longest edge 4 x 384, 384 px tiles).
SMOLVLM_IMAGE_PROCESSOR = {"do_resize": True, "size": {"longest_edge": 1536}, "do_image_splitting": True,
                           "max_image_size": {"longest_edge": 384}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                           "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}


def _smolvlm_processor(raw: dict) -> dict:
    tile = raw["vision_config"]["image_size"]
    return {**SMOLVLM_IMAGE_PROCESSOR, "size": {"longest_edge": 4 * tile}, "max_image_size": {"longest_edge": tile}}


def _tiny(name: str) -> dict:
    """A tiny config of ``name``'s structure (CPU test of this harness)."""
    raw = copy.deepcopy(CONFIGS[name])
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
    else:
        raw["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)
        raw["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    patch_size=8, image_size=48)
    return raw


def model_config(name: str) -> dict:
    """The config dict of ``name`` (a key of :data:`CONFIGS`, or ``tiny-`` + ``qwen2.5-vl``/``qwen3-vl``/``smolvlm``)."""
    if name.startswith("tiny-"):
        base = {"tiny-qwen2.5-vl": "qwen2.5-vl-3b", "tiny-qwen3-vl": "qwen3-vl-2b", "tiny-smolvlm": "smolvlm2-2.2b"}
        return _tiny(base[name])
    return copy.deepcopy(CONFIGS[name])


def _hf_class(raw: dict):
    import transformers

    return {"qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
            "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
            "smolvlm": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration)}[raw["model_type"]]


def build(name: str, device: torch.device, dtype: torch.dtype, max_seq_len: int, seed: int = 0):
    """``(ours, hf, files)``: transformers' model with random weights and ours over the same tensors."""
    raw = model_config(name)
    cfg_cls, model_cls = _hf_class(raw)
    hf_cfg = cfg_cls(**raw)
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
    raw_saved = hf_cfg.to_dict()
    family = family_for(raw_saved)
    cfg = family.parse_config(raw_saved)
    files = ModelFiles(model_dir=__import__("pathlib").Path("/nonexistent"), raw_config=raw_saved, config=cfg,
                       weight_files=[], family=family,
                       image_processor=_smolvlm_processor(raw) if raw["model_type"] == "smolvlm" else None)
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


def make_request(files: ModelFiles, size: tuple[int, int], n_text: int = 32, seed: int = 0):
    """``(ids (1, T) int64, vision)``: a random frame of ``size`` (W, H) through the family's processor and
    a prompt of random text tokens around the vision tokens (Qwen: between vision start / end)."""
    rng = np.random.default_rng(seed)
    w, h = size
    proc = files.family.make_processor(files)
    vision = proc.prepare([rng.integers(0, 256, (h, w, 3), dtype=np.uint8)])
    cfg = files.config
    hi = min(cfg.text.vocab_size, 151000) - 1
    text = rng.integers(5, min(hi, cfg.image_token_id) - 1, n_text).tolist()
    mid = [cfg.image_token_id] * vision.num_tokens
    if hasattr(cfg, "vision_start_token_id"):
        mid = [cfg.vision_start_token_id, *mid, cfg.vision_start_token_id + 1]
    ids = text[: n_text // 2] + mid + text[n_text // 2:]
    return torch.tensor([ids]), vision


def _hf_inputs(hf, files, ids, vision, device, dtype, batch: int = 1) -> dict:
    """transformers' inputs for ``batch`` copies of the request (pixels and grids repeated)."""
    px = vision.pixel_values.to(device, dtype)
    ids = ids.expand(batch, -1)
    kw = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids, device=device)}
    if vision.grid_thw is not None:
        mm = (ids == files.config.image_token_id).long().to(device)  # what the processor returns
        kw.update(pixel_values=px.repeat(batch, 1), image_grid_thw=vision.grid_thw.repeat(batch, 1).to(device),
                  mm_token_type_ids=mm)
    else:
        kw.update(pixel_values=px.unsqueeze(0).repeat(batch, *([1] * px.dim())))
    return kw


def bench_ours(model, files, ids, vision, *, new_tokens, device, ceilings, batch: int = 1) -> dict:
    """One row of ours at ``batch`` (1: vision, TTFT and decode; > 1: ``batch`` copies of the request
    decoding together through ``decode_batch``, the prompt prefilled once and its KV cache rows copied)."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    be = TorchBackend(model, max_batch_size=batch)
    ids_dev = ids.to(device)
    row: dict = {}

    def first():
        feats = be.encode_vision(vision)
        pos, delta = be.position_ids(ids_dev, vision)
        return int(be.prefill(be.embed(ids_dev, feats), position_ids=pos)[0].argmax()), delta

    if batch == 1:
        row["vision_ms"] = event_ms(lambda: be.encode_vision(vision), device, warmup=2, iters=5)
        row["ttft_ms"] = wall_ms(first, device, warmup=2, iters=5)
    tok0, delta = first()
    t = ids.shape[1]
    if batch > 1:  # the same request in every row: copy row 0's keys and values
        for layer in model.language_model.layers:
            cache = layer.self_attn.kv_cache
            for buf in (cache.k, cache.v):
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
    kv_tok = sum(layer.self_attn.kv_cache.bytes_per_token() for layer in model.language_model.layers)
    step = w_bytes + batch * be.kv_len_for(t + new_tokens) * kv_tok
    row.update(weight_bytes=w_bytes, bytes_per_step_mb=step / 2**20, gbps=step / row["tpot_ms"] / 1e6)
    row["copy_frac"] = row["gbps"] / ceilings["copy_gbps"]
    if cuda:
        own = sum(p.numel() * p.element_size() for p in model.parameters())
        row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base + own) / 2**20
    be.graphs = None
    if batch > 1:
        model.language_model.setup_caches(1, model.language_model.max_seq_len)  # back to one row
    return row


def bench_hf(hf, files, ids, vision, *, new_tokens, device, dtype, batch: int = 1) -> dict:
    """One row of transformers at ``batch`` (1: vision, TTFT and ``generate``; > 1: ``generate`` over
    ``batch`` copies of the request)."""
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
                vis_kw = {k: v for k, v in kw.items() if k in ("pixel_values", "image_grid_thw")}
                row["vision_ms"] = event_ms(lambda: hf.model.get_image_features(**vis_kw), device, warmup=2, iters=5)
            except Exception as exc:  # noqa: BLE001 - API differences between releases
                row["error_vision"] = f"{type(exc).__name__}: {exc}"[:200]
            row["ttft_ms"] = wall_ms(lambda: int(hf(**kw, logits_to_keep=1).logits[0, -1].argmax()), device,
                                     warmup=2, iters=5)

        def gen(n):
            return hf.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True,
                               pad_token_id=0)

        gen(2)
        t1 = wall_ms(lambda: gen(1), device, warmup=0, iters=3)
        tn = wall_ms(lambda: gen(new_tokens), device, warmup=0, iters=2)
    tpot = (tn - t1) / (new_tokens - 1)
    if tpot > 0:
        row["tpot_ms"] = tpot
        row["decode_tok_s"] = batch * 1e3 / tpot
    if cuda:
        own = sum(p.numel() * p.element_size() for p in hf.parameters())
        row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base + own) / 2**20
    return row


@torch.inference_mode()
def parity(ours, hf, files, ids, vision, device, dtype) -> dict:
    """Last-position prefill logits: ours and transformers in ``dtype`` vs transformers in fp32."""
    kw = _hf_inputs(hf, files, ids, vision, device, dtype)
    hf16 = hf(**kw, logits_to_keep=1).logits[0, -1].float()
    ids_dev = ids.to(device)
    feats = ours.encode_vision(vision)
    pos, _ = ours.position_ids(ids_dev, vision)
    ours_logits = ours.prefill(ours.embed(ids_dev, feats), position_ids=pos)[0].float()
    hf32 = copy.deepcopy(hf).float()
    kw32 = _hf_inputs(hf32, files, ids, vision, device, torch.float32)
    ref = hf32(**kw32, logits_to_keep=1).logits[0, -1].double()
    del hf32
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def rel(x):
        return float((x.double() - ref).norm() / ref.norm())

    return {"ours_vs_fp32": rel(ours_logits), "hf_bf16_vs_fp32": rel(hf16), "ours_vs_hf_bf16":
            float((ours_logits.double() - hf16.double()).norm() / hf16.double().norm()),
            "argmax_equal": int(ours_logits.argmax()) == int(ref.argmax())}


#: the implementations of a row (edgevlm-w4 last: it quantizes our model in place)
IMPLS = ("transformers", "edgevlm", "edgevlm-w4")

def run(models: list[str], sizes: list[tuple[int, int]], *, device: str = "cuda", new_tokens: int = 32,
        do_parity: bool = False, w4: bool = True, batches: tuple[int, ...] = (1,),
        impls: tuple[str, ...] = IMPLS) -> dict:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ceilings = measure_ceilings(dev)
    rows, par = [], {}
    t0 = time.perf_counter()
    for name in models:
        try:
            ours, hf, files = build(name, dev, dtype, max_seq_len=4096)
        except Exception as exc:  # noqa: BLE001 - keep the other models
            logger.exception("build %s", name)
            rows.append({"model": name, "impl": "-", "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        reqs = {f"{w}x{h}": make_request(files, (w, h)) for w, h in sizes}
        if do_parity:
            try:
                first_size = next(iter(reqs))
                par[name] = {"size": first_size, **parity(ours, hf, files, *reqs[first_size], dev, dtype)}
            except Exception as exc:  # noqa: BLE001
                logger.exception("parity %s", name)
                par[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        for impl in [i for i in IMPLS if i in impls and (w4 or i != "edgevlm-w4")]:
            if impl == "edgevlm-w4":
                try:
                    quantize_decoder_w4(ours)
                except Exception as exc:  # noqa: BLE001
                    rows.append({"model": name, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
            for (size, (ids, vision)), batch in itertools.product(reqs.items(), batches):
                common = {"model": name, "impl": impl, "size": size, "batch": batch, "prompt_tokens": ids.shape[1],
                          "vision_tokens": vision.num_tokens}
                try:
                    if impl == "transformers":
                        row = bench_hf(hf, files, ids, vision, new_tokens=new_tokens, device=dev, dtype=dtype,
                                       batch=batch)
                    else:
                        row = bench_ours(ours, files, ids, vision, new_tokens=new_tokens, device=dev,
                                         ceilings=ceilings, batch=batch)
                except Exception as exc:  # noqa: BLE001 - one impl failing keeps the others
                    logger.exception("%s %s %s", name, impl, size)
                    row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append({**common, **row})
        del ours, hf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"bench": "gpu_families", "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, **ceilings, "new_tokens": new_tokens,
            "rows": rows, "parity": par, "wall_s": round(time.perf_counter() - t0, 1)}


COLUMNS = ("model", "impl", "size", "batch", "vision_tokens", "vision_ms", "ttft_ms", "tpot_ms", "decode_tok_s", "peak_mb",
           "copy_frac")


def format_table(summary: dict) -> str:
    """One line per row (``-`` where missing), then the parity lines."""
    lines = [" | ".join(COLUMNS)]
    for r in summary["rows"]:
        cells = []
        for c in COLUMNS:
            v = r.get(c)
            cells.append("-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)))
        lines.append(" | ".join(cells) + (f" | ERROR {r['error'][:150]}" if r.get("error") else ""))
    for name, p in summary["parity"].items():
        lines.append(f"parity {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in p.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--sizes", default="448x448,1280x720", help="W x H, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--no-w4", action="store_true")
    ap.add_argument("--batches", default="1", help="decode batch sizes, comma-separated (e.g. 1,8)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",")]
    summary = run(args.models.split(","), sizes, device=args.device, new_tokens=args.new_tokens,
                  do_parity=args.parity, w4=not args.no_w4,
                  batches=tuple(int(b) for b in args.batches.split(",")), impls=tuple(args.impls.split(",")))
    print(f"device={summary['gpu'] or summary['device']} copy={summary['copy_gbps']:.0f} GB/s")
    print(format_table(summary))
    line = json.dumps(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
