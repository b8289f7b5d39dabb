"""Early exit and token pruning on the CLS-free ViTs of Qwen2.5-VL, Qwen3-VL and SmolVLM2
(:mod:`edgevlm.runtime.adaptive`, the families' ``exit_run``), and ``edgevlm calibrate`` on them.

Tiny random checkpoints from the families' own test builders (transformers' models, saved). The
exit path is checked against the towers' own ``forward`` with the blocks after the exit removed
and the adapter put in front of the connector; an exit "at" the last block against the full
model's logits; pruning against the full connector output and the unpruned prompt's multimodal
RoPE positions.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from family_support import write_checkpoint  # noqa: E402

from edgevlm.quantize import calibrate  # noqa: E402
from edgevlm.runtime.engine import Engine  # noqa: E402
from edgevlm.runtime.exits import ExitHeads, make_spec  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm")
QUESTION = "how many shapes are there?"
FAST = ["--steps", "2", "--batch-size", "1", "--agreement-images", "5", "--questions-per-image", "1",
        "--no-frontier", "--threads", "1"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(checkpoint[1])


def _image(h: int = 96, w: int = 128, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


_RANDOMIZE = []


@pytest.fixture(autouse=True)
def _randomizer(randomize_heads):
    _RANDOMIZE[:] = [randomize_heads]


def _heads(engine: Engine, blocks: list[int], seed: int = 0, query: bool = False) -> ExitHeads:
    """Random exit heads at ``blocks`` for ``engine``'s model, attached to it; returns them."""
    heads = _RANDOMIZE[0](ExitHeads(make_spec(engine.config, exit_blocks=blocks, labels=[], head_hidden=16,
                                          confidence_query=query)), seed)
    engine.backend.model.attach_exit_heads(heads)
    return engine.backend.model.exit_heads


class _Batch1(torch.nn.Module):
    """``(N, D)`` -> ``adapter((1, N, D))[0]``: an exit adapter in front of a connector that takes rows."""

    def __init__(self, adapter: torch.nn.Module) -> None:
        super().__init__()
        self.adapter = adapter

    def forward(self, x):
        return self.adapter(x[None])[0]


def _truncated_by_hand(family: str, model, heads: ExitHeads, vision, k: int):
    """``(vision tokens, DeepStack features)`` of the tower's own forward with blocks ``k+1..`` removed
    and exit ``k``'s adapter in front of the connector."""
    adapter = heads.adapters[str(k)]
    if family == "smolvlm":
        tower = copy.deepcopy(model.vision_model)
        tower.encoder.layers = tower.encoder.layers[:k]
        tower.post_layernorm = torch.nn.Sequential(adapter, tower.post_layernorm)
        feats = model.connector(tower(vision.pixel_values))
        return feats.reshape(-1, feats.shape[-1]), []
    tower = copy.deepcopy(model.visual)
    tower.blocks = tower.blocks[:k]
    captured = {}

    class AdaptedMerger(torch.nn.Module):
        def __init__(self, merger):
            super().__init__()
            self.merger = merger

        def forward(self, x):
            captured["adapted"] = _Batch1(adapter)(x)
            return self.merger(captured["adapted"])

    tower.merger = AdaptedMerger(tower.merger)
    if family == "qwen2_5_vl":
        return tower(vision.pixel_values, vision.grid_thw), []
    main, deepstack = tower(vision.pixel_values, vision.grid_thw)
    indexes = tower.cfg.deepstack_visual_indexes
    # DeepStack layers past the exit: their own mergers on the adapter's output
    deepstack += [model.visual.deepstack_merger_list[j](captured["adapted"]) for j, i in enumerate(indexes) if i >= k]
    return main, deepstack


