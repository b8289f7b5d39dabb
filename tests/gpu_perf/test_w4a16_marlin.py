"""The tensor-core W4A16 kernel (issue 15): its INT4 layout, its arithmetic in PyTorch, the dispatch in
``Int4Linear`` and its fallback log line on CPU; the CUDA kernel itself where a GPU is present (speed is
bench/w4a16_marlin.py's)."""

from __future__ import annotations

import importlib.util
import logging

import pytest

torch = pytest.importorskip("torch")

from edgevlm.runtime import int4  # noqa: E402
from edgevlm.runtime.int4_format import (  # noqa: E402
    dequantize_int4,
    pack_int4,
    quantize_int4,
    repack_int4_mma,
    unpack_int4,
    unpack_int4_mma,
)
from edgevlm.runtime.kernels import w4a16_mma as mk  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("n", "k", "g"), [(16, 128, 128), (48, 384, 128), (32, 192, 64), (64, 256, 64)])
def test_repack_round_trip_is_exact(n, k, g):
    gen = torch.Generator().manual_seed(n + k + g)
    qw = quantize_int4(torch.randn(n, k, generator=gen), g)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (n // 16, k // 64, 32, 4)
    assert meta.dtype == torch.int32 and tuple(meta.shape) == (n // 16, k // g, 16)
    back = unpack_int4_mma(packed, meta, g)
    assert torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.scales, qw.scales)
    assert torch.equal(back.zeros, qw.zeros)


def test_repack_places_each_nibble_where_the_fragment_tables_say():
    """Word j of lane L (g = L // 4, t = L % 4), nibble p = 4e + 2h + rb holds
    q[16 nt + 8 rb + g, 64 kb + 16 t + 4 j + 2 h + e] (the documented layout, checked element by element)."""
    n, k, g = 32, 128, 64
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    packed, _ = repack_int4_mma(qweight, torch.ones(n, k // g, dtype=torch.float16),
                                torch.zeros(n, k // g, dtype=torch.uint8), g)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for nt in range(n // 16):
        for kb in range(k // 64):
            for lane in range(32):
                gg, t = lane // 4, lane % 4
                for j in range(4):
                    w = int(words[nt, kb, lane, j])
                    for p in range(8):
                        e, h, rb = p >> 2, (p >> 1) & 1, p & 1
                        assert (w >> (4 * p)) & 0xF == int(codes[16 * nt + 8 * rb + gg, 64 * kb + 16 * t + 4 * j + 2 * h + e])


def test_repack_rejects_shapes_the_layout_cannot_hold():
    qw = quantize_int4(torch.randn(24, 256), 128)
    with pytest.raises(ValueError, match="out_features % 16"):
        repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)
    qw = quantize_int4(torch.randn(16, 256), 32)
    with pytest.raises(ValueError, match="group_size in"):
        repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 32)


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize(("g", "dtype"), [(128, torch.bfloat16), (64, torch.float16)])
def test_reference_math_on_the_layout_matches_the_dequantized_matmul(m, g, dtype):
    gen = torch.Generator().manual_seed(m * g)
    n, k = 48, 512
    qw = quantize_int4(torch.randn(n, k, generator=gen), g)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    ref = x.double() @ dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64).T + bias.double()
    y = mk.w4a16_mma_reference(x, packed, meta, g, bias)
    assert _rel(y, ref) < 1e-12
    # float32 (the kernel's accumulator type) stays far inside the 3e-3 budget
    assert _rel(mk.w4a16_mma_reference(x, packed, meta, g, bias, compute=torch.float32), ref) < 1e-5
    # a wrong layout reading is caught: swapping two lanes' words changes the result
    broken = packed.clone()
    broken[:, :, [0, 5]] = broken[:, :, [5, 0]]
    assert _rel(mk.w4a16_mma_reference(x, broken, meta, g, bias), ref) > 1e-3


def test_wrapper_rejects_bad_arguments():
    qw = quantize_int4(torch.randn(32, 256), 128)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        mk.w4a16_mma(torch.randn(33, 256).bfloat16(), packed, meta, 128)
    with pytest.raises(ValueError, match="register-ring kernel serves M <= 16"):
        mk.w4a16_mma(torch.randn(17, 256).bfloat16(), packed, meta, 128, config=("reg", 8, 2, 1))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mk.w4a16_mma(torch.randn(1, 256), packed, meta, 128)
    with pytest.raises(ValueError, match=r"x must be \(M, 256\)"):
        mk.w4a16_mma(torch.randn(1, 128).bfloat16(), packed, meta, 128)
    with pytest.raises(ValueError, match="meta must be"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta[:, :1].contiguous(), 128)
    with pytest.raises(ValueError, match="config must be"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta, 128, config=(3, 4, 1))
    with pytest.raises(ValueError, match="config must be"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta, 128, config=("bulk", 8, 2, 1))
    with pytest.raises(ValueError, match="mode must be"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta, 128, config=("bulk", 8, 4, 1), mode=1)
    with pytest.raises(mk.MmaKernelUnavailable, match="CUDA"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta, 128, config=(8, 4, 1))


def test_launch_config_comes_from_the_sweep_table():
    assert mk.mma_config(1, 16, 128, 128) == ("reg", *mk.DEFAULT_CONFIG)  # an untuned shape, no sm_90
    assert mk.mma_config(24, 16, 128, 128) == ("bulk", *mk.DEFAULT_BULK_CONFIG)  # M > 16: the bulk variant
    table = mk.tuned_configs()
    assert "4096x11008g128" in table  # the H200 sweep's file ships with the package
    for row in table.values():
        for kind, a, b, tpc in row.values():
            pairs = {"reg": mk.MMA_CONFIGS, "bulk": mk.BULK_CONFIGS, "lean": mk.LEAN_CONFIGS,
                     "async": mk.ASYNC_CONFIGS}[kind]
            assert (a, b) in pairs and tpc >= 1
    cfg = table["4096x11008g128"]["1"]
    assert mk.mma_config(1, 4096, 11008, 128, bulk=True, lean=True) == cfg
    if cfg[0] == "bulk":  # a GPU without the bulk variant gets the register ring instead
        assert mk.mma_config(1, 4096, 11008, 128, bulk=False)[0] == "reg"
    if cfg[0] in ("lean", "async"):  # a build without the lean variant gets the sweep's fastest other entry
        assert mk.mma_config(1, 4096, 11008, 128, bulk=True, lean=False)[0] in ("reg", "bulk")
    for key, row in mk._table()[3].items():  # fallbacks stand only beside lean / async entries
        for bucket, fb in row.items():
            assert table[key][bucket][0] in ("lean", "async") and fb[0] in ("reg", "bulk")
    for key, row in table.items():  # and every such entry has one: a build without it keeps measured choices
        for bucket, cfg in row.items():
            if cfg[0] in ("lean", "async"):
                assert bucket in mk._table()[3].get(key, {}), (key, bucket)


def test_table_entries_parse_in_both_formats():
    assert mk._parse_config([8, 2, 2]) == ("reg", 8, 2, 2)  # layout-version-1 tables: the register ring
    assert mk._parse_config(["bulk", 8, 8, 1]) == ("bulk", 8, 8, 1)
    assert mk._parse_config(["reg", 16, 4, 1]) == ("reg", 16, 4, 1)
    assert mk._parse_config(["reg", 16, 4, 1, 1]) == ("reg", 16, 4, 1)  # + the x-sum fold flag (zx_fold)
    assert mk._parse_config(["lean", 8, 3, 1, 0, 0]) == ("lean", 8, 3, 1)
    assert mk._parse_config(["async", 4, 8, 1, 0, 0]) == ("async", 4, 8, 1)
    for bad in ([3, 4, 1], ["bulk", 8, 2, 1], ["warp", 8, 8, 1], [8, 2, 0], [8, "x", 1], 7, ["lean", 8, 8, 1],
                ["async", 8, 3, 1]):
        assert mk._parse_config(bad) is None


def test_async_ring_entries_need_the_lean_build_and_fall_back(monkeypatch):
    """The cp.async ring ("async") is compiled into the lean kernel: its table entries are used where the lean
    build is, else the table's fallback entry (the fastest register-ring / bulk configuration), else the register
    ring with the same (KSPLIT, DEPTH) where it has that pair."""
    table = {"64x128g128": {"1": ("async", 4, 8, 1), "8": ("async", 8, 8, 2), "16": ("async", 16, 2, 1)}}
    monkeypatch.setattr(mk, "tuned_configs", lambda: table)
    monkeypatch.setattr(mk, "_table", lambda: (table, {}, {}, {"64x128g128": {"8": ("bulk", 8, 4, 1, False, 0)}}))
    assert mk.mma_config(1, 64, 128, 128, lean=True) == ("async", 4, 8, 1)
    assert mk.mma_config(1, 64, 128, 128) == ("reg", 4, 8, 1)  # the register ring has (4, 8)
    assert mk.mma_config(8, 64, 128, 128, bulk=True) == ("bulk", 8, 4, 1)  # the measured fallback
    assert mk.mma_config(16, 64, 128, 128) == ("reg", 16, 2, 1)
    _check_lean_kind_errors(("async", 4, 8, 1), mode=0)
    with pytest.raises(ValueError, match="config must be"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), *_small_packed(), 128, config=("async", 4, 2, 1))


def _small_packed() -> tuple:
    qw = quantize_int4(torch.randn(32, 256), 128)
    return repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)


