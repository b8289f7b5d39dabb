"""Word-level tokenizer of the demo model, its chat template, and the training-sequence builder.

The tokenizer is a ``tokenizers`` ``WordLevel`` model (NFKC + lowercase normaliser, whitespace
split then isolated punctuation, no decoder: tokens are joined with single spaces on decode, so
every answer the scene generator produces decodes back to itself). Ids 0-4 are the special tokens
``<unk> <s> </s> <pad> <image>``; the rest is :func:`edgevlm.runtime.demo.scenes.vocabulary`
plus the template words and common question words, sorted.

The chat template follows LLaVA-1.5 (``llava-hf/llava-1.5-7b-hf``'s conversation format):
``<s>USER: <image>\\n{question} ASSISTANT: {answer}</s>USER: {question} ASSISTANT:``. Unlike the
Llama tokenizer, this tokenizer adds no BOS itself (no post-processor): the template writes
``bos_token``. A user message may be a string (``<image>\\n`` is put before the first one unless it
already holds ``<image>``) or a list of ``{"type": "image"}``/``{"type": "text", "text": ...}`` parts.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgevlm.runtime.demo import scenes

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, PAD, IMAGE)
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IMAGE_TOKEN_ID = range(5)

#: Words a user may plausibly use beyond the generator's own vocabulary (they map to ids, not <unk>).
EXTRA_WORDS: tuple[str, ...] = (
    "user", "assistant", ":", ",", "!", "'", "s", "-",
    "an", "any", "above", "below", "big", "can", "center", "centre", "colour", "colors", "colours",
    "contain", "count", "do", "does", "five", "four", "front", "has", "have", "i", "image", "in",
    "item", "items", "it", "large", "located", "me", "middle", "of", "one", "picture", "please",
    "see", "side", "size", "tell", "thing", "things", "three", "tiny", "to", "two", "visible",
    "where", "which", "with", "you", "zero", "10",
)  # fmt: skip

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if not loop.first %} {% endif %}USER: "
    "{% if message['content'] is string %}"
    "{% if loop.first and '<image>' not in message['content'] %}<image>\n{% endif %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    " ASSISTANT: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def vocab_words() -> list[str]:
    """All non-special tokens, sorted (ids 5..)."""
    return sorted(set(scenes.vocabulary()) | set(EXTRA_WORDS))


def build_tokenizer():
    """The demo model's ``tokenizers.Tokenizer`` (word level; see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in vocab_words():
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` contents (transformers' ``PreTrainedTokenizerFast`` keys)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "image_token": IMAGE,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(out_dir: str | Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def render_chat(messages: list[dict], *, add_generation_prompt: bool) -> str:
    """Render :data:`CHAT_TEMPLATE` with jinja2 (as transformers' ``apply_chat_template`` does)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS
    )


class SequenceBuilder:
    """Builds training sequences ``<s>USER: <image>*N q1 ASSISTANT: a1</s>USER: q2 ...`` as ids.

    The ids equal the tokenizer's encoding of :func:`render_chat` with ``<image>`` repeated once per
    vision token (a test checks this); ``target`` marks the answer tokens and their ``</s>``.
    """

    def __init__(self) -> None:
        self.tok = build_tokenizer()
        self._cache: dict[str, list[int]] = {}
        self.user = self.encode("USER:")
        self.assistant = self.encode("ASSISTANT:")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens added), cached."""
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tok.encode(text, add_special_tokens=False).ids
            self._cache[text] = ids
        return ids

    def build(self, n_image_tokens: int, qas: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        """``(ids, target)`` for a conversation about one image: ``qas`` = [(question, answer)]."""
        ids = [BOS_ID] + self.user + [IMAGE_TOKEN_ID] * n_image_tokens
        target = [False] * len(ids)
        for turn, (question, ans) in enumerate(qas):
            if turn:
                ids += self.user
            ids += self.encode(question) + self.assistant
            a = self.encode(ans) + [EOS_ID]
            target += [False] * (len(ids) - len(target))
            ids += a
            target += [True] * len(a)
        return ids, target
