"""AWQ: activation-aware weight quantization (Lin et al., MLSys 2024, arXiv:2306.00978, section 3).

For a set of linear layers that read the same input ``X (n, K)`` (for example q/k/v after the
attention norm), AWQ protects the input channels with large activations by scaling them up before
quantization: ``W' = W * s`` (per input channel), ``x' = x / s``, so the product is unchanged in
exact arithmetic while the salient channels get relatively finer quantization steps. The scales
are ``s = s_X ** alpha`` with ``s_X = mean |X|`` per channel (the paper's eq. 5), normalised by
``sqrt(max(s) * min(s))``; ``alpha`` is grid-searched on ``[0, 1)`` to minimise the output MSE
``|| Q(W * s) (X / s) - W X ||^2`` on real calibration activations. ``alpha = 0`` is plain RTN, so
the chosen scales are never worse than RTN on the calibration sample.

``1 / s`` is then folded into the operation that produces ``X`` when that is exact (the
weight/bias of an RMSNorm/LayerNorm feeding only these layers; the output rows of ``v_proj``
feeding ``o_proj`` when the shapes match, i.e. no grouped-query sharing; ``up_proj`` feeding
``down_proj``, because ``act(gate) * up`` is linear in ``up``). Otherwise it stays an explicit
``input_scale`` of the :class:`~edgevlm.runtime.int4.Int4Linear`. The paper's weight-clipping
search is not implemented.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from edgevlm.runtime.decoder import RMSNorm
from edgevlm.runtime.int4 import fake_quantize_int4

logger = logging.getLogger(__name__)

#: (producer relative to a block prefix, consumers that read only its output). Llama + CLIP names.
FOLD_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("mlp.up_proj", ("mlp.down_proj",)),
    ("layer_norm1", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.out_proj",)),
    ("layer_norm2", ("mlp.fc1",)),
)


@dataclass
class ScaleGroup:
    """Linear layers sharing one input, and the op AWQ's ``1/s`` folds into (None: input_scale)."""

    linears: list[str]
    prev: str | None = None


@dataclass
class AWQResult:
    """Outcome of the scale search for one linear layer."""

    alpha: float
    scales: torch.Tensor  # (K,) float32, the s of W' = W * s
    fold_into: str | None
    rel_error: float  # relative output MSE of Q(W s)(x/s) on the calibration sample
    rel_error_rtn: float  # same for plain RTN (alpha = 0)


def _is_norm(m: nn.Module, k: int) -> bool:
    """Whether AWQ may fold its input scale into ``m``'s ``(k,)`` weight: an ``nn.LayerNorm`` or the
    runtime's :class:`~edgevlm.runtime.decoder.RMSNorm` (``x_hat * w``). Gemma's
    :class:`~edgevlm.runtime.decoder.UnitOffsetNorm` (``x_hat * (1 + w)``) is not: its consumers keep an
    explicit input scale instead."""
    w = getattr(m, "weight", None)
    if not isinstance(m, (nn.LayerNorm, RMSNorm)) or not isinstance(w, torch.Tensor):
        return False
    return tuple(w.shape) == (k,)


def _foldable(prev: nn.Module, consumers: list[nn.Module]) -> bool:
    k = consumers[0].in_features
    if any(c.in_features != k for c in consumers):
        return False
    if type(prev) is nn.Linear:
        return prev.out_features == k
    return _is_norm(prev, k)


def find_scale_groups(model: nn.Module, targets: list[str], *, fold: bool = True) -> list[ScaleGroup]:
    """Group ``targets`` (names of ``nn.Linear`` modules) by shared input per :data:`FOLD_RULES`;
    each remaining target is its own group with an explicit input scale."""
    modules = dict(model.named_modules())
    target_set = set(targets)
    assigned: set[str] = set()
    groups: list[ScaleGroup] = []
    if fold:
        for prefix in modules:
            p = prefix + "." if prefix else ""
            for prev_rel, consumer_rels in FOLD_RULES:
                prev, consumers = p + prev_rel, [p + c for c in consumer_rels]
                if prev not in modules or not all(c in target_set and c not in assigned for c in consumers):
                    continue
                if _foldable(modules[prev], [modules[c] for c in consumers]):
                    groups.append(ScaleGroup(consumers, prev))
                    assigned.update(consumers)
    groups += [ScaleGroup([t]) for t in targets if t not in assigned]
    return groups


class InputObserver:
    """Forward pre-hook statistics of one layer input: ``sum |x|`` per channel over all rows, and a
    uniform reservoir sample (Vitter's algorithm R, vectorised) of at most ``max_rows`` rows."""

    def __init__(self, in_features: int, max_rows: int, seed: int = 0) -> None:
        self.in_features = in_features
        self.max_rows = max_rows
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.seen = 0
        self.rows: torch.Tensor | None = None  # (<= max_rows, K) float32, on the CPU
        self._gen = torch.Generator().manual_seed(seed)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, self.in_features).to("cpu", torch.float32)  # (n, K)
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        if self.rows is None:
            self.rows = torch.empty(0, self.in_features)
        room = self.max_rows - self.rows.shape[0]
        if room > 0:
            self.rows = torch.cat([self.rows, x[:room]])
        rest = x[max(room, 0):]
        start = self.seen + x.shape[0] - rest.shape[0]
        self.seen += x.shape[0]
        if rest.shape[0]:
            t = torch.arange(start, start + rest.shape[0], dtype=torch.float64)
            j = (torch.rand(rest.shape[0], generator=self._gen, dtype=torch.float64) * (t + 1)).long()
            keep = (j < self.max_rows).nonzero().flatten()
            if keep.numel():
                last = torch.full((self.max_rows,), -1, dtype=torch.long)  # later rows win, as in order
                last.scatter_reduce_(0, j[keep], keep, reduce="amax")
                slots = (last >= 0).nonzero().flatten()
                self.rows[slots] = rest[last[slots]]

    @property
    def mean_abs(self) -> torch.Tensor:
        """``s_X``: mean ``|x|`` per input channel, ``(K,)`` float32."""
        return (self.abs_sum / max(self.seen, 1)).float()