@pytest.mark.parametrize("k", [1, 2])
def test_forced_exit_equals_the_truncated_tower_plus_adapter(checkpoint, engine, k):
    family, _ = checkpoint
    model = engine.backend.model
    n = engine.config.exit_geometry.vision_blocks
    if k >= n:
        pytest.skip(f"the tiny {family} tower has {n} blocks")
    heads = _heads(engine, [k])
    vision = engine.processor.prepare([_image()])
    with torch.no_grad():
        tokens, info = model.encode_vision_adaptive(vision, OperatingPoint(name="x", exit_layer=k))
        deepstack = list(getattr(model, "_deepstack", []))
        want, want_deepstack = _truncated_by_hand(family, model, heads, vision, k)
        full = model.encode_vision(vision)
    assert info.exit_layers == [k] and info.blocks_run == k and info.exit_confidences == [None]
    assert tokens.shape == full.shape == want.shape
    torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    assert (tokens - full).abs().max() > 1e-3  # the exit really changed the features
    assert len(deepstack) == len(want_deepstack)
    for got, exp in zip(deepstack, want_deepstack, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def _logits(model, ids, vision, feats):
    input_ids = torch.tensor([ids])
    pos, _ = model.position_ids(input_ids, vision)
    embeds = model.embed(input_ids, feats)
    return model.prefill(embeds, all_logits=True) if pos is None else \
        model.prefill(embeds, position_ids=pos, all_logits=True)


def test_exit_layer_at_the_last_block_is_the_full_model(checkpoint, engine):
    family, _ = checkpoint
    model = engine.backend.model
    n = engine.config.exit_geometry.vision_blocks
    _heads(engine, [1])
    vision = engine.processor.prepare([_image(80, 150, 1)])
    ids = engine.tokenizer.encode_request(QUESTION, vision, engine.processor)
    with torch.no_grad():
        feats, info = model.encode_vision_adaptive(vision, OperatingPoint(name="last", exit_layer=n, keep_ratio=1.0))
        got = _logits(model, ids, vision, feats)
        want = model.forward(torch.tensor([ids]), vision)
    assert info.exit_layers == [None] and info.blocks_run == n and info.kept_index is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = engine.ask(_image(80, 150, 1), QUESTION, max_new_tokens=6)
    last = engine.ask(_image(80, 150, 1), QUESTION, max_new_tokens=6,
                      operating_point=OperatingPoint(name="last", exit_layer=n))
    assert last.text == full.text and last.stats.exit_layer is None


def test_confidence_gated_exit_reads_the_pooled_patches_and_the_question(checkpoint, engine):
    """Threshold 0 exits at the first exit point with the confidence the pooled head gives the
    raster-ordered patch states (mean of the patches in the CLS slot) and the question embedding."""
    from edgevlm.runtime.adaptive import question_embedding

    family, _ = checkpoint
    model = engine.backend.model
    heads = _heads(engine, [1], seed=3, query=True)
    image = _image(70, 100, 2)
    p = engine.prepare(image, QUESTION, operating_point=OperatingPoint(name="g", exit_threshold=0.0))
    prompt = torch.tensor([p.ids])
    with torch.no_grad():
        run = model.exit_run(p.vision)
        hidden = run.step()
        x, grid = run.pooled_view(hidden)
        want = float(heads.confidence_at(1, x, grid, question_embedding(model, prompt))[0])
        feats, info = model.encode_vision_adaptive(p.vision, p.operating_point, prompt)
    assert x.shape[1] == grid[0] * grid[1]
    assert info.exit_layers == [1] and info.exit_confidences[0] == pytest.approx(want, abs=1e-6)
    # without the question a question-conditioned head gives 0: no exit at a threshold above it
    with torch.no_grad():
        _, blind = model.encode_vision_adaptive(p.vision, OperatingPoint(name="g", exit_threshold=0.5), None)
    assert blind.exit_confidences == [0.0] and blind.exit_layers == [None]
    answer = engine.ask(image, QUESTION, max_new_tokens=3, operating_point=p.operating_point)
    assert answer.stats.exit_layer == 1 and answer.stats.exit_confidence == pytest.approx(want, abs=1e-5)


def test_pooled_view_is_raster_order(checkpoint, engine):
    """The pooled heads see the patch states in raster order: a pixel pattern placed in the image's
    top-left patch shows up in the first raster token."""
    family, _ = checkpoint
    model = engine.backend.model
    vision = engine.processor.prepare([_image(64, 96, 4)])
    with torch.no_grad():
        run = model.exit_run(vision)  # nothing run yet: run.x holds the stem's output
        x, grid = run.pooled_view(run.x if family == "smolvlm" else run.x[None])
    if family == "smolvlm":
        want = model.vision_model.embeddings(vision.pixel_values[-1:], torch.ones(1, *grid, dtype=torch.bool))
        torch.testing.assert_close(x, want)
        return
    # Qwen: the stem of patch (row, col) is the patch embedding of the processor's row for it
    t, h, w = vision.grid_thw[0].tolist()
    m = engine.config.vision.spatial_merge_size
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // m, m, w // m, m)
    order_r = rows.reshape(shape).transpose(1, 2).flatten()  # processor rows are in merge-block order
    order_c = cols.reshape(shape).transpose(1, 2).flatten()
    raster_of_row = order_r * w + order_c
    with torch.no_grad():
        stem = model.visual.patch_embed(vision.pixel_values)
        if family == "qwen3_vl":
            stem = stem + model.visual.position_embeddings(vision.grid_thw).to(stem.dtype)
    want = torch.empty_like(stem)
    want[raster_of_row] = stem
    assert grid == (t * h, w)
    torch.testing.assert_close(x[0], want)


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_pruning_keeps_ceil_r_n_by_norm_in_order(checkpoint, engine, ratio):
    family, _ = checkpoint
    model = engine.backend.model
    image = _image(90, 120, 5)
    op = OperatingPoint(name="prune", keep_ratio=ratio)
    p = engine.prepare(image, QUESTION, operating_point=op)
    vision = p.vision
    with torch.no_grad():
        full = model.encode_vision(vision)
        full_deepstack = list(getattr(model, "_deepstack", []))
        tokens, info = model.encode_vision_adaptive(vision, op)
        deepstack = list(getattr(model, "_deepstack", []))
    groups = vision.token_groups or vision.tokens_per_item
    index = torch.tensor(info.kept_index[0])
    assert len(index) == tokens.shape[0] == p.n_vision == sum(math.ceil(ratio * g) for g in groups)
    ids = torch.tensor(p.ids)
    assert int((ids == engine.config.image_token_id).sum()) == p.n_vision  # the prompt matches
    assert bool((index[1:] > index[:-1]).all())  # original order
    torch.testing.assert_close(tokens, full[index])
    for got, exp in zip(deepstack, full_deepstack, strict=True):  # Qwen3-VL: DeepStack pruned alike
        torch.testing.assert_close(got, exp[index])
    norms, start = full.float().norm(dim=-1), 0
    for g in groups:  # within each group the kept tokens are the largest-norm ones
        kept = index[(index >= start) & (index < start + g)]
        assert len(kept) == math.ceil(ratio * g)
        dropped = torch.tensor(sorted(set(range(start, start + g)) - set(kept.tolist())), dtype=torch.long)
        if len(dropped):
            assert float(norms[kept].min()) >= float(norms[dropped].max())
        start += g
    answer = engine.ask(image, QUESTION, max_new_tokens=4, operating_point=op)
    assert answer.stats.vision_tokens == p.n_vision and answer.stats.new_tokens >= 1


def test_pruned_qwen_prompt_keeps_each_tokens_mrope_position(checkpoint, engine, monkeypatch):
    """Prefill positions of a pruned prompt: every kept vision token at its own unpruned (t, h, w),
    the text around the image where it is without pruning, decode continuing after the largest."""
    family, _ = checkpoint
    if family == "smolvlm":
        pytest.skip("SmolVLM uses 1-D RoPE: pruned tokens take consecutive slots")
    model = engine.backend.model
    image = _image(100, 140, 6)
    op = OperatingPoint(name="prune", keep_ratio=0.4)
    p = engine.prepare(image, QUESTION, operating_point=op)
    full_p = engine.prepare(image, QUESTION)
    with torch.no_grad():
        _, info = model.encode_vision_adaptive(p.vision, op)
    kept = info.kept_index[0]
    pos, delta = engine.backend.position_ids(torch.tensor([p.ids]), p.vision, kept_index=kept)
    full_pos, _ = model.position_ids(torch.tensor([full_p.ids]), full_p.vision)
    img = engine.config.image_token_id
    start = p.ids.index(img)
    n_full = full_p.n_vision
    assert pos.shape == (3, 1, len(p.ids))
    torch.testing.assert_close(pos[..., :start], full_pos[..., :start])  # text before the image
    torch.testing.assert_close(pos[..., start + len(kept):], full_pos[..., start + n_full:])  # text after
    _, h, w = p.vision.grid_thw[0].tolist()
    lw = w // engine.config.vision.spatial_merge_size
    first = int(full_pos[0, 0, start])
    for j, i in enumerate(kept):  # each kept token: (start, start + row, start + col) of its merged cell
        assert pos[:, 0, start + j].tolist() == [first, first + i // lw, first + i % lw]
    assert delta == int(pos.max()) + 1 - len(p.ids)
    # the engine's request prefills with exactly these positions and decodes from rope_delta
    seen: dict = {}
    prefill, greedy = engine.backend.prefill, engine.backend.greedy_tokens

    def watch_prefill(embeds, **kw):
        seen["prefill"] = kw.get("position_ids")
        return prefill(embeds, **kw)

    def watch_greedy(token, pos, n, **kw):  # the engine's greedy decode loop
        seen["rope_offset"] = kw.get("rope_offset", 0)
        return greedy(token, pos, n, **kw)

    monkeypatch.setattr(engine.backend, "prefill", watch_prefill)
    monkeypatch.setattr(engine.backend, "greedy_tokens", watch_greedy)
    answer = engine.ask(image, QUESTION, max_new_tokens=3, operating_point=op)
    assert answer.stats.vision_tokens == len(kept)
    assert torch.equal(seen["prefill"].cpu(), pos)
    assert seen["rope_offset"] == delta


def test_smolvlm_prompt_has_each_tiles_pruned_run(checkpoint, engine):
    family, _ = checkpoint
    if family != "smolvlm":
        pytest.skip("SmolVLM's per-tile prompt runs")
    image = _image(300, 500, 7)  # split into tiles plus the global image
    p = engine.prepare(image, QUESTION, operating_point=OperatingPoint(name="k", keep_ratio=0.25))
    seq = p.vision.token_groups[0]
    k = math.ceil(0.25 * seq)
    runs, run = [], 0
    for t in p.ids + [-1]:
        if t == engine.config.image_token_id:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert len(runs) == len(p.vision.token_groups) > 1 and set(runs) == {k}


# ---- edgevlm calibrate and the CLI ---------------------------------------------------------------


@pytest.fixture(scope="module")
def calibrated(checkpoint, tmp_path_factory) -> tuple[str, Path]:
    family, src = checkpoint
    model = tmp_path_factory.mktemp(f"{family}_calibrated") / "model"
    shutil.copytree(src, model)
    assert calibrate.main([str(model), *FAST, "--exit-blocks", "1"]) == 0
    return family, model


def test_calibrate_writes_exits_json_with_the_certificate(calibrated):
    from edgevlm.quantize.exit_confidence import binomial_cdf
    from edgevlm.runtime.exits import read_spec, weights_fingerprint

    family, model = calibrated
    spec = read_spec(model)
    assert spec.has_cls_token is False and spec.exit_blocks == [1] and spec.labels == []
    assert spec.weights_fingerprint == weights_fingerprint(model)
    assert spec.max_answer_change == 0.01 and spec.risk_delta == 0.1
    held_out = spec.calibration["held_out_pairs"]
    assert held_out >= 1 and spec.calibration["agreement_images"] == 5
    assert "1" in spec.exit_metrics and 0.0 <= spec.exit_metrics["1"].forced_agreement <= 1.0
    tested = [r for r in spec.cascade if r.p_value is not None]
    assert spec.cascade and tested
    for r in spec.cascade:
        assert r.pairs == held_out and 0 <= r.changes <= r.pairs
    for r in tested:  # Learn then Test: the exact binomial p-value of "change rate > 1 %"
        assert r.p_value == pytest.approx(binomial_cdf(r.changes, r.pairs, 0.01), abs=1e-6)
    if spec.recommended_threshold is not None:
        row = next(r for r in spec.cascade if r.threshold == spec.recommended_threshold)
        assert row.p_value <= spec.risk_delta
    engine = Engine.load(model)
    assert engine.exit_points == [1]


def test_ask_cli_runs_the_calibrated_exits(calibrated, tmp_path, capsys):
    from PIL import Image

    from edgevlm.cli import main

    family, model = calibrated
    path = tmp_path / "frame.png"
    Image.fromarray(_image(96, 128, 8)).save(path)
    for flags in (["--exit-layer", "1"], ["--exit-threshold", "0.0"], ["--keep-ratio", "0.5"],
                  ["--exit-layer", "1", "--keep-ratio", "0.3"]):
        rc = main(["ask", "--image", str(path), "--model", str(model), "--json", "--max-new-tokens", "3",
                   *flags, QUESTION])
        out = capsys.readouterr().out.strip().splitlines()
        assert rc == 0, flags
        stats = json.loads(out[-1])["stats"]
        if "--exit-layer" in flags or "--exit-threshold" in flags:
            assert stats["exit_layer"] == 1
        if "--keep-ratio" in flags:
            assert stats["vision_tokens"] < Engine.load(model).prepare(_image(96, 128, 8), QUESTION).n_vision


@pytest.mark.parametrize("flags, needle", [
    (["--exit-layer", "7"], "--exit-layer 7 is not an exit point of this model (exit points: 1)"),
    (["--keep-ratio", "0"], "--keep-ratio"),
    (["--keep-ratio", "1.5"], "--keep-ratio"),
])
def test_ask_bad_exit_and_pruning_values_are_one_line(calibrated, flags, needle, tmp_path, capsys):
    from PIL import Image

    from edgevlm.cli import main

    _, model = calibrated
    path = tmp_path / "frame.png"
    Image.fromarray(_image()).save(path)
    try:
        rc = main(["ask", "--image", str(path), "--model", str(model), *flags, QUESTION])
    except SystemExit as exc:  # argparse's own value checks exit from the parser
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("edgevlm: error:") and needle in err[0], err


def test_engine_refuses_bad_exit_layers_and_pruned_video(calibrated):
    from edgevlm.errors import InvalidRequestError

    family, model = calibrated
    engine = Engine.load(model)
    n = engine.config.exit_geometry.vision_blocks
    for k in range(2, n):  # inside the tower but not an exit point
        with pytest.raises(InvalidRequestError, match=f"exit_layer {k} is not an exit point"):
            engine.prepare(_image(), QUESTION, operating_point=OperatingPoint(name="x", exit_layer=k))
    last = engine.ask(_image(), QUESTION, max_new_tokens=2, operating_point=OperatingPoint(name="x", exit_layer=n))
    assert last.stats.exit_layer is None  # the last block: full depth
    with pytest.raises(InvalidRequestError, match=rf"^operating point 'x': exit_layer {n + 3} is past the vision "
                                                  rf"encoder's depth \({n} blocks: exit_layer 1\.\.{n}\)$"):
        engine.prepare(_image(), QUESTION, operating_point=OperatingPoint(name="x", exit_layer=n + 3))
    if engine.family.supports_video:
        frames = [_image(seed=s) for s in range(4)]
        with pytest.raises(InvalidRequestError, match="token pruning takes an image, not a video"):
            engine.prepare(frames, QUESTION, operating_point=OperatingPoint(name="k", keep_ratio=0.5))
        # early exit on a video is fine (one exit decision for the whole clip)
        answer = engine.ask(frames, QUESTION, max_new_tokens=2, operating_point=OperatingPoint(name="x", exit_layer=1))
        assert answer.stats.exit_layer == 1


def test_heads_of_other_weights_or_another_model_are_refused(calibrated, tmp_path, caplog, capsys):
    """Heads calibrated for other weights: logged, not used, and an exit asked for is one line;
    heads of another architecture: a one-line load error."""
    from PIL import Image
    from safetensors.torch import load_file, save_file

    from edgevlm.cli import main
    from edgevlm.errors import ModelLoadError

    family, model = calibrated
    other = tmp_path / "other"
    shutil.copytree(model, other)  # the same model with one weight changed (a retrained model, say)
    (weights,) = [f for f in other.glob("*.safetensors") if f.name != "exits.safetensors"]
    tensors = load_file(str(weights))
    name = next(n for n in sorted(tensors) if "embed_tokens" in n)
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(weights), metadata={"format": "pt"})
    for name in ("exits.json", "exits.safetensors"):
        shutil.copy(model / name, other / name)
    with caplog.at_level("ERROR", logger="edgevlm.runtime.exits"):
        engine = Engine.load(other)
    assert engine.exit_points == [] and any("calibrated for other weights" in r.getMessage() for r in caplog.records)
    path = tmp_path / "frame.png"
    Image.fromarray(_image()).save(path)
    rc = main(["ask", "--image", str(path), "--model", str(other), "--exit-layer", "1", QUESTION])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"edgevlm: error: --exit-layer: the exit heads in {other} were calibrated "
                               "for other weights and are not used (rerun `edgevlm calibrate`)"]

    spec = json.loads((model / "exits.json").read_text())
    spec["vision_blocks"] += 1
    (other / "exits.json").write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError, match=r"vision_blocks is \d+ but the model has \d+ \(exit heads of another model"):
        Engine.load(other)


