"""The shared decoder's per-family options and hooks against transformers' own causal LMs (fp32):
q/k/v bias (Qwen2), q/k norm (Qwen3), RoPE ``linear`` / ``llama3`` / ``dynamic`` (Llama), Mistral;
and the ``rope`` / ``rope_offset`` / ``layer_adds`` hooks of :meth:`Decoder.forward`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from edgevlm.errors import ModelLoadError  # noqa: E402
from edgevlm.runtime.config import parse_text_config  # noqa: E402
from edgevlm.runtime.decoder import Decoder, rope_cos_sin  # noqa: E402
from edgevlm.runtime.kernels import kernels_usable  # noqa: E402

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)

CASES = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 64}),
    "llama3": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "linear": (transformers.LlamaConfig, {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                              "factor": 2.0}}),
    "dynamic": (transformers.LlamaConfig, {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                               "factor": 2.0}}),
}


def _pair(case: str, seed: int = 0):
    cls, extra = CASES[case]
    hf_cfg = cls(**SIZES, **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # random biases / norm weights, so that a missing one shows
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(0.0, 0.5)
    cfg = parse_text_config(hf_cfg.to_dict())
    dec = Decoder(cfg)
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    dec.load_state_dict(state, strict=True)
    dec.eval()
    dec.setup_caches(2, 64)
    return hf, dec, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(case):
    hf, dec, cfg = _pair(case)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits  # (1, T, V)
        ours = dec(dec.embed_tokens(ids[:, :39]), torch.arange(39), prefill=True, all_logits=True)
        step = dec.decode_step(ids[:, 39:], torch.tensor([39]), 40)
    torch.testing.assert_close(ours, ref[:, :39], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, ref[:, 39], rtol=1e-4, atol=1e-4)
    if case == "qwen2":
        assert cfg.qkv_bias and not cfg.o_bias and dec.layers[0].self_attn.o_proj.bias is None
    if case == "qwen3":
        assert cfg.qk_norm and dec.layers[0].self_attn.q_norm.weight.shape == (16,)


def test_fused_projections_keep_bias_and_qk_norm():
    for case in ("qwen2", "qwen3"):
        _, dec, _ = _pair(case)
        ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ref = dec(dec.embed_tokens(ids), torch.arange(12), prefill=True, all_logits=True)
            assert dec.fuse_projections() == 4
            fused = dec(dec.embed_tokens(ids), torch.arange(12), prefill=True, all_logits=True)
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
        # fused projections (q/k norm and bias included) are all the Triton decode path needs
        assert dec.enable_fused_decode() is kernels_usable(torch.device("cpu"))


def test_rope_hooks():
    _, dec, _ = _pair("llama3")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = dec(dec.embed_tokens(ids), torch.arange(10), prefill=True, all_logits=True)
        ref_next = dec.decode_step(ids[:, :1], torch.tensor([10]), 11)
        # tables at positions 5..14 for slots 0..9: a constant shift, which RoPE does not see in prefill
        shifted = rope_cos_sin(dec.inv_freq, torch.arange(5, 15))
        out = dec(dec.embed_tokens(ids), torch.arange(10), prefill=True, all_logits=True, rope=shifted)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        # decoding at slot 10 with offset 5 reads RoPE position 15: the same relative distances
        nxt = dec.decode_step(ids[:, :1], torch.tensor([10]), 11, rope_offset=torch.tensor([5]))
        torch.testing.assert_close(nxt, ref_next, rtol=1e-4, atol=1e-4)
        wrong = dec.decode_step(ids[:, :1], torch.tensor([10]), 11, rope_offset=3)
        assert (wrong - ref_next).abs().max() > 50 * (nxt - ref_next).abs().max()


def test_layer_adds_add_features_after_the_layer():
    _, dec, _ = _pair("qwen3")
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, 2:5] = True
    feats = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = dec(dec.embed_tokens(ids), torch.arange(8), prefill=True, all_logits=True,
                  layer_adds=[(mask, feats)])
        x = dec.embed_tokens(ids)
        cos, sin = dec.rope_cos[:8], dec.rope_sin[:8]
        x = dec.layers[0](x, cos, sin, torch.arange(8), None)
        x[mask] += feats
        x = dec.layers[1](x, cos, sin, torch.arange(8), None)
        ref = dec.lm_head(dec.norm(x))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_limits_and_refusals():
    _, dec, _ = _pair("mistral")
    with pytest.raises(ValueError, match="sliding_window"):
        dec.setup_caches(1, 65)
    with pytest.raises(ModelLoadError, match="rope_type 'yarn' is not supported"):
        parse_text_config({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="low_freq_factor is required"):
        parse_text_config({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ModelLoadError, match="model_type 'gemma' is not supported"):
        parse_text_config({"model_type": "gemma"})