def _check_lean_kind_errors(config: tuple, mode: int) -> None:
    """The lean kernel's kinds refuse the x-sum fold / loads-only modes and more than 16 rows (before any launch)."""
    packed, meta = _small_packed()
    with pytest.raises(ValueError, match="mode must be 2"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta, 128, config=config, mode=mode)
    with pytest.raises(ValueError, match="serves M <= 16"):
        mk.w4a16_mma(torch.randn(17, 256).bfloat16(), packed, meta, 128, config=config)


def test_lean_variant_is_the_default_and_its_table_entries_fall_back(monkeypatch):
    monkeypatch.delenv(mk.LEAN_ENV, raising=False)
    assert mk.lean_build()  # built and used by default since the 2026-12-02 H200 run
    for off in ("0", "false", "off"):
        monkeypatch.setenv(mk.LEAN_ENV, off)
        assert not mk.lean_build()
    monkeypatch.setenv(mk.LEAN_ENV, "1")
    assert mk.lean_build()
    table = {"64x128g128": {"1": ("lean", 16, 2, 1), "8": ("lean", 8, 3, 2)}}
    monkeypatch.setattr(mk, "tuned_configs", lambda: table)
    assert mk.mma_config(1, 64, 128, 128, lean=True) == ("lean", 16, 2, 1)
    assert mk.mma_config(1, 64, 128, 128) == ("reg", 16, 2, 1)  # not built here: the same schedule
    assert mk.mma_config(8, 64, 128, 128) == ("reg", *mk.DEFAULT_CONFIG)  # DEPTH 3 has no register-ring twin
    _check_lean_kind_errors(("lean", 8, 2, 1), mode=1)


