"""Early-exit training (runtime/demo/train_exits.py): the loss reduces to the plain training loss
without exit weight, an identity adapter passes block k's hidden states through, and heads saved
after training give the runtime's forced exit exactly the features the training saw."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from edgevlm.runtime.demo import train, train_exits  # noqa: E402
from edgevlm.runtime.demo.train_data import N_AUX_CLASSES  # noqa: E402

CPU = torch.device("cpu")


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlavaForConditionalGeneration(train.model_config(tiny=True)).eval()


def randomise_adapters(heads, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.adapters.named_parameters():
            if not name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def test_joint_loss_without_exit_weight_is_the_training_loss():
    model = tiny_model()
    heads = train_exits.build_exit_heads(model, [1], adapter_hidden=32, adapter_attn_dim=16)
    randomise_adapters(heads)
    torch.manual_seed(3)
    aux = torch.nn.Linear(model.config.vision_config.hidden_size, N_AUX_CLASSES + 6)
    batch = train.TrainBatches(seed=0, batch_size=2)[5]
    batch["pixel_values"] = batch["pixel_values"].float()
    with torch.no_grad():
        ref = train.train_loss(model, batch, CPU, aux, 0.5)
        zero, parts = train_exits.joint_loss(model, heads, batch, CPU, exit_weight=0.0, aux_head=aux, aux_weight=0.5)
        one, _ = train_exits.joint_loss(model, heads, batch, CPU, exit_weight=1.0, aux_head=aux, aux_weight=0.5)
        plain = train.train_loss(model, batch, CPU)
    torch.testing.assert_close(zero, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts[0], plain, rtol=1e-5, atol=1e-5)  # the full path's answer CE
    assert len(parts) == 2 and float(one) > float(zero) + 1e-3  # the exit's loss is added


def test_identity_adapter_passes_the_block_output_through():
    model = tiny_model()
    heads = train_exits.build_exit_heads(model, [1], adapter_hidden=32, adapter_attn_dim=0)
    batch = train.TrainBatches(seed=0, batch_size=2)[1]
    px = batch["pixel_values"].float()
    with torch.no_grad():
        hidden, variants = train_exits.forward_variants(model, heads, px, batch["input_ids"])
        vis = model.model.vision_tower(pixel_values=px, interpolate_pos_encoding=True, output_hidden_states=True)
    assert hidden.shape[:2] == (2, 2)  # (variants, batch, T, D)
    torch.testing.assert_close(variants[0], vis.last_hidden_state[:, 1:])
    torch.testing.assert_close(variants[1], vis.hidden_states[1][:, 1:])


def test_saved_heads_give_the_runtime_the_trained_exit_features(tmp_path):
    """Model + heads as train.main saves them (float16, fingerprint bound); the runtime's forced
    exit after block 1 must produce the vision tokens the training forward computed."""
    from edgevlm.runtime import Engine
    from edgevlm.runtime.exits import read_spec
    from edgevlm.runtime.vision import encode_adaptive

    model = tiny_model(seed=4)
    heads = train_exits.build_exit_heads(model, [1], adapter_hidden=32, adapter_attn_dim=16)
    randomise_adapters(heads, seed=2)
    with torch.no_grad():  # round to the saved float16 values, as train.main does before saving
        for p in [*model.parameters(), *heads.parameters()]:
            p.copy_(p.half().float())
    train.save_model(model, tmp_path)
    train_exits.save_heads(heads, tmp_path, {"steps": 0})
    spec = read_spec(tmp_path)
    assert spec.weights_fingerprint and spec.recommended_threshold is None
    assert spec.calibration == {"joint_training": {"steps": 0}} and spec.confidence_query_dim > 0

    engine = Engine.load(tmp_path, device="cpu")
    tower = engine.backend.model.vision_tower
    assert engine.backend.model.exit_heads is not None  # fingerprint matched: heads in use
    px = train.TrainBatches(seed=0, batch_size=1)[2]["pixel_values"].float()
    with torch.no_grad():
        feats = model.model.vision_tower(pixel_values=px, interpolate_pos_encoding=True, output_hidden_states=True)
        want = model.model.multi_modal_projector(heads.adapt(1, feats.hidden_states[1])[:, 1:])
        got, info = encode_adaptive(tower, px, exit_heads=engine.backend.model.exit_heads, exit_layer=1)
        full, _ = encode_adaptive(tower, px)
    assert info.exit_layers == [1]
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert (full - got).abs().max() > 1e-3  # the exit path really differs from the full encoder


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--exit-init", "{tmp}"], "--exit-init needs --exit-blocks"),
        (["--exit-blocks", "1", "--exit-init", "{tmp}"], "no exits.json there"),
        (["--init", "{tmp}/missing"], "not a model folder"),
        (["--exit-blocks", "1", "--exit-weight", "-1"], "--exit-weight must be >= 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--exit-blocks", "5"], "exit blocks must be ascending, distinct, within 1..1"),  # tiny: 2 blocks
        (["--exit-blocks", "1", "1"], "exit blocks must be ascending"),
    ],
)
def test_training_option_errors_are_one_line(tmp_path, capsys, args, needle):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = train.main(["--out", str(tmp_path / "out"), "--tiny", "--steps", "1", "--batch-size", "2", "--eval-n", "2",
                       "--workers", "1", "--checkpoint-every", "0", *args])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgevlm: error:") and needle in err[-1], err
    assert not (tmp_path / "out").exists()  # nothing written
