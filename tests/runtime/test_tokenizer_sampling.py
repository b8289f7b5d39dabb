"""Chat templates, image-token expansion, incremental detokenisation, top-p and stop strings."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from edgevlm.errors import ModelLoadError  # noqa: E402
from edgevlm.runtime.sampling import SamplingParams, TextAssembler, holdback, select_token  # noqa: E402
from edgevlm.runtime.tokenizer import IncrementalDecoder, VLMTokenizer  # noqa: E402

STRING_TEMPLATE = (  # a template that expects message['content'] to be a plain string
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT_ONLY_TEMPLATE = (  # structured content, but image items are not rendered
    "{% for m in messages %}Q: {% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endfor %} A:"
)


def _tokenizer(tmp_path, *, template=None, where="tokenizer_config"):
    from edgevlm.runtime.testing import build_tokenizer_json

    (tmp_path / "tokenizer.json").write_text(build_tokenizer_json())
    cfg = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    if template is not None and where == "tokenizer_config":
        cfg["chat_template"] = template
    elif template is not None and where == "jinja":
        (tmp_path / "chat_template.jinja").write_text(template)
    elif template is not None and where == "json":
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return VLMTokenizer.from_dir(tmp_path, image_token_id=4)


def test_structured_chat_template_and_image_expansion(engine):
    tok = engine.tokenizer
    assert tok.render_prompt("how many stars ?") == "USER: <image>\nhow many stars ? ASSISTANT:"
    ids = tok.encode_prompt("how many stars ?", 3)
    words = [tok.tok.id_to_token(i) for i in ids]
    assert words == ["<s>", "USER", ":", "<image>", "<image>", "<image>", "how", "many", "stars", "?",
                     "ASSISTANT", ":"]


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja", "json"])
def test_string_content_template_from_each_file(tmp_path, where):
    tok = _tokenizer(tmp_path, template=STRING_TEMPLATE, where=where)
    text = tok.render_prompt("is there a red square ?")
    assert text == "<s><|user|><image>\nis there a red square ?<|end|><|assistant|>"
    ids = tok.encode_prompt("is there a red square ?", 2)
    assert ids.count(1) == 1 and ids[0] == 1  # BOS from the template, not added twice
    assert ids.count(4) == 2


def test_template_that_drops_image_items_gets_the_image_inserted(tmp_path):
    tok = _tokenizer(tmp_path, template=TEXT_ONLY_TEMPLATE)
    assert tok.render_prompt("describe this") == "Q: <image>\ndescribe this A:"


def test_no_template_uses_llava_fallback(tmp_path):
    tok = _tokenizer(tmp_path)
    assert tok.render_prompt("what shape ?") == "USER: <image>\nwhat shape ? ASSISTANT:"


@pytest.mark.parametrize(
    "template", ["{% for m in messages %}{{ m['content'] ", "{{ raise_exception('no images here') }}"]
)
def test_broken_template_is_a_load_error(tmp_path, template):
    with pytest.raises(ModelLoadError, match="chat template"):
        _tokenizer(tmp_path, template=template)


def test_image_token_that_is_not_an_added_token_is_a_load_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from edgevlm.runtime.testing import SPECIAL_TOKENS

    raw = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL_TOKENS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()  # splits "<image>" into "<", "image", ">"
    with pytest.raises(ModelLoadError, match="image token '<image>'"):
        VLMTokenizer(raw, 4, None, None, None)


def test_incremental_decoder_keeps_multibyte_characters_whole():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(["<image>"])
    tok = VLMTokenizer(raw, raw.token_to_id("<image>"), None, None, None)
    text = "Größe: 3 🙂 objects, naïve café"
    ids = raw.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: emoji split over 4 tokens
    dec = IncrementalDecoder(tok)
    deltas = [dec.push(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "🙂" in deltas  # emitted in one piece once its 4th byte arrived


def test_incremental_decoder_word_level_spacing(engine):
    tok = engine.tokenizer
    ids = tok.tok.encode("red circle on the left", add_special_tokens=False).ids
    dec = IncrementalDecoder(tok)
    assert [dec.push(i) for i in ids] == ["red", " circle", " on", " the", " left"]
    assert dec.push(2) == ""  # EOS is a special token: no text


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams.validate(4, 1.0, 0.7, None, 0)
    g = torch.Generator().manual_seed(0)
    drawn = {select_token(logits, params, g) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 so nothing after it
    all_tokens = {select_token(logits, SamplingParams.validate(4, 1.0, 1.0, None, 0), g) for _ in range(400)}
    assert all_tokens == {0, 1, 2, 3}
    assert select_token(logits, SamplingParams.validate(4, 0.0, 1.0, None, None), None) == 0


def test_seeded_sampling_sequences_repeat():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams.validate(4, 1.0, 0.9, None, 123)

    def draw():
        g = torch.Generator().manual_seed(123)
        return [select_token(logits, params, g) for _ in range(20)]

    assert draw() == draw()


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, 10**23])
def test_seed_outside_the_wire_range_is_invalid_request(seed):
    """A seed torch.Generator cannot take (past 2**64) or the wire refuses (negative, past 2**63 - 1) is an
    InvalidRequestError naming ``seed``, not a ValueError from ``manual_seed`` at the first sampled token."""
    from edgevlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"seed must be in \[0, 9223372036854775807\], got "):
        SamplingParams.validate(4, 1.0, 1.0, None, seed)
    assert SamplingParams.validate(4, 1.0, 1.0, None, 2**63 - 1).seed == 2**63 - 1


def test_holdback_and_text_assembler():
    assert holdback("the cat", ("cats",)) == 3
    assert holdback("the ca", ("cats", "a")) == 2
    assert holdback("the dog", ("cats",)) == 0
    asm = TextAssembler(("STOP",))
    shown = [asm.add(p) for p in [" hello", " wor", "ld ST", "O", "P and more"]]
    assert shown == ["hello", " wor", "ld", "", ""]
    assert asm.stopped and asm.final_text == "hello world"
    asm = TextAssembler(())
    assert [asm.add(p) for p in ["  a", " ", "b  "]] + [asm.finish()] == ["a", "", " b", ""]
    assert asm.final_text == "a b"