def test_lean_late_trigger_is_built_for_sm90_and_newer(monkeypatch):
    """The lean variant's late PDL trigger (after the last ring refill; a separately named build) is compiled by
    default for sm_90+ (the GPUs with PDL), not for an Orin (sm_87) or an unknown arch; EDGEVLM_W4A16_LEAN_TRIGGER
    forces it either way; never without the lean variant."""
    monkeypatch.delenv(mk.LEAN_ENV, raising=False)
    monkeypatch.delenv(mk.LEAN_TRIGGER_ENV, raising=False)
    assert mk.lean_trigger_build("9.0") and mk.lean_trigger_build("10.0")
    assert not mk.lean_trigger_build("8.7") and not mk.lean_trigger_build(None) and not mk.lean_trigger_build("x")
    monkeypatch.setenv(mk.LEAN_TRIGGER_ENV, "1")
    assert mk.lean_trigger_build("8.7") and mk.lean_trigger_build()
    monkeypatch.setenv(mk.LEAN_TRIGGER_ENV, "0")
    assert not mk.lean_trigger_build("9.0")
    monkeypatch.setenv(mk.LEAN_TRIGGER_ENV, "1")
    monkeypatch.setenv(mk.LEAN_ENV, "0")
    assert not mk.lean_trigger_build("9.0")
    assert mk._build_flags(False, True) == ("", [])
    assert mk._build_flags(True, False) == ("_lean", ["-DEDGEVLM_W4A16_LEAN"])
    assert mk._build_flags(True, True) == ("_lean_lt", ["-DEDGEVLM_W4A16_LEAN", "-DEDGEVLM_W4A16_LEAN_TRIGGER"])


