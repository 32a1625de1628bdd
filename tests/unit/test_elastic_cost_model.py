"""Cost model formulas against hand-computed values; profiles and presets."""
import json

import pytest

from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig, stage_layers
from longctx.hardware import builtin_profiles, load_profile
from longctx.models import ModelConfig, get_model

TINY = ModelConfig("tiny", 6, 64, 4, 256, 100)


def hand_profile(tmp_path, **over):
    data = {"name": "hand", "source": "spec-derived", "peak_tflops": 1.0,
            "matmul_efficiency": 0.5, "attention_efficiency": 0.25, "layer_overhead_s": 0.001,
            "backward_factor": 2.0, "hbm_gb": 1.0, "intra_node_gbps": 1.0,
            "intra_node_latency_s": 1e-5, "inter_node_gbps": 0.5, "inter_node_latency_s": 2e-5,
            "gpus_per_node": 8}
    data.update(over)
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(data))
    return load_profile(str(path))


def test_forward_time_matches_eq1_by_hand(tmp_path):
    cost = CostModel(TINY, hand_profile(tmp_path), ParallelConfig(pp=2, sp=1))
    # alpha1 = 2h / (peak * attention efficiency) = 128 / 0.25e12; alpha2 = 2 (4h^2 + 2hf) /
    # (peak * matmul efficiency) = 2 * (16384 + 32768) / 0.5e12.
    alpha1, alpha2 = 128 / 0.25e12, 98304 / 0.5e12
    chunk = Chunk((Piece(0, 1, 100, 300, True), Piece(1, 0, 0, 50, True)))
    expected = alpha1 * ((100 + 200) ** 2 - 100 ** 2) + alpha2 * 200 \
        + alpha1 * 50 ** 2 + alpha2 * 50 + 0.001
    assert cost.layer_compute(chunk) == pytest.approx(expected, rel=1e-12)
    assert cost.layer_collectives(chunk) == 0.0
    assert cost.layer_backward(chunk) == pytest.approx(2 * expected, rel=1e-12)
    # stage 1 is the last: it adds the output layer, 2 h V FLOPs per token at matmul speed.
    head = 2 * 64 * 100 * 250 / 0.5e12
    assert cost.stage_forward(1, chunk) == pytest.approx(3 * expected + head, rel=1e-12)
    assert cost.stage_time(0, chunk, 2) == pytest.approx(3 * expected * 3 + 2 * expected,
                                                         rel=1e-12)


def test_ulysses_all_to_all_time_by_hand(tmp_path):
    cost = CostModel(TINY, hand_profile(tmp_path), ParallelConfig(pp=2, sp=4))
    chunk = Chunk((Piece(0, 0, 0, 400, True),))
    # four all-to-alls, each latency + (400 tokens * 64 * 2 bytes / 4) * 3/4 / 1 GB/s.
    expected = 4 * (1e-5 + 400 * 64 * 2 / 4 * 0.75 / 1e9)
    assert cost.layer_collectives(chunk) == pytest.approx(expected, rel=1e-12)
    # pp neighbours: 4 x 2 = 8 GPUs fit a node -> NVLink figures for the p2p too.
    assert cost.p2p_time(chunk) == pytest.approx(1e-5 + 400 * 64 * 2 / 4 / 1e9, rel=1e-12)


