"""W4A16 decode GEMM on the tensor cores (CUDA C++, M = 1..16 rows; 1..32 on sm_90) and the prefill
dequantizer: build, availability, call, reference.

Three variants of one kernel (same layout, same arithmetic, bit-stable): ``"reg"`` (``w4a16_mma.cu``,
sm_80+: a register ring of weight loads), ``"lean"`` (``w4a16_lean.cu``, sm_80+: the register ring with
~40 % fewer instructions around the arithmetic, bit-identical to ``"reg"``; built by default since the
2026-12-02 H200 run, ``EDGEVLM_W4A16_LEAN=0`` builds and runs without it) and ``"bulk"`` (``w4a16_bulk.cu``,
sm_90 only: a per-warp shared-memory ring filled by the bulk-copy engine, which also serves M = 17..32 and
folds the zero point in through per-group activation sums at M <= 4); the launch table
(``w4a16_mma_configs.json``, from ``bench/w4a16_kernel.py`` on an H200) picks the variant and configuration
per shape and M bucket (and, where it names the lean variant, the fastest other entry as its fallback).
:func:`w4a16_mma_gated` is the lean kernel with a gated-MLP epilogue: a fused gate/up weight whose rows are
interleaved per tile (:func:`~edgevlm.runtime.int4_format.gated_row_order`) gives ``act(gate) * up`` in the same
launch (the decode step's SiLU*up kernel gone; :data:`GATED_MAX_M`).
:func:`w4a16_dequant` (``w4a16_dequant.cu``) writes the dense bf16/fp16 weight in one pass for
``dequantize + cuBLAS`` prefill. All are bound to torch by ``w4a16_mma_ext.cpp``.

The register-ring kernel reads the weights in the
tensor-core layout of :func:`edgevlm.runtime.int4_format.repack_int4_mma` (``MMA_LAYOUT_VERSION``):
one 16-byte load per lane is four ``mma.m16n8k16`` A fragments, nibbles become the exact bf16/fp16
``q - zero`` with one mask-or and one fma (the "magic number" conversion), the scale is applied to the
fp32 group sums after the
mma, each warp keeps DEPTH groups of 16-byte weight loads in flight in a register ring, and the K axis
is split over a CTA's warps with a fixed-order reduction (bit-stable). The
techniques are Marlin's (Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference
on Large Language Models", 2024); the code is this project's own.

The extension is compiled on first use (~30 s on the H200's host; longer on an Orin) with torch's
``cpp_extension.load`` for the GPU's own architecture (sm_80 and newer; ``EDGEVLM_CUDA_ARCH=8.7``
overrides, e.g. to build for an Orin ahead of time) into :func:`kernel_cache_dir`. :func:`mma_status` says whether it
builds, loads and passes a correctness probe on a device, and why not: callers fall back to torch's
tinygemm (see :class:`edgevlm.runtime.int4.Int4Linear`).

:func:`w4a16_mma_reference` is the kernel's arithmetic in PyTorch, read off the same layout by the
fragment tables (the CPU tests check it against a dequantized matmul).

Build ahead of time (e.g. from ``jetson/install.sh``): ``python -m edgevlm.runtime.kernels.w4a16_mma --build``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from edgevlm.runtime.int4_format import MMA_LAYOUT_VERSION, check_mma_shape

logger = logging.getLogger(__name__)

MMA_MAX_M = 16
"""Activation rows up to which the register-ring kernel (``w4a16_mma.cu``, sm_80+) serves (decode and
batched decode)."""
BULK_MAX_M = 32
"""Rows up to which the sm_90 bulk-copy kernel (``w4a16_bulk.cu``) serves (batched decode to batch 32)."""
MMA_CONFIGS = ((4, 2), (4, 4), (4, 8), (8, 2), (8, 4), (16, 2), (16, 4))
"""``(KSPLIT warps per CTA, DEPTH groups of weight loads in flight per warp)`` pairs compiled into the
register-ring kernel; a launch configuration adds ``TILES_PER_CTA`` (16-row tiles one CTA streams, >= 1).
Every pair runs on every sm_80+ GPU (at most 512 threads and 30 KB of static shared memory per CTA)."""
BULK_CONFIGS = ((4, 4), (4, 8), (8, 4), (8, 8))
"""``(WARPS per CTA, STAGES of the per-warp shared-memory ring)`` pairs compiled into the bulk-copy
kernel (sm_90; up to 78 KB of dynamic shared memory per CTA), plus ``TILES_PER_CTA``."""
DEFAULT_CONFIG = (8, 2, 1)
"""The register-ring launch configuration for shapes the sweep did not measure."""
DEFAULT_BULK_CONFIG = (8, 8, 1)
"""The bulk-copy launch configuration for shapes the sweep did not measure (sm_90)."""
UNTUNED_PREFERS_BULK = False
"""Whether shapes the sweep did not measure use the bulk-copy variant at M <= 16 where it is usable."""
KINDS = ("reg", "bulk", "lean", "async")
"""Kernel variants: ``"reg"`` the register ring (sm_80+), ``"bulk"`` the sm_90 bulk-copy ring, ``"lean"`` the
register ring with less address arithmetic per item (``w4a16_lean.cu``, sm_80+, bit-identical to ``"reg"``;
built unless ``EDGEVLM_W4A16_LEAN=0``), ``"async"`` the lean kernel with its ring in shared memory, filled by
``cp.async`` (sm_80+, same build, bit-identical to ``"lean"``)."""
LEAN_CONFIGS = ((4, 2), (4, 4), (8, 2), (8, 3), (8, 4), (16, 2), (16, 3), (16, 4))
"""``(KSPLIT, DEPTH)`` pairs compiled into the lean variant (plus ``TILES_PER_CTA``)."""
ASYNC_CONFIGS = ((4, 4), (4, 8), (8, 4), (8, 8), (16, 2), (16, 4))
"""``(KSPLIT, SLOTS)`` pairs compiled into the lean kernel's ``cp.async`` ring (``"async"``): SLOTS groups of weight
loads in flight per warp in shared memory (``KSPLIT x SLOTS x (GT x 512 + 64)`` bytes of dynamic shared memory per
CTA, at most 69.6 KB), at no register cost: with SLOTS at least a warp's groups per tile (K / 128 / KSPLIT at group
size 128) every weight load of a one-tile CTA is issued before the first is used, as a loads-only kernel would.
The register ring of ``"lean"`` waits one memory round trip per DEPTH groups instead."""
DEFAULT_LEAN_CONFIG = (8, 2, 1)
DEFAULT_ASYNC_CONFIG = (8, 4, 1)
LEAN_ENV = "EDGEVLM_W4A16_LEAN"


def lean_build() -> bool:
    """Whether the extension is built with the lean variant and its table entries are used: yes unless
    ``EDGEVLM_W4A16_LEAN=0`` (the default since the H200 run of bench/results/w4a16_kernel_h200_20261202.md: faster
    than the register ring on every 7B / Qwen3-VL shape at M = 1..16, bit-identical to it). Read per call: set to 0
    after the extension was built with it, the table's fallback entries (register ring / bulk) run instead."""
    return os.environ.get(LEAN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


LEAN_TRIGGER_ENV = "EDGEVLM_W4A16_LEAN_TRIGGER"


def lean_trigger_build(arch: str | None = None) -> bool:
    """Whether the lean variant is also built with its late PDL trigger: under PDL the next kernel is released after
    each CTA's last weight load instead of at entry; where built, lean launches under PDL use it unless
    ``late_trigger=False`` is passed. ``EDGEVLM_W4A16_LEAN_TRIGGER``: ``1`` / ``0``, or unset (``auto``): for builds
    of ``arch`` sm_90 and newer (the GPUs with PDL; on the H200 the session-11 decode measurements ran with it:
    a 7B layer's four matmuls as a PDL chain 46.08 -> 45.72 us at M = 1, 48.48 -> 47.18 at M = 8), never for an
    older or unknown ``arch`` (an Orin's build stays as small). Never without the lean variant."""
    if not lean_build():
        return False
    value = os.environ.get(LEAN_TRIGGER_ENV, "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off") or arch is None:
        return False
    try:
        return int(arch.split(".")[0]) >= 9
    except ValueError:
        return False


LEAN_LATE_TRIGGER = True
"""In a build with the late trigger (:func:`lean_trigger_build`): lean launches under PDL use it by default
(``late_trigger=None``). A switch for benchmarks."""


def _build_flags(lean: bool, trigger: bool) -> tuple[str, list[str]]:
    """``(name suffix, -D defines)`` of the extension build with the lean variant / its late trigger."""
    if not lean:
        return "", []
    if trigger:
        return "_lean_lt", ["-DEDGEVLM_W4A16_LEAN", "-DEDGEVLM_W4A16_LEAN_TRIGGER"]
    return "_lean", ["-DEDGEVLM_W4A16_LEAN"]


CONFIGS_FILE = Path(__file__).with_name("w4a16_mma_configs.json")
SOURCES = ("w4a16_mma.cu", "w4a16_bulk.cu", "w4a16_dequant.cu", "w4a16_mma_ext.cpp")
LEAN_SOURCES = ("w4a16_lean.cu",)
HEADERS = ("w4a16_common.cuh",)
MIN_CAPABILITY = (8, 0)  # mma.m16n8k16 bf16 and fma.rn.bf16x2 need sm_80
BULK_CAPABILITY = (9, 0)  # cp.async.bulk + mbarrier transaction counts


class MmaKernelUnavailable(RuntimeError):
    """The tensor-core W4A16 kernel cannot run here (no CUDA, no compiler, old GPU, failed build/probe)."""


def _arch(device: torch.device) -> str:
    """``"8.7"``-style architecture to build for: ``EDGEVLM_CUDA_ARCH`` or the device's capability."""
    env = os.environ.get("EDGEVLM_CUDA_ARCH", "").strip()
    if env:
        return env
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def _source_dir() -> Path:
    return Path(__file__).resolve().parent


_BUILD_LOCK = threading.Lock()


def kernel_cache_dir() -> Path | None:
    """Where the extension is built: ``EDGEVLM_KERNEL_CACHE``, else ``<venv>/var/cache/edgevlm-kernels``
    when that folder exists (``jetson/install.sh`` builds there), else None (torch's extension cache,
    ``TORCH_EXTENSIONS_DIR``)."""
    env = os.environ.get("EDGEVLM_KERNEL_CACHE", "").strip()
    if env:
        return Path(env)
    venv_cache = Path(sys.prefix) / "var" / "cache" / "edgevlm-kernels"
    return venv_cache if venv_cache.is_dir() else None


@functools.cache
def _build(arch: str, lean: bool = False, trigger: bool = False):
    """Compile (or load from torch's extension cache) the extension for ``arch`` (``lean``: with
    ``w4a16_lean.cu``; ``trigger``: also its late-PDL-trigger instances); raises ``MmaKernelUnavailable`` with
    the reason."""
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - part of torch
        raise MmaKernelUnavailable(f"torch.utils.cpp_extension unavailable: {exc}") from exc
    if cpp_extension.CUDA_HOME is None:
        raise MmaKernelUnavailable("no CUDA toolkit (nvcc) found: set CUDA_HOME")
    try:
        major, minor = (int(v) for v in arch.split("."))
    except ValueError as exc:
        raise MmaKernelUnavailable(f"bad CUDA architecture {arch!r} (expected e.g. 8.7)") from exc
    if (major, minor) < MIN_CAPABILITY:
        raise MmaKernelUnavailable(f"sm_{major}{minor} is older than sm_80 (no bf16 mma)")
    cc = f"{major}{minor}"
    src = _source_dir()
    sources = (*SOURCES, *LEAN_SOURCES) if lean else SOURCES
    digest = hashlib.sha256(b"".join((src / f).read_bytes() for f in (*sources, *HEADERS))).hexdigest()[:10]
    suffix, defines = _build_flags(lean, trigger)
    name = f"edgevlm_w4a16_mma_v{MMA_LAYOUT_VERSION}_sm{cc}{suffix}_{digest}"
    build_dir = kernel_cache_dir()
    try:
        if build_dir is not None:
            build_dir = build_dir / name
            build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            build_directory=str(build_dir) if build_dir is not None else None,
            sources=[str(src / s) for s in sources],
            extra_cflags=["-O3", *defines],
            extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{cc},code=sm_{cc}", *defines],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError, SystemExit) as exc:  # compiler missing/failing, bad cache
        raise MmaKernelUnavailable(f"building the W4A16 mma extension for sm_{cc} failed: {exc}") from exc


_LOADED: dict[int, object] = {}  # CUDA device index -> extension module


def load_extension(device: torch.device | str | None = None):
    """The compiled extension module for ``device`` (default: the current CUDA device); raises
    :class:`MmaKernelUnavailable`."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    index = dev.index
    if index is not None and index in _LOADED:  # the per-call fast path
        return _LOADED[index]
    if dev.type != "cuda":
        raise MmaKernelUnavailable(f"the kernel runs on CUDA devices, not {dev.type}")
    if not torch.cuda.is_available():
        raise MmaKernelUnavailable("CUDA is not available")
    if index is None:
        index = torch.cuda.current_device()
        if index in _LOADED:
            return _LOADED[index]
    with _BUILD_LOCK:
        arch = _arch(torch.device("cuda", index))
        ext = _build(arch, lean_build(), lean_trigger_build(arch))
    _LOADED[index] = ext
    return ext


_STATUS: dict[tuple[str, str], str | None] = {}  # (device, kind) -> None (usable) or the reason it is not


def _device_key(dev: torch.device) -> str:
    return str(dev) if dev.type != "cuda" or dev.index is not None else f"cuda:{torch.cuda.current_device()}"


def mma_status(device: torch.device | str, kind: str = "reg") -> str | None:
    """``None`` when kernel variant ``kind`` (:data:`KINDS`) is usable on ``device`` (built, loaded, and a
    probe matched a float64 reference at M = 1 and 9, and 24 for ``"bulk"``, for both group sizes), else
    the reason it is not. Checked once per device and kind. ``"bulk"`` needs sm_90."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    dev = torch.device(device)
    key = (_device_key(dev), kind)
    if key in _STATUS:
        return _STATUS[key]
    reason: str | None
    try:
        if dev.type != "cuda":
            raise MmaKernelUnavailable(f"the kernel runs on CUDA devices, not {dev.type}")
        if kind == "bulk" and torch.cuda.get_device_capability(dev) < BULK_CAPABILITY:
            raise MmaKernelUnavailable("the bulk-copy variant needs sm_90 (cp.async.bulk)")
        if os.environ.get("EDGEVLM_W4A16_BULK", "1").strip() in ("0", "false", "no", "off") and kind == "bulk":
            raise MmaKernelUnavailable("the bulk-copy variant is disabled by EDGEVLM_W4A16_BULK=0")
        if kind in ("lean", "async") and not lean_build():
            raise MmaKernelUnavailable(f"the lean variant is switched off ({LEAN_ENV}=0)")
        load_extension(dev)
        reason = _probe(torch.device(key[0]), kind)
    except MmaKernelUnavailable as exc:
        reason = str(exc)
    _STATUS[key] = reason
    return reason


def max_rows(device: torch.device | str) -> int:
    """Activation rows up to which :func:`w4a16_mma` serves on ``device``: :data:`BULK_MAX_M` where the
    sm_90 variant is usable, :data:`MMA_MAX_M` where only the register ring is, 0 where neither."""
    if mma_status(device, "reg") is not None:
        return 0
    return BULK_MAX_M if mma_status(device, "bulk") is None else MMA_MAX_M


def _probe(dev: torch.device, kind: str) -> str | None:
    from edgevlm.runtime.int4_format import dequantize_int4, gated_row_order, quantize_int4, repack_int4_mma

    gen = torch.Generator().manual_seed(0)
    cfg = {"reg": ("reg", *DEFAULT_CONFIG), "bulk": ("bulk", *DEFAULT_BULK_CONFIG),
           "lean": ("lean", *DEFAULT_LEAN_CONFIG), "async": ("async", *DEFAULT_ASYNC_CONFIG)}[kind]
    for g in (64, 128):
        w = torch.randn(48, 512, generator=gen)
        qw = quantize_int4(w, g)
        packed, meta = repack_int4_mma(qw.qweight.to(dev), qw.scales.to(dev), qw.zeros.to(dev), g)
        ref_w = dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
        for m in ((1, 9, 24) if kind == "bulk" else (1, 9)):
            x = torch.randn(m, 512, generator=gen).to(torch.bfloat16)
            ref = x.double() @ ref_w.T
            for mode in ((0, 2) if m <= 4 and kind in ("reg", "bulk") else (2,)):  # with and without the x-sum fold
                try:
                    y = w4a16_mma(x.to(dev), packed, meta, g, config=cfg, mode=mode).double().cpu()
                except (RuntimeError, ValueError) as exc:
                    return f"the W4A16 {kind} kernel failed its probe: {exc}"
                err = float((y - ref).norm() / ref.norm())
                if not err < 1e-2:
                    return f"the W4A16 {kind} kernel gives wrong results (rel err {err:.2e} at M={m}, g={g})"
            if kind == "lean":  # its gated-MLP epilogue too (rows 0-23 gate, 24-47 up)
                order = gated_row_order(48)
                gl, gm = repack_int4_mma(qw.qweight[order].to(dev), qw.scales[order].to(dev),
                                         qw.zeros[order].to(dev), g)
                want = torch.nn.functional.silu(ref[:, :24]) * ref[:, 24:]
                try:
                    y = w4a16_mma_gated(x.to(dev), gl, gm, g, "silu", config=DEFAULT_LEAN_CONFIG).double().cpu()
                except (RuntimeError, ValueError) as exc:
                    return f"the W4A16 lean kernel's gated epilogue failed its probe: {exc}"
                err = float((y - want).norm() / want.norm())
                if not err < 1e-2:
                    return f"the W4A16 lean kernel's gated epilogue gives wrong results (rel err {err:.2e}, g={g})"
    return None


M_BUCKETS = (1, 8, 16, 32)


def _parse_config(cfg) -> tuple[str, int, int, int] | None:
    """``("reg" | "bulk", a, b, tiles_per_cta)`` from a table entry (``[a, b, tpc]`` = register ring,
    the format of layout-version-1 tables; ``[kind, a, b, tpc]``; ``[kind, a, b, tpc, zx]``, see
    :func:`zx_fold`; ``[kind, a, b, tpc, zx, pf]``, see :func:`prefetch_tiles`) or None when malformed."""
    try:
        if len(cfg) == 3:
            kind, rest = "reg", cfg
        elif len(cfg) in (4, 5, 6) and cfg[0] in KINDS:
            kind, rest = cfg[0], cfg[1:4]
        else:
            return None
        a, b, tpc = (int(v) for v in rest)
    except (TypeError, ValueError):
        return None
    pairs = {"reg": MMA_CONFIGS, "bulk": BULK_CONFIGS, "lean": LEAN_CONFIGS, "async": ASYNC_CONFIGS}[kind]
    return (kind, a, b, tpc) if (a, b) in pairs and tpc >= 1 else None


@functools.cache
def _table() -> tuple[dict, dict, dict, dict]:
    """``(configs, zx, pf, fallback)`` of the launch table; ``fallback``: per shape and M bucket whose entry
    names the lean variant, the fastest measured register-ring / bulk entry ``(kind, a, b, tpc, zx, pf)``
    (used where the lean variant is not built or switched off)."""
    configs: dict[str, dict[str, tuple[str, int, int, int]]] = {}
    zx: dict[str, dict[str, bool]] = {}
    pf: dict[str, dict[str, int]] = {}
    fallback: dict[str, dict[str, tuple[str, int, int, int, bool, int]]] = {}
    try:
        data = json.loads(CONFIGS_FILE.read_text())
        for key, row in data.get("configs", {}).items():
            for m, cfg in row.items():
                parsed = _parse_config(cfg)
                if parsed is not None:
                    configs.setdefault(str(key), {})[str(m)] = parsed
                    if len(cfg) >= 5:
                        zx.setdefault(str(key), {})[str(m)] = bool(cfg[4])
                    if len(cfg) == 6 and int(cfg[5]) >= 0:
                        pf.setdefault(str(key), {})[str(m)] = int(cfg[5])
        for key, row in (data.get("fallback") or {}).items():
            for m, cfg in row.items():
                parsed = _parse_config(cfg)
                if parsed is not None and parsed[0] not in ("lean", "async"):
                    fallback.setdefault(str(key), {})[str(m)] = (
                        *parsed, bool(cfg[4]) if len(cfg) >= 5 else False,
                        max(0, int(cfg[5])) if len(cfg) == 6 else PF_DEFAULT)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        logger.debug("no tuned W4A16 mma configs (%s): heuristic only", exc)
    return configs, zx, pf, fallback


def tuned_configs() -> dict[str, dict[str, tuple[str, int, int, int]]]:
    """Measured best launch configuration ``(kind, a, b, TILES_PER_CTA)`` per weight shape ``"NxKgG"``
    and M bucket, written by ``bench/w4a16_kernel.py`` on an H200 ({} when the file is absent).
    Entries of the register-ring kernel hold ``(KSPLIT, DEPTH)``, of the bulk kernel ``(WARPS, STAGES)``."""
    return _table()[0]


ZX_DEFAULT = False
"""Whether shapes the sweep did not measure use the x-sum zero-point fold at M <= 4."""


def zx_fold(m: int, n: int, k: int, group_size: int) -> bool:
    """Whether the kernel folds the zero point in through per-group activation sums for this product
    (only at ``m <= 4``: the mma then takes the biased codes and skips one fma per two weights): the
    sweep's measured choice for the shape, else :data:`ZX_DEFAULT`."""
    if m > 4:
        return False
    bucket = next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])
    return _table()[1].get(f"{n}x{k}g{group_size}", {}).get(str(bucket), ZX_DEFAULT)


