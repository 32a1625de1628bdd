"""The cost model's layer terms beyond the dense GPT layer (a mixture of experts, the Q and K
norms): by hand, and against the saved-tensor meter on Megatron's own layers."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from longctx.chunks import Chunk, Piece
from longctx.cost_model import (CostModel, ParallelConfig, layer_saved_per_token,
                                mlp_saved_per_token, qk_norm_saved_per_token)
from longctx.models import ModelConfig
from test_elastic_cost_model import hand_profile

H, HEADS, FFN, EXPERTS, TOPK, EXPERT_FFN = 64, 4, 256, 4, 2, 128
SHARED = 96


def moe(**over) -> ModelConfig:
    shape = dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN)
    shape.update(over)
    return ModelConfig("moe", 6, H, HEADS, FFN, 100, **shape)


@pytest.mark.parametrize("gated", [False, True])
def test_moe_activation_bytes_time_and_weights_by_hand(tmp_path, gated):
    """BF16, 4 experts of width 128, top 2, Ulysses sp = 2. Per token the MLP keeps, instead of
    a dense MLP's ``f + w``: 2 permuted copies of the token (2 x 64), per copy the expert's
    first projection and its fc2 input (GeLU: 128 + 128 and the GeLU output 128; SwiGLU:
    256 + 128), all 2 bytes; the router's top-2 softmax in FP32 (8 bytes), its per-expert
    copy (2) and the [tokens, 4] probabilities (4), 2 bytes each, the bool routing map (4
    bytes) and two int64 index arrays of 2 (32 bytes)."""
    model = moe(gated_mlp=gated)
    cost = CostModel(model, hand_profile(tmp_path), ParallelConfig(pp=2, sp=2))
    mlp = 2 * 2 * (64 + 384) + 8 + 2 * (2 + 4) + 4 + 32
    assert mlp_saved_per_token(model) == mlp
    whole = Chunk((Piece(0, 0, 0, 10, True),))
    assert cost.layer_activation(whole) == pytest.approx(10 * (2 * 8 * H + 16 + 4 * HEADS + mlp) / 2)
    # GEMMs: attention 4h^2, the router h E, 2 experts of h w_e + h F each.
    first = 256 if gated else 128
    flops = 2 * (4 * H * H + H * EXPERTS + TOPK * (H * first + H * EXPERT_FFN))
    assert cost.alpha2 == pytest.approx(flops / (2 * 0.5e12))
    assert model.params_per_layer() == 4 * H * H + 4 * H + H * EXPERTS \
        + EXPERTS * H * (first + EXPERT_FFN) + 4 * H


@pytest.mark.parametrize("gated,gate", [(False, False), (True, True)])
def test_a_shared_expert_by_hand(tmp_path, gated, gate):
    """A shared expert of width 96 beside the routed ones, FP32 at sp = 1: it keeps what a dense
    MLP of that width keeps (GeLU: its first projection 96 and the GeLU output 96; SwiGLU: 192
    and 96), with the gate also its output (64) and the gate's sigmoid (1), 4 bytes each; its
    GEMMs h w_s + h S (+ h for the gate) per token; its weights the same (no biases)."""
    plain = moe(gated_mlp=gated, dtype="float32")
    model = moe(gated_mlp=gated, dtype="float32", moe_shared_expert_intermediate_size=SHARED,
                moe_shared_expert_gate=gate)
    width = 2 * SHARED if gated else SHARED
    extra = width + SHARED + (H + 1 if gate else 0)
    assert mlp_saved_per_token(model) - mlp_saved_per_token(plain) == 4 * extra
    weights = H * (width + SHARED) + (H if gate else 0)
    assert model.params_per_layer() - plain.params_per_layer() == weights
    plain_cost = CostModel(plain, hand_profile(tmp_path), ParallelConfig(pp=2))
    cost = CostModel(model, hand_profile(tmp_path), ParallelConfig(pp=2))
    assert cost.alpha2 - plain_cost.alpha2 == pytest.approx(2 * weights / 0.5e12)
    assert model.mlp_label == "4 experts, top 2, width 128, shared width 96" + (
        " gated" if gate else "")


def test_the_router_dtype_sizes_the_routers_logits_and_probabilities():
    """BF16, top 2 of 4 experts, the router in FP32: its per-expert copy of the top-2 weights
    (2) and the [tokens, 4] probabilities (4) take 4 bytes an element, not 2."""
    plain = moe(dtype="bfloat16")
    assert mlp_saved_per_token(moe(dtype="bfloat16", moe_router_dtype="fp32")) \
        - mlp_saved_per_token(plain) == (4 - 2) * (2 + 4)
    assert moe(moe_router_dtype="fp64").mlp_label == "4 experts, top 2, width 128, router fp64"


def test_the_expert_width_defaults_to_the_ffn_width_as_megatron_does():
    assert moe(moe_ffn_hidden_size=None).expert_ffn == FFN
    dense = ModelConfig("dense", 6, H, HEADS, FFN, 100)
    assert mlp_saved_per_token(dense) == 2 * 2 * FFN


@pytest.mark.parametrize("over, message", [
    ({"moe_router_topk": 5}, r"moe_router_topk must be in \[1, num_experts=4\], got 5"),
    ({"moe_router_topk": 0}, r"moe_router_topk must be in \[1, num_experts=4\], got 0"),
    ({"num_experts": -1}, "num_experts must be >= 0"),
    ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size must be >= 1"),
    ({"moe_shared_expert_intermediate_size": 0},
     "moe_shared_expert_intermediate_size must be >= 1 beside num_experts >= 1, got 0"),
    ({"num_experts": 0, "moe_shared_expert_intermediate_size": 8},
     "moe_shared_expert_intermediate_size must be >= 1 beside num_experts >= 1"),
    ({"moe_shared_expert_gate": True}, "give moe_shared_expert_intermediate_size too"),
    ({"moe_router_dtype": "bf16"}, "moe_router_dtype must be one of fp32, fp64 or None"),
])
def test_a_bad_moe_shape_says_what_to_change(over, message):
    with pytest.raises(ValueError, match=message):
        moe(**over)


def saved_bytes_per_token(config, num_experts, qk_layernorm=False) -> float:
    """Slope over 128 -> 256 tokens of what one layer of the project's spec saves."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron.plugin.layers.attention import document_layer_spec
    from megatron.plugin.layers.memory import SavedTensorMeter

    spec = document_layer_spec(1, num_experts=num_experts,
                               qk_layernorm=qk_layernorm).layer_specs[0]
    layer = build_module(spec, config=config, layer_number=1).train()
    counts = []
    for tokens in (128, 256):
        x = torch.randn(tokens, 1, config.hidden_size, dtype=config.params_dtype,
                        requires_grad=True)
        meter = SavedTensorMeter()
        with meter.active():
            out, _ = layer(x, attention_mask=None)
            counts.append(meter.current)
        del out
    return (counts[1] - counts[0]) / 128


