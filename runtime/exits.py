"""Exit heads of the vision encoder: early exit with a confidence estimate, and closed-set labels.

At each exit point (after vision block ``k``) a calibrated model carries three small heads, trained
offline by :mod:`edgevlm.quantize.calibrate` (distillation from the full encoder on calibration
data, in the spirit of DeeBERT / BERxiT-style early exit — Xin et al., ACL 2020 / EACL 2021 — with
the exit head mapping into the *frozen* projector's input space instead of a task output):

- **adapter** ``(B, T, D) -> (B, T, F)``: maps block ``k``'s hidden states to the features the
  projector expects (LLaVA: ``F = D * len(vision_feature_layer)``; Qwen2.5-VL, Qwen3-VL, SmolVLM:
  ``F = D``, the last block's states that the family's connector reads, see
  :mod:`edgevlm.runtime.adaptive`; the dims come from the family config's ``exit_geometry``). Optionally first one narrow pre-LN
  self-attention layer ``x + o(attn(q, k, v of LN(x)))`` with ``attn_dim`` < D inner channels (the
  cross-patch mixing the skipped blocks would have done, at a fraction of a block's cost), then
  ``skip(x) + fc2(gelu(fc1(LN(x))))``; initialised to the identity (``o`` and ``fc2`` zero,
  ``skip`` = I), so training starts from the residual stream at block ``k``.
- **confidence** ``(B, T, D) [+ (B, Q) question embedding] -> (B,)`` in [0, 1]: the predicted
  probability that the decoder's greedy answer *to this question* from the adapted features equals
  its answer from the full encoder (trained on many (image, question) pairs where both answers were
  compared, BCE on the 0/1 agreement). With ``confidence_query_dim = Q > 0`` the head also reads
  the question: the mean of the decoder's input embeddings over the prompt's text tokens
  (:func:`query_embedding`), so a question kind that needs the skipped blocks (counting small
  objects, say) gets a low confidence on the same image where another kind can exit. Without a
  question such heads return 0 (no confidence-gated exit). The encoder stops at the first exit
  point whose confidence reaches the operating point's ``exit_threshold``; ``exits.json`` records
  the ``recommended_threshold`` certified on held-out pairs by Learn then Test (true answer-change
  rate <= ``max_answer_change`` with probability >= 1 - ``risk_delta``; see
  :mod:`edgevlm.quantize.exit_confidence`) and the whole held-out ``cascade`` table.
- **classifier** ``(B, T, D) -> (B, L)`` logits of L closed-set binary labels (for the demo
  model: colours, shapes, sizes, halves and colour-shape pairs present), used by daemon monitors.
  A classifier may also sit on the last block (``classifier_blocks`` lists where).

Pooled heads (confidence, classifier) see ``[mean(LN(patches)), max(LN(patches)), LN(CLS),
max(LN(patches)) of each image quadrant, s]`` (a tower without a CLS token — SigLIP, Qwen2.5-VL,
Qwen3-VL, SmolVLM: ``LN(mean(patches))`` in the CLS slot, ``has_cls_token: false`` in ``exits.json``;
the patches in raster order) where ``s = sqrt(N) / grid_side`` tells them the
input resolution; the quadrant maxima keep where things are (left/right, top/bottom labels); a
question-conditioned confidence head appends ``LN(question embedding)``.

Files (beside the model or inside an engine bundle; safetensors and JSON only)::

    exits.safetensors   adapters.<k>.*, confidence.<k>.*, classifiers.<k>.*   (float16)
    exits.json          ExitsSpec: format, dims, exit blocks, labels, calibration record, metrics
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from edgevlm.atomic_files import AtomicFiles
from edgevlm.errors import ModelLoadError
from edgevlm.model_folder import weights_fingerprint

logger = logging.getLogger(__name__)

EXITS_WEIGHTS = "exits.safetensors"
EXITS_JSON = "exits.json"
EXITS_FORMAT = "edgevlm-exits"
EXITS_FORMAT_VERSION = 1


class ThresholdRow(BaseModel):
    """Held-out behaviour of one exit point at one confidence threshold."""

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(ge=0.0, le=1.0, description="Confidence threshold.")
    exit_rate: float = Field(ge=0.0, le=1.0, description="Fraction of inputs that exit here.")
    agreement: float = Field(
        ge=0.0, le=1.0, description="Fraction of answers equal to the full encoder's (exited or not)."
    )


class ExitMetrics(BaseModel):
    """Calibration measurements of one exit point (held-out calibration pairs)."""

    model_config = ConfigDict(extra="forbid")

    feature_cosine: float = Field(description="Mean cosine between adapted and full features.")
    forced_agreement: float = Field(description="Answers unchanged when always exiting here.")
    thresholds: list[ThresholdRow] = Field(default_factory=list, description="Threshold sweep.")
    agreement_by_kind: dict[str, float] = Field(
        default_factory=dict, description="Forced-exit answer agreement per demo question kind (held-out pairs)."
    )


class CascadeRow(BaseModel):
    """Held-out behaviour of the whole exit cascade (every exit point gated by one threshold)."""

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(ge=0.0, le=1.0, description="Confidence threshold shared by all exit points.")
    exit_rates: dict[str, float] = Field(description="Per exit block: fraction of pairs that exit there.")
    answer_change: float = Field(ge=0.0, le=1.0, description="Fraction of pairs whose answer changes.")
    blocks_mean: float = Field(ge=0.0, description="Mean encoder blocks run (exit block, else all).")
    pairs: int = Field(0, ge=0, description="Held-out (image, question) pairs.")
    changes: int = Field(0, ge=0, description="Pairs whose answer changed.")
    p_value: float | None = Field(
        None, ge=0.0, le=1.0, description="Binomial p-value of 'change rate > max_answer_change' (Learn then Test)."
    )


class ExitsSpec(BaseModel):
    """``exits.json``: what the heads expect and how they were made."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["edgevlm-exits"] = Field(EXITS_FORMAT, description="Magic string.")
    format_version: Literal[1] = Field(EXITS_FORMAT_VERSION, description="Format version.")
    vision_hidden_size: int = Field(gt=0, description="Hidden size D of the vision encoder.")
    vision_blocks: int = Field(gt=0, description="Vision blocks the full encoder runs.")
    grid_side: int = Field(gt=0, description="Patches per side of the trained position grid.")
    has_cls_token: bool = Field(
        True, description="The tower's hidden states start with a CLS token (CLIP); False (SigLIP): the pooled "
        "heads read LN(mean of the patch tokens) in its place.")
    feature_dim: int = Field(gt=0, description="Projector input size F (D x selected layers).")
    layer_norm_eps: float = Field(1e-5, gt=0, description="LayerNorm epsilon of the heads.")
    exit_blocks: list[int] = Field(description="Blocks after which an exit is possible, ascending.")
    adapter_hidden: int = Field(gt=0, description="Hidden width of each adapter MLP.")
    adapter_attn_dim: int = Field(0, ge=0, description="Inner width of the adapter's attention layer (0 = none).")
    adapter_attn_heads: int = Field(4, gt=0, description="Heads of the adapter's attention layer.")
    adapter_blocks: int = Field(
        0, ge=0, description="Full ViT blocks at the start of each adapter (initialised from the encoder's last ones)."
    )
    head_hidden: int = Field(gt=0, description="Hidden width of the pooled heads.")
    confidence_query_dim: int = Field(
        0, ge=0, description="Width of the question embedding the confidence heads read (0 = image only)."
    )
    recommended_threshold: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Cascade threshold certified on held-out pairs (Learn then Test): answer-change rate "
                    "<= max_answer_change with probability >= 1 - risk_delta; None if none.",
    )
    max_answer_change: float = Field(0.01, ge=0.0, le=1.0, description="Target of recommended_threshold.")
    risk_delta: float = Field(
        0.1, ge=0.0, lt=1.0,
        description="Learn-then-Test level: P(true change rate > max_answer_change) <= this (0 = point estimate).",
    )
    cascade: list[CascadeRow] = Field(default_factory=list, description="Held-out cascade threshold sweep.")
    labels: list[str] = Field(default_factory=list, description="Closed-set label names of the classifiers.")
    classifier_blocks: list[int] = Field(default_factory=list, description="Blocks carrying a classifier.")
    weights_fingerprint: str = Field(
        "", description="weights_fingerprint() of the model the heads were trained on ('' = not checked)."
    )
    calibration: dict[str, Any] = Field(default_factory=dict, description="Data, steps, seed, time, source.")
    exit_metrics: dict[str, ExitMetrics] = Field(default_factory=dict, description="Per exit block.")
    classifier_accuracy: dict[str, float] = Field(
        default_factory=dict, description="Per classifier block: held-out mean per-label accuracy."
    )
    classifier_balanced_accuracy: dict[str, float] = Field(
        default_factory=dict,
        description="Per classifier block: held-out balanced accuracy ((TPR + TNR) / 2), mean over labels.",
    )