def test_lean_table_entries_fall_back_to_the_sweeps_best_other_entry(monkeypatch, tmp_path):
    """A table whose entry names the lean variant carries the sweep's fastest register-ring / bulk entry as
    ``fallback``: a build without the lean variant (or ``EDGEVLM_W4A16_LEAN=0``) runs that one."""
    import json

    table = {"configs": {"64x128g128": {"1": ["lean", 8, 3, 2, 0, 0], "8": ["lean", 16, 2, 1, 0, 0],
                                        "16": ["lean", 8, 3, 1, 0, 0], "32": ["bulk", 8, 4, 1, 0, 0]}},
             "fallback": {"64x128g128": {"1": ["reg", 4, 4, 2, 1, 1], "8": ["bulk", 8, 8, 1, 0, 0],
                                         "16": ["lean", 8, 2, 1, 0, 0]}}}
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(mk, "CONFIGS_FILE", path)
    mk._table.cache_clear()
    try:
        assert mk.mma_config(1, 64, 128, 128, lean=True) == ("lean", 8, 3, 2)
        assert mk._choice(1, 64, 128, 128, False, True) == (("lean", 8, 3, 2), None, None)
        assert mk.mma_config(1, 64, 128, 128) == ("reg", 4, 4, 2)  # the fallback, its zx and pf too
        assert mk._choice(1, 64, 128, 128, False, False) == (("reg", 4, 4, 2), True, 1)
        assert mk.mma_config(8, 64, 128, 128, bulk=True) == ("bulk", 8, 8, 1)
        # a bulk fallback where bulk is not usable: the same schedule on the register ring (lean (16, 2))
        assert mk.mma_config(8, 64, 128, 128) == ("reg", 16, 2, 1)
        # a lean fallback is ignored (malformed for this purpose); (8, 3) has no register-ring twin
        assert mk.mma_config(16, 64, 128, 128) == ("reg", *mk.DEFAULT_CONFIG)
        assert mk.mma_config(32, 64, 128, 128, bulk=True) == ("bulk", 8, 4, 1)
    finally:
        monkeypatch.undo()
        mk._table.cache_clear()


def test_prefetch_distance_and_pdl_switches():
    assert mk._parse_config(["reg", 8, 2, 2, 0, 2]) == ("reg", 8, 2, 2)  # + the L2 prefetch distance
    assert mk.prefetch_tiles(1, 16, 128, 128) == mk.PF_DEFAULT  # an untuned shape
    for key, row in mk._table()[2].items():  # measured choices, where the table has them
        n, k = (int(v) for v in key.split("g")[0].split("x"))
        for bucket, pf in row.items():
            assert pf >= 0 and mk.prefetch_tiles(int(bucket), n, k, 128) == pf
    assert not mk.pdl_ok(torch.device("cpu"), 1)
    qw = quantize_int4(torch.randn(32, 256), 128)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match="prefetch must be"):
        mk.w4a16_mma(torch.randn(1, 256).bfloat16(), packed, meta, 128, config=(8, 2, 1), prefetch=-1)


def test_pdl_switch_is_on_unless_turned_off():
    """The W4A16 kernels' PDL switch is on by default since session 11 (with the decode step's Triton kernels also
    programmatic dependents the H200 step gained 8 % at batch 1; where PDL applies is runtime/kernels/pdl.py's
    rule) and EDGEVLM_W4A16_PDL=0 turns it off. Read at import, so each setting runs in a fresh interpreter."""
    import os
    import subprocess
    import sys
    import tempfile

    code = "from edgevlm.runtime.kernels import w4a16_mma as mk; print(int(mk.PDL))"
    seen = {}
    for value in (None, "0", "1", "on", "no"):
        env = {k: v for k, v in os.environ.items() if k != "EDGEVLM_W4A16_PDL"}
        if value is not None:
            env["EDGEVLM_W4A16_PDL"] = value
        with tempfile.TemporaryDirectory() as cwd:  # not the repo root: its edgevlm/ folder would hide the package
            out = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                                 timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[value] = out.stdout.strip().splitlines()[-1]
    assert seen == {None: "1", "0": "0", "1": "1", "on": "1", "no": "0"}


def test_zx_fold_only_at_small_m():
    assert mk.zx_fold(1, 16, 128, 128) is mk.ZX_DEFAULT  # an untuned shape
    for key, row in mk._table()[1].items():  # measured choices, where the table has them
        n, k = (int(v) for v in key.split("g")[0].split("x"))
        for bucket, zx in row.items():
            assert mk.zx_fold(int(bucket), n, k, 128) == (zx and int(bucket) <= 4)
    assert not mk.zx_fold(8, 4096, 11008, 128)


def test_dequant_wrapper_rejects_bad_arguments():
    qw = quantize_int4(torch.randn(32, 256), 128)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mk.w4a16_dequant(qw.qweight, qw.scales, qw.zeros, 128, torch.float32)
    with pytest.raises(ValueError, match="outside the weight"):
        mk.w4a16_dequant(qw.qweight, qw.scales, qw.zeros, 128, row0=16, rows=32)
    with pytest.raises(mk.MmaKernelUnavailable, match="CUDA"):
        mk.w4a16_dequant(qw.qweight, qw.scales, qw.zeros, 128)


