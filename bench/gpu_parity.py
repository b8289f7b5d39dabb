#!/usr/bin/env python3
"""Parity of edgevlm's PyTorch LLaVA runtime against transformers' LlavaForConditionalGeneration.

Builds random LLaVA checkpoints with transformers (a tiny one, the same config as
tests/runtime/test_hf_parity.py, and a ~100M-parameter one), saves them with save_pretrained, loads
them with both implementations and compares, at a square and a non-square input resolution:

* ``prefill_rel_err``: max |ours - hf| / max |hf| over the logits of every prompt position;
* ``decode_rel_err``: the same for 8 decode steps through our static KV cache, against
  transformers' full-sequence logits at those positions;
* ``greedy``: tokens of a 24-token greedy generation that agree with ``hf.generate`` (ours runs
  prefill + static-cache decode), and the index of the first disagreement;
* in bf16, ``hf_vs_fp32``/``ours_vs_fp32``: each implementation's bf16 prefill logits against
  transformers in float32 — the bf16 noise floor. A row passes when both errors are within
  ``--max-rel-err`` (1e-4 fp32, 2e-2 bf16) or within transformers' own bf16 error.

Usage (on the GPU box): ``python bench/gpu_parity.py`` (CUDA, bfloat16). Here on a CPU:
``python bench/gpu_parity.py --device cpu --fp32``. Prints a table and ends with one JSON line.
Needs torch, transformers, safetensors; not pydantic, tokenizers, jinja2 or OpenCV.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bootstrap_imports() -> None:
    """Make ``edgevlm.runtime`` importable from a plain checkout (no pip install): the repo maps
    ``runtime/`` to ``edgevlm.runtime`` only through setuptools' package-dir."""
    sys.path.insert(0, str(REPO))
    try:
        import edgevlm.runtime.loader  # noqa: F401
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "edgevlm.runtime", REPO / "runtime" / "__init__.py", submodule_search_locations=[str(REPO / "runtime")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["edgevlm.runtime"] = module
    spec.loader.exec_module(module)


SIZES = {
    # vision (hidden, layers, heads, image, patch), text (hidden, layers, heads, kv heads, inter, vocab)
    "tiny": dict(vision=(32, 3, 4, 64, 16), text=(64, 2, 4, 2, 128, 71), res=[(64, 64), (48, 96)]),
    "100m": dict(vision=(384, 6, 6, 224, 16), text=(768, 8, 12, 4, 2048, 32000), res=[(224, 224), (160, 288)]),
}


def build_checkpoint(out: Path, size: str, seed: int = 0) -> Path:
    """Random LLaVA (CLIP ViT, penultimate-layer features, GQA Llama) saved by transformers."""
    import torch
    import transformers

    (vd, vl, vh, img, patch), (td, tl, th, tkv, ti, vocab) = SIZES[size]["vision"], SIZES[size]["text"]
    vc = transformers.CLIPVisionConfig(hidden_size=vd, intermediate_size=4 * vd, num_hidden_layers=vl,
                                       num_attention_heads=vh, image_size=img, patch_size=patch)
    tc = transformers.LlamaConfig(vocab_size=vocab, hidden_size=td, intermediate_size=ti, num_hidden_layers=tl,
                                  num_attention_heads=th, num_key_value_heads=tkv, max_position_embeddings=1024,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=4, vision_feature_layer=-2,
                                   vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # O(1) activations and well-spread logits (transformers' init is near-uniform)
        for name, p in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "position_embedding.weight")):
                p.normal_(0.0, 0.2)
            elif p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1)
    model.save_pretrained(out)
    return out


def rel_err(ours, ref) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def _force_interpolation(hf):
    """Make transformers' CLIP embeddings always interpolate position embeddings (generate() cannot
    pass ``interpolate_pos_encoding``; for the native square size it is the identity anyway)."""
    embeddings = next(m for m in hf.modules() if type(m).__name__ == "CLIPVisionEmbeddings")
    original = embeddings.forward
    embeddings.forward = lambda pv, **_: original(pv, interpolate_pos_encoding=True)
    return hf.eval()


