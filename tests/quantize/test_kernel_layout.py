"""The stored tensor-core INT4 layout (``edgevlm quantize --w4a16-layout mma``): the repack round trip,
the bundle's copy (bit for bit the load-time repack), its manifest record, and the loader's decisions
(use / repack / ignore / refuse).

The loader's CUDA-side decisions are exercised on CPU by answering the kernel probe
(``mma_device_ok``) and the compute capability: the stored tensors really land in the layers and are
checked through the kernel's own PyTorch arithmetic (``w4a16_mma_reference``). The real kernel on a
GPU: ``test_cuda_load_uses_the_stored_layout`` (skipped without CUDA)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from edgevlm.errors import ModelLoadError
from edgevlm.quantize.build import BuildOptions, build_bundle
from edgevlm.runtime.bundle import (
    MANIFEST_NAME,
    attach_kernel_layouts,
    read_manifest,
    sha256_file,
    verify_bundle,
)
from edgevlm.runtime.int4 import Int4Linear
from edgevlm.runtime.int4_format import (
    MMA_LAYOUT_VERSION,
    dequantize_int4,
    mma_layout_fits,
    mma_layout_shapes,
    mma_target_served,
    pack_int4,
    repack_int4_mma,
    unpack_int4_mma,
)

RTN = dict(method="rtn", onnx=False, calib=None, tensorrt=False)
LAYOUT = "layouts/w4a16-mma-v1.safetensors"


# ----------------------------------------------------------------------------- the format (pure torch)
@pytest.mark.parametrize("n,k,g", [(16, 64, 64), (48, 256, 128), (32, 384, 64)])
def test_repack_round_trip_is_exact(n, k, g):
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) + 0.01).to(torch.float16)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8)
    qw, meta = repack_int4_mma(pack_int4(codes), scales, zeros, g)
    assert (qw.dtype, meta.dtype) == (torch.int32, torch.int32)
    assert (tuple(qw.shape), tuple(meta.shape)) == mma_layout_shapes(n, k, g)
    back = unpack_int4_mma(qw, meta, g)
    assert torch.equal(back.qweight, pack_int4(codes)) and torch.equal(back.zeros, zeros)
    assert torch.equal(back.scales.view(torch.int16), scales.view(torch.int16))  # bit for bit
    # the kernel's own arithmetic on the repacked tensors == a float64 matmul of the canonical weight
    from edgevlm.runtime.kernels.w4a16_mma import w4a16_mma_reference

    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    want = x.double() @ dequantize_int4(pack_int4(codes), scales, zeros, g, torch.float64).T
    torch.testing.assert_close(w4a16_mma_reference(x, qw, meta, g), want, rtol=1e-9, atol=1e-9)


def test_layout_shape_rules_and_targets():
    assert mma_layout_fits(96, 192, 64) and not mma_layout_fits(96, 192, 32) and not mma_layout_fits(24, 128, 64)
    with pytest.raises(ValueError, match="out_features % 16"):
        mma_layout_shapes(24, 128, 64)
    assert mma_target_served(["sm_80+"], (8, 7)) and mma_target_served(["sm_80+"], (9, 0))
    assert mma_target_served(["sm_80+"], (10, 0)) and not mma_target_served(["sm_80+"], (7, 5))
    assert mma_target_served(["sm_87"], (8, 7)) and not mma_target_served(["sm_87"], (9, 0))
    assert not mma_target_served(["ampere", "sm_x+"], (8, 0))


def test_set_mma_layout_checks_shapes():
    lin = Int4Linear.from_linear(torch.nn.Linear(128, 32), group_size=64)
    qw, meta = repack_int4_mma(lin.qweight, lin.scales, lin.zeros, 64)
    with pytest.raises(ValueError, match=r"meta is torch.int32 \(2, 1, 16\); .* needs torch.int32 \(2, 2, 16\)"):
        lin.set_mma_layout(qw, meta[:, :1])
    with pytest.raises(ValueError, match="qw is torch.int64"):
        lin.set_mma_layout(qw.long(), meta)
    lin.set_mma_layout(qw, meta)
    got_qw, got_meta, bias = lin._mma_tensors()  # the stored copy, not a repack
    assert got_qw.data_ptr() == qw.data_ptr() and torch.equal(got_meta, meta)
    assert torch.equal(bias, lin.bias.float())


# ----------------------------------------------------------------------------- bundles
@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from edgevlm.runtime.testing import write_tiny_checkpoint

    # text hidden 192: q/k/v/gate/up at group size 64, down_proj (384) at 128; all fit the mma layout
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src"), seed=1, resolution_ladder=[32, 64],
                                 text_hidden=192, vision_hidden=64, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def bundles(tiny_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("bundles")
    plain = build_bundle(tiny_src, root / "canonical", BuildOptions(**RTN))
    mma = build_bundle(tiny_src, root / "mma", BuildOptions(**RTN, w4a16_layout="mma"))
    return plain, mma


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_default_bundle_is_canonical_only(bundles):
    plain, _ = bundles
    m = read_manifest(plain.bundle_dir)
    assert m.kernel_layouts == [] and m.stats["kernel_layout_bytes"] == 0
    # no key at all: an edgevlm from before kernel_layouts (extra keys forbidden) still reads the manifest
    assert "kernel_layouts" not in json.loads((plain.bundle_dir / MANIFEST_NAME).read_text())
    assert not (plain.bundle_dir / "layouts").exists()


def test_mma_bundle_records_and_stores_the_layout(bundles):
    plain, mma = bundles
    m = read_manifest(mma.bundle_dir)
    (rec,) = m.kernel_layouts
    assert json.loads((mma.bundle_dir / MANIFEST_NAME).read_text())["kernel_layouts"][0]["name"] == "w4a16-mma"
    assert (rec.name, rec.version, rec.targets, rec.files) == ("w4a16-mma", MMA_LAYOUT_VERSION, ["sm_80+"], [LAYOUT])
    int4 = [d for d in m.layers if d.action == "int4"]
    assert rec.layers == len(int4) == 14
    entry = {e.path: e for e in m.files}[LAYOUT]  # hashed like every other file
    assert entry.sha256 == sha256_file(mma.bundle_dir / LAYOUT)
    stored = _tensors(mma.bundle_dir / LAYOUT)
    assert rec.size_bytes == m.stats["kernel_layout_bytes"] == sum(t.numel() * 4 for t in stored.values())
    # the canonical tensors are unchanged: the same tensors as the default build (the safetensors header's
    # metadata order is not deterministic, so the files' bytes are not compared)
    canon, plain_canon = _tensors(mma.bundle_dir / "model.safetensors"), _tensors(plain.bundle_dir / "model.safetensors")
    assert canon.keys() == plain_canon.keys() and all(torch.equal(canon[k], plain_canon[k]) for k in canon)
    assert len(stored) == 2 * len(int4)
    for d in int4:
        src = "language_model.model." + d.name[len("language_model."):]  # the tiny LLaVA's source key names
        qw, meta = repack_int4_mma(canon[src + ".qweight"], canon[src + ".scales"], canon[src + ".zeros"], d.group_size)
        assert torch.equal(stored[d.name + ".mma_qweight"], qw) and torch.equal(stored[d.name + ".mma_meta"], meta)
        back = unpack_int4_mma(qw, meta, d.group_size)
        assert torch.equal(back.qweight, canon[src + ".qweight"]) and torch.equal(back.zeros, canon[src + ".zeros"])
    readme = (mma.bundle_dir / "README.md").read_text()
    assert "`layouts/` the INT4 layers' tensor-core layout" in readme
    from edgevlm.quantize.cli import summary

    table, data = summary(mma)
    assert "stored layout w4a16-mma  v1 (sm_80+): 14 INT4 layers" in table
    assert data["kernel_layouts"] == [{"name": "w4a16-mma", "version": 1, "layers": 14, "mb": rec.size_bytes / 1e6}]


def test_cpu_load_ignores_the_layout_with_one_line(bundles, caplog):
    from edgevlm.runtime import Engine
    from edgevlm.runtime import int4 as int4_mod

    plain, mma = bundles
    int4_mod._MMA_FALLBACK_LOGGED.clear()
    with caplog.at_level(logging.INFO):
        engine = Engine.load(mma.bundle_dir)
    lines = [r.getMessage() for r in caplog.records if "tensor-core kernel unavailable" in r.getMessage()]
    assert len(lines) == 1 and "stored w4a16-mma layout v1 (sm_80+) is ignored" in lines[0]
    model = engine.backend.model
    assert all(m._mma_cache is None for m in model.modules() if isinstance(m, Int4Linear))
    ref = Engine.load(plain.bundle_dir).backend.model
    ids = torch.tensor([[1, 4, 4, 4, 4, 4, 4, 7, 9, 11]])
    pixels = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pixels), ref(ids, pixels), rtol=0, atol=0)


def test_tampered_layout_file_is_refused_by_the_hash(bundles, tmp_path):
    dst = _copy(bundles[1], tmp_path)
    with open(dst / LAYOUT, "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(ModelLoadError, match=f"file {LAYOUT} does not match its SHA-256"):
        verify_bundle(dst)


# ----------------------------------------------------------------------------- the loader's decisions
def _copy(result, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(result.bundle_dir, dst)
    return dst


def _cpu_model(bundle_dir):
    """The bundle's model on CPU (canonical tensors loaded, no kernel layouts attached)."""
    from edgevlm.runtime.bundle import swap_int4_layers
    from edgevlm.runtime.loader import load_weights, read_model_files

    files = read_model_files(bundle_dir)
    manifest = verify_bundle(bundle_dir)
    with torch.device("meta"):
        model = files.family.build_model(files.config)
    swap_int4_layers(model, manifest, device="meta", dtype=torch.float32)
    load_weights(model, files, device="cpu", dtype=torch.float32, keep_suffixes=(".qweight", ".scales", ".zeros"),
                 what="bundle")
    return model, manifest


