"""Train the shipped demo VLM from scratch on generated scenes (transformers' LLaVA, one seeded command).

    python -m edgevlm.runtime.demo.train --out DIR --seed 0 [--device cuda] [--steps N] [--max-minutes M]

Model: ``LlavaForConditionalGeneration`` with a CLIP ViT (patch 16, 384 px, hidden 256, 6 blocks),
the LLaVA 2-layer GELU projector and a Llama decoder (hidden 256, 4 layers, 4 query / 2 KV heads,
GQA); ``vision_feature_layer -1``, strategy ``default`` (CLS dropped). Data: batches of
:mod:`edgevlm.runtime.demo.scenes` images at one random rung of the resolution ladder per batch,
preprocessed by :func:`edgevlm.runtime.preprocess.preprocess` (CLIP mean/std), each image with a
2-6 turn LLaVA-1.5 conversation; loss on answer tokens (and their ``</s>``) only. Batch ``i`` is a
pure function of ``(seed, i)``, so ``--steps N`` makes a run reproducible whatever the number of
loader workers. Without ``--steps`` the step count is fitted to ``--max-minutes`` from the speed of
the first steps and printed (rerun with that ``--steps``). Eval accuracy is greedy exact match
computed teacher-forced (greedy decoding gives the answer iff the argmax is right at every answer
position). Weights are rounded to float16 before the final eval and saved as float16
safetensors with ``save_pretrained``, plus the tokenizer files and ``"edgevlm":
{"resolution_ladder": [...]}`` in ``config.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np

from edgevlm.runtime.demo import vocab
from edgevlm.runtime.demo.train_data import (
    KIND_WEIGHTS,
    MAX_TURNS,
    MIN_TURNS,
    N_AUX_CLASSES,
    P_JPEG,
    PATCH_PX,
    RESOLUTION_LADDER_PX,
    RUNG_PROBS,
    TrainBatches,
    _eval_item,
    aux_labels,
    eval_batches,
)

logger = logging.getLogger(__name__)

# The data pipeline is edgevlm.runtime.demo.train_data; its names are re-exported here.
__all__ = [
    "EVAL_SEED", "KIND_WEIGHTS", "MAX_TURNS", "MIN_TURNS", "N_AUX_CLASSES", "PATCH_PX", "P_JPEG",
    "RESOLUTION_LADDER_PX", "RUNG_PROBS", "TrainBatches", "aux_labels", "eval_batches", "main", "model_config",
]

EVAL_SEED = 1000


def model_config(tiny: bool = False, vocab_size: int = 128):
    """The demo ``LlavaConfig`` (``tiny``: a 2-block toy for CPU smoke runs)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=64 if tiny else 256,
        intermediate_size=256 if tiny else 1024,
        num_hidden_layers=2 if tiny else 6,
        num_attention_heads=2 if tiny else 4,
        image_size=RESOLUTION_LADDER_PX[0],
        patch_size=PATCH_PX,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        projection_dim=256,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64 if tiny else 256,
        intermediate_size=128 if tiny else 768,
        num_hidden_layers=2 if tiny else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16 if tiny else 64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        bos_token_id=vocab.BOS_ID,
        eos_token_id=vocab.EOS_ID,
        pad_token_id=vocab.PAD_ID,
        tie_word_embeddings=False,
    )
    n_img = (RESOLUTION_LADDER_PX[0] // PATCH_PX) * (RESOLUTION_LADDER_PX[0] * 3 // 4 // PATCH_PX)
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=vocab.IMAGE_TOKEN_ID,
        image_seq_length=n_img,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )


# ----------------------------------------------------------------------------- model