PF_DEFAULT = 0
"""L2 prefetch distance (16-row tiles, 0 = none) of the register-ring kernel for shapes the sweep did not
measure (or tables written before the prefetch existed)."""


def prefetch_tiles(m: int, n: int, k: int, group_size: int) -> int:
    """How many 16-row tiles ahead the register-ring kernel asks L2 for its weights (``prefetch.global.L2``
    of each warp's range; 0: none; >= the CTA's tiles: all of them at the start): the sweep's measured
    choice for the shape and M bucket, else :data:`PF_DEFAULT`."""
    bucket = next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])
    return _table()[2].get(f"{n}x{k}g{group_size}", {}).get(str(bucket), PF_DEFAULT)


PDL = os.environ.get("EDGEVLM_W4A16_PDL", "1").strip().lower() in ("1", "true", "yes", "on")
"""This module's switch for programmatic dependent launch (sm_90: the launch and the weight loads overlap the
previous kernel's tail; the activations are read only after it has finished); where it applies is
:func:`edgevlm.runtime.kernels.pdl.allowed`'s rule (by default decode launches of at most 8 rows).
``EDGEVLM_W4A16_PDL=0`` turns it off for these kernels. History: off by default until session 11 (2026-12-02),
because with the decode step's Triton kernels launched plainly it lost in the whole-model A/B (427.6 / 424.5 /
424.0 tok/s at batch 1 against 410.6 / 399.7 / 410.3 with it); with them as programmatic dependents too, the step
gained 8 % at batch 1 (``bench/results/session11_h200_20261202/``)."""


