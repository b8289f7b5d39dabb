"""Training phases 1 and 2 of ``edgevlm calibrate`` (:mod:`edgevlm.quantize.calibrate`): adapter
distillation + closed-set classifiers on the full encoder's features, then answer distillation
through the frozen projector and decoder. See the driver's module doc for the losses and sources.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from edgevlm.quantize.calibrate_data import (
    BatchStream,
    _pixels,
    calibration_scene,
    encoder_states,
    grid_of,
    scene_labels,
    selected_features,
)
from edgevlm.quantize.exit_confidence import decoder_logits

logger = logging.getLogger(__name__)

KD_OFFSET = 10_000_000  # image-index offsets of the calibration stream per phase (disjoint images)


def _autocast(engine):
    """bfloat16 autocast for the heads on CUDA when the model runs in bfloat16; a no-op otherwise."""
    import contextlib

    import torch

    if str(engine.backend.device).startswith("cuda") and engine.backend.dtype == torch.bfloat16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _schedule(opt, steps: int):
    import torch

    warm = max(1, steps // 20)  # linear warm-up, then cosine decay to 5%
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps - 1))))))


def feature_loss(model, pred, target, target_proj):
    """Phase-1 loss of one exit: normalised MSE + (1 - cosine) on the selected features ``(B, N, F)``
    and normalised MSE after the frozen projector (``target_proj`` ``(B, N, D_text)``)."""
    import torch.nn.functional as F

    feat_mse = F.mse_loss(pred.float(), target) / target.pow(2).mean()
    cos = 1.0 - F.cosine_similarity(pred.float(), target, dim=-1).mean()
    pp = model.vision_tower.projector(pred.to(target_proj.dtype)).float()
    return feat_mse + cos + F.mse_loss(pp, target_proj) / target_proj.pow(2).mean()


# --------------------------------------------------------------------------- phase 1


def train_adapters(engine, heads, *, steps: int, batch_size: int, seed: int, lr: float = 2e-3,
                   rungs: list[int] | None = None, workers: int = 0, deadline: float | None = None,
                   progress: Callable[[str], None] = logger.info, adapters: bool = True) -> dict[str, float]:
    """Distil the adapters and train the classifiers (phase 1), stopping early at ``deadline``
    (a ``time.perf_counter()`` value); ``adapters=False`` trains the classifiers only (adapters
    kept as they are). Returns held-out metrics: ``feature_cosine_<k>``,
    ``classifier_accuracy_<k>`` and ``steps_run``."""
    import torch
    import torch.nn.functional as F

    model = engine.backend.model
    dev = engine.backend.device
    spec = heads.spec
    need = set(spec.exit_blocks) | set(spec.classifier_blocks) | set(model.cfg.vision_feature_indices)
    select = (lambda t: t[:, 1:]) if model.cfg.vision_feature_select_strategy == "default" else (lambda t: t)
    params = heads.parameters() if adapters else heads.classifiers.parameters()
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=1e-4)
    sched = _schedule(opt, steps)
    heads.train()
    t0 = time.perf_counter()
    stream = BatchStream(engine, seed=seed, offset=0, steps=steps, batch_size=batch_size,
                         rungs=rungs or list(engine.resolution_ladder), labels=spec.labels, workers=workers)
    done = 0
    for step, batch in enumerate(stream):
        if deadline is not None and time.perf_counter() > deadline:
            progress(f"calibrate: adapters stopped at step {step}/{steps} (time budget)")
            break
        with torch.no_grad():
            px = torch.from_numpy(batch["pixels"]).to(dev, engine.backend.dtype)
            grid = grid_of(model, px)
            states = encoder_states(model, px, need)
            target = selected_features(model, states).float()  # (B, N, F)
            target_proj = model.vision_tower.projector(target.to(engine.backend.dtype)).float()
        with _autocast(engine):
            loss = torch.zeros((), device=dev)
            for k in spec.exit_blocks if adapters else ():
                loss = loss + feature_loss(model, select(heads.adapt(k, states[k].float())), target, target_proj)
            if spec.labels:
                y = torch.from_numpy(batch["labels"]).to(dev)
                for k in spec.classifier_blocks:
                    logits = heads.classifiers[str(k)](states[k].float(), grid).float()
                    loss = loss + F.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        done = step + 1
        if step % 25 == 0 or step == steps - 1:
            what = "adapters" if adapters else "classifiers"
            progress(f"calibrate: {what} step {step + 1}/{steps} loss {loss.item():.4f} "
                     f"({time.perf_counter() - t0:.0f} s)")
    heads.eval()
    out = _phase1_metrics(engine, heads, seed=seed + 1, n=min(64, max(2 * batch_size, 16)))
    out["steps_run"] = done
    return out


def _phase1_metrics(engine, heads, *, seed: int, n: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    model = engine.backend.model
    spec = heads.spec
    need = set(spec.exit_blocks) | set(spec.classifier_blocks) | set(model.cfg.vision_feature_indices)
    cos: dict[int, list[float]] = {k: [] for k in spec.exit_blocks}
    probs: dict[int, list] = {k: [] for k in spec.classifier_blocks}
    truth: list = []
    hd = next(heads.parameters()).dtype
    with torch.no_grad():
        for i, rung in enumerate(engine.resolution_ladder):
            batch = [calibration_scene(seed, i * n + j) for j in range(n)]
            px = _pixels(engine, [b[0] for b in batch], rung)
            grid = grid_of(model, px)
            states = {k: v.to(hd) for k, v in encoder_states(model, px, need).items()}
            target = selected_features(model, states).float()
            for k in spec.exit_blocks:
                pred = heads.adapt(k, states[k]).float()
                pred = pred[:, 1:] if model.cfg.vision_feature_select_strategy == "default" else pred
                cos[k].append(float(F.cosine_similarity(pred, target, dim=-1).mean()))
            if spec.labels:
                truth.append(np.stack([scene_labels(b[1], spec.labels) for b in batch]))
                for k in spec.classifier_blocks:
                    probs[k].append(heads.classify(k, states[k], grid).cpu().numpy())
    out = {f"feature_cosine_{k}": float(np.mean(v)) for k, v in cos.items()}
    if spec.labels:
        y = np.concatenate(truth) > 0.5  # (n, L)
        for k in spec.classifier_blocks:
            pred = np.concatenate(probs[k]) >= 0.5
            out[f"classifier_accuracy_{k}"] = float((pred == y).mean())
            tpr = [(pred[:, j] & y[:, j]).sum() / y[:, j].sum() for j in range(y.shape[1]) if y[:, j].any()]
            tnr = [(~pred[:, j] & ~y[:, j]).sum() / (~y[:, j]).sum() for j in range(y.shape[1]) if (~y[:, j]).any()]
            out[f"classifier_balanced_accuracy_{k}"] = float((np.mean(tpr) + np.mean(tnr)) / 2)
    return out


def fit_classifier(engine, heads, images: list[np.ndarray], targets: np.ndarray, *, rung: int | None = None,
                   steps: int = 200, lr: float = 1e-2, blocks: list[int] | None = None) -> dict[int, float]:
    """Train only the classifiers of ``heads`` on labelled images (any data, not only demo scenes).

    Args:
        images: ``(H, W, 3)`` uint8 RGB frames.
        targets: ``(n, L)`` 0/1 matrix over ``heads.labels``.
        rung: input resolution (default: the engine's native size).
        blocks: classifier blocks to train (default: all).
    Returns:
        training accuracy per block (mean over labels).
    """
    import torch
    import torch.nn.functional as F

    model = engine.backend.model
    blocks = blocks or list(heads.spec.classifier_blocks)
    y = torch.as_tensor(np.asarray(targets, np.float32), device=engine.backend.device)
    with torch.no_grad():
        px = _pixels(engine, images, rung or engine.image_size_px)
        grid = grid_of(model, px)
        states = encoder_states(model, px, set(blocks))
    params = [p for k in blocks for p in heads.classifiers[str(k)].parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    heads.train()
    for _ in range(steps):
        loss = sum(F.binary_cross_entropy_with_logits(heads.classifiers[str(k)](states[k].float(), grid), y)
                   for k in blocks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    heads.eval()
    with torch.no_grad():
        return {k: float(((heads.classify(k, states[k].float(), grid) >= 0.5).float() == y).float().mean())
                for k in blocks}


# --------------------------------------------------------------------------- phase 2


def distill_answers(engine, heads, *, steps: int, batch_size: int, seed: int, lr: float = 5e-4,
                    questions: int = 2, rungs: list[int] | None = None, workers: int = 0,
                    deadline: float | None = None, progress: Callable[[str], None] = logger.info) -> int:
    """Answer distillation (see the module doc, step 2), ``questions`` sampled questions per image,
    all in one right-padded teacher-forced batch; stops early at ``deadline``. Returns the steps run."""
    import torch
    import torch.nn.functional as F

    from edgevlm.quantize.exit_confidence import sequence_embeds

    model = engine.backend.model
    dec = model.language_model
    spec = heads.spec
    dev, dtype = engine.backend.device, engine.backend.dtype
    need = set(spec.exit_blocks) | set(model.cfg.vision_feature_indices)
    tok = engine.tokenizer
    eos = min(engine.eos_token_ids)
    opt = torch.optim.AdamW([p for k in spec.exit_blocks for p in heads.adapters[str(k)].parameters()], lr=lr,
                            weight_decay=1e-4)
    sched = _schedule(opt, steps)
    select = (lambda t: t[:, 1:]) if model.cfg.vision_feature_select_strategy == "default" else (lambda t: t)
    stream = BatchStream(engine, seed=seed, offset=KD_OFFSET, steps=steps, batch_size=batch_size,
                         rungs=rungs or list(engine.resolution_ladder), labels=[], questions=questions, workers=workers)
    t0 = time.perf_counter()
    heads.train()
    done = 0
    for step, batch in enumerate(stream):
        if deadline is not None and time.perf_counter() > deadline:
            progress(f"calibrate: answer distillation stopped at step {step}/{steps} (time budget)")
            break
        with torch.no_grad():
            px = torch.from_numpy(batch["pixels"]).to(dev, dtype)
            states = encoder_states(model, px, need)
            target = selected_features(model, states).float()
            full = model.vision_tower.projector(target.to(dtype))  # (B, N, D_text)
            rows = [(j, q, a) for j, qas in enumerate(batch["qas"]) for q, a, _ in qas]
            seqs, mask_rows = [], []
            for _, q, a in rows:
                ids = tok.encode_prompt(q, full.shape[1])
                answer = tok.tok.encode(a, add_special_tokens=False).ids + [eos]
                seqs.append(ids + answer[:-1])
                mask_rows.append((len(ids) - 1, len(answer)))
            img = torch.tensor([j for j, *_ in rows], device=dev)
            t_max = max(len(s) for s in seqs)
            mask = torch.zeros(len(rows), t_max, dtype=torch.bool, device=dev)
            for r, (s0, n) in enumerate(mask_rows):
                mask[r, s0 : s0 + n] = True
            plens = [s0 + 1 for s0, _ in mask_rows]
            teacher = F.log_softmax(decoder_logits(dec, sequence_embeds(model, seqs, full[img], plens)).float()[mask], -1)
        with _autocast(engine):
            loss = torch.zeros((), device=dev)
            for k in spec.exit_blocks:
                pred = select(heads.adapt(k, states[k].float()))  # (B, N, F)
                feats = model.vision_tower.projector(pred.to(dtype))
                student = F.log_softmax(decoder_logits(dec, sequence_embeds(model, seqs, feats[img], plens)).float()[mask],
                                        -1)
                kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")  # per answer token
                loss = loss + kl + 0.25 * feature_loss(model, pred, target, full.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        done = step + 1
        if step % 10 == 0 or step == steps - 1:
            progress(f"calibrate: answer distillation step {step + 1}/{steps} loss {loss.item():.4f} "
                     f"({time.perf_counter() - t0:.0f} s)")
    heads.eval()
    return done
