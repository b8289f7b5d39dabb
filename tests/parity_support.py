"""Parity helpers shared by the family tests (ours vs transformers' ``...ForConditionalGeneration``)."""

from __future__ import annotations

import torch


def max_rel_error(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |logits - ref| / max |ref|`` over every element."""
    return float((logits - ref).abs().max() / ref.abs().max())


def hf_greedy(hf_model, inputs: dict, n: int = 16) -> list[int]:
    """transformers' greedy ``generate`` of exactly ``n`` new tokens (EOS masked, as ``min_new_tokens``)."""
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def our_greedy(model, ids: torch.Tensor, vision, n: int = 16) -> list[int]:
    """Our model's greedy tokens for prompt ``ids`` ``(1, T)`` and its ``vision``: encode, embed,
    prefill, then ``n - 1`` decode steps at slots ``T, T + 1, ...`` (1-D RoPE families)."""
    tokens: list[int] = []
    with torch.no_grad():
        logits = model.prefill(model.embed(ids, model.encode_vision(vision)))
        for step in range(n):
            tokens.append(int(logits.argmax(-1)))
            logits = model.decode(torch.tensor([[tokens[-1]]]), torch.tensor([ids.shape[1] + step]))
    return tokens


def map_checkpoint(state: dict, weight_rules, *, every_key_ruled: bool = False) -> dict:
    """``state`` (checkpoint tensor name -> value) renamed by a family's ``WEIGHT_RULES`` exactly as the
    loader does (:func:`edgevlm.runtime.loader.map_weight_name`: first rule found rewrites or drops the
    name, no rule keeps it). ``every_key_ruled``: an ``AssertionError`` for a name no rule matches."""
    from edgevlm.runtime.loader import compile_weight_rules, map_weight_name

    rules = compile_weight_rules(tuple(weight_rules))
    out = {}
    for key, value in state.items():
        if every_key_ruled and not any(pattern.search(key) for pattern, _ in rules):
            raise AssertionError(f"no weight rule for {key}")
        name = map_weight_name(key, rules)
        if name is not None:
            out[name] = value
    return out