def pdl_ok(device: torch.device, rows: int | None) -> bool:
    """Whether a launch over ``rows`` activation rows (None: not a decode launch) on ``device`` is a programmatic
    dependent: :data:`PDL` and :func:`edgevlm.runtime.kernels.pdl.allowed`."""
    from edgevlm.runtime.kernels import pdl

    return PDL and pdl.allowed(device, rows)


def _choice(m: int, n: int, k: int, group_size: int, bulk: bool, lean: bool) -> tuple[tuple[str, int, int, int],
                                                                                     bool | None, int | None]:
    """``(config, zx, pf)`` of :func:`mma_config`; ``zx`` / ``pf`` are None where the table's own entry for
    the shape applies (:func:`zx_fold`, :func:`prefetch_tiles`), else the fallback entry's."""
    bucket = next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])
    key = f"{n}x{k}g{group_size}"
    tuned = tuned_configs().get(key, {}).get(str(bucket))
    usable = {"reg": True, "bulk": bulk, "lean": lean, "async": lean}
    if tuned is not None and usable[tuned[0]] and (m <= MMA_MAX_M or tuned[0] == "bulk"):
        return tuned, None, None
    if tuned is not None and tuned[0] in ("lean", "async"):
        fb = _table()[3].get(key, {}).get(str(bucket))
        if fb is not None and usable[fb[0]] and (m <= MMA_MAX_M or fb[0] == "bulk"):
            return fb[:4], fb[4], fb[5]  # the sweep's fastest register-ring / bulk entry (lean not built here)
        if m <= MMA_MAX_M and tuned[1:3] in MMA_CONFIGS:
            return ("reg", *tuned[1:]), False, PF_DEFAULT  # the same schedule on the register ring
    if m > MMA_MAX_M or (bulk and UNTUNED_PREFERS_BULK):
        return ("bulk", *DEFAULT_BULK_CONFIG), False, PF_DEFAULT
    return ("reg", *DEFAULT_CONFIG), False, PF_DEFAULT


