"""Fixtures of the runtime tests: tiny checkpoints (ours and transformers-built) and engines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint written by write_tiny_checkpoint (non-square capable, ladder 32/64)."""
    from edgevlm.runtime.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0, resolution_ladder=[32, 64])


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from edgevlm.runtime import Engine

    return Engine.load(tiny_dir, device="cpu")


@pytest.fixture(scope="session")
def image() -> np.ndarray:
    """A deterministic non-square RGB frame (H=60, W=100)."""
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, size=(60, 100, 3), dtype=np.uint8)


def build_hf_checkpoint(out: Path, *, feature_layer, strategy: str, kv_heads: int, tie: bool,
                        vision_layers: int = 3, seed: int = 0) -> Path:
    """Build a random LlavaForConditionalGeneration with transformers, save_pretrained it into
    ``out`` and add our word-level tokenizer files. Weights are re-drawn with O(1) activations so
    logits are well spread (transformers' init gives near-uniform logits)."""
    transformers = pytest.importorskip("transformers")
    from edgevlm.runtime.testing import CHAT_TEMPLATE, build_tokenizer_json

    tok_json = build_tokenizer_json()
    vocab = len(json.loads(tok_json)["model"]["vocab"])
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                                       num_attention_heads=4, image_size=64, patch_size=16)
    tc = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=tie,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=4,
                                   vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                   tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "position_embedding.weight")):
                p.normal_(0.0, 0.2)
            elif p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(tok_json)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="session")
def hf_builder():
    """:func:`build_hf_checkpoint` (skips when transformers is not installed)."""
    pytest.importorskip("transformers")
    return build_hf_checkpoint


@pytest.fixture
def copy_dir(tmp_path):
    """Copy a checkpoint folder into a fresh temp folder (to break it)."""

    def _copy(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return _copy
