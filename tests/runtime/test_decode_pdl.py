"""Programmatic dependent launch (PDL) of the fused decode step's Triton kernels, on a machine without a GPU:

* :func:`~edgevlm.runtime.kernels.decode_fused.pdl_ok` says no off CUDA, in Triton's interpreter, with the
  switch off, below sm_90 and with a Triton without grid dependency control; the switch comes from
  ``EDGEVLM_DECODE_PDL``;
* every launch site passes ``USE_GDC`` and ``launch_pdl`` together (fake kernels record the launches);
* the kernels compiled for sm_90 with ``USE_GDC=True`` carry ``griddepcontrol.wait`` then
  ``griddepcontrol.launch_dependents`` before their first global memory access, and neither without it
  (PTX ISA, "griddepcontrol");
* ``bench/decode_step_breakdown.py``'s variant names compose and restore their switches.

Whether PDL pays is measured on the GPU (``bench/decode_step_breakdown.py --variants nomask,nomask_pdlall``)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import pytest

from tests.runtime.test_decode_kernels_compile import _compile
from tests.triton_support import REPO, needs_triton

torch = pytest.importorskip("torch")


@pytest.fixture
def df(monkeypatch):
    from edgevlm.runtime.kernels import decode_fused, pdl

    monkeypatch.setattr(pdl, "_CAPABLE", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pdl.MODE_ENV, raising=False)
    return decode_fused


def test_pdl_ok_is_off_cuda_in_the_interpreter_and_when_switched_off(df, monkeypatch):
    monkeypatch.setattr(df, "PDL", False)
    assert not df.pdl_ok(torch.device("cuda:0"), 1)  # switch off: no CUDA call at all
    monkeypatch.setattr(df, "PDL", True)
    assert not df.pdl_ok(torch.device("cpu"), 1)
    assert not df.pdl_ok("cpu", 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not df.pdl_ok(torch.device("cuda:0"), 1)


def test_pdl_rule_sm90_rows_mode_and_triton_gdc(df, monkeypatch):
    """runtime/kernels/pdl.py's rule, shared by both modules: sm_90+ (cached per device), EDGEVLM_PDL auto (decode
    steps of at most MAX_ROWS rows; never a launch that is not a decode step, rows=None) / on / off; the Triton
    module also needs a Triton with gdc_wait."""
    from edgevlm.runtime.kernels import pdl
    from edgevlm.runtime.kernels import w4a16_mma as mk

    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap["value"])
    monkeypatch.setattr(df, "_triton_has_gdc", lambda: True)
    monkeypatch.setattr(df, "PDL", True)
    monkeypatch.setattr(mk, "PDL", True)
    assert pdl.mode() == "auto" and pdl.MAX_ROWS == 8
    for rows, want in ((1, True), (8, True), (9, False), (32, False), (None, False)):
        assert pdl.allowed("cuda:0", rows) is want, rows
        assert mk.pdl_ok(torch.device("cuda:0"), rows) is want, rows
    assert df.pdl_ok(torch.device("cuda:0"), 8) and not df.pdl_ok(torch.device("cuda:0"), 16)
    monkeypatch.setenv(pdl.MODE_ENV, "on")
    assert pdl.allowed("cuda:0", 32) and pdl.allowed("cuda:0", None) and df.pdl_ok(torch.device("cuda:0"), 32)
    monkeypatch.setenv(pdl.MODE_ENV, "off")
    assert not pdl.allowed("cuda:0", 1) and not df.pdl_ok(torch.device("cuda:0"), 1)
    monkeypatch.setenv(pdl.MODE_ENV, "auto")
    monkeypatch.setattr(pdl, "MAX_ROWS", None)
    assert pdl.allowed("cuda:0", 32)
    monkeypatch.setattr(pdl, "MAX_ROWS", 8)
    monkeypatch.setattr(df, "PDL", False)
    assert not df.pdl_ok(torch.device("cuda:0"), 1)  # the switch is read at each call, the device check cached
    monkeypatch.setattr(df, "PDL", True)
    cap["value"] = (8, 7)
    assert not df.pdl_ok(torch.device("cuda:1"), 1)  # an Orin: no PDL
    assert df.pdl_ok(torch.device("cuda:0"), 1)  # cached per device
    monkeypatch.setattr(df, "_triton_has_gdc", lambda: False)
    assert not df.pdl_ok(torch.device("cuda:0"), 1)
    assert mk.pdl_ok(torch.device("cuda:0"), 1)  # the CUDA kernels do not need Triton


@needs_triton
def test_this_triton_has_gdc():
    from edgevlm.runtime.kernels import decode_fused

    assert decode_fused._triton_has_gdc()  # the dev install's Triton is >= 3.4


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("0", False), ("1", True), ("on", True),
                                                  ("no", False)])
def test_pdl_switch_comes_from_the_environment(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "EDGEVLM_DECODE_PDL"}
    if value is not None:
        env["EDGEVLM_DECODE_PDL"] = value
    script = "from edgevlm.runtime.kernels import decode_fused as d; print(d.PDL, d.ADD_RMS_NORM_WARPS)"
    with tempfile.TemporaryDirectory(prefix="edgevlm-pdl-") as cwd:  # not the repository root (triton_support)
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(expected), "None"]


class _FakeKernel:
    """Records ``kernel[grid](*args, **kwargs)`` launches instead of running them."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, kwargs))


