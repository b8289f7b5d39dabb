"""A checkpoint folder damaged the way a user damages one (a file left out of a copy, a corrupt weight
file), met by ``edgevlm quantize``, ``edgevlm ask`` and ``edgevlm serve --check-config``: one line,
exit 2, no output folder left behind. Real tiny checkpoints written by the family tests' builders."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from cli_support import one_line_error

cv2 = pytest.importorskip("cv2")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from edgevlm.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def qwen_src(tmp_path_factory) -> Path:
    from family_support import write_checkpoint

    return write_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("ckpt") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> Path:
    y, x = np.mgrid[0:48, 0:64]
    path = tmp_path_factory.mktemp("img") / "scene.png"
    assert cv2.imwrite(str(path), np.stack([x * 4, y * 5, np.full_like(x, 120)], -1).astype(np.uint8))
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_qwen_checkpoint_without_its_chat_template_is_refused_not_prompted_as_llava(
    qwen_src, image_path, tmp_path, capsys
):
    """Was: the folder loaded with LLaVA-1.5's 'USER: <image>\\n... ASSISTANT:' prompt, without a word,
    and quantize built a bundle of it: a Qwen model asked in another model's format answers garbage."""
    src = _copy(qwen_src, tmp_path / "no_template")
    (src / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((src / "tokenizer_config.json").read_text())
    out = tmp_path / "bundle"
    assert main(["quantize", str(src), "--out", str(out), "--method", "rtn"]) == 2
    message = one_line_error(capsys)
    assert message.startswith(
        f"{src}: model folder {src} has no chat template (chat_template.jinja, "
        "chat_template.json or tokenizer_config.json's chat_template): the qwen2_5_vl family"
    )
    assert not out.exists() and not out.with_name("bundle.partial").exists()
    assert main(["ask", "--image", str(image_path), "--model", str(src), "what is this?"]) == 2
    assert f"model folder {src} has no chat template" in one_line_error(capsys)
    config = tmp_path / "daemon.yaml"
    config.write_text(f"mqtt: {{device_id: r1}}\nmodel: {{path: {src}}}\n")
    assert main(["serve", "--check-config", str(config)]) == 2
    assert one_line_error(capsys).startswith(f"model.path: model folder {src} has no chat template")
    # the same folder with the template in chat_template.json (the hub's other spelling) loads
    template = (qwen_src / "chat_template.jinja").read_text()
    (src / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert main(["ask", "--image", str(image_path), "--model", str(src), "--max-new-tokens", "2", "q"]) == 0
    capsys.readouterr()


def test_a_llava_checkpoint_without_a_chat_template_keeps_the_llava_prompt(tmp_path):
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    engine = Engine.load(write_tiny_checkpoint(tmp_path / "llava", chat_template=None), device="cpu")
    assert engine.tokenizer.chat_template is None
    assert engine.tokenizer.render_prompt("hi") == "USER: <image>\nhi ASSISTANT:"


def test_a_weight_header_whose_dtype_does_not_fit_its_bytes_is_one_line(qwen_src, tmp_path, capsys):
    """Was: ``edgevlm quantize`` stopped with 'internal error: SafetensorError: ...' (exit 1), and
    ``serve --check-config`` passed the file that ``serve`` then could not load."""
    src = _copy(qwen_src, tmp_path / "relabelled")
    weights = src / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for f32 in (b'"dtype":"F32"', b'"dtype": "F32"'):  # the header as its writer spaced it
        text = raw[8 : 8 + n].replace(f32, f32.replace(b"F32", b"F64"), 1)
        if text != raw[8 : 8 + n]:
            break
    assert len(text) == n and text != raw[8 : 8 + n]  # same header length: only one dtype changed
    header, before = json.loads(text), json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__" and header[k]["dtype"] != before[k]["dtype"])
    weights.write_bytes(raw[:8] + text + raw[8 + n :])
    out = tmp_path / "bundle"
    assert main(["quantize", str(src), "--out", str(out), "--method", "rtn"]) == 2
    assert one_line_error(capsys).startswith(
        f"{weights}: corrupt safetensors header (tensor {name!r} is F64 "
    )
    assert not out.exists() and not out.with_name("bundle.partial").exists()
    config = tmp_path / "daemon.yaml"
    config.write_text(f"mqtt: {{device_id: r1}}\nmodel: {{path: {src}}}\n")
    assert main(["serve", "--check-config", str(config)]) == 2
    assert one_line_error(capsys).startswith(
        f"model.path: {weights}: corrupt safetensors header (tensor {name!r}"
    )