def test_activation_memory_by_hand(tmp_path):
    cost = CostModel(TINY, hand_profile(tmp_path), ParallelConfig(pp=2, sp=2))
    h, f = 64, 256
    head = Chunk((Piece(0, 0, 0, 10, False),))       # keeps K/V and an fp32 dK/dV sum
    whole = Chunk((Piece(1, 0, 0, 10, True),))
    # 8h + 2f elements of 2 bytes, the two norms' FP32 statistics (2 x 8 bytes) and the
    # softmax's log-sum-exp of 4 heads (4 x 4 bytes), over sp = 2
    full = (16 * h + 4 * f + 16 + 16) / 2
    assert cost.layer_activation(whole) == pytest.approx(10 * full)
    # the dK/dV accumulator: K and V, 4 bytes an element whatever the model's dtype.
    assert cost.layer_activation(head) == pytest.approx(10 * (full + 8 * h / 2))
    assert cost.layer_saving(whole) == pytest.approx(10 * (full - 2 * h / 2))
    # checkpointing keeps the layer's input and the K/V (the store's); the sum is not saved
    assert cost.layer_saving(head) == pytest.approx(10 * (full - 2 * h / 2 - 4 * h / 2))
    # stage 0 has 3 layers; checkpointing 2 of them keeps 1 full layer and the range's input
    # (Megatron's own recomputation: each checkpointed layer's, 2 inputs); its embedding keeps
    # the int64 token and position ids, 16 / sp bytes per token.
    assert cost.stash_bytes(0, whole, 2) == pytest.approx(10 * (full + h + 16 / 2))
    assert cost.stash_bytes(0, whole, 2, per_layer=True) == pytest.approx(
        10 * (full + 2 * h + 16 / 2))
    # last stage also keeps FP32 logits, 4 V / sp bytes per token, the final norm's input and
    # statistics and the output layer's input, (2 h e + 8) / sp, and the loss's int64
    # targets, bool target mask and FP32 loss mask, 13 / sp.
    head = (4 * 100 + 2 * h * 2 + 8 + 13) / 2
    assert cost.stash_bytes(1, whole) == pytest.approx(30 * full + 10 * head)


def test_an_fp32_model_prices_twice_the_activation_bytes_of_a_bf16_one(tmp_path):
    """Activations, K/V and what a stage sends are in the model's dtype whichever profile
    prices the time; the logits, the dK/dV sums of a split document and the norms' and
    softmax's statistics are FP32 in both, the embedding's ids and the loss's targets and
    masks the same in both."""
    profile = hand_profile(tmp_path)
    bf16, fp32 = (CostModel(ModelConfig("tiny", 6, 64, 4, 256, 100, dtype=dtype), profile,
                            ParallelConfig(pp=2, sp=2)) for dtype in ("bfloat16", "float32"))
    split, whole = Chunk((Piece(0, 0, 0, 10, False),)), Chunk((Piece(1, 0, 0, 10, True),))
    assert fp32.dkv_per_token == bf16.dkv_per_token == 4 * 2 * 64 / 2
    stats = 10 * (2 * 8 + 4 * 4) / 2  # per layer, 10 tokens over sp = 2
    ids = 10 * 16 / 2
    for chunk, sums in ((split, 10 * bf16.dkv_per_token), (whole, 0.0)):
        assert fp32.layer_activation(chunk) - sums - stats == pytest.approx(
            2 * (bf16.layer_activation(chunk) - sums - stats))
        assert fp32.layer_saving(chunk) - stats == pytest.approx(
            2 * (bf16.layer_saving(chunk) - stats))
        # stage 0 has 3 layers, each with its sum, one checkpointed, and the embedding's ids
        fixed = 3 * sums + 2 * stats + ids
        assert fp32.stash_bytes(0, chunk, 1) - fixed == pytest.approx(
            2 * (bf16.stash_bytes(0, chunk, 1) - fixed))
    fixed = 10 * (4 * 100 + 8 + 13) / 2 + 3 * stats
    assert fp32.stash_bytes(1, whole) - fixed == pytest.approx(
        2 * (bf16.stash_bytes(1, whole) - fixed))
    assert fp32.kv_per_token == 2 * bf16.kv_per_token == 4 * 2 * 64 / 2
    assert fp32.layer_compute(whole) == bf16.layer_compute(whole)
    # the bytes of the all-to-alls (four, 1e-5 s latency each) and of a send to the next stage
    assert fp32.layer_collectives(whole) - 4e-5 == pytest.approx(
        2 * (bf16.layer_collectives(whole) - 4e-5))
    assert fp32.p2p_time(whole) - 1e-5 == pytest.approx(2 * (bf16.p2p_time(whole) - 1e-5))
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        ModelConfig("tiny", 6, 64, 4, 256, 100, dtype="fp8")