def test_cpu_falls_back_with_one_log_line(caplog, monkeypatch):
    monkeypatch.setattr(int4, "_MMA_FALLBACK_LOGGED", set())
    mod = int4.Int4Linear.from_linear(torch.nn.Linear(256, 32), 128)
    x = torch.randn(2, 256)
    ref = x.double() @ mod.dequantized_weight(torch.float64).T + mod.bias.double()
    with caplog.at_level(logging.INFO, logger="edgevlm.runtime.int4"):
        for kernel in ("auto", "mma"):
            int4.set_int4_kernel(mod, kernel)
            assert mod.execution_path(2, torch.device("cpu")) != "mma"
            assert _rel(mod(x), ref) < 1e-2
    lines = [r for r in caplog.records if "tensor-core kernel unavailable" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "cpu" in lines[0].getMessage() and "tinygemm" in lines[0].getMessage()


def test_env_switch_disables_the_kernel(monkeypatch, caplog):
    monkeypatch.setattr(int4, "_MMA_FALLBACK_LOGGED", set())
    monkeypatch.setenv("EDGEVLM_W4A16_MMA", "0")
    with caplog.at_level(logging.INFO, logger="edgevlm.runtime.int4"):
        assert not int4.mma_kernel_ok(torch.device("cpu"), 32, 256, 128)
    assert any("EDGEVLM_W4A16_MMA=0" in r.getMessage() for r in caplog.records)
    # a layer the layout cannot hold is refused without a log line (the kernel may serve others)
    caplog.clear()
    assert not int4.mma_kernel_ok(torch.device("cpu"), 24, 256, 128)
    assert not caplog.records


@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize(("g", "dtype"), [(128, torch.bfloat16), (64, torch.bfloat16), (128, torch.float16)])
def test_cuda_kernel_matches_float64_and_is_bit_stable(m, g, dtype):
    if mk.mma_status("cuda") is not None:
        pytest.skip(f"kernel unavailable: {mk.mma_status('cuda')}")
    gen = torch.Generator(device="cuda").manual_seed(m * g)
    n, k = 1024, 2048
    qw = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.02, g)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen)
    ref = x.double() @ dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64).T + bias.double()
    # (mode, L2 prefetch distance, PDL): the x-sum fold; prefetch of the whole range / one and two tiles
    # ahead of a 3-tile CTA (the rolling path); programmatic dependent launch (a no-op before sm_90)
    for cfg in [(*kd, tpc) for kd in mk.MMA_CONFIGS for tpc in (1, 3)]:
        for mode, pf, pdl in ((0, 0, False), (2, 0, False), (2, 1, True), (2, 2, False)):
            outs = []
            for _ in range(2):
                poison = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                del poison  # the kernel's output block: an unwritten element stays NaN
                outs.append(mk.w4a16_mma(x, packed, meta, g, bias, config=cfg, mode=mode, prefetch=pf, pdl=pdl))
            assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[1]).all(), (cfg, mode, pf)
            assert _rel(outs[0], ref) <= 3e-3, (cfg, mode, pf)
            assert torch.equal(outs[0], outs[1]), (cfg, mode, pf)
            if mode == 2 and pf == 0:
                plain = outs[0]
            elif mode == 2:  # prefetch and PDL change when bytes arrive, not the arithmetic
                assert torch.equal(outs[0], plain), (cfg, pf, pdl)
    # the PyTorch reference of the layout agrees with the kernel to fp32/bf16 rounding
    ref_layout = mk.w4a16_mma_reference(x.cpu(), packed.cpu(), meta.cpu(), g, bias.cpu())
    assert _rel(outs[0].cpu(), ref_layout) <= 3e-3


@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32])
@pytest.mark.parametrize(("g", "dtype"), [(128, torch.bfloat16), (64, torch.bfloat16), (128, torch.float16)])
def test_cuda_bulk_kernel_matches_float64_and_is_bit_stable(m, g, dtype):
    if mk.mma_status("cuda", "bulk") is not None:
        pytest.skip(f"bulk variant unavailable: {mk.mma_status('cuda', 'bulk')}")
    gen = torch.Generator(device="cuda").manual_seed(m * g + 1)
    n, k = 1024, 2048
    qw = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.02, g)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen)
    ref = x.double() @ dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64).T + bias.double()
    for cfg in [("bulk", *ws, tpc) for ws in mk.BULK_CONFIGS for tpc in (1, 3)]:
        for mode in (0, 2):  # with and without the x-sum zero-point fold (M <= 4)
            outs = [mk.w4a16_mma(x, packed, meta, g, bias, config=cfg, mode=mode, pdl=pdl) for pdl in (False, True)]
            assert torch.isfinite(outs[0]).all()
            assert _rel(outs[0], ref) <= 3e-3, (cfg, mode)
            assert torch.equal(outs[0], outs[1]), (cfg, mode)


