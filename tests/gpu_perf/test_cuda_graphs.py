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


@needs_cuda
def test_feeding_graphs_give_the_tokens_of_graph_decode_and_argmax(perf_files):
    """Greedy decoding through the feeding graphs (``greedy_tokens`` / ``greedy_step``: the next token
    and slot written on the device, step k + 1 queued before token k is read) against the plain graphs
    driven from the host (``decode`` + ``argmax``): the same tokens, single and batched, across a KV
    bucket boundary, with a request stopped early in between."""
    from edgevlm.runtime.backends import Backend
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.loader import load_model

    model = load_model(perf_files, device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=600)
    be = TorchBackend(model, cuda_graphs=True, max_batch_size=4)
    prompts = [make_prompt(6, 9), make_prompt(7, 11), make_prompt(8, 5)]

    def prefill(i, row=0):
        ids, px = prompts[i]
        ids_dev = torch.tensor([ids], device="cuda")
        embeds = be.embed(ids_dev, be.encode_image(px))
        logits = be.prefill(embeds) if row == 0 else be.prefill_batch([embeds], [row])
        return int(logits[0].argmax()), len(ids)

    n = 300 - len(prompts[0][0]) + 20  # crosses the 256 -> 512 bucket
    first, pos = prefill(0)
    want = list(Backend.greedy_tokens(be, first, pos, n))
    prefill(0)
    stream = be.greedy_tokens(first, pos, n)
    assert [next(stream) for _ in range(3)] == want[:3]
    stream.close()  # stopped early: one queued step runs ahead
    prefill(0)
    assert list(be.greedy_tokens(first, pos, n)) == want
    assert any(key[2] for key in be.graphs._graphs)  # feeding graphs were captured and replayed
    refs = {}
    for i in range(3):
        f, p = prefill(i)
        refs[i] = (f, p, list(Backend.greedy_tokens(be, f, p, 40)))
    for i in range(3):
        prefill(i, row=i)
    pending, got = None, {0: [], 1: [], 2: []}
    for step in range(41):
        new = {i: (refs[i][0], refs[i][1], 0) for i in range(3)} if step == 0 else {}
        queued = be.greedy_step(3, new) if step < 40 else None  # graph batch 4: one padding row fed along
        if pending is not None:
            out = pending.tokens()
            for i in range(3):
                got[i].append(out[i])
        pending = queued
    for i in range(3):
        assert got[i] == refs[i][2]