def test_a_gated_mlp_prices_its_wide_first_projection(tmp_path):
    gated = ModelConfig("gated", 6, 64, 4, 256, 100, gated_mlp=True)
    cost = CostModel(gated, hand_profile(tmp_path), ParallelConfig(pp=2))
    h, f = 64, 256
    whole = Chunk((Piece(0, 0, 0, 10, True),))
    assert cost.layer_activation(whole) == pytest.approx(10 * (2 * (8 * h + 3 * f) + 16 + 16))
    assert cost.alpha2 == pytest.approx(2 * (4 * h * h + 3 * h * f) / 0.5e12)
    assert gated.params_per_layer() == 4 * h * h + 4 * h + 3 * h * f + 2 * f + h + 4 * h


def test_model_state_by_hand(tmp_path):
    parallel = ParallelConfig(pp=2, sp=2, memory_gb=1.0, reserved_gb=0.0)
    cost = CostModel(TINY, hand_profile(tmp_path), parallel)
    per_layer = 4 * 64 * 64 + 4 * 64 + 2 * 64 * 256 + 256 + 64 + 4 * 64
    params0 = 3 * per_layer + 100 * 64
    assert cost.static_bytes(0) == pytest.approx(params0 * (2 + 4 + 12 / 2))
    params1 = 3 * per_layer + 100 * 64 + 2 * 64
    assert cost.static_bytes(1) == pytest.approx(params1 * (2 + 4 + 12 / 2))
    assert cost.activation_budget(0) == pytest.approx(1e9 - cost.static_bytes(0))
    # FP32: 4-byte weights and gradients, no master copy, sharded Adam moments.
    fp32 = CostModel(ModelConfig("tiny", 6, 64, 4, 256, 100, dtype="float32"),
                     hand_profile(tmp_path), parallel)
    assert fp32.static_bytes(0) == pytest.approx(params0 * (4 + 4 + 8 / 2))


def test_stage_layers_put_the_remainder_on_late_stages():
    assert stage_layers(10, 4) == (2, 2, 3, 3)
    assert stage_layers(48, 4) == (12, 12, 12, 12)


def test_presets_and_profiles_exist_and_are_spec_derived():
    assert get_model("gpt-30b").num_layers == 48
    assert builtin_profiles() == ["a100", "a800", "h100", "h20", "h200"]
    for name in builtin_profiles():
        profile = load_profile(name)
        assert profile.source == "spec-derived"
        for figure in ("peak_tflops", "hbm_gb", "intra_node_gbps", "inter_node_gbps",
                       "gpus_per_node"):
            assert figure in profile.notes, (name, figure)
        assert profile.gpus_per_node == 8


def test_measured_profile_coefficients_are_used(tmp_path):
    fit = {"alpha1": 1e-9, "alpha2": 1e-6, "beta": 1e-3, "hidden_size": 64, "sp": 1, "tp": 1}
    profile = hand_profile(tmp_path, source="measured", layer_coefficients=fit,
                           machine="test box")
    cost = CostModel(TINY, profile, ParallelConfig(pp=2))
    chunk = Chunk((Piece(0, 0, 0, 100, True),))
    assert cost.layer_compute(chunk) == pytest.approx(1e-9 * 100 ** 2 + 1e-6 * 100 + 1e-3)
    with pytest.raises(ValueError, match="fitted for hidden 64, sp 1"):
        CostModel(TINY, profile, ParallelConfig(pp=2, sp=2))


