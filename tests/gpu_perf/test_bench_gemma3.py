"""``edgevlm bench`` on the Gemma 3 family (quantize/bench_families.py), on CPU: ``tiny-gemma3`` (Gemma-3-4B-it's
structure: sliding / full layers, a window of 8 shorter than the 50-token prompt, SigLIP + pooling; transformers'
model and ours over the same random tensors) through every variant at batch 1 and 2, transformers given the
``token_type_ids`` its processor returns (each image bidirectional, as ours), and the published 4B shape.

Run: ``.venv/bin/python -m pytest -q tests/gpu_perf/test_bench_gemma3.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.gpu_perf.test_bench_families import _bench, _check_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_tiny_gemma3_on_cpu(tmp_path, capsys):
    from edgevlm.quantize.benchmark import VARIANTS

    lines, summary = _bench(["--models", "tiny-gemma3", "--batch-sizes", "1,2", "--sizes", "96x48"], capsys,
                            tmp_path)
    assert any(line.startswith("parity tiny-gemma3: ") for line in lines)
    rows = _check_rows(summary, ["tiny-gemma3"], ("transformers", *VARIANTS), ("96x48",), (1, 2))
    assert summary["parity"]["tiny-gemma3"]["ours_vs_hf"] < 1e-4  # measured 0 (fp32, same weights)
    by = {(r["impl"], r["batch"]): r for r in rows}
    for (impl, b), r in by.items():
        assert r["prompt_tokens"] == 50 and r["vision_tokens"] == 16
        if impl.startswith("edgevlm-w4"):
            assert r["weight_bytes"] < by[("edgevlm", b)]["weight_bytes"]
        if impl == "edgevlm-w4-kv4":
            assert r["kv_bytes_per_token"] * 3 < by[("edgevlm", b)]["kv_bytes_per_token"]


def test_token_type_ids_make_transformers_run_images_bidirectionally():
    """Without ``token_type_ids`` transformers' Gemma 3 runs the image causally and its logits leave ours
    (measured 6.9e-2 relative); with them the two are equal (measured 0)."""
    from edgevlm.quantize import bench_families as bf

    cpu = torch.device("cpu")
    ours, hf, files = bf.build("tiny-gemma3", cpu, torch.float32, 256)
    ids, vision = bf.make_request(files, (96, 48))
    kw = bf._hf_inputs(hf, files, ids, vision, cpu, torch.float32)
    assert kw["token_type_ids"].sum() == vision.num_tokens == 16
    assert bf.parity(ours, hf, files, ids, vision, cpu, torch.float32)["ours_vs_hf"] < 1e-4
    kw.pop("token_type_ids")
    with torch.no_grad():
        causal = hf(**kw, logits_to_keep=1).logits[0, -1].double()
        ours_logits = ours.prefill(ours.embed(ids, ours.encode_vision(vision)))[0].double()
    assert float((causal - ours_logits).norm() / ours_logits.norm()) > 1e-2


def test_gemma3_4b_published_shape_parses_in_both_runtimes():
    from edgevlm.quantize.bench_families import FAMILY_MODEL_NAMES, model_files

    assert {"gemma3-4b", "tiny-gemma3"} <= set(FAMILY_MODEL_NAMES)
    hf_cfg, files = model_files("gemma3-4b")
    text = files.config.text
    assert files.family.name == "gemma3"
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim, text.intermediate_size) == (34, 2560, 8, 4, 256, 10240)
    assert text.sliding_layer_window == 1024 and text.layer_types.count("full_attention") == 5
    assert files.config.image_seq_len == 256 and hf_cfg.text_config.query_pre_attn_scalar == 256
