"""The Triton W4A16 prefill GEMM (runtime/kernels/w4a16_gemm.py) and Int4Linear's choice of it: argument checks,
the launch table and the switch on the CPU; numerics against float64 in Triton's CPU interpreter; on a CUDA GPU
numerics at M = 600, agreement with dequantize + cuBLAS, the prefill path and a CUDA-graph replay (speed is
bench/w4a16_prefill_gemm.py's)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from triton_support import needs_triton, run_interpreted  # noqa: E402

from edgevlm.runtime import int4  # noqa: E402
from edgevlm.runtime.int4_format import dequantize_int4, quantize_int4  # noqa: E402
from edgevlm.runtime.kernels import w4a16_gemm as gk  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point the kernel module at a temporary launch table; returns a writer (dict -> file, caches cleared)."""
    path = tmp_path / "w4a16_gemm_configs.json"
    monkeypatch.setattr(gk, "CONFIGS_FILE", path)
    gk._table.cache_clear()

    def write(doc) -> None:
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        gk._table.cache_clear()

    yield write
    gk._table.cache_clear()


def test_gemm_rejects_bad_arguments():
    qw = quantize_int4(torch.randn(16, 256), 128)
    x = torch.randn(3, 256)
    args = (qw.qweight, qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match=r"x must be \(M, 256\)"):
        gk.w4a16_gemm(torch.randn(3, 128), *args)
    with pytest.raises(ValueError, match=r"x must be \(M, 256\)"):
        gk.w4a16_gemm(torch.randn(256), *args)
    with pytest.raises(ValueError, match="x must be one of"):
        gk.w4a16_gemm(x.double(), *args)
    with pytest.raises(ValueError, match="contiguous uint8"):
        gk.w4a16_gemm(x, qw.qweight.to(torch.int32), qw.scales, qw.zeros, 128)
    with pytest.raises(ValueError, match="multiple of group_size"):
        gk.w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, 96)
    with pytest.raises(ValueError, match="scales/zeros must be"):
        gk.w4a16_gemm(x, qw.qweight, qw.scales[:, :1].contiguous(), qw.zeros, 128)
    with pytest.raises(ValueError, match=r"bias must be a float \(16,\)"):
        gk.w4a16_gemm(x, *args, bias=torch.randn(15))
    with pytest.raises(ValueError, match=r"bias must be a float \(16,\)"):
        gk.w4a16_gemm(x, *args, bias=torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="x on meta"):
        gk.w4a16_gemm(torch.empty(3, 256, device="meta"), *args)
    with pytest.raises(ValueError, match="config must be 7 ints"):
        gk.w4a16_gemm(x, *args, config=(64, 64, 64, 4, 2, 8))
    with pytest.raises(ValueError, match="BLOCK_N=48 must be a power of two"):
        gk.w4a16_gemm(x, *args, config=(64, 48, 64, 4, 2, 8, 0))
    with pytest.raises(ValueError, match="at least 16"):
        gk.w4a16_gemm(x, *args, config=(8, 64, 64, 4, 2, 8, 0))
    with pytest.raises(ValueError, match="SWAP_AB=2 0 or 1"):
        gk.w4a16_gemm(x, *args, config=(64, 64, 64, 4, 2, 8, 2))
    with pytest.raises(ValueError, match="num_stages=0"):
        gk.w4a16_gemm(x, *args, config=(64, 64, 64, 4, 0, 8, 0))
    empty = gk.w4a16_gemm(torch.randn(0, 256), *args)  # no launch for zero rows
    assert empty.shape == (0, 16) and empty.dtype == torch.float32


