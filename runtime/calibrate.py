"""``edgevlm calibrate MODEL_OR_BUNDLE``: train the exit heads of a model, then measure its operating points.

    edgevlm calibrate DIR [--exit-blocks 2 3] [--steps 300] [--kd-steps 100] [--batch-size 8]
        [--agreement-images 300] [--questions-per-image 3] [--adapter-attn-dim 0] [--adapter-blocks 0]
        [--seed 0] [--device cpu] [--dtype float32] [--threads N] [--no-frontier] [--frontier-n 90]
        [--profile NAME] [--out DIR]

(also ``python -m edgevlm.runtime.calibrate ...``). Writes ``exits.safetensors`` + ``exits.json``
(:mod:`edgevlm.runtime.exits`) and, unless ``--no-frontier``, ``frontier.json`` + ``frontier.png``
(:mod:`edgevlm.runtime.frontier`) into the model folder (or ``--out``). For an engine bundle the
new files are added to ``manifest.json`` with their SHA-256.

Calibration data: the demo scene generator (:mod:`edgevlm.runtime.demo.scenes`, its own seeded
stream ``rng_for(seed, 3, i)``, disjoint from training, evaluation and video streams), rendered at
384x288 and fed at every rung of the model's resolution ladder in turn. The model stays frozen.

1. **Adapters + classifiers** (distillation): for each exit block ``k``, the adapter is trained so
   that ``adapter(h_k)`` matches the full encoder's selected features ``f``: normalised MSE plus
   (1 - cosine) on ``f``, plus normalised MSE after the frozen projector (the decoder's input).
   Classifiers (on every exit block and the last block) learn the scene's closed-set labels with
   binary cross-entropy.
2. **Confidence**: on other images, the decoder answers sampled questions greedily from the full
   features; for each exit, a teacher-forced pass checks whether greedy decoding from the adapted
   features gives the same tokens. The confidence head learns, from block ``k``'s states alone,
   the fraction of questions whose answer stays the same (BCE on that soft target; 80/20 split by
   image, the 20% giving the threshold table stored in ``exits.json``).

Errors (bad folder, bad options) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

CALIB_DOMAIN = 3  # SeedSequence domain of the calibration stream (train 0, eval 1, video 2)
NOISE_SIGMA = 2.0
MAX_ANSWER_TOKENS = 24
THRESHOLDS = [round(0.05 * i, 2) for i in range(21)]


# ------------------------------------------------------------------------------------ data


def demo_labels() -> list[str]:
    """Closed-set labels of the demo scenes: colours, shapes, sizes, halves with any object, halves
    with a large object, and colour-shape pairs (each true when such an object is present)."""
    from edgevlm.runtime.demo import scenes

    halves = ["left", "right", "top", "bottom"]
    return [*scenes.COLOUR_NAMES, *scenes.SHAPES, *scenes.SIZES, *halves, *[f"large {h}" for h in halves],
            *[f"{c} {s}" for c in scenes.COLOUR_NAMES for s in scenes.SHAPES]]


def scene_labels(scene, labels: list[str]) -> np.ndarray:
    """``(L,)`` float32 0/1 vector: which of ``labels`` hold for a demo ``scene``."""
    present: set[str] = set()
    for o in scene.objects:
        halves = ["left" if o.cx_px < scene.width_px / 2 else "right",
                  "top" if o.cy_px < scene.height_px / 2 else "bottom"]
        present |= {o.colour, o.shape, o.size, f"{o.colour} {o.shape}", *halves}
        if o.size == "large":
            present |= {f"large {h}" for h in halves}
    return np.asarray([lab in present for lab in labels], np.float32)


def calibration_scene(seed: int, index: int):
    """Scene ``index`` of the calibration stream: ``(image (288, 384, 3) uint8, scene, rng)``."""
    from edgevlm.runtime.demo import scenes

    rng = scenes.rng_for(seed, CALIB_DOMAIN, index)
    scene = scenes.generate_scene(rng)
    return scenes.render(scene, noise_rng=rng, noise_sigma=NOISE_SIGMA), scene, rng


def _pixels(engine, images: list[np.ndarray], rung: int):
    import torch

    from edgevlm.runtime.preprocess import preprocess

    px = [preprocess(im, rung, engine.patch_size_px, engine.image_mean, engine.image_std) for im in images]
    return torch.from_numpy(np.stack(px)).to(engine.backend.device, engine.backend.dtype)  # (B, 3, H, W)


def grid_of(model, pixel_values) -> tuple[int, int]:
    """The patch grid ``(h, w)`` of a ``(B, 3, H, W)`` pixel batch."""
    p = model.cfg.vision.patch_size
    return pixel_values.shape[-2] // p, pixel_values.shape[-1] // p


def encoder_states(model, pixel_values, blocks: set[int]) -> dict:
    """Hidden states ``{i: (B, 1 + N, D)}`` after the blocks in ``blocks`` (0 = after pre-LN)."""
    enc = model.vision_tower.encoder
    x = enc.stem(pixel_values)
    out = {0: x} if 0 in blocks else {}
    for i, layer in enumerate(enc.layers, start=1):
        if i > max(blocks):
            break
        x = layer(x)
        if i in blocks:
            out[i] = x
    return out


def selected_features(model, states: dict):
    """The features the projector reads, ``(B, N, F)`` ('default' strategy drops CLS)."""
    import torch

    cfg = model.cfg
    f = torch.cat([states[i] for i in cfg.vision_feature_indices], dim=-1)
    return f[:, 1:] if cfg.vision_feature_select_strategy == "default" else f


# --------------------------------------------------------------------------- phase 1


def train_adapters(engine, heads, *, steps: int, batch_size: int, seed: int, lr: float = 2e-3,
                   progress: Callable[[str], None] = logger.info) -> dict[str, float]:
    """Distil the adapters and train the classifiers (phase 1). Returns held-out metrics:
    ``feature_cosine_<k>`` and ``classifier_accuracy_<k>``."""
    import torch
    import torch.nn.functional as F

    model = engine.backend.model
    spec = heads.spec
    labels = spec.labels
    need = set(spec.exit_blocks) | set(spec.classifier_blocks) | set(model.cfg.vision_feature_indices)
    ladder = list(engine.resolution_ladder)
    select = (lambda t: t[:, 1:]) if model.cfg.vision_feature_select_strategy == "default" else (lambda t: t)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    warm = max(1, steps // 20)  # linear warm-up, then cosine decay to 5%
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps - 1))))))
    heads.train()
    t0 = time.perf_counter()
    for step in range(steps):
        rung = ladder[step % len(ladder)]
        batch = [calibration_scene(seed, step * batch_size + j) for j in range(batch_size)]
        with torch.no_grad():
            px = _pixels(engine, [b[0] for b in batch], rung)
            grid = grid_of(model, px)
            states = {k: v.float() for k, v in encoder_states(model, px, need).items()}
            target = selected_features(model, states)  # (B, N, F)
        proj = model.vision_tower.projector
        with torch.no_grad():
            target_proj = proj(target.to(engine.backend.dtype)).float()
        loss = torch.zeros(())
        for k in spec.exit_blocks:
            pred = select(heads.adapt(k, states[k]))  # (B, N, F)
            feat_mse = F.mse_loss(pred, target) / target.pow(2).mean()
            cos = 1.0 - F.cosine_similarity(pred, target, dim=-1).mean()
            pp = proj(pred.to(engine.backend.dtype)).float()
            proj_mse = F.mse_loss(pp, target_proj) / target_proj.pow(2).mean()
            loss = loss + feat_mse + cos + proj_mse
        if labels:
            y = torch.from_numpy(np.stack([scene_labels(b[1], labels) for b in batch]))
            for k in spec.classifier_blocks:
                logits = heads.classifiers[str(k)](states[k], grid)
                loss = loss + F.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss = loss.detach()
        if step % 25 == 0 or step == steps - 1:
            progress(f"calibrate: adapters step {step + 1}/{steps} loss {loss.item():.4f} "
                     f"({time.perf_counter() - t0:.0f} s)")
    heads.eval()
    return _phase1_metrics(engine, heads, seed=seed + 1, n=max(2 * batch_size, 16))


def _phase1_metrics(engine, heads, *, seed: int, n: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    model = engine.backend.model
    spec = heads.spec
    need = set(spec.exit_blocks) | set(spec.classifier_blocks) | set(model.cfg.vision_feature_indices)
    cos: dict[int, list[float]] = {k: [] for k in spec.exit_blocks}
    probs: dict[int, list] = {k: [] for k in spec.classifier_blocks}
    truth: list = []
    with torch.no_grad():
        for i, rung in enumerate(engine.resolution_ladder):
            batch = [calibration_scene(seed, i * n + j) for j in range(n)]
            px = _pixels(engine, [b[0] for b in batch], rung)
            grid = grid_of(model, px)
            states = {k: v.float() for k, v in encoder_states(model, px, need).items()}
            target = selected_features(model, states)
            for k in spec.exit_blocks:
                pred = heads.adapt(k, states[k])
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


# --------------------------------------------------------------------------- phase 1b


def decoder_logits(dec, embeds):
    """Causal logits ``(B, T, V)`` of the decoder for ``embeds`` ``(B, T, D)`` at positions
    ``0..T-1``, without touching the KV cache (so autograd can run through it; the same math as
    :meth:`~edgevlm.runtime.decoder.Decoder.forward` with ``prefill=True``)."""
    import torch.nn.functional as F

    from edgevlm.runtime.decoder import apply_rope

    b, t, _ = embeds.shape
    cos, sin = dec.rope_cos[:t].to(embeds.dtype), dec.rope_sin[:t].to(embeds.dtype)  # (T, Dh)
    x = embeds
    for layer in dec.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(b, t, a.n_heads, a.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = a.k_proj(h).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = a.v_proj(h).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        x = x + a.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return dec.lm_head(dec.norm(x))  # (B, T, V)


def distill_answers(engine, heads, *, steps: int, batch_size: int, seed: int, lr: float = 5e-4,
                    temperature: float = 1.0, progress: Callable[[str], None] = logger.info) -> None:
    """Phase 1b (``--kd-steps``): fine-tune the adapters end to end through the frozen projector
    and decoder. For a scene and a sampled question, the teacher is the decoder fed the full
    encoder's features, the student the same decoder fed ``adapter(h_k)``; the loss is
    KL(teacher || student) of the next-token distributions at the positions of the teacher's
    greedy answer (knowledge distillation, Hinton et al. 2015), summed over exit blocks."""
    import torch
    import torch.nn.functional as F

    from edgevlm.runtime.demo import scenes

    model = engine.backend.model
    dec = model.language_model
    spec = heads.spec
    need = set(spec.exit_blocks) | set(model.cfg.vision_feature_indices)
    ladder = list(engine.resolution_ladder)
    dtype = engine.backend.dtype
    params = [p for k in spec.exit_blocks for p in heads.adapters[str(k)].parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    select = (lambda t: t[:, 1:]) if model.cfg.vision_feature_select_strategy == "default" else (lambda t: t)
    t0 = time.perf_counter()
    heads.train()
    for step in range(steps):
        rung = ladder[step % len(ladder)]
        batch = [calibration_scene(seed + 7, step * batch_size + j) for j in range(batch_size)]
        with torch.no_grad():
            states = encoder_states(model, _pixels(engine, [b[0] for b in batch], rung), need)
            full = model.vision_tower.projector(selected_features(model, states))  # (B, N, D_text)
            seqs, spans = [], []
            for j, (_, scene, rng) in enumerate(batch):
                qa = scenes.sample_questions(scene, rng, 1)[0]
                ids = engine.tokenizer.encode_prompt(qa.question, full.shape[1])
                answer = greedy_tokens(engine, ids, full[j : j + 1])
                seqs.append(ids + answer[:-1])
                spans.append((len(ids) - 1, len(answer)))
            t_max = max(len(x) for x in seqs)
            ids_t = torch.zeros(len(seqs), t_max, dtype=torch.long, device=full.device)
            for j, x in enumerate(seqs):
                ids_t[j, : len(x)] = torch.tensor(x)
            is_img = ids_t == model.cfg.image_token_id  # (B, T); pads are id 0, never the image token
            tok = dec.embed_tokens(ids_t)  # (B, T, D)
            teacher = decoder_logits(dec, tok.masked_scatter(is_img[..., None], full.to(tok.dtype))).float()
        loss = torch.zeros((), device=full.device)
        for k in spec.exit_blocks:
            feats = model.vision_tower.projector(select(heads.adapt(k, states[k].float())).to(dtype))
            student = decoder_logits(dec, tok.masked_scatter(is_img[..., None], feats.to(tok.dtype))).float()
            for j, (start, n) in enumerate(spans):
                p_t = F.log_softmax(teacher[j, start : start + n] / temperature, dim=-1)
                p_s = F.log_softmax(student[j, start : start + n] / temperature, dim=-1)
                loss = loss + F.kl_div(p_s, p_t, log_target=True, reduction="batchmean") / len(spans)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss = loss.detach()
        if step % 10 == 0 or step == steps - 1:
            progress(f"calibrate: answer distillation step {step + 1}/{steps} KL {loss.item():.4f} "
                     f"({time.perf_counter() - t0:.0f} s)")
    heads.eval()


# --------------------------------------------------------------------------- phase 2


def greedy_tokens(engine, ids: list[int], feats, max_new_tokens: int = MAX_ANSWER_TOKENS) -> list[int]:
    """Greedy generation through the backend (prefill + decode into the KV cache); token ids,
    ending with EOS unless the cap was hit."""
    import torch

    be = engine.backend
    logits = be.prefill(be.embed(torch.tensor([ids], device=be.device), feats))
    out: list[int] = []
    pos = len(ids)
    while True:
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in engine.eos_token_ids or len(out) >= max_new_tokens:
            return out
        logits = be.decode(tok, pos)
        pos += 1


def reproduces(engine, ids: list[int], feats, answer: list[int]) -> bool:
    """Whether greedy decoding from ``feats`` gives exactly ``answer`` (one teacher-forced pass:
    the argmax at every answer position must be the answer token)."""
    import torch

    model = engine.backend.model
    dev = engine.backend.device
    prompt = model.embed(torch.tensor([ids], device=dev), feats)  # (1, T, D)
    # generated tokens are embedded plainly, as decode does (a model may emit the image token id)
    tail = model.language_model.embed_tokens(torch.tensor([answer[:-1]], dtype=torch.long, device=dev))
    logits = model.prefill(torch.cat([prompt, tail.to(prompt.dtype)], dim=1), all_logits=True)[0]  # (T, V)
    pred = logits[len(ids) - 1 : len(ids) - 1 + len(answer)].argmax(-1)
    return pred.tolist() == answer


def agreement_data(engine, heads, *, n_images: int, questions: int, seed: int,
                   progress: Callable[[str], None] = logger.info):
    """Phase 2 data: per image and exit block, the pooled-head input and the fraction of sampled
    questions whose greedy answer is unchanged. Returns ``(states {k: [((1+N, D) float32, grid)]},
    agree {k: (n,) float32}, correct_full (n,), correct_exit {k: (n,)})``."""
    import torch

    from edgevlm.runtime.demo import scenes

    model = engine.backend.model
    spec = heads.spec
    need = set(spec.exit_blocks) | set(model.cfg.vision_feature_indices)
    ladder = list(engine.resolution_ladder)
    states_out: dict[int, list] = {k: [] for k in spec.exit_blocks}
    agree = {k: np.zeros(n_images, np.float32) for k in spec.exit_blocks}
    correct_exit = {k: np.zeros(n_images, np.float32) for k in spec.exit_blocks}
    correct_full = np.zeros(n_images, np.float32)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(n_images):
            image, scene, rng = calibration_scene(seed, 1_000_000 + i)
            rung = ladder[i % len(ladder)]
            px = _pixels(engine, [image], rung)
            grid = grid_of(model, px)
            st = encoder_states(model, px, need)
            full = model.vision_tower.projector(selected_features(model, st))  # (1, N, D_text)
            exit_feats = {}
            for k in spec.exit_blocks:
                a = heads.adapt(k, st[k].to(next(heads.parameters()).dtype))
                a = a[:, 1:] if model.cfg.vision_feature_select_strategy == "default" else a
                exit_feats[k] = model.vision_tower.projector(a.to(full.dtype))
                states_out[k].append((st[k][0].float().cpu(), grid))
            qas = scenes.sample_questions(scene, rng, questions)
            for qa in qas:
                ids = engine.tokenizer.encode_prompt(qa.question, full.shape[1])
                answer = greedy_tokens(engine, ids, full)
                ok_full = engine.tokenizer.decode(answer).strip() == qa.answer
                correct_full[i] += ok_full / len(qas)
                for k in spec.exit_blocks:
                    same = reproduces(engine, ids, exit_feats[k], answer)
                    agree[k][i] += same / len(qas)
                    if same:
                        correct_exit[k][i] += ok_full / len(qas)
                    else:
                        text = engine.tokenizer.decode(greedy_tokens(engine, ids, exit_feats[k])).strip()
                        correct_exit[k][i] += (text == qa.answer) / len(qas)
            if i % 50 == 0 or i == n_images - 1:
                progress(f"calibrate: agreement image {i + 1}/{n_images} ({time.perf_counter() - t0:.0f} s)")
    return states_out, agree, correct_full, correct_exit


def train_confidence(heads, block: int, states: list, target: np.ndarray, *, epochs: int = 300,
                     lr: float = 3e-3, seed: int = 0) -> None:
    """Fit the confidence head of ``block`` on pooled states -> agreement fraction (BCE, full batch)."""
    import torch
    import torch.nn.functional as F

    head = heads.confidence[str(block)]
    head.train()
    torch.manual_seed(seed)
    with torch.no_grad():
        pooled = torch.stack([head.pool(s[None].to(head.fc1.weight), g)[0] for s, g in states])  # (n, 7D+1)
    for p in head.norm.parameters():
        p.requires_grad_(False)  # pooled inputs are computed once, with the LN as initialised
    y = torch.from_numpy(target)
    opt = torch.optim.AdamW([head.fc1.weight, head.fc1.bias, head.fc2.weight, head.fc2.bias], lr=lr,
                            weight_decay=1e-2)
    for _ in range(epochs):
        logits = head.fc2(F.gelu(head.fc1(pooled)))[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    head.eval()


def threshold_table(conf: np.ndarray, agree: np.ndarray) -> list[dict[str, float]]:
    """For each threshold: exit rate and overall agreement (exited answers agree with ``agree``,
    the others are the full encoder's, so they agree)."""
    rows = []
    for t in THRESHOLDS:
        leave = conf >= t
        overall = float(np.where(leave, agree, 1.0).mean()) if len(agree) else 1.0
        rows.append({"threshold": t, "exit_rate": float(leave.mean()) if len(agree) else 0.0, "agreement": overall})
    return rows


# --------------------------------------------------------------------------- driver


def default_exit_blocks(n_blocks: int) -> list[int]:
    """Exit points at about one third and one half of the encoder depth (e.g. 6 blocks: [2, 3];
    12 blocks: [4, 6]); one point for shallow encoders."""
    blocks = sorted({max(1, round(n_blocks / 3)), max(1, n_blocks // 2)} - {n_blocks})
    return blocks or ([1] if n_blocks > 1 else [])


def calibrate(engine, *, exit_blocks: list[int] | None = None, steps: int = 300, batch_size: int = 8,
              agreement_images: int = 300, questions_per_image: int = 3, seed: int = 0, kd_steps: int = 0,
              adapter_hidden: int | None = None, adapter_attn_dim: int = 0, adapter_blocks: int = 0,
              progress: Callable[[str], None] = logger.info):
    """Train exit heads for ``engine`` (a loaded :class:`~edgevlm.runtime.Engine`, torch backend).

    Returns the trained :class:`~edgevlm.runtime.exits.ExitHeads` (float32, on the engine's
    device) with the calibration record and metrics in its spec. The engine's model is not changed.

    Raises:
        ValueError: bad exit blocks or counts; a backend other than torch.
    """
    import torch

    from edgevlm.runtime.exits import ExitHeads, ExitMetrics, ThresholdRow, make_spec, weights_fingerprint

    if engine.backend_name != "torch":
        raise ValueError(f"calibration needs the torch backend, not {engine.backend_name!r}")
    if steps < 1 or batch_size < 1 or agreement_images < 5 or questions_per_image < 1:
        raise ValueError("steps, batch_size, questions_per_image must be >= 1 and agreement_images >= 5")
    model = engine.backend.model
    n_blocks = model.cfg.vision_blocks_needed
    blocks = list(exit_blocks) if exit_blocks else default_exit_blocks(n_blocks)
    spec = make_spec(model.cfg, exit_blocks=blocks, labels=demo_labels(), adapter_hidden=adapter_hidden,
                     adapter_attn_dim=adapter_attn_dim, adapter_blocks=adapter_blocks)
    heads = ExitHeads(spec, model.cfg.vision).to(engine.backend.device, torch.float32)
    layers = model.vision_tower.encoder.layers
    for k in spec.exit_blocks:
        adapter = heads.adapters[str(k)]
        adapter.reset_to_identity()
        for blk, src in zip(getattr(adapter, "blocks", []), layers[len(layers) - adapter_blocks:], strict=True):
            blk.load_state_dict({n: t.float() for n, t in src.state_dict().items()})  # start as the last blocks
    t0 = time.perf_counter()
    progress(f"calibrate: exit blocks {blocks} of {n_blocks}, {len(spec.labels)} labels, {steps} steps x {batch_size}")
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)  # the model stays fixed; only the heads learn
    try:
        p1 = train_adapters(engine, heads, steps=steps, batch_size=batch_size, seed=seed, progress=progress)
        if kd_steps > 0:
            distill_answers(engine, heads, steps=kd_steps, batch_size=batch_size, seed=seed, progress=progress)
            p1.update(_phase1_metrics(engine, heads, seed=seed + 1, n=max(2 * batch_size, 16)))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    t1 = time.perf_counter()
    states, agree, correct_full, correct_exit = agreement_data(
        engine, heads, n_images=agreement_images, questions=questions_per_image, seed=seed, progress=progress)
    n_train = int(round(0.8 * agreement_images))
    metrics = {}
    for k in spec.exit_blocks:
        train_confidence(heads, k, states[k][:n_train], agree[k][:n_train], seed=seed)
        with torch.no_grad():
            conf = np.asarray([float(heads.confidence_at(k, s[None].to(heads.adapters[str(k)].fc1.weight), g))
                               for s, g in states[k][n_train:]])
        rows = threshold_table(conf, agree[k][n_train:])
        metrics[str(k)] = ExitMetrics(
            feature_cosine=round(p1[f"feature_cosine_{k}"], 5),
            forced_agreement=round(float(agree[k].mean()), 5),
            thresholds=[ThresholdRow(**{key: round(v, 5) for key, v in r.items()}) for r in rows],
        )
        progress(f"calibrate: exit {k}: feature cosine {p1[f'feature_cosine_{k}']:.4f}, answers unchanged "
                 f"{agree[k].mean():.3f}, exit accuracy {correct_exit[k].mean():.3f} vs full {correct_full.mean():.3f}")
    spec.exit_metrics = metrics
    spec.weights_fingerprint = weights_fingerprint(engine.model_dir)
    spec.classifier_accuracy = {str(k): round(p1[f"classifier_accuracy_{k}"], 5) for k in spec.classifier_blocks}
    spec.classifier_balanced_accuracy = {str(k): round(p1[f"classifier_balanced_accuracy_{k}"], 5)
                                         for k in spec.classifier_blocks}
    progress("calibrate: classifier balanced accuracy " + ", ".join(
        f"block {k}: {v:.3f}" for k, v in spec.classifier_balanced_accuracy.items()))
    spec.calibration = {
        "data": "demo scenes (edgevlm.runtime.demo.scenes), stream rng_for(seed, 3, i)",
        "seed": seed, "steps": steps, "batch_size": batch_size, "agreement_images": agreement_images,
        "questions_per_image": questions_per_image, "kd_steps": kd_steps,
        "resolution_ladder": list(engine.resolution_ladder),
        "full_accuracy": round(float(correct_full.mean()), 5),
        "exit_accuracy": {str(k): round(float(v.mean()), 5) for k, v in correct_exit.items()},
        "adapter_s": round(t1 - t0, 1), "confidence_s": round(time.perf_counter() - t1, 1),
        "source": str(engine.model_dir),
    }
    return heads


def _add_to_manifest(bundle_dir: Path, names: list[str]) -> None:
    """Record (or refresh) ``names`` with their SHA-256 in an engine bundle's ``manifest.json``."""
    from edgevlm.runtime.bundle import MANIFEST_NAME, FileEntry, read_manifest, sha256_file

    manifest = read_manifest(bundle_dir)
    keep = [e for e in manifest.files if e.path not in names]
    for name in names:
        p = bundle_dir / name
        keep.append(FileEntry(path=name, sha256=sha256_file(p), size_bytes=p.stat().st_size))
    manifest.files = sorted(keep, key=lambda e: e.path)
    (bundle_dir / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgevlm calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="model folder or engine bundle")
    ap.add_argument("--exit-blocks", type=int, nargs="+", default=None,
                    help="vision blocks to put exit heads after (default: ~1/3 and ~1/2 of the depth)")
    ap.add_argument("--steps", type=int, default=300, help="adapter/classifier training steps")
    ap.add_argument("--batch-size", type=int, default=8, help="images per training step")
    ap.add_argument("--adapter-hidden", type=int, default=None, help="adapter MLP width (default: D)")
    ap.add_argument("--adapter-attn-dim", type=int, default=0,
                    help="inner width of an attention layer in each adapter (0 = MLP only)")
    ap.add_argument("--adapter-blocks", type=int, default=0,
                    help="full ViT blocks in each adapter, initialised from the encoder's last blocks")
    ap.add_argument("--kd-steps", type=int, default=100,
                    help="answer-distillation steps through the frozen decoder after the feature loss")
    ap.add_argument("--agreement-images", type=int, default=300, help="images for the confidence heads")
    ap.add_argument("--questions-per-image", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: per device)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="output folder (default: the model folder)")
    ap.add_argument("--no-frontier", action="store_true", help="skip the operating-point measurement")
    ap.add_argument("--frontier-n", type=int, default=90, help="evaluation items per grid point")
    ap.add_argument("--profile", default=None, help="device profile whose knob grid to measure")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``edgevlm calibrate``). Returns 0, or 2 after a one-line error."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from edgevlm.errors import EdgeVLMError

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.steps < 1 or args.batch_size < 1 or args.questions_per_image < 1 or args.agreement_images < 5:
            raise ValueError("--steps, --batch-size, --questions-per-image must be >= 1, --agreement-images >= 5")
        if args.threads is not None:
            import torch

            torch.set_num_threads(max(1, args.threads))
        from edgevlm.runtime import Engine
        from edgevlm.runtime.bundle import is_bundle
        from edgevlm.runtime.exits import EXITS_JSON, EXITS_WEIGHTS, load_exit_heads, save_exit_heads

        engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
        heads = calibrate(engine, exit_blocks=args.exit_blocks, steps=args.steps, batch_size=args.batch_size,
                          agreement_images=args.agreement_images, questions_per_image=args.questions_per_image,
                          seed=args.seed, kd_steps=max(0, args.kd_steps), adapter_hidden=args.adapter_hidden,
                          adapter_attn_dim=args.adapter_attn_dim, adapter_blocks=args.adapter_blocks,
                          progress=say)
        out = Path(args.out) if args.out else Path(engine.model_dir)
        weights, spec_path = save_exit_heads(heads, out)
        say(f"calibrate: wrote {weights} and {spec_path}")
        written = [EXITS_WEIGHTS, EXITS_JSON]
        if not args.no_frontier:
            from edgevlm.runtime import frontier

            engine.backend.model.attach_exit_heads(load_exit_heads(out, engine.config, device=engine.backend.device,
                                                                   dtype=engine.backend.dtype))
            written += frontier.run(engine, out, n=args.frontier_n, profile=args.profile, progress=say)
        if args.out is None and is_bundle(out):
            _add_to_manifest(out, written)
            say(f"calibrate: added {', '.join(written)} to {out / 'manifest.json'}")
    except (EdgeVLMError, ValueError, OSError) as exc:
        msg = exc.message if isinstance(exc, EdgeVLMError) else str(exc)
        print(f"edgevlm calibrate: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