@pytest.fixture
def sm(monkeypatch):
    """Answer the kernel probe as 'usable' and the compute capability as ``sm[0]`` (default sm_90)."""
    cap = [(9, 0)]
    monkeypatch.setattr("edgevlm.runtime.int4.mma_device_ok", lambda device, note="": True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    return cap


def _rewrite(dst, manifest, **changes):
    rec = manifest.kernel_layouts[0].model_copy(update=changes)
    manifest = manifest.model_copy(update=dict(kernel_layouts=[rec]))
    (dst / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2))
    return verify_bundle(dst)


def _save_layout(dst, tensors):
    """Rewrite the layout file and its SHA-256 (a bundle whose hashes match but whose layout does not)."""
    from safetensors.torch import save_file

    save_file(tensors, str(dst / LAYOUT))
    raw = json.loads((dst / MANIFEST_NAME).read_text())
    for e in raw["files"]:
        if e["path"] == LAYOUT:
            e["sha256"], e["size_bytes"] = sha256_file(dst / LAYOUT), (dst / LAYOUT).stat().st_size
    (dst / MANIFEST_NAME).write_text(json.dumps(raw))


def _no_repack(*args, **kwargs):
    raise AssertionError("repack_int4_mma called: the stored layout was not used")


def test_matching_version_uses_the_stored_layout(bundles, sm, monkeypatch):
    from edgevlm.runtime.kernels.w4a16_mma import w4a16_mma_reference

    model, manifest = _cpu_model(bundles[1].bundle_dir)
    assert attach_kernel_layouts(model, manifest, bundles[1].bundle_dir, torch.device("cpu")) == 14
    monkeypatch.setattr("edgevlm.runtime.int4.repack_int4_mma", _no_repack)
    stored = _tensors(bundles[1].bundle_dir / LAYOUT)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for d in manifest.layers:
        if d.action != "int4":
            continue
        m = model.get_submodule(d.name)
        qw, meta, _ = m._mma_tensors()
        assert torch.equal(qw, stored[d.name + ".mma_qweight"]) and torch.equal(meta, stored[d.name + ".mma_meta"])
        if m.in_features == 192:
            want = x.double() @ m.dequantized_weight(torch.float64).T
            torch.testing.assert_close(w4a16_mma_reference(x, qw, meta, m.group_size), want, rtol=1e-9, atol=1e-9)