def test_table_lookup_buckets_configs_and_verdicts(table):
    assert [gk.m_bucket(m) for m in (1, 128, 129, 600, 601, 1024, 5000)] == [128, 128, 600, 600, 1024, 1024, 1024]
    table({"device": "NVIDIA H200", "configs": {"4096x4096g128": {
        "600": {"config": [64, 128, 64, 4, 4, 8, 1], "gemm_us": 30.0, "dequant_cublas_us": 40.0},
        "128": {"config": [64, 64, 64, 4, 5, 1, 0], "gemm_us": 20.0, "dequant_cublas_us": 19.5},
        "1024": {"config": [64, 64], "gemm_us": "x"}}}})
    assert gk.table_device() == "NVIDIA H200"
    assert gk.gemm_config(600, 4096, 4096, 128) == (64, 128, 64, 4, 4, 8, 1)
    assert gk.gemm_config(300, 4096, 4096, 128) == (64, 128, 64, 4, 4, 8, 1)
    assert gk.gemm_config(100, 4096, 4096, 128) == (64, 64, 64, 4, 5, 1, 0)
    assert gk.gemm_config(2000, 4096, 4096, 128) == gk.DEFAULT_CONFIG  # malformed entry
    assert gk.gemm_config(600, 4096, 4096, 64) == gk.DEFAULT_CONFIG  # group size not measured
    assert gk.prefers_gemm(600, 4096, 4096, 128) is True
    assert gk.prefers_gemm(64, 4096, 4096, 128) is False  # measured slower there
    assert gk.prefers_gemm(1024, 4096, 4096, 128) is False
    assert gk.prefers_gemm(600, 12288, 4096, 128) is False  # shape not measured
    table("not json")
    assert gk.table_device() is None and gk.gemm_config(600, 4096, 4096, 128) == gk.DEFAULT_CONFIG
    table({"device": "x", "configs": []})
    assert gk.table_device() is None and gk.prefers_gemm(600, 4096, 4096, 128) is False


def test_the_installed_table_is_well_formed():
    """Whatever table ships: every entry a valid configuration the kernel accepts, with both times. The table
    loads (``_table`` turns an unreadable file into ``{}``, which would switch the GEMM off and leave this loop
    empty) and names its GPU."""
    gk._table.cache_clear()
    data = gk._table()
    assert gk.CONFIGS_FILE.is_file() and data.get("configs"), f"{gk.CONFIGS_FILE} missing or unreadable"
    assert gk.table_device(), "the table names no GPU: Int4Linear would never use it"
    for key, row in data.get("configs", {}).items():
        n, rest = key.split("x")
        k, g = rest.split("g")
        for bucket, entry in row.items():
            assert int(bucket) in gk.M_BUCKETS, key
            assert gk._check_config(tuple(entry["config"]), int(g)) == tuple(entry["config"]), (key, bucket)
            assert entry["gemm_us"] > 0 and entry["dequant_cublas_us"] > 0, (key, bucket)
            assert gk.gemm_config(int(bucket), int(n), int(k), int(g)) == tuple(entry["config"])


