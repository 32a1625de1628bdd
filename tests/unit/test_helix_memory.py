"""helix.memory: the part model's bookkeeping (its bytes are held to the training loop's meter
by the end-to-end tests)."""
import pytest

from helix.memory import HelixMemory, HelixShape, planned_peaks, weight_holders
from helix.schedule import HelixFlow, planned_helix
from megatron.plugin.pipeline.ir import Kind

SHAPE = dict(tokens=1024, sequence_parallel_tokens=1024, hidden=64, attention=64, mlp_first=256,
             mlp_second=256, qkv=192, heads=4, vocab=384, element_bytes=4, mask_bytes=4,
             norm_statistics=2, norm_normalized=False, norm_weight=False, position_ids=True,
             rope_dim=0, qkv_bias=True, recompute=False,
             mlp_chunk_rows=None)


def test_a_local_weight_is_charged_once_per_loop_and_layer():
    pp, layers, microbatches, folds = 2, 4, 8, 2
    flow = HelixFlow(pp, layers, folds, microbatches)
    schedule = planned_helix(pp, layers, microbatches, folds)
    holders = weight_holders(schedule, flow)
    # Two loops of four; slot 1 (two folds) attends on its boundaries' stages.
    assert len(holders) == 2 * layers
    memory = HelixMemory(HelixShape(**SHAPE), flow, holders)
    local = [a for row in schedule for a in row if a.kind is Kind.ATTN_F
             and flow.attention_stage(int(a.part[2:]), a.unit) == int(a.part[2:]) % pp]
    charged = {a: memory.activation_bytes(a) for a in local}
    assert len(set(charged.values())) == 2
    assert all((charged[a] > min(charged.values())) == ((a.stage, a.unit, int(a.part[2:]))
                                                         in holders) for a in local)


def test_recomputation_and_chunked_mlps_lower_every_stage_peak():
    plain = planned_peaks(HelixShape(**SHAPE), 2, 4, 4, 2, False)
    recomputed = planned_peaks(HelixShape(**{**SHAPE, "recompute": True}), 2, 4, 4, 2, True)
    chunked = planned_peaks(HelixShape(**{**SHAPE, "mlp_chunk_rows": 256}), 2, 4, 4, 2, False)
    assert all(r < p and c < p for p, r, c in zip(plain, recomputed, chunked))


def test_a_mixture_of_experts_mlp_keeps_the_cost_models_bytes_instead_of_the_dense_ones():
    """With experts, the MLP block keeps the cost model's per-token MoE bytes (exact against
    the meter in tests/unit/test_layer_costs.py) in place of the dense first and second
    widths."""
    from longctx.cost_model import mlp_saved_per_token
    from longctx.models import ModelConfig

    experts = mlp_saved_per_token(ModelConfig("moe", 4, 64, 4, 256, 384, dtype="float32",
                                              num_experts=4, moe_router_topk=2,
                                              moe_ffn_hidden_size=128))
    flow = HelixFlow(2, 4, 2, 4)
    dense = HelixMemory(HelixShape(**SHAPE), flow)
    moe = HelixMemory(HelixShape(**SHAPE, moe_bytes=experts), flow)
    assert moe._mlp_block(1024) - dense._mlp_block(1024) == 1024 * (experts - (256 + 256) * 4)


def test_qk_norms_keep_their_statistics_copies_and_weights():
    """With ``--qk-layernorm`` an attention keeps, per token and Q or K head (8 rows here), the
    norm's FP32 statistics and the normed output (no RoPE: the attention saves it); with RoPE
    the rotated copies it saves are counted already; a composite RMSNorm also keeps its
    normalized input. A received copy carries the norms' weights (and LayerNorm's biases).
    The bytes are held to the training loop's meter by
    ``tests/e2e/test_pretrain.py::test_helix_recomputation_draws_the_dropout_masks_of_the_forward``."""
    flow = HelixFlow(2, 4, 2, 4)
    attention = [a for row in planned_helix(2, 4, 4, 2) for a in row if a.kind is Kind.ATTN_F]
    plain = HelixMemory(HelixShape(**SHAPE), flow)
    variants = {
        "layernorm": ({}, 1024 * 8 * (2 * 4 + 16 * 4)),
        "layernorm_rope": ({"rope_dim": 16}, 1024 * 8 * 2 * 4),
        "rmsnorm_cpu": ({"norm_statistics": 1, "norm_normalized": True},
                        1024 * 8 * (4 + 2 * 16 * 4))}
    for name, (changes, expected) in variants.items():
        shape = {**SHAPE, **changes}
        without = HelixMemory(HelixShape(**shape), flow)
        normed = HelixMemory(HelixShape(**shape, qk_norm_rows=8), flow)
        assert normed._qk_norm() == expected, name
        weights = 2 * 16 * (1 if shape["norm_statistics"] == 1 else 2) * 4
        assert normed._weight() - without._weight() == weights, name
        for action in attention:
            assert normed.activation_bytes(action) - without.activation_bytes(action) in (
                expected, expected + weights), (name, action)
    recomputing = HelixMemory(HelixShape(**{**SHAPE, "recompute": True}, qk_norm_rows=8), flow)
    backward = next(a for row in planned_helix(2, 4, 4, 2, True) for a in row
                    if a.kind is Kind.ATTN_B)
    assert recomputing.workspace_bytes(backward) == recomputing._qkv() + 1024 * 8 * 72
    assert plain._qk_norm() == 0


def test_a_priced_models_shape_is_the_one_a_run_of_it_reads():
    """helix.memory.model_shape (the simulator's models) against helix_shape (what a training
    run reads from megatron-core's config and Megatron's arguments): GPT-3B at TP 8 with
    sequence parallelism, on CUDA, with dropout and learned positions, then with RoPE."""
    import dataclasses
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer import TransformerConfig

    from helix.memory import helix_shape, model_shape
    from longctx.models import ModelConfig

    model = ModelConfig("gpt-3b", 16, 4096, 32, 16384, 50304, hidden_dropout=True)
    config = TransformerConfig(num_layers=16, hidden_size=4096, num_attention_heads=32,
                               ffn_hidden_size=16384, tensor_model_parallel_size=8,
                               sequence_parallel=True, params_dtype=torch.bfloat16,
                               hidden_dropout=0.1, add_bias_linear=True)
    for learned in (True, False):
        args = SimpleNamespace(
            seq_length=131072, micro_batch_size=1, padded_vocab_size=50304,
            position_embedding_type="learned_absolute" if learned else "rope",
            rotary_percent=1.0, helix_mlp_chunk_size=None,
            helix_recompute_without_attention=True)
        priced = dataclasses.replace(model, learned_positions=learned)
        assert model_shape(priced, 131072, 8, recompute=True) == \
            helix_shape(config, args, "cuda")


def test_a_priced_model_with_what_its_shape_does_not_read_is_refused():
    """Q/K norms and the attention output gate add bytes model_shape has no field for: it
    names them instead of pricing the model without them."""
    import dataclasses

    from helix.memory import model_shape
    from longctx.models import ModelConfig

    model = ModelConfig("gpt-3b", 16, 4096, 32, 16384, 50304)
    for flags, named in (({"qk_layernorm": True}, "qk_layernorm"),
                         ({"qk_layernorm": True, "attention_output_gate": True},
                          "qk_layernorm, attention_output_gate")):
        with pytest.raises(ValueError, match=f"does not read {named};"):
            model_shape(dataclasses.replace(model, **flags), 131072, 8, recompute=True)
