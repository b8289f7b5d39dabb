"""Model configuration of the LLaVA family, parsed from a Hugging Face ``config.json`` (torch-free).

Reads both the transformers 5.x layout (``text_config.rope_parameters``) and the legacy 4.x one
(``text_config.rope_theta`` + ``rope_scaling``, ``image_token_index``). Keys a config leaves out take
the defaults of transformers' ``LlavaConfig``, ``CLIPVisionConfig`` and ``LlamaConfig`` (the values
below are copied from those classes' documented defaults). Anything the runtime cannot run raises
:class:`~edgevlm.errors.ModelLoadError` naming the offending key.
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
class VisionConfig:
    """CLIP-style ViT (``model_type: clip_vision_model``)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_side(self) -> int:
        """Patches per side of the trained (square) position-embedding grid."""
        return self.image_size // self.patch_size


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


@dataclass(frozen=True)
class LlavaConfig:
    """A LLaVA checkpoint: vision tower + 2-layer MLP projector + decoder, plus edgevlm extras."""

    vision: VisionConfig
    text: TextConfig
    image_token_id: int = 32000
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    vision_feature_layer: tuple[int, ...] = (-2,)
    vision_feature_select_strategy: str = "default"
    tie_word_embeddings: bool = False
    resolution_ladder: tuple[int, ...] = ()

    @property
    def vision_feature_indices(self) -> tuple[int, ...]:
        """``vision_feature_layer`` as non-negative indices into the hidden-state list
        ``[embeddings, block_1, ..., block_L]`` (transformers' ``hidden_states`` convention)."""
        n = self.vision.num_hidden_layers + 1
        return tuple(i % n for i in self.vision_feature_layer)

    @property
    def vision_blocks_needed(self) -> int:
        """Encoder blocks that must run to produce every selected feature layer."""
        return max(self.vision_feature_indices)


def _get(d: dict, key: str, default: Any, typ: type | tuple[type, ...], where: str) -> Any:
    value = d.get(key, default)
    if value is None:
        return default
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ModelLoadError(f"config.json: {where}{key} has type {type(value).__name__}, expected {typ}")
    return value


def _int_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ModelLoadError(f"config.json: {where} must be an int or a list of ints, got {value!r}")


