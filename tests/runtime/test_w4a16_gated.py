"""The W4A16 gated-MLP epilogue on a machine without a GPU: the interleaved row order of a fused gate/up weight, the
kernel's arithmetic on it (``w4a16_mma_reference`` in float64), what ``Int4Linear`` and the decoder do with a gated
projection, and the launch arguments (a fake extension that computes with the reference records them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from edgevlm.runtime.int4 import Int4Linear  # noqa: E402
from edgevlm.runtime.int4_format import (  # noqa: E402
    dequantize_int4,
    gated_row_order,
    quantize_int4,
    repack_int4_mma,
)
from edgevlm.runtime.kernels import w4a16_mma as mk  # noqa: E402
from tests.triton_support import needs_triton, run_interpreted  # noqa: E402


def _act(name: str, g: torch.Tensor) -> torch.Tensor:
    return F.silu(g) if name == "silu" else F.gelu(g, approximate="tanh")


def test_row_order_pairs_each_gate_row_with_its_up_row_in_one_tile():
    order = gated_row_order(48)
    assert sorted(order.tolist()) == list(range(48))
    tiles = order.reshape(-1, 16)
    assert torch.equal(tiles[:, 8:], tiles[:, :8] + 24)  # rows g + 8: the up partner of gate row g
    assert torch.equal(tiles[:, :8].reshape(-1), torch.arange(24))
    for bad in (40, 8, 2):
        with pytest.raises(ValueError, match="% 16 == 0"):
            gated_row_order(bad)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("group_size", [64, 128])
def test_kernel_arithmetic_on_the_interleaved_layout_is_the_gated_mlp(act, group_size):
    gen = torch.Generator().manual_seed(1)
    inter, k, m = 32, 256, 3
    w = quantize_int4(torch.randn(2 * inter, k, generator=gen), group_size)
    order = gated_row_order(2 * inter)
    qw, meta = repack_int4_mma(w.qweight[order], w.scales[order], w.zeros[order], group_size)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    y = mk.w4a16_mma_reference(x, qw, meta, group_size)  # (M, 2I) float64, rows of the interleaved layout
    tiles = y.reshape(m, -1, 16)
    got = _act(act, tiles[:, :, :8].reshape(m, inter)) * tiles[:, :, 8:].reshape(m, inter)
    dense = x.double() @ dequantize_int4(w.qweight, w.scales, w.zeros, group_size, torch.float64).T
    want = _act(act, dense[:, :inter]) * dense[:, inter:]
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def _gate_up(inter=32, k=256, bias=False):
    gen = torch.Generator().manual_seed(2)
    w = quantize_int4(torch.randn(2 * inter, k, generator=gen), 128)
    b = torch.randn(2 * inter, generator=gen) if bias else None
    return Int4Linear.from_int4(w, b)


def test_set_gated_checks_and_keeps_forward_in_canonical_order():
    lin = _gate_up()
    x = torch.randn(2, 256)
    ref = lin(x)
    lin.set_gated("silu")
    assert lin.gated_act == "silu" and torch.equal(lin(x), ref)
    assert not lin.gated_ready(x)  # CPU: not the tensor-core path
    with pytest.raises(ValueError, match="gated_ready"):
        lin.forward_gated(x)
    with pytest.raises(ValueError, match="not one of"):
        lin.set_gated("relu")
    odd = Int4Linear(256, 40)
    with pytest.raises(ValueError, match="multiple of 8"):
        odd.set_gated("silu")
    lin.set_gated(None)
    assert lin.gated_act is None


class _RefExt:
    """Computes the launches with ``w4a16_mma_reference`` (float64, cast to x's dtype) and records their arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def w4a16_lean(self, x, qw, meta, bias, g, a, b, tpc, pdl, late, async_ring):
        self.calls.append(("lean", a, b, tpc))
        return mk.w4a16_mma_reference(x, qw, meta, g, bias).to(x.dtype)

    def w4a16_mma(self, x, qw, meta, bias, g, a, b, tpc, mode, prefetch, pdl):
        self.calls.append(("reg", a, b, tpc))
        return mk.w4a16_mma_reference(x, qw, meta, g, bias).to(x.dtype)

    def w4a16_bulk(self, x, qw, meta, bias, g, a, b, tpc, allow_zx, pdl):
        self.calls.append(("bulk", a, b, tpc))
        return mk.w4a16_mma_reference(x, qw, meta, g, bias).to(x.dtype)

    def w4a16_lean_gated(self, x, qw, meta, bias, g, a, b, tpc, pdl, late, act):
        self.calls.append(("gated", a, b, tpc, act))
        y = mk.w4a16_mma_reference(x, qw, meta, g, bias)
        tiles = y.reshape(x.shape[0], -1, 16)
        gate, up = tiles[:, :, :8].reshape(x.shape[0], -1), tiles[:, :, 8:].reshape(x.shape[0], -1)
        return (_act("silu" if act == 0 else "gelu", gate) * up).to(x.dtype)


@pytest.fixture
def ref_ext(monkeypatch):
    ext = _RefExt()
    monkeypatch.setattr(mk, "load_extension", lambda device=None: ext)
    monkeypatch.setattr(mk, "pdl_ok", lambda device, rows: False)
    monkeypatch.setattr(mk, "mma_status", lambda device, kind="reg": None)
    monkeypatch.setattr(mk, "lean_build", lambda: True)
    return ext


@needs_triton
def test_gated_act_reads_the_interleaved_columns():
    out = run_interpreted("""
        import json, torch
        import torch.nn.functional as F
        from edgevlm.runtime.int4_format import gated_row_order
        from edgevlm.runtime.kernels.decode_fused import gated_act
        gen = torch.Generator().manual_seed(0)
        gu = torch.randn(3, 2 * 1032, generator=gen)  # I = 1032: a partial last block of 1024
        order = gated_row_order(gu.shape[1])
        res = {}
        for act, f in (("silu", F.silu), ("gelu_pytorch_tanh", lambda g: F.gelu(g, approximate="tanh"))):
            want = f(gu[:, :1032]) * gu[:, 1032:]
            got = gated_act(gu[:, order].contiguous(), act, interleaved=True)
            res[act] = float((got - want).abs().max())
        try:
            gated_act(torch.randn(2, 40), "silu", interleaved=True)
            res["odd"] = "accepted"
        except ValueError as exc:
            res["odd"] = str(exc)
        print(json.dumps(res))
    """)
    assert out["silu"] < 1e-5 and out["gelu_pytorch_tanh"] < 1e-5, out
    assert "I % 8 == 0" in out["odd"]


@pytest.mark.parametrize("bias", [False, True])
def test_gated_layer_on_the_mma_path(ref_ext, monkeypatch, bias):
    lin = _gate_up(bias=bias)
    x = torch.randn(3, 256).bfloat16()
    plain = lin(x.float())  # the dequantizing reference path, [gate | up]
    lin.set_gated("gelu_pytorch_tanh")
    monkeypatch.setattr(Int4Linear, "execution_path", lambda self, m, device: "mma")
    monkeypatch.setattr("edgevlm.runtime.int4.mma_max_rows", lambda device: 16)
    # the plain launch over the interleaved layout comes back in [gate | up] order
    y = lin(x).float()
    assert torch.allclose(y, plain, rtol=2e-2, atol=2e-2)
    # forward_gated where gated_ready says so (CPU tensors pass here only through the stubs)
    monkeypatch.setattr(Int4Linear, "gated_ready", lambda self, x: True)
    gated = lin.forward_gated(x).float()
    want = F.gelu(plain[:, :32], approximate="tanh") * plain[:, 32:]
    assert gated.shape == (3, 32) and torch.allclose(gated, want, rtol=3e-2, atol=3e-2)
    kind, a, b, tpc, act = ref_ext.calls[-1]
    assert kind == "gated" and act == 1 and (a, b) in mk.GATED_CONFIGS
    # above GATED_MAX_M rows: the plain launch over the interleaved rows, then the interleaved act kernel
    from edgevlm.runtime.kernels import decode_fused

    seen = []

    def fake_act(y, act, *, interleaved=False):
        seen.append((act, interleaved))
        tiles = y.float().reshape(y.shape[0], -1, 16)
        return (F.gelu(tiles[:, :, :8], approximate="tanh") * tiles[:, :, 8:]).reshape(y.shape[0], -1).to(y.dtype)

    monkeypatch.setattr(decode_fused, "gated_act", fake_act)
    x12 = torch.randn(mk.GATED_MAX_M + 4, 256).bfloat16()
    ref12 = lin(x12.float())
    got12 = lin.forward_gated(x12).float()
    assert seen == [("gelu_pytorch_tanh", True)] and ref_ext.calls[-1][0] != "gated"
    want12 = F.gelu(ref12[:, :32], approximate="tanh") * ref12[:, 32:]
    assert torch.allclose(got12, want12, rtol=3e-2, atol=3e-2)


def test_gated_launch_arguments(ref_ext):
    w = quantize_int4(torch.randn(64, 256), 128)
    order = gated_row_order(64)
    qw, meta = repack_int4_mma(w.qweight[order], w.scales[order], w.zeros[order], 128)
    x = torch.randn(2, 256).bfloat16()
    mk.w4a16_mma_gated(x, qw, meta, 128, "silu", config=(8, 3, 2))
    assert ref_ext.calls[-1] == ("gated", 8, 3, 2, 0)
    with pytest.raises(ValueError, match="w4a16_mma_gated: activation 'relu' is not one of"):
        mk.w4a16_mma_gated(x, qw, meta, 128, "relu")
    with pytest.raises(ValueError, match="config must be"):
        mk.w4a16_mma_gated(x, qw, meta, 128, "silu", config=(16, 2, 1))  # no gated instance
    assert not mk.gated_ok("cpu", mk.GATED_MAX_M + 1, "silu") and not mk.gated_ok("cpu", 1, "relu")
    with pytest.raises(ValueError, match="M <= 16"):
        mk.w4a16_mma_gated(torch.randn(17, 256).bfloat16(), qw, meta, 128, "silu")
    with pytest.raises(ValueError, match="x must be"):
        mk.w4a16_mma_gated(torch.randn(2, 128).bfloat16(), qw, meta, 128, "silu")


def test_gated_config_follows_the_table():
    for m in (1, 8, 16):
        for n, k in ((22016, 4096), (24576, 4096), (12288, 2048), (4096, 11008)):
            kind, a, b, tpc = mk.mma_config(m, n, k, 128, bulk=True, lean=True)
            got = mk.gated_config(m, n, k, 128)
            assert got[:2] in mk.GATED_CONFIGS
            if kind == "lean" and (a, b) in mk.GATED_CONFIGS:
                assert got == (a, b, tpc)
            elif kind in ("lean", "async") and (a, 2) in mk.GATED_CONFIGS:
                assert got == (a, 2, tpc)
            else:
                assert got == mk.DEFAULT_LEAN_CONFIG


def test_fused_decode_marks_the_fused_w4a16_projections(monkeypatch):
    from edgevlm.quantize.bench_models import build_models, quantize_decoder_w4

    model, _, _ = build_models("tiny", device=torch.device("cpu"), dtype=torch.float32, max_seq_len=32,
                               with_hf=False)
    quantize_decoder_w4(model)
    dec = model.language_model
    dec.fuse_projections()
    assert all(layer.mlp.gate_up_proj.gated_act is None for layer in dec.layers)  # fused, not yet gated
    monkeypatch.setattr("edgevlm.runtime.kernels.kernels_usable", lambda device: True)
    assert dec.enable_fused_decode(True)
    assert all(layer.mlp.gate_up_proj.gated_act == layer.mlp.act for layer in dec.layers)
    dec.enable_fused_decode(False)
    assert all(layer.mlp.gate_up_proj.gated_act is None for layer in dec.layers)
    monkeypatch.setattr(mk, "GATED", False)  # the switch off: the fused step without the epilogue
    assert dec.enable_fused_decode(True)
    assert all(layer.mlp.gate_up_proj.gated_act is None for layer in dec.layers)


def test_fused_step_takes_the_gated_launch_where_ready(monkeypatch):
    from edgevlm.runtime.decoder import Decoder

    lin = _gate_up()
    lin.set_gated("silu")
    mlp = torch.nn.Module()
    mlp.gate_up_proj, mlp.act = lin, "silu"
    h = torch.randn(2, 256)
    seen = []
    monkeypatch.setattr(Int4Linear, "gated_ready", lambda self, x: True)
    monkeypatch.setattr(Int4Linear, "forward_gated", lambda self, x: seen.append("gated") or x[:, :32])
    out = Decoder._gate_up_act(mlp, h, lambda gu, act: seen.append("separate") or gu[:, :32])
    assert seen == ["gated"] and out.shape == (2, 32)
    monkeypatch.setattr(Int4Linear, "gated_ready", lambda self, x: False)
    Decoder._gate_up_act(mlp, h, lambda gu, act: seen.append("separate") or gu[:, :32])
    assert seen == ["gated", "separate"]


def test_gated_launch_refuses_bad_configs_and_a_build_without_it(ref_ext, monkeypatch):
    w = quantize_int4(torch.randn(64, 256), 128)
    order = gated_row_order(64)
    qw, meta = repack_int4_mma(w.qweight[order], w.scales[order], w.zeros[order], 128)
    x = torch.randn(2, 256).bfloat16()
    for bad in (("lean", 8, 2, 1), (8, 2, 0), (8, 2), (8, 2.0, 1), None.__class__):
        with pytest.raises(ValueError, match="config must be"):
            mk.w4a16_mma_gated(x, qw, meta, 128, "silu", config=bad)
    monkeypatch.setattr(mk, "load_extension", lambda device=None: object())  # a build without the lean variant
    with pytest.raises(mk.MmaKernelUnavailable, match="no lean variant"):
        mk.w4a16_mma_gated(x, qw, meta, 128, "silu")


def test_gated_ready_follows_the_mma_path(monkeypatch):
    class _Rows:  # what gated_ready reads of an input: its device and element count
        def __init__(self, rows, device="cuda"):
            self.device, self.rows = torch.device(device), rows

        def numel(self):
            return self.rows * 256

    lin = _gate_up()
    assert not lin.gated_ready(_Rows(1))  # not gated
    lin.set_gated("silu")
    seen = []
    monkeypatch.setattr(Int4Linear, "execution_path",
                        lambda self, m, device: seen.append(m) or ("mma" if m <= 64 else "cuda_dequant"))
    assert lin.gated_ready(_Rows(1)) and lin.gated_ready(_Rows(40))  # 40: forward's row blocks serve it too
    assert not lin.gated_ready(_Rows(600))  # prefill rows: not the mma path
    assert not lin.gated_ready(_Rows(1, "cpu"))
    assert seen == [1, 40, 600]


def test_forward_gated_over_row_blocks_and_float32(ref_ext, monkeypatch):
    from edgevlm.runtime.kernels import decode_fused

    lin = _gate_up()
    x = torch.randn(40, 256)  # float32, 40 rows: three launches of <= 16 rows
    plain = lin(x)
    lin.set_gated("silu")
    monkeypatch.setattr(Int4Linear, "execution_path", lambda self, m, device: "mma")
    monkeypatch.setattr(Int4Linear, "gated_ready", lambda self, x: True)
    monkeypatch.setattr("edgevlm.runtime.int4.mma_max_rows", lambda device: 16)

    def act_interleaved(y, act, *, interleaved=False):
        assert interleaved and act == "silu"
        tiles = y.float().reshape(y.shape[0], -1, 16)
        return (F.silu(tiles[:, :, :8]) * tiles[:, :, 8:]).reshape(y.shape[0], -1).to(y.dtype)

    monkeypatch.setattr(decode_fused, "gated_act", act_interleaved)
    before = len(ref_ext.calls)
    y = lin.forward_gated(x)
    assert y.dtype == torch.float32 and y.shape == (40, 32)
    launches = [c[0] for c in ref_ext.calls[before:]]
    assert len(launches) == 3 and "gated" not in launches  # 40 rows > GATED_MAX_M: plain launches of <= 16 rows
    want = F.silu(plain[:, :32]) * plain[:, 32:]
    assert torch.allclose(y, want, rtol=3e-2, atol=3e-2)
    assert torch.allclose(lin(x), plain, rtol=2e-2, atol=2e-2)  # forward: [gate | up] again, over row blocks


def test_set_mma_layout_unmarks_a_gated_layer():
    lin = _gate_up()
    lin.set_gated("silu")
    qw, meta = repack_int4_mma(lin.qweight, lin.scales, lin.zeros, 128)
    lin.set_mma_layout(qw, meta)
    assert lin.gated_act is None and lin._mma_cache[4] is None


def test_breakdown_ungated_variant():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "decode_step_breakdown.py"
    spec = importlib.util.spec_from_file_location("decode_step_breakdown_t", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.parse_variant("nomask_ungated").ungated
    with pytest.raises(ValueError, match="need the decoder"):
        with mod.variant("nomask_ungated", None):
            pass