class Adapter(nn.Module):
    """Exit-block hidden states -> projector input features (see the module doc)."""

    def __init__(self, dim: int, hidden: int, out_dim: int, eps: float, attn_dim: int = 0,
                 attn_heads: int = 4, vision_cfg=None, n_blocks: int = 0) -> None:
        super().__init__()
        self.attn_dim, self.attn_heads = attn_dim, attn_heads
        if n_blocks:
            from edgevlm.runtime.vision import VisionBlock

            self.blocks = nn.ModuleList([VisionBlock(vision_cfg) for _ in range(n_blocks)])
        if attn_dim:
            self.attn_norm = nn.LayerNorm(dim, eps=eps)
            self.qkv = nn.Linear(dim, 3 * attn_dim)
            self.o = nn.Linear(attn_dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)
        self.skip = nn.Linear(dim, out_dim)

    def reset_to_identity(self) -> None:
        """``skip`` = identity (tiled when F is a multiple of D), ``fc2`` = ``o`` = 0: output starts as x."""
        with torch.no_grad():
            d, f = self.skip.in_features, self.skip.out_features
            eye = torch.eye(d).repeat(math.ceil(f / d), 1)[:f]  # (F, D)
            self.skip.weight.copy_(eye)
            self.skip.bias.zero_()
            self.fc2.weight.zero_()
            self.fc2.bias.zero_()
            if self.attn_dim:
                self.o.weight.zero_()
                self.o.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in getattr(self, "blocks", ()):
            x = blk(x)  # (B, T, D): full ViT blocks, initialised from the encoder's last blocks
        if self.attn_dim:
            b, t, _ = x.shape
            hd = self.attn_dim // self.attn_heads
            q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.attn_heads, hd).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, hd)
            x = x + self.o(y.transpose(1, 2).reshape(b, t, self.attn_dim))  # (B, T, D)
        return self.skip(x) + self.fc2(F.gelu(self.fc1(self.norm(x))))  # (B, T, F)


