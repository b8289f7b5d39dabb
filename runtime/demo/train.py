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
import os
import time
from pathlib import Path

import numpy as np

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
from edgevlm.runtime.demo.train_model import (  # noqa: F401  (re-exported: used by tests and train_exits)
    _param_groups,
    answer_logits,
    exact_match,
    forward_hidden,
    init_position_embedding,
    lr_at,
    model_config,
    save_model,
    train_loss,
)

logger = logging.getLogger(__name__)

# The data pipeline is edgevlm.runtime.demo.train_data; its names are re-exported here.
__all__ = [
    "EVAL_SEED", "KIND_WEIGHTS", "MAX_TURNS", "MIN_TURNS", "N_AUX_CLASSES", "PATCH_PX", "P_JPEG",
    "RESOLUTION_LADDER_PX", "RUNG_PROBS", "TrainBatches", "aux_labels", "eval_batches", "main", "model_config",
]

EVAL_SEED = 1000


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
