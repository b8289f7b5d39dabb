#!/usr/bin/env python3
"""W4A16 on a CUDA GPU, issue 15 in one device call: per-layer decode kernels, prefill paths, numerics,
whole-model decode and TTFT, and the sm_87 build.

Sections (each one's failure is recorded and the others still run):

1. ``layers``: the tensor-core kernel's two variants (``reg``: register ring, sm_80+; ``bulk``: sm_90
   bulk-copy ring, runtime/kernels/w4a16_bulk.cu) swept over their compiled launch configurations vs
   torch's tinygemm int4 op vs a bf16 cuBLAS matmul, per layer at M = 1, 8, 16, 32, on the four 7B shapes
   (LLaVA-1.5-7B / Llama-2-7B, fused qkv and gate_up) and those of the Qwen3-VL-2B/8B text decoders;
   group size 128, random RTN weights. Timing as bench/w4a16_marlin.py (CUDA-graph replays over weight
   copies that exceed 3x the L2; median). GB/s counts the canonical INT4 bytes + activations + outputs.
2. ``numerics``: the chosen configuration of each variant against a float64 matmul of the dequantized
   weight at M = 1, 8, 16 (and 32 for bulk), three runs bit-identical; the prefill path at M = 600.
3. ``prefill``: M = 32 .. 600 on the 7B shapes: the Triton dequantizer + cuBLAS (the path before), the
   extension's CUDA dequantizer + cuBLAS (whole weight, or row chunks that stay in L2), tinygemm, bf16
   cuBLAS; the winner is set as ``int4.PREFILL_CHUNK_BYTES`` for section 4.
4. ``model``: ``edgevlm bench``'s harness (runtime/benchmark.py) on the LLaVA-1.5-7B shape, bf16 and
   W4A16 (the kernel on), batch 1/8/32, 32-token prompt at 336 px: decode tok/s, TTFT.
5. ``sm87``: ``nvcc -gencode arch=compute_87,code=sm_87 -c`` of every kernel source (in the background).

Usage::

    python3 bench/w4a16_kernel.py [--skip model] [--quick] [--install-table] [--no-lean] [--no-pdl] [--pf 0]

The lean register-ring variant (runtime/kernels/w4a16_lean.cu, the default build) is first run in a child process
against the register ring (bit-identical at the same KSPLIT, every compiled configuration), then swept with the
others; the chain and model sections also run with it switched off (the table's fallback entries).
``--no-lean`` builds and sweeps without it; ``--no-pdl`` launches everything plainly; ``--pf`` the register
ring's L2 prefetch distances to sweep (``0``: none, the 12-02 measurement found every distance slower).

Prints tables, then one JSON line (also ``$OUT/w4a16_kernel.json``; the sweep's best configurations go to
``$OUT/w4a16_mma_configs.json``, the file runtime/kernels/ ships).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from types import ModuleType

from bench_support import SHAPES  # bench/ is sys.path[0] when run as a script

REPO = Path(__file__).resolve().parents[1]
MS = (1, 8, 16, 32)
TPC = (1, 2, 4)
PF = (0, 1, 2, 4)  # L2 prefetch distance of the register ring, in tiles (<= tiles_per_cta; 0 = none)
PDL_TOP = 3  # configurations per (shape, M, kind) re-timed as a chain of programmatic dependent launches
PREFILL_MS = (32, 64, 128, 256, 600)
CHUNKS_MB = (0, 8, 16, 32)
REL_LIMIT = 3e-3
# text decoders for the Orin prediction: layers, per-layer shape keys, lm_head (vocab x hidden, bf16)
MODELS = {
    "qwen3-vl-2b": {"layers": 28, "prefix": "qwen2b", "lm_head": (151936, 2048), "trt_edge_llm_tok_s": 98.9},
    "qwen3-vl-8b": {"layers": 36, "prefix": "qwen8b", "lm_head": (151936, 4096), "trt_edge_llm_tok_s": 32.1},
    "llava-1.5-7b": {"layers": 32, "prefix": "7b", "lm_head": (32064, 4096), "trt_edge_llm_tok_s": None},
}
ORIN_GBPS = 204.8
_bench_modules: dict[str, ModuleType] = {}


def _bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module, loaded once."""
    if name not in _bench_modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # registered first, as an import does (a dataclass looks its module up)
        spec.loader.exec_module(module)
        _bench_modules[name] = module
    return _bench_modules[name]


def marlin():
    """bench/w4a16_marlin.py as a module (graph_us, copies_for, rel, bootstrap_imports)."""
    return _bench_module("w4a16_marlin")


def breakdown():
    """bench/decode_step_breakdown.py as a module (``variant``: the decode step before / after session 8)."""
    return _bench_module("decode_step_breakdown")