@pytest.mark.parametrize("make, message", [
    (lambda: get_model("gpt-99b"), "valid: gpt-13b, gpt-30b, gpt-65b, gpt-7b"),
    (lambda: load_profile("tpu"), "valid: a100, a800, h100, h20"),
    (lambda: ParallelConfig(pp=0), "pp must be >= 1"),
    (lambda: CostModel(TINY, load_profile("a800"), ParallelConfig(pp=2, sp=8)),
     "not divisible by sp x tp"),
    (lambda: ModelConfig("odd", 2, 65, 4, 10, 10), "divisible by num_heads"),
])
def test_bad_configuration_says_what_to_change(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_measured_activation_bytes_are_used_only_in_their_dtype(tmp_path):
    counted = {"layer": 9000.0, "checkpointed": 256.0, "kv": 512.0, "dkv": 512.0,
               "embedding": 16.0, "head": 2000.0, "hidden_size": 64, "vocab_size": 100,
               "sp": 1, "tp": 1, "dtype": "float32"}
    profile = hand_profile(tmp_path, source="measured", activation_coefficients=counted,
                           machine="box")
    fp32 = ModelConfig("tiny", 6, 64, 4, 256, 100, dtype="float32")
    whole = Chunk((Piece(0, 0, 0, 10, True),))
    assert CostModel(fp32, profile, ParallelConfig(pp=2)).layer_activation(whole) == 90000.0
    with pytest.raises(ValueError, match="measured activations in float32, not bfloat16"):
        CostModel(TINY, profile, ParallelConfig(pp=2))
    del counted["dtype"]
    with pytest.raises(ValueError, match="incomplete profile .* 'dtype'"):
        hand_profile(tmp_path, source="measured", activation_coefficients=counted)


def test_measured_end_coefficients_price_embedding_and_head(tmp_path):
    ends = {"embedding_forward": [1e-7, 1e-4], "embedding_backward": [2e-7, 2e-4],
            "head_forward": [3e-6, 5e-4], "head_backward": [6e-6, 7e-4],
            "hidden_size": 64, "vocab_size": 100, "sp": 1, "tp": 1}
    profile = hand_profile(tmp_path, source="measured", end_coefficients=ends, machine="box")
    cost = CostModel(TINY, profile, ParallelConfig(pp=3))
    chunk = Chunk((Piece(0, 0, 0, 100, True),))
    layers = 2 * cost.layer_forward(chunk)
    assert cost.stage_forward(0, chunk) == pytest.approx(layers + 1e-7 * 100 + 1e-4)
    assert cost.stage_forward(1, chunk) == pytest.approx(layers)
    assert cost.stage_forward(2, chunk) == pytest.approx(layers + 3e-6 * 100 + 5e-4)
    backward = 2 * cost.layer_backward(chunk)
    assert cost.stage_backward(0, chunk) == pytest.approx(backward + 2e-7 * 100 + 2e-4)
    assert cost.stage_backward(2, chunk) == pytest.approx(backward + 6e-6 * 100 + 7e-4)
    with pytest.raises(ValueError, match="timed the embedding and head for hidden, vocab"):
        CostModel(ModelConfig("wide", 6, 64, 4, 256, 200), profile, ParallelConfig(pp=3))
    with pytest.raises(ValueError, match="two non-negative numbers"):
        hand_profile(tmp_path, source="measured",
                     end_coefficients=dict(ends, head_forward=[-1.0, 0.0]))
    with pytest.raises(ValueError, match="belong to a 'measured' profile"):
        hand_profile(tmp_path, end_coefficients=ends)


def test_chunk_costs_place_the_dkv_sums_at_the_first_later_slices_backward(tmp_path):
    """A document split in three slices (units 0, 1, 2; the last packed with a whole document):
    each forward stashes all but its slice's dK/dV sums; the backward of unit 2 creates the sums
    of units 0 and 1, the backward of unit 1 names unit 0, and a forward plus its sums equal
    the stash the planners bound with."""
    from longctx.chunk_costs import ChunkCosts
    from megatron.plugin.pipeline.ir import Action, Kind

    cost = CostModel(TINY, hand_profile(tmp_path), ParallelConfig(pp=2, sp=1))
    chunks = [Chunk((Piece(0, 0, 0, 10, False),)), Chunk((Piece(0, 1, 10, 30, False),)),
              Chunk((Piece(0, 2, 30, 40, True), Piece(1, 0, 0, 5, True)))]
    costs = ChunkCosts(cost, chunks, lambda stage, unit: 0)
    sums = [cost.gradient_sum_bytes(0, chunk) for chunk in chunks]
    assert sums == [3 * 10 * cost.dkv_per_token, 3 * 20 * cost.dkv_per_token, 0.0]
    for unit, chunk in enumerate(chunks):
        forward = costs.activation_bytes(Action(0, Kind.FORWARD, unit))
        assert forward + sums[unit] == pytest.approx(cost.stash_bytes(0, chunk))
    backward = [costs.gradient_sums(Action(0, Kind.BACKWARD, unit)) for unit in range(3)]
    assert backward == [(), ((0, sums[0]),), ((0, sums[0]), (1, sums[1]))]
