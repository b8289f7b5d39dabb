"""Early-exit training of the demo VLM: the encoder learns to answer from its early blocks too.

``edgevlm calibrate`` fits exit heads to a *frozen* model: its adapters must turn block ``k``'s
hidden states into what the last block would have produced, and on the demo model that loses
3.3 points at block 2 (the early blocks were never asked to carry the answer). When the model's
training is ours, the better recipe is the one of LayerSkip (Elhoushi et al., "LayerSkip:
Enabling Early Exit Inference and Self-Speculative Decoding", ACL 2024, section 3: an early-exit
loss at intermediate layers through the *shared* output head, during training) carried over to
the vision encoder: every step runs the encoder once, and the decoder on ``1 + len(exit_blocks)``
variants of the image features (the full encoder's and, per exit block ``k``,
``adapter_k(h_k)``), each through the shared projector and decoder; the loss is

    L = CE(full) + sum_k w * CE(exit k)   (+ the same weights on the dense per-patch aux loss),

so the encoder, the projector, the decoder *and* the adapters (:class:`edgevlm.runtime.exits.Adapter`,
the runtime's exit-head format) learn together. The full-depth path keeps weight 1, so the full
model's accuracy is kept (checked by the final evaluation, which reports the full model and every
forced exit at every rung). The confidence and closed-set classifier heads are fitted afterwards
on the final weights by ``edgevlm calibrate --init MODEL --keep-adapters`` (the adapters stay as
trained here).

Used by :mod:`edgevlm.runtime.demo.train` with ``--exit-blocks``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from edgevlm.runtime.demo import vocab
from edgevlm.runtime.demo.train_model import dense_aux_loss, record_hits, summarise_hits

logger = logging.getLogger(__name__)


def runtime_config(model):
    """The runtime's :class:`~edgevlm.runtime.config.LlavaConfig` of a transformers LLaVA model."""
    from edgevlm.runtime.models.llava.config import parse_config

    return parse_config(model.config.to_dict())


def build_exit_heads(model, exit_blocks: list[int], *, adapter_hidden: int, adapter_attn_dim: int,
                     init: str | Path | None = None):
    """Exit heads to train jointly with ``model`` (float32, on the model's device).

    ``init``: a folder with ``exits.json`` + ``exits.safetensors`` for this architecture whose
    weights are the starting point (the weights fingerprint is *not* checked: the encoder is about
    to change anyway); otherwise adapters start as the identity. Confidence heads are question-
    conditioned; classifiers cover :func:`~edgevlm.runtime.demo.scenes.demo_labels`.

    Raises:
        ValueError: exit blocks out of range; ``init`` heads of another architecture or other blocks.
    """
    import torch
    from safetensors.torch import load_file

    from edgevlm.runtime.demo.scenes import demo_labels
    from edgevlm.runtime.exits import EXITS_WEIGHTS, ExitHeads, make_spec, read_spec

    cfg = runtime_config(model)
    if init is not None:
        spec = read_spec(init)
        if spec.exit_blocks != sorted(exit_blocks) or spec.vision_hidden_size != cfg.vision.hidden_size:
            raise ValueError(f"--exit-init {init}: heads for blocks {spec.exit_blocks} of width "
                             f"{spec.vision_hidden_size}, not {sorted(exit_blocks)} of {cfg.vision.hidden_size}")
        heads = ExitHeads(spec, cfg.vision)
        heads.load_state_dict({k: v.float() for k, v in load_file(str(Path(init) / EXITS_WEIGHTS)).items()})
        heads.spec.weights_fingerprint = ""
    else:
        spec = make_spec(cfg, exit_blocks=list(exit_blocks), labels=demo_labels(), adapter_hidden=adapter_hidden,
                         adapter_attn_dim=adapter_attn_dim, confidence_query=True)
        heads = ExitHeads(spec, cfg.vision)
        for k in spec.exit_blocks:
            heads.adapters[str(k)].reset_to_identity()
    device = next(model.parameters()).device
    return heads.to(device, torch.float32)


