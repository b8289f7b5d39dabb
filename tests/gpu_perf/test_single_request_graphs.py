"""A single request's vision encode and prefill replay CUDA graphs (TorchBackend.encode_image /
encode_vision / prefill with ``cuda_graphs``): the same answer as the eager path, graphs reused per
length bucket; a pruned operating point (its tokens at their unpruned RoPE positions) replays a graph
of its own with the RoPE tables as an input. Every family's hooks: ``test_prefill_graphs_families.py``.
What the families hand the graph (``prefill_inputs``) is checked on CPU; the CUDA parts skip without a
GPU."""

from __future__ import annotations

import pytest

from tests.gpu_perf.conftest import make_prompt, rel_err

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _family(name: str, device: str):
    pytest.importorskip("transformers")
    from edgevlm.quantize.bench_families import build, make_request

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ours, _, files = build(name, torch.device(device), dtype, max_seq_len=256)
    return ours, files, make_request


def test_llava_prefill_inputs_hand_over_pruned_positions(make_backend):
    from edgevlm.types import OperatingPoint

    be = make_backend()
    model = be.model
    ids, px = make_prompt(3, 6)
    assert model.prefill_inputs(model.embed(torch.tensor([ids]), model.encode_image(px))) == {}
    feats, _ = model.encode_image_adaptive(px, OperatingPoint(name="p", keep_ratio=0.5))
    n_kept = feats.shape[1]
    pruned_ids = [i for i in ids if i != 4][:3] + [4] * n_kept + [i for i in ids if i != 4][3:]
    embeds = model.embed(torch.tensor([pruned_ids]), feats)
    hooks = model.prefill_inputs(embeds)  # the pruned tokens' RoPE positions, handed over
    assert set(hooks) == {"rope"} and hooks["rope"][0].shape == (1, len(pruned_ids), model.cfg.text.head_dim)
    assert model.prefill_inputs(embeds) == {}


@pytest.mark.parametrize("name, hooks", [("tiny-smolvlm", set()), ("tiny-internvl", set()),
                                         ("tiny-gemma3", {"image_blocks"}), ("tiny-qwen2.5-vl", {"rope"}),
                                         ("tiny-qwen3-vl", {"rope", "layer_adds"})])
def test_family_prefill_inputs(name, hooks):
    ours, files, make_request = _family(name, "cpu")
    ids, vision = make_request(files, (64, 64), n_text=12)
    embeds = ours.embed(ids, ours.encode_vision(vision))
    pos, _ = ours.position_ids(ids, vision)
    assert set(ours.prefill_inputs(embeds, pos)) == hooks
    if pos is None:  # 1-D RoPE: no positions taken; a text-only prompt is the plain causal prefill
        with pytest.raises(ValueError, match="1-D RoPE"):
            ours.prefill_inputs(embeds, torch.zeros(3, 1, ids.shape[1], dtype=torch.long))
        assert ours.prefill_inputs(ours.embed(ids)) == {}


@needs_cuda
def test_single_request_graphs_equal_eager_on_cuda(perf_files):
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.loader import load_model

    model = load_model(perf_files, device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=300)

    def run(be, ids, px, forced=None):
        ids_dev = torch.tensor([ids], device="cuda")
        feats = be.encode_image(px)
        out = [be.prefill(be.embed(ids_dev, feats)).float().clone()]
        toks = [int(out[0].argmax())]
        for i in range(8):
            out.append(be.decode(forced[i] if forced else toks[-1], len(ids) + i).float().clone())
            toks.append(int(out[-1].argmax()))
        return feats.float().clone(), torch.cat(out), toks

    eager = TorchBackend(model, cuda_graphs=False)
    prompts = [make_prompt(6, 9), make_prompt(7, 12), make_prompt(8, 9, height_px=32)]
    refs = [run(eager, ids, px) for ids, px in prompts]
    graphed = TorchBackend(model, cuda_graphs=True)
    for (ids, px), (fe, le, te) in zip(prompts, refs, strict=True):
        fg, lg, tg = run(graphed, ids, px, te[:-1])
        assert rel_err(fg, fe) < 1e-2
        assert rel_err(lg, le) < 2e-2 and tg == te
    # one prefill graph per length bucket: all three prompts fit the first 64 positions
    assert len(graphed._prefill_graphs) == 1
    assert len(graphed._vision_graphs[None]) == 2  # two input sizes, one batch bucket
    # a pruned operating point (its tokens at their unpruned positions) replays a graph with RoPE tables
    from edgevlm.types import OperatingPoint

    ids, px = prompts[0]
    op = OperatingPoint(name="p", keep_ratio=0.5)

    def pruned_prefill(be):
        feats = be.encode_image(px, operating_point=op)
        pruned = [i for i in ids if i != 4][:3] + [4] * feats.shape[1] + [i for i in ids if i != 4][3:]
        return be.prefill(be.embed(torch.tensor([pruned], device="cuda"), feats)).float().clone()

    want = pruned_prefill(eager)
    assert rel_err(pruned_prefill(graphed), want) < 2e-2
    assert len(graphed._prefill_graphs) == 2 and not graphed._prefill_graphs._eager
    assert rel_err(pruned_prefill(graphed), want) < 2e-2 and len(graphed._prefill_graphs) == 2  # replayed


@needs_cuda
def test_pixels_on_the_device_and_several_images_encode_through_the_graphs(perf_files):
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.loader import load_model

    model = load_model(perf_files, device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=300)
    eager = TorchBackend(model, cuda_graphs=False)
    graphed = TorchBackend(model, cuda_graphs=True)
    px = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    want = eager.encode_image(px)
    assert rel_err(graphed.encode_image(px.cuda()), want) < 1e-2  # 3 images: the 4-row bucket, rows cut
    assert rel_err(graphed.encode_image(px), want) < 1e-2  # from the host: pinned staging
    first = graphed.encode_image(px[:1])
    second = graphed.encode_image(px[1:2])  # a later frame does not overwrite the first one's features
    assert rel_err(first, want[:1]) < 1e-2 and rel_err(second, want[1:2]) < 1e-2


@needs_cuda
@pytest.mark.parametrize("name", ["tiny-smolvlm", "tiny-internvl"])
def test_image_token_families_single_request_graphs_equal_eager(name):
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    ours, files, make_request = _family(name, "cuda")
    ids, vision = make_request(files, (64, 64), n_text=12)
    ids = ids.cuda()

    def run(be):
        feats = be.encode_vision(vision)
        return be.prefill(be.embed(ids, feats)).float().clone()

    want = run(TorchBackend(ours, cuda_graphs=False))
    graphed = TorchBackend(ours, cuda_graphs=True)
    got = run(graphed)
    assert rel_err(got, want) < 2e-2 and int(got.argmax()) == int(want.argmax())
    assert len(graphed._prefill_graphs) == 1
    assert rel_err(run(graphed), want) < 2e-2  # the replay