def mma_config(m: int, n: int, k: int, group_size: int, *, bulk: bool = False,
               lean: bool = False) -> tuple[str, int, int, int]:
    """``(kind, a, b, TILES_PER_CTA)`` for an ``(m, k) x (n, k)^T`` product: the H200 sweep's best for
    this shape and M bucket (``w4a16_mma_configs.json``), else the default of the variant that serves
    ``m``. ``bulk`` / ``lean``: that variant is usable (else its entries of the table are skipped: a lean
    entry then gives the table's ``fallback`` entry, the fastest register-ring / bulk configuration the
    sweep measured, else the register ring with the same KSPLIT/DEPTH where it has that pair)."""
    return _choice(m, n, k, group_size, bulk, lean)[0]


def _check_call(x: torch.Tensor, qw: torch.Tensor, meta: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                max_m: int) -> tuple[int, int, int]:
    """``(M, N, K)`` of a decode-kernel call after checking its tensors (``x (M, K)`` bf16/fp16 with ``M <= max_m``,
    the mma layout's ``qw`` / ``meta``, a float32 ``(N,)`` bias); raises ``ValueError`` naming the bad one."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_m:
        raise ValueError(f"x must be (M, K) with 1 <= M <= {max_m}, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    if qw.dtype != torch.int32 or qw.dim() != 4 or tuple(qw.shape[2:]) != (32, 4):
        raise ValueError(f"qw must be int32 (N/16, K/64, 32, 4), got {qw.dtype} {tuple(qw.shape)}")
    n, k = int(qw.shape[0]) * 16, int(qw.shape[1]) * 64
    check_mma_shape(n, k, group_size)
    if x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    if tuple(meta.shape) != (n // 16, k // group_size, 16) or meta.dtype != torch.int32:
        raise ValueError(f"meta must be int32 ({n // 16}, {k // group_size}, 16), got {meta.dtype} {tuple(meta.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != n):
        raise ValueError(f"bias must be float32 ({n},)")
    return int(x.shape[0]), n, k


def w4a16_mma(x: torch.Tensor, qw: torch.Tensor, meta: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, config: tuple | None = None,
              *, mode: int | None = None, prefetch: int | None = None, pdl: bool | None = None,
              late_trigger: bool | None = None) -> torch.Tensor:
    """``x (M, K)`` bf16/fp16 (``M <= 16``; ``M <= 32`` on sm_90) times the INT4 weight in the mma layout,
    transposed, plus ``bias`` (float32 ``(N,)``): ``(M, N)`` in ``x.dtype``, fp32 accumulation, bit-stable.

    ``qw``/``meta`` come from :func:`~edgevlm.runtime.int4_format.repack_int4_mma`. Raises
    ``ValueError`` for bad shapes/dtypes/configs and :class:`MmaKernelUnavailable` where the extension is
    absent. ``config`` overrides :func:`mma_config` (tuning): ``(kind, a, b, TILES_PER_CTA)`` or the
    register ring's ``(KSPLIT, DEPTH, TILES_PER_CTA)``; ``mode=1`` is the register ring's loads-only
    diagnostic (streams the weights, computes nothing meaningful); ``mode=0`` computes with the x-sum
    zero-point fold at M <= 4, ``mode=2`` without it (the same function to fp32 rounding); ``None``: as
    :func:`zx_fold` says for this shape. ``prefetch``: the register ring's L2 prefetch distance in tiles
    (``None``: :func:`prefetch_tiles` for a table configuration, 0 with an explicit ``config``); ``pdl``:
    programmatic dependent launch (``None``: :func:`pdl_ok`); ``late_trigger``: the lean variant releases its PDL
    dependent after the last weight load instead of at entry (``None``: where the build has it, see
    :func:`lean_trigger_build`, and ``pdl``; ``True`` raises :class:`MmaKernelUnavailable` where it does not)."""
    m, n, k = _check_call(x, qw, meta, group_size, bias, BULK_MAX_M)
    fb_zx = fb_pf = None
    if config is None:
        bulk = m > MMA_MAX_M or _bulk_ok(x.device)
        lean = lean_build() and m <= MMA_MAX_M and mma_status(x.device, "lean") is None
        cfg, fb_zx, fb_pf = _choice(m, n, k, group_size, bulk, lean)
        if cfg[0] == "async" and mma_status(x.device, "async") is not None:  # its probe failed: the fallback
            cfg, fb_zx, fb_pf = _choice(m, n, k, group_size, bulk, False)
    else:
        cfg = _parse_config(config)
        if cfg is None:
            raise ValueError(f"config must be (kind in {KINDS}, a, b, TILES_PER_CTA >= 1) with (a, b) in "
                             f"{MMA_CONFIGS} (reg), {BULK_CONFIGS} (bulk), {LEAN_CONFIGS} (lean) or {ASYNC_CONFIGS} "
                             f"(async), got {config!r}")
    kind, a, b, tiles_per_cta = cfg
    if mode is None:
        zx = zx_fold(m, n, k, group_size) if fb_zx is None else (fb_zx and m <= 4)
        mode = 2 if kind in ("lean", "async") else (0 if zx else 2)
    if kind in ("reg", "lean", "async") and m > MMA_MAX_M:
        raise ValueError(f"the register-ring kernel serves M <= {MMA_MAX_M}, got M = {m}")
    if kind in ("lean", "async") and mode != 2:
        raise ValueError("mode must be 2 for the lean kernel (no x-sum fold, no loads-only diagnostic)")
    if kind == "bulk" and mode not in (0, 2):
        raise ValueError("mode must be 0 or 2 (no x-sum zero-point fold) for the bulk kernel")
    if kind == "reg" and mode not in (0, 1, 2):
        raise ValueError("mode must be 0, 1 (loads only) or 2 for the register-ring kernel")
    if prefetch is None:
        prefetch = (prefetch_tiles(m, n, k, group_size) if fb_pf is None else fb_pf) if config is None else 0
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    ext = load_extension(x.device)
    if pdl is None:
        pdl = pdl_ok(x.device, m)
    if kind == "bulk":
        return ext.w4a16_bulk(x.contiguous(), qw, meta, bias, group_size, a, b, tiles_per_cta, mode == 0, pdl)
    if kind in ("lean", "async"):
        if not hasattr(ext, "w4a16_lean"):
            raise MmaKernelUnavailable(f"this build of the extension has no lean variant (built with {LEAN_ENV}=0)")
        built = bool(getattr(ext, "lean_late_trigger", False))
        if late_trigger and not built:
            raise MmaKernelUnavailable(f"this build has no lean late PDL trigger (sm_90+ builds, or {LEAN_TRIGGER_ENV}=1)")
        late = built and pdl and LEAN_LATE_TRIGGER if late_trigger is None else bool(late_trigger)
        return ext.w4a16_lean(x.contiguous(), qw, meta, bias, group_size, a, b, tiles_per_cta, pdl, late,
                              kind == "async")
    return ext.w4a16_mma(x.contiguous(), qw, meta, bias, group_size, a, b, tiles_per_cta, mode, prefetch, pdl)


GATED_CONFIGS = ((4, 2), (4, 4), (8, 2), (8, 3), (8, 4))
"""``(KSPLIT, DEPTH)`` pairs of the lean kernel compiled with the gated-MLP epilogue (register ring). Of their
group-64 (GT = 1) instances 14 of 40 spill 12-24 bytes (nvcc 13, sm_90; the plain ones do not); group 64 was not
benchmarked with the epilogue."""


GATED = os.environ.get("EDGEVLM_W4A16_GATED", "1").strip().lower() not in ("0", "false", "no", "off")
"""Whether a fused W4A16 gate/up projection runs the gated-MLP epilogue (``Decoder.enable_fused_decode`` marks it,
:func:`gated_ok` lets it run; ``EDGEVLM_W4A16_GATED=0``: the plain kernel and the separate act(gate) * up kernel)."""


GATED_MAX_M = 8
"""Rows up to which a decode step uses the gated epilogue (above: the plain launch over the interleaved rows and the
interleaved act kernel, ``Int4Linear.forward_gated``). H200, 7B-shape W4A16 step (session 13,
``bench/results/w4a16_kernel_h200_20261203.md``): 1.892 -> 1.844 ms at batch 1 and 2.650 -> 2.593 at batch 8 (the
SiLU*up kernel gone; the gate/up matmul itself ~0.5 µs slower in isolation), but 3.820 -> 3.910 at batch 16, where
the gated matmul is 4 µs slower than the plain one in isolation (30.10 vs 26.14 µs, 7B gate/up) and the SiLU*up
kernel it replaces took 1.4. :func:`w4a16_mma_gated` itself serves up to :data:`MMA_MAX_M`."""


def gated_ok(device: torch.device | str, m: int, act: str) -> bool:
    """Whether a decode step runs ``m`` rows of a gated projection with activation ``act`` through
    :func:`w4a16_mma_gated` on ``device``: :data:`GATED`, ``1 <= m <= GATED_MAX_M``, ``act`` one of
    ``decode_fused.GATED_ACTS``, and a lean build whose probe passed there."""
    from edgevlm.runtime.kernels.decode_fused import GATED_ACTS

    return (GATED and act in GATED_ACTS and 1 <= m <= GATED_MAX_M and lean_build()
            and mma_status(device, "lean") is None)


def gated_config(m: int, n: int, k: int, group_size: int) -> tuple[int, int, int]:
    """``(KSPLIT, DEPTH, TILES_PER_CTA)`` of the gated launch for an ``(m, k) x (n, k)^T`` fused gate/up product: the
    launch table's lean / async entry for the shape where its pair has a gated instance (:data:`GATED_CONFIGS`),
    else the same KSPLIT with DEPTH 2 (an async entry's slots are not the register ring's depth), else
    :data:`DEFAULT_LEAN_CONFIG`; the entry's tiles per CTA are kept."""
    kind, a, b, tpc = _choice(m, n, k, group_size, True, True)[0]
    if kind == "lean" and (a, b) in GATED_CONFIGS:
        return a, b, tpc
    if kind in ("lean", "async") and (a, 2) in GATED_CONFIGS:
        return a, 2, tpc
    return DEFAULT_LEAN_CONFIG