def test_canonical_bundle_is_repacked_with_one_info_line(bundles, sm, caplog):
    model, manifest = _cpu_model(bundles[0].bundle_dir)
    with caplog.at_level(logging.INFO, logger="edgevlm.runtime.bundle"):
        assert attach_kernel_layouts(model, manifest, bundles[0].bundle_dir, torch.device("cpu")) == 0
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO and "stores no w4a16-mma layout: repacking 14 INT4 layers" in rec.getMessage()


@pytest.mark.parametrize("changes,cap,needle", [
    (dict(version=MMA_LAYOUT_VERSION + 1), (9, 0), f"v{MMA_LAYOUT_VERSION + 1} (sm_80+), but this edgevlm reads v1"),
    (dict(targets=["sm_90"]), (8, 7), "but it does not serve sm_87"),
])
def test_other_version_or_target_is_repacked_with_one_warning(bundles, sm, caplog, tmp_path, changes, cap, needle):
    dst = _copy(bundles[1], tmp_path)
    manifest = _rewrite(dst, read_manifest(dst), **changes)
    sm[0] = cap
    model, _ = _cpu_model(dst)
    with caplog.at_level(logging.INFO, logger="edgevlm.runtime.bundle"):
        assert attach_kernel_layouts(model, manifest, dst, torch.device("cpu")) == 0
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and needle in rec.getMessage() and "repacking 14 INT4 layers" in rec.getMessage()
    assert all(m._mma_cache is None for m in model.modules() if isinstance(m, Int4Linear))


