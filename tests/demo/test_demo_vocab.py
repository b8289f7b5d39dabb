"""Word-level tokenizer: exact round trip of every answer form, template/sequence agreement."""

from __future__ import annotations

import pytest

from edgevlm.runtime.demo import model_dir, scenes, vocab


@pytest.fixture(scope="module")
def tok():
    return vocab.build_tokenizer()


def _answers_and_questions():
    answers = {str(d) for d in range(5)} | {"yes", "no", "left", "right", "top", "bottom"}
    answers |= set(scenes.COLOURS) | set(scenes.SHAPES)
    questions = set()
    for i in range(400):
        scene = scenes.generate_scene(scenes.rng_for(0, scenes.DOMAIN_TRAIN, i))
        for qa in scenes.all_questions(scene):
            answers.add(qa.answer)
            questions.add(qa.question)
    return sorted(answers), sorted(questions)


def test_every_answer_form_round_trips(tok):
    answers, questions = _answers_and_questions()
    assert any(a.count(" and ") == 3 for a in answers)  # 4-object descriptions are covered
    for a in answers:
        enc = tok.encode(a, add_special_tokens=False)
        assert vocab.UNK_ID not in enc.ids, a
        assert tok.decode(enc.ids) == a
    for q in questions:
        assert vocab.UNK_ID not in tok.encode(q, add_special_tokens=False).ids, q


def test_special_tokens_and_case(tok):
    assert [tok.token_to_id(t) for t in vocab.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.encode("How Many SHAPES are there?").ids == tok.encode("how many shapes are there?").ids
    assert tok.encode("purple").ids == [vocab.UNK_ID]
    ids = tok.encode("<s>USER: <image>\nhi</s>").ids
    assert ids[0] == vocab.BOS_ID and vocab.IMAGE_TOKEN_ID in ids and ids[-1] == vocab.EOS_ID
    assert tok.decode([vocab.EOS_ID, tok.token_to_id("3")]) == "3"  # specials skipped


def test_sequence_builder_matches_the_chat_template(tok):
    qas = [
        ("how many shapes are there?", "3"),
        ("describe the scene.", "large red circle and small blue square"),
    ]
    messages = []
    for q, a in qas:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    text = vocab.render_chat(messages, add_generation_prompt=False)
    assert text.startswith("<s>USER: <image>\nhow many shapes are there? ASSISTANT: 3</s> USER: describe")
    ref = tok.encode(text).ids
    p = ref.index(vocab.IMAGE_TOKEN_ID)
    ref = ref[:p] + [vocab.IMAGE_TOKEN_ID] * 6 + ref[p + 1 :]
    ids, target = vocab.SequenceBuilder().build(6, qas)
    assert ids == ref
    supervised = [i for i, t in zip(ids, target, strict=True) if t]
    assert (
        tok.decode(supervised, skip_special_tokens=False).split()
        == "3 </s> large red circle and small blue square </s>".split()
    )


def test_runtime_tokenizer_encodes_prompts_like_training():
    """The runtime's prompt (chat template from the shipped tokenizer_config.json) equals the
    training prefix, token for token."""
    from edgevlm.runtime.tokenizer import VLMTokenizer

    rt = VLMTokenizer.from_dir(model_dir(), vocab.IMAGE_TOKEN_ID)
    builder = vocab.SequenceBuilder()
    for q in ("what color is the triangle?", "Describe the scene."):
        ids, target = builder.build(432, [(q, "red")])
        prompt = ids[: target.index(True)]
        assert rt.encode_prompt(q, 432) == prompt


@pytest.mark.slow  # imports transformers
def test_shipped_tokenizer_files_load_in_transformers():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir()))
    assert hf.bos_token == "<s>" and hf.eos_token == "</s>"
    text = hf.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "is there a red cross?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<s>USER: <image>\nis there a red cross? ASSISTANT:"
    assert hf.decode(hf("small white cross", add_special_tokens=False)["input_ids"]) == "small white cross"