def w4a16_mma_gated(x: torch.Tensor, qw: torch.Tensor, meta: torch.Tensor, group_size: int, act: str,
                    bias: torch.Tensor | None = None, config: tuple[int, int, int] | None = None, *,
                    pdl: bool | None = None) -> torch.Tensor:
    """``act(x W_gate^T + b_gate) * (x W_up^T + b_up)`` in one launch: ``x (M, K)`` bf16/fp16 (``M <= 16``) times a
    fused gate/up weight whose rows are in :func:`~edgevlm.runtime.int4_format.gated_row_order` (``qw``/``meta`` of
    :func:`~edgevlm.runtime.int4_format.repack_int4_mma` of the reordered rows, ``bias`` float32 ``(N,)`` reordered
    likewise) -> ``(M, N / 2)`` in ``x.dtype``. Gate and up stay fp32 until the product (one rounding; the separate
    path rounds each to ``x.dtype`` first, so results differ in the last bits). ``act``: one of
    ``decode_fused.GATED_ACTS``; ``config``: ``(KSPLIT, DEPTH, TILES_PER_CTA)`` with a pair of :data:`GATED_CONFIGS`
    (default :func:`gated_config`); ``pdl`` as :func:`w4a16_mma`. Raises ``ValueError`` for bad arguments and
    :class:`MmaKernelUnavailable` where the extension or its lean variant is absent."""
    from edgevlm.runtime.kernels.decode_fused import gated_act_code

    code = gated_act_code(act, "w4a16_mma_gated")
    m, n, k = _check_call(x, qw, meta, group_size, bias, MMA_MAX_M)
    if config is None:
        config = gated_config(m, n, k, group_size)
    ok = (isinstance(config, (tuple, list)) and len(config) == 3 and all(isinstance(v, int) for v in config)
          and tuple(config[:2]) in GATED_CONFIGS and config[2] >= 1)
    if not ok:
        raise ValueError(f"config must be (KSPLIT, DEPTH, TILES_PER_CTA >= 1) with a pair of {GATED_CONFIGS}, "
                         f"got {config!r}")
    ksplit, depth, tpc = config
    ext = load_extension(x.device)
    if not hasattr(ext, "w4a16_lean_gated"):
        raise MmaKernelUnavailable(f"this build of the extension has no lean variant (built with {LEAN_ENV}=0)")
    if pdl is None:
        pdl = pdl_ok(x.device, m)
    late = bool(getattr(ext, "lean_late_trigger", False)) and pdl and LEAN_LATE_TRIGGER
    return ext.w4a16_lean_gated(x.contiguous(), qw, meta, bias, group_size, ksplit, depth, tpc, pdl, late, code)


