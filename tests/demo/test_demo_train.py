"""Training script pieces: batches are a pure function of (seed, index), the training forward is
transformers' LLaVA forward, and the shipped configuration fits the size budget."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from edgevlm.runtime.demo import train, vocab  # noqa: E402
from edgevlm.runtime.preprocess import preprocess  # noqa: E402


def test_batches_are_deterministic_and_well_formed():
    a = train.TrainBatches(seed=0, batch_size=3)[17]
    b = train.TrainBatches(seed=0, batch_size=3)[17]
    c = train.TrainBatches(seed=1, batch_size=3)[17]
    assert a["rung"] == b["rung"] and a["rung"] in train.RESOLUTION_LADDER_PX
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert not torch.equal(a["pixel_values"], c["pixel_values"]) or not torch.equal(
        a["input_ids"], c["input_ids"]
    )
    rung = a["rung"]
    _, _, h, w = a["pixel_values"].shape
    assert (w, h) == (rung, rung * 3 // 4)  # 4:3 scenes, longer side = rung, multiples of 16
    n_img = (h // 16) * (w // 16)
    assert ((a["input_ids"] == vocab.IMAGE_TOKEN_ID).sum(dim=1) == n_img).all()
    assert a["target"].any(dim=1).all()  # every row supervises something
    # pixel values are exactly preprocess() of some uint8 image (CLIP normalisation), in float16
    x = preprocess(np.zeros((288, 384, 3), np.uint8), rung, 16)
    assert x.shape == a["pixel_values"].shape[1:]


def test_training_forward_equals_transformers_llava():
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(train.model_config(tiny=True)).eval()
    batch = train.TrainBatches(seed=0, batch_size=2)[3]
    pixels = batch["pixel_values"].float()
    with torch.no_grad():
        mine = model.lm_head(train.forward_hidden(model, pixels, batch["input_ids"]))
        ref = model(input_ids=batch["input_ids"], pixel_values=pixels, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
        logits, tgt, rows = train.answer_logits(model, batch, torch.device("cpu"))
        ce = torch.nn.functional.cross_entropy(logits, tgt)
        torch.testing.assert_close(train.train_loss(model, batch, torch.device("cpu")), ce)
    assert rows.tolist() == sorted(rows.tolist()) and set(rows.tolist()) == {0, 1}


def test_shipped_configuration_fits_the_budget():
    cfg = train.model_config()
    assert cfg.vision_config.patch_size == 16 and cfg.vision_config.num_hidden_layers >= 6
    assert cfg.text_config.num_key_value_heads < cfg.text_config.num_attention_heads
    assert cfg.vision_feature_layer == -1 and cfg.vision_feature_select_strategy == "default"
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 2 * n <= 20_000_000  # float16 bytes


def test_position_embedding_init_is_2d_sincos():
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(train.model_config(tiny=True))
    train.init_position_embedding(model)
    emb = next(m for m in model.model.vision_tower.modules() if hasattr(m, "position_embedding"))
    w = emb.position_embedding.weight.detach()  # (1 + 24*24, 64)
    assert torch.all(w[0] == 0)
    grid = w[1:].reshape(24, 24, -1)
    half = w.shape[1] // 2
    assert torch.allclose(grid[:, 0, :half], grid[:, 5, :half])  # row code constant along a row
    assert torch.allclose(grid[0, :, half:], grid[7, :, half:])  # column code constant down a column
    assert torch.allclose(grid[3, 0, 0], torch.tensor(np.sin(3.0), dtype=w.dtype))  # row 3
    assert torch.allclose(grid[0, 3, half], torch.tensor(np.sin(3.0), dtype=w.dtype))  # column 3


def test_lr_schedule():
    assert train.lr_at(0, 1000, 1e-3, 100) == pytest.approx(1e-5)
    assert train.lr_at(99, 1000, 1e-3, 100) == pytest.approx(1e-3)
    assert train.lr_at(1000, 1000, 1e-3, 100) == pytest.approx(5e-5)
