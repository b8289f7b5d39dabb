"""The measurements of ``edgevlm bench`` (:mod:`edgevlm.quantize.benchmark`): timing, ceilings, inputs.

Timers (wall clock, CUDA events), the device's copy-bandwidth and matmul ceilings, the benchmark
inputs and FLOP counts, and the measurement of one model by one implementation
(:func:`bench_edgevlm`, :func:`bench_hf`), each giving one result row whose metrics the module
docstring of :mod:`edgevlm.quantize.benchmark` defines.
"""

from __future__ import annotations

import statistics
import time

#: the edgevlm implementations ``edgevlm bench`` measures: name -> (decoder weights, ``kv_cache_dtype``);
#: ``w4-head``: W4A16 decoder and ``lm_head`` (what ``edgevlm quantize --lm-head int4`` builds)
VARIANTS = {
    "edgevlm": ("16bit", None),
    "edgevlm-w4": ("w4", None),
    "edgevlm-w4-head4": ("w4-head", None),
    "edgevlm-w4-kv4": ("w4", "int4"),
    "edgevlm-w4-kv8": ("w4", "fp8_e4m3"),
}


# ---------------------------------------------------------------------------- timing
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, device, *, warmup: int = 1, iters: int = 3) -> float:
    """Median wall-clock milliseconds of ``fn()`` (device synchronised around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_ms(fn, device, *, warmup: int = 2, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` by CUDA events (wall clock on CPU)."""
    import torch

    if device.type != "cuda":
        return wall_ms(fn, device, warmup=warmup, iters=iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(device) -> dict:
    """Device-to-device copy bandwidth (GB/s, bytes read + written) and dense matmul rate (TFLOP/s,
    bf16 on CUDA, float32 on CPU) on random data."""
    import torch

    cuda = device.type == "cuda"
    n_bytes = (1 << 30) if cuda else (1 << 26)
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = event_ms(lambda: dst.copy_(src), device, warmup=2, iters=10 if cuda else 3)
    n = 8192 if cuda else 1024
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = event_ms(lambda: a @ b, device, warmup=3, iters=10 if cuda else 3)
    return {"copy_gbps": 2 * n_bytes / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
            "matmul_dtype": str(dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------- inputs and costs
def make_inputs(cfg, n_text: int, seed: int = 0):
    """``(ids list, pixels (1, 3, S, S) float32 CPU)``: BOS, 4 text tokens, the image placeholders,
    the rest of ``n_text`` random text tokens (never special ids 0-4)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n_vis = (cfg.vision.image_size // cfg.vision.patch_size) ** 2
    n_vis += 1 if cfg.vision_feature_select_strategy == "full" else 0
    text = torch.randint(5, cfg.text.vocab_size, (n_text,), generator=g).tolist()
    ids = [1] + text[:4] + [cfg.image_token_id] * n_vis + text[4:]
    pixels = torch.randn(1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g)
    return ids, pixels


def vision_flops(cfg, batch: int) -> float:
    """Matmul FLOPs of the vision encoder (blocks LLaVA uses) + projector for ``batch`` images."""
    v, p = cfg.vision, cfg.vision.patch_size
    n_patch = (v.image_size // p) ** 2
    n, d = n_patch + 1, v.hidden_size
    per_layer = 2 * n * d * 4 * d + 2 * n * d * 2 * v.intermediate_size + 4 * n * n * d
    stem = 2 * n_patch * 3 * p * p * d
    proj = 2 * n_patch * (d * len(cfg.vision_feature_layer) * cfg.text.hidden_size + cfg.text.hidden_size ** 2)
    return batch * (cfg.vision_blocks_needed * per_layer + stem + proj)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------- edgevlm
def bench_edgevlm(model, cfg, *, kv_cache_dtype, ids, pixels, new_tokens: int, batch_sizes: list[int],
                  vision_batch: int, device, ceilings: dict, weight_bytes: int) -> dict:
    """Measure one edgevlm variant (see the module docstring); returns a result row."""
    import torch

    from edgevlm.runtime.backends.torch_backend import TorchBackend

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    be = TorchBackend(model, kv_cache_dtype=kv_cache_dtype, max_batch_size=max(batch_sizes))
    ids_dev = torch.tensor([ids], device=device)
    t = len(ids)
    row: dict = {}

    def first_token() -> int:
        feats = be.encode_image(pixels)
        return int(be.prefill(be.embed(ids_dev, feats))[0].argmax())

    row["ttft_ms"] = wall_ms(first_token, device, warmup=2, iters=5)
    first = first_token()

    def decode_loop() -> None:  # Engine.ask's greedy loop: step k + 1 queued before token k is read
        for _ in be.greedy_tokens(first, t, new_tokens):
            pass

    def host_fed_loop() -> None:  # the loop before greedy_tokens: decode, argmax and a sync per token
        tok, pos = first, t
        for _ in range(new_tokens):
            tok = int(be.decode(tok, pos)[0].argmax())
            pos += 1

    loop_ms = wall_ms(decode_loop, device, warmup=1, iters=3)
    row["tpot_ms"] = loop_ms / new_tokens
    row["decode_tok_s"] = 1e3 / row["tpot_ms"]
    row["decode_tok_s_host_fed"] = new_tokens / wall_ms(host_fed_loop, device, warmup=1, iters=3) * 1e3
    kv_len = be.kv_len_for(t + new_tokens)
    layers = model.language_model.layers
    kv_tok = sum(layer.self_attn.kv_cache.bytes_per_token() for layer in layers)  # all layers, k + v
    row["kv_bytes_per_token"] = kv_tok
    step_bytes = weight_bytes + kv_len * kv_tok
    row["bytes_per_step_mb"] = step_bytes / 2**20
    if be.graphs is not None:
        be.graphs.tokens[:1].fill_(first)
        be.graphs.positions[:1].fill_(t)
        row["step_gpu_ms"] = event_ms(lambda: be.graphs.replay(1, be.kv_len_for(t + 1)), device, warmup=3, iters=20)
        row["graphs"] = len(be.graphs)
    row["gbps"] = step_bytes / row["tpot_ms"] / 1e6
    row["copy_frac"] = row["gbps"] / ceilings["copy_gbps"]
    row["bound_tok_s"] = ceilings["copy_gbps"] * 1e9 / step_bytes
    row["batch_tok_s"] = {}
    for b in batch_sizes:
        if b == 1:
            continue
        for r0 in range(0, b, 4):  # prefill b rows, four at a time
            rows = list(range(r0, min(b, r0 + 4)))
            feats = be.encode_images([pixels] * len(rows))
            be.prefill_batch([be.embed(ids_dev, f) for f in feats], rows)
        def batch_loop(b=b) -> None:  # the continuous batcher's greedy steps: k + 1 queued before k is read
            pending = be.greedy_step(b, {row: (first, t, 0) for row in range(b)})
            for _ in range(new_tokens - 1):
                queued = be.greedy_step(b)
                pending.tokens()
                pending = queued
            pending.tokens()

        def host_fed_batch_loop(b=b) -> None:  # decode_batch, argmax and a sync per step
            tok, pos = [first] * b, t
            for _ in range(new_tokens):
                tok = be.decode_batch(tok, [pos] * b).argmax(dim=-1).tolist()
                pos += 1

        row["batch_tok_s"][str(b)] = b * new_tokens / wall_ms(batch_loop, device, warmup=1, iters=2) * 1e3
        row.setdefault("batch_tok_s_host_fed", {})[str(b)] = \
            b * new_tokens / wall_ms(host_fed_batch_loop, device, warmup=1, iters=2) * 1e3
    vis_px = pixels.expand(vision_batch, -1, -1, -1).contiguous().to(device)
    vis_ms = event_ms(lambda: be.encode_image(vis_px), device, warmup=2, iters=5)
    row["vision_batch"] = vision_batch
    row["vision_img_s"] = vision_batch / vis_ms * 1e3
    row["vision_tflops"] = vision_flops(cfg, vision_batch) / vis_ms / 1e9
    row["vision_mm_frac"] = row["vision_tflops"] / ceilings["matmul_tflops"]
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - base
        row["peak_mb"] = (peak + weight_bytes + _vision_bytes(model)) / 2**20
    be.graphs = None
    for layer in model.language_model.layers:  # back to a small cache for the next variant
        layer.self_attn.kv_cache = None
    model.language_model.setup_caches(1, model.language_model.max_seq_len)
    return row


def _vision_bytes(model) -> int:
    return _nbytes(model.vision_tower.parameters()) + _nbytes([model.language_model.embed_tokens.weight])


# ---------------------------------------------------------------------------- transformers
def bench_hf(hf, cfg, *, ids, pixels, new_tokens: int, vision_batch: int, device, ceilings: dict) -> dict:
    """Measure transformers' LLaVA: forward for TTFT, ``generate`` (dynamic and static cache,
    ``disable_compile``) for TPOT; returns a result row (``hf_cache``: the faster cache)."""
    import torch

    from edgevlm.runtime.kv_cache import kv_bytes_per_token

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    dtype = next(hf.parameters()).dtype
    ids_dev = torch.tensor([ids], device=device)
    mask = torch.ones_like(ids_dev)
    px = pixels.to(device, dtype)
    row: dict = {}

    @torch.inference_mode()
    def first_token() -> int:
        out = hf(input_ids=ids_dev, pixel_values=pixels.to(device, dtype), attention_mask=mask, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    row["ttft_ms"] = wall_ms(first_token, device, warmup=2, iters=5)

    @torch.inference_mode()
    def gen(n: int, cache: str | None):
        kwargs = {"cache_implementation": cache} if cache else {}
        return hf.generate(input_ids=ids_dev, pixel_values=px, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, disable_compile=True, pad_token_id=0, **kwargs)

    best = None
    for cache in (None, "static"):
        try:
            gen(2, cache)
            t1 = wall_ms(lambda c=cache: gen(1, c), device, warmup=0, iters=3)
            tn = wall_ms(lambda c=cache: gen(new_tokens, c), device, warmup=0, iters=2)
        except Exception as exc:  # noqa: BLE001 - a cache type this transformers build cannot run
            row[f"error_{cache or 'dynamic'}"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        tpot = (tn - t1) / (new_tokens - 1)
        if tpot <= 0:  # timing noise larger than the decode time (tiny model on a busy CPU)
            row[f"error_{cache or 'dynamic'}"] = f"non-positive TPOT estimate {tpot:.3f} ms"
            continue
        row[f"tpot_ms_{cache or 'dynamic'}"] = tpot
        if best is None or tpot < best[1]:
            best = (cache or "dynamic", tpot)
    if best is not None:
        row["hf_cache"], row["tpot_ms"] = best
        row["decode_tok_s"] = 1e3 / row["tpot_ms"]
        tc = cfg.text
        kv_tok = kv_bytes_per_token("bf16" if dtype != torch.float32 else "fp32", tc.num_hidden_layers,
                                    tc.num_key_value_heads, tc.head_dim)
        w_bytes = _nbytes(hf.model.language_model.layers.parameters()) + _nbytes(hf.lm_head.parameters())
        step_bytes = w_bytes + (len(ids) + new_tokens // 2) * kv_tok
        row["kv_bytes_per_token"] = kv_tok
        row["bytes_per_step_mb"] = step_bytes / 2**20
        row["gbps"] = step_bytes / row["tpot_ms"] / 1e6
        row["copy_frac"] = row["gbps"] / ceilings["copy_gbps"]
    try:
        vis_px = pixels.expand(vision_batch, -1, -1, -1).contiguous().to(device, dtype)
        with torch.inference_mode():
            vis_ms = event_ms(lambda: hf.model.get_image_features(pixel_values=vis_px), device, warmup=2, iters=5)
        row["vision_batch"] = vision_batch
        row["vision_img_s"] = vision_batch / vis_ms * 1e3
        row["vision_tflops"] = vision_flops(cfg, vision_batch) / vis_ms / 1e9
        row["vision_mm_frac"] = row["vision_tflops"] / ceilings["matmul_tflops"]
    except Exception as exc:  # noqa: BLE001 - API differences between transformers releases
        row["error_vision"] = f"{type(exc).__name__}: {exc}"[:200]
    if cuda:
        row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base + _nbytes(hf.parameters())) / 2**20
    return row
