"""Benchmark models: random-weight LLaVA models in real architectures' sizes, built without downloads,
as edgevlm :class:`~edgevlm.runtime.llava.LlavaModel` and (optionally) as transformers'
``LlavaForConditionalGeneration`` sharing the very same weight tensors.

Sizes (published configs; weights are random, only shapes and cost matter):

* ``llava-7b``: LLaVA-1.5-7B (Liu et al. 2023) — CLIP ViT-L/14 at 336 px (24 layers, 1024 wide, 577
  tokens, features from layer -2) + 2-layer GELU projector + Llama-2-7B (32 layers, 4096 wide,
  32 heads, MLP 11008, vocab 32064).
* ``small``: CLIP ViT-B/16 at 224 px (12 layers, 768 wide) + a ~0.5B Llama-shaped decoder with the
  shape of Qwen2.5-0.5B (24 layers, 896 wide, 14 query / 2 KV heads of 64, MLP 4864, vocab 151936,
  tied embeddings): 494M decoder parameters.
* ``tiny``: a few-hundred-KB model for CPU tests of the benchmark itself.
* ``demo``: the shipped demo model (``edgevlm.runtime.demo.model_dir()``), loaded from disk; any
  other LLaVA checkpoint folder through :func:`build_from_dir` (``edgevlm bench --model DIR``).

The other families' models are :mod:`edgevlm.quantize.bench_families`'.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgevlm.runtime.loader import compile_weight_rules, map_weight_name
from edgevlm.runtime.models.llava.config import LlavaConfig, parse_config
from edgevlm.runtime.models.llava.model import LlavaModel
from edgevlm.runtime.models.llava.weights import WEIGHT_RULES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of one benchmark model (vision: CLIP ViT; text: Llama)."""

    v_hidden: int
    v_layers: int
    v_heads: int
    v_inter: int
    image_px: int
    patch_px: int
    t_hidden: int
    t_layers: int
    t_heads: int
    t_kv_heads: int
    t_inter: int
    vocab: int
    tie: bool = False
    feature_layer: int = -2

    def config_dict(self) -> dict:
        """A ``config.json``-style dict (what transformers' save_pretrained writes)."""
        return {
            "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
            "image_token_index": 4, "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
            "vision_feature_layer": self.feature_layer, "vision_feature_select_strategy": "default",
            "tie_word_embeddings": self.tie,
            "vision_config": {
                "model_type": "clip_vision_model", "hidden_size": self.v_hidden, "intermediate_size": self.v_inter,
                "num_hidden_layers": self.v_layers, "num_attention_heads": self.v_heads, "num_channels": 3,
                "image_size": self.image_px, "patch_size": self.patch_px, "hidden_act": "quick_gelu",
                "layer_norm_eps": 1e-5, "projection_dim": 768,
            },
            "text_config": {
                "model_type": "llama", "vocab_size": self.vocab, "hidden_size": self.t_hidden,
                "intermediate_size": self.t_inter, "num_hidden_layers": self.t_layers,
                "num_attention_heads": self.t_heads, "num_key_value_heads": self.t_kv_heads,
                "head_dim": self.t_hidden // self.t_heads, "hidden_act": "silu", "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": 0, "tie_word_embeddings": self.tie,
            },
        }


SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(64, 2, 4, 128, 64, 16, 128, 2, 4, 2, 256, 512),
    "small": ModelSpec(768, 12, 12, 3072, 224, 16, 896, 24, 14, 2, 4864, 151936, tie=True),
    "llava-7b": ModelSpec(1024, 24, 16, 4096, 336, 14, 4096, 32, 32, 32, 11008, 32064),
}
MODEL_NAMES = (*SPECS, "demo")