_LEAN_KINDS = [("lean", *p) for p in mk.LEAN_CONFIGS] + [("async", *p) for p in mk.ASYNC_CONFIGS]


@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 9, 16])
@pytest.mark.parametrize(("g", "dtype"), [(128, torch.bfloat16), (64, torch.float16)])
def test_cuda_lean_kernel_is_bit_identical_to_the_register_ring(m, g, dtype):
    """The lean variant (the default build; EDGEVLM_W4A16_LEAN=0 leaves it out) and its cp.async ring compute the
    register ring's function in the same order: bit-identical to it at the same KSPLIT, within 3e-3 of float64,
    every element written."""
    if mk.mma_status("cuda", "lean") is not None:
        pytest.skip(f"lean variant unavailable: {mk.mma_status('cuda', 'lean')}")
    assert mk.mma_status("cuda", "async") is None
    gen = torch.Generator(device="cuda").manual_seed(m * g + 5)
    n, k = 1024, 2048 + 64 * (g == 64)  # an uneven split of the groups over the warps too
    qw = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.02, g)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen)
    ref = x.double() @ dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64).T + bias.double()
    for kind, ks, depth in _LEAN_KINDS:
        for tpc in (1, 3):
            for pdl in (False, True):
                poison = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                del poison
                y = mk.w4a16_mma(x, packed, meta, g, bias, config=(kind, ks, depth, tpc), pdl=pdl)
                assert torch.isfinite(y).all(), (ks, depth, tpc)
                assert _rel(y, ref) <= 3e-3, (ks, depth, tpc)
                twin = mk.w4a16_mma(x, packed, meta, g, bias, config=("reg", ks, 2, tpc), mode=2)
                assert torch.equal(y, twin), (ks, depth, tpc, pdl)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize(("g", "dtype"), [(128, torch.bfloat16), (64, torch.bfloat16), (128, torch.float16),
                                          (64, torch.float16)])
def test_cuda_lean_kernel_at_extreme_zero_points_and_offset_activations(m, g, dtype):
    """Zero points at 0 and 15 (and all between), codes at both ends, activations with a large common offset (the
    case that stresses any zero-point fold: sum_k x large against sum_k (q - zero) x; a fold through a second mma
    was measured on the H200 on 12-02 and reverted, bench/results/w4a16_kernel_h200_20261202.md, session 8). The
    lean kernel: within 3e-3 of float64 at every (KSPLIT, DEPTH), bit-identical to the register ring and across
    runs."""
    if mk.mma_status("cuda", "lean") is not None:
        pytest.skip(f"lean variant unavailable: {mk.mma_status('cuda', 'lean')}")
    gen = torch.Generator(device="cuda").manual_seed(1000 + m * g)
    n, k = 512, 2048
    codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
    codes[:, ::7] = 15
    codes[:, 3::7] = 0
    zeros = torch.randint(0, 16, (n, k // g), device="cuda", generator=gen, dtype=torch.uint8)
    zeros[::3, ::2] = 0
    zeros[1::3, 1::2] = 15
    scales = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.004 + 0.0005).to(torch.float16)
    packed, meta = repack_int4_mma(pack_int4(codes), scales, zeros, g)
    x = (torch.randn(m, k, device="cuda", generator=gen) * 0.5 + 2.0).to(dtype)
    x[m // 2] = -x[m // 2]  # one row with a large negative offset
    ref = x.double() @ dequantize_int4(pack_int4(codes), scales, zeros, g, torch.float64).T
    for kind, ks, depth in _LEAN_KINDS:
        y = mk.w4a16_mma(x, packed, meta, g, config=(kind, ks, depth, 1))
        assert torch.isfinite(y).all(), (ks, depth)
        assert _rel(y, ref) <= 3e-3, (ks, depth, _rel(y, ref))
        assert torch.equal(y, mk.w4a16_mma(x, packed, meta, g, config=(kind, ks, depth, 1))), (ks, depth)
        assert torch.equal(y, mk.w4a16_mma(x, packed, meta, g, config=("reg", ks, 2, 1), mode=2)), (ks, depth)


@needs_cuda
@pytest.mark.parametrize("m", [1, 9, 16])
def test_cuda_lean_late_trigger_gives_the_same_outputs_and_keeps_the_dependency(m):
    """The late PDL trigger (built by default for sm_90+, EDGEVLM_W4A16_LEAN_TRIGGER=1 elsewhere) moves only when the next kernel may start:
    every lean configuration gives the bit-identical output with it, NaN-poisoned outputs are all written, and a
    chain whose every call reads the previous call's output (plain torch kernels between some) is bit-equal to
    ordinary launches, eagerly and in a CUDA graph."""
    if mk.mma_status("cuda", "lean") is not None:
        pytest.skip(f"lean variant unavailable: {mk.mma_status('cuda', 'lean')}")
    if not getattr(mk.load_extension("cuda"), "lean_late_trigger", False):
        pytest.skip(f"built without the late trigger ({mk.LEAN_TRIGGER_ENV}=1 builds it)")
    gen = torch.Generator(device="cuda").manual_seed(m + 21)
    n = k = 1024
    qw = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.05, 128)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    for ks, depth in mk.LEAN_CONFIGS:
        for tpc in (1, 3):
            cfg = ("lean", ks, depth, tpc)
            ref = mk.w4a16_mma(x, packed, meta, 128, config=cfg, pdl=False, late_trigger=False)
            for pdl in (False, True):
                poison = torch.full((m, n), float("nan"), device="cuda", dtype=x.dtype)
                del poison
                y = mk.w4a16_mma(x, packed, meta, 128, config=cfg, pdl=pdl, late_trigger=True)
                assert torch.isfinite(y).all() and torch.equal(y, ref), (cfg, pdl)

    def chain(late):
        y = x
        for i in range(6):
            cfg = ("lean", *mk.LEAN_CONFIGS[i % len(mk.LEAN_CONFIGS)], 1 + i % 2)
            y = mk.w4a16_mma(y, packed, meta, 128, config=cfg, pdl=late is not None, late_trigger=bool(late))
            y = mk.w4a16_mma(y, packed, meta, 128, config=cfg, pdl=late is not None, late_trigger=bool(late))
            y = y / y.float().norm(dim=1, keepdim=True).to(y.dtype) * 32  # plain torch kernels between
        return y

    plain = chain(None)
    assert torch.isfinite(plain).all()
    assert torch.equal(chain(True), plain)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 16, 32])