def test_prefill_path_follows_the_switch_and_the_table(table, monkeypatch):
    """The choice on a CUDA device without touching one: the Triton probe and torch's int4 probe are stubbed."""
    monkeypatch.setattr(int4, "_triton_w4a16", lambda device: True)
    monkeypatch.setattr(int4, "kernel_convention", lambda device: None)
    monkeypatch.setattr(int4, "mma_kernel_ok", lambda *a, **k: False)
    monkeypatch.setattr(int4, "_cuda_device_name", lambda index: "NVIDIA H200")
    monkeypatch.delenv(int4.PREFILL_GEMM_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    lin = int4.Int4Linear.from_linear(torch.nn.Linear(256, 32), 128)
    table({"device": "NVIDIA H200", "configs": {"32x256g128": {
        "600": {"config": [64, 64, 64, 4, 4, 8, 1], "gemm_us": 5.0, "dequant_cublas_us": 9.0},
        "1024": {"config": [64, 64, 64, 4, 4, 8, 1], "gemm_us": 9.0, "dequant_cublas_us": 5.0}}}})
    assert lin.execution_path(600, cuda) == "triton_gemm"
    assert lin.execution_path(1000, cuda) == "triton_dequant"  # the table says dequantize + cuBLAS there
    assert lin.execution_path(32, cuda) == "triton_dequant"  # below PREFILL_GEMM_MIN_M
    assert lin.execution_path(4, cuda) == "triton_gemv"  # decode is untouched
    assert lin.execution_path(600, torch.device("cpu")) != "triton_gemm"
    monkeypatch.setattr(int4, "_cuda_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    assert lin.execution_path(600, cuda) == "triton_dequant"  # measured on another GPU
    monkeypatch.setenv(int4.PREFILL_GEMM_ENV, "force")
    assert lin.execution_path(1000, cuda) == "triton_gemm"
    monkeypatch.setenv(int4.PREFILL_GEMM_ENV, "0")
    assert lin.execution_path(600, cuda) == "triton_dequant"
    monkeypatch.setattr(int4, "_cuda_device_name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(int4, "PREFILL_GEMM", False)
    monkeypatch.delenv(int4.PREFILL_GEMM_ENV)
    assert lin.execution_path(600, cuda) == "triton_dequant"
    monkeypatch.setenv(int4.PREFILL_GEMM_ENV, "1")
    assert lin.execution_path(600, cuda) == "triton_gemm"
    int4.set_int4_kernel(lin, "dequant")
    assert lin.execution_path(600, cuda) == "dequant"
    int4.set_int4_kernel(lin, "triton")
    assert lin.execution_path(600, cuda) == "triton_dequant"  # the GEMM is an "auto" choice
    monkeypatch.setattr(int4, "mma_kernel_ok", lambda *a, **k: True)
    monkeypatch.setattr(int4, "mma_max_rows", lambda device: 32)
    int4.set_int4_kernel(lin, "auto")
    assert lin.execution_path(600, cuda) == "triton_gemm"  # in place of the extension's dequantizer
    monkeypatch.setenv(int4.PREFILL_GEMM_ENV, "off")
    assert lin.execution_path(600, cuda) == "cuda_dequant"
    assert lin.execution_path(64, cuda) == "mma"


GEMM_SCRIPT = """
    import json, torch
    from edgevlm.runtime.int4 import quantize_int4, dequantize_int4
    from edgevlm.runtime.kernels.w4a16_gemm import w4a16_gemm, DEFAULT_CONFIG
    torch.manual_seed(0)
    out = []
    # N not a multiple of BLOCK_N (17, 40), M odd and not a multiple of BLOCK_M, group 128 and 64, K = 1.5 groups
    cases = [(40, 384, 128, 33, torch.float32, True, None), (17, 512, 128, 100, torch.float32, False, None),
             (64, 256, 64, 37, torch.float16, True, (32, 32, 64, 4, 2, 2, 1)),
             (48, 512, 128, 5, torch.float32, False, (16, 16, 32, 4, 2, 1, 0)),
             (32, 192, 64, 19, torch.float16, False, (16, 32, 128, 4, 2, 3, 0)),
             (24, 256, 64, 1, torch.float32, True, (16, 16, 16, 4, 2, 1, 1))]
    for n, k, g, m, dtype, has_bias, cfg in cases:
        qw = quantize_int4(torch.randn(n, k), g)
        w64 = dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
        x = torch.randn(m, k).to(dtype)
        b = torch.randn(n) if has_bias else None
        y = w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, g, b, config=cfg)
        y2 = w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, g, b, config=cfg)
        ref = x.double() @ w64.T + (b.double() if has_bias else 0)
        # the dequantized weight as the activations' dtype holds it, through a float64 matmul
        w_dt = dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, dtype).double()
        ref_dt = x.double() @ w_dt.T + (b.double() if has_bias else 0)
        out.append({"case": [n, k, g, m, str(dtype), has_bias, str(cfg)], "shape": list(y.shape),
                    "dtype": str(y.dtype), "rel": float((y.double() - ref).norm() / ref.norm()),
                    "rel_same_weight": float((y.double() - ref_dt).norm() / ref_dt.norm()),
                    "finite": bool(torch.isfinite(y).all()), "stable": bool(torch.equal(y, y2))})
    # a strided x (a column slice) is copied, not misread
    qw = quantize_int4(torch.randn(32, 256), 128)
    xs = torch.randn(9, 512)[:, ::2]
    y = w4a16_gemm(xs, qw.qweight, qw.scales, qw.zeros, 128)
    ref = xs.double() @ dequantize_int4(qw.qweight, qw.scales, qw.zeros, 128, torch.float64).T
    out.append({"case": "strided", "shape": list(y.shape), "dtype": str(y.dtype),
                "rel": float((y.double() - ref).norm() / ref.norm()), "rel_same_weight": 0.0, "finite": True,
                "stable": True})
    print(json.dumps(out))
"""


@needs_triton
def test_gemm_matches_float64_in_the_interpreter():
    res = run_interpreted(GEMM_SCRIPT)
    assert len(res) == 7
    for r in res:
        case = r["case"]
        m, n = (9, 32) if case == "strided" else (case[3], case[0])
        assert r["shape"] == [m, n] and r["finite"] and r["stable"], r
        fp16 = case != "strided" and case[4] == "torch.float16"
        assert r["dtype"] == ("torch.float16" if fp16 else "torch.float32")
        # fp32: the interpreter's float32 dot; fp16: products of fp16 operands, fp32 sums, one fp16 rounding
        assert r["rel"] < (3e-3 if fp16 else 1e-5), r
        assert r["rel_same_weight"] < (1e-3 if fp16 else 1e-5), r


# ----------------------------------------------------------------------------------------------- CUDA
def _moved(qw, dev):
    return int4.Int4Weight(qw.qweight.to(dev), qw.scales.to(dev), qw.zeros.to(dev), qw.group_size)


@needs_cuda
@needs_triton
@pytest.mark.parametrize(("n", "k", "g", "dtype"), [(4096, 4096, 128, torch.bfloat16), (4096, 11008, 128,
                                                    torch.bfloat16), (1024, 4096, 64, torch.float16)])
def test_gemm_on_cuda_matches_float64_at_prefill_sizes(n, k, g, dtype):
    dev = torch.device("cuda")
    qw = _moved(quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05, g), dev)
    w64 = dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, torch.float64)
    bias = torch.randn(n, device=dev) * 0.1
    for m in (33, 100, 600):
        x = torch.randn(m, k, device=dev).to(dtype)
        y = gk.w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, g, bias)
        ref = x.double() @ w64.T + bias.double()
        assert y.dtype == dtype and y.shape == (m, n) and bool(torch.isfinite(y).all())
        assert _rel(y, ref) < 3e-3, (m, _rel(y, ref))
        runs = [gk.w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, g, bias) for _ in range(3)]
        assert all(torch.equal(y, r) for r in runs), m  # bit-stable
        # the dequantize + cuBLAS path on the same weight (bf16/fp16 weight, cuBLAS accumulation)
        dense = torch.nn.functional.linear(x, dequantize_int4(qw.qweight, qw.scales, qw.zeros, g, dtype),
                                           bias.to(dtype))
        assert _rel(y, dense) < 2e-3, (m, _rel(y, dense))
    for cfg in gk.CANDIDATES[:2] + gk.CANDIDATES[6:8]:  # each operand order, explicit configurations
        x = torch.randn(600, k, device=dev).to(dtype)
        y = gk.w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, g, config=cfg)
        assert _rel(y, x.double() @ w64.T) < 3e-3, cfg
    with pytest.raises(ValueError, match="x must be one of"):
        gk.w4a16_gemm(torch.randn(4, k, device=dev), qw.qweight, qw.scales, qw.zeros, g)


