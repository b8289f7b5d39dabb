"""The Triton fused patch-embedding + LayerNorm kernel: argument checks everywhere, numerics through
Triton's CPU interpreter when triton is installed (bf16 is checked on the GPU by bench/gpu_suite.py)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

torch = pytest.importorskip("torch")

from triton_support import run_interpreted  # noqa: E402


def test_fused_stem_option_without_cuda_is_a_load_error(make_backend):
    from edgevlm.errors import ModelLoadError

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the option is valid here")
    with pytest.raises(ModelLoadError, match="fused_vision_stem"):
        make_backend(fused_vision_stem=True)


def test_fused_stem_rejects_mismatched_shapes():
    from edgevlm.runtime.kernels.patch_embed_ln import fused_patch_embed_layernorm

    w = torch.randn(32, 3, 16, 16)
    d = torch.ones(32)
    with pytest.raises(ValueError, match="patch embedding"):
        fused_patch_embed_layernorm(torch.randn(1, 3, 30, 32), w, d, torch.randn(3, 32), d, d, 1e-5)
    with pytest.raises(ValueError, match="pos_embed"):
        fused_patch_embed_layernorm(torch.randn(1, 3, 32, 32), w, d, torch.randn(4, 32), d, d, 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        fused_patch_embed_layernorm(torch.randn(1, 3, 32, 32), w, d, torch.randn(5, 32), d, d, 1e-5,
                                    out=torch.empty(1, 4, 32))


SCRIPT = textwrap.dedent("""
    import json, torch
    from edgevlm.runtime.models.llava.config import VisionConfig
    from edgevlm.runtime.vision import VisionEmbeddings
    from edgevlm.runtime.kernels.patch_embed_ln import FusedVisionStem, fused_patch_embed_layernorm
    torch.manual_seed(0)
    out = []
    for d, p, img, (h, w) in [(48, 14, 56, (56, 42)), (32, 16, 64, (64, 64))]:
        cfg = VisionConfig(hidden_size=d, patch_size=p, image_size=img, num_attention_heads=4)
        emb, ln = VisionEmbeddings(cfg), torch.nn.LayerNorm(d)
        with torch.no_grad():
            for prm in list(emb.parameters()) + list(ln.parameters()):
                prm.normal_(0, 0.5)
        ref64 = None
        px = torch.randn(3, 3, h, w)
        with torch.no_grad():
            ref64 = ln.double()(emb.double()(px.double()))
            for dt in (torch.float32, torch.float16):
                e, n = emb.to(dt), ln.to(dt)
                poisoned = torch.full((3, 1 + (h // p) * (w // p), d), float("nan"), dtype=dt)
                fused_patch_embed_layernorm(px, e.patch_embedding.weight, e.class_embedding,
                                            e.position_embeddings(h // p, w // p), n.weight, n.bias, n.eps,
                                            out=poisoned)
                mod = FusedVisionStem(e, n)(px)
                err = float((poisoned.double() - ref64).norm() / ref64.norm())
                out.append([str(dt), d, p, err, bool(torch.isfinite(poisoned).all()),
                            float((mod.double() - poisoned.double()).abs().max())])
    print(json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_stem_matches_float64_in_the_triton_interpreter():
    rows = run_interpreted(SCRIPT)
    assert len(rows) == 4
    for dtype, _d, _p, err, finite, module_diff in rows:
        assert finite  # every element written (the output was poisoned with NaN)
        assert err < (1e-5 if dtype == "torch.float32" else 2e-3)
        assert module_diff == 0.0
