"""``quantize_``: swap ``nn.Linear`` layers of a module for W4A16 :class:`Int4Linear` in place.

Shaped like torchao's ``quantize_(model, config, filter_fn)``::

    from edgevlm.quantize import Int4WeightOnlyConfig, quantize_

    quantize_(model, Int4WeightOnlyConfig(group_size=128))                 # RTN, one call

    quantize_(model, Int4WeightOnlyConfig(method="awq", step="prepare"))  # AWQ: observers
    for batch in calibration_batches:
        model(batch)                                                      # real activations
    quantize_(model, Int4WeightOnlyConfig(method="awq", step="convert"))  # search, fold, quantize

Every call plans first (:func:`edgevlm.quantize.plan.plan_layers`: group size per layer, the
divisibility fallback, layers kept 16-bit) and logs the plan; the decisions are returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from edgevlm.errors import InvalidRequestError
from edgevlm.quantize import awq
from edgevlm.quantize.config import Int4WeightOnlyConfig
from edgevlm.quantize.plan import LayerDecision, LinearInfo, format_plan, plan_layers
from edgevlm.runtime.int4 import Int4Linear, quantize_int4

logger = logging.getLogger(__name__)

_STATE_ATTR = "_edgevlm_awq_state"

FilterFn = Callable[[nn.Module, str], bool]


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return type(module) is nn.Linear


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def plan_module(model: nn.Module, config: Int4WeightOnlyConfig, filter_fn: FilterFn | None = None) -> list[LayerDecision]:
    """The plan ``quantize_`` would follow: one decision per ``nn.Linear`` accepted by ``filter_fn``."""
    filter_fn = filter_fn or _default_filter
    infos = [
        LinearInfo(name, name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and filter_fn(m, name)
    ]
    return plan_layers(infos, group_size=config.group_size, method=config.method, roles=False)


def apply_awq(model: nn.Module, state: awq.AWQState, results: dict[str, awq.AWQResult]) -> None:
    """Apply searched scales and quantize: fold ``1/s`` into producers, scale consumers' input
    columns by ``s`` (on float32 working copies), then replace every target by an ``Int4Linear``
    (with ``input_scale = 1/s`` where nothing could absorb it)."""
    work = {n: model.get_submodule(n).weight.detach().float().clone() for n in state.group_sizes}
    input_scales: dict[str, torch.Tensor] = {}
    for grp in state.groups:
        res = results[grp.linears[0]]
        if res.alpha == 0.0:
            continue  # s == 1
        s = res.scales.to(work[grp.linears[0]].device)
        for n in grp.linears:
            work[n] *= s  # columns: W' = W * s
        if grp.prev is None:
            for n in grp.linears:
                input_scales[n] = 1.0 / s
        elif grp.prev in work:  # a producer that is itself quantized: scale its rows in the fp32 copy
            work[grp.prev] *= (1.0 / s)[:, None]
            bias = model.get_submodule(grp.prev).bias
            if bias is not None:
                with torch.no_grad():
                    bias.copy_((bias.float() / s).to(bias.dtype))
        else:
            awq.fold_scales(model, grp.prev, s)
    for name, g in state.group_sizes.items():
        old = model.get_submodule(name)
        bias = old.bias.detach() if old.bias is not None else None
        new = Int4Linear.from_int4(quantize_int4(work.pop(name), g), bias, input_scales.get(name))
        if bias is None:
            new = new.to(old.weight.dtype)
        _set_submodule(model, name, new)


def _annotate(decisions: list[LayerDecision], results: dict[str, awq.AWQResult]) -> list[LayerDecision]:
    out = []
    for d in decisions:
        r = results.get(d.name)
        if r is None:
            out.append(d)
            continue
        where = "none" if r.alpha == 0.0 else ("folded" if r.fold_into else "input_scale")
        out.append(d.model_copy(update=dict(
            awq_scale=where, awq_fold_into=r.fold_into if where == "folded" else None, awq_alpha=r.alpha,
            rel_error=r.rel_error, rel_error_rtn=r.rel_error_rtn,
        )))
    return out


def quantize_(
    model: nn.Module, config: Int4WeightOnlyConfig, filter_fn: FilterFn | None = None
) -> list[LayerDecision]:
    """Quantize ``model``'s ``nn.Linear`` layers in place (see the module docstring).

    Args:
        model: any module; its linears (those ``filter_fn(module, fqn)`` accepts, default: every
            ``nn.Linear``) are replaced by :class:`~edgevlm.runtime.int4.Int4Linear`.
        config: an :class:`Int4WeightOnlyConfig`.
    Returns:
        the per-layer decisions (after ``convert``: with AWQ's alpha, fold target and errors).
    Raises:
        TypeError: ``config`` is not an Int4WeightOnlyConfig, or ``model`` is not an ``nn.Module``.
        ValueError: a ``step`` that does not fit the method or the model's state;
            :class:`~edgevlm.errors.InvalidRequestError` when ``model`` is itself an ``nn.Linear`` the
            filter accepts (a layer cannot replace itself in place: wrap it, or use
            :meth:`Int4Linear.from_linear <edgevlm.runtime.int4.Int4Linear.from_linear>`).
        RuntimeError: AWQ ``convert`` without calibration data reaching a layer.
    """
    if not isinstance(config, Int4WeightOnlyConfig):
        raise TypeError(f"config must be an Int4WeightOnlyConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) is nn.Linear and (filter_fn or _default_filter)(model, ""):
        # its plan would say "int4" while the caller's object stays an nn.Linear (setattr(model, "", ...))
        raise InvalidRequestError(
            "quantize_ replaces the nn.Linear layers inside model in place, and model is itself an nn.Linear: "
            "wrap it (nn.Sequential(layer)) or use Int4Linear.from_linear(layer, group_size)")
    if config.method == "rtn":
        if config.step is not None:
            raise ValueError("step is only used with method='awq'")
        decisions = plan_module(model, config, filter_fn)
        logger.info("quantization plan:\n%s", format_plan(decisions))
        for d in decisions:
            if d.action == "int4":
                old = model.get_submodule(d.name)
                new = Int4Linear.from_linear(old, d.group_size).to(old.weight.device)
                _set_submodule(model, d.name, new.to(old.weight.dtype))
        return decisions
    if config.step == "prepare":
        if _STATE_ATTR in model.__dict__:
            raise ValueError("model is already prepared for AWQ (run step='convert')")
        decisions = plan_module(model, config, filter_fn)
        logger.info("quantization plan:\n%s", format_plan(decisions))
        sizes = {d.name: d.group_size for d in decisions if d.action == "int4"}
        state = awq.prepare(model, sizes, fold=config.awq_fold, max_rows=config.awq_max_tokens, seed=config.seed)
        model.__dict__[_STATE_ATTR] = (state, decisions)
        return decisions
    if config.step == "convert":
        if _STATE_ATTR not in model.__dict__:
            raise ValueError("AWQ convert: model was not prepared (call with step='prepare' first)")
        state, decisions = model.__dict__[_STATE_ATTR]
        results = awq.search(model, state, config.awq_grid)
        state.remove_hooks()
        apply_awq(model, state, results)
        del model.__dict__[_STATE_ATTR]
        return _annotate(decisions, results)
    raise ValueError("method='awq' runs in two steps: step='prepare', calibration batches, then step='convert'")
