"""quantize_ (RTN, AWQ prepare/calibrate/convert), the group-size plan, AWQ folding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgevlm.quantize import Int4WeightOnlyConfig, awq, choose_group_size, format_plan, quantize_
from edgevlm.runtime.int4 import Int4Linear, fake_quantize_int4

AWQ_PREPARE = Int4WeightOnlyConfig(method="awq", step="prepare")
AWQ_CONVERT = Int4WeightOnlyConfig(method="awq", step="convert")


# ---------------------------------------------------------------------------------- plan rule
@pytest.mark.parametrize(
    "in_features, requested, expected",
    [(256, 128, 128), (192, 128, 64), (96, 128, 32), (4304, 128, None), (4304, 32, None), (192, 64, 64),
     (160, 64, 32), (1152, 128, 128)],
)
def test_choose_group_size(in_features, requested, expected):
    g, reason = choose_group_size(in_features, requested)
    assert g == expected
    if expected is None:
        assert "kept 16-bit" in reason and str(in_features) in reason
    elif expected != requested:
        assert f"group size {expected}" in reason


def test_choose_group_size_rejects_unsupported():
    with pytest.raises(ValueError, match="group_size must be one of"):
        choose_group_size(256, 256)


def _mlp(in_features: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, 64), nn.GELU(), nn.Linear(64, 32))


def test_rtn_plan_handles_4304_and_1_5x_group(caplog):
    model = nn.Module()
    model.siglip_fc2 = nn.Linear(4304, 32)  # SigLIP-so400m MLP input width
    model.odd = nn.Linear(192, 48)  # 1.5 x 128
    model.even = nn.Linear(256, 48)
    ref = {n: m.weight.detach().clone() for n, m in model.named_children()}
    with caplog.at_level("INFO", logger="edgevlm.quantize.api"):
        decisions = quantize_(model, Int4WeightOnlyConfig(group_size=128))
    by_name = {d.name: d for d in decisions}
    assert by_name["siglip_fc2"].action == "keep" and "4304" in by_name["siglip_fc2"].reason
    assert by_name["odd"].action == "int4" and by_name["odd"].group_size == 64
    assert by_name["even"].group_size == 128
    assert type(model.siglip_fc2) is nn.Linear and torch.equal(model.siglip_fc2.weight, ref["siglip_fc2"])
    assert isinstance(model.odd, Int4Linear) and model.odd.group_size == 64
    # the stored layer computes exactly the RTN fake-quantized weight of that group size
    x = torch.randn(5, 192)
    model.odd.kernel = "dequant"  # float32 path: exact up to float32 rounding
    y_ref = x.double() @ fake_quantize_int4(ref["odd"], 64).double().T + model.odd.bias.double()
    torch.testing.assert_close(model.odd(x).double(), y_ref, rtol=1e-5, atol=1e-5)
    assert "kept 16-bit" in caplog.text and "group size 64" in caplog.text
    table = format_plan(decisions)
    assert "siglip_fc2" in table and "16-bit" in table and "2 of 3 linear layers" in table


def test_filter_fn_limits_layers():
    model = _mlp(128)
    quantize_(model, Int4WeightOnlyConfig(group_size=64), filter_fn=lambda m, fqn: fqn == "0")
    assert isinstance(model[0], Int4Linear) and type(model[2]) is nn.Linear


# ---------------------------------------------------------------------------------- AWQ vs RTN
def _outlier_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    x[:, :: k // 8] *= 40.0  # a few salient input channels (LLM activation outliers)
    return x


def test_awq_beats_rtn_on_outlier_channels():
    torch.manual_seed(0)
    k, n = 512, 256
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    w = lin.weight.detach().clone()
    held_out = _outlier_inputs(512, k, seed=99)
    ref = held_out @ w.T

    rtn_model = nn.Sequential(nn.Linear(k, n, bias=False))
    rtn_model[0].weight.data.copy_(w)
    quantize_(rtn_model, Int4WeightOnlyConfig(group_size=128))

    awq_model = nn.Sequential(lin)
    quantize_(awq_model, AWQ_PREPARE)
    with torch.no_grad():
        for seed in range(4):
            awq_model(_outlier_inputs(256, k, seed))
    decisions = quantize_(awq_model, AWQ_CONVERT)

    def rel(m):
        with torch.no_grad():
            return ((m(held_out) - ref).pow(2).sum() / ref.pow(2).sum()).item()

    err_rtn, err_awq = rel(rtn_model), rel(awq_model)
    assert err_awq < 0.5 * err_rtn, (err_awq, err_rtn)
    d = decisions[0]
    assert d.awq_scale == "input_scale" and d.awq_alpha > 0  # a lone Linear: nothing to fold into
    assert d.rel_error < d.rel_error_rtn
    assert awq_model[0].input_scale is not None


class _Block(nn.Module):
    """A Llama decoder block on R's modules, run without a KV cache (prefill from 0)."""

    def __init__(self, kv_heads: int = 4):
        super().__init__()
        from edgevlm.runtime.config import TextConfig
        from edgevlm.runtime.decoder import DecoderLayer, rope_tables
        from edgevlm.runtime.kv_cache import KVCache

        self.cfg = TextConfig(vocab_size=10, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32)
        torch.manual_seed(0)
        self.layer = DecoderLayer(self.cfg)
        with torch.no_grad():
            for name, p in self.layer.named_parameters():
                p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, p.shape[-1] ** -0.5)
        self.layer.self_attn.kv_cache = KVCache(1, kv_heads, 64, 32, dtype=torch.float32, device="cpu")
        self.cos, self.sin = rope_tables(32, 64, 10000.0, "cpu")

    def forward(self, x):  # (1, T, 128)
        t = x.shape[1]
        return self.layer(x, self.cos[:t], self.sin[:t], torch.arange(t), None)


