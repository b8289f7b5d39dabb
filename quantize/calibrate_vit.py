"""``edgevlm calibrate`` on the native-resolution ViTs without a CLS token (Qwen2.5-VL, Qwen3-VL,
SmolVLM): phases 1 and 3 of :mod:`edgevlm.quantize.calibrate` through the families' block-by-block
exit runs (:mod:`edgevlm.runtime.adaptive`, a model's ``exit_run``) and the engine's own request path.

Data: the demo calibration stream (:func:`edgevlm.quantize.calibrate_data.calibration_scene`,
384x288 scenes), each image prepared by the family's processor at a rung of ``rungs`` in turn
(None: the checkpoint's own preprocessing), so the adapters see the grids the model serves.

1. **Adapters** (distillation): for each exit block ``k``, ``adapter(h_k)`` goes through the frozen
   connector (Qwen: the 2x2 merger; SmolVLM: post-layernorm + pixel shuffle + projection; Qwen3-VL:
   also the DeepStack mergers of layers deeper than k) and is trained to match the full tower's
   connector output: normalised MSE + (1 - cosine) per token, on the main vision tokens and on each
   DeepStack feature the exit has to stand in for.
2. Answer distillation is LLaVA's (its decoder math is 1-D RoPE): not run here.
3. **Agreement pairs**: per (image, question), the greedy answer of ``Engine.ask`` at full depth and
   with a forced exit at each block (the deployed path: preprocessing, the exit adapter, multimodal
   RoPE, DeepStack adds, decode), compared as text; the pooled states of each exit block (raster
   order, :meth:`~edgevlm.runtime.adaptive.ViTRun.pooled_view`) and the question embedding are
   recorded for the confidence heads. :mod:`edgevlm.quantize.calibrate` then fits the confidence
   heads and certifies the threshold (Learn then Test) exactly as for LLaVA.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import numpy as np

from edgevlm.quantize.calibrate_data import calibration_scene
from edgevlm.quantize.exit_confidence import pairs_record

logger = logging.getLogger(__name__)


def _rungs(engine, rungs: list[int] | None) -> list[int | None]:
    return list(rungs or engine.resolution_ladder) or [None]


def _tokens_loss(pred, target):
    """Normalised MSE + (1 - cosine) of ``(N, F)`` token features against ``target`` (float32)."""
    import torch.nn.functional as F

    pred = pred.float()
    return F.mse_loss(pred, target) / target.pow(2).mean().clamp_min(1e-12) + \
        (1.0 - F.cosine_similarity(pred, target, dim=-1).mean())


def exit_states(model, vision, blocks: set[int]):
    """Run ``model``'s tower over ``vision`` block by block: ``(run, {k: block k's states (B, T, D)},
    (teacher tokens (N, D_text), teacher side features))`` — the full tower's connector output."""
    run = model.exit_run(vision)
    states, hidden = {}, None
    while run.blocks_run < run.n_blocks:
        hidden = run.step()
        if run.blocks_run in blocks:
            states[run.blocks_run] = hidden
    return run, states, run.finish(hidden)


def exit_loss(run, heads, k: int, hidden, teacher) -> tuple:
    """Phase-1 loss of exit ``k`` and the cosine of its main tokens to the teacher's."""
    import torch.nn.functional as F

    tokens, side = run.finish(hidden, k, lambda h: heads.adapt(k, h.float()))
    target, target_side = teacher
    loss = _tokens_loss(tokens, target.float())
    for s, t in zip(side, target_side, strict=True):
        loss = loss + _tokens_loss(s, t.float())
    return loss, float(F.cosine_similarity(tokens.detach().float(), target.float(), dim=-1).mean())


def train_vit_adapters(engine, heads, *, steps: int, batch_size: int, seed: int, lr: float = 2e-3,
                       rungs: list[int] | None = None, deadline: float | None = None,
                       progress: Callable[[str], None] = logger.info, adapters: bool = True) -> dict[str, float]:
    """Phase 1 (see the module doc): ``steps`` AdamW steps of ``batch_size`` calibration images
    each (stopping early at ``deadline``, a ``time.perf_counter()`` value). ``adapters=False`` only
    measures. Returns ``feature_cosine_<k>`` on held-out images and ``steps_run``."""
    import torch

    from edgevlm.quantize.calibrate_train import _schedule

    model = engine.backend.model
    spec = heads.spec
    blocks = set(spec.exit_blocks)
    ladder = _rungs(engine, rungs)
    done = 0
    if adapters and steps:
        opt = torch.optim.AdamW([p for p in heads.adapters.parameters() if p.requires_grad], lr=lr,
                                weight_decay=1e-4)
        sched = _schedule(opt, steps)
        heads.train()
        t0 = time.perf_counter()
        for step in range(steps):
            if deadline is not None and time.perf_counter() > deadline:
                progress(f"calibrate: adapters stopped at step {step}/{steps} (time budget)")
                break
            loss = torch.zeros((), device=engine.backend.device)
            for j in range(batch_size):
                image, _, _ = calibration_scene(seed, step * batch_size + j)
                vision = engine.processor.prepare([image], resolution_px=ladder[step % len(ladder)])
                with torch.no_grad():
                    run, states, teacher = exit_states(model, vision, blocks)
                for k in spec.exit_blocks:
                    loss = loss + exit_loss(run, heads, k, states[k], teacher)[0] / batch_size
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            done = step + 1
            if step % 25 == 0 or step == steps - 1:
                progress(f"calibrate: adapters step {step + 1}/{steps} loss {loss.item():.4f} "
                         f"({time.perf_counter() - t0:.0f} s)")
        heads.eval()
    cos: dict[int, list[float]] = {k: [] for k in spec.exit_blocks}
    with torch.no_grad():
        for i in range(max(4, min(16, 2 * batch_size))):
            image, _, _ = calibration_scene(seed + 1, i)
            vision = engine.processor.prepare([image], resolution_px=ladder[i % len(ladder)])
            run, states, teacher = exit_states(model, vision, blocks)
            for k in spec.exit_blocks:
                cos[k].append(exit_loss(run, heads, k, states[k], teacher)[1])
    out: dict[str, float] = {f"feature_cosine_{k}": float(np.mean(v)) for k, v in cos.items()}
    out["steps_run"] = done
    return out