def forward_variants(model, heads, pixel_values, input_ids):
    """Encoder once, decoder on every feature variant.

    Args:
        pixel_values: ``(B, 3, H, W)`` normalised images; ``input_ids``: ``(B, T)`` with image tokens.
    Returns:
        ``(V, B, T, D)`` decoder last hidden states and the list of ``V`` ``(B, Np, Dv)`` vision
        features (full encoder first, then each exit block of ``heads`` in order).
    """
    import torch

    inner = model.model
    vis = inner.vision_tower(pixel_values=pixel_values, interpolate_pos_encoding=True, output_hidden_states=True)
    variants = [vis.last_hidden_state[:, 1:]]  # (B, Np, Dv), CLS dropped
    for k in heads.exit_blocks:
        variants.append(heads.adapt(k, vis.hidden_states[k])[:, 1:])  # (B, Np, Dv): adapter sees CLS too
    v, b = len(variants), input_ids.shape[0]
    img = inner.multi_modal_projector(torch.cat(variants, dim=0))  # (V*B, Np, D)
    ids = input_ids.repeat(v, 1)  # (V*B, T)
    emb = inner.get_input_embeddings()(ids)  # (V*B, T, D)
    mask = (ids == vocab.IMAGE_TOKEN_ID).unsqueeze(-1)  # (V*B, T, 1)
    emb = emb.masked_scatter(mask, img.to(emb.dtype))
    hidden = inner.language_model(inputs_embeds=emb, use_cache=False).last_hidden_state  # (V*B, T, D)
    return hidden.view(v, b, *hidden.shape[1:]), variants


def joint_loss(model, heads, batch: dict, device, *, exit_weight: float, aux_head=None, aux_weight: float = 0.0):
    """The module doc's loss for one batch; returns ``(loss, per-variant answer CE list)``."""
    import torch.nn.functional as F

    pixel_values = batch["pixel_values"].to(device, non_blocking=True)
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    target = batch["target"].to(device, non_blocking=True)
    hidden, variants = forward_variants(model, heads, pixel_values, input_ids)  # (V, B, T, D)
    labels = input_ids[:, 1:].masked_fill(~target[:, 1:], -100)  # (B, T-1)
    weights = [1.0] + [exit_weight] * (len(variants) - 1)
    loss, parts = 0.0, []
    aux = batch["aux"].to(device, non_blocking=True) if aux_head is not None and "aux" in batch else None
    for i, w in enumerate(weights):
        logits = model.lm_head(hidden[i, :, :-1]).float()  # (B, T-1, V)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        parts.append(ce)
        term = ce if aux is None else ce + aux_weight * dense_aux_loss(aux_head, variants[i], aux)
        loss = loss + w * term
    return loss, parts


def exact_match_variants(model, heads, batches, device, amp_dtype) -> list[tuple[float, dict[str, float]]]:
    """Teacher-forced greedy exact match (as :func:`edgevlm.runtime.demo.train.exact_match`) of the
    full model and of every forced exit: ``[(accuracy, per kind)]``, full first."""
    import torch

    hits: list[dict[str, list[bool]]] = []
    model.eval()
    heads.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        for batch, kinds in batches:
            input_ids = batch["input_ids"].to(device)
            target = batch["target"].to(device)
            hidden, _ = forward_variants(model, heads, batch["pixel_values"].to(device), input_ids)
            pred_pos = target[:, 1:]  # (B, T-1)
            tgt = input_ids[:, 1:][pred_pos]  # (M,)
            rows = torch.nonzero(pred_pos, as_tuple=True)[0]  # (M,)
            for i in range(hidden.shape[0]):
                if len(hits) <= i:
                    hits.append({})
                logits = model.lm_head(hidden[i, :, :-1][pred_pos]).float()  # (M, V)
                record_hits(hits[i], logits, tgt, rows, kinds)
    model.train()
    heads.train()
    return [summarise_hits(h) for h in hits]


def save_heads(heads, out_dir: Path, record: dict) -> None:
    """Write the jointly trained heads beside the saved model, bound to its weights (fingerprint),
    with ``record`` (steps, weights, accuracies) as ``calibration["joint_training"]``. Confidence
    and classifiers are not trained yet: ``recommended_threshold`` is None until ``edgevlm
    calibrate --init ... --keep-adapters`` fits them."""
    from edgevlm.runtime.exits import save_exit_heads, weights_fingerprint

    spec = heads.spec
    spec.weights_fingerprint = weights_fingerprint(out_dir)
    spec.recommended_threshold = None
    spec.cascade = []
    spec.exit_metrics = {}
    spec.classifier_accuracy = {}
    spec.classifier_balanced_accuracy = {}
    spec.calibration = {"joint_training": record}
    save_exit_heads(heads, out_dir)
    logger.info("exit heads (adapters trained jointly) saved to %s", out_dir)