NAMES = ("add_rms_norm_kernel", "rope_kv_kernel", "silu_mul_kernel", "attn_split_kernel", "attn_combine_kernel",
         "rope_attn_kernel")


@pytest.mark.parametrize("use", [False, True])
def test_every_launch_site_passes_use_gdc_and_launch_pdl_together(df, monkeypatch, use):
    log: list = []
    monkeypatch.setattr(df, "_kernels", lambda: tuple(_FakeKernel(n, log) for n in NAMES))
    seen = []
    monkeypatch.setattr(df, "pdl_ok", lambda device, rows: seen.append((device, rows)) or use)
    b, h, hkv, dh, s = 2, 4, 2, 16, 64
    x = torch.randn(b, 32)
    df.add_rms_norm(x, x, torch.ones(32), 1e-6)
    cache = torch.zeros(b, hkv, s, dh)
    qkv = torch.randn(b, (h + 2 * hkv) * dh)
    cos, sin = torch.ones(s, dh), torch.zeros(s, dh)
    pos = torch.full((b,), 40, dtype=torch.int64)
    df.rope_kv_write(qkv, cos, sin, pos, cache, cache.clone(), h, hkv)
    df.silu_mul(torch.randn(b, 64))
    df.gated_act(torch.randn(b, 64), "gelu_pytorch_tanh")
    df.gated_act(torch.randn(b, 64), "silu", interleaved=True)
    df.decode_attention(torch.randn(b, h, 1, dh), cache, cache.clone(), pos, s, block_n=16, cta_budget=1 << 20)
    df.rope_decode_attention(qkv, cos, sin, pos, cache, cache.clone(), h, hkv, s, block_n=16)
    assert [n for n, _ in log] == ["add_rms_norm_kernel", "rope_kv_kernel", "silu_mul_kernel", "silu_mul_kernel",
                                   "silu_mul_kernel", "attn_split_kernel", "attn_combine_kernel", "rope_attn_kernel"]
    assert [kw["INTERLEAVED"] for n, kw in log if n == "silu_mul_kernel"] == [False, False, True]
    assert all(str(d) == "cpu" and r == b for d, r in seen) and len(seen) >= 6  # the rows: the decode batch
    for name, kwargs in log:
        assert kwargs["USE_GDC"] is use, name
        if use:
            assert kwargs["launch_pdl"] is True, name
        else:  # kept out: Triton < 3.4 refuses an unknown launch keyword
            assert "launch_pdl" not in kwargs, name


