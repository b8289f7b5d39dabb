"""Phase 2 of ``edgevlm calibrate``: answer agreement of the exits, the confidence heads, the threshold.

For many calibration (image, question) pairs the decoder answers greedily from the full encoder's
features (the teacher answer); for every exit block a teacher-forced pass checks whether greedy
decoding from the exit's adapted features gives exactly the same tokens (it does iff the argmax at
every answer position is the answer token). Each pair gives, per exit block, a 0/1 target "answer
unchanged". The confidence head of a block learns it from block ``k``'s pooled states and, for
question-conditioned heads, the question embedding (BCE; early stopping on a validation split). On
held-out images the exit *cascade* (every exit point gated by one threshold, the encoder stopping at
the first that clears it) is simulated for a grid of thresholds, and ``recommended_threshold`` is
chosen by Learn then Test (Angelopoulos, Bates, Candes, Jordan & Lei, "Learn then Test:
Calibrating Predictive Algorithms to Achieve Risk Control", 2021) with fixed-sequence testing:
from the highest threshold down, the null "answer-change rate > alpha" (``max_answer_change``) is
tested with the exact binomial test on the held-out pairs, and the lowest threshold reached before
the first test that fails to reject at level ``delta`` is returned; with probability >= 1 - delta
its true change rate is <= alpha (pairs treated as independent; questions of one image are not
quite). ``delta = 0`` takes the plain point estimate instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)

MAX_ANSWER_TOKENS = 24
THRESHOLDS = [round(0.05 * i, 2) for i in range(21)]
CASCADE_THRESHOLDS = sorted({*[round(0.01 * i, 2) for i in range(101)], 0.995, 0.999})


# ------------------------------------------------------------------------------------ decoding


def decoder_logits(dec, embeds):
    """Causal logits ``(B, T, V)`` of the decoder for ``embeds`` ``(B, T, D)`` at positions
    ``0..T-1``, without touching the KV cache (so autograd can run through it; the same math as
    :meth:`~edgevlm.runtime.decoder.Decoder.forward` with ``prefill=True``). Right padding is
    harmless: causal attention never lets a position see the ones after it."""
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


def sequence_embeds(model, seqs: list[list[int]], feats, prompt_lens: list[int] | None = None):
    """Right-padded input embeddings of token sequences whose image tokens take ``feats``.

    Args:
        seqs: B token id lists, each holding exactly N image tokens in its prompt.
        feats: ``(B, N, D_text)`` projected vision tokens, row ``i`` for sequence ``i``.
        prompt_lens: per sequence, the prompt length; tokens after it are generated ones,
            embedded plainly even if one is the image token id (as decode does).
    Returns:
        ``(B, T_max, D_text)`` embeddings (pads are token 0) in ``feats``' dtype.
    """
    import torch

    t_max = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t_max, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = torch.tensor(s)
    ids = ids.to(feats.device)  # one host-to-device copy
    is_img = ids == model.cfg.image_token_id  # (B, T); pads are id 0, never the image token
    if prompt_lens is not None:
        pos = torch.arange(t_max, device=feats.device)
        is_img &= pos[None] < torch.tensor(prompt_lens, device=feats.device)[:, None]
    tok = model.language_model.embed_tokens(ids).to(feats.dtype)  # (B, T, D)
    return tok.masked_scatter(is_img[..., None], feats)


def greedy_tokens(engine, ids: list[int], feats, max_new_tokens: int = MAX_ANSWER_TOKENS) -> list[int]:
    """Greedy generation through the backend (prefill + decode into the KV cache); token ids,
    ending with EOS unless the cap was hit. ``feats``: ``(1, N, D_text)``."""
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


def batched_greedy(engine, prompts: list[list[int]], feats, max_new_tokens: int = MAX_ANSWER_TOKENS) -> list[list[int]]:
    """Greedy answers of B prompts at once, re-running the whole right-padded batch through
    :func:`decoder_logits` per new token (no KV cache: cheap on a GPU, where per-token launch
    overhead would dominate a per-prompt loop). Same tokens as :func:`greedy_tokens` up to
    floating-point ties. ``feats``: ``(B, N, D_text)``, row ``i`` for prompt ``i``."""
    import torch

    model = engine.backend.model
    eos = engine.eos_token_ids
    seqs = [list(p) for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not live:
            break
        logits = decoder_logits(model.language_model, sequence_embeds(model, [seqs[i] for i in live], feats[live],
                                                                      [len(prompts[i]) for i in live]))
        last = torch.tensor([len(seqs[i]) - 1 for i in live], device=logits.device)
        toks = logits[torch.arange(len(live), device=logits.device), last].argmax(-1).tolist()  # (B_live,)
        still = []
        for i, tok in zip(live, toks, strict=True):
            answers[i].append(tok)
            seqs[i].append(tok)
            if tok not in eos:
                still.append(i)
        live = still
    return answers


def reproduces_batch(engine, prompts: list[list[int]], feats, answers: list[list[int]]) -> list[bool]:
    """Whether greedy decoding from ``feats`` ``(B, N, D_text)`` gives exactly ``answers[i]`` for
    each prompt (one teacher-forced pass: the argmax at every answer position must be the answer
    token; generated tokens are embedded plainly, as decode does)."""
    model = engine.backend.model
    seqs = [p + a[:-1] for p, a in zip(prompts, answers, strict=True)]
    embeds = sequence_embeds(model, seqs, feats, [len(p) for p in prompts])
    pred = decoder_logits(model.language_model, embeds).argmax(-1).cpu()  # (B, T)
    out = []
    for j, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        out.append(pred[j, len(p) - 1 : len(p) - 1 + len(a)].tolist() == a)
    return out


def reproduces(engine, ids: list[int], feats, answer: list[int]) -> bool:
    """:func:`reproduces_batch` for one prompt (``feats`` ``(1, N, D_text)``)."""
    return reproduces_batch(engine, [ids], feats, [answer])[0]


# ------------------------------------------------------------------------------------ confidence


def train_confidence(head, pooled, query, target: np.ndarray, *, val_fraction: float = 0.15, epochs: int = 600,
                     lr: float = 2e-3, weight_decay: float = 0.05, groups: np.ndarray | None = None,
                     seed: int = 0) -> dict[str, float]:
    """Fit a confidence head's MLP on precomputed inputs (BCE on 0/1 "answer unchanged").

    Args:
        head: a :class:`~edgevlm.runtime.exits.PooledHead` with one output.
        pooled: ``(n, 7D + 1)`` float32 pooled states (:meth:`PooledHead.pool`).
        query: ``(n, Q)`` question embeddings, or None for an image-only head.
        target: ``(n,)`` 0/1.
        groups: ``(n,)`` image index of each pair; the validation split (early stopping: the
            epoch with the lowest validation BCE is kept) takes whole images.
    Returns:
        ``{"train_bce", "val_bce", "best_epoch"}``.
    """
    import copy

    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    n = len(target)
    groups = np.arange(n) if groups is None else groups
    uniq = np.unique(groups)
    rng = np.random.default_rng(seed)
    val_g = set(rng.choice(uniq, size=max(1, int(len(uniq) * val_fraction)), replace=False).tolist())
    is_val = torch.from_numpy(np.asarray([g in val_g for g in groups]))
    y = torch.from_numpy(np.asarray(target, np.float32)).to(pooled.device)
    for p in head.parameters():
        p.requires_grad_(False)
    params = [head.fc1.weight, head.fc1.bias, head.fc2.weight, head.fc2.bias]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    tr, va = (~is_val).to(pooled.device), is_val.to(pooled.device)
    best = (float("inf"), -1, None)
    head.train()
    for epoch in range(epochs):
        logits = head.head(pooled, query)[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits[tr], y[tr])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if epoch % 10 == 9 or epoch == epochs - 1:
            with torch.no_grad():
                v = float(F.binary_cross_entropy_with_logits(head.head(pooled, query)[:, 0][va], y[va])) if va.any() else 0.0
            if v < best[0]:
                best = (v, epoch, copy.deepcopy(head.state_dict()))
    if best[2] is not None:
        head.load_state_dict(best[2])
    head.eval()
    with torch.no_grad():
        train_bce = float(F.binary_cross_entropy_with_logits(head.head(pooled, query)[:, 0][tr], y[tr]))
    return {"train_bce": round(train_bce, 5), "val_bce": round(best[0], 5), "best_epoch": best[1] + 1}


def threshold_table(conf: np.ndarray, agree: np.ndarray) -> list[dict[str, float]]:
    """For each threshold of :data:`THRESHOLDS`: exit rate and overall agreement when only this
    exit is consulted (exited answers agree with ``agree``, the others are the full encoder's)."""
    rows = []
    for t in THRESHOLDS:
        leave = conf >= t
        overall = float(np.where(leave, agree, 1.0).mean()) if len(agree) else 1.0
        rows.append({"threshold": t, "exit_rate": float(leave.mean()) if len(agree) else 0.0, "agreement": overall})
    return rows


def cascade_table(conf: dict[int, np.ndarray], agree: dict[int, np.ndarray], n_blocks: int,
                  thresholds: list[float] | None = None) -> list[dict]:
    """Simulate the exit cascade (stop at the first exit block whose confidence >= t) per threshold.

    Args:
        conf, agree: per exit block, ``(n,)`` confidences and 0/1 "answer unchanged" of the same pairs.
        n_blocks: encoder depth (blocks run without an exit).
    Returns:
        rows ``{"threshold", "exit_rates": {block: rate}, "answer_change", "blocks_mean"}``.
    """
    blocks = sorted(conf)
    n = len(next(iter(conf.values()))) if conf else 0
    rows = []
    for t in thresholds or CASCADE_THRESHOLDS:
        done = np.zeros(n, bool)
        changed = np.zeros(n, bool)
        depth = np.full(n, float(n_blocks))
        rates = {}
        for k in blocks:
            leave = ~done & (conf[k] >= t)
            rates[str(k)] = round(float(leave.mean()) if n else 0.0, 5)
            changed |= leave & (agree[k] < 0.5)
            depth[leave] = k
            done |= leave
        rows.append({"threshold": t, "exit_rates": rates, "answer_change": round(float(changed.mean()) if n else 0.0, 5),
                     "blocks_mean": round(float(depth.mean()) if n else float(n_blocks), 4), "pairs": int(n),
                     "changes": int(changed.sum())})
    return rows


def binomial_cdf(k: int, n: int, p: float) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, p)`` (summed in log space; exact for any n)."""
    if k >= n or p <= 0.0:
        return 1.0
    if k < 0:
        return 0.0
    if p >= 1.0:
        return 0.0
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
            for i in range(k + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def recommend_threshold(rows: list[dict], max_answer_change: float, delta: float = 0.1) -> float | None:
    """The recommended cascade threshold (see the module doc): Learn then Test over the rows from
    the highest threshold down, each row's p-value ``P(Binomial(pairs, alpha) <= changes)`` stored
    in ``row["p_value"]``; the lowest threshold before the first p-value > ``delta`` at which
    something exits (None if none). ``delta = 0``: the lowest threshold whose point estimate
    ``answer_change`` is <= alpha. Thresholds of 1.0 are never recommended."""
    ordered = sorted(rows, key=lambda r: -r["threshold"])
    best = None
    for r in ordered:
        if delta > 0:
            r["p_value"] = round(binomial_cdf(r.get("changes", 0), r.get("pairs", 0), max_answer_change), 6)
            if r["p_value"] > delta:
                break
        elif r["answer_change"] > max_answer_change:
            continue
        if sum(r["exit_rates"].values()) > 0 and r["threshold"] < 1.0:
            best = r["threshold"]
    return best


def pairs_record(pooled: dict, queries: list, image_idx: list, agree: dict, correct_full: list, correct_exit: dict,
                 kinds: list[str]) -> dict:
    """The calibration pairs as :func:`collect_pairs` returns them: per exit block the pooled exit
    features ``(P, D)`` float32 and 0/1 agreement / correctness arrays ``(P,)``; the question
    embeddings ``(P, Q)`` (or None), each pair's image index and question kind."""
    import torch

    return {
        "pooled": {k: torch.cat(v) for k, v in pooled.items()},
        "query": torch.cat(queries) if queries else None,
        "image": np.asarray(image_idx),
        "agree": {k: np.asarray(v, np.float32) for k, v in agree.items()},
        "correct_full": np.asarray(correct_full, np.float32),
        "correct_exit": {k: np.asarray(v, np.float32) for k, v in correct_exit.items()},
        "kinds": kinds,
    }