@torch.no_grad()
def init_random_(model: nn.Module, seed: int) -> None:
    """Re-draw every parameter so activations stay O(1) through the depth (``N(0, 1/fan_in)``
    matrices, norms ``1 + N(0, 0.1)``, embeddings ``N(0, 0.2)``); on the parameters' device."""
    gen_device = next(model.parameters()).device
    g = torch.Generator(device=gen_device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("embed_tokens.weight", "position_embedding.weight")):
            p.normal_(0.0, 0.2, generator=g)
        elif p.ndim > 1:
            p.normal_(0.0, p[0].numel() ** -0.5, generator=g)
        else:
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1, generator=g)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def ours_from_state(cfg: LlavaConfig, state: dict[str, torch.Tensor], max_seq_len: int) -> LlavaModel:
    """An edgevlm model over the tensors of a transformers state dict (shared, not copied)."""
    with torch.device("meta"):
        model = LlavaModel(cfg)
    expected = set(model.state_dict())
    rules = compile_weight_rules(WEIGHT_RULES)
    mapped = {}
    for key, t in state.items():
        name = map_weight_name(key, rules)
        if name is not None and name in expected:
            mapped[name] = t
    if cfg.tie_word_embeddings:
        mapped.pop("language_model.lm_head.weight", None)
        expected.discard("language_model.lm_head.weight")
    missing = sorted(expected - set(mapped))
    if missing:
        raise RuntimeError(f"state dict lacks {missing[:3]}")
    model.load_state_dict(mapped, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.setup_caches(1, max_seq_len)
    return model


def build_models(name: str | ModelSpec, *, device: torch.device, dtype: torch.dtype, max_seq_len: int,
                 with_hf: bool, seed: int = 0, hf_attn: str = "sdpa"):
    """``(ours, hf_or_None, cfg)`` for benchmark model ``name`` (see :data:`MODEL_NAMES`) or a
    :class:`ModelSpec`.

    Raises FileNotFoundError for ``demo`` when the demo weights are not shipped in this tree, and
    ImportError when ``with_hf`` and transformers is missing."""
    if name == "demo":
        return _build_demo(device=device, dtype=dtype, max_seq_len=max_seq_len, with_hf=with_hf, hf_attn=hf_attn)
    raw = (name if isinstance(name, ModelSpec) else SPECS[name]).config_dict()
    cfg = parse_config(raw)
    if not with_hf:
        with torch.device("meta"):
            model = LlavaModel(cfg)
        model.to_empty(device=device).to(dtype)
        init_random_(model, seed)
        if cfg.tie_word_embeddings:
            model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
        model.eval().requires_grad_(False)
        model.setup_caches(1, max_seq_len)
        return model, None, cfg
    import transformers

    hf_cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**{k: v for k, v in raw["vision_config"].items() if k != "model_type"}),
        text_config=transformers.LlamaConfig(**{k: v for k, v in raw["text_config"].items() if k != "model_type"}),
        image_token_id=raw["image_token_index"], vision_feature_layer=raw["vision_feature_layer"],
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
        tie_word_embeddings=raw["tie_word_embeddings"],
    )
    hf_cfg._attn_implementation = hf_attn
    with _default_dtype(dtype), torch.device(device):
        hf = transformers.LlavaForConditionalGeneration(hf_cfg)
    hf = hf.to(device=device).eval().requires_grad_(False)  # no dtype cast: RoPE's inv_freq stays fp32
    init_random_(hf, seed)
    return ours_from_state(cfg, hf.state_dict(), max_seq_len), hf, cfg


def _build_demo(*, device, dtype, max_seq_len, with_hf, hf_attn):
    from edgevlm.runtime.demo import model_dir

    path = Path(model_dir())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the demo model is not in this tree ({path})")
    return build_from_dir(path, device=device, dtype=dtype, max_seq_len=max_seq_len, with_hf=with_hf, hf_attn=hf_attn)