def _vision_config(vc: dict) -> VisionConfig:
    w = "vision_config."
    model_type = vc.get("model_type", "clip_vision_model")
    if model_type != "clip_vision_model":
        raise ModelLoadError(f"config.json: {w}model_type {model_type!r} is not supported (clip_vision_model)")
    d = VisionConfig()
    cfg = VisionConfig(
        hidden_size=_get(vc, "hidden_size", d.hidden_size, int, w),
        intermediate_size=_get(vc, "intermediate_size", d.intermediate_size, int, w),
        num_hidden_layers=_get(vc, "num_hidden_layers", d.num_hidden_layers, int, w),
        num_attention_heads=_get(vc, "num_attention_heads", d.num_attention_heads, int, w),
        num_channels=_get(vc, "num_channels", d.num_channels, int, w),
        image_size=_get(vc, "image_size", d.image_size, int, w),
        patch_size=_get(vc, "patch_size", d.patch_size, int, w),
        hidden_act=_get(vc, "hidden_act", d.hidden_act, str, w),
        layer_norm_eps=_get(vc, "layer_norm_eps", d.layer_norm_eps, float, w),
    )
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: {w}hidden_act {cfg.hidden_act!r} is not supported")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ModelLoadError(f"config.json: {w}hidden_size is not a multiple of num_attention_heads")
    if cfg.image_size % cfg.patch_size:
        raise ModelLoadError(f"config.json: {w}image_size is not a multiple of patch_size")
    return cfg


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
        params = dict(tc.get("rope_scaling") or {})
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

    hidden = _get(tc, "hidden_size", d.hidden_size, int, w)
    heads = _get(tc, "num_attention_heads", d.num_attention_heads, int, w)
    if model_type in ("qwen2", "qwen2_5_vl_text"):  # q/k/v bias always, o_proj none (modeling_qwen2)
        qkv_bias, o_bias = True, False
    else:  # attention_bias: every projection, q/k/v and o (modeling_llama / mistral / qwen3)
        qkv_bias = o_bias = _get(tc, "attention_bias", False, bool, w)
    sliding = tc.get("sliding_window", default("sliding_window"))
    if model_type.startswith("qwen") and not tc.get("use_sliding_window", False):
        sliding = None  # Qwen configs carry a window that is only used with use_sliding_window
    if sliding is not None and (not isinstance(sliding, int) or isinstance(sliding, bool) or sliding < 1):
        raise ModelLoadError(f"config.json: {w}sliding_window must be a positive int or null, got {sliding!r}")
    cfg = TextConfig(
        vocab_size=_get(tc, "vocab_size", default("vocab_size"), int, w),
        hidden_size=hidden,
        intermediate_size=_get(tc, "intermediate_size", default("intermediate_size"), int, w),
        num_hidden_layers=_get(tc, "num_hidden_layers", d.num_hidden_layers, int, w),
        num_attention_heads=heads,
        num_key_value_heads=_get(tc, "num_key_value_heads", fam.get("num_key_value_heads", heads), int, w),
        head_dim=_get(tc, "head_dim", hidden // max(heads, 1), int, w),
        hidden_act=_get(tc, "hidden_act", d.hidden_act, str, w),
        max_position_embeddings=_get(tc, "max_position_embeddings", default("max_position_embeddings"), int, w),
        rms_norm_eps=_get(tc, "rms_norm_eps", d.rms_norm_eps, float, w),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=bool(fam.get("qk_norm", False)),
        mlp_bias=_get(tc, "mlp_bias", d.mlp_bias, bool, w),
        sliding_window=sliding,
        bos_token_id=tc.get("bos_token_id") if isinstance(tc.get("bos_token_id"), int) else None,
        eos_token_id=_int_list(tc.get("eos_token_id"), w + "eos_token_id"),
        **_rope(tc, w),
    )
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


def parse_config(raw: dict) -> LlavaConfig:
    """Parse a LLaVA ``config.json`` dict.

    Raises:
        ModelLoadError: not a LLaVA config, a missing sub-config, a wrong type, or a feature the
            runtime does not implement (RoPE scaling, another vision/text model type).
    """
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    if raw.get("model_type") != "llava":
        raise ModelLoadError(f"config.json: model_type {raw.get('model_type')!r} is not supported (llava)")
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key), dict):
            raise ModelLoadError(f"config.json: missing key {key!r}")
    vision = _vision_config(raw["vision_config"])
    text = parse_text_config(raw["text_config"])
    image_token_id = raw.get("image_token_id", raw.get("image_token_index", 32000))
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < text.vocab_size:
        raise ModelLoadError(f"config.json: image_token_id {image_token_id!r} is not a token id of the vocabulary")
    layers = _int_list(raw.get("vision_feature_layer", -2), "vision_feature_layer")
    n_states = vision.num_hidden_layers + 1
    if not layers or any(not -n_states <= i < n_states for i in layers):
        raise ModelLoadError(f"config.json: vision_feature_layer {layers} is out of range for {n_states - 1} layers")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"config.json: vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
    act = _get(raw, "projector_hidden_act", "gelu", str, "")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config.json: projector_hidden_act {act!r} is not supported")
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(raw["text_config"].get("tie_word_embeddings", False))
    extra = raw.get("edgevlm") or {}
    if not isinstance(extra, dict):
        raise ModelLoadError("config.json: edgevlm must be an object")
    ladder = extra.get("resolution_ladder") or [vision.image_size]
    if not isinstance(ladder, list) or not all(isinstance(r, int) and r > 0 for r in ladder):
        raise ModelLoadError(f"config.json: edgevlm.resolution_ladder must be a list of positive ints, got {ladder!r}")
    return LlavaConfig(
        vision=vision,
        text=text,
        image_token_id=image_token_id,
        projector_hidden_act=act,
        projector_bias=_get(raw, "multimodal_projector_bias", True, bool, ""),
        vision_feature_layer=tuple(layers),
        vision_feature_select_strategy=strategy,
        tie_word_embeddings=tie,
        resolution_ladder=tuple(sorted(set(ladder))),
    )
