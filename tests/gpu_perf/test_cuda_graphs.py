"""CUDA-graph decode: CPU fallback and errors here; graph == eager where a GPU exists."""

from __future__ import annotations

import pytest

from tests.gpu_perf.conftest import make_prompt, rel_err, run_single

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graph_batch_sizes():
    from edgevlm.runtime.cuda_graphs import graph_batch_size

    assert [graph_batch_size(n, 32) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert graph_batch_size(5, 6) == 6


def test_decode_graphs_refuse_a_cpu_model(make_backend):
    from edgevlm.runtime.cuda_graphs import DecodeGraphs

    with pytest.raises(RuntimeError, match="CUDA device"):
        DecodeGraphs(make_backend().model.language_model)


def test_cuda_graphs_option_falls_back_to_eager_on_cpu(make_backend):
    ids, px = make_prompt(5, 6)
    be = make_backend(cuda_graphs=True)
    assert not be.cuda_graphs and be.graphs is None
    logits, tokens = run_single(be, ids, px, 5)
    ref_logits, ref_tokens = run_single(make_backend(), ids, px, 5)
    assert tokens == ref_tokens and rel_err(logits, ref_logits) == 0.0


@needs_cuda
@pytest.mark.parametrize("kv", [None, "int4"])
def test_graph_decode_equals_eager_on_cuda(perf_files, kv):
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.loader import load_model

    model = load_model(perf_files, device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=300)
    ids, px = make_prompt(6, 9)
    eager = TorchBackend(model, cuda_graphs=False, kv_cache_dtype=kv)

    def run(be, forced=None):
        ids_dev = torch.tensor([ids], device="cuda")
        out = [be.prefill(be.embed(ids_dev, be.encode_image(px))).float().clone()]
        toks = [int(out[0].argmax())]
        for i in range(12):
            out.append(be.decode(forced[i] if forced else toks[-1], len(ids) + i).float().clone())
            toks.append(int(out[-1].argmax()))
        return torch.cat(out), toks

    le, te = run(eager)
    graphed = TorchBackend(model, cuda_graphs=True, kv_cache_dtype=kv)
    lg, tg = run(graphed, te[:-1])
    assert len(graphed.graphs) >= 1
    assert rel_err(lg, le) < 1e-3 and tg == te