def test_add_rms_norm_warps_knob(df, monkeypatch):
    log: list = []
    monkeypatch.setattr(df, "_kernels", lambda: tuple(_FakeKernel(n, log) for n in NAMES))
    for d, knob, want in ((4096, None, 16), (5120, None, 16), (2048, None, 4), (4096, 4, 4), (8192, 8, 8)):
        monkeypatch.setattr(df, "ADD_RMS_NORM_WARPS", knob)
        x = torch.randn(1, d)
        df.add_rms_norm(x, x, torch.ones(d), 1e-6)
        assert log[-1][1]["num_warps"] == want


def _signatures(use: bool, act: str = "silu", interleaved: bool = False) -> dict:
    """``name -> (signature, constexprs, num_warps)`` of each decode kernel, bf16 activations, a bf16 cache."""
    gdc = {"USE_GDC": use}
    return {
        "add_rms_norm_kernel": ({
            "x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "wd_ptr": "*bf16", "s_ptr": "*bf16",
            "y_ptr": "*bf16", "D": "i32", "eps": "fp32", "d_eps": "fp32", "BLOCK_D": "constexpr",
            "UNIT_OFFSET": "constexpr", "DELTA_NORM": "constexpr", "USE_GDC": "constexpr"},
            {"BLOCK_D": 4096, "UNIT_OFFSET": False, "DELTA_NORM": False, **gdc}, 8),
        "rope_kv_kernel": ({
            "qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "rpos_ptr": "*i64",
            "qw_ptr": "*fp32", "kw_ptr": "*fp32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "ks_ptr": "*fp32", "vs_ptr": "*fp32", "H": "i32", "HKV": "i32", "S": "i32", "eps": "fp32",
            "HEAD_DIM": "constexpr", "HALF": "constexpr", "QK_NORM": "constexpr", "UNIT_OFFSET": "constexpr",
            "KV_FP8": "constexpr", "USE_GDC": "constexpr"},
            {"HEAD_DIM": 128, "HALF": 64, "QK_NORM": False, "UNIT_OFFSET": False, "KV_FP8": False, **gdc}, 1),
        "silu_mul_kernel": ({
            "gu_ptr": "*bf16", "y_ptr": "*bf16", "INTER": "i32", "BLOCK": "constexpr", "GELU_TANH": "constexpr",
            "INTERLEAVED": "constexpr", "USE_GDC": "constexpr"},
            {"BLOCK": 1024, "GELU_TANH": act != "silu", "INTERLEAVED": interleaved, **gdc}, 4),
        "attn_split_kernel": ({
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
            "pos_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "y_ptr": "*bf16", "H": "i32",
            "HKV": "i32", "S": "i32", "CHUNK": "i32", "scale": "fp32", "WINDOW": "i32", "REP": "constexpr",
            "REP_PAD": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "NSPLIT": "constexpr",
            "HAS_WINDOW": "constexpr", "KV_FP8": "constexpr", "FP8_NATIVE": "constexpr", "USE_GDC": "constexpr"},
            {"REP": 1, "REP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64, "NSPLIT": 16, "HAS_WINDOW": False,
             "KV_FP8": False, "FP8_NATIVE": False, **gdc}, 4),
        "attn_combine_kernel": ({
            "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "y_ptr": "*bf16", "HEAD_DIM": "constexpr",
            "NSPLIT": "constexpr", "USE_GDC": "constexpr"}, {"HEAD_DIM": 128, "NSPLIT": 16, **gdc}, 1),
        "rope_attn_kernel": ({
            "qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "rpos_ptr": "*i64",
            "qw_ptr": "*fp32", "kw_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*fp32",
            "m_ptr": "*fp32", "l_ptr": "*fp32", "cnt_ptr": "*i32", "y_ptr": "*bf16", "H": "i32", "HKV": "i32",
            "S": "i32", "CHUNK": "i32", "scale": "fp32", "eps": "fp32", "REP": "constexpr", "REP_PAD": "constexpr",
            "HEAD_DIM": "constexpr", "HALF": "constexpr", "BLOCK_N": "constexpr", "NSPLIT": "constexpr",
            "QK_NORM": "constexpr", "UNIT_OFFSET": "constexpr", "COMBINE": "constexpr", "USE_GDC": "constexpr"},
            {"REP": 1, "REP_PAD": 16, "HEAD_DIM": 128, "HALF": 64, "BLOCK_N": 64, "NSPLIT": 16, "QK_NORM": False,
             "UNIT_OFFSET": False, "COMBINE": True, **gdc}, 4),
    }