def build_from_dir(path: str | Path, *, device: torch.device, dtype: torch.dtype, max_seq_len: int, with_hf: bool,
                   hf_attn: str = "sdpa"):
    """``(ours, hf_or_None, cfg)`` of a LLaVA checkpoint folder: ours by
    :func:`~edgevlm.runtime.loader.load_model`, transformers' by ``from_pretrained`` (two copies of
    the weights). Raises ModelLoadError for a folder that is not a checkpoint."""
    from edgevlm.runtime.loader import load_model, read_model_files

    files = read_model_files(path)
    ours = load_model(files, device=device, dtype=dtype, max_seq_len=max_seq_len)
    hf = None
    if with_hf:
        import transformers

        hf = transformers.LlavaForConditionalGeneration.from_pretrained(
            files.model_dir, dtype=dtype, attn_implementation=hf_attn).to(device).eval()
    return ours, hf, files.config


def quantize_decoder_w4(model: LlavaModel, group_size: int = 128) -> int:
    """Replace the decoder layers' linears by RTN W4A16 :class:`~edgevlm.runtime.int4.Int4Linear`
    (in place; ``lm_head``, embeddings and the vision tower stay 16-bit). Fused projections
    (``qkv_proj``, ``gate_up_proj``) are dropped, not quantized a second time: the next
    ``fuse_projections`` (a new ``TorchBackend``) fuses the int4 parts. Returns the count."""
    from edgevlm.runtime.int4 import Int4Linear

    n = 0
    for layer in model.language_model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for attr, mod in list(parent.named_children()):
                if attr in _FUSED:  # fused q/k/v and gate/up: dropped here, re-fused from the int4 parts
                    setattr(parent, attr, None)
                elif isinstance(mod, nn.Linear) and mod.in_features % group_size == 0:
                    setattr(parent, attr, Int4Linear.from_linear(mod, group_size).to(mod.weight.device))
                    n += 1
    return n


def quantize_lm_head_w4(model: LlavaModel, group_size: int = 128) -> bool:
    """Replace ``lm_head`` by an RTN W4A16 :class:`~edgevlm.runtime.int4.Int4Linear` (in place; a tied head
    gets its own INT4 copy, the embeddings stay 16-bit), as ``edgevlm quantize --lm-head int4`` does.
    Returns whether it was replaced (False: ``in_features`` not a multiple of ``group_size``)."""
    from edgevlm.runtime.int4 import Int4Linear

    head = model.language_model.lm_head
    if head.in_features % group_size:
        return False
    model.language_model.lm_head = Int4Linear.from_linear(head, group_size).to(head.weight.device)
    return True


#: the fused projections of :meth:`Decoder.fuse_projections` (views of the parts' weights)
_FUSED = ("qkv_proj", "gate_up_proj")


def shallow_copy_model(model: LlavaModel, max_seq_len: int) -> LlavaModel:
    """Another :class:`LlavaModel` over the same parameter tensors (own KV caches): to quantize
    the decoder of one copy while the other stays 16-bit."""
    state = dict(model.state_dict())
    with torch.device("meta"):
        clone = LlavaModel(model.cfg)
    if model.cfg.tie_word_embeddings:
        state.pop("language_model.lm_head.weight", None)
    clone.load_state_dict(state, strict=False, assign=True)
    if model.cfg.tie_word_embeddings:
        clone.language_model.lm_head.weight = clone.language_model.embed_tokens.weight
    clone.eval().requires_grad_(False)
    clone.setup_caches(1, max_seq_len)
    return clone


def decoder_weight_bytes(model: LlavaModel) -> int:
    """Bytes of decoder weights one decode step reads (layers, final norm, ``lm_head``; the
    embedding table is read one row per token and not counted). Storage shared between modules
    (fused projections, tied embeddings) counts once; KV caches do not count."""
    dec = model.language_model
    caches = {b.untyped_storage().data_ptr() for layer in dec.layers for b in layer.self_attn.kv_cache.buffers()}
    seen: set[int] = set()
    total = 0
    tensors = [*dec.layers.parameters(), *dec.layers.buffers(), *dec.norm.parameters(), *dec.lm_head.parameters(),
               *dec.lm_head.buffers()]
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in caches or ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
