"""Test helpers: a tiny random-weight LLaVA checkpoint in Hugging Face format, written without
transformers (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a chat template, ``generation_config.json``, ``preprocessor_config.json`` with CLIP's normalisation).

The files follow what transformers 5.x ``save_pretrained`` writes for ``LlavaForConditionalGeneration``
(so transformers can load them too); ``layout`` selects one of the other key layouts the loader
accepts, for loader tests.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
DEFAULT_WORDS = (
    "USER ASSISTANT : ? . , a an the is are there how many what which where colour color shape of in on "
    "left right top bottom middle red green blue yellow white black orange purple circle circles square "
    "squares triangle triangles star stars small large big one two three four five six zero yes no and "
    "image picture object objects describe see this"
).split()

#: LLaVA-1.5-style template; renders structured (list) and plain-string message content.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

LAYOUTS = ("save_pretrained", "transformers5", "legacy")


def build_tokenizer_json(words: tuple[str, ...] | list[str] = DEFAULT_WORDS) -> str:
    """A word-level ``tokenizer.json`` (ids: specials 0-4 as in :data:`SPECIAL_TOKENS`, then ``words``;
    BOS prepended by the post-processor; whitespace/punctuation pre-tokenisation)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok.to_str()


def _tensors(cfg: dict, seed: int, tie: bool):
    """Random weights ``{canonical name: tensor}`` in the save_pretrained layout (float32)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def lin(name: str, n_out: int, n_in: int, bias: bool) -> None:
        out[name + ".weight"] = torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)
        if bias:
            out[name + ".bias"] = torch.randn(n_out, generator=g) * 0.02

    def norm(name: str, dim: int, bias: bool) -> None:
        out[name + ".weight"] = 1.0 + 0.1 * torch.randn(dim, generator=g)
        if bias:
            out[name + ".bias"] = 0.02 * torch.randn(dim, generator=g)

    vc, tc = cfg["vision_config"], cfg["text_config"]
    dv, p = vc["hidden_size"], vc["patch_size"]
    v = "vision_tower."
    out[v + "embeddings.class_embedding"] = torch.randn(dv, generator=g) * 0.5
    out[v + "embeddings.patch_embedding.weight"] = torch.randn(dv, 3, p, p, generator=g) / math.sqrt(3 * p * p)
    out[v + "embeddings.position_embedding.weight"] = torch.randn(
        (vc["image_size"] // p) ** 2 + 1, dv, generator=g) * 0.5
    norm(v + "pre_layrnorm", dv, True)
    for i in range(vc["num_hidden_layers"]):
        b = f"{v}encoder.layers.{i}."
        norm(b + "layer_norm1", dv, True)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            lin(b + "self_attn." + proj, dv, dv, True)
        norm(b + "layer_norm2", dv, True)
        lin(b + "mlp.fc1", vc["intermediate_size"], dv, True)
        lin(b + "mlp.fc2", dv, vc["intermediate_size"], True)
    norm(v + "post_layernorm", dv, True)
    d, hd = tc["hidden_size"], tc["head_dim"]
    lin("multi_modal_projector.linear_1", d, dv, True)
    lin("multi_modal_projector.linear_2", d, d, True)
    t = "language_model.model."
    out[t + "embed_tokens.weight"] = torch.randn(tc["vocab_size"], d, generator=g)
    for i in range(tc["num_hidden_layers"]):
        b = f"{t}layers.{i}."
        norm(b + "input_layernorm", d, False)
        lin(b + "self_attn.q_proj", tc["num_attention_heads"] * hd, d, False)
        lin(b + "self_attn.k_proj", tc["num_key_value_heads"] * hd, d, False)
        lin(b + "self_attn.v_proj", tc["num_key_value_heads"] * hd, d, False)
        lin(b + "self_attn.o_proj", d, tc["num_attention_heads"] * hd, False)
        norm(b + "post_attention_layernorm", d, False)
        lin(b + "mlp.gate_proj", tc["intermediate_size"], d, False)
        lin(b + "mlp.up_proj", tc["intermediate_size"], d, False)
        lin(b + "mlp.down_proj", d, tc["intermediate_size"], False)
    norm(t + "norm", d, False)
    if not tie:
        lin("language_model.lm_head", tc["vocab_size"], d, False)
    return out


def relayout(key: str, layout: str) -> str:
    """Rename a save_pretrained-layout key into ``layout`` (one of :data:`LAYOUTS`)."""
    if layout == "save_pretrained":
        return key
    if layout == "legacy":  # transformers 4.x: CLIPVisionModel wraps its modules in .vision_model
        return "vision_tower.vision_model." + key[len("vision_tower."):] if key.startswith("vision_tower.") else key
    if layout == "transformers5":  # transformers 5.x module tree (LlavaForConditionalGeneration.state_dict())
        if key.startswith("language_model.lm_head."):
            return key[len("language_model."):]
        if key.startswith("language_model.model."):
            return "model.language_model." + key[len("language_model.model."):]
        return "model." + key
    raise ValueError(f"unknown layout {layout!r} (one of {LAYOUTS})")


def write_tiny_checkpoint(
    dir: str | Path,
    *,
    seed: int = 0,
    image_size_px: int = 64,
    patch_size_px: int = 16,
    resolution_ladder: list[int] | None = None,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    text_hidden: int = 64,
    text_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_feature_layer: int | list[int] = -1,
    vision_feature_select_strategy: str = "default",
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    words: tuple[str, ...] | list[str] = DEFAULT_WORDS,
    chat_template: str | None = CHAT_TEMPLATE,
    layout: str = "save_pretrained",
) -> Path:
    """Write a tiny random LLaVA checkpoint (CLIP ViT + MLP projector + Llama) into ``dir``.

    Deterministic for a given ``seed``; a few hundred KB; loadable by
    :meth:`edgevlm.runtime.Engine.load` and by transformers' ``LlavaForConditionalGeneration``
    (``layout="save_pretrained"``). Answers are gibberish from the word list. Returns ``dir``.
    """
    from safetensors.torch import save_file

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = build_tokenizer_json(words)
    vocab_size = len(json.loads(tok_json)["model"]["vocab"])
    cfg = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "dtype": "float32",
        "image_token_index": SPECIAL_TOKENS.index("<image>"),
        "image_seq_length": (image_size_px // patch_size_px) ** 2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": vision_feature_layer,
        "vision_feature_select_strategy": vision_feature_select_strategy,
        "tie_word_embeddings": tie_word_embeddings,
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden,
            "num_hidden_layers": vision_layers, "num_attention_heads": num_heads, "num_channels": 3,
            "image_size": image_size_px, "patch_size": patch_size_px, "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5, "attention_dropout": 0.0, "projection_dim": vision_hidden,
        },
        "text_config": {
            "model_type": "llama", "vocab_size": vocab_size, "hidden_size": text_hidden,
            "intermediate_size": 2 * text_hidden, "num_hidden_layers": text_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": text_hidden // num_heads, "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 3, "tie_word_embeddings": tie_word_embeddings,
        },
        "edgevlm": {"resolution_ladder": list(resolution_ladder or [image_size_px])},
    }
    tensors = {relayout(k, layout): t.contiguous() for k, t in _tensors(cfg, seed, tie_word_embeddings).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok_json)
    # CLIP's normalisation, no "size": the engine runs it at its resolution-ladder rungs
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]},
        indent=2) + "\n")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": max_position_embeddings}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    logger.debug("wrote tiny LLaVA checkpoint to %s", out)
    return out