def test_unknown_layout_name_is_ignored(bundles, sm, caplog, tmp_path):
    dst = _copy(bundles[1], tmp_path)
    manifest = _rewrite(dst, read_manifest(dst), name="w4a16-future")
    model, _ = _cpu_model(dst)
    with caplog.at_level(logging.INFO, logger="edgevlm.runtime.bundle"):
        assert attach_kernel_layouts(model, manifest, dst, torch.device("cpu")) == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert any("stored kernel layout w4a16-future v1 is unknown to this edgevlm: ignored" in m for m in msgs)


KEY = "language_model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.update({KEY + ".mma_meta": t[KEY + ".mma_meta"][:, :1].contiguous()}),
     rf"stored layout tensor {KEY}.mma_meta in {LAYOUT} is torch.int32 \(12, 1, 16\), layer {KEY} needs "
     r"torch.int32 \(12, 3, 16\)"),
    (lambda t: t.update({KEY + ".mma_qweight": t[KEY + ".mma_qweight"].to(torch.int64)}),
     rf"stored layout tensor {KEY}.mma_qweight in {LAYOUT} is torch.int64"),
    (lambda t: t.pop(KEY + ".mma_meta"), rf"has no tensor {KEY}.mma_meta \(INT4 layer {KEY}\)"),
    (lambda t: t.update({"language_model.layers.9.mlp.up_proj.mma_meta": t[KEY + ".mma_meta"].clone()}),
     r"holds tensor language_model.layers.9.mlp.up_proj.mma_meta, which no INT4 layer"),
])
def test_inconsistent_stored_layout_refuses_the_bundle(bundles, sm, tmp_path, edit, needle):
    dst = _copy(bundles[1], tmp_path)
    tensors = _tensors(dst / LAYOUT)
    edit(tensors)
    _save_layout(dst, tensors)
    manifest = verify_bundle(dst)  # the hashes match: the layout itself is wrong
    model, _ = _cpu_model(dst)
    with pytest.raises(ModelLoadError, match=needle):
        attach_kernel_layouts(model, manifest, dst, torch.device("cpu"))


