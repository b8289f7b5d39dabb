"""Every family's prefill replays a CUDA graph, a single request's and the continuous batcher's rows
alike (:mod:`edgevlm.runtime.prefill_graphs`): the hooks a family computes for its prefill
(``DecoderVLM.prefill_inputs`` / ``prefill_batch_inputs``: M-RoPE tables, Qwen3-VL's DeepStack adds,
Gemma 3's image blocks, pruned LLaVA tokens' positions) padded to the captured buckets
(:func:`~edgevlm.runtime.prefill_graphs.pad_prefill`) give the eager ``prefill``'s logits and KV cache.

On CPU (float32) the backend's graph route runs with the graph replay replaced by the very forward it
captures (``Decoder.prefill_batch`` on the padded inputs): logits and the decode steps after them equal
the eager prefill's, and no op of it reads tensor data on the host (which a capture could not hold:
DeepStack's boolean-mask add did). On CUDA (bf16, skipped without a GPU) the real graphs: the same answers as eager,
one graph per bucket reused, the hooks among the graph's inputs.
"""

from __future__ import annotations

import pytest

from tests.gpu_perf.conftest import make_prompt, rel_err

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FAMILIES = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-gemma3", "tiny-smolvlm", "tiny-internvl"]
#: the hooks each family's prefill of an image prompt hands the decoder
HOOKS = {"tiny-qwen2.5-vl": {"rope"}, "tiny-qwen3-vl": {"rope", "layer_adds"}, "tiny-gemma3": {"image_blocks"},
         "tiny-smolvlm": set(), "tiny-internvl": set()}
SIZES = [(96, 64), (64, 64), (128, 96)]  # (W, H) px of the requests' frames
N_STEPS = 4


def _family(name: str, device: str, max_seq_len: int = 256):
    pytest.importorskip("transformers")
    from edgevlm.quantize.bench_families import build

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ours, _, files = build(name, torch.device(device), dtype, max_seq_len=max_seq_len)
    return ours, files


def _requests(files, device: str, n: int = 2):
    from edgevlm.quantize.bench_families import make_request

    out = []
    for i in range(n):
        ids, vision = make_request(files, SIZES[i % len(SIZES)], n_text=12 + 7 * i, seed=i)
        out.append((ids.to(device), vision))
    return out


