"""Decoder configuration shared by every model family (torch-free): :class:`TextConfig`, parsed
from a Hugging Face ``text_config`` by :func:`parse_text_config`, and the typed ``config.json``
readers the families' config parsers use.

Reads both the transformers 5.x layout (``rope_parameters``) and the legacy 4.x one (``rope_theta``
+ ``rope_scaling``). Keys a config leaves out take the defaults of the model type's transformers
config class (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ...). Anything the runtime cannot
run raises :class:`~edgevlm.errors.ModelLoadError` naming the offending key. Each family's own
config (vision tower, projector, image tokens) lives in ``edgevlm.runtime.models.<family>``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from edgevlm.errors import ModelLoadError

logger = logging.getLogger(__name__)

#: Activation names accepted for the vision MLP and the projector (transformers' ACT2FN names).
SUPPORTED_ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new", "silu", "relu")


@dataclass(frozen=True)
class TextConfig:
    """Llama-family decoder (the shared :class:`~edgevlm.runtime.decoder.Decoder`), configurable per
    family: ``llama``, ``mistral``, ``qwen2`` (q/k/v bias), ``qwen3`` (per-head q/k RMSNorm) and the
    text halves of the Qwen VL families (multimodal RoPE).

    RoPE: ``rope_type`` ``default``, ``linear`` (inverse frequencies divided by ``rope_factor``),
    ``dynamic`` (dynamic NTK: equals ``default`` while the KV cache stays within
    ``max_position_embeddings``, which :meth:`Decoder.setup_caches` enforces) or ``llama3``
    (Llama 3.1's frequency-dependent scaling with ``rope_factor``, ``rope_low_freq_factor``,
    ``rope_high_freq_factor``, ``rope_original_max_position_embeddings``); see
    :func:`edgevlm.runtime.decoder.rope_inv_freq`. ``mrope_section`` (M-RoPE, Qwen2-VL and later):
    the ``(t, h, w)`` split of the ``head_dim / 2`` frequencies; ``mrope_interleaved``: Qwen3-VL's
    interleaved layout. ``sliding_window``: Mistral's attention window (positions); the KV cache is
    kept within it, so attention is exact.

    Gemma 3 (``edgevlm.runtime.models.gemma3``): ``norm_unit_offset`` — every RMSNorm weight is
    stored as an offset from 1 (``x * (1 + w)``, the product in float32); ``sandwich_norms`` — four
    norms per layer (``post_attention_layernorm`` on the attention output, ``pre_feedforward_layernorm``
    / ``post_feedforward_layernorm`` around the MLP); ``embed_scale`` — token embeddings multiplied by
    it (``sqrt(hidden_size)``, cast to the weights' dtype first); ``attn_scale`` — the attention
    score scale (``query_pre_attn_scalar ** -0.5``; None = ``head_dim ** -0.5``); ``layer_types`` —
    ``"sliding_attention"`` / ``"full_attention"`` per layer; ``sliding_layer_window`` — the sliding
    layers' window (key ``k`` visible to query ``q`` when ``q - k < sliding_layer_window``): a mask
    during prefill, and a rolling KV cache of that many slots per sliding layer
    (:meth:`~edgevlm.runtime.decoder.Decoder.setup_caches`, ``window_caches``; ``sliding_window``,
    which bounds every layer's cache, stays None); ``sliding_rope_theta`` — the sliding layers' RoPE base ('default'
    type; the RoPE fields above are the full layers').
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=list)
    # Gemma 2 / 3 options (Gemma Team, "Gemma 3 Technical Report", 2025; transformers' Gemma3TextModel),
    # all off by default so the other decoders are unchanged
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_layer_window: int | None = None
    sliding_rope_theta: float | None = None


def get_typed(d: dict, key: str, default: Any, typ: type | tuple[type, ...], where: str) -> Any:
    value = d.get(key, default)
    if value is None:
        return default
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        names = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
        raise ModelLoadError(f"config.json: {where}{key} has type {type(value).__name__}, expected {names}")
    return value


def token_id(d: dict, key: str, default: int | None, vocab_size: int, where: str = "") -> int:
    """The token id under ``key`` of a ``config.json`` dict (``default`` when left out or null).

    Raises:
        ModelLoadError: a value that is not an int in ``[0, vocab_size)``, naming ``where`` + key.
    """
    value = d.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
        raise ModelLoadError(f"config.json: {where}{key} {value!r} is not a token id of the vocabulary "
                             f"(vocab_size {vocab_size})")
    return value


def int_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ModelLoadError(f"config.json: {where} must be an int or a list of ints, got {value!r}")


#: the private names families already import (kept one session for merging; use the public ones)
_get = get_typed


#: per-layer attention kinds of ``TextConfig.layer_types`` (transformers' names)
LAYER_TYPES = ("sliding_attention", "full_attention")

#: RoPE types :func:`edgevlm.runtime.decoder.rope_inv_freq` implements.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

#: Decoder model types :func:`parse_text_config` reads, with what each implies beyond Llama and the
#: defaults of its transformers config class that differ from ``LlamaConfig``'s.
TEXT_MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {"qkv_bias": True, "vocab_size": 151936, "intermediate_size": 22016,
              "max_position_embeddings": 32768},
    "qwen3": {"qk_norm": True, "vocab_size": 151936, "intermediate_size": 22016,
              "max_position_embeddings": 32768},
    "qwen2_5_vl_text": {"qkv_bias": True, "vocab_size": 152064, "intermediate_size": 29568,
                        "num_key_value_heads": 8, "max_position_embeddings": 32768},
    "qwen3_vl_text": {"qk_norm": True, "vocab_size": 151936, "intermediate_size": 22016,
                      "max_position_embeddings": 128000},
}


def _number(params: dict, key: str, default: float | None, where: str) -> float | None:
    value = params.get(key, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {where}{key} must be a positive number, got {value!r}")
    return float(value)


def _rope(tc: dict, where: str) -> dict[str, Any]:
    """RoPE fields of :class:`TextConfig` from ``rope_parameters`` (transformers 5.x) or
    ``rope_theta``/``rope_scaling`` (4.x)."""
    params = tc.get("rope_parameters")
    if params is None:
        scaling = tc.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ModelLoadError(f"config.json: {where}rope_scaling must be an object or null, got {scaling!r}")
        params = dict(scaling)
        params.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ModelLoadError(f"config.json: {where}rope_parameters must be an object")
    w = where + "rope_parameters."
    rope_type = params.get("rope_type", params.get("type", "default"))
    mrope = params.get("mrope_section")
    if rope_type == "mrope":  # transformers 4.x Qwen2-VL spelling of default + mrope_section
        rope_type = "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: {w}rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"config.json: {w}partial_rotary_factor {params['partial_rotary_factor']!r} "
                             "is not supported (1.0 only)")
    out: dict[str, Any] = {"rope_type": rope_type,
                           "rope_theta": _number(params, "rope_theta", tc.get("rope_theta", 10000.0), w)}
    if rope_type in ("linear", "dynamic", "llama3"):
        if "factor" not in params:
            raise ModelLoadError(f"config.json: {w}factor is required for rope_type {rope_type!r}")
        out["rope_factor"] = _number(params, "factor", None, w)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ModelLoadError(f"config.json: {w}{key} is required for rope_type 'llama3'")
        out["rope_low_freq_factor"] = _number(params, "low_freq_factor", None, w)
        out["rope_high_freq_factor"] = _number(params, "high_freq_factor", None, w)
        if out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
            raise ModelLoadError(f"config.json: {w}high_freq_factor must be larger than low_freq_factor")
        out["rope_original_max_position_embeddings"] = int(
            _number(params, "original_max_position_embeddings", None, w))
    if mrope is not None:
        if not isinstance(mrope, list) or not all(isinstance(v, int) and v > 0 for v in mrope):
            raise ModelLoadError(f"config.json: {w}mrope_section must be a list of positive ints, got {mrope!r}")
        out["mrope_section"] = tuple(mrope)
        out["mrope_interleaved"] = bool(params.get("mrope_interleaved", tc.get("mrope_interleaved", False)))
    return out


#: the decoder sizes that must be positive integers (a zero or negative one is refused naming the key)
POSITIVE_TEXT_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "max_position_embeddings")