def import_quantize():
    """``edgevlm.quantize`` (the bench harness moved there from runtime/): imported normally, else mapped
    from this checkout's quantize/ as bench/gpu_suite.py's bootstrap maps runtime/ (a checkout run without
    ``pip install -e .``, where ``edgevlm`` resolves to the checkout's edgevlm/ folder)."""
    try:
        import edgevlm.quantize  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location("edgevlm.quantize", REPO / "quantize" / "__init__.py",
                                                      submodule_search_locations=[str(REPO / "quantize")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["edgevlm.quantize"] = module
        spec.loader.exec_module(module)
    from edgevlm.quantize import benchmark

    return benchmark


RESULTS: dict = {"bench": "w4a16_kernel", "sections": {}}


class lean_switch:  # noqa: N801 - used as a context manager
    """``with lean_switch(on):`` the lean variant's table entries used (True: the build has it) or not (False: the
    table's fallback entries, as a build without it); None: unchanged. Works on the loaded extension: the kernel
    wrapper reads ``EDGEVLM_W4A16_LEAN`` per call, the built module keeps every variant."""

    def __init__(self, on: bool | None):
        self.on, self.before = on, None

    def __enter__(self):
        self.before = os.environ.get("EDGEVLM_W4A16_LEAN")
        if self.on is not None:
            os.environ["EDGEVLM_W4A16_LEAN"] = "1" if self.on else "0"
        return self

    def __exit__(self, *exc):
        if self.on is not None:
            if self.before is None:
                os.environ.pop("EDGEVLM_W4A16_LEAN", None)
            else:
                os.environ["EDGEVLM_W4A16_LEAN"] = self.before
        return False


def section(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
                RESULTS["sections"][name] = f"ok {time.perf_counter() - t0:.1f} s"
                return out
            except Exception as exc:  # noqa: BLE001 - one failing section must not lose the rest
                traceback.print_exc()
                RESULTS["sections"][name] = f"FAILED {type(exc).__name__}: {exc}"[:400]
                return None
            finally:
                save()
        return run
    return wrap


def save() -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w4a16_kernel.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


def start_sm87_build() -> subprocess.Popen | None:
    """nvcc sm_87 compile of the kernel sources in the background (returns None without nvcc)."""
    import shutil

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        return None
    src = REPO / "runtime" / "kernels"
    cmd = " && ".join(f"{nvcc} -O3 -std=c++17 -gencode arch=compute_87,code=sm_87 -c {src / f} -o /tmp/{f}.sm87.o"
                      for f in ("w4a16_mma.cu", "w4a16_bulk.cu", "w4a16_dequant.cu", "w4a16_lean.cu"))
    return subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def bulk_safe(timeout_s: float = 120.0) -> str | None:
    """Run the bulk variant once in a child process (a hang must not take this run with it): None when it
    matched a float64 reference, else why not."""
    marlin_py = str(REPO / "bench" / "w4a16_marlin.py")
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import importlib.util as u; "
            f"s = u.spec_from_file_location('m', {marlin_py!r}); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "m.bootstrap_imports(); from edgevlm.runtime.kernels import w4a16_mma as mk; "
            "print('BULK', mk.mma_status('cuda', 'bulk'))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the bulk probe did not finish in {timeout_s:.0f} s"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BULK ")), None)
    if line is None:
        return f"the bulk probe failed: {(proc.stdout + proc.stderr)[-600:]}"
    return None if line == "BULK None" else line[5:]


LEAN_CHILD = """
import torch
from edgevlm.runtime.kernels import w4a16_mma as mk
from edgevlm.runtime.int4_format import quantize_int4, repack_int4_mma
why = mk.mma_status("cuda", "lean")
if why is None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    for g, k in ((128, 2048), (64, 2112)):
        qw = quantize_int4(torch.randn(1024, k, device="cuda", generator=gen) * 0.02, g)
        packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
        for m in (1, 3, 9, 16):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for kind, pairs in (("lean", mk.LEAN_CONFIGS), ("async", mk.ASYNC_CONFIGS)):
                for ks, depth in pairs:
                    for tpc in (1, 3):
                        y = mk.w4a16_mma(x, packed, meta, g, config=(kind, ks, depth, tpc), pdl=False)
                        twin = mk.w4a16_mma(x, packed, meta, g, config=("reg", ks, 2, tpc), mode=2, pdl=False)
                        if not torch.equal(y, twin) and why is None:
                            why = f"{kind} {(ks, depth, tpc)} differs from the register ring at M={m}, g={g}"
    torch.cuda.synchronize()
print("LEAN", why)
"""


def lean_safe(timeout_s: float = 150.0) -> str | None:
    """Run the lean variant and its cp.async ring (every compiled configuration against its register-ring twin)
    in a child process first: a kernel fault there must not poison this process's CUDA context. None when it
    matched."""
    marlin_py = str(REPO / "bench" / "w4a16_marlin.py")
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import importlib.util as u; "
            f"s = u.spec_from_file_location('m', {marlin_py!r}); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "m.bootstrap_imports()\n" + LEAN_CHILD)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, EDGEVLM_W4A16_LEAN="1"))
    except subprocess.TimeoutExpired:
        return f"the lean probe did not finish in {timeout_s:.0f} s"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LEAN ")), None)
    if line is None:
        return f"the lean probe failed: {(proc.stdout + proc.stderr)[-600:]}"
    return None if line == "LEAN None" else line[5:]


def configs(kind: str, m: int):
    from edgevlm.runtime.kernels import w4a16_mma as mk

    if kind in ("reg", "lean", "async"):
        pairs = {"reg": mk.MMA_CONFIGS, "lean": mk.LEAN_CONFIGS, "async": mk.ASYNC_CONFIGS}[kind]
        return [] if m > mk.MMA_MAX_M else [(kind, a, b, t) for a, b in pairs for t in TPC]
    return [("bulk", a, b, t) for a, b in mk.BULK_CONFIGS for t in TPC]


def variants(kind: str, m: int):
    """``(config, mode, pf)`` triples of the sweep: every compiled configuration; the register ring with each
    L2 prefetch distance up to its tiles per CTA; the x-sum zero-point fold (mode 0) at M <= 4 without
    prefetch (measured slower in the previous session: kept as a check, not swept wider)."""
    out = []
    for c in configs(kind, m):
        pfs = [p for p in PF if p <= c[3]] if kind == "reg" else [0]
        out += [(c, 2, p) for p in pfs]
        if m <= 4 and kind in ("reg", "bulk"):
            out.append((c, 0, 0))
    return out


def poisoned_call(fn, shape, dtype, dev):
    """Run ``fn`` right after freeing a NaN-filled block of the output's size (the caching allocator hands
    the same block to the kernel's torch.empty): an element the kernel does not write stays NaN."""
    import torch

    poison = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    ptr = poison.data_ptr()
    del poison
    y = fn()
    return y, y.data_ptr() == ptr


@section("layers")
def run_layers(ctx, shapes, kinds):
    import torch
    import torch.nn.functional as F

    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16_mma as mk

    mar = marlin()
    dev, l2, g = ctx["dev"], ctx["l2"], 128
    conv = int4.kernel_convention(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows, checks, sweep, tuned, fallback = [], [], [], {}, {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        qw = int4.quantize_int4(w, g)
        del w
        w64 = int4.dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
        wbf = w64.to(torch.bfloat16)
        packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
        int4_bytes = qw.nbytes()
        r4, r16 = mar.copies_for(int4_bytes, l2), mar.copies_for(n * k * 2, l2)
        mma_copies = [(packed.clone(), meta.clone()) for _ in range(r4)]
        tg_w = int4._pack_for_kernel(conv, qw.qweight) if conv else None
        tg_sz = int4._tinygemm_scales_and_zeros(qw.scales, qw.zeros, torch.bfloat16) if conv else None
        tg_copies = [(tg_w.clone(), tg_sz.clone()) for _ in range(r4)] if conv else []
        bf_copies = [wbf.clone() for _ in range(r16)]
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.double() @ w64.T
            moved = int4_bytes + x.numel() * 2 + m * n * 2
            best = {}  # (kind, zx) -> best row
            for kind in kinds:
                mine = []
                for c, mode, pf in variants(kind, m):
                    y = mk.w4a16_mma(x, packed, meta, g, config=c, mode=mode, prefetch=pf, pdl=False)
                    if kind in ("lean", "async"):  # the same function in the same order as the register ring
                        twin = mk.w4a16_mma(x, packed, meta, g, config=("reg", c[1], 2, c[3]), mode=2, pdl=False)
                        if not torch.equal(y, twin):
                            checks.append({"what": f"{kind} {name} M={m} {c} == reg twin", "pass": False})
                    err = mar.rel(y, ref)
                    us = mar.graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c, mode=mode, prefetch=pf, pdl=False)
                                       for p, mt in mma_copies])
                    mine.append({"shape": name, "m": m, "config": list(c), "zx": mode == 0, "pf": pf,
                                 "us": round(us, 2), "gbps": round(moved / us / 1e3, 1), "rel_err": err,
                                 "ok": err <= REL_LIMIT})
                if ctx.get("pdl"):  # the fastest few again, each call a programmatic dependent of the one before
                    for r in sorted([r for r in mine if r["ok"]], key=lambda r: r["us"])[:PDL_TOP]:
                        c, mode, pf = tuple(r["config"]), 0 if r["zx"] else 2, r["pf"]
                        r["pdl_us"] = round(mar.graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c, mode=mode,
                                                                  prefetch=pf, pdl=True, late_trigger=False)
                                                          for p, mt in mma_copies]), 2)
                        if kind == "lean" and ctx.get("lean_trigger"):  # released after the last ring refill
                            r["pdl_late_us"] = round(mar.graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c,
                                                                           pdl=True, late_trigger=True)
                                                                   for p, mt in mma_copies]), 2)
                sweep.extend(mine)
                if any(not r["ok"] for r in mine):
                    checks.append({"what": f"sweep {name} M={m} {kind}", "pass": False,
                                   "bad": [(r["config"], r["zx"]) for r in mine if not r["ok"]]})
                for zx in (False, True):
                    good = [r for r in mine if r["ok"] and r["zx"] == zx]
                    if good:
                        best[(kind, zx)] = min(good, key=lambda r: r["us"])
            if not best:
                continue
            win = min(best.values(), key=lambda r: r["us"])
            tuned.setdefault(f"{n}x{k}g{g}", {})[str(m)] = [*win["config"], int(win["zx"]), int(win["pf"])]
            if win["config"][0] in ("lean", "async"):  # what a build without the lean variant runs instead
                others = [r for (kd, _), r in best.items() if kd not in ("lean", "async")]
                if others:
                    fb = min(others, key=lambda r: r["us"])
                    fallback.setdefault(f"{n}x{k}g{g}", {})[str(m)] = [*fb["config"], int(fb["zx"]), int(fb["pf"])]
            timed_pdl = [r for r in mine_all(sweep, name, m) if "pdl_us" in r]
            win_pdl = min(timed_pdl, key=lambda r: r["pdl_us"]) if timed_pdl else None
            # numerics of each variant's chosen configuration: float64 reference, 3 runs bit-identical, the
            # output poisoned with NaN before each run, with and without PDL
            for (kind, zx), r in best.items():
                call = partial(mk.w4a16_mma, x, packed, meta, g, config=tuple(r["config"]), mode=0 if zx else 2,
                               prefetch=r["pf"])
                runs = [poisoned_call(partial(call, pdl=i == 1 and bool(ctx.get("pdl"))), (m, n), x.dtype, dev)
                        for i in range(3)]
                outs = [o for o, _ in runs]
                err = mar.rel(outs[0], ref)
                stable = all(torch.equal(outs[0], o) for o in outs[1:])
                if kind == "lean" and ctx.get("lean_trigger"):
                    late, _ = poisoned_call(partial(call, pdl=True, late_trigger=True), (m, n), x.dtype, dev)
                    stable = stable and torch.equal(outs[0], late)
                    outs.append(late)
                checks.append({"what": f"{name} M={m} {kind} zx={zx} pf={r['pf']} {r['config']}", "rel_err": err,
                               "bit_stable": stable, "poison_reused": sum(p for _, p in runs),
                               "pass": err <= REL_LIMIT and stable and all(bool(torch.isfinite(o).all()) for o in outs)})
            tg_us = mar.graph_us([partial(torch.ops.aten._weight_int4pack_mm, x, a, g, b) for a, b in tg_copies]) \
                if conv else float("nan")
            bf_us = mar.graph_us([partial(F.linear, x, wb) for wb in bf_copies])
            us_of = partial(_best_us, best)
            loads_only_us = None
            if m == 1 and ("reg", False) in best:  # the register ring's access pattern with no arithmetic
                c = tuple(best[("reg", False)]["config"])
                loads_only_us = round(mar.graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c, mode=1)
                                                    for p, mt in mma_copies]), 2)
            loads_only_pf_us = None
            if m == 1 and ("reg", False) in best and best[("reg", False)]["pf"] > 0:
                c = tuple(best[("reg", False)]["config"])
                loads_only_pf_us = round(mar.graph_us([partial(mk.w4a16_mma, x, p, mt, g, config=c, mode=1,
                                                               prefetch=best[("reg", False)]["pf"], pdl=False)
                                                       for p, mt in mma_copies]), 2)
            row = {"shape": name, "n": n, "k": k, "m": m, "best": [*win["config"], int(win["zx"]), int(win["pf"])],
                   "us": win["us"], "reg_loads_only_pf_us": loads_only_pf_us,
                   "pdl_best": [*win_pdl["config"], int(win_pdl["zx"]), int(win_pdl["pf"])] if win_pdl else None,
                   "pdl_us": win_pdl["pdl_us"] if win_pdl else None,
                   "pdl_gbps": round(moved / win_pdl["pdl_us"] / 1e3, 1) if win_pdl else None,
                   "win_pdl_us": win.get("pdl_us"),
                   "gbps": win["gbps"], "pct_copy": round(100 * win["gbps"] / ctx["copy_gbps"], 1),
                   "reg_us": us_of("reg"), "reg_nozx_us": us_of("reg", False), "reg_zx_us": us_of("reg", True),
                   "lean_us": us_of("lean"), "async_us": us_of("async"), "pdl_by_kind": _pdl_by_kind(mine_all(sweep, name, m)),
                   "bulk_us": us_of("bulk"), "bulk_nozx_us": us_of("bulk", False), "bulk_zx_us": us_of("bulk", True),
                   "reg_loads_only_us": loads_only_us,
                   "tinygemm_us": round(tg_us, 2), "tinygemm_gbps": round(moved / tg_us / 1e3, 1),
                   "bf16_us": round(bf_us, 2), "bf16_gbps": round((n * k * 2 + x.numel() * 2 + m * n * 2) / bf_us / 1e3, 1),
                   "vs_tinygemm": round(tg_us / win["us"], 2), "vs_bf16": round(bf_us / win["us"], 2),
                   "int4_bytes": int4_bytes}
            rows.append(row)
            print(f"{name:15s} M={m:<3d} best {row['best']} {win['us']:7.2f} us {win['gbps']:7.1f} GB/s | pdl "
                  f"{row['pdl_best']} {row['pdl_us']} us {row['pdl_gbps']} GB/s | lean {row['lean_us']} | async "
                  f"{row['async_us']} | reg {row['reg_us']} | bulk "
                  f"{row['bulk_us']} | loads-only {loads_only_us} / pf {loads_only_pf_us} | tinygemm {tg_us:7.2f} | "
                  f"bf16 {bf_us:7.2f}", flush=True)
        del mma_copies, tg_copies, bf_copies, w64, wbf
        torch.cuda.empty_cache()
    RESULTS.update(layers=rows, sweep=sweep)
    RESULTS.setdefault("checks", []).extend(checks)
    table = json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "group_size": g,
                        "source": "bench/w4a16_kernel.py (sweep of every variant; entry: kind, a, b, "
                                  "tiles_per_cta, zx, pf; fallback: the fastest non-lean entry where the lean "
                                  "variant won)", "configs": tuned,
                        **({"fallback": fallback} if fallback else {})}, indent=1) + "\n"
    if os.environ.get("OUT") and tuned:
        Path(os.environ["OUT"], "w4a16_mma_configs.json").write_text(table)
    if ctx.get("install_table") and tuned:  # the model section then runs with this sweep's table
        mk.CONFIGS_FILE.write_text(table)
        mk._table.cache_clear()
    return rows