def test_profile_points_with_exit_knobs_are_runnable(calibrated):
    from edgevlm.daemon.budget import runnable
    from edgevlm.profile import FrontierPoint

    _, model = calibrated
    engine = Engine.load(model)

    def point(**knobs):
        return FrontierPoint(name="p", accuracy=0.5, vision_ms=1, prefill_ms=1, tpot_ms=1, **knobs)

    assert runnable(engine, point(exit_layer=1)) and runnable(engine, point(exit_threshold=0.5))
    assert runnable(engine, point(keep_ratio=0.5)) and not runnable(engine, point(exit_layer=3))


@pytest.mark.parametrize("flags, needle", [
    (["--kd-steps", "5"], "--kd-steps: answer distillation and ViT-block adapters are LLaVA's; the {family}"),
    (["--adapter-blocks", "1"], "--adapter-blocks: answer distillation and ViT-block adapters are LLaVA's"),
    (["--exit-blocks", "9"], "exit blocks must be ascending, distinct, within 1..{last}; got [9]"),
])
def test_calibrate_bad_options_are_one_line(checkpoint, engine, flags, needle, capsys):
    family, src = checkpoint
    last = engine.config.exit_geometry.vision_blocks - 1
    rc = calibrate.main([str(src), *FAST, *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle.format(family=family, last=last) in err[0], err
    assert not (src / "exits.json").exists()


def test_certified_threshold_where_the_late_blocks_do_nothing(tmp_path):
    """Qwen3-VL (DeepStack past the exit) whose blocks after the exit are identities (their output
    projections zeroed): the identity-initialised adapter reproduces every answer, the confidence
    heads learn it and ``recommended_threshold`` is certified (point estimate, ``--risk-delta 0``);
    the gated exit then answers exactly as the full model."""
    from safetensors.torch import load_file, save_file

    from edgevlm.runtime.exits import read_spec

    model = write_checkpoint("qwen3_vl", tmp_path / "q3")
    (st,) = list(model.glob("*.safetensors"))
    tensors = load_file(str(st))
    for name in list(tensors):
        if any(f"blocks.{b}.{part}" in name for b in (2, 3) for part in ("attn.proj", "mlp.linear_fc2")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(st), metadata={"format": "pt"})
    assert calibrate.main([str(model), "--steps", "1", "--batch-size", "1", "--agreement-images", "10",
                           "--questions-per-image", "2", "--no-frontier", "--threads", "1", "--exit-blocks", "2",
                           "--risk-delta", "0", "--lr", "1e-6"]) == 0
    spec = read_spec(model)
    assert spec.exit_metrics["2"].forced_agreement == 1.0
    t = spec.recommended_threshold
    assert t is not None
    row = next(r for r in spec.cascade if r.threshold == t)
    assert row.answer_change <= 0.01 and row.exit_rates["2"] > 0
    engine = Engine.load(model)
    image = _image(96, 128, 9)
    full = engine.ask(image, QUESTION, max_new_tokens=6)
    gated = engine.ask(image, QUESTION, max_new_tokens=6, operating_point=OperatingPoint(name="g", exit_threshold=0.0))
    assert gated.stats.exit_layer == 2 and gated.text == full.text


def test_a_kept_encoder_walk_serves_the_next_questions_early_exit_exactly(checkpoint, engine):
    """A VisionTrunk (the vision cache's entry for an exit_threshold point): a question that exits at
    the first exit block, then one that walks to the end resuming from it, then the first again —
    each equal to its walk without the trunk, and no block run twice."""
    from edgevlm.runtime.adaptive import encode_model_adaptive
    from edgevlm.runtime.vision_cache import VisionTrunk

    model = engine.backend.model
    n = engine.config.exit_geometry.vision_blocks
    blocks = [b for b in (1, 2) if b < n]  # a tiny tower may have 2 blocks
    _heads(engine, blocks, seed=4, query=True)
    image = _image(70, 100, 5)
    early = OperatingPoint(name="early", exit_threshold=0.0)  # exits at block 1
    never = OperatingPoint(name="never", exit_threshold=1.0)  # a sigmoid confidence never reaches 1: full depth
    p = engine.prepare(image, QUESTION, operating_point=early)
    prompt = torch.tensor([p.ids])
    steps = []
    real_run = model.exit_run

    def counting_run(vision):
        run = real_run(vision)
        real_step = run.step
        run.step = lambda: (steps.append(run.blocks_run + 1), real_step())[1]
        return run

    trunk = VisionTrunk()
    with torch.no_grad():
        want_early = encode_model_adaptive(model, p.vision, early, prompt)
        want_never = encode_model_adaptive(model, p.vision, never, prompt)
        model.exit_run = counting_run
        try:
            got = [encode_model_adaptive(model, p.vision, op, prompt, trunk) for op in (early, never, early)]
        finally:
            model.exit_run = real_run
    assert steps == list(range(1, n + 1)), steps  # every block once, in order, over the three questions
    assert trunk.blocks_run == n and sorted(trunk.seen) == sorted({*blocks, n})
    assert set(trunk.tokens) == {1, n}  # the tokens made at each exit (and the full depth), kept
    for (tokens, side, info), (want_t, want_s, want_i) in zip(got, [want_early, want_never, want_early], strict=True):
        assert torch.equal(tokens, want_t) and all(torch.equal(a, b) for a, b in zip(side, want_s, strict=True))
        assert (info.exit_layers, info.exit_confidences, info.blocks_run) == (
            want_i.exit_layers, want_i.exit_confidences, want_i.blocks_run)
    assert got[0][2].exit_layers == [1] and got[1][2].exit_layers == [None]


def test_the_engines_vision_cache_serves_exit_threshold_points(checkpoint, engine):
    family, _ = checkpoint
    if not engine.family.vision_state_free:
        pytest.skip(f"{family}: its encoder leaves state for the prefill (DeepStack): not cached")
    _heads(engine, [b for b in (1, 2) if b < engine.config.exit_geometry.vision_blocks], seed=6, query=True)
    image = _image(70, 100, 7)
    op = OperatingPoint(name="gated", exit_threshold=0.5)
    questions = [QUESTION, "what colour is the largest shape?", "is there a circle?"]
    engine.set_vision_cache(None)
    off = [engine.ask(image, q, max_new_tokens=3, operating_point=op) for q in questions]
    engine.set_vision_cache(16)
    try:
        on = [engine.ask(image.copy(), q, max_new_tokens=3, operating_point=op) for q in questions]
        assert [a.text for a in on] == [a.text for a in off]
        assert [a.stats.exit_layer for a in on] == [a.stats.exit_layer for a in off]
        assert [a.stats.exit_confidence for a in on] == [a.stats.exit_confidence for a in off]
        assert on[0].stats.vision_cached is False and len(engine.vision_cache) == 1
        assert engine.vision_cache.keys()[0][-1] == "trunk"
    finally:
        engine.set_vision_cache(None)


def test_a_trunk_walked_under_an_exit_layer_cap_serves_an_uncapped_point_exactly(checkpoint, engine):
    """exit_threshold with exit_layer reads only the exit blocks up to the cap, yet walks on to the end
    when none is confident; the trunk it leaves (one cache key for every exit_threshold point) must
    serve a point that reads the deeper exit blocks too (was: KeyError on the block not kept)."""
    from edgevlm.runtime.adaptive import encode_model_adaptive
    from edgevlm.runtime.vision_cache import VisionTrunk

    model = engine.backend.model
    n = engine.config.exit_geometry.vision_blocks
    blocks = [b for b in range(1, n)][:2]
    if len(blocks) < 2:
        pytest.skip("the tiny tower has fewer than two exit blocks")
    _heads(engine, blocks, seed=8, query=True)
    image = _image(70, 100, 9)
    capped = OperatingPoint(name="capped", exit_threshold=1.0, exit_layer=blocks[0])
    never = OperatingPoint(name="never", exit_threshold=1.0)
    p = engine.prepare(image, QUESTION, operating_point=never)
    prompt = torch.tensor([p.ids])
    trunk = VisionTrunk()
    with torch.no_grad():
        want = encode_model_adaptive(model, p.vision, never, prompt)
        encode_model_adaptive(model, p.vision, capped, prompt, trunk)
        got = encode_model_adaptive(model, p.vision, never, prompt, trunk)
    assert torch.equal(got[0], want[0]) and got[2] == want[2]