class EagerGraphs:
    """What the backend's graph route hands a :class:`~edgevlm.runtime.prefill_graphs.PrefillGraphs`,
    run by the forward it would capture (``Decoder.prefill_batch``); records each call's inputs."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.calls: list[dict] = []

    def __call__(self, embeds, lengths, rows, **hooks):
        self.calls.append({"shape": tuple(embeds.shape[:2]), "lengths": lengths.tolist(), "rows": rows.tolist(),
                           "hooks": hooks})
        return self.lm.prefill_batch(embeds, lengths, rows, **hooks)


def _single(be, ids, vision, forced: list[int] | None = None):
    """Prefill + ``N_STEPS`` greedy decode steps of one request -> ``(logits (1 + n, V) float32, tokens)``."""
    feats = be.encode_vision(vision)
    pos, delta = be.position_ids(ids, vision)
    embeds = be.embed(ids, feats)
    out = [(be.prefill(embeds) if pos is None else be.prefill(embeds, position_ids=pos)).float().clone()]
    toks = [int(out[0].argmax())]
    for i in range(N_STEPS):
        tok = forced[i] if forced is not None else toks[-1]
        out.append(be.decode(tok, ids.shape[1] + i, rope_offset=delta).float().clone())
        toks.append(int(out[-1].argmax()))
    return torch.cat(out), toks


def _batched(be, reqs, rows: list[int], forced: list[list[int]] | None = None, **kw):
    """The continuous batcher's per-row prefill of ``reqs`` into cache ``rows`` + ``N_STEPS`` decode
    steps -> ``(logits (1 + n, len(reqs), V) float32 in request order, tokens per step)``."""
    embeds, ids_of, positions, states, deltas = [], [], [], [], []
    for ids, vision in reqs:
        feats, state = be.encode_vision_state(vision)
        pos, delta = be.position_ids(ids, vision)
        embeds.append(be.embed(ids, feats))
        ids_of.append(ids)
        positions.append(pos)
        states.append(state)
        deltas.append(delta)
    first = be.prefill_batch(embeds, rows, input_ids=ids_of, position_ids=positions, vision_states=states,
                             **kw).float().clone()
    # decode_batch runs cache rows 0..n-1 in order: request i sits in row rows[i]
    order = [rows.index(r) for r in range(len(reqs))]
    out, toks = [first], [[int(first[i].argmax()) for i in range(len(reqs))]]
    for step in range(N_STEPS):
        fed = forced[step] if forced is not None else toks[-1]
        o = be.decode_batch([fed[i] for i in order], [reqs[i][0].shape[1] + step for i in order],
                            [deltas[i] for i in order]).float().clone()
        o = o[[order.index(i) for i in range(len(reqs))]]  # back to request order
        out.append(o)
        toks.append([int(x) for x in o.argmax(-1)])
    return torch.stack(out), toks


# ---------------------------------------------------------------------------------------------- CPU
def test_pad_prefill_pads_every_hook_and_repeats_the_last_row():
    from edgevlm.runtime.prefill_graphs import LENGTH_BUCKET, pad_prefill

    g = torch.Generator().manual_seed(0)
    b, t, d, dh = 2, 5, 4, 6
    embeds = torch.randn(b, t, d, generator=g)
    cos, sin = torch.randn(b, t, dh, generator=g), torch.randn(b, t, dh, generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    feats = [torch.randn(5, d, generator=g) for _ in range(2)]
    blocks = torch.tensor([[-1, 0, 0, -1, -1], [0, -1, 1, 1, -1]])
    hooks = {"rope": (cos, sin), "layer_adds": [(mask, feats[0]), None, (mask, feats[1])], "image_blocks": blocks}
    x, lengths, rows, out = pad_prefill(embeds, torch.tensor([3, 5]), torch.tensor([4, 1]), hooks, 8, [7])
    assert x.shape == (3, 8, d) and torch.equal(x[:2, :t], embeds) and not x[:2, t:].any()
    assert torch.equal(x[2, :t], embeds[1])  # the extra row repeats the last prompt
    assert lengths.tolist() == [3, 5, 5] and rows.tolist() == [4, 1, 7]
    assert torch.equal(out["rope"][0][:2, :t], cos) and not out["rope"][1][:, t:].any()
    assert out["image_blocks"][:, t:].eq(-1).all() and torch.equal(out["image_blocks"][2, :t], blocks[1])
    adds = out["layer_adds"]
    assert adds[1] is None and adds[0][0] is adds[2][0]  # one mask tensor for the layers that share it
    m, f = adds[2]
    assert m.shape == (3, 8) and not m[:, t:].any() and torch.equal(m[2, :t], mask[1])
    assert f.shape == (LENGTH_BUCKET, d)  # 5 + 3 (the extra row's) -> one bucket
    assert torch.equal(f[:5], feats[1]) and torch.equal(f[5:8], feats[1][2:]) and not f[8:].any()
    with pytest.raises(ValueError, match="cannot pad"):
        pad_prefill(embeds, torch.tensor([3, 5]), torch.tensor([4, 1]), {}, 4)


def test_padding_rows_fill_spare_rows_then_repeat_the_last_row():
    """One rule for the bucket's padding rows (the per-row prefill and LLaVA's plain images alike)."""
    from edgevlm.runtime.prefill_graphs import padding_rows

    assert padding_rows([2, 0, 1], [3, 5], 1) == [3]
    assert padding_rows([2, 0, 1], [0, 6], 3) == [6, 1, 1]  # a spare row already in the group is skipped
    assert padding_rows([4], None, 0) == []

def test_add_at_mask_is_index_put_accumulate_and_ignores_padding_rows():
    from edgevlm.runtime.decoder import add_at_mask

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 3, generator=g).to(torch.bfloat16)
    mask = torch.rand(2, 6, generator=g) > 0.5
    n = int(mask.sum())
    feats = torch.randn(n + 4, 3, generator=g)  # 4 padding rows
    want = x.index_put((mask,), feats[:n].to(x.dtype), accumulate=True)
    assert torch.equal(add_at_mask(x, mask, feats), want)
    assert torch.equal(add_at_mask(x, mask, feats[:0]), x)


@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_padded_one_row_prefill_equals_eager_prefill(name, monkeypatch):
    """The single request's graph route (the family's ``prefill_inputs``, padded to the length
    bucket, ``Decoder.prefill_batch`` of one row) gives ``model.prefill``'s logits, and the decode
    steps after it (the KV cache it wrote) the same logits too (float32)."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend
    from edgevlm.runtime.prefill_graphs import length_bucket

    ours, files = _family(name, "cpu")
    be = TorchBackend(ours)
    reqs = _requests(files, "cpu")
    refs = [_single(be, ids, vision) for ids, vision in reqs]
    graphs = EagerGraphs(ours.language_model)
    monkeypatch.setattr(be, "_prefill_graphs_for_device", lambda: graphs)
    for (ids, vision), (want, want_toks) in zip(reqs, refs, strict=True):
        got, toks = _single(be, ids, vision, forced=want_toks[:-1])
        assert rel_err(got[:1], want[:1]) < 1e-5  # the prefill's logits
        assert rel_err(got, want) < 1e-5 and toks == want_toks  # and the decode steps over its cache
    assert [c["shape"] for c in graphs.calls] == [(1, length_bucket(ids.shape[1], 256)) for ids, _ in reqs]
    assert [c["lengths"] for c in graphs.calls] == [[ids.shape[1]] for ids, _ in reqs]
    for call in graphs.calls:
        assert set(call["hooks"]) == HOOKS[name]
        for add in call["hooks"].get("layer_adds", []):  # DeepStack: its features padded to a bucket
            assert add[1].shape[0] % 64 == 0 and int(add[0].sum()) <= add[1].shape[0]
    # the side state was handed over as the eager prefill hands it over
    assert getattr(ours, "_deepstack", []) == [] and getattr(ours, "_pending", None) is None


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("cache_rows", [4, 3])
def test_cpu_padded_batched_rows_equal_single_prefills(name, cache_rows, monkeypatch):
    """The continuous batcher's per-row prefill (``TorchBackend.prefill_batch``) through the graph
    route: 3 prompts padded to 4 rows (a spare cache row, or with 3 cache rows the last prompt
    written again into its own row) and to the length bucket give each prompt's single eager prefill
    and decode steps (float32)."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    ours, files = _family(name, "cpu")
    single = TorchBackend(ours)
    reqs = _requests(files, "cpu", n=3)
    refs = [_single(single, ids, vision) for ids, vision in reqs]
    be = TorchBackend(ours, max_batch_size=cache_rows)
    graphs = EagerGraphs(ours.language_model)
    monkeypatch.setattr(be, "_prefill_graphs_for_device", lambda: graphs)
    rows = [2, 0, 1]
    forced = [[refs[i][1][s] for i in range(3)] for s in range(N_STEPS)]
    got, toks = _batched(be, reqs, rows, forced, spare_rows=[3] if cache_rows == 4 else [])
    for i in range(3):
        assert rel_err(got[:, i], refs[i][0]) < 1e-4, i
    assert [[t[i] for t in toks] for i in range(3)] == [r[1] for r in refs]
    (call,) = graphs.calls
    assert call["shape"][0] == 4 and call["shape"][1] % 64 == 0
    assert call["rows"] == rows + [3 if cache_rows == 4 else 1]  # the padding row: spare, else the last prompt's
    assert set(call["hooks"]) == HOOKS[name]


#: aten ops that read tensor data on the host (a sync: a CUDA graph capture fails on them)
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "is_nonzero", "item", "equal",
              "allclose", "unique", "_unique2"}


class HostReads:
    """Records the host-reading aten ops (:data:`HOST_READS`, and indexing by a bool mask, which counts
    it on the host) that run in its ``with`` block: what a CUDA graph could not capture, seen on CPU."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        found = self.found = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                idx = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else args[1:2]
                if name in HOST_READS or (name.startswith("index") and any(
                        isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx)):
                    found.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_host_read_probe_sees_the_boolean_deepstack_add():
    from edgevlm.runtime.decoder import add_at_mask

    x, mask, feats = torch.zeros(1, 4, 2), torch.tensor([[True, False, True, False]]), torch.ones(2, 2)
    with HostReads() as probe:
        x.index_put((mask,), feats, accumulate=True)  # DeepStack's add before: not capturable
    assert probe.found == ["index_put"]
    with HostReads() as probe:
        add_at_mask(x, mask, feats)
    assert probe.found == []