def test_scale_groups_follow_the_architecture():
    mha, gqa = _Block(kv_heads=4), _Block(kv_heads=2)
    names = [n for n, m in mha.named_modules() if type(m) is nn.Linear]
    groups = {tuple(g.linears): g.prev for g in awq.find_scale_groups(mha, names)}
    p = "layer."
    assert groups[(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")] == p + "input_layernorm"
    assert groups[(p + "mlp.gate_proj", p + "mlp.up_proj")] == p + "post_attention_layernorm"
    assert groups[(p + "self_attn.o_proj",)] == p + "self_attn.v_proj"
    assert groups[(p + "mlp.down_proj",)] == p + "mlp.up_proj"
    # grouped-query attention: v_proj (2 kv heads) cannot absorb o_proj's scales
    groups = {tuple(g.linears): g.prev for g in awq.find_scale_groups(gqa, names)}
    assert groups[(p + "self_attn.o_proj",)] is None


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_folding_is_exact_before_quantization(kv_heads):
    """Folding 1/s into producers and s into consumers leaves the float block's output unchanged."""
    block = _Block(kv_heads)
    x = torch.randn(1, 20, 128)
    with torch.no_grad():
        ref = block(x)
        names = [n for n, m in block.named_modules() if type(m) is nn.Linear]
        for grp in awq.find_scale_groups(block, names):
            k = block.get_submodule(grp.linears[0]).in_features
            s = torch.rand(k) * 3 + 0.2
            for n in grp.linears:
                block.get_submodule(n).weight.mul_(s)
            if grp.prev is None:  # emulate an explicit input scale with a pre-hook
                block.get_submodule(grp.linears[0]).register_forward_pre_hook(
                    lambda m, a, s=s: (a[0] / s,))
            else:
                awq.fold_scales(block, grp.prev, s)
        torch.testing.assert_close(block(x), ref, rtol=1e-4, atol=1e-4)


def test_awq_on_decoder_block_folds_and_beats_rtn():
    block, rtn_block = _Block(), _Block()
    calib = [torch.randn(1, 24, 128, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for c in calib:
        c[..., :4] *= 25.0  # outlier hidden channels, as in LLM residual streams
    x = torch.randn(1, 24, 128, generator=torch.Generator().manual_seed(100))
    x[..., :4] *= 25.0
    with torch.no_grad():
        ref = block(x)
    quantize_(block, AWQ_PREPARE)
    with torch.no_grad():
        for c in calib:
            block(c)
    decisions = quantize_(block, AWQ_CONVERT)
    quantize_(rtn_block, Int4WeightOnlyConfig())
    by_name = {d.name: d for d in decisions}
    assert all(d.action == "int4" for d in decisions) and len(decisions) == 7
    q = by_name["layer.self_attn.q_proj"]
    assert q.awq_scale in ("folded", "none")
    if q.awq_scale == "folded":
        assert q.awq_fold_into == "layer.input_layernorm"
    assert all(isinstance(block.get_submodule(n), Int4Linear) for n in by_name)
    assert all(block.get_submodule(n).input_scale is None for n in by_name)  # everything folded (MHA)
    with torch.no_grad():
        err_awq = (block(x) - ref).pow(2).mean().item()
        err_rtn = (rtn_block(x) - ref).pow(2).mean().item()
    assert err_awq < err_rtn, (err_awq, err_rtn)


# ---------------------------------------------------------------------------------- error paths
def test_awq_step_errors():
    model = _mlp(128)
    with pytest.raises(ValueError, match="two steps"):
        quantize_(model, Int4WeightOnlyConfig(method="awq"))
    with pytest.raises(ValueError, match="not prepared"):
        quantize_(model, AWQ_CONVERT)
    quantize_(model, AWQ_PREPARE)
    with pytest.raises(ValueError, match="already prepared"):
        quantize_(model, AWQ_PREPARE)
    with pytest.raises(RuntimeError, match="no calibration activations"):
        quantize_(model, AWQ_CONVERT)
    with torch.no_grad():  # still prepared: calibrating now lets convert succeed
        model(torch.randn(8, 128))
    quantize_(model, AWQ_CONVERT)
    assert isinstance(model[0], Int4Linear)


def test_config_errors():
    with pytest.raises(ValueError, match="only used with method='awq'"):
        quantize_(_mlp(128), Int4WeightOnlyConfig(step="prepare"))
    with pytest.raises(TypeError, match="Int4WeightOnlyConfig"):
        quantize_(_mlp(128), {"group_size": 128})
    with pytest.raises(ValueError):
        Int4WeightOnlyConfig(group_size=100)
    with pytest.raises(ValueError):
        Int4WeightOnlyConfig(grop_size=128)  # unknown field


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(), AWQ_PREPARE], ids=["rtn", "awq"])
def test_a_bare_linear_is_refused_not_left_unquantized(config):
    """quantize_(nn.Linear(256, 256), cfg) returned a plan saying "int4" for layer '' while the caller's layer
    stayed a plain nn.Linear (the Int4Linear was set as an attribute named '' on it): a silent no-op. Now it is
    refused naming the way out, the layer untouched; a wrapped layer is quantized; a non-module is a TypeError."""
    from edgevlm.errors import InvalidRequestError

    layer = nn.Linear(256, 256)
    weight = layer.weight.detach().clone()
    with pytest.raises(InvalidRequestError, match=r"model is itself an nn\.Linear: wrap it"):
        quantize_(layer, config)
    assert type(layer) is nn.Linear and torch.equal(layer.weight, weight) and "" not in layer._modules
    assert not any(name.startswith("_edgevlm") for name in layer.__dict__)  # not left prepared for AWQ either
    wrapped = nn.Sequential(layer)
    if config.method == "rtn":
        assert [d.action for d in quantize_(wrapped, config)] == ["int4"]
        assert isinstance(wrapped[0], Int4Linear)
    with pytest.raises(TypeError, match="^model must be a torch.nn.Module, got str$"):
        quantize_("model", config)


def test_reservoir_keeps_uniform_sample_and_full_mean():
    obs = awq.InputObserver(4, max_rows=50, seed=0)
    for i in range(20):
        obs(None, (torch.full((10, 4), float(i)),))
    assert obs.seen == 200 and obs.rows.shape == (50, 4)
    torch.testing.assert_close(obs.mean_abs, torch.full((4,), 9.5))
    batches = obs.rows[:, 0]
    assert batches.min() < 5 and batches.max() > 14  # not just the first 50 rows


def test_awq_folds_into_plain_rms_and_layer_norms_only():
    """The fold target is chosen by class, not by name: Gemma's unit-offset norm (``x_hat * (1 + w)``)
    is never folded into, a same-named stand-in neither; a weight of another width is not a target."""
    from edgevlm.runtime.decoder import RMSNorm, UnitOffsetNorm

    assert awq._is_norm(RMSNorm(8, 1e-6), 8)
    assert awq._is_norm(nn.LayerNorm(8), 8)
    assert not awq._is_norm(RMSNorm(8, 1e-6), 16)
    assert not awq._is_norm(UnitOffsetNorm(8, 1e-6), 8)
    assert not awq._is_norm(nn.LayerNorm(8, elementwise_affine=False), 8)

    class LookalikeRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    assert not awq._is_norm(LookalikeRMSNorm(), 8)