def compare(ckpt: Path, size: str, device: str, dtype, n_decode: int = 8, n_greedy: int = 24) -> list[dict]:
    import torch
    import transformers

    from edgevlm.runtime.loader import load_model, read_model_files

    dev = torch.device(device)
    hf = _force_interpolation(transformers.LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).to(dev))
    ours = load_model(read_model_files(ckpt), device=dev, dtype=dtype, max_seq_len=1024)
    hf32 = None  # float32 reference: the bf16 noise floor of both implementations
    if dtype != torch.float32:
        hf32 = _force_interpolation(
            transformers.LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).to(dev))
    n_params = sum(p.numel() for p in hf.parameters()) / 1e6
    rows = []
    g = torch.Generator().manual_seed(0)
    for h, w in SIZES[size]["res"]:
        n_vis = ours.vision_tower.num_vision_tokens(h, w)
        text = torch.randint(5, hf.config.text_config.vocab_size, (24,), generator=g).tolist()
        ids = torch.tensor([[1] + text[:8] + [4] * n_vis + text[8:]], device=dev)  # (1, T)
        pixels = torch.randn(1, 3, h, w, generator=g).to(dev, dtype)
        t = ids.shape[1]
        with torch.inference_mode():
            ref = hf(input_ids=ids, pixel_values=pixels).logits[0]  # (T, V)
            out = ours(ids, pixels)[0]
            prefill_err = rel_err(out, ref)
            floor = {}
            if hf32 is not None:
                ref32 = hf32(input_ids=ids, pixel_values=pixels.float()).logits[0]
                floor = dict(hf_vs_fp32=rel_err(ref, ref32), ours_vs_fp32=rel_err(out, ref32))
            embeds = ours.embed(ids[:, : t - n_decode], ours.encode_image(pixels))
            steps = [ours.prefill(embeds)[0]]
            for pos in range(t - n_decode, t):
                steps.append(ours.decode(ids[:, pos : pos + 1], torch.tensor([pos], device=dev))[0])
            decode_err = max(rel_err(s, ref[t - n_decode - 1 + i]) for i, s in enumerate(steps))
            gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                              max_new_tokens=n_greedy, min_new_tokens=n_greedy, do_sample=False)
            ref_ids = gen[0, t:].tolist()
            logits = ours.prefill(ours.embed(ids, ours.encode_image(pixels)))
            our_ids = []
            for pos in range(t, t + len(ref_ids)):
                step = logits[0].float()
                step[hf.generation_config.eos_token_id] = float("-inf")  # as min_new_tokens does in generate
                our_ids.append(int(step.argmax()))
                logits = ours.decode(torch.tensor([[our_ids[-1]]], device=dev), torch.tensor([pos], device=dev))
        agree = sum(a == b for a, b in zip(our_ids, ref_ids, strict=True))
        first_diff = next((i for i, (a, b) in enumerate(zip(our_ids, ref_ids, strict=True)) if a != b), None)
        rows.append(dict(model=size, params_m=round(n_params, 1), input_hw=f"{h}x{w}", vision_tokens=n_vis,
                         prompt_tokens=t, prefill_rel_err=prefill_err, decode_rel_err=decode_err,
                         greedy_agree=agree, greedy_total=len(ref_ids), first_divergence=first_diff, **floor))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--fp32", action="store_true", help="compare in float32 instead of bfloat16")
    ap.add_argument("--sizes", default="tiny,100m", help="comma-separated: " + ",".join(SIZES))
    ap.add_argument("--max-rel-err", type=float, default=None,
                    help="pass threshold on prefill/decode rel. error (default 1e-4 fp32, 2e-2 bf16)")
    args = ap.parse_args()
    _bootstrap_imports()
    import torch
    import transformers

    dtype = torch.float32 if args.fp32 else torch.bfloat16
    threshold = args.max_rel_err or (1e-4 if args.fp32 else 2e-2)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --fp32", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            ckpt = build_checkpoint(Path(tmp) / size, size)
            rows.extend(compare(ckpt, size, args.device, dtype))
    for r in rows:  # in bf16, within the threshold or within transformers' own bf16 error vs fp32
        limit = max(threshold, r.get("hf_vs_fp32", 0.0))
        r["pass"] = r["prefill_rel_err"] <= limit and r["decode_rel_err"] <= limit
    header = f"{'model':6} {'params_M':>8} {'input':>8} {'vis_tok':>7} {'prompt':>6} {'prefill_rel':>11} " \
             f"{'decode_rel':>10} {'greedy':>7} {'1st_diff':>8} {'pass':>5}"
    print(f"device={args.device} dtype={str(dtype).removeprefix('torch.')} torch={torch.__version__} "
          f"transformers={transformers.__version__} threshold={threshold:g}")
    if not args.fp32:
        header += f" {'hf_vs_fp32':>10} {'ours_vs_fp32':>12}"
    print(header)
    for r in rows:
        line = (f"{r['model']:6} {r['params_m']:8.1f} {r['input_hw']:>8} {r['vision_tokens']:7d} {r['prompt_tokens']:6d} "
                f"{r['prefill_rel_err']:11.2e} {r['decode_rel_err']:10.2e} "
                f"{r['greedy_agree']:>3}/{r['greedy_total']:<3} {str(r['first_divergence']):>8} {str(r['pass']):>5}")
        if not args.fp32:
            line += f" {r['hf_vs_fp32']:10.2e} {r['ours_vs_fp32']:12.2e}"
        print(line)
    summary = {
        "bench": "gpu_parity", "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
        "transformers": transformers.__version__, "threshold": threshold,
        "max_prefill_rel_err": max(r["prefill_rel_err"] for r in rows),
        "max_decode_rel_err": max(r["decode_rel_err"] for r in rows),
        "greedy_agree": sum(r["greedy_agree"] for r in rows), "greedy_total": sum(r["greedy_total"] for r in rows),
        "pass": all(r["pass"] for r in rows), "wall_s": round(time.perf_counter() - t0, 1), "rows": rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