# the first global memory access of a kernel: loads, stores, atomics, reductions, async and bulk copies
_MEMORY = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld\.global|st\.global|atom\.|red\.|cp\.async|cp\.reduce|ld\.shared|"
                     r"st\.shared)", re.M)


@needs_triton
@pytest.mark.parametrize("act,interleaved", [("silu", False), ("gelu_pytorch_tanh", False), ("silu", True),
                                             ("gelu_pytorch_tanh", True)])
def test_kernels_compile_with_and_without_gdc_for_sm90(act, interleaved):
    from edgevlm.runtime.kernels import decode_fused

    kernels = dict(zip(NAMES, decode_fused._kernels(), strict=True))
    # every kernel once; then the gated-activation kernel's other variants (GELU_TANH, INTERLEAVED)
    names = NAMES if (act, interleaved) == ("silu", False) else ("silu_mul_kernel",)
    for use in (True, False):
        sigs = _signatures(use, act, interleaved)
        for name in names:
            sig, consts, warps = sigs[name]
            ptx = _compile(kernels[name], sig, consts, 90, num_warps=warps).asm["ptx"]
            assert ".target sm_90" in ptx
            if not use:
                assert "griddepcontrol" not in ptx, name
                continue
            wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
            first = _MEMORY.search(ptx)
            assert wait >= 0 and launch > wait, name
            assert first is not None and launch < first.start(), (name, ptx[first.start():first.start() + 80])


def _load_bench(name: str, monkeypatch=None, *, register: bool = False):
    """``bench/<name>.py`` as a module; ``monkeypatch``: with ``bench/`` on ``sys.path`` (as when it runs as a
    script); ``register``: in ``sys.modules`` while it runs (a dataclass looks its module up while defined)."""
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _bench_module():
    return _load_bench("decode_step_breakdown", register=True)


@pytest.mark.parametrize("name", ["before", "nomask", "after", "after_pdl", "after_w4head", "nomask_pdl",
                                  "nomask_w4head", "nomask_split16"])
def test_bench_keeps_the_old_variant_names(name):
    v = _bench_module().parse_variant(name)
    assert v.base == name.split("_")[0]
    pdl = name.endswith("_pdl")  # W4A16 PDL on and the Triton kernels plain; without it the library's defaults
    assert v.w4a16_pdl == (True if pdl else None) and v.decode_pdl == (False if pdl else None)
    assert v.norm_warps is None and not v.pdl_all_rows
    assert v.w4head == name.endswith("_w4head") and v.split16 == name.endswith("_split16")


def test_bench_variant_suffixes_compose():
    bench = _bench_module()
    v = bench.parse_variant("nomask_pdlall_norm16")
    assert (v.base, v.w4a16_pdl, v.decode_pdl, v.pdl_all_rows, v.norm_warps, v.w4head, v.split16) == \
        ("nomask", True, True, True, 16, False, False)
    assert bench.parse_variant("after_norm8_pdl") == bench.Variant("after", w4a16_pdl=True, decode_pdl=False,
                                                                   norm_warps=8)
    assert bench.parse_variant("nomask_nopdl") == bench.Variant("nomask", w4a16_pdl=False, decode_pdl=False)
    for bad in ("later", "nomask_pdl2", "nomask_norm12", "nomask_norm8_norm16", "nomask_pdl_pdl", "nomask_",
                "nomask_nopdl_pdlall"):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)