@pytest.mark.parametrize("gated,dtype,shared,gate,router", [
    (False, torch.float32, None, False, None), (True, torch.float32, None, False, None),
    (False, torch.bfloat16, None, False, None), (True, torch.float32, SHARED, True, None),
    (False, torch.float32, SHARED, True, "fp64"), (True, torch.bfloat16, SHARED, False, None),
    (True, torch.bfloat16, None, False, "fp32")])
def test_the_moe_terms_are_what_megatrons_moe_layer_saves(one_rank, gated, dtype, shared,
                                                          gate, router):
    """Megatron's MoE layer (local spec: ``SequentialMLP``, the ``allgather`` dispatcher,
    softmax top-2 routing, no biases, the activation fusion Megatron-LM's parser sets: SwiGLU's
    on, GeLU's off without biases; with a shared expert, gated or not; with the router in
    another dtype than the model's) saves, per token, exactly the cost model's MoE terms more
    than the dense layer of the same attention saves its dense MLP terms; in BF16 too (the
    router's softmax stays FP32)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu,
                  bias_activation_fusion=gated, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    dense = TransformerConfig(**common)
    experts = TransformerConfig(**common, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                                moe_ffn_hidden_size=EXPERT_FFN, moe_aux_loss_coeff=0.0,
                                moe_shared_expert_intermediate_size=shared,
                                moe_shared_expert_gate=gate, moe_router_dtype=router)
    measured = saved_bytes_per_token(experts, EXPERTS) - saved_bytes_per_token(dense, None)
    shape = dict(dtype=str(dtype).removeprefix("torch."), gated_mlp=gated)
    planned = mlp_saved_per_token(moe(**shape, moe_shared_expert_intermediate_size=shared,
                                      moe_shared_expert_gate=gate,
                                      moe_router_dtype=router)) \
        - mlp_saved_per_token(ModelConfig("dense", 6, H, HEADS, FFN, 100, **shape))
    assert measured == planned


def test_a_profile_measured_on_one_mlp_prices_no_other(tmp_path):
    """Fitted times and counted bytes carry the MLP they were measured on (profile_costs.py
    stamps it): a dense layer's are refused for an MoE model, and an MoE layer's for another
    expert shape; profiles written before the stamp were dense."""
    fit = {"alpha1": 1e-9, "alpha2": 1e-6, "beta": 1e-3, "hidden_size": H, "sp": 1, "tp": 1}
    counted = {"layer": 9000.0, "checkpointed": 256.0, "kv": 512.0, "dkv": 512.0,
               "embedding": 16.0, "head": 2000.0, "hidden_size": H, "vocab_size": 100,
               "sp": 1, "tp": 1, "dtype": "bfloat16"}
    label = moe().mlp_label
    assert label == "4 experts, top 2, width 128"
    whole = Chunk((Piece(0, 0, 0, 10, True),))
    for key, values in (("layer_coefficients", fit), ("activation_coefficients", counted)):
        dense = hand_profile(tmp_path, source="measured", machine="box", **{key: values})
        CostModel(ModelConfig("dense", 6, H, HEADS, FFN, 100), dense, ParallelConfig(pp=2))
        with pytest.raises(ValueError, match=f"a dense MLP, not {label}; profile this model"):
            CostModel(moe(), dense, ParallelConfig(pp=2))
        stamped = hand_profile(tmp_path, source="measured", machine="box",
                               **{key: dict(values, mlp=label)})
        cost = CostModel(moe(), stamped, ParallelConfig(pp=2))
        with pytest.raises(ValueError, match=f"a {label} MLP, not 4 experts, top 1"):
            CostModel(moe(moe_router_topk=1), stamped, ParallelConfig(pp=2))
    assert cost.layer_activation(whole) == 90000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_qk_norm_term_is_what_the_q_and_k_layernorms_save(one_rank, dtype):
    """``--qk-layernorm`` (LayerNorm): a layer saves exactly the cost model's Q/K-norm term more
    than the same layer without the norms, in FP32 and BF16 (the statistics stay FP32)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16)
    measured = saved_bytes_per_token(TransformerConfig(**common, qk_layernorm=True), None, True) \
        - saved_bytes_per_token(TransformerConfig(**common), None)
    shape = dict(dtype=str(dtype).removeprefix("torch."))
    assert measured == qk_norm_saved_per_token(
        ModelConfig("qk", 6, H, HEADS, FFN, 100, qk_layernorm=True, **shape))
    assert qk_norm_saved_per_token(ModelConfig("plain", 6, H, HEADS, FFN, 100, **shape)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dropout_term_is_what_the_hidden_dropouts_save_on_this_device(one_rank, tmp_path,
                                                                          dtype):
    """Megatron's default ``--hidden-dropout 0.1``: a layer saves exactly the cost model's two
    masks more than without dropout, at the bytes per element of the device it runs on (a
    CPU keeps the scaled noise in the layer's dtype; CUDA a one-byte mask)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    measured = saved_bytes_per_token(TransformerConfig(**common, hidden_dropout=0.1), None) \
        - saved_bytes_per_token(TransformerConfig(**common, hidden_dropout=0.0), None)
    shape = dict(dtype=str(dtype).removeprefix("torch."), dropout_mask_bytes=dtype.itemsize)
    cost = CostModel(ModelConfig("dropout", 6, H, HEADS, FFN, 100, hidden_dropout=True, **shape),
                     hand_profile(tmp_path), ParallelConfig(pp=2))
    plain = CostModel(ModelConfig("plain", 6, H, HEADS, FFN, 100, **shape),
                      hand_profile(tmp_path), ParallelConfig(pp=2))
    assert measured == cost.full_per_token - plain.full_per_token == 2 * H * dtype.itemsize


#: Megatron-LM's Llama-style architecture flags (``--position-embedding-type rope
#: --normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2
#: --disable-bias-linear``).
LLAMA = ("rope", "rmsnorm", "swiglu", "gqa", "no-bias")


def architecture(flags, dtype, dropout):
    """The ``TransformerConfig`` keywords, the ``GPTModel`` position embedding, the RoPE
    settings and the :class:`ModelConfig` of a one-layer model with the architecture
    ``flags`` (names of Megatron-LM's flags, as Megatron's parser translates them: ``--swiglu``
    is a gated SiLU MLP with the fused bias-SwiGLU), on this CPU."""
    from megatron.plugin.layers.attention import RopeSettings

    groups = 2 if "gqa" in flags else 1 if "mqa" in flags else None
    config = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  hidden_dropout=dropout, attention_dropout=dropout, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16,
                  normalization="RMSNorm" if "rmsnorm" in flags else "LayerNorm",
                  num_query_groups=groups, qk_layernorm="qk-norm" in flags,
                  add_bias_linear="no-bias" not in flags)
    if "swiglu" in flags:
        config.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True)
    rope = "rope" in flags
    shape = ModelConfig("one", 1, H, HEADS, FFN, 384, dtype=str(dtype).removeprefix("torch."),
                        hidden_dropout=dropout > 0, dropout_mask_bytes=dtype.itemsize,
                        learned_positions=not rope, rope=rope, gated_mlp="swiglu" in flags,
                        normalization=config["normalization"], fused_norms=False,
                        num_query_groups=groups, qk_layernorm="qk-norm" in flags)
    return config, "none" if rope else "learned_absolute", RopeSettings() if rope else None, shape


def whole_model_bytes(tmp_path, flags, dtype, dropout, device) -> tuple[float, float]:
    """(measured, planned) bytes per token of a one-layer model's training micro-batch on
    ``device``: the saved-tensor meter's slope over 128 -> 256 tokens, and the cost model's
    one-stage stash of that architecture (:func:`architecture`; CUDA's fused norms and
    one-byte dropout masks there)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.plugin.batches import forward_step, micro_batch, pack_row
    from megatron.plugin.layers.attention import document_layer_spec
    from megatron.plugin.layers.memory import SavedTensorMeter

    config, positions, rope, shape = architecture(flags, dtype, dropout)
    config = TransformerConfig(**config)
    spec = document_layer_spec(1, config.normalization, rope, qk_layernorm=config.qk_layernorm)
    model = GPTModel(config, spec, vocab_size=384, max_sequence_length=256,
                     position_embedding_type=positions).to(device, dtype).train()
    if device == "cuda":
        shape = dataclasses.replace(shape, fused_norms=True, dropout_mask_bytes=1)
    generator = torch.Generator().manual_seed(1)
    counts = []
    for tokens in (128, 256):
        doc = torch.randint(0, 257, (tokens + 1,), generator=generator).numpy()
        meter = SavedTensorMeter()
        with meter.active():
            output, loss = forward_step(iter([micro_batch([pack_row([doc])])]), model)
            kept = loss(output)
            counts.append(meter.current)
        del output, kept
    cost = CostModel(shape, hand_profile(tmp_path), ParallelConfig(pp=1))
    one_token = Chunk((Piece(0, 0, 0, 1, True),))
    return (counts[1] - counts[0]) / 128, cost.stash_bytes(0, one_token)


@pytest.mark.parametrize("dtype,dropout,flags", [
    (torch.float32, 0.0, ()), (torch.float32, 0.1, ()), (torch.bfloat16, 0.1, ()),
    (torch.float32, 0.0, ("rope",)), (torch.float32, 0.0, ("rmsnorm",)),
    (torch.float32, 0.0, ("swiglu",)), (torch.float32, 0.0, ("gqa",)),
    (torch.float32, 0.0, ("mqa",)), (torch.float32, 0.0, ("qk-norm",)),
    (torch.float32, 0.0, ("gqa", "qk-norm")), (torch.float32, 0.0, ("rmsnorm", "qk-norm")),
    (torch.float32, 0.0, ("rope", "gqa", "qk-norm")), (torch.float32, 0.1, LLAMA),
    (torch.float32, 0.0, ("mqa", "rmsnorm", "qk-norm", "rope")),
    (torch.bfloat16, 0.1, LLAMA), (torch.bfloat16, 0.0, (*LLAMA, "qk-norm"))],
    ids=lambda value: "-".join(value) or "gpt" if isinstance(value, tuple) else None)
def test_a_whole_model_saves_what_its_stage_is_priced(one_rank, tmp_path, dtype, dropout, flags):
    """A one-layer ``GPTModel`` of the project's spec (the vocab of 257 padded to 384), one
    training micro-batch with its loss, saves per token exactly what the cost model prices a
    one-stage pipeline's stash: the embedding's ids and dropout mask, the layer and the head's
    norm, output-layer input, FP32 logits, targets and masks; with Megatron's default dropout
    and without, in FP32 and BF16 (slope over 128 -> 256 tokens, which drops the loss scalar);
    for GPT's architecture and for each of Megatron-LM's Llama-style flags alone and together
    (RoPE's tables and rotated queries and keys, the composite RMSNorm's FP32 copies, SwiGLU's
    first projection, grouped and multi-query attention's projection output and query copy,
    the Q and K norms), each of which changes the bytes. The model counts LayerNorm's
    statistics in FP32, as CUDA's norms keep them; a CPU keeps them in BF16 for a BF16 model,
    2 x 2 bytes fewer for each of the three norms."""
    measured, planned = whole_model_bytes(tmp_path, flags, dtype, dropout, "cpu")
    layer_norm = "rmsnorm" not in flags
    cpu_statistics = 3 * 2 * (4 - dtype.itemsize) if dtype.itemsize < 4 and layer_norm else 0
    assert measured == planned - cpu_statistics


@pytest.mark.parametrize("flags,rows", [(("rmsnorm",), 2), (("rmsnorm", "qk-norm"), 2 + 2 * HEADS),
                                        (("rmsnorm", "qk-norm", "gqa"), 2 + HEADS + 2)])
def test_a_fused_rmsnorm_keeps_its_input_and_one_fp32_statistic(flags, rows):
    """On CUDA the norms are fused kernels (torch's fused RMSNorm, Transformer Engine's): an
    RMSNorm keeps what LayerNorm keeps but one of its two FP32 statistics, 4 bytes fewer a
    row: the layer's two norms, the Q norm's per head and the K norm's per group; the
    composite RMSNorm of a CPU keeps more (its FP32 copies)."""
    for dtype in (torch.float32, torch.bfloat16):
        shape = architecture(flags, dtype, 0.0)[3]
        fused = dataclasses.replace(shape, fused_norms=True)
        layer_norm = dataclasses.replace(shape, normalization="LayerNorm")
        assert layer_saved_per_token(layer_norm) - layer_saved_per_token(fused) == 4 * rows
        assert layer_saved_per_token(shape) > layer_saved_per_token(fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused norms run on CUDA")
@pytest.mark.parametrize("flags", [("rmsnorm",), (*LLAMA, "qk-norm")])
def test_a_whole_model_on_cuda_saves_what_its_stage_is_priced(one_rank, tmp_path, flags):
    """The fused RMSNorm of CUDA (and its one-byte dropout masks) on the one-layer model of
    :func:`test_a_whole_model_saves_what_its_stage_is_priced`, in BF16."""
    measured, planned = whole_model_bytes(tmp_path, flags, torch.bfloat16, 0.1, "cuda")
    assert measured == planned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_output_gate_terms_are_what_megatrons_layer_saves(one_rank, dtype):
    """``--attention-output-gate``: Megatron's attention multiplies its output by the sigmoid
    of a gate the QKV projection computes, and the product keeps both operands, ``2h e`` per
    token (the meter on the project's layer with and without it), in BF16 too."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  params_dtype=dtype, bf16=dtype == torch.bfloat16)
    measured = saved_bytes_per_token(TransformerConfig(**common, attention_output_gate=True),
                                     None) - saved_bytes_per_token(TransformerConfig(**common),
                                                                   None)
    shape = dict(dtype=str(dtype).removeprefix("torch."))
    gated = ModelConfig("gated", 6, H, HEADS, FFN, 100, attention_output_gate=True, **shape)
    plain = ModelConfig("plain", 6, H, HEADS, FFN, 100, **shape)
    assert measured == layer_saved_per_token(gated) - layer_saved_per_token(plain) \
        == 2 * H * gated.element_bytes


def test_the_attention_output_gate_by_hand(tmp_path):
    """The gate's rows of the QKV projection: ``h^2 + h`` weights and ``h^2`` multiply-adds a
    token more."""
    gated = ModelConfig("gated", 6, H, HEADS, FFN, 100, attention_output_gate=True)
    plain = ModelConfig("plain", 6, H, HEADS, FFN, 100)
    assert gated.params_per_layer() - plain.params_per_layer() == H * H + H
    gated_cost = CostModel(gated, hand_profile(tmp_path), ParallelConfig(pp=2))
    plain_cost = CostModel(plain, hand_profile(tmp_path), ParallelConfig(pp=2))
    assert gated_cost.alpha2 - plain_cost.alpha2 == pytest.approx(2 * H * H / 0.5e12)


def checkpointed_model_bytes(tmp_path, count, final) -> tuple[tuple, tuple]:
    """((measured after the forward, after the recomputation), (planned the same)) bytes per
    token of a two-layer Llama-style ``GPTModel`` (Megatron's default dropout, FP32) whose
    leading ``count`` layers the runtime checkpoints (:class:`LeadingLayers`), on a whole
    document or (``final`` false) the first slice of a longer one, whose K/V the store keeps."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.plugin.batches import forward_step, micro_batch, pack_row
    from megatron.plugin.layers.attention import document_layer_spec
    from megatron.plugin.layers.kv_store import KVStore
    from megatron.plugin.layers.memory import SavedTensorMeter
    from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers

    config, positions, rope, shape = architecture(LLAMA, torch.float32, 0.1)
    config = TransformerConfig(**dict(config, num_layers=2))
    spec = document_layer_spec(2, config.normalization, rope)
    model = GPTModel(config, spec, vocab_size=384, max_sequence_length=256,
                     position_embedding_type=positions).train()
    layers = LeadingLayers(model)
    generator = torch.Generator().manual_seed(1)
    forward, recomputed = [], []
    for tokens in (128, 256):
        doc = torch.randint(0, 257, (tokens + 1,), generator=generator).numpy()
        row = pack_row([doc]) if final else pack_row([doc], slices=[("doc", 0, 0)],
                                                     doc_tokens=[2 * tokens])
        store, meter = KVStore(), SavedTensorMeter()
        with meter.active():
            with layers.armed(count):
                output, loss = forward_step(iter([micro_batch([row])]), model, kv_store=store,
                                            record_kv=not final)
            stash = layers.take()
            kept = loss(output)
            forward.append(meter.current)
            layers.recompute(stash)
            recomputed.append(meter.current)
        del output, kept, stash, store
    cost = CostModel(dataclasses.replace(shape, num_layers=2), hand_profile(tmp_path),
                     ParallelConfig(pp=1))
    one_token = Chunk((Piece(0, 0, 0, 1, final),))
    # the dK/dV sums of a slice come with a later slice's backward (none runs here)
    stash = cost.stash_bytes(0, one_token, count) - cost.gradient_sum_bytes(0, one_token)
    measured = tuple((after[1] - after[0]) / 128 for after in (forward, recomputed))
    return measured, (stash, stash + cost.checkpoint_saving(one_token, count))


@pytest.mark.parametrize("final", [True, False], ids=["whole", "first-slice"])
@pytest.mark.parametrize("count", [1, 2], ids=["block-1", "uniform"])
def test_a_checkpointed_range_keeps_what_its_stage_is_priced(one_rank, tmp_path, count, final):
    """Megatron's full recomputation as the runtime runs it (``--recompute-method block
    --recompute-num-layers 1``: the first layer; ``uniform``: both): after the forward a
    two-layer Llama-style model keeps per token exactly the stash the cost model prices, the
    range's input once (not one per checkpointed layer, Megatron's own keeping) beside the
    embedding's, the other layers', the head's and the checkpointed layers' K/V of a sliced
    document; after ``RECOMPUTE`` the whole stage's stash, the range rebuilt from that one
    input."""
    measured, planned = checkpointed_model_bytes(tmp_path, count, final)
    assert measured == planned
    one_token = Chunk((Piece(0, 0, 0, 1, final),))
    cost = CostModel(dataclasses.replace(architecture(LLAMA, torch.float32, 0.1)[3],
                                         num_layers=2), hand_profile(tmp_path),
                     ParallelConfig(pp=1))
    assert cost.stash_bytes(0, one_token, count, per_layer=True) - cost.stash_bytes(
        0, one_token, count) == (count - 1) * H * 4