@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_captured_prefill_reads_nothing_on_the_host(name, monkeypatch):
    """What the graph captures (the padded ``Decoder.prefill_batch`` with every hook, one row and three
    rows padded to four) runs no op that reads tensor data on the host: CUDA graph capture would fail
    (and fall back to eager) on such an op."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    ours, files = _family(name, "cpu")
    be = TorchBackend(ours, max_batch_size=4)
    found: list[str] = []

    def graphs(embeds, lengths, rows, **hooks):
        with HostReads() as probe:
            out = ours.language_model.prefill_batch(embeds, lengths, rows, **hooks)
        found.extend(probe.found)
        return out

    monkeypatch.setattr(be, "_prefill_graphs_for_device", lambda: graphs)
    reqs = _requests(files, "cpu", n=3)
    _batched(be, reqs, [0, 1, 2])
    ids, vision = reqs[0]
    feats = be.encode_vision(vision)
    pos, _ = be.position_ids(ids, vision)
    embeds = be.embed(ids, feats)
    be.prefill(embeds) if pos is None else be.prefill(embeds, position_ids=pos)
    assert found == []


def test_cpu_pruned_llava_prefill_through_the_graph_route(make_backend, monkeypatch):
    """LLaVA's pruned vision tokens keep their unpruned RoPE positions: ``prefill_inputs`` hands the
    decoder those tables, and the padded one-row prefill equals the eager one."""
    from edgevlm.types import OperatingPoint

    be = make_backend()
    ids, px = make_prompt(3, 6)
    op = OperatingPoint(name="p", keep_ratio=0.5)

    def run():
        feats = be.encode_image(px, operating_point=op)
        pruned = [i for i in ids if i != 4][:3] + [4] * feats.shape[1] + [i for i in ids if i != 4][3:]
        return be.prefill(be.embed(torch.tensor([pruned]), feats)).clone()

    want = run()
    graphs = EagerGraphs(be.model.language_model)
    monkeypatch.setattr(be, "_prefill_graphs_for_device", lambda: graphs)
    assert rel_err(run(), want) < 1e-5
    assert set(graphs.calls[0]["hooks"]) == {"rope"}
    assert be.model._rope_positions is None  # handed over



def test_qwen3_prefill_refuses_deepstack_features_of_another_encode():
    """``add_at_mask`` (the graph-capturable DeepStack add) reads features by the mask's running count and
    leaves the count check to its callers: a single request's prefill whose DeepStack features came from
    another encode than the embedded vision tokens (other count) raises, as ``index_put`` did, instead of
    adding clamped rows."""
    ours, files = _family("tiny-qwen3-vl", "cpu")
    (ids, vision), (_, other) = _requests(files, "cpu", n=2)  # frames of other sizes: other token counts
    pos, _ = ours.position_ids(ids, vision)
    embeds = ours.embed(ids, ours.encode_vision(vision))
    ours.encode_vision(other)  # its DeepStack features replace this request's
    with pytest.raises(ValueError, match="DeepStack"):
        ours.prefill(embeds, position_ids=pos)
    assert ours._deepstack == [] and ours._vision_mask is None  # the stale state is dropped, not kept


# --------------------------------------------------------------------------------------------- CUDA
def _keys_hooks(graphs) -> list[set]:
    """The hooks present in each kept graph's key (see PrefillGraphs.keys)."""
    out = []
    for (_base, rope, adds, blocks), _ in graphs.keys():
        out.append({h for h, v in (("rope", rope), ("layer_adds", adds), ("image_blocks", blocks)) if v is not None})
    return out


