#!/usr/bin/env python3
"""Where the time of a W4A16 decode step goes outside the INT4 matmuls: kernels grouped per step.

Builds the LLaVA-1.5-7B-shape model the way ``bench/w4a16_kernel.py``'s model section does (random
weights, bf16, decoder linears RTN W4A16 group 128, fused q/k/v and gate/up, the fused Triton decode step,
CUDA graphs), fills the bf16 KV cache with random values, and for each decode-step variant and batch size
captures the step at the bench's attended length (a 609-token prompt -> ``kv_len`` bucket 768, rows at
position 609), then

* times graph replays with CUDA events (median step, ms),
* replays ``--steps`` steps under ``torch.profiler`` and groups the CUDA kernels: ``int4_matmul``
  (the W4A16 kernels), ``attention`` (RoPE + KV write + attention kernels), ``norm``, ``elementwise``
  (SiLU*up, fills, copies, gathers, masks), ``lm_head`` (the bf16 cuBLAS product), ``other``; per group
  kernels per step and µs per step; ``gap_us`` = the event-timed step minus the kernels' busy time (the
  graph's launch gaps between kernels),
* at batch 1 also the decode loop of the bench harness (``TorchBackend.decode`` + argmax + ``int()`` per
  token, 32 tokens): ``tpot_ms`` and the host/sync time around the graph (``tpot - step``).

Variants (``--variants``):

* ``before`` -- the step as it was before session 8: RoPE + KV write (``rope_kv_write``), split attention and
  its combine (``decode_attention``) as three kernels per layer, and the decode mask / RoPE row gathers that
  the old ``Decoder.forward`` built every step although the fused step does not read them (re-created here
  by :func:`legacy_prologue`, the same torch ops),
* ``nomask`` -- without those unused mask / gather kernels, three attention kernels,
* ``after`` -- and :func:`~edgevlm.runtime.kernels.decode_fused.rope_decode_attention`: one attention kernel
  per layer (the default),
* ``after_pdl`` -- ``after`` with the W4A16 kernels as programmatic dependent launches (opt-in),
* ``after_w4head`` -- ``after`` with an RTN W4A16 ``lm_head`` (a what-if: other logits),
* ``nomask_pdl``, ``nomask_w4head`` -- the same two switches on ``nomask`` (the default three attention kernels),
* ``nomask_split16`` -- ``nomask`` with :func:`~edgevlm.runtime.kernels.decode_fused.decode_attention` splitting the
  keys 16 ways at every batch size (its schedule before 2026-12-02; now the splits shrink to about one wave of CTAs
  and one split skips the combine kernel).

A variant name is a base (``before``, ``nomask``, ``after``) and any of these suffixes, each after a ``_``, in any
order and combination (e.g. ``nomask_pdlall_norm16``; :func:`parse_variant`):

* ``nopdl`` -- every kernel launched plainly (``w4a16_mma.PDL`` and ``decode_fused.PDL`` off; the library's default
  since session 11 launches a decode step of at most 8 rows with programmatic dependent launch, PDL),
* ``pdl`` -- only the W4A16 CUDA kernels as programmatic dependent launches (the Triton kernels plain),
* ``pdlall`` -- those and the fused decode step's Triton kernels (``decode_fused.PDL``: RMSNorm, RoPE / KV write,
  attention and its combine, SiLU*up, each waiting for the previous kernel at its top), at every batch size
  (``pdl.MAX_ROWS = None``; the default limits PDL to 8 rows),
* ``normN`` -- :func:`~edgevlm.runtime.kernels.decode_fused.add_rms_norm` with ``N`` warps per row (``norm4``,
  ``norm16``; ``decode_fused.ADD_RMS_NORM_WARPS``; the default is 16 from 4096 columns, 4 below),
* ``w4head`` -- an RTN W4A16 ``lm_head`` (a what-if: other logits),
* ``split16`` -- the 16-way key split at every batch size,
* ``ungated`` -- the fused gate/up projections without the W4A16 gated-MLP epilogue (the plain kernel, then the
  SiLU*up kernel; the library's default since session 13 applies ``act(gate) * up`` in the matmul's epilogue),
* ``sepcombine`` -- with the ``after`` base: the key splits combined by the combine kernel after the one-kernel
  attention instead of its last CTA (``decode_fused.FUSED_ATTENTION_COMBINE``: two attention kernels per layer),
* ``nonorm`` -- a what-if with other logits: the layers' ``add_rms_norm`` launches nothing and passes its inputs on
  (``(x, delta)`` as ``(s, normed)``), the upper bound of what folding the norms into the matmuls could save,
* ``noattn`` -- a what-if with other logits, with the ``after`` base: the one-kernel attention launches nothing and
  returns the query part of ``qkv`` (the critical-path cost of attention, RoPE and the KV write together),
* ``regring`` / ``loadsonly`` -- each W4A16 launch of the lean variant's table entry ``(lean|async, KSPLIT, DEPTH,
  TILES_PER_CTA)`` runs the register-ring kernel with the same schedule (a DEPTH it lacks: the next one it has),
  computing (``regring``) or as its loads-only diagnostic (``loadsonly``: the weights streamed, nothing computed;
  other logits): the step's time if the matmuls' arithmetic were free. Gated launches keep their own kernel, so
  compare with ``_ungated``.

Every switch is restored when the variant's captures are done.

Prints a table per batch size, then one JSON line. Usage (on a CUDA GPU)::

    python3 bench/decode_step_breakdown.py [--batch-sizes 1,8] [--steps 20] [--variants before,nomask,after]
    python3 bench/decode_step_breakdown.py --variants nomask,nomask_pdlall,nomask_norm8,nomask_pdlall_norm16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import statistics
import sys
import time
from collections import defaultdict

GROUPS = ("int4_matmul", "attention", "norm", "elementwise", "lm_head", "other")


def group_of(name: str) -> str:
    """The group of a CUDA kernel name (see the module docstring)."""
    n = name.lower()
    if "w4a16" in n:
        return "int4_matmul"
    if "attn" in n or "rope" in n or "flash" in n or "sdpa" in n or "softmax" in n:
        return "attention"
    if "rms" in n or "norm" in n:
        return "norm"
    if any(k in n for k in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_", "sm80_")):
        return "lm_head"
    if any(k in n for k in ("silu", "gated", "elementwise", "vectorized", "fill", "copy", "index", "arange",
                            "compare", "reduce", "cat", "where", "embedding")):
        return "elementwise"
    return "other"


@contextlib.contextmanager
def legacy_prologue(on: bool):
    """While ``on``: every fused decode step (``Decoder._fused_decode``, all decoders) first builds what
    ``Decoder.forward`` built before session 8 and the fused step never read: the RoPE rows ``cos`` /
    ``sin`` / ``sin_signed`` at the positions (gather + cast each) and the additive decode mask
    (``decode_mask``, ``full``, ``masked_fill_``). Same torch ops, same shapes: the old step's extra kernels."""
    import torch

    from edgevlm.runtime.decoder import Decoder
    from edgevlm.runtime.kv_cache import decode_mask

    if not on:
        yield
        return
    real = Decoder._fused_decode

    def step(self, embeds, pos, kv_len, rope_pos=None):
        ip = pos[:, None]  # (B, 1) as input_pos was
        rp = ip if rope_pos is None else rope_pos[:, None]
        for table in (self.rope_cos, self.rope_sin, self.rope_sin_signed):
            table[rp].to(embeds.dtype)
        allowed = decode_mask(ip, kv_len)
        mask = torch.full(allowed.shape, float("-inf"), dtype=embeds.dtype, device=embeds.device)
        mask.masked_fill_(allowed, 0.0)
        return real(self, embeds, pos, kv_len, rope_pos)

    Decoder._fused_decode = step
    try:
        yield
    finally:
        Decoder._fused_decode = real