def test_bench_variant_sets_and_restores_the_switches(monkeypatch):
    from edgevlm.runtime.kernels import decode_fused, pdl, w4a16_mma

    bench = _bench_module()
    assert pdl.MAX_ROWS == 8
    monkeypatch.setattr(decode_fused, "PDL", False)
    monkeypatch.setattr(decode_fused, "ADD_RMS_NORM_WARPS", None)
    monkeypatch.setattr(decode_fused, "FUSED_ATTENTION", False)
    monkeypatch.setattr(w4a16_mma, "PDL", False)
    with bench.variant("nomask_pdlall_norm16"):
        assert decode_fused.PDL and w4a16_mma.PDL and decode_fused.ADD_RMS_NORM_WARPS == 16
        assert not decode_fused.FUSED_ATTENTION and pdl.MAX_ROWS is None
    assert not decode_fused.PDL and not w4a16_mma.PDL and decode_fused.ADD_RMS_NORM_WARPS is None
    assert pdl.MAX_ROWS == 8
    with pytest.raises(RuntimeError), bench.variant("after_pdlall_norm8"):  # restored on an error too
        assert decode_fused.FUSED_ATTENTION and decode_fused.ADD_RMS_NORM_WARPS == 8
        raise RuntimeError("capture failed")
    assert not decode_fused.PDL and not w4a16_mma.PDL and decode_fused.ADD_RMS_NORM_WARPS is None
    assert not decode_fused.FUSED_ATTENTION
    with bench.variant("nomask_pdl"):  # _pdl: the W4A16 kernels only
        assert w4a16_mma.PDL and not decode_fused.PDL
    monkeypatch.setattr(decode_fused, "PDL", True)
    monkeypatch.setattr(w4a16_mma, "PDL", True)
    with bench.variant("nomask_nopdl"):
        assert not w4a16_mma.PDL and not decode_fused.PDL
    assert w4a16_mma.PDL and decode_fused.PDL
    monkeypatch.setattr(w4a16_mma, "PDL", False)
    with pytest.raises(ValueError), bench.variant("nomask_bogus"):
        pass
    assert not w4a16_mma.PDL


def test_bench_what_if_variants_skip_the_kernels_and_restore_them():
    """``_nonorm`` passes the residual and the delta on as ``(s, normed)``; ``_noattn`` (the ``after`` base only)
    returns the query heads of ``qkv`` as ``(B, H, 1, Dh)``; both functions are the library's again after."""
    import torch

    from edgevlm.runtime.kernels import decode_fused

    bench = _bench_module()
    norm, attn = decode_fused.add_rms_norm, decode_fused.rope_decode_attention
    x, d = torch.randn(2, 8), torch.randn(2, 8)
    qkv = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 16)  # H = 2, Hkv = 1, Dh = 4: q 8, k 4, v 4
    k_cache = torch.zeros(2, 1, 6, 4)
    with bench.variant("after_nonorm_noattn"):
        s, y = decode_fused.add_rms_norm(x, d, torch.ones(8), 1e-6, unit_offset=False)
        assert s is x and y is d
        q = decode_fused.rope_decode_attention(qkv, None, None, None, k_cache, k_cache, 2, 1, 6, scale=0.5)
        assert q.shape == (2, 2, 1, 4) and torch.equal(q.reshape(2, 8), qkv[:, :8])
    assert decode_fused.add_rms_norm is norm and decode_fused.rope_decode_attention is attn
    assert bench.parse_variant("nomask_nonorm") == bench.Variant("nomask", nonorm=True)
    with pytest.raises(ValueError, match="noattn needs the after base"):
        bench.parse_variant("nomask_noattn")


