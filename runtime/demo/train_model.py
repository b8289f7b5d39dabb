"""The demo VLM's model pieces for :mod:`edgevlm.runtime.demo.train`: configuration, the training
forward and loss (transformers' LLaVA), teacher-forced exact match, position-embedding init, the
learning-rate schedule and float16 saving. See the training module's doc for the recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from edgevlm.runtime.demo import vocab
from edgevlm.runtime.demo.train_data import N_AUX_CLASSES, PATCH_PX, RESOLUTION_LADDER_PX
from edgevlm.runtime.preprocess import CLIP_MEAN, CLIP_STD


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
    return loss + aux_weight * dense_aux_loss(aux_head, feats, batch["aux"].to(device, non_blocking=True))


def dense_aux_loss(aux_head, feats, aux):
    """The dense per-patch vision loss of :func:`aux_labels`: ``aux_head`` (a ``Linear(Dv,
    N_AUX_CLASSES + 6)``) on ``feats (B, Np, Dv)`` against ``aux (B, 4, Np)`` (coverage class, then
    object centre, right half, bottom half, 2-way each); summed cross-entropies."""
    import torch.nn.functional as F

    out = aux_head(feats).float()  # (B, Np, C + 6)
    terms = F.cross_entropy(out[..., :N_AUX_CLASSES].reshape(-1, N_AUX_CLASSES), aux[:, 0].reshape(-1))
    for k in range(3):  # centre, right half, bottom half: 2-way each
        lo = N_AUX_CLASSES + 2 * k
        terms = terms + F.cross_entropy(out[..., lo : lo + 2].reshape(-1, 2), aux[:, 1 + k].reshape(-1))
    return terms


def record_hits(hits: dict[str, list[bool]], logits, tgt, rows, kinds: list[str]) -> None:
    """Append, per item of a batch, whether every supervised argmax of ``logits (M, V)`` equals
    ``tgt (M,)`` (``rows (M,)``: the item of each position) to ``hits[kind]``."""
    import torch

    wrong = torch.zeros(len(kinds), device=logits.device)
    wrong.index_add_(0, rows, (logits.argmax(-1) != tgt).float())
    for kind, w in zip(kinds, wrong.tolist(), strict=True):
        hits.setdefault(kind, []).append(w == 0)


def summarise_hits(hits: dict[str, list[bool]]) -> tuple[float, dict[str, float]]:
    """``(overall accuracy, per kind)`` of :func:`record_hits`' record."""
    per_kind = {k: float(np.mean(v)) for k, v in sorted(hits.items())}
    return float(np.mean([h for v in hits.values() for h in v])), per_kind


def exact_match(model, batches, device, amp_dtype) -> tuple[float, dict[str, float]]:
    """Greedy exact-match accuracy (teacher-forced: all answer argmaxes right) and per kind."""
    import torch

    hits: dict[str, list[bool]] = {}
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        for batch, kinds in batches:
            logits, tgt, rows = answer_logits(model, batch, device)
            record_hits(hits, logits, tgt, rows, kinds)
    model.train()
    return summarise_hits(hits)


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
    # the normalisation it is trained with; no "size": it runs at its resolution-ladder rungs
    (out_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)}, indent=2) + "\n")
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))