class PooledHead(nn.Module):
    """Token-pooled MLP: ``[mean, max over LN(patches), LN(CLS), quadrant maxima, sqrt(N)/grid_side
    (, LN(query))] -> n_out``."""

    def __init__(self, dim: int, hidden: int, n_out: int, grid_side: int, eps: float, query_dim: int = 0,
                 has_cls: bool = True) -> None:
        super().__init__()
        self.grid_side = grid_side
        self.has_cls = has_cls
        self.query_dim = query_dim
        self.norm = nn.LayerNorm(dim, eps=eps)
        if query_dim:
            self.query_norm = nn.LayerNorm(query_dim, eps=eps)
        self.fc1 = nn.Linear(7 * dim + 1 + query_dim, hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def pool(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """``(B, 1 + h*w, D)`` (CLS first, patches in raster order of the ``grid_hw = (h, w)``
        patch grid; ``(B, h*w, D)`` without a CLS token) -> ``(B, 7D + 1)``."""
        c = int(self.has_cls)
        b, n, d = x.shape[0], x.shape[1] - c, x.shape[2]
        gh, gw = grid_hw
        if gh * gw != n:
            raise ValueError(f"{n} patch tokens do not form a {gh}x{gw} grid")
        if not c:  # the pooled token in the CLS slot: mean over the patch tokens, then the head's LN
            x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1)  # (B, 1 + N, D)
        h = self.norm(x)
        patches = h[:, 1:]  # (B, N, D)
        grid = patches.reshape(b, gh, gw, d)
        rh, rw = max(1, (gh + 1) // 2), max(1, (gw + 1) // 2)
        quads = [grid[:, r0:r1, c0:c1].amax(dim=(1, 2))  # (B, D) each: TL, TR, BL, BR
                 for r0, r1 in ((0, rh), (gh - rh, gh)) for c0, c1 in ((0, rw), (gw - rw, gw))]
        scale = math.sqrt(n) / self.grid_side
        s = torch.full((b, 1), scale, dtype=h.dtype, device=h.device)
        return torch.cat([patches.mean(dim=1), patches.amax(dim=1), h[:, 0], *quads, s], dim=-1)

    def head(self, pooled: torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, 7D + 1)`` pooled features (and ``(B, Q)`` query when ``query_dim``) -> ``(B, n_out)``."""
        if self.query_dim:
            if query is None:
                raise ValueError("this head reads a question embedding")
            pooled = torch.cat([pooled, self.query_norm(query.to(pooled.dtype))], dim=-1)  # (B, 7D + 1 + Q)
        return self.fc2(F.gelu(self.fc1(pooled)))  # (B, n_out)

    def forward(self, x: torch.Tensor, grid_hw: tuple[int, int], query: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.pool(x, grid_hw), query)  # (B, n_out)


class ExitHeads(nn.Module):
    """All exit heads of one model (see the module doc). Build from an :class:`ExitsSpec`."""

    def __init__(self, spec: ExitsSpec, vision_cfg=None) -> None:
        super().__init__()
        if spec.adapter_blocks and vision_cfg is None:
            raise ValueError("adapters with ViT blocks need the model's vision config")
        self.spec = spec
        d, eps, g = spec.vision_hidden_size, spec.layer_norm_eps, spec.grid_side
        self.adapters = nn.ModuleDict({
            str(b): Adapter(d, spec.adapter_hidden, spec.feature_dim, eps, spec.adapter_attn_dim,
                            spec.adapter_attn_heads, vision_cfg, spec.adapter_blocks)
            for b in spec.exit_blocks
        })
        q = spec.confidence_query_dim
        self.confidence = nn.ModuleDict({str(b): PooledHead(d, spec.head_hidden, 1, g, eps, q, spec.has_cls_token)
                                         for b in spec.exit_blocks})
        n_labels = len(spec.labels)
        self.classifiers = nn.ModuleDict(
            {str(b): PooledHead(d, spec.head_hidden, n_labels, g, eps, has_cls=spec.has_cls_token)
             for b in spec.classifier_blocks}
            if n_labels
            else {}
        )

    @property
    def exit_blocks(self) -> list[int]:
        return list(self.spec.exit_blocks)

    @property
    def labels(self) -> list[str]:
        return list(self.spec.labels)

    def adapt(self, block: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block ``block``'s hidden states ``(B, T, D)`` -> projector input ``(B, T, F)``."""
        return self.adapters[str(block)](hidden)

    @property
    def needs_query(self) -> bool:
        """Whether the confidence heads read the question (:func:`query_embedding`)."""
        return self.spec.confidence_query_dim > 0

    def confidence_at(self, block: int, hidden: torch.Tensor, grid_hw: tuple[int, int],
                      query: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, 1 + h*w, D)`` (``(B, h*w, D)`` without a CLS token; and ``(B, Q)`` question
        embedding) -> ``(B,)`` float32 probability that the answer stays the same. Question-conditioned heads without a query return zeros
        (an unknown question never exits on confidence)."""
        if self.needs_query and query is None:
            return torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        return torch.sigmoid(self.confidence[str(block)](hidden, grid_hw, query)[:, 0].float())

    def classify(self, block: int, hidden: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """``(B, 1 + h*w, D)`` -> ``(B, L)`` float32 label probabilities (independent sigmoids)."""
        if str(block) not in self.classifiers:
            raise KeyError(f"no classifier at block {block} (have {self.spec.classifier_blocks})")
        return torch.sigmoid(self.classifiers[str(block)](hidden, grid_hw).float())


def query_embedding(embed_tokens: nn.Embedding, prompt_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """The question embedding a question-conditioned confidence head reads: the mean of the
    decoder's input embeddings over the prompt's text tokens (image tokens left out).

    Args:
        embed_tokens: the decoder's token embedding table ``(V, Q)``.
        prompt_ids: ``(B, T)`` long, the rendered prompt (image tokens expanded or not).
        image_token_id: id of the image placeholder token.
    Returns:
        ``(B, Q)`` in the embedding's dtype.
    """
    keep = (prompt_ids != image_token_id).to(embed_tokens.weight.dtype)[..., None]  # (B, T, 1)
    e = embed_tokens(prompt_ids)  # (B, T, Q)
    return (e * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)  # (B, Q)


def make_spec(cfg, *, exit_blocks: list[int], labels: list[str], adapter_hidden: int | None = None,
              head_hidden: int = 128, classifier_blocks: list[int] | None = None, adapter_attn_dim: int = 0,
              adapter_attn_heads: int = 4, adapter_blocks: int = 0, confidence_query: bool = False) -> ExitsSpec:
    """An :class:`ExitsSpec` for a family config with ``exit_geometry``
    (:class:`~edgevlm.runtime.models.base.ExitGeometry`: LLaVA, Qwen2.5-VL, Qwen3-VL, SmolVLM).

    Raises:
        ValueError: exit blocks not ascending, not in ``1..vision_blocks-1``; an attention width
            that is not a multiple of the heads.
    """
    if adapter_attn_dim % adapter_attn_heads:
        raise ValueError(f"adapter_attn_dim {adapter_attn_dim} is not a multiple of {adapter_attn_heads} heads")
    geo = cfg.exit_geometry
    n = geo.vision_blocks
    blocks = sorted(set(exit_blocks))
    if not blocks or blocks != list(exit_blocks) or blocks[0] < 1 or blocks[-1] >= n:
        raise ValueError(f"exit blocks must be ascending, distinct, within 1..{n - 1}; got {exit_blocks}")
    d = geo.vision_hidden_size
    if classifier_blocks is None:
        classifier_blocks = blocks + [n]
    return ExitsSpec(
        vision_hidden_size=d,
        vision_blocks=n,
        grid_side=geo.grid_side,
        has_cls_token=geo.has_cls_token,
        feature_dim=geo.feature_dim,
        layer_norm_eps=getattr(cfg.vision, "layer_norm_eps", 1e-6),
        exit_blocks=blocks,
        adapter_hidden=adapter_hidden or d,
        adapter_attn_dim=adapter_attn_dim,
        adapter_attn_heads=adapter_attn_heads,
        adapter_blocks=adapter_blocks,
        head_hidden=head_hidden,
        confidence_query_dim=geo.text_hidden_size if confidence_query else 0,
        labels=list(labels),
        classifier_blocks=sorted(set(classifier_blocks)) if labels else [],
    )


def has_exit_heads(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds ``exits.json``."""
    return (Path(model_dir) / EXITS_JSON).is_file()


def read_spec(model_dir: str | Path) -> ExitsSpec:
    """Parse ``exits.json``. Raises ModelLoadError (missing, not JSON, invalid: names the key)."""
    path = Path(model_dir) / EXITS_JSON
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found (run `edgevlm calibrate` on the model)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    try:
        return ExitsSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<root>"
        msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ModelLoadError(f"{path}: {loc}: {msg}") from None


def load_exit_heads(model_dir: str | Path, cfg, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, weights_dir: str | Path | None = None) -> ExitHeads | None:
    """Load the exit heads of ``model_dir`` for a model with config ``cfg``; None without
    ``exits.json``, and None (logged as an error) when they were calibrated for other weights
    (``weights_fingerprint``, checked against the weights in ``weights_dir``, default
    ``model_dir``), so a retrained model still loads, without early exit.

    Raises:
        ModelLoadError: invalid JSON/spec, heads made for another architecture (dims or block
            counts differ), or missing/extra/misshapen tensors in ``exits.safetensors``.
    """
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    if not has_exit_heads(model_dir):
        return None
    spec = read_spec(model_dir)
    geo = cfg.exit_geometry
    want = {
        "vision_hidden_size": geo.vision_hidden_size,
        "vision_blocks": geo.vision_blocks,
        "feature_dim": geo.feature_dim,
        "grid_side": geo.grid_side,
        "has_cls_token": geo.has_cls_token,
    }
    if spec.confidence_query_dim:
        want["confidence_query_dim"] = geo.text_hidden_size
    for key, value in want.items():
        if getattr(spec, key) != value:
            raise ModelLoadError(
                f"{model_dir / EXITS_JSON}: {key} is {getattr(spec, key)} but the model has {value} "
                "(exit heads of another model; rerun `edgevlm calibrate`)"
            )
    if any(not 1 <= b < spec.vision_blocks for b in spec.exit_blocks) or spec.exit_blocks != sorted(
        set(spec.exit_blocks)
    ):
        raise ModelLoadError(f"{model_dir / EXITS_JSON}: exit_blocks {spec.exit_blocks} out of range or unsorted")
    if any(not 1 <= b <= spec.vision_blocks for b in spec.classifier_blocks):
        raise ModelLoadError(f"{model_dir / EXITS_JSON}: classifier_blocks {spec.classifier_blocks} out of range")
    weights_dir = Path(weights_dir) if weights_dir is not None else model_dir
    if spec.weights_fingerprint and spec.weights_fingerprint != weights_fingerprint(weights_dir):
        logger.error("%s: the exit heads were calibrated for other weights than %s's (retrained or replaced): "
                     "not used; rerun `edgevlm calibrate`", model_dir / EXITS_JSON, weights_dir)
        return None
    heads = ExitHeads(spec, cfg.vision)
    expected = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    path = model_dir / EXITS_WEIGHTS
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in expected:
                    raise ModelLoadError(f"{path}: unexpected tensor {key}")
                t = f.get_tensor(key)
                if tuple(t.shape) != expected[key]:
                    raise ModelLoadError(f"{path}: {key} has shape {tuple(t.shape)}, expected {expected[key]}")
                state[key] = t
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"{path}: cannot read exit heads ({exc})") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{path}: missing tensors {', '.join(missing[:4])}")
    heads.load_state_dict(state)
    heads.to(device=device, dtype=dtype).eval()
    logger.info("exit heads: blocks %s, %d labels (%s)", spec.exit_blocks, len(spec.labels), model_dir)
    return heads


def save_exit_heads(heads: ExitHeads, out_dir: str | Path, *, dtype: torch.dtype = torch.float16,
                    group: AtomicFiles | None = None) -> tuple[Path, Path]:
    """Write ``exits.safetensors`` (``dtype``, float16 by default: half the bytes, and the heads
    run in the model's dtype anyway; mode 0644) and ``exits.json`` into ``out_dir``; returns both paths.

    The two files are replaced together (:class:`edgevlm.atomic_files.AtomicFiles`): a reader (a
    daemon's hot reload) or an interrupt never leaves new weights beside an old spec. With ``group``
    they are only staged in it, and replaced at its commit together with the caller's other files
    (``edgevlm calibrate``: the bundle's ``manifest.json``).

    Raises:
        OSError: ``out_dir`` cannot be created or written (no file changed).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in heads.state_dict().items()}
    weights, spec_path = out / EXITS_WEIGHTS, out / EXITS_JSON
    own = AtomicFiles() if group is None else None
    staging = own or group
    try:
        tmp = staging.path(weights)
        save_file(tensors, str(tmp), metadata={"format": EXITS_FORMAT})
        tmp.chmod(0o644)  # safetensors writes 0600; the daemon's service user must read shipped heads
        staging.write_text(spec_path, heads.spec.model_dump_json(indent=2) + "\n")
    except BaseException:
        if own is not None:  # a caller's group is the caller's to discard
            own.discard()
        raise
    if own is not None:
        own.commit()
    return weights, spec_path