def collect_pairs(engine, heads, batches, *, progress: Callable[[str], None] = logger.info, total: int = 0,
                  deadline: float | None = None) -> dict:
    """Answer agreement of every exit on calibration pairs.

    Args:
        batches: iterable of dicts ``{"pixels": (B, 3, H, W) float32 ndarray, "qas": B lists of
            (question, answer, kind)}`` (see :class:`edgevlm.quantize.calibrate_data.BatchStream`).
        deadline: ``time.perf_counter()`` value after which no further batch is started.
    Returns:
        ``{"pooled": {k: (n_img, 7D + 1) tensor}, "query": (n_pairs, Q) tensor or None, "image":
        (n_pairs,) image index, "agree": {k: (n_pairs,) 0/1}, "correct_full": (n_pairs,),
        "correct_exit": {k: (n_pairs,)}, "kinds": [str]}``.
    """
    import torch

    from edgevlm.quantize.calibrate_data import encoder_states, selected_features
    from edgevlm.runtime.exits import query_embedding

    model = engine.backend.model
    spec = heads.spec
    dev, dtype = engine.backend.device, engine.backend.dtype
    need = set(spec.exit_blocks) | set(model.cfg.vision_feature_indices)
    select = (lambda t: t[:, 1:]) if model.cfg.vision_feature_select_strategy == "default" else (lambda t: t)
    batched = str(dev).startswith("cuda")
    tok = engine.tokenizer
    pooled: dict[int, list] = {k: [] for k in spec.exit_blocks}
    queries, image_idx, kinds, correct_full = [], [], [], []
    agree: dict[int, list] = {k: [] for k in spec.exit_blocks}
    correct_exit: dict[int, list] = {k: [] for k in spec.exit_blocks}
    n_img = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b_i, batch in enumerate(batches):
            if deadline is not None and time.perf_counter() > deadline and n_img:
                progress(f"calibrate: agreement stopped after {n_img} images (time budget)")
                break
            px = torch.from_numpy(batch["pixels"]).to(dev, dtype)
            p = model.cfg.vision.patch_size
            grid = (px.shape[-2] // p, px.shape[-1] // p)
            st = encoder_states(model, px, need)
            full = model.vision_tower.projector(selected_features(model, st))  # (B, N, D_text)
            hd = next(heads.parameters()).dtype
            exit_feats = {k: model.vision_tower.projector(select(heads.adapt(k, st[k].to(hd))).to(dtype))
                          for k in spec.exit_blocks}
            for k in spec.exit_blocks:
                pooled[k].append(heads.confidence[str(k)].pool(st[k].to(hd), grid).float())  # (B, 7D + 1)
            rows = [(j, q, a, kind) for j, qas in enumerate(batch["qas"]) for q, a, kind in qas]
            prompts = [tok.encode_prompt(q, full.shape[1]) for _, q, _, _ in rows]
            img = torch.tensor([j for j, *_ in rows], device=full.device)
            if batched:
                answers = batched_greedy(engine, prompts, full[img])
            else:
                answers = [greedy_tokens(engine, ids, full[j : j + 1]) for ids, (j, *_) in zip(prompts, rows, strict=True)]
            ok_full = [tok.decode(ans).strip() == a for ans, (_, _, a, _) in zip(answers, rows, strict=True)]
            for k in spec.exit_blocks:
                same = reproduces_batch(engine, prompts, exit_feats[k][img], answers)
                agree[k] += [float(s) for s in same]
                changed = [r for r, s in enumerate(same) if not s]  # may still be right where full was wrong
                if batched and changed:
                    alts = batched_greedy(engine, [prompts[r] for r in changed], exit_feats[k][img[changed]])
                else:
                    alts = [greedy_tokens(engine, prompts[r], exit_feats[k][rows[r][0]][None]) for r in changed]
                alt_ok = {r: tok.decode(alt).strip() == rows[r][2] for r, alt in zip(changed, alts, strict=True)}
                correct_exit[k] += [float(alt_ok[r] if r in alt_ok else ok_full[r]) for r in range(len(rows))]
            if spec.confidence_query_dim:  # pad with the image token: query_embedding leaves it out
                img_id = model.cfg.image_token_id
                t_max = max(len(x) for x in prompts)
                ids_t = torch.tensor([x + [img_id] * (t_max - len(x)) for x in prompts], device=dev)
                queries.append(query_embedding(model.language_model.embed_tokens, ids_t, img_id).float())
            image_idx += [n_img + j for j, *_ in rows]
            kinds += [kind for *_, kind in rows]
            correct_full += [float(x) for x in ok_full]
            n_img += len(batch["qas"])
            if b_i % 10 == 0:
                progress(f"calibrate: agreement {n_img}{'/' + str(total) if total else ''} images, {len(kinds)} pairs "
                         f"({time.perf_counter() - t0:.0f} s)")
    return pairs_record(pooled, queries, image_idx, agree, correct_full, correct_exit, kinds)
