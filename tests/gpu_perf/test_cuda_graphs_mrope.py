"""CUDA-graph decode of the multimodal-RoPE families (Qwen2.5-VL, Qwen3-VL) and SmolVLM: graph replay
logits equal eager logits at batch 1 (``decode`` with the prompt's rope delta) and at batch 3 (a
captured batch of 4 with per-row positions and rope offsets as graph inputs: the rows' deltas
change between rounds while the same graphs replay). CUDA only: skips cleanly without a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import family_support as fs  # noqa: E402

N_STEPS = 10
GRAPH_TOL = 1e-3  # relative L2 of bf16 logits, graph vs eager (the same kernels: ~0)


@pytest.fixture(scope="module", params=fs.FAMILIES)
def family_dir(request, tmp_path_factory):
    return fs.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _load(folder, **options):
    from edgevlm.runtime import Engine

    return Engine.load(folder, device="cuda", backend_options=options)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _prefill(engine, prepared):
    be = engine.backend
    ids = torch.tensor([prepared.ids], device="cuda")
    position_ids, delta = be.position_ids(ids, prepared.vision)
    embeds = be.embed(ids, be.encode_vision(prepared.vision))
    first = be.prefill(embeds) if position_ids is None else be.prefill(embeds, position_ids=position_ids)
    return first.float().clone(), delta


@needs_cuda
def test_batch1_graph_decode_equals_eager(family_dir):
    eager, graphed = _load(family_dir, cuda_graphs=False), _load(family_dir, cuda_graphs=True)
    assert graphed.backend.cuda_graphs and not eager.backend.cuda_graphs
    family = eager.family.name
    for im, p, n in fs.requests(family):
        prep = eager.prepare(im, p, max_new_tokens=n)
        runs = {}
        for name, engine in (("eager", eager), ("graph", graphed)):
            first, delta = _prefill(engine, prep)
            out, toks = [first], [int(first.argmax())]
            ref_toks = runs["eager"][1] if name == "graph" else None  # teacher-force the eager tokens
            for i in range(N_STEPS):
                tok = ref_toks[i] if ref_toks else toks[-1]
                out.append(engine.backend.decode(tok, len(prep.ids) + i, rope_offset=delta).float().clone())
                toks.append(int(out[-1].argmax()))
            runs[name] = (torch.cat(out), toks, delta)
        assert (runs["eager"][2] != 0) == family.startswith("qwen")  # M-RoPE: a real rope delta
        assert _rel(runs["graph"][0], runs["eager"][0]) < GRAPH_TOL
        assert runs["graph"][1] == runs["eager"][1]
    assert len(graphed.backend.graphs) >= 1


@needs_cuda
def test_batched_graph_decode_with_per_row_rope_offsets_equals_eager(family_dir):
    eager = _load(family_dir, cuda_graphs=False, max_batch_size=4)
    graphed = _load(family_dir, cuda_graphs=True, max_batch_size=4)
    preps = [eager.prepare(im, p, max_new_tokens=n) for im, p, n in fs.requests(eager.family.name)]
    for rows in ([0, 1, 2], [2, 0, 1]):  # second round: other deltas per row, the same graphs replayed
        logits = {}
        for name, engine in (("eager", eager), ("graph", graphed)):
            be = engine.backend
            embeds, ids_of, positions, states, deltas = [], [], [], [], []
            for p in preps:
                ids = torch.tensor([p.ids], device="cuda")
                feats, state = be.encode_vision_state(p.vision)
                position_ids, delta = be.position_ids(ids, p.vision)
                embeds.append(be.embed(ids, feats))
                ids_of.append(ids)
                positions.append(position_ids)
                states.append(state)
                deltas.append(delta)
            first = be.prefill_batch(embeds, rows, input_ids=ids_of, position_ids=positions,
                                     vision_states=states).float().clone()
            by_row = {row: i for i, row in enumerate(rows)}
            order = [by_row[r] for r in range(3)]
            toks = [int(first[i].argmax()) for i in order]
            if name == "graph":
                ref_toks = logits["eager"][1]
            out, fed = [first[order]], []
            for step in range(N_STEPS):
                step_toks = ref_toks[step] if name == "graph" else toks
                fed.append(step_toks)
                o = be.decode_batch(step_toks, [len(preps[i].ids) + step for i in order],
                                    [deltas[i] for i in order]).float().clone()
                out.append(o)
                toks = [int(x) for x in o.argmax(-1)]
            logits[name] = (torch.stack(out), fed)
        assert logits["graph"][1] == logits["eager"][1]
        assert _rel(logits["graph"][0], logits["eager"][0]) < GRAPH_TOL
    assert any(key[0] == 4 for key in graphed.backend.graphs.capture_ms)  # 3 rows ran as a captured batch of 4
