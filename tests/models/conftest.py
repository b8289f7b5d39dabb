"""Tiny Qwen-style tokenizers for the Qwen-family tests (Qwen2.5-VL, Qwen3-VL).

:func:`build_qwen_tokenizer` writes a byte-level BPE ``tokenizer.json`` with the pre-tokenizer,
normaliser and decoder of Qwen2's ``tokenizer.json`` (the hub's), trained on a few sentences so
the vocabulary stays small, followed by Qwen's special tokens (``<|im_start|>``, ``<|vision_start|>``,
``<|image_pad|>``, ...), plus a ``tokenizer_config.json`` naming ``Qwen2Tokenizer`` so that
transformers' ``AutoProcessor`` loads it. The returned dict maps each special token to its id.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Qwen2's pre-tokenizer split pattern (tokenizer.json of Qwen2 / Qwen2.5 / Qwen2.5-VL / Qwen3-VL).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Special tokens in the order Qwen2.5-VL's tokenizer adds them (ids follow the trained vocabulary).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

#: Qwen2.5-VL's chat template as the hub ships it (chat_template.json of Qwen/Qwen2.5-VL-*-Instruct).
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = (
    "You are a helpful assistant.",
    "how many shapes are there? what color is the triangle? describe the scene.",
    "is the red circle on the left or the right? the top or the bottom? yes no 0 1 2 3",
    "What is happening in this video? The robot picks up a green cube and a yellow box.",
    "system user assistant",
)


def build_qwen_tokenizer(folder: Path, chat_template: str | None = QWEN2_5_VL_CHAT_TEMPLATE,
                         vocab_size: int = 300, extra_special_tokens: tuple[str, ...] = ()) -> dict[str, int]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (and ``chat_template.jinja`` when
    ``chat_template`` is given) into ``folder``; returns ``{special token: id}``. The BPE part
    has at most ``vocab_size`` entries; the special tokens come after it (Qwen's, then
    ``extra_special_tokens``, e.g. InternVL's ``<img>``)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(_CORPUS), trainer=trainer)
    specials = QWEN_SPECIAL_TOKENS + tuple(extra_special_tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "add_prefix_space": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return ids
