"""MuP (``--use-mup``) in the project's layers: what Megatron's config derives reaches them."""
import pytest
import torch


@pytest.mark.parametrize("power,base_head_dim", [(1.0, None), (0.75, 4.0)])
def test_the_document_attention_attends_at_mups_scale(one_rank, power, base_head_dim):
    """Megatron's config sets ``softmax_scale`` to ``sqrt(base_head_dim) / kv_channels **
    power`` under MuP (1 / kv_channels by default, not its square root); the layer built from
    the project's spec hands it to the document attention, which attends with it."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.plugin.layers.attention import document_layer_spec

    heads, dim = 4, 8
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               attention_dropout=0.0, hidden_dropout=0.0, use_mup=True,
                               mup_base_hidden_size=16, mup_attn_scale_power=power,
                               mup_base_head_dim=base_head_dim)
    scale = (base_head_dim or 1.0) ** 0.5 / dim ** power
    assert config.softmax_scale == pytest.approx(scale)
    layer = build_module(document_layer_spec(1).layer_specs[0], config=config, layer_number=1)
    attention = layer.self_attention.core_attention
    assert attention.softmax_scale == config.softmax_scale

    generator = torch.Generator().manual_seed(0)
    tokens = 6
    q, k, v = (torch.randn(tokens, 1, heads, dim, generator=generator) for _ in range(3))
    got = attention(q, k, v, attention_mask=None)
    scores = torch.einsum("shd,thd->hst", q[:, 0], k[:, 0]) * scale
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    expected = torch.einsum("hst,thd->shd", weights, v[:, 0]).reshape(tokens, 1, heads * dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