BASES = ("before", "nomask", "after")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One decode-step variant (module docstring): its base and the switches its suffixes turn on. ``norm_warps``:
    warps of ``add_rms_norm`` (None: the module's rule)."""

    base: str
    w4a16_pdl: bool | None = None
    decode_pdl: bool | None = None
    pdl_all_rows: bool = False
    w4head: bool = False
    split16: bool = False
    norm_warps: int | None = None
    ungated: bool = False
    sepcombine: bool = False
    nonorm: bool = False
    noattn: bool = False
    matmul: str | None = None  # "regring" / "loadsonly": the register-ring kernel for every lean launch


def parse_variant(name: str) -> Variant:
    """The :class:`Variant` of a name ``base[_suffix]...`` (module docstring: bases ``before`` / ``nomask`` /
    ``after``; suffixes ``nopdl``, ``pdl``, ``pdlall``, ``normN`` with ``N`` a power of two 1..32, ``w4head``, ``split16``,
    ``ungated``, in any order). Raises ``ValueError`` for another base, an unknown or repeated suffix, or a bad warp count."""
    base, *suffixes = name.split("_")
    if base not in BASES:
        raise ValueError(f"variant {name!r}: the base must be one of {', '.join(BASES)}, got {base!r}")
    if len(set(suffixes)) != len(suffixes):
        raise ValueError(f"variant {name!r}: a suffix is repeated")
    opts: dict = {}
    for suffix in suffixes:
        norm = re.fullmatch(r"norm(\d+)", suffix)
        if suffix in ("nopdl", "pdl", "pdlall") and "w4a16_pdl" in opts:
            raise ValueError(f"variant {name!r}: nopdl, pdl and pdlall exclude each other")
        if suffix == "nopdl":
            opts["w4a16_pdl"] = opts["decode_pdl"] = False
        elif suffix == "pdl":
            opts["w4a16_pdl"], opts["decode_pdl"] = True, False
        elif suffix == "pdlall":
            opts["w4a16_pdl"] = opts["decode_pdl"] = opts["pdl_all_rows"] = True
        elif suffix == "w4head":
            opts["w4head"] = True
        elif suffix == "split16":
            opts["split16"] = True
        elif suffix == "ungated":
            opts["ungated"] = True
        elif suffix == "sepcombine":
            opts["sepcombine"] = True
        elif suffix == "nonorm":
            opts["nonorm"] = True
        elif suffix in ("regring", "loadsonly"):
            if "matmul" in opts:
                raise ValueError(f"variant {name!r}: regring and loadsonly exclude each other")
            opts["matmul"] = suffix
        elif suffix == "noattn":
            if base != "after":
                raise ValueError(f"variant {name!r}: noattn needs the after base (the one-kernel attention)")
            opts["noattn"] = True
        elif norm:
            warps = int(norm.group(1))
            if warps < 1 or warps > 32 or warps & (warps - 1) or "norm_warps" in opts:
                raise ValueError(f"variant {name!r}: normN needs one power of two N in 1..32, got {suffix!r}")
            opts["norm_warps"] = warps
        else:
            raise ValueError(f"variant {name!r}: unknown suffix {suffix!r} (nopdl, pdl, pdlall, normN, w4head, split16, "
                             "ungated, sepcombine, nonorm, noattn, regring, loadsonly)")
    return Variant(base, **opts)


def register_ring_launch(launch, loads_only: bool):
    """``launch`` (:func:`~edgevlm.runtime.kernels.w4a16_mma.w4a16_mma`) wrapped so that a call the table gives to
    the lean variant (``lean`` / ``async``, :func:`~edgevlm.runtime.kernels.w4a16_mma.mma_config`) runs the
    register-ring kernel with the same KSPLIT, TILES_PER_CTA and the smallest compiled DEPTH >= the entry's
    (``MMA_CONFIGS``), in mode 1 (loads only: other outputs) or 2 (computing). Calls with an explicit ``config`` or
    ``mode``, and shapes without such an entry, pass through unchanged."""
    from edgevlm.runtime.kernels import w4a16_mma as mk

    def wrapped(x, qw, meta, group_size, bias=None, config=None, *, mode=None, **kw):
        if config is None and mode is None and x.dim() == 2:
            m, n, k = x.shape[0], qw.shape[0] * 16, qw.shape[1] * 64  # the mma layout: (N/16, K/64, 32, 4)
            kind, a, b, tpc = mk.mma_config(m, n, k, group_size, lean=True)
            depth = min((d for ks, d in mk.MMA_CONFIGS if ks == a and d >= b), default=None)
            if kind in ("lean", "async") and depth is not None:
                kw.pop("late_trigger", None)
                return launch(x, qw, meta, group_size, bias, ("reg", a, depth, tpc), mode=1 if loads_only else 2,
                              **kw)
        return launch(x, qw, meta, group_size, bias, config, mode=mode, **kw)

    return wrapped


@contextlib.contextmanager
def variant(name: str, dec=None):
    """Switches of one variant (:func:`parse_variant`, module docstring) for the body's captures, all restored
    after: the base sets ``decode_fused.FUSED_ATTENTION`` (``after``) and the legacy prologue (``before``);
    ``_split16``: the old 16-way key split of ``decode_attention``; ``_nopdl``: plain launches everywhere;
    ``_pdl``: only the W4A16 kernels launched as programmatic dependents (``w4a16_mma.PDL``); ``_pdlall``: those
    and the fused decode step's Triton kernels (``decode_fused.PDL``) at every batch size (``pdl.MAX_ROWS``); ``_normN``:
    ``decode_fused.ADD_RMS_NORM_WARPS = N``; ``_sepcombine``: ``decode_fused.FUSED_ATTENTION_COMBINE`` off; ``_nonorm``: ``decode_fused.add_rms_norm`` replaced by a
    function that returns its first two arguments (no kernel; other logits); ``_noattn``:
    ``decode_fused.rope_decode_attention`` replaced by the query heads of ``qkv`` (no kernel; other logits);
    ``_regring`` / ``_loadsonly``: ``w4a16_mma.w4a16_mma`` wrapped by :func:`register_ring_launch`; ``_w4head``: ``dec``'s bf16 ``lm_head`` replaced by an RTN W4A16
    ``Int4Linear`` (group 128; other logits: a what-if for bundles whose head is quantized); ``_ungated``: ``dec``'s
    gated gate/up projections unmarked (``Int4Linear.set_gated(None)``, re-marked after). Switches a variant
    does not name keep their values (the environment's). Raises ``ValueError`` for a bad name, before changing
    anything."""
    v = parse_variant(name)
    from edgevlm.runtime.kernels import decode_fused, pdl
    from edgevlm.runtime.kernels import w4a16_mma as mk

    saved = (decode_fused.FUSED_ATTENTION, decode_fused.ATTENTION_CTA_BUDGET, decode_fused.PDL,
             decode_fused.ADD_RMS_NORM_WARPS, mk.PDL, pdl.MAX_ROWS, decode_fused.FUSED_ATTENTION_COMBINE,
             decode_fused.add_rms_norm, decode_fused.rope_decode_attention, mk.w4a16_mma)
    if (v.ungated or v.w4head) and dec is None:
        raise ValueError(f"variant {name!r}: _ungated and _w4head need the decoder (dec)")
    head = None
    gated = {}
    decode_fused.FUSED_ATTENTION = v.base == "after"
    if v.split16:  # decode_attention's schedule before 2026-12-02: 16 key splits at any batch
        decode_fused.ATTENTION_CTA_BUDGET = 1 << 30
    if v.w4a16_pdl is not None:
        mk.PDL = v.w4a16_pdl
    if v.decode_pdl is not None:
        decode_fused.PDL = v.decode_pdl
    if v.pdl_all_rows:
        pdl.MAX_ROWS = None
    if v.norm_warps is not None:
        decode_fused.ADD_RMS_NORM_WARPS = v.norm_warps
    if v.sepcombine:
        decode_fused.FUSED_ATTENTION_COMBINE = False
    if v.nonorm:  # the decoder imports add_rms_norm from the module at each fused step
        decode_fused.add_rms_norm = lambda x, delta, weight, eps, **_: (x, delta)
    if v.matmul is not None:  # Int4Linear imports w4a16_mma from the module at each launch
        mk.w4a16_mma = register_ring_launch(mk.w4a16_mma, loads_only=v.matmul == "loadsonly")
    if v.noattn:  # (B, H, 1, Dh) as the kernel returns, read from qkv's query columns
        decode_fused.rope_decode_attention = lambda qkv, cos, sin, pos, k_cache, v_cache, n_heads, *a, **kw: \
            qkv[:, :n_heads * k_cache.shape[-1]].reshape(qkv.shape[0], n_heads, 1, k_cache.shape[-1])
    try:
        if v.ungated:  # (graphs captured before must be reset: set_gated drops the layouts they read)
            gated = {layer.mlp.gate_up_proj: layer.mlp.gate_up_proj.gated_act for layer in dec.layers
                     if getattr(layer.mlp.gate_up_proj, "gated_act", None) is not None}
            for mod in gated:
                mod.set_gated(None)
        if v.w4head:
            from edgevlm.runtime.int4 import Int4Linear

            head = dec.lm_head
            if getattr(dec, "_bench_w4_head", None) is None:
                dec._bench_w4_head = Int4Linear.from_linear(head, 128).to(head.weight.device)
            dec.lm_head = dec._bench_w4_head
        with legacy_prologue(v.base == "before"):
            yield
    finally:
        (decode_fused.FUSED_ATTENTION, decode_fused.ATTENTION_CTA_BUDGET, decode_fused.PDL,
         decode_fused.ADD_RMS_NORM_WARPS, mk.PDL, pdl.MAX_ROWS, decode_fused.FUSED_ATTENTION_COMBINE,
         decode_fused.add_rms_norm, decode_fused.rope_decode_attention, mk.w4a16_mma) = saved
        for mod, act in gated.items():
            mod.set_gated(act)
        if head is not None:
            dec.lm_head = head


def profile_replays(replay, steps: int, group=None, groups_order=GROUPS) -> tuple[dict, list]:
    """Kernels of ``steps`` calls of ``replay`` under torch.profiler: ``({group: [µs/step, kernels/step]},
    [(name, µs/step, calls/step)])`` plus the busy time (union of kernel intervals) per step as
    ``groups["_busy_us"]``; kernels grouped by ``group(name)`` (default :func:`group_of`) into ``groups_order``."""
    group = group or group_of
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        per[ev.name][0] += ev.device_time / steps
        per[ev.name][1] += 1
        tr = getattr(ev, "time_range", None)
        if tr is not None:
            spans.append((tr.start, tr.end))
    groups = {g: [0.0, 0.0] for g in groups_order}
    for name, (us, n) in per.items():
        groups[group(name)][0] += us
        groups[group(name)][1] += n / steps
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    groups["_busy_us"] = busy / steps
    rows = sorted(((name[:80], us, n / steps) for name, (us, n) in per.items()), key=lambda r: -r[1])
    return groups, rows


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001 - not installed
        return None


def w4_decode_model(name: str, dev, max_batch: int, prompt: int, new_tokens: int) -> tuple:
    """``(model, backend, kv_len)``: benchmark model ``name`` (random weights, bf16) with its decoder linears RTN
    W4A16 (group 128), a ``TorchBackend`` for up to ``max_batch`` rows (CUDA graphs), the bf16 KV cache filled with
    random values (attention over real-looking keys, not zeros) and long enough for ``prompt + new_tokens`` (the
    bench harness's length rule), and the KV bucket of a row at position ``prompt``."""
    import torch

    from edgevlm.quantize.bench_models import build_models, quantize_decoder_w4
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    model, _, _ = build_models(name, device=dev, dtype=torch.bfloat16, max_seq_len=64, with_hf=False)
    model.setup_caches(1, ((prompt + new_tokens + 16 + 255) // 256) * 256)
    quantize_decoder_w4(model)
    be = TorchBackend(model, max_batch_size=max_batch)
    gen = torch.Generator(device=dev).manual_seed(0)
    for layer in model.language_model.layers:
        layer.self_attn.kv_cache.k.normal_(generator=gen)
        layer.self_attn.kv_cache.v.normal_(generator=gen)
    return model, be, be.kv_len_for(prompt + 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava-7b")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--variants", default="before,nomask,after,after_pdl,after_w4head")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per (variant, batch)")
    ap.add_argument("--prompt", type=int, default=609, help="row position of the step (the bench's prompt length)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens of the batch-1 decode loop")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the variants for the step times")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    for name in (v for v in args.variants.split(",") if v):
        try:
            parse_variant(name)
        except ValueError as exc:
            ap.error(str(exc))
    from bench_support import print_result, use_package  # bench/ is sys.path[0] when run as a script

    use_package()
    import torch

    from edgevlm.quantize.bench_measure import event_ms, wall_ms
    from edgevlm.runtime.kernels import decode_fused
    from edgevlm.runtime.kernels import w4a16_mma as mk

    if not torch.cuda.is_available():
        print("decode_step_breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    names = [v for v in args.variants.split(",") if v]
    t0 = time.perf_counter()
    model, be, kv_len = w4_decode_model(args.model, dev, max(batches), args.prompt, args.new_tokens)
    dec = model.language_model
    build_s = time.perf_counter() - t0
    print(f"{args.model} W4A16 built in {build_s:.1f} s; fused decode {dec.fused_decode}; kv_len {kv_len}, "
          f"rows at position {args.prompt}", flush=True)
    result = {"bench": "decode_step_breakdown", "model": args.model, "gpu": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "triton": _version("triton"), "kv_len": kv_len, "position": args.prompt, "steps": args.steps,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}

    def set_rows(b: int) -> None:
        be.graphs.tokens[:b].fill_(7)
        be.graphs.positions[:b].fill_(args.prompt)

    # step times: the variants alternated `rounds` times (graphs re-captured per variant)
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    tpot: dict[str, list[float]] = defaultdict(list)

    def run_variant_times(name: str) -> None:
        with variant(name, dec):
            be.graphs.reset()
            for b in batches:
                set_rows(b)
                times[(name, b)].append(event_ms(lambda b=b: be.graphs.replay(b, kv_len), dev, warmup=5, iters=40))
            if 1 in batches:  # the harness's batch-1 loop: decode + argmax + int() per token
                def loop() -> None:
                    tok, pos = 7, args.prompt
                    for _ in range(args.new_tokens):
                        tok = int(be.decode(tok, pos)[0].argmax())
                        pos += 1
                tpot[name].append(wall_ms(loop, dev, warmup=1, iters=3) / args.new_tokens)
            if name.startswith("after") and not decode_fused.FUSED_ATTENTION:
                raise RuntimeError("rope_decode_attention fell back to the three kernels (see the warning)")

    failed: dict[str, str] = {}
    for _ in range(args.rounds):
        for name in [n for n in names if n not in failed]:
            try:
                run_variant_times(name)
            except Exception as exc:  # noqa: BLE001 - keep the other variants' numbers
                failed[name] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"variant {name} failed: {failed[name]}", flush=True)
    names = [n for n in names if n not in failed]
    result["failed"] = failed
    # one profile per (variant, batch), and the outputs of the variants compared
    logits = {}
    for name in names:
        with variant(name, dec):
            be.graphs.reset()
            for b in batches:
                set_rows(b)
                out = be.graphs.replay(b, kv_len).float().clone()
                logits[(name, b)] = out
                groups, rows = profile_replays(lambda b=b: be.graphs.replay(b, kv_len), args.steps)
                step_ms = statistics.median(times[(name, b)])
                run = {"variant": name, "batch": b, "step_ms": round(step_ms, 4),
                       "step_ms_all": [round(t, 4) for t in times[(name, b)]],
                       "busy_us": round(groups.pop("_busy_us"), 1),
                       "groups": {g: {"us": round(v[0], 1), "kernels": round(v[1], 1)} for g, v in groups.items()},
                       "top": [[n, round(us, 2), round(c, 2)] for n, us, c in rows[: args.top]]}
                run["gap_us"] = round(step_ms * 1e3 - run["busy_us"], 1)
                # what the launches used (a _pdlall variant on a GPU / Triton without PDL runs plain launches)
                run["pdl"] = {"w4a16": mk.pdl_ok(dev, b), "decode": decode_fused.pdl_ok(dev, b)}
                run["add_rms_norm_warps"] = decode_fused.add_rms_norm_warps(dec.cfg.hidden_size)
                # layers marked gated (the epilogue runs where w4a16_mma.gated_ok says so: up to GATED_MAX_M rows)
                run["gated_layers"] = any(getattr(layer.mlp.gate_up_proj, "gated_act", None) for layer in dec.layers)
                run["gated_epilogue"] = run["gated_layers"] and b <= mk.GATED_MAX_M
                run["kernels"] = round(sum(v["kernels"] for v in run["groups"].values()), 1)
                if b == 1 and tpot.get(name):
                    run["tpot_ms"] = round(statistics.median(tpot[name]), 4)
                    run["tpot_ms_all"] = [round(t, 4) for t in tpot[name]]
                    run["tok_s"] = round(1e3 / run["tpot_ms"], 1)
                    run["host_gap_ms"] = round(run["tpot_ms"] - step_ms, 4)
                result["runs"].append(run)
    ref = names[0]
    for (name, b), out in logits.items():
        base = logits[(ref, b)]
        err = float((out - base).norm() / base.norm())
        for run in result["runs"]:
            if run["variant"] == name and run["batch"] == b:
                run["logits_rel_vs_" + ref] = err
                run["argmax_same_vs_" + ref] = bool(torch.equal(out.argmax(-1), base.argmax(-1)))
    be.graphs.reset()
    for b in batches:
        print(f"\nbatch {b}: µs per step by group (kernels per step)")
        head = f"{'group':12s}" + "".join(f"{n:>18s}" for n in names)
        print(head)
        runs = {r["variant"]: r for r in result["runs"] if r["batch"] == b}
        for g in GROUPS:
            print(f"{g:12s}" + "".join(f"{runs[n]['groups'][g]['us']:>11.1f} ({runs[n]['groups'][g]['kernels']:>4.0f})"
                                       for n in names))
        for key in ("busy_us", "gap_us", "kernels", "step_ms", "tpot_ms", "tok_s", "host_gap_ms",
                    "logits_rel_vs_" + ref):
            if all(key in runs[n] for n in names):
                print(f"{key:12s}" + "".join(f"{runs[n][key]:>18.4g}" for n in names))
        for n in names:
            print(f"  top kernels, {n}: " + "; ".join(f"{k} {us} us x{c}" for k, us, c in runs[n]["top"][:8]))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