def test_pdl_chain_reads_the_previous_output(m):
    """Each call's input is the previous call's output (with a plain torch kernel between some): launched as
    programmatic dependents, eagerly and in a CUDA graph, the chain gives bit-for-bit the plain result."""
    if mk.mma_status("cuda") is not None:
        pytest.skip(f"kernel unavailable: {mk.mma_status('cuda')}")
    if m > mk.max_rows("cuda"):
        pytest.skip("M > the kernel's rows here")
    gen = torch.Generator(device="cuda").manual_seed(m + 7)
    n = k = 1024
    qw = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.05, 128)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, 128)
    x0 = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)

    def chain(pdl):
        y = x0
        for _ in range(6):
            y = mk.w4a16_mma(y, packed, meta, 128, pdl=pdl, prefetch=1)
            y = mk.w4a16_mma(y, packed, meta, 128, pdl=pdl)  # a PDL kernel right after a PDL kernel
            y = y / y.float().norm(dim=1, keepdim=True).to(y.dtype) * 32  # plain torch kernels between
        return y

    ref = chain(False)
    assert torch.isfinite(ref).all()
    assert torch.equal(chain(True), ref)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


@needs_cuda
@pytest.mark.parametrize(("g", "dtype"), [(128, torch.bfloat16), (64, torch.float16), (32, torch.bfloat16)])
def test_cuda_dequant_is_bit_identical_to_the_reference(g, dtype):
    if mk.mma_status("cuda") is not None:
        pytest.skip(f"kernel unavailable: {mk.mma_status('cuda')}")
    qw = quantize_int4(torch.randn(96, 512, device="cuda") * 0.02, g)
    ref = dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, dtype)
    assert torch.equal(mk.w4a16_dequant(qw.qweight, qw.scales, qw.zeros, g, dtype), ref)
    buf = torch.full((64 * 512 + 7,), float("nan"), device="cuda", dtype=dtype)
    part = mk.w4a16_dequant(qw.qweight, qw.scales, qw.zeros, g, dtype, row0=16, rows=64, out=buf)
    assert torch.equal(part, ref[16:80])