def _bulk_ok(device: torch.device) -> bool:
    return mma_status(device, "bulk") is None


def w4a16_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  dtype: torch.dtype = torch.bfloat16, *, row0: int = 0, rows: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[row0, row0 + rows)`` of the canonical INT4 weight as a dense ``(rows, K)`` tensor in
    ``dtype`` (bf16/fp16), one CUDA kernel: ``(q - zero) * scale`` in fp32, one rounding (bit-identical to
    :func:`edgevlm.runtime.int4_format.dequantize_int4`). ``out``: a contiguous buffer of ``dtype`` with at
    least ``rows * K`` elements to write into (its first ``rows * K`` elements are returned as the view).
    Raises ``ValueError`` for bad arguments, :class:`MmaKernelUnavailable` where the extension is absent."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be uint8 (N, K/2), got {qweight.dtype} {tuple(qweight.shape)}")
    n = int(qweight.shape[0])
    rows = n - row0 if rows is None else rows
    if not (0 <= row0 and rows >= 1 and row0 + rows <= n):
        raise ValueError(f"rows [{row0}, {row0 + rows}) outside the weight's {n} rows")
    ext = load_extension(qweight.device)
    return ext.w4a16_dequant(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), group_size, row0, rows,
                             dtype == torch.bfloat16, out, pdl_ok(qweight.device, None))