def forward_hidden(model, pixel_values, input_ids, return_vision: bool = False):
    """LLaVA forward up to the decoder's last hidden state, ``(B, T, D)``.

    Same computation as ``LlavaForConditionalGeneration.forward`` with ``vision_feature_layer=-1``
    and strategy ``default``, plus ``interpolate_pos_encoding=True`` for non-square and smaller
    inputs; no attention mask (right padding + causal attention: real tokens never see pads).
    """
    inner = model.model
    vis = inner.vision_tower(pixel_values=pixel_values, interpolate_pos_encoding=True)
    feats = vis.last_hidden_state[:, 1:]  # (B, Np, Dv), CLS dropped
    img = inner.multi_modal_projector(feats)  # (B, Np, D)
    emb = inner.get_input_embeddings()(input_ids)  # (B, T, D)
    mask = (input_ids == vocab.IMAGE_TOKEN_ID).unsqueeze(-1)  # (B, T, 1)
    emb = emb.masked_scatter(mask, img.to(emb.dtype))
    out = inner.language_model(inputs_embeds=emb, use_cache=False)
    if return_vision:
        return out.last_hidden_state, feats
    return out.last_hidden_state


def answer_logits(model, batch: dict, device):
    """Logits at the positions that predict supervised tokens: ``(M, V)`` float32, targets ``(M,)``
    and the row of each, ``(M,)``."""
    import torch

    pixel_values = batch["pixel_values"].to(device, non_blocking=True)
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    target = batch["target"].to(device, non_blocking=True)
    hidden = forward_hidden(model, pixel_values, input_ids)  # (B, T, D)
    pred_pos = target[:, 1:]  # (B, T-1): position t predicts token t+1
    h = hidden[:, :-1][pred_pos]  # (M, D)
    logits = model.lm_head(h).float()  # (M, V)
    tgt = input_ids[:, 1:][pred_pos]  # (M,)
    rows = torch.nonzero(pred_pos, as_tuple=True)[0]  # (M,)
    return logits, tgt, rows


def train_loss(model, batch: dict, device, aux_head=None, aux_weight: float = 0.0):
    """Mean cross-entropy over the supervised tokens; the same value as over
    :func:`answer_logits`, but without boolean indexing, so no host-device sync per step.
    With ``aux_head`` (a ``Linear(Dv, N_AUX_CLASSES + 6)``), adds ``aux_weight`` × the dense
    per-patch loss of :func:`aux_labels` (coverage class, object centre, image half)."""
    import torch.nn.functional as F

    pixel_values = batch["pixel_values"].to(device, non_blocking=True)
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    target = batch["target"].to(device, non_blocking=True)
    hidden, feats = forward_hidden(model, pixel_values, input_ids, return_vision=True)  # (B, T, D)
    logits = model.lm_head(hidden[:, :-1]).float()  # (B, T-1, V)
    labels = input_ids[:, 1:].masked_fill(~target[:, 1:], -100)  # (B, T-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    if aux_head is None or "aux" not in batch:
        return loss
    aux = batch["aux"].to(device, non_blocking=True)  # (B, 4, Np)
    out = aux_head(feats).float()  # (B, Np, C + 6)
    terms = F.cross_entropy(out[..., :N_AUX_CLASSES].reshape(-1, N_AUX_CLASSES), aux[:, 0].reshape(-1))
    for k in range(3):  # centre, right half, bottom half: 2-way each
        lo = N_AUX_CLASSES + 2 * k
        terms = terms + F.cross_entropy(out[..., lo : lo + 2].reshape(-1, 2), aux[:, 1 + k].reshape(-1))
    return loss + aux_weight * terms


def exact_match(model, batches, device, amp_dtype) -> tuple[float, dict[str, float]]:
    """Greedy exact-match accuracy (teacher-forced: all answer argmaxes right) and per kind."""
    import torch

    hits: dict[str, list[bool]] = {}
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        for batch, kinds in batches:
            logits, tgt, rows = answer_logits(model, batch, device)
            wrong = torch.zeros(len(kinds), device=device)
            wrong.index_add_(0, rows, (logits.argmax(-1) != tgt).float())
            for kind, w in zip(kinds, wrong.tolist(), strict=True):
                hits.setdefault(kind, []).append(w == 0)
    model.train()
    per_kind = {k: float(np.mean(v)) for k, v in sorted(hits.items())}
    total = float(np.mean([h for v in hits.values() for h in v]))
    return total, per_kind