def mine_all(sweep: list[dict], name: str, m: int) -> list[dict]:
    return [r for r in sweep if r["shape"] == name and r["m"] == m]


def _pdl_by_kind(rows: list[dict]) -> dict:
    """The fastest PDL-chain µs per kernel variant (``{kind: [µs, config]}``) of one (shape, M)."""
    out: dict = {}
    for r in rows:
        if "pdl_us" in r and (r["config"][0] not in out or r["pdl_us"] < out[r["config"][0]][0]):
            out[r["config"][0]] = [r["pdl_us"], [*r["config"], int(r["zx"]), int(r["pf"])]]
        if "pdl_late_us" in r and ("lean_late" not in out or r["pdl_late_us"] < out["lean_late"][0]):
            out["lean_late"] = [r["pdl_late_us"], [*r["config"], 0, 0]]
    return out


def _best_us(best: dict, kind: str, zx: bool | None = None) -> float | None:
    rs = [r for (kd, z), r in best.items() if kd == kind and (zx is None or z == zx)]
    return min(r["us"] for r in rs) if rs else None


@section("chain")
def run_chain(ctx, prefixes=("7b", "qwen8b", "qwen2b"), ms=(1, 8, 16)):
    """A decoder layer's four matmuls back to back (qkv, o, gate_up, down; the launch table's configurations),
    copies rotated past L2 as in ``layers``: µs per layer with ordinary launches and with programmatic
    dependent launch (each kernel's launch and weight loads overlap the previous one's tail). Then a
    dependency check: 8 calls where each call's input is the previous call's output, PDL vs plain, bit-equal."""
    import torch

    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16_mma as mk

    mar = marlin()
    dev, l2, g = ctx["dev"], ctx["l2"], 128
    gen = torch.Generator(device=dev)
    gen.manual_seed(3)
    rows = []
    for prefix in prefixes:
        names = [f"{prefix}.{part}" for part in ("qkv", "o", "gate_up", "down")]
        layer = []
        for nm in names:
            n, k = SHAPES[nm]
            qw = int4.quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, g)
            layer.append((n, k, *int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g), qw.nbytes()))
        layer_bytes = sum(e[4] for e in layer)
        copies = [[(n, k, p.clone(), mt.clone()) for n, k, p, mt, _ in layer]
                  for _ in range(mar.copies_for(layer_bytes, l2))]
        for m in ms:
            xs = {k: torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16) for _, k, *_ in layer}
            row = {"model": prefix, "m": m, "layer_int4_bytes": layer_bytes}
            # with the lean variant swept: the table as installed (lean entries) and with lean switched off (the
            # table's fallback entries: what the register ring / bulk variants give)
            for lean_on in ((True, False) if "lean" in ctx.get("kinds", ()) else (None,)):
                tag = "reg_" if lean_on is False else ""
                with lean_switch(lean_on):
                    modes = [("plain", False, False), ("pdl", True, False)]
                    if ctx.get("lean_trigger") and lean_on:  # lean entries released after their last ring refill
                        modes.append(("late_pdl", True, True))
                    for label, pdl, late in modes:
                        calls = [partial(mk.w4a16_mma, xs[k], p, mt, g, pdl=pdl, late_trigger=late)
                                 for cp in copies for n, k, p, mt in cp]
                        us = mar.graph_us(calls) * 4  # graph_us divides by the number of calls: 4 per layer
                        row[f"{tag}{label}_us"] = round(us, 2)
                        row[f"{tag}{label}_gbps"] = round(layer_bytes / us / 1e3, 1)
            rows.append(row)
            print(f"chain {prefix} M={m}: plain {row['plain_us']} us ({row['plain_gbps']} GB/s), PDL {row['pdl_us']} us "
                  f"({row['pdl_gbps']} GB/s)" + (f"; lean off: plain {row['reg_plain_us']} us, PDL {row['reg_pdl_us']} us"
                                                 if "reg_pdl_us" in row else ""), flush=True)
        del copies
        torch.cuda.empty_cache()
    RESULTS["chain"] = rows
    # dependency check: y_{i+1} = f(y_i) on a square weight, eager and graphed, PDL vs plain
    n = k = 4096
    qw = int4.quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, g)
    packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    for m in (1, 8, 16, 32):
        x0 = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)

        def chain(pdl, x0=x0):
            y = x0
            for _ in range(8):
                y = mk.w4a16_mma(y, packed, meta, g, pdl=pdl)
                y = y / y.float().norm(dim=1, keepdim=True).to(y.dtype) * 64  # keep it in range; a non-PDL kernel
                y = mk.w4a16_mma(y, packed, meta, g, pdl=pdl)  # PDL after PDL
            return y

        ref = chain(False)
        eager = chain(True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(True)
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(ref, eager) and torch.equal(ref, out) and bool(torch.isfinite(ref).all())
        RESULTS.setdefault("checks", []).append({"what": f"PDL dependency chain M={m} (eager + graph) == plain",
                                                 "pass": ok})
        print(f"PDL dependency chain M={m}: {'bit-equal' if ok else 'DIFFERENT'}", flush=True)
    return rows


@section("extra_numerics")
def run_extra_numerics(ctx, kinds):
    """bias + fp16 + group 64 at odd M for every compiled configuration of each variant."""
    import torch

    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16_mma as mk

    mar = marlin()
    dev = ctx["dev"]
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    n, k = 2048, 4096
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    for gsz in (64, 128):
        qw = int4.quantize_int4(w, gsz)
        w64 = int4.dequantize_int4(qw.qweight, qw.scales, qw.zeros, gsz, torch.float64)
        packed, meta = int4.repack_int4_mma(qw.qweight, qw.scales, qw.zeros, gsz)
        bias = torch.randn(n, device=dev, generator=gen)
        for m in (1, 3, 9, 16, 17, 27, 32):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
                ref = x.double() @ w64.T + bias.double()
                cfgs = [c for kind in kinds for c in configs(kind, m)]
                cfgs = [(*c[:3], t) for c in cfgs for t in (1, 3) if c[3] == 1]
                errs = [mar.rel(mk.w4a16_mma(x, packed, meta, gsz, bias, config=c, mode=mode), ref)
                        for c in cfgs for mode in ((0, 2) if m <= 4 and c[0] != "lean" else (2,))]
                RESULTS.setdefault("checks", []).append(
                    {"what": f"bias {n}x{k} g{gsz} {str(dtype)[6:]} M={m} ({len(cfgs)} configs)",
                     "rel_err": max(errs), "pass": max(errs) <= REL_LIMIT})


@section("prefill")
def run_prefill(ctx, shapes):
    import torch
    import torch.nn.functional as F

    from edgevlm.runtime import int4
    from edgevlm.runtime.kernels import w4a16 as tk
    from edgevlm.runtime.kernels import w4a16_mma as mk

    mar = marlin()
    dev, l2, g = ctx["dev"], ctx["l2"], 128
    conv = int4.kernel_convention(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(2)
    rows = []
    totals: dict[str, dict[int, float]] = {}
    for name, (n, k) in shapes.items():
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        q = int4.Int4Linear.from_linear(lin, g)
        del lin
        wbf = q.dequantized_weight(torch.bfloat16)
        w64 = q.dequantized_weight(torch.float64)
        r4 = mar.copies_for(q.int4_weight().nbytes(), l2)
        mods = [q] + [int4.Int4Linear.from_int4(int4.Int4Weight(q.qweight.clone(), q.scales.clone(),
                                                                 q.zeros.clone(), g)) for _ in range(r4 - 1)]
        bfs = [wbf] + [wbf.clone() for _ in range(mar.copies_for(n * k * 2, l2) - 1)]
        # the dequantizer alone: GB/s (reads int4, writes bf16)
        dq_us = mar.graph_us([partial(mk.w4a16_dequant, md.qweight, md.scales, md.zeros, g) for md in mods])
        tdq_us = mar.graph_us([partial(tk.dequantize_w4, md.qweight, md.scales, md.zeros, g, torch.bfloat16)
                               for md in mods])
        dq_bytes = q.int4_weight().nbytes() + n * k * 2
        exact = torch.equal(mk.w4a16_dequant(q.qweight, q.scales, q.zeros, g), wbf)
        RESULTS.setdefault("checks", []).append({"what": f"dequant {name} == dequantize_int4 bf16", "pass": exact})
        print(f"{name:15s} dequant cuda {dq_us:7.1f} us ({dq_bytes / dq_us / 1e3:.0f} GB/s), triton {tdq_us:7.1f} us "
              f"({dq_bytes / tdq_us / 1e3:.0f} GB/s); bit-exact {exact}", flush=True)
        for m in PREFILL_MS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.double() @ w64.T
            row = {"shape": name, "m": m, "dequant_cuda_us": round(dq_us, 1), "dequant_triton_us": round(tdq_us, 1)}
            for deq in ("cuda", "triton"):
                for mb in CHUNKS_MB:
                    y = int4._prefill_matmul(x, q, deq, mb << 20)
                    err = mar.rel(y, ref)
                    RESULTS["checks"].append({"what": f"prefill {name} M={m} {deq} chunk {mb} MiB", "rel_err": err,
                                              "pass": err <= REL_LIMIT or m != 600 and err <= 5e-3})
                    row[f"{deq}_chunk{mb}_us"] = round(mar.graph_us(
                        [partial(int4._prefill_matmul, x, md, deq, mb << 20) for md in mods]), 1)
                    row[f"{deq}_chunk{mb}_rel_err"] = err
            # what Int4Linear routes (the kernel in <= 2 launches up to M = 64 on sm_90, else cuda dequant)
            path = q.execution_path(m, dev)
            y = q(x)
            err = mar.rel(y, ref)
            RESULTS["checks"].append({"what": f"Int4Linear {name} M={m} path {path}", "rel_err": err,
                                      "pass": err <= REL_LIMIT})
            row["int4linear_path"] = path
            row["int4linear_us"] = round(mar.graph_us([partial(md, x) for md in mods]), 1)
            if conv and m <= 64:
                pk = [(md._kernel_tensors(conv)) for md in mods]
                row["tinygemm_us"] = round(mar.graph_us(
                    [partial(torch.ops.aten._weight_int4pack_mm, x, a, g, b) for a, b in pk]), 1)
                for md in mods:
                    md._kernel_cache = None
            row["bf16_us"] = round(mar.graph_us([partial(F.linear, x, wb) for wb in bfs]), 1)
            rows.append(row)
            for key in [kk for kk in row if kk.endswith("_us") and not kk.startswith("dequant")]:
                totals.setdefault(key, {}).setdefault(m, 0.0)
                totals[key][m] += row[key]
            print(f"  M={m:<4d} " + " ".join(f"{kk[:-3]} {v}" for kk, v in row.items() if kk.endswith("_us")
                                             and not kk.startswith("dequant")), flush=True)
        del mods, bfs, wbf, w64
        torch.cuda.empty_cache()
    # the dequantizer + chunk size that win the 7B layer sum at M = 600 (the TTFT prompt) go to the model run
    at = {(deq, mb): totals.get(f"{deq}_chunk{mb}_us", {}).get(600, float("inf"))
          for deq in ("cuda", "triton") for mb in CHUNKS_MB}
    choice = min(at, key=at.get)
    RESULTS.update(prefill=rows, prefill_totals=totals, prefill_choice=list(choice))
    return choice


@section("model")
def run_model(ctx, choice):
    from edgevlm.runtime import int4

    benchmark = import_quantize()

    if choice:
        int4.PREFILL_DEQUANTIZER, int4.PREFILL_CHUNK_BYTES = choice[0], choice[1] << 20
    from edgevlm.runtime.kernels import w4a16_mma as mk

    keep = ("model", "impl", "ttft_ms", "tpot_ms", "decode_tok_s", "decode_tok_s_host_fed", "step_gpu_ms", "batch_tok_s",
            "batch_tok_s_host_fed", "copy_frac", "gbps",
            "weight_bytes", "kv_bytes_per_token", "error")
    rows = []
    copy = None
    lean = "lean" in ctx.get("kinds", ())
    late = bool(ctx.get("lean_trigger")) and lean
    runs = [("pdl", ctx["model_variants"], True, None, late)]
    if lean:  # the same W4A16 model with the lean variant switched off (the register ring / bulk entries)
        runs.append(("pdl, lean off", ["edgevlm-w4"], True, False, False))
    if late:  # the lean kernels released at entry (as the default build) instead of after the last refill
        runs.append(("pdl, late trigger off", ["edgevlm-w4"], True, None, False))
    runs.append(("plain", ["edgevlm-w4"], False, None, False))
    for i in range(1, ctx.get("model_ab", 1)):  # PDL on / off again, alternating, to see the run-to-run spread
        runs += [(f"pdl #{i + 1}", ["edgevlm-w4"], True, None, late), (f"plain #{i + 1}", ["edgevlm-w4"], False, None, False)]
    runs = [(*r, None) for r in runs]
    if ctx.get("model_ab_fusion"):  # instead: the decode step of session 8 vs before it, launches as the library's
        lib = bool(ctx.get("lib_pdl"))
        runs = []
        for i in range(ctx.get("model_ab", 1)):
            runs += [(f"fused #{i + 1}", ctx["model_variants"] if i == 0 else ["edgevlm-w4"], lib, None, False, "after"),
                     (f"unfused #{i + 1}", ["edgevlm-w4"], lib, None, False, "before")]
    for label, variants_, pdl, lean_on, late_on, step in runs:
        if label.startswith("plain") and not ctx.get("pdl"):
            continue
        mk.PDL = pdl and bool(ctx.get("pdl"))
        mk.LEAN_LATE_TRIGGER = late_on
        # "plain": every kernel launched plainly (the Triton decode kernels too, whose PDL switch is on by default)
        with lean_switch(lean_on), breakdown().variant(step or ("nomask" if mk.PDL else "nomask_nopdl")):
            summary = benchmark.run(models=["llava-7b"], variants=variants_, with_hf=False,
                                    batch_sizes=ctx["batch_sizes"], new_tokens=32, n_text=32)
        rows += [{**{k: r.get(k) for k in keep if k in r}, "w4a16_launch": label} for r in summary["rows"]]
        copy = summary.get("copy_gbps") or copy
        print(f"[{label}]\n" + benchmark.format_table(summary["rows"]), flush=True)
    mk.PDL = bool(ctx.get("lib_pdl")) and bool(ctx.get("pdl"))  # the library's own setting again
    mk.LEAN_LATE_TRIGGER = True
    RESULTS["model"] = {"rows": rows, "copy_gbps": copy, "prefill": list(choice or ())}
    return rows


def orin_prediction(layers: list[dict], copy_gbps: float) -> dict:
    """Predicted AGX Orin decode tok/s per model: bytes per token (INT4 decoder layers + bf16 lm_head) over
    204.8 GB/s times the efficiency (GB/s over copy GB/s) the register-ring kernel (the sm_87 variant)
    reached on the H200 at M = 1, summed over the model's four layer shapes. A paper estimate: Orin not run."""
    out = {}
    for model, spec in MODELS.items():
        per = {r["shape"].split(".", 1)[1]: r for r in layers if r["m"] == 1 and r["shape"].startswith(spec["prefix"] + ".")}
        if len(per) != 4:
            continue
        layer_bytes = sum(r["int4_bytes"] for r in per.values())
        reg_us = sum(r["reg_us"] or r["us"] for r in per.values())
        eff = layer_bytes / reg_us / 1e3 / copy_gbps
        best_eff = layer_bytes / sum(r["us"] for r in per.values()) / 1e3 / copy_gbps
        head = spec["lm_head"][0] * spec["lm_head"][1] * 2
        head_int4 = spec["lm_head"][0] * spec["lm_head"][1] * (0.5 + 3 / 128)
        tok_bytes = spec["layers"] * layer_bytes + head
        tok_bytes_q_head = spec["layers"] * layer_bytes + head_int4
        out[model] = {"bytes_per_token_mb": round(tok_bytes / 1e6, 1),
                      "bytes_per_token_int4_head_mb": round(tok_bytes_q_head / 1e6, 1),
                      "h200_efficiency_reg": round(eff, 3), "h200_efficiency_best": round(best_eff, 3),
                      "orin_tok_s": round(eff * ORIN_GBPS * 1e9 / tok_bytes, 1),
                      "orin_tok_s_int4_head": round(eff * ORIN_GBPS * 1e9 / tok_bytes_q_head, 1),
                      "orin_bound_tok_s": round(ORIN_GBPS * 1e9 / tok_bytes, 1),
                      "trt_edge_llm_tok_s": spec["trt_edge_llm_tok_s"]}
    return out


def main(argv: list[str] | None = None) -> int:
    global PREFILL_MS, PF
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (layers,prefill,model,numerics,sm87)")
    ap.add_argument("--quick", action="store_true", help="the four 7B shapes only")
    ap.add_argument("--batch-sizes", default="1,8,32", help="decode batch sizes of the model section")
    ap.add_argument("--prefill-ms", default="32,64,128,256,600", help="M values of the prefill section")
    ap.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch anywhere")
    ap.add_argument("--pf", default=",".join(str(p) for p in PF),
                    help="L2 prefetch distances (tiles) the register ring is swept with (0: none)")
    ap.add_argument("--lean", action="store_true",
                    help="build and sweep the lean register-ring variant (the default unless EDGEVLM_W4A16_LEAN=0)")
    ap.add_argument("--no-lean", action="store_true",
                    help="build and sweep without the lean variant (EDGEVLM_W4A16_LEAN=0)")
    ap.add_argument("--lean-trigger", action="store_true",
                    help="also build the lean variant's late PDL trigger (EDGEVLM_W4A16_LEAN_TRIGGER=1; the default "
                         "for sm_90+ builds anyway) and "
                         "time it beside the entry trigger (layers, chain, model)")
    ap.add_argument("--model-ab", type=int, default=1,
                    help="run the W4A16 model with PDL on and off this many times each, alternating")
    ap.add_argument("--model-ab-fusion", action="store_true",
                    help="--model-ab alternates the decode step of session 8 (one attention kernel per layer, no "
                         "unused mask / RoPE gathers) with the one before it, launches as the library's default")
    ap.add_argument("--model-variants", default="edgevlm,edgevlm-w4",
                    help="variants of the model section (W4A16 is also run once without PDL)")
    ap.add_argument("--chain-models", default="7b,qwen8b,qwen2b", help="models of the chain section")
    ap.add_argument("--install-table", action="store_true",
                    help="write the sweep's launch table into runtime/kernels/ (used by the model section)")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    PREFILL_MS = tuple(int(m) for m in args.prefill_ms.split(","))
    PF = tuple(int(p) for p in args.pf.split(","))
    t0 = time.perf_counter()
    if args.lean or args.no_lean:
        os.environ["EDGEVLM_W4A16_LEAN"] = "0" if args.no_lean else "1"
    want_lean = os.environ.get("EDGEVLM_W4A16_LEAN", "1").strip().lower() not in ("0", "false", "no", "off")
    if args.lean_trigger:
        os.environ["EDGEVLM_W4A16_LEAN_TRIGGER"] = "1"
    nv = start_sm87_build() if "sm87" not in skip else None
    marlin().bootstrap_imports()
    import torch

    if not torch.cuda.is_available():
        print("w4a16_kernel: needs a CUDA GPU", file=sys.stderr)
        return 2
    from edgevlm.runtime.kernels import w4a16_mma as mk

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(10):
        dst.copy_(src)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        dst.copy_(src)
    ev[1].record()
    ev[1].synchronize()
    copy_gbps = 2 * (1 << 30) * 20 / (ev[0].elapsed_time(ev[1]) * 1e-3) / 1e9
    del src, dst
    tb = time.perf_counter()
    try:
        mk.load_extension(dev)
    except mk.MmaKernelUnavailable as exc:
        print(f"w4a16_kernel: extension unavailable: {exc}", file=sys.stderr)
        RESULTS["error"] = str(exc)
        save()
        return 1
    build_s = time.perf_counter() - tb
    bulk = bulk_safe() if props.major >= 9 else "not sm_90"
    if bulk is not None:
        os.environ["EDGEVLM_W4A16_BULK"] = "0"
    kinds = ("reg", "bulk") if bulk is None else ("reg",)
    lean = lean_safe() if want_lean else "not requested"
    if lean is None:
        lean = mk.mma_status(dev, "lean")
    if lean is None:
        kinds = (*kinds, "lean")
        why_async = mk.mma_status(dev, "async")  # the lean kernel's cp.async ring (same build)
        if why_async is None:
            kinds = (*kinds, "async")
        else:
            print(f"w4a16_kernel: async variant not swept: {why_async}", flush=True)
        RESULTS["async_status"] = why_async
    elif want_lean:  # the table's lean entries (none from this sweep) are not used by this process
        os.environ["EDGEVLM_W4A16_LEAN"] = "0"
        print(f"w4a16_kernel: lean variant not swept: {lean}", flush=True)
    RESULTS["lean_status"] = lean
    print(f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, "
          f"copy {copy_gbps:.0f} GB/s; torch {torch.__version__}; extension built in {build_s:.1f} s; "
          f"bulk variant: {'ok' if bulk is None else bulk}", flush=True)
    RESULTS.update(device=props.name, torch=torch.__version__, copy_gbps=round(copy_gbps, 1), l2_mib=l2 >> 20,
                   build_s=round(build_s, 1), bulk_status=bulk,
                   date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    pdl = props.major >= 9 and not args.no_pdl
    lib_pdl = mk.PDL  # on unless EDGEVLM_W4A16_PDL=0; the sections below pass / set PDL themselves
    mk.PDL = pdl
    lean_trigger = "lean" in kinds and pdl and bool(getattr(mk.load_extension(dev), "lean_late_trigger", False))
    RESULTS["lean_trigger"] = lean_trigger
    ctx = {"dev": dev, "l2": l2, "copy_gbps": copy_gbps, "install_table": args.install_table, "pdl": pdl,
           "lib_pdl": lib_pdl, "model_ab_fusion": args.model_ab_fusion,
           "kinds": kinds, "lean_trigger": lean_trigger, "model_ab": max(1, args.model_ab),
           "batch_sizes": [int(b) for b in args.batch_sizes.split(",")],
           "model_variants": [v for v in args.model_variants.split(",") if v]}
    shapes = {k: v for k, v in SHAPES.items() if k.startswith("7b.")} if args.quick else SHAPES
    layers = run_layers(ctx, shapes, kinds) if "layers" not in skip else None
    if "chain" not in skip:
        run_chain(ctx, tuple(p for p in args.chain_models.split(",") if p))
    chunk = run_prefill(ctx, {k: v for k, v in SHAPES.items() if k.startswith("7b.")}) if "prefill" not in skip else None
    if "model" not in skip:
        run_model(ctx, chunk)
    if "numerics" not in skip:
        run_extra_numerics(ctx, kinds)
    if layers:
        RESULTS["orin_prediction"] = orin_prediction(layers, copy_gbps)
    if nv is not None:
        out, _ = nv.communicate(timeout=300)
        RESULTS["sm87_build"] = {"rc": nv.returncode, "log": out[-2000:]}
    RESULTS["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print_tables()
    bad = [c for c in RESULTS.get("checks", []) if not c["pass"]]
    RESULTS["all_checks_pass"] = not bad
    print(f"\nchecks: {len(RESULTS.get('checks', [])) - len(bad)}/{len(RESULTS.get('checks', []))} pass"
          + (f"; FAILED: {bad[:6]}" if bad else ""))
    save()
    print(json.dumps({k: v for k, v in RESULTS.items() if k not in ("sweep", "checks", "prefill", "layers")},
                     default=str))
    return 0 if not bad else 1


def print_tables() -> None:
    layers = RESULTS.get("layers") or []
    if layers:
        print("\n| shape | M | best (kind, a, b, tpc, zx, pf) | µs | GB/s | % copy | PDL chain µs | PDL GB/s | "
              "lean µs | lean PDL µs | async µs | reg µs | reg PDL µs | reg+zx µs | bulk µs | loads-only µs (pf 0 / pf) | "
              "tinygemm µs | bf16 µs | vs tinygemm | vs bf16 |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for r in layers:
            pk = r.get("pdl_by_kind") or {}
            print(f"| {r['shape']} | {r['m']} | {tuple(r['best'])} | {r['us']} | {r['gbps']} | {r['pct_copy']} | "
                  f"{r.get('pdl_us')} | {r.get('pdl_gbps')} | {r.get('lean_us')} | {(pk.get('lean') or [None])[0]} | "
                  f"{r.get('async_us')} | {r['reg_nozx_us']} | {(pk.get('reg') or [None])[0]} | {r['reg_zx_us']} | "
                  f"{r['bulk_nozx_us']} | {r['reg_loads_only_us']} / {r.get('reg_loads_only_pf_us')} | "
                  f"{r['tinygemm_us']} | {r['bf16_us']} | {r['vs_tinygemm']}x | {r['vs_bf16']}x |")
    chain = RESULTS.get("chain")
    if chain:
        print("\nfour matmuls of a decoder layer back to back (µs per layer):")
        print("| model | M | plain µs | GB/s | PDL µs | GB/s | PDL, late trigger µs | lean off: plain µs | PDL µs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in chain:
            print(f"| {r['model']} | {r['m']} | {r['plain_us']} | {r['plain_gbps']} | {r['pdl_us']} | {r['pdl_gbps']} | "
                  f"{r.get('late_pdl_us')} | {r.get('reg_plain_us')} | {r.get('reg_pdl_us')} |")
    tot = RESULTS.get("prefill_totals")
    if tot:
        print("\nprefill, sum of the four 7B layers (µs):")
        print("| path | " + " | ".join(f"M={m}" for m in PREFILL_MS) + " |")
        print("|---|" + "---:|" * len(PREFILL_MS))
        for key, per in tot.items():
            print(f"| {key[:-3]} | " + " | ".join(str(round(per.get(m, float('nan')), 1)) for m in PREFILL_MS) + " |")
    model = RESULTS.get("model")
    if model:
        print("\nwhole model (LLaVA-1.5-7B shape):")
        for r in model["rows"]:
            print(f"  {r.get('impl')} [{r.get('w4a16_launch')}]: ttft {r.get('ttft_ms')} ms, decode {r.get('decode_tok_s')} tok/s, "
                  f"batch {r.get('batch_tok_s')}, copy_frac {r.get('copy_frac')} {r.get('error') or ''}")
    if RESULTS.get("orin_prediction"):
        print("\nAGX Orin (not run; predicted):", json.dumps(RESULTS["orin_prediction"]))


if __name__ == "__main__":
    raise SystemExit(main())
