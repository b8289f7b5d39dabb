"""The per-layer quantization plan: which linear layers become INT4, with which group size, and why.

Rule for ``in_features`` not divisible by the requested group size (documented in the README and
shown in the plan; never an assertion, never a silent wrong result):

1. use the requested ``group_size`` if it divides ``in_features``;
2. otherwise the largest *smaller* supported group size (64, then 32) that divides it;
3. otherwise keep the layer 16-bit.

Examples: ``in_features=192`` (1.5 x 128) with group size 128 -> 64; SigLIP-so400m's MLP
``in_features=4304`` (= 16 x 269) -> no supported size divides it -> kept 16-bit.

Which layers (LLaVA canonical names of :class:`edgevlm.runtime.llava.LlavaModel`): the decoder's
linears (``language_model.layers.*``) by default; the vision encoder's (``vision_tower.encoder.*``)
with ``vision="int4"``; ``lm_head`` only with ``lm_head=True``; the projector, embeddings and norms
stay 16-bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from edgevlm.runtime.bundle import LayerDecision
from edgevlm.runtime.int4 import SUPPORTED_GROUP_SIZES

__all__ = ["LayerDecision", "LinearInfo", "choose_group_size", "format_plan", "layer_role", "plan_layers"]


@dataclass(frozen=True)
class LinearInfo:
    """A linear layer found in a model or checkpoint: module name, source tensor prefix, shape."""

    name: str
    source_key: str
    in_features: int
    out_features: int


def choose_group_size(in_features: int, requested: int) -> tuple[int | None, str]:
    """Apply the divisibility rule. Returns ``(group_size or None, reason)``.

    Raises ``ValueError`` when ``requested`` is not a supported group size.
    """
    if requested not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {requested}")
    if in_features % requested == 0:
        return requested, f"group size {requested}"
    for g in sorted((g for g in SUPPORTED_GROUP_SIZES if g < requested), reverse=True):
        if in_features % g == 0:
            return g, f"in_features {in_features} not divisible by {requested}: group size {g}"
    tried = "/".join(str(g) for g in sorted((g for g in SUPPORTED_GROUP_SIZES if g <= requested), reverse=True))
    return None, f"in_features {in_features} not divisible by {tried}: kept 16-bit"


def layer_role(name: str) -> str:
    """``decoder``, ``lm_head``, ``vision``, ``projector``, ``vision_fixed`` (another family's tower or
    connector: always 16-bit) or ``other`` for a module name of a family's runtime model."""
    if name.startswith("language_model.layers."):
        return "decoder"
    if name == "language_model.lm_head":
        return "lm_head"
    if name.startswith("vision_tower.encoder."):
        return "vision"
    if name.startswith("vision_tower.projector."):
        return "projector"
    if not name.startswith("language_model."):  # other families' towers / connectors (vision_model., visual.)
        return "vision_fixed"
    return "other"


def plan_layers(
    layers: Iterable[LinearInfo],
    *,
    group_size: int,
    method: str,
    vision: str = "fp16",
    lm_head: bool = False,
    roles: bool = True,
    int4_vision: bool = True,
) -> list[LayerDecision]:
    """Decide every layer. With ``roles=False`` (generic modules, see ``quantize_``) every given
    layer is a candidate; otherwise the LLaVA role rules in the module docstring apply.
    ``int4_vision``: whether the family can quantize its vision tower (the family's
    ``ModelFamily.int4_vision``); without it a kept tower's reason names no ``--vision int4``."""
    out = []
    for info in layers:
        role = layer_role(info.name) if roles else "decoder"
        base = dict(name=info.name, source_key=info.source_key, in_features=info.in_features,
                    out_features=info.out_features)
        reason = {
            "lm_head": "lm_head stays 16-bit (quantize it with --lm-head int4)",
            "vision": ("vision encoder stays 16-bit (quantize it with --vision int4)" if int4_vision
                       else "vision encoder stays 16-bit (this family's tower is not quantized)"),
            "projector": "projector stays 16-bit",
            "vision_fixed": "vision encoder / connector stays 16-bit",
            "other": "not a decoder layer: stays 16-bit",
        }.get(role)
        wanted = role == "decoder" or (role == "vision" and vision == "int4") or (role == "lm_head" and lm_head)
        if not wanted:
            out.append(LayerDecision(**base, action="keep", reason=reason or ""))
            continue
        g, why = choose_group_size(info.in_features, group_size)
        if g is None:
            out.append(LayerDecision(**base, action="keep", reason=why))
        else:
            out.append(LayerDecision(**base, action="int4", group_size=g, method=method, reason=why))
    return out


def format_plan(decisions: list[LayerDecision], *, verbose: bool = False) -> str:
    """A text table of the plan. Layers that differ only in their block index are merged into one
    row (``layers.*``) with a count unless ``verbose``."""
    rows: dict[tuple, int] = {}
    for d in decisions:
        name = d.name if verbose else re.sub(r"\.layers\.\d+\.", ".layers.*.", d.name)
        key = (name, f"{d.out_features}x{d.in_features}", d.action.upper() if d.action == "int4" else "16-bit",
               str(d.group_size or "-"), d.reason)
        rows[key] = rows.get(key, 0) + 1
    header = ("layer", "count", "out x in", "weights", "group", "rule / reason")
    table = [header] + [(k[0], str(n), k[1], k[2], k[3], k[4]) for k, n in rows.items()]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    lines = []
    for i, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
        if i == 0:
            lines.append("-" * (sum(widths) + 2 * len(widths) + len(header[-1])))
    n4 = sum(d.action == "int4" for d in decisions)
    lines.append(f"{n4} of {len(decisions)} linear layers -> INT4 W4A16; embeddings and norms stay 16-bit")
    return "\n".join(lines)