def init_position_embedding(model, base: float = 100.0) -> None:
    """Initialise the ViT's learned position embeddings with 2-D sin-cos values (MAE, He et al.
    2021, "Masked Autoencoders Are Scalable Vision Learners", eq. of its pos_embed; here with
    base 100 for a 24x24 grid): the first half of the channels encodes the patch row, the second
    the column, CLS gets zeros. Still a learned parameter; from-scratch training at small scale
    otherwise learns left/right very slowly (the default N(0, 0.02) init is tiny next to the
    patch embeddings)."""
    import torch

    emb = next(m for m in model.model.vision_tower.modules() if hasattr(m, "position_embedding"))
    weight = emb.position_embedding.weight  # (1 + G*G, D)
    dim = weight.shape[1]
    side = int(round((weight.shape[0] - 1) ** 0.5))
    quarter = dim // 4
    omega = 1.0 / base ** (torch.arange(quarter, dtype=torch.float64) / quarter)  # (D/4,)
    pos = torch.arange(side, dtype=torch.float64)[:, None] * omega[None, :]  # (G, D/4)
    one_d = torch.cat([pos.sin(), pos.cos()], dim=1)  # (G, D/2)
    rows = one_d[:, None, :].expand(side, side, dim // 2)  # (G, G, D/2) by row
    cols = one_d[None, :, :].expand(side, side, dim // 2)  # (G, G, D/2) by column
    grid = torch.cat([rows, cols], dim=-1).reshape(side * side, dim)  # (G*G, D) row-major
    with torch.no_grad():
        weight[0].zero_()
        weight[1:].copy_(grid.to(weight.dtype))


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.ndim >= 2 and "embed" not in name and "position" not in name
        (decay if is_matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 5% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def save_model(model, out_dir: Path) -> int:
    """``save_pretrained`` with float16 weights (the training weights are left untouched) +
    tokenizer files + the edgevlm key in ``config.json``. Returns the weight file size in bytes."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).cpu() for k, v in model.state_dict().items()}
    model.save_pretrained(str(out_dir), state_dict=state)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float16"
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = "float16"
    cfg["edgevlm"] = {"resolution_ladder": list(RESOLUTION_LADDER_PX)}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    vocab.save_tokenizer(out_dir)
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    from edgevlm.cli_args import OneLineParser, fail

    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output model folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=0, help="total steps (0: fit to --max-minutes)")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="time bound of the training loop")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument(
        "--checkpoint-every", type=int, default=2000, help="save to --out every N steps (0: never)"
    )
    ap.add_argument("--eval-n", type=int, default=1800, help="held-out items for the final eval")
    ap.add_argument("--init", default=None, help="start from this checkpoint instead of scratch")
    ap.add_argument("--tiny", action="store_true", help="2-block toy model (CPU smoke test)")
    ap.add_argument(
        "--aux-weight", type=float, default=0.5, help="weight of the dense per-patch vision loss (0: off)"
    )
    ap.add_argument("--exit-blocks", type=int, nargs="+", default=None,
                    help="early-exit training (edgevlm.runtime.demo.train_exits): exit after these vision blocks")
    ap.add_argument("--exit-weight", type=float, default=1.0, help="loss weight of each exit (full path: 1)")
    ap.add_argument("--exit-adapter-hidden", type=int, default=512, help="exit adapter MLP width")
    ap.add_argument("--exit-adapter-attn-dim", type=int, default=128, help="exit adapter attention width (0: none)")
    ap.add_argument("--exit-init", default=None, help="folder with exits.json/.safetensors to start the heads from")
    args = ap.parse_args(argv)
    problem = _check_args(args)
    if problem:
        return fail(problem)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch
    from torch.utils.data import DataLoader
    from transformers import LlavaForConditionalGeneration

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(args.device)
    amp_dtype = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    from multiprocessing import Pool

    n_quick = min(450, args.eval_n)
    with Pool(max(1, args.workers)) as pool:
        quick_items = pool.map(_eval_item, [(EVAL_SEED, i) for i in range(n_quick)], chunksize=16)
    quick = {
        r: eval_batches(quick_items, r, 150) for r in (RESOLUTION_LADDER_PX[0], RESOLUTION_LADDER_PX[-1])
    }
    print(f"quick eval set: {n_quick} items ({time.perf_counter() - t_start:.1f}s)", flush=True)

    try:
        if args.init:
            model = LlavaForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32)
        else:
            model = LlavaForConditionalGeneration(model_config(tiny=args.tiny))
            init_position_embedding(model)
    except (OSError, ValueError) as exc:
        return fail(f"--init {args.init}: cannot load the model ({exc})")
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,} ({n_params * 2 / 1e6:.1f} MB in float16)", flush=True)

    aux_head = None
    groups = _param_groups(model, args.weight_decay)
    heads = None
    if args.exit_blocks:
        from edgevlm.errors import EdgeVLMError
        from edgevlm.runtime.demo import train_exits

        try:
            heads = train_exits.build_exit_heads(model, args.exit_blocks, adapter_hidden=args.exit_adapter_hidden,
                                                 adapter_attn_dim=args.exit_adapter_attn_dim, init=args.exit_init)
        except (ValueError, EdgeVLMError, OSError, RuntimeError) as exc:
            return fail(exc)
        heads.train()
        groups.append({"params": list(heads.adapters.parameters()), "weight_decay": args.weight_decay})
        print(f"early-exit training: exits after blocks {heads.exit_blocks}, weight {args.exit_weight}", flush=True)
    if args.aux_weight > 0:
        torch.manual_seed(args.seed + 1)
        aux_head = torch.nn.Linear(model.config.vision_config.hidden_size, N_AUX_CLASSES + 6).to(device)
        groups.append({"params": list(aux_head.parameters()), "weight_decay": 0.0})
    opt = torch.optim.AdamW(
        groups,
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    data = TrainBatches(args.seed, args.batch_size)
    budget_s = args.max_minutes * 60.0
    total = args.steps if args.steps > 0 else 10**9
    loader = DataLoader(
        data,
        batch_size=None,
        sampler=range(total if args.steps > 0 else 10**7),
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=6 if args.workers else None,
        persistent_workers=False,
        worker_init_fn=_worker_init,
    )
    t_loop = time.perf_counter()
    t_log, wait_s, loss_acc, n_acc = t_loop, 0.0, 0.0, 0
    step, t_fit = 0, 0.0
    t_fetch = time.perf_counter()
    for batch in loader:
        wait_s += time.perf_counter() - t_fetch
        if step >= total:
            break
        elapsed = time.perf_counter() - t_loop
        if elapsed > budget_s:
            print(f"time bound reached at step {step} of {total}", flush=True)
            break
        if args.steps <= 0 and step == 30:
            t_fit = elapsed
        if args.steps <= 0 and step == 130:  # steady-state speed of steps 30..130
            per_step = (elapsed - t_fit) / 100
            total = step + max(1, int((budget_s - elapsed) / per_step * 0.97))
            print(
                f"fitted --steps {total} ({per_step * 1000:.1f} ms/step); reproduce with --steps {total}",
                flush=True,
            )
        lr = lr_at(step, total if total < 10**9 else 20000, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            if heads is None:
                loss = train_loss(model, batch, device, aux_head, args.aux_weight)
            else:
                loss, _ = train_exits.joint_loss(model, heads, batch, device, exit_weight=args.exit_weight,
                                                     aux_head=aux_head, aux_weight=args.aux_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        loss_acc += loss.item() if (step % 25 == 0) else 0.0
        n_acc += 1 if step % 25 == 0 else 0
        step += 1
        if step % 100 == 0:
            now = time.perf_counter()
            print(
                f"step {step}/{total if total < 10**9 else '?'} loss {loss_acc / max(n_acc, 1):.4f} lr {lr:.2e} "
                f"{100 / (now - t_log):.1f} steps/s data-wait {100 * wait_s / (now - t_log):.0f}% "
                f"t={now - t_start:.0f}s",
                flush=True,
            )
            t_log, wait_s, loss_acc, n_acc = now, 0.0, 0.0, 0
        if step % args.eval_every == 0 and heads is not None:
            for r, b in quick.items():
                accs = train_exits.exact_match_variants(model, heads, b, device, amp_dtype)
                print(f"eval step {step} {r}px: full {accs[0][0]:.3f} "
                      + " ".join(f"exit@{k} {a[0]:.3f}" for k, a in zip(heads.exit_blocks, accs[1:], strict=True)),
                      flush=True)
        elif step % args.eval_every == 0:
            accs = {r: exact_match(model, b, device, amp_dtype) for r, b in quick.items()}
            top = accs[RESOLUTION_LADDER_PX[0]][1]
            print(
                f"eval step {step}: "
                + " ".join(f"{r}px {a[0]:.3f}" for r, a in accs.items())
                + " | top rung: "
                + " ".join(f"{k} {v:.2f}" for k, v in top.items()),
                flush=True,
            )
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_model(model, Path(args.out))
                print(f"checkpoint saved at step {step}", flush=True)
        t_fetch = time.perf_counter()
    del loader
    print(f"trained {step} steps in {time.perf_counter() - t_loop:.0f}s", flush=True)

    # Round to the shipped float16 weights, then the final held-out eval at every rung.
    with torch.no_grad():
        for p in [*model.parameters(), *(heads.parameters() if heads is not None else [])]:
            p.copy_(p.to(torch.float16).to(torch.float32))
    with Pool(max(1, args.workers)) as pool:
        items = pool.map(_eval_item, [(EVAL_SEED, i) for i in range(args.eval_n)], chunksize=16)
    result = {"steps": step, "seed": args.seed, "parameters": n_params, "eval_n": args.eval_n, "accuracy": {}}
    for rung in RESOLUTION_LADDER_PX:
        if heads is not None:
            accs = train_exits.exact_match_variants(model, heads, eval_batches(items, rung, 150), device, amp_dtype)
            (acc, per_kind), exits = accs[0], accs[1:]
            for k, (a, pk) in zip(heads.exit_blocks, exits, strict=True):
                result.setdefault("exit_accuracy", {}).setdefault(str(k), {})[str(rung)] = {"all": a, **pk}
                print(f"final {rung}px exit@{k}: {a:.4f} " + " ".join(f"{kk} {v:.3f}" for kk, v in pk.items()),
                      flush=True)
        else:
            acc, per_kind = exact_match(model, eval_batches(items, rung, 150), device, amp_dtype)
        result["accuracy"][str(rung)] = {"all": acc, **per_kind}
        print(
            f"final {rung}px: {acc:.4f} " + " ".join(f"{k} {v:.3f}" for k, v in per_kind.items()), flush=True
        )
    size = save_model(model, Path(args.out))
    result["weights_bytes"] = size
    if heads is not None:
        result["exit_blocks"], result["exit_weight"], result["init"] = heads.exit_blocks, args.exit_weight, args.init
        train_exits.save_heads(heads, Path(args.out), result)
    print(
        f"saved {args.out} ({size / 1e6:.2f} MB safetensors) t={time.perf_counter() - t_start:.0f}s",
        flush=True,
    )
    print(json.dumps(result), flush=True)
    return 0


def _check_args(args) -> str | None:
    """The first problem with the options that is visible before any work, or None."""
    for name in ("steps", "batch_size", "warmup", "eval_every", "eval_n", "checkpoint_every", "workers"):
        value, least = getattr(args, name), 1 if name in ("batch_size", "eval_every", "eval_n") else 0
        if value < least:
            return f"--{name.replace('_', '-')} must be >= {least}, got {value}"
    if args.lr <= 0 or args.max_minutes <= 0:
        return "--lr and --max-minutes must be > 0"
    if args.init and not (Path(args.init) / "config.json").is_file():
        return f"--init {args.init}: not a model folder (no config.json)"
    if args.exit_init and not args.exit_blocks:
        return "--exit-init needs --exit-blocks (early-exit training is off without it)"
    if args.exit_init and not (Path(args.exit_init) / "exits.json").is_file():
        return f"--exit-init {args.exit_init}: no exits.json there"
    if args.exit_blocks is not None:
        if args.exit_weight < 0:
            return f"--exit-weight must be >= 0, got {args.exit_weight}"
        if args.exit_adapter_hidden < 1 or args.exit_adapter_attn_dim < 0:
            return "--exit-adapter-hidden must be >= 1 and --exit-adapter-attn-dim >= 0"
    return None


def _worker_init(_worker_id: int) -> None:
    import cv2

    cv2.setNumThreads(1)


if __name__ == "__main__":
    raise SystemExit(main())