def parse_text_config(tc: dict, where: str = "text_config.") -> TextConfig:
    """Parse a decoder config (a ``text_config`` dict) of one of :data:`TEXT_MODEL_TYPES`.

    Keys the dict leaves out take the defaults of the model type's transformers config class.
    ``where`` prefixes the key paths in error messages. Raises :class:`ModelLoadError` naming the
    key for a wrong type, an unsupported model type, RoPE type or activation, or inconsistent sizes.
    """
    w = where
    model_type = tc.get("model_type", "llama")
    if model_type not in TEXT_MODEL_TYPES:
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(TEXT_MODEL_TYPES)})")
    fam = TEXT_MODEL_TYPES[model_type]
    d = TextConfig()

    def default(key: str) -> Any:
        return fam.get(key, getattr(d, key))

    hidden = get_typed(tc, "hidden_size", d.hidden_size, int, w)
    heads = get_typed(tc, "num_attention_heads", d.num_attention_heads, int, w)
    if model_type in ("qwen2", "qwen2_5_vl_text"):  # q/k/v bias always, o_proj none (modeling_qwen2)
        qkv_bias, o_bias = True, False
    else:  # attention_bias: every projection, q/k/v and o (modeling_llama / mistral / qwen3)
        qkv_bias = o_bias = get_typed(tc, "attention_bias", False, bool, w)
    sliding = tc.get("sliding_window", default("sliding_window"))
    if model_type.startswith("qwen") and not tc.get("use_sliding_window", False):
        sliding = None  # Qwen configs carry a window that is only used with use_sliding_window
    if sliding is not None and (not isinstance(sliding, int) or isinstance(sliding, bool) or sliding < 1):
        raise ModelLoadError(f"config.json: {w}sliding_window must be a positive int or null, got {sliding!r}")
    cfg = TextConfig(
        vocab_size=get_typed(tc, "vocab_size", default("vocab_size"), int, w),
        hidden_size=hidden,
        intermediate_size=get_typed(tc, "intermediate_size", default("intermediate_size"), int, w),
        num_hidden_layers=get_typed(tc, "num_hidden_layers", d.num_hidden_layers, int, w),
        num_attention_heads=heads,
        num_key_value_heads=get_typed(tc, "num_key_value_heads", fam.get("num_key_value_heads", heads), int, w),
        head_dim=get_typed(tc, "head_dim", hidden // max(heads, 1), int, w),
        hidden_act=get_typed(tc, "hidden_act", d.hidden_act, str, w),
        max_position_embeddings=get_typed(tc, "max_position_embeddings", default("max_position_embeddings"), int, w),
        rms_norm_eps=get_typed(tc, "rms_norm_eps", d.rms_norm_eps, float, w),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=bool(fam.get("qk_norm", False)),
        mlp_bias=get_typed(tc, "mlp_bias", d.mlp_bias, bool, w),
        sliding_window=sliding,
        bos_token_id=tc.get("bos_token_id") if isinstance(tc.get("bos_token_id"), int) else None,
        eos_token_id=int_list(tc.get("eos_token_id"), w + "eos_token_id"),
        **_rope(tc, w),
    )
    for key in POSITIVE_TEXT_SIZES:  # checked before any division or tensor shape uses them
        if getattr(cfg, key) < 1:
            raise ModelLoadError(f"config.json: {w}{key} must be positive, got {getattr(cfg, key)}")
    if not cfg.rms_norm_eps > 0:
        raise ModelLoadError(f"config.json: {w}rms_norm_eps must be positive, got {cfg.rms_norm_eps}")
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_act {cfg.hidden_act!r} is not supported")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelLoadError(f"config.json: {w}num_attention_heads is not a multiple of num_key_value_heads")
    if cfg.head_dim % 2:
        raise ModelLoadError(f"config.json: {w}head_dim must be even for RoPE")
    if cfg.mrope_section is not None and sum(cfg.mrope_section) != cfg.head_dim // 2:
        raise ModelLoadError(f"config.json: {w}rope_parameters.mrope_section {list(cfg.mrope_section)} "
                             f"must sum to head_dim / 2 = {cfg.head_dim // 2}")
    return cfg


def parse_resolution_ladder(raw: dict, default: tuple[int, ...] = (), *, min_px: int = 1) -> tuple[int, ...]:
    """The resolution ladder of a checkpoint: ``config.json``'s ``edgevlm.resolution_ladder`` (rungs
    in px, sorted, duplicates dropped), else ``default``. One rule for every family; ``min_px`` is the
    vision patch size, the smallest rung (as for ``edgevlm ask --resolution``).

    Raises:
        ModelLoadError: ``edgevlm`` is not an object, the ladder is not a list of positive ints, or
            a rung is below ``min_px``.
    """
    extra = raw.get("edgevlm") or {}
    if not isinstance(extra, dict):
        raise ModelLoadError("config.json: edgevlm must be an object")
    ladder = extra.get("resolution_ladder") or list(default)
    if not isinstance(ladder, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0
                                               for r in ladder):
        raise ModelLoadError(f"config.json: edgevlm.resolution_ladder must be a list of positive ints, got {ladder!r}")
    small = sorted({r for r in ladder if r < min_px})
    if small:
        raise ModelLoadError(
            f"config.json: edgevlm.resolution_ladder rung(s) {', '.join(map(str, small))} px are below the vision "
            f"patch size ({min_px} px): a rung is at least one patch"
        )
    return tuple(sorted(set(ladder)))