def _answer(engine, image, question: str, rung: int | None, exit_layer: int | None, max_new_tokens: int) -> str:
    """The engine's greedy answer at ``rung`` with a forced exit at ``exit_layer`` (None: full depth)."""
    from edgevlm.types import OperatingPoint

    op = OperatingPoint(name="calibrate", resolution_px=rung, exit_layer=exit_layer)
    return engine.ask(image, question, max_new_tokens=max_new_tokens, operating_point=op).text


def collect_vit_pairs(engine, heads, *, seed: int, offset: int, images: int, questions: int,
                      rungs: list[int] | None = None, max_new_tokens: int = 24, deadline: float | None = None,
                      progress: Callable[[str], None] = logger.info) -> dict:
    """Phase 3's agreement pairs (see the module doc) on calibration images ``offset ..
    offset + images - 1``; returns the dict :func:`edgevlm.quantize.exit_confidence.collect_pairs`
    returns (pooled states per exit block, question embeddings, image index, 0/1 agreement,
    correctness, question kinds)."""
    import torch

    from edgevlm.runtime import adaptive
    from edgevlm.runtime.demo.questions import sample_questions
    from edgevlm.types import OperatingPoint

    model = engine.backend.model
    spec = heads.spec
    hd = next(heads.parameters()).dtype
    previous = model.exit_heads
    model.attach_exit_heads(copy.deepcopy(heads))  # the engine's forced exits use these adapters
    ladder = _rungs(engine, rungs)
    pooled: dict[int, list] = {k: [] for k in spec.exit_blocks}
    agree: dict[int, list] = {k: [] for k in spec.exit_blocks}
    correct_exit: dict[int, list] = {k: [] for k in spec.exit_blocks}
    queries, image_idx, kinds, correct_full = [], [], [], []
    t0 = time.perf_counter()
    n_img = 0
    try:
        for i in range(images):
            if deadline is not None and time.perf_counter() > deadline and n_img:
                progress(f"calibrate: agreement stopped after {n_img} images (time budget)")
                break
            image, scene, rng = calibration_scene(seed, offset + i)
            rung = ladder[i % len(ladder)]
            qas = sample_questions(scene, rng, questions)
            if not qas:
                continue
            with torch.inference_mode():
                run, states, _ = exit_states(model, engine.processor.prepare([image], resolution_px=rung),
                                             set(spec.exit_blocks))
                for k in spec.exit_blocks:
                    x, grid = run.pooled_view(states[k])
                    pooled[k].append(heads.confidence[str(k)].pool(x.to(hd), grid).float())  # (1, 7D + 1)
            for qa in qas:
                full = _answer(engine, image, qa.question, rung, None, max_new_tokens)
                correct_full.append(float(full.strip() == qa.answer))
                for k in spec.exit_blocks:
                    text = _answer(engine, image, qa.question, rung, k, max_new_tokens)
                    agree[k].append(float(text == full))
                    correct_exit[k].append(float(text.strip() == qa.answer))
                if spec.confidence_query_dim:
                    ids = engine.prepare(image, qa.question, operating_point=OperatingPoint(resolution_px=rung)).ids
                    with torch.inference_mode():
                        queries.append(adaptive.question_embedding(model, torch.tensor([ids])).float())
                image_idx.append(n_img)
                kinds.append(qa.kind)
            n_img += 1
            if i % 10 == 0:
                progress(f"calibrate: agreement {n_img}/{images} images, {len(kinds)} pairs "
                         f"({time.perf_counter() - t0:.0f} s)")
    finally:
        model.attach_exit_heads(previous)
    if not kinds:
        raise ValueError("no calibration pairs were collected (time budget too small?)")
    return pairs_record(pooled, queries, image_idx, agree, correct_full, correct_exit, kinds)