def w4a16_mma_reference(x: torch.Tensor, qw: torch.Tensor, meta: torch.Tensor, group_size: int,
                        bias: torch.Tensor | None = None, compute: torch.dtype = torch.float64) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch on the mma layout: ``(M, N)`` in ``compute``.

    Reads every lane's words as ``mma.m16n8k16`` fragments by the PTX ISA's tables (A element of
    register ``r``, half ``e``: row ``g + 8 (r & 1)``, column ``2t + 8 (r >> 1) + e``; B register ``h``
    of lane ``(g, t)`` for k-tile ``j``: rows ``2t + 8h + e``, batch column ``g``, loaded from channels
    ``16t + 4j + 2h + e`` of the 64-block), forms ``q - zero`` per element (exact, as the kernel's
    magic-number conversion and fma), sums each group's 16 x 16 x M tile products, scales the group
    sums by the fp16 scale, and adds ``bias``.
    """
    nt, kb = int(qw.shape[0]), int(qw.shape[1])
    m = x.shape[0]
    gt = group_size // 64  # 64-blocks per group
    words = qw.to(torch.int64) & 0xFFFFFFFF  # (NT, KB, lane, j)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nib = (words.unsqueeze(-1) >> shifts) & 0xF  # (NT, KB, lane, j, p)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    p = torch.arange(8)
    r, e = p & 3, p >> 2
    a_row = (g[:, None] + 8 * (r[None, :] & 1))  # (lane, p)
    a_col = (2 * t[:, None] + 8 * (r[None, :] >> 1) + e[None, :])  # (lane, p)
    a_tiles = torch.zeros(nt, kb, 4, 16, 16, dtype=compute)
    a_tiles[:, :, :, a_row, a_col] = nib.permute(0, 1, 3, 2, 4).to(compute)  # (NT, KB, j, row, col)
    # zero point per (tile row, group): subtracted before the mma, as the kernel's fma does
    zeros = ((meta.to(torch.int64) >> 16) & 0xF).to(compute)  # (NT, G, 16)
    scales = (meta.to(torch.int64) & 0xFFFF).to(torch.int16).view(torch.float16).to(compute)  # (NT, G, 16)
    a_tiles -= zeros.repeat_interleave(gt, dim=1)[:, :, None, :, None]
    # B tiles: (KB, j, 16 fragment rows, M) from the lane mapping of the activations
    xs = x.to(compute).reshape(m, kb, 64)
    hh = torch.arange(2)
    ee = torch.arange(2)
    jj = torch.arange(4)
    tt = torch.arange(4)
    b_row = 2 * tt[:, None, None] + 8 * hh[None, :, None] + ee[None, None, :]  # (t, h, e)
    chan = 16 * tt[:, None, None, None] + 4 * jj[None, :, None, None] + 2 * hh[None, None, :, None] \
        + ee[None, None, None, :]  # (t, j, h, e)
    b_tiles = torch.zeros(kb, 4, 16, m, dtype=compute)
    for j in range(4):
        b_tiles[:, j, b_row.reshape(-1), :] = xs[:, :, chan[:, j].reshape(-1)].permute(1, 2, 0)
    prod = torch.einsum("nbjrc,bjcm->nbrm", a_tiles, b_tiles)  # (NT, KB, 16, M): sums of 4 k-tiles
    group_sum = prod.reshape(nt, kb // gt, gt, 16, m).sum(dim=2)  # (NT, G, 16, M): sum (q - zero) x
    y = (group_sum * scales[..., None]).sum(dim=1).reshape(nt * 16, m).T  # (M, N)
    if bias is not None:
        y = y + bias.to(compute)
    return y


def main(argv: list[str] | None = None) -> int:
    """``--build``: compile the extension for this machine's GPU (or ``EDGEVLM_CUDA_ARCH``) now."""
    ap = argparse.ArgumentParser(description="build/check the W4A16 tensor-core kernel")
    ap.add_argument("--build", action="store_true", help="compile the extension now (needs CUDA and nvcc)")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0
    try:
        if os.environ.get("EDGEVLM_CUDA_ARCH") and not torch.cuda.is_available():
            with _BUILD_LOCK:
                _build(os.environ["EDGEVLM_CUDA_ARCH"], lean_build(), lean_trigger_build(os.environ["EDGEVLM_CUDA_ARCH"]))
        else:
            load_extension()
    except MmaKernelUnavailable as exc:
        print(f"w4a16_mma: not built: {exc}", file=sys.stderr)
        return 1
    print("w4a16_mma: built")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