@needs_cuda
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_single_request_prefill_graphs_equal_eager(name):
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    ours, files = _family(name, "cuda")
    reqs = _requests(files, "cuda")
    eager = TorchBackend(ours, cuda_graphs=False)
    refs = [_single(eager, ids, vision) for ids, vision in reqs]
    graphed = TorchBackend(ours, cuda_graphs=True)
    captured = []
    for _ in range(2):  # the second round replays the graphs the first captured
        for (ids, vision), (want, want_toks) in zip(reqs, refs, strict=True):
            got, toks = _single(graphed, ids, vision, forced=want_toks[:-1])
            print(f"rel_err {name} single prefill {rel_err(got[:1], want[:1]):.3g} all {rel_err(got, want):.3g}")
            assert rel_err(got[:1], want[:1]) < 2e-2 and toks[0] == want_toks[0]
            assert rel_err(got, want) < 2e-2 and toks == want_toks
        captured.append(len(graphed._prefill_graphs.capture_ms))
    graphs = graphed._prefill_graphs
    assert not graphs._eager  # captured, and the capture-time check against eager passed
    assert captured[0] == captured[1] == len(graphs) <= len(reqs)  # one per key, reused in the second round
    assert all(hooks == HOOKS[name] for hooks in _keys_hooks(graphs))


