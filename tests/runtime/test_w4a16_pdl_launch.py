"""Where the W4A16 CUDA kernels are launched as programmatic dependents (PDL), on a machine without a GPU (a fake
extension records the launches):

* :func:`~edgevlm.runtime.kernels.w4a16_mma.w4a16_mma` asks :func:`~edgevlm.runtime.kernels.w4a16_mma.pdl_ok` with
  the launch's activation rows and hands its answer to the binding, an explicit ``pdl`` wins;
  :func:`~edgevlm.runtime.kernels.w4a16_mma.w4a16_dequant` (the prefill's dequantizer) asks with ``rows=None``;
* :class:`~edgevlm.runtime.int4.Int4Linear` launches plainly on the call that repacks its mma layout (the kernel
  reads the weights before its PDL wait, and the repack's kernels are the stream's last) and leaves the choice to
  the rule afterwards.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from edgevlm.runtime.int4 import Int4Linear  # noqa: E402
from edgevlm.runtime.int4_format import quantize_int4, repack_int4_mma  # noqa: E402
from edgevlm.runtime.kernels import w4a16_mma as mk  # noqa: E402


class _FakeExt:
    """Records the binding calls; returns zeros of the output shape."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def w4a16_lean(self, x, qw, meta, bias, g, a, b, tpc, pdl, late, async_ring):
        self.calls.append(("lean", (pdl, late, async_ring)))
        return torch.zeros(x.shape[0], qw.shape[0] * 16, dtype=x.dtype)

    def w4a16_mma(self, x, qw, meta, bias, g, a, b, tpc, mode, prefetch, pdl):
        self.calls.append(("reg", (pdl,)))
        return torch.zeros(x.shape[0], qw.shape[0] * 16, dtype=x.dtype)

    def w4a16_dequant(self, qweight, scales, zeros, g, row0, rows, bf16, out, pdl):
        self.calls.append(("dequant", (pdl,)))
        return out


@pytest.fixture
def fake(monkeypatch):
    ext = _FakeExt()
    asked: list = []
    monkeypatch.setattr(mk, "load_extension", lambda device=None: ext)
    monkeypatch.setattr(mk, "pdl_ok", lambda device, rows: asked.append(rows) or rows is not None)
    return ext, asked


def _layer(n: int = 32, k: int = 256, g: int = 128):
    qw = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), g)
    packed, meta = repack_int4_mma(qw.qweight, qw.scales, qw.zeros, g)
    return qw, packed, meta


@pytest.mark.parametrize("m", [1, 8, 9, 16])
def test_w4a16_mma_asks_the_rule_with_its_rows(fake, m):
    ext, asked = fake
    _, packed, meta = _layer()
    x = torch.randn(m, 256).bfloat16()
    mk.w4a16_mma(x, packed, meta, 128, config=("lean", 8, 2, 1))
    mk.w4a16_mma(x, packed, meta, 128, config=("async", 8, 4, 1))
    mk.w4a16_mma(x, packed, meta, 128, config=("reg", 8, 2, 1), mode=2)
    assert asked == [m, m, m]
    assert [c[0] for c in ext.calls] == ["lean", "lean", "reg"]
    assert ext.calls[0][1][0] is True and ext.calls[0][1][2] is False  # pdl from the rule, the register ring
    assert ext.calls[1][1][2] is True  # the cp.async ring
    asked.clear()
    mk.w4a16_mma(x, packed, meta, 128, config=("lean", 8, 2, 1), pdl=False)
    assert asked == [] and ext.calls[-1][1][0] is False  # an explicit pdl is not second-guessed


def test_w4a16_dequant_is_never_a_decode_launch(fake):
    ext, asked = fake
    qw, _, _ = _layer()
    mk.w4a16_dequant(qw.qweight, qw.scales, qw.zeros, 128, torch.bfloat16, out=torch.empty(32, 256).bfloat16())
    assert asked == [None] and ext.calls == [("dequant", (False,))]


def test_int4_linear_launches_plainly_on_the_call_that_repacks(monkeypatch):
    qw, _, _ = _layer()
    lin = Int4Linear.from_int4(qw)
    seen: list = []

    def fake_mma(x, qw_, meta, g, bias=None, config=None, **kw):
        seen.append(kw.get("pdl", "unset"))
        return torch.zeros(x.shape[0], 32, dtype=x.dtype)

    monkeypatch.setattr(mk, "w4a16_mma", fake_mma)
    monkeypatch.setattr(Int4Linear, "execution_path", lambda self, m, device: "mma")
    monkeypatch.setattr("edgevlm.runtime.int4.mma_max_rows", lambda device: 16)
    x = torch.randn(2, 256).bfloat16()
    lin(x)
    lin(x)
    lin(x)
    assert seen == [False, None, None]  # plain, then pdl_ok's rule (pdl=None)
    lin._mma_cache = None  # e.g. module.to(...) drops the layout: repacked, plain again
    lin(torch.randn(40, 256).bfloat16())  # three launches of <= 16 rows
    assert seen[3:] == [False, False, False]