def test_bench_register_ring_launch_maps_lean_entries(monkeypatch):
    """``_regring`` / ``_loadsonly``: a call the table gives to the lean kernel runs the register ring with the same
    KSPLIT and TILES_PER_CTA and the next compiled DEPTH (8, 3 -> 8, 4), mode 1 or 2; explicit configs, explicit
    modes and register-ring entries pass through."""
    import torch

    from edgevlm.runtime.kernels import w4a16_mma as mk

    bench = _bench_module()
    calls = []

    def launch(x, qw, meta, g, bias=None, config=None, *, mode=None, **kw):
        calls.append((config, mode, sorted(kw)))
        return "y"

    table = {(1, 12288, 4096): ("lean", 8, 3, 2), (1, 4096, 4096): ("reg", 8, 2, 1)}
    monkeypatch.setattr(mk, "mma_config", lambda m, n, k, g, **kw: table[(m, n, k)])
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    qkv = torch.zeros(12288 // 16, 4096 // 64, 32, 4, dtype=torch.int32)
    o = torch.zeros(4096 // 16, 4096 // 64, 32, 4, dtype=torch.int32)
    loads = bench.register_ring_launch(launch, loads_only=True)
    assert loads(x, qkv, None, 128, pdl=True, late_trigger=True) == "y"
    assert calls[-1] == (("reg", 8, 4, 2), 1, ["pdl"])
    bench.register_ring_launch(launch, loads_only=False)(x, qkv, None, 128, pdl=True)
    assert calls[-1] == (("reg", 8, 4, 2), 2, ["pdl"])
    loads(x, o, None, 128, pdl=False)  # the table's register-ring entry: unchanged
    assert calls[-1] == (None, None, ["pdl"])
    loads(x, qkv, None, 128, config=("lean", 4, 2, 1))  # an explicit config: unchanged
    assert calls[-1] == (("lean", 4, 2, 1), None, [])
    with pytest.raises(ValueError, match="exclude each other"):
        bench.parse_variant("nomask_regring_loadsonly")


def test_w4a16_bench_loads_the_breakdown_module(monkeypatch):
    """bench/w4a16_kernel.py's model section loads decode_step_breakdown by path (its ``variant`` switches); the
    module defines a dataclass, which needs the module registered before it runs (it failed on the H200 on 12-02,
    session 11, before the loader did)."""
    bench = _load_bench("w4a16_kernel", monkeypatch)  # not registered: its own loader must do it
    bd = bench.breakdown()
    assert callable(bd.variant) and bd is bench.breakdown()


def test_pdl_check_settings_parse(monkeypatch):
    """bench/decode_pdl_check.py's settings: none, w4, triton and single Triton kernels joined by '+'."""
    mod = _load_bench("decode_pdl_check", monkeypatch)
    assert mod.parse_setting("none") == (False, frozenset(), False, None)
    assert mod.parse_setting("w4") == (True, frozenset(), False, None)
    assert mod.parse_setting("triton") == (False, None, True, None)
    assert mod.parse_setting("w4+triton") == (True, None, True, None)
    assert mod.parse_setting("w4+le16+triton") == (True, None, True, 16)
    assert mod.parse_setting("le8+w4+triton") == (True, None, True, 8)
    assert mod.parse_setting("w4+rope_kv+attn_split") == (True, frozenset({"rope_kv", "attn_split"}), True, None)
    for bad in ("w5", "w4+w4", "", "triton+bogus", "w4+le8+le16", "w4le16"):
        with pytest.raises(ValueError):
            mod.parse_setting(bad)
    assert mod.main(["--settings", "w4+nope"]) == 2


def test_pdl_kernels_knob_picks_the_launches(df, monkeypatch):
    monkeypatch.setattr(df, "PDL_KERNELS", frozenset({"rope_kv"}))
    assert df._gdc_launch(True, "rope_kv") == {"USE_GDC": True, "launch_pdl": True}
    assert df._gdc_launch(True, "attn_split") == {"USE_GDC": False}
    assert df._gdc_launch(False, "rope_kv") == {"USE_GDC": False}
    monkeypatch.setattr(df, "PDL_KERNELS", None)
    assert df._gdc_launch(True, "attn_split") == {"USE_GDC": True, "launch_pdl": True}