@needs_cuda
@needs_triton
def test_int4linear_prefill_uses_the_gemm_and_replays_from_a_cuda_graph(monkeypatch):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = int4.Int4Linear.from_linear(torch.nn.Linear(4096, 1024).to(torch.bfloat16), 128).to(dev)
    x = torch.randn(2, 300, 4096, device=dev, dtype=torch.bfloat16)
    monkeypatch.setenv(int4.PREFILL_GEMM_ENV, "0")
    base_path = lin.execution_path(600, dev)
    assert base_path in ("cuda_dequant", "triton_dequant")
    y_dequant = lin(x)
    monkeypatch.delenv(int4.PREFILL_GEMM_ENV)
    # the default follows the shipped table: the GEMM exactly where it was measured faster on this GPU model
    from edgevlm.runtime.kernels.w4a16_gemm import prefers_gemm, table_device

    want = table_device() == torch.cuda.get_device_name(dev) and prefers_gemm(600, 1024, 4096, 128)
    assert (lin.execution_path(600, dev) == "triton_gemm") == want
    monkeypatch.setenv(int4.PREFILL_GEMM_ENV, "force")
    assert lin.execution_path(600, dev) == "triton_gemm"
    y = lin(x)
    assert y.shape == (2, 300, 1024) and y.dtype == torch.bfloat16
    ref = x.double() @ lin.dequantized_weight(torch.float64).T + lin.bias.double()
    assert _rel(y, ref) < 3e-3
    assert _rel(y, y_dequant) < 2e-3
    # capture one prefill call in a CUDA graph, replay it on new input: equal to the eager call
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lin(static_x)  # warm-up outside the capture (compiles the configuration)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = lin(static_x)
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, lin(x2))
    assert not torch.equal(static_y, y)