@needs_cuda
@pytest.mark.parametrize("chunk_bytes", [0, 64 * 1024])
def test_int4linear_prefill_uses_the_cuda_dequantizer(monkeypatch, chunk_bytes):
    if mk.mma_status("cuda") is not None:
        pytest.skip(f"kernel unavailable: {mk.mma_status('cuda')}")
    monkeypatch.setattr(int4, "PREFILL_CHUNK_BYTES", chunk_bytes)
    lin = torch.nn.Linear(1024, 1040, device="cuda", dtype=torch.bfloat16)
    mod = int4.Int4Linear.from_linear(lin, 128)
    dev = torch.device("cuda")
    assert mod.execution_path(600, dev) == "cuda_dequant"
    x = torch.randn(600, 1024, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ mod.dequantized_weight(torch.float64).T + mod.bias.double()
    y = mod(x)
    assert y.shape == (600, 1040) and torch.isfinite(y).all()
    assert _rel(y, ref) <= 3e-3
    y32 = mod(x.float())  # float32 activations: the dense reference path, float32 out
    assert y32.dtype == torch.float32 and _rel(y32, x.double() @ mod.dequantized_weight(torch.float64).T
                                                + mod.bias.double()) <= 1e-4


@needs_cuda
def test_int4linear_uses_the_kernel_for_decode_on_cuda():
    if mk.mma_status("cuda") is not None:
        pytest.skip(f"kernel unavailable: {mk.mma_status('cuda')}")
    lin = torch.nn.Linear(2048, 1024, device="cuda", dtype=torch.bfloat16)
    mod = int4.Int4Linear.from_linear(lin, 128)
    dev = torch.device("cuda")
    top = int4.mma_max_rows(dev)
    assert top in (16, 32)
    most = int4.MMA_MAX_CALLS * top  # row blocks of <= top rows, one launch each
    assert {mod.execution_path(m, dev) for m in (1, 16, top, top + 1, most)} == {"mma"}
    assert mod.execution_path(most + 1, dev) == "cuda_dequant"
    for m in (top + 5, most):  # the row-block split gives the same function
        xs = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        ref_s = xs.double() @ mod.dequantized_weight(torch.float64).T + mod.bias.double()
        assert _rel(mod(xs), ref_s) <= 3e-3
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ mod.dequantized_weight(torch.float64).T + mod.bias.double()
    assert _rel(mod(x), ref) <= 3e-3
    assert int4.prepare_int4_kernels(mod) == 1
    # unpack of the cached layout gives the canonical buffers back
    back = unpack_int4_mma(mod._mma_tensors()[0], mod._mma_tensors()[1], 128)
    assert torch.equal(unpack_int4(back.qweight), unpack_int4(mod.qweight))


def test_kernel_cache_dir_prefers_the_env_then_the_venv_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEVLM_KERNEL_CACHE", str(tmp_path / "k"))
    assert mk.kernel_cache_dir() == tmp_path / "k"
    monkeypatch.delenv("EDGEVLM_KERNEL_CACHE")
    monkeypatch.setattr(mk.sys, "prefix", str(tmp_path))
    assert mk.kernel_cache_dir() is None  # no venv folder: torch's extension cache
    (tmp_path / "var" / "cache" / "edgevlm-kernels").mkdir(parents=True)
    assert mk.kernel_cache_dir() == tmp_path / "var" / "cache" / "edgevlm-kernels"


PREFILL_SCRIPT = """
import json, torch
from edgevlm.runtime import int4
torch.manual_seed(0)
out = {}
for bias in (False, True):
    lin = torch.nn.Linear(256, 160, bias=bias)
    mod = int4.Int4Linear.from_linear(lin, 64)
    x = torch.randn(40, 256)
    ref = x.double() @ mod.dequantized_weight(torch.float64).T + (mod.bias.double() if bias else 0)
    for chunk in (0, 64 * 512, 10**9):  # whole weight, 64-row chunks (3 chunks, the last short), one chunk
        y = int4._prefill_matmul(x, mod, "triton", chunk)
        out[f"{bias}-{chunk}"] = [list(y.shape), float((y.double() - ref).norm() / ref.norm())]
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_prefill_row_chunks_assemble_the_whole_product_in_the_interpreter(tmp_path):
    """The prefill path's chunked assembly (one reused buffer, bias slices, column views of the output),
    with the Triton dequantizer under its CPU interpreter (fp32): every chunking gives the same product.

    The child Python starts in an empty folder, not the repository root: there the checkout's top-level
    ``edgevlm/`` folder (which holds no ``runtime``) comes first on ``sys.path`` and hides the package as
    installed (an editable install's finder maps it back; a wheel-style layout on ``PYTHONPATH``, as on the
    device machine, does not)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", PREFILL_SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 and "No module named 'edgevlm" in proc.stderr:
        pytest.skip("edgevlm.runtime is not importable in a child process here (neither installed nor on "
                    f"PYTHONPATH): {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 6
    for shape, err in res.values():
        assert shape == [40, 160]
        assert err < 1e-5