def search_scales(
    x: torch.Tensor, mean_abs: torch.Tensor, weights: list[tuple[torch.Tensor, int]], grid: int
) -> tuple[float, torch.Tensor, list[float], list[float]]:
    """Grid-search alpha for layers ``weights`` = ``[(W (N_i, K), group_size_i)]`` sharing input ``x (n, K)``.

    Returns ``(alpha, s (K,), rel_errors, rel_errors_rtn)``, errors per layer as
    ``||y_q - y||^2 / ||y||^2`` on ``x``; the total over layers decides.
    """
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    x = x.float()
    ws = [(w.float(), g) for w, g in weights]
    refs = [x @ w.T for w, _ in ws]  # (n, N_i)
    norms = [r.pow(2).sum().clamp(min=1e-30).item() for r in refs]
    base = mean_abs.float().clamp(min=1e-5)
    best: tuple[float, float, torch.Tensor, list[float]] = (float("inf"), 0.0, torch.ones_like(base), [])
    rtn: list[float] = []
    for i in range(grid):
        alpha = i / grid
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        errs = []
        xs = x / s  # Q(W s) (x / s): cheaper than dividing the (N, K) weight when n < N
        for (w, g), ref, nrm in zip(ws, refs, norms, strict=True):
            wq = fake_quantize_int4(w * s, g)
            errs.append((xs @ wq.T - ref).pow(2).sum().item() / nrm)
        total = sum(e * n for e, n in zip(errs, norms, strict=True))
        if i == 0:
            rtn = errs
        if total < best[0]:
            best = (total, alpha, s, errs)
    return best[1], best[2], best[3], rtn


def fold_scales(model: nn.Module, prev: str, s: torch.Tensor) -> None:
    """Divide the output channels of ``prev`` (a norm's weight/bias, or a Linear's rows/bias) by ``s``."""
    m = model.get_submodule(prev)
    with torch.no_grad():
        inv = (1.0 / s).to(m.weight.device)
        if isinstance(m, nn.Linear):
            m.weight.copy_((m.weight.float() * inv[:, None]).to(m.weight.dtype))
        else:
            m.weight.copy_((m.weight.float() * inv).to(m.weight.dtype))
        if getattr(m, "bias", None) is not None:
            m.bias.copy_((m.bias.float() * inv).to(m.bias.dtype))


@dataclass
class AWQState:
    """Observers installed by :func:`prepare`; consumed by :func:`convert`."""

    groups: list[ScaleGroup]
    group_sizes: dict[str, int]
    observers: dict[str, InputObserver] = field(default_factory=dict)  # group's first linear -> observer
    handles: list = field(default_factory=list)

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def prepare(model: nn.Module, group_sizes: dict[str, int], *, fold: bool, max_rows: int, seed: int) -> AWQState:
    """Install input observers on one linear of every scale group of ``group_sizes``' layers."""
    groups = find_scale_groups(model, list(group_sizes), fold=fold)
    state = AWQState(groups, dict(group_sizes))
    for i, grp in enumerate(groups):
        first = model.get_submodule(grp.linears[0])
        obs = InputObserver(first.in_features, max_rows, seed + i)
        state.observers[grp.linears[0]] = obs
        state.handles.append(first.register_forward_pre_hook(obs))
    return state


def search(model: nn.Module, state: AWQState, grid: int) -> dict[str, AWQResult]:
    """Scale search for every group (weights are not modified). Raises ``RuntimeError`` when a
    group's observer saw no calibration data."""
    results: dict[str, AWQResult] = {}
    for grp in state.groups:
        obs = state.observers[grp.linears[0]]
        if obs.seen == 0 or obs.rows is None:
            raise RuntimeError(f"AWQ: no calibration activations reached {grp.linears[0]} (run calibration "
                               "batches through the model between prepare and convert)")
        mods = [model.get_submodule(n) for n in grp.linears]
        weights = [(m.weight.detach().cpu(), state.group_sizes[n]) for m, n in zip(mods, grp.linears, strict=True)]
        alpha, s, errs, rtn = search_scales(obs.rows, obs.mean_abs, weights, grid)
        for name, e, r in zip(grp.linears, errs, rtn, strict=True):
            results[name] = AWQResult(alpha, s, grp.prev, e, r)
        logger.debug("AWQ %s: alpha %.2f rel err %.3g (RTN %.3g)", grp.linears, alpha, sum(errs), sum(rtn))
    return results