@needs_cuda
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_batched_rows_prefill_graphs_equal_eager(name):
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    ours, files = _family(name, "cuda")
    reqs = _requests(files, "cuda", n=3)
    eager = TorchBackend(ours, cuda_graphs=False, max_batch_size=4)
    graphed = TorchBackend(ours, cuda_graphs=True, max_batch_size=4)
    for rows in ([0, 1, 2], [2, 0, 1]):  # the second round replays the first round's graph into other rows
        want, want_toks = _batched(eager, reqs, rows)
        got, toks = _batched(graphed, reqs, rows, forced=want_toks[:N_STEPS])
        print(f"rel_err {name} batched rows {rows} prefill {rel_err(got[0], want[0]):.3g} all {rel_err(got, want):.3g}")
        assert toks == want_toks
        for i in range(3):
            assert rel_err(got[:, i], want[:, i]) < 2e-2, i
    graphs = graphed._prefill_graphs
    assert not graphs._eager and len(graphs) == 1  # 3 rows -> one graph of 4 rows, replayed
    assert _keys_hooks(graphs) == [HOOKS[name]]
    (key,) = graphs.keys()
    assert key[1][0][0][0] == 4  # embeds (4, T, D)


@needs_cuda
def test_cuda_qwen3_deepstack_and_gemma3_image_blocks_change_the_graphs_answer():
    """The hooks really are graph inputs: a replay with the DeepStack adds (Qwen3-VL) and with the
    image blocks (Gemma 3) of another request than the captured one follows that request (its
    eager logits), not the captured inputs."""
    from edgevlm.runtime.backends.torch_backend import TorchBackend

    for name in ("tiny-qwen3-vl", "tiny-gemma3"):
        ours, files = _family(name, "cuda")
        from edgevlm.quantize.bench_families import make_request

        ids, vision = make_request(files, (96, 64), n_text=12, seed=0)
        other_ids, other_vision = make_request(files, (96, 64), n_text=14, seed=5)  # the image 1 later
        ids, other_ids = ids.cuda(), other_ids.cuda()
        eager = TorchBackend(ours, cuda_graphs=False)
        graphed = TorchBackend(ours, cuda_graphs=True)
        want = _single(eager, other_ids, other_vision)[0][:1]
        _single(graphed, ids, vision)  # captures
        got = _single(graphed, other_ids, other_vision)[0][:1]  # replays with the other request's hooks
        assert len(graphed._prefill_graphs.capture_ms) == 1
        assert rel_err(got, want) < 2e-2