def test_layout_file_outside_the_manifest_is_refused(bundles, sm, tmp_path):
    dst = _copy(bundles[1], tmp_path)
    shutil.copy(dst / LAYOUT, dst / "layouts" / "extra.safetensors")
    manifest = _rewrite(dst, read_manifest(dst), files=[LAYOUT, "layouts/extra.safetensors"])
    model, _ = _cpu_model(dst)
    with pytest.raises(ModelLoadError, match="kernel layout file layouts/extra.safetensors is not listed"):
        attach_kernel_layouts(model, manifest, dst, torch.device("cpu"))


def test_cli_flag_help_states_the_size_cost():
    from edgevlm.quantize.cli import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "--w4a16-layout {canonical,mma}" in help_text and "doubles the INT4 bytes" in help_text


def test_cli_bad_layout_is_one_line_exit_2(capsys):
    from edgevlm.quantize.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["src", "--out", "x", "--w4a16-layout", "marlin"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--w4a16-layout" in err[0] and "marlin" in err[0]


def test_build_option_is_checked(tiny_src, tmp_path):
    from edgevlm.errors import ConfigError

    with pytest.raises(ConfigError, match="w4a16 layout must be one of canonical, mma, got 'marlin'"):
        build_bundle(tiny_src, tmp_path / "b", BuildOptions(**RTN, w4a16_layout="marlin"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_uses_the_stored_layout(bundles, monkeypatch):
    from edgevlm.runtime.int4 import mma_device_ok
    from edgevlm.runtime.loader import load_model, read_model_files

    dev = torch.device("cuda")
    if not mma_device_ok(dev):
        pytest.skip("the W4A16 tensor-core kernel is not usable on this GPU")
    with monkeypatch.context() as mp:  # loading the mma bundle must not repack
        mp.setattr("edgevlm.runtime.int4.repack_int4_mma", _no_repack)
        got = load_model(read_model_files(bundles[1].bundle_dir), device=dev, dtype=torch.bfloat16, max_seq_len=64)
        for m in got.modules():
            if isinstance(m, Int4Linear):
                m._mma_tensors()
    ref = load_model(read_model_files(bundles[0].bundle_dir), device=dev, dtype=torch.bfloat16, max_seq_len=64)
    stored = _tensors(bundles[1].bundle_dir / LAYOUT)
    for name, m in got.named_modules():
        if isinstance(m, Int4Linear):
            qw, meta, _ = m._mma_tensors()
            assert torch.equal(qw.cpu(), stored[name + ".mma_qweight"])
            assert torch.equal(meta.cpu(), stored[name + ".mma_meta"])
    ids = torch.tensor([[1, 4, 4, 4, 4, 4, 4, 7, 9, 11]], device=dev)
    pixels = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(got(ids, pixels), ref(ids, pixels), rtol=0, atol=0)


def test_sharded_layout_is_read_across_files(tiny_src, sm, tmp_path):
    result = build_bundle(tiny_src, tmp_path / "b", BuildOptions(**RTN, w4a16_layout="mma", max_shard_mb=0.05))
    (rec,) = read_manifest(result.bundle_dir).kernel_layouts
    assert len(rec.files) > 1 and rec.files[0] == f"layouts/w4a16-mma-v1-00001-of-{len(rec.files):05d}.safetensors"
    assert not list((result.bundle_dir / "layouts").glob("*.json"))  # the record lists the files: no index
    model, manifest = _cpu_model(result.bundle_dir)
    assert attach_kernel_layouts(model, manifest, result.bundle_dir, torch.device("cpu")) == 14
