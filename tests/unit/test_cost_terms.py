"""Physical cost terms of a hardware profile, each against a hand calculation: node NICs shared
by the node's GPUs, a host link shared by the GPUs behind it, the allocator's overhead, and the
kernel efficiency of short chunks."""
import dataclasses

import pytest

from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import load_profile, profile_from_dict
from longctx.models import ModelConfig
from sppo_offload.costs import OffloadCosts
from megatron.plugin.pipeline.ir import Action, Kind

TINY = ModelConfig("tiny", 4, 64, 16, 256, 100)
HAND = {"name": "hand", "source": "spec-derived", "peak_tflops": 1.0,
        "matmul_efficiency": 0.5, "attention_efficiency": 0.25, "layer_overhead_s": 0.001,
        "backward_factor": 2.0, "hbm_gb": 1.0, "intra_node_gbps": 100.0,
        "intra_node_latency_s": 1e-5, "inter_node_gbps": 25.0, "inter_node_latency_s": 2e-5,
        "gpus_per_node": 8}


def profile(**over):
    return profile_from_dict(dict(HAND, **over))


def one_piece(tokens: int) -> Chunk:
    return Chunk((Piece(0, 0, 0, tokens, True),))


def test_node_nics_are_shared_by_the_node_gpus():
    assert profile().cross_node_gbps == 25.0  # no node figure: the GPU's own
    assert profile(node_nic_gbps=50.0).cross_node_gbps == 50.0 / 8  # 400 Gb/s a node
    assert profile(node_nic_gbps=400.0).cross_node_gbps == 25.0  # capped by the GPU's HCA
    # Ulysses over 16 GPUs (two nodes): four all-to-alls per layer, each latency + the
    # cross-node share of tokens h e / sp, 8 of its 16 peers' (the other 7 go over NVLink at
    # the same time and finish first: 7/16 / 100 GB/s < 8/16 / 6.25 GB/s).
    cost = CostModel(TINY, profile(node_nic_gbps=50.0), ParallelConfig(pp=1, sp=16))
    tokens = 4096
    bytes_ = tokens * 64 * TINY.element_bytes / 16 * 8 / 16
    expected = 4 * (2e-5 + bytes_ / (6.25 * GB))
    assert cost.layer_collectives(one_piece(tokens)) == pytest.approx(expected, rel=1e-12)
    inside = CostModel(TINY, profile(node_nic_gbps=50.0), ParallelConfig(pp=1, sp=8))
    expected = 4 * (1e-5 + tokens * 64 * TINY.element_bytes / 8 * 7 / 8 / (100 * GB))
    assert inside.layer_collectives(one_piece(tokens)) == pytest.approx(expected, rel=1e-12)


def test_a_host_link_is_shared_by_the_gpus_behind_it():
    assert profile(host_link_gbps=32.0).host_gbps_per_gpu == 32.0
    assert profile(host_link_gbps=32.0, gpus_per_host_link=2).host_gbps_per_gpu == 16.0
    assert profile().host_gbps_per_gpu is None
    with pytest.raises(ValueError, match="gpus_per_host_link must be in"):
        profile(gpus_per_host_link=9)


def test_the_allocator_overhead_is_charged_on_every_activation_byte():
    plain = CostModel(TINY, profile(), ParallelConfig(pp=2))
    cost = CostModel(TINY, profile(allocator_overhead=0.25), ParallelConfig(pp=2))
    chunk = Chunk((Piece(0, 0, 0, 300, False),))
    for name in ("layer_activation", "layer_saving"):
        assert getattr(cost, name)(chunk) == pytest.approx(1.25 * getattr(plain, name)(chunk))
    assert cost.stash_bytes(1, chunk, 1) == pytest.approx(1.25 * plain.stash_bytes(1, chunk, 1))
    assert cost.static_bytes(0) == plain.static_bytes(0)  # model state is not fragmented
    with pytest.raises(ValueError, match="allocator_overhead must be in"):
        profile(allocator_overhead=1.0)


def test_offload_copies_move_live_bytes():
    """An offload of device bytes (overhead included) copies the live bytes only: 1.25 GB of
    device memory at 25% overhead is 1 GB over a 16 GB/s share of the host link."""
    hardware = profile(allocator_overhead=0.25, host_link_gbps=32.0, gpus_per_host_link=2)
    cost = CostModel(TINY, hardware, ParallelConfig(pp=1))
    costs = OffloadCosts(cost, [one_piece(64)], [[1.25 * GB]], host_gbps=hardware.host_gbps_per_gpu)
    copy = Action(0, Kind.OFFLOAD, 0)
    assert costs.duration(copy) == pytest.approx(1.0 / 16.0)


def test_host_memory_and_multiplexed_transfers_count_live_bytes():
    """The host holds, and a link moves, live bytes: the allocator's overhead stays behind."""
    from sppo_offload.multiplex import MultiplexCosts
    from sppo_offload.offload import host_bytes

    model = ModelConfig("m", 4, 64, 16, 256, 100)
    plain = CostModel(model, profile(host_link_gbps=32.0), ParallelConfig(pp=2, tp=2))
    cost = CostModel(model, profile(host_link_gbps=32.0, allocator_overhead=0.25),
                     ParallelConfig(pp=2, tp=2))
    chunks = [Chunk((Piece(0, 0, 0, 512, False),)), Chunk((Piece(0, 1, 512, 1024, True),))]
    alphas = ((0.5, 0.0), (0.5, 0.0))
    assert host_bytes(cost, chunks, alphas) == pytest.approx(host_bytes(plain, chunks, alphas))
    lengths = [512, 512]
    assert MultiplexCosts(cost, lengths).kv_bytes(0) == pytest.approx(
        MultiplexCosts(plain, lengths).kv_bytes(0))


def test_the_planner_sets_the_largest_workspace_aside():
    """Under TP 2 the elastic planner's checkpointing budget of each stage loses its largest
    workspace over the chunks (memory units, rounded up; the last stage's is the larger of the
    layer's and the loss's), and the plan's peak bytes add it back."""
    from elastic_pipe import checkpointing

    cost = CostModel(TINY, profile(hbm_gb=1.0), ParallelConfig(pp=2, tp=2, memory_gb=1.0,
                                                               reserved_gb=0.0))
    chunks = [one_piece(4096), one_piece(1024)]
    events = [[(0, (0, 1)), (1, (1,))], [(0, (0,)), (1, (1,))]]
    problem = checkpointing.build_problem(cost, chunks, events)
    unit = problem.memory_unit
    workspace = [-(-cost.stage_workspace(p, chunks[0]) // unit) for p in (0, 1)]
    assert problem.workspace == tuple(workspace) and min(workspace) > 0
    assert problem.budget[0] == cost.activation_budget(0) // unit - workspace[0]
    peaks = checkpointing.memory_peaks(problem, checkpointing.full_table(problem))
    assert checkpointing.peak_bytes(cost, problem, peaks)[1] == pytest.approx(
        cost.static_bytes(1) + (peaks[1] + workspace[1]) * unit)


def test_kernel_efficiency_interpolates_in_log_tokens():
    hardware = profile(kernel_efficiency=[[1024, 0.5], [4096, 0.9]])
    assert hardware.efficiency(512) == 0.5  # held below the first point
    assert hardware.efficiency(2048) == pytest.approx(0.7)  # half way in log2
    assert hardware.efficiency(1 << 20) == 0.9  # held above the last
    assert profile().efficiency(16) == 1.0


def test_kernel_efficiency_slows_short_chunks_but_not_the_fixed_work():
    curve = [[256, 0.5], [4096, 1.0]]
    plain = CostModel(TINY, profile(), ParallelConfig(pp=1, sp=2))
    cost = CostModel(TINY, profile(kernel_efficiency=curve), ParallelConfig(pp=1, sp=2))
    short, long = one_piece(512), one_piece(8192)  # 256 and 4096 tokens a GPU
    assert cost.layer_compute(short) == pytest.approx(
        0.001 + (plain.layer_compute(short) - 0.001) / 0.5, rel=1e-12)
    assert cost.layer_compute(long) == pytest.approx(plain.layer_compute(long), rel=1e-12)


@pytest.mark.parametrize("points,message", [
    ([], "at least one point"),
    ([[4096, 0.9], [1024, 0.5]], "strictly increasing"),
    ([[1024, 1.5]], r"fractions must be in \(0, 1\]"),
    ([[1024]], r"must be \[\[tokens, fraction\]"),
])
def test_a_bad_efficiency_curve_is_refused(points, message):
    with pytest.raises(ValueError, match=message):
        profile(kernel_efficiency=points)


def test_a_measured_fit_and_an_efficiency_curve_are_refused_together():
    fit = {"alpha1": 1e-9, "alpha2": 1e-6, "beta": 1e-4, "hidden_size": 64, "sp": 1, "tp": 1}
    with pytest.raises(ValueError, match="prices the chunk size itself"):
        profile(source="measured", layer_coefficients=fit, kernel_efficiency=[[1024, 0.5]])


def test_shipped_profiles_say_where_each_physical_term_comes_from():
    for name in ("a100", "a800", "h100", "h20"):
        hardware = load_profile(name)
        for term in ("node_nic_gbps", "gpus_per_host_link", "allocator_overhead",
                     "kernel_efficiency"):
            assert term in hardware.notes, (name, term)
        assert dataclasses.replace(hardware).cross_node_gbps <= hardware.inter_node_gbps


def test_tensor_parallel_workspace_is_two_full_sequence_buffers():
    """TP 4 with sequence parallelism: a column-parallel linear's backward holds its re-gathered
    full-sequence input and its full-sequence input gradient, two [s / sp, h] buffers:
    2 x 512 x 64 x 2 bytes = 131072 bytes for 1024 tokens over SP 2 in BF16; none without TP."""
    chunk = one_piece(1024)
    cost = CostModel(TINY, profile(), ParallelConfig(pp=1, sp=2, tp=4))
    assert cost.layer_workspace(chunk) == 2 * 1024 / 2 * 64 * TINY.element_bytes == 131072
    assert CostModel(TINY, profile(), ParallelConfig(pp=1, sp=2)).layer_workspace(chunk) == 0


def test_the_loss_holds_the_logits_in_the_model_dtype_beside_their_fp32_copy():
    """The last stage's loss: the BF16 logits beside the FP32 copy the cross entropy keeps,
    V / (sp tp) x 2 bytes a token; in FP32 the copy is the logits themselves. The stage holds
    the larger of that and a layer's buffers (they do not run at once)."""
    chunk = one_piece(1024)
    cost = CostModel(TINY, profile(), ParallelConfig(pp=2, sp=2, tp=2))
    loss = 1024 * TINY.vocab_size / 4 * 2
    assert cost.loss_workspace(chunk) == loss
    assert cost.stage_workspace(1, chunk) == max(loss, cost.layer_workspace(chunk))
    assert cost.stage_workspace(0, chunk) == cost.layer_workspace(chunk)
    fp32 = dataclasses.replace(TINY, dtype="float32")
    assert CostModel(fp32, profile(), ParallelConfig(pp=2, tp=2)).loss_workspace(chunk) == 0


def test_the_allocator_overhead_applies_to_the_workspace_as_to_the_activations():
    """Buffers allocated while a layer or the loss runs go through the same caching allocator:
    an overhead of 0.25 makes TP 2's two full-sequence buffers of 1024 tokens 2 x 1024 x 64 x 2
    x 1.25 = 327680 bytes, and the loss's BF16 logits 1024 x 100 / 2 x 2 x 1.25 = 128000."""
    chunk = one_piece(1024)
    cost = CostModel(TINY, profile(allocator_overhead=0.25), ParallelConfig(pp=1, tp=2))
    assert cost.layer_workspace(chunk) == 2 * 1024 * 64 * 2 * 1.25 == 327680
    assert cost.loss_workspace(chunk) == 1024 * 100 / 2 * 2 * 1.25 == 128000


def test_ring_attention_is_exposed_only_beyond_the_attention_it_overlaps():
    """CP 4 over a 100 GB/s link (4 GPUs, one node): each GPU holds a quarter of the chunk's
    tokens and of its work; the ring passes a K/V block of tokens / 4 x 2h x 2 bytes three
    times. A long chunk hides it behind attention, a short one exposes the rest; the backward
    moves twice the bytes against twice the attention."""
    plain = CostModel(TINY, profile(), ParallelConfig(pp=1))
    cost = CostModel(TINY, profile(), ParallelConfig(pp=1, cp=4))
    alpha1 = 2 * 64 / (4 * 1e12 * 0.25)
    for tokens in (64, 1 << 16):
        chunk = one_piece(tokens)
        assert cost.layer_compute(chunk) == pytest.approx(
            0.001 + (plain.layer_compute(chunk) - 0.001) / 4, rel=1e-12)
        attention = alpha1 * tokens ** 2
        ring = 3 * (1e-5 + tokens * 2 * 64 * TINY.element_bytes / 4 / (100 * GB))
        assert cost.layer_collectives(chunk) == pytest.approx(max(0.0, ring - attention),
                                                              abs=1e-15)
        assert cost.layer_backward(chunk) == pytest.approx(
            2 * cost.layer_compute(chunk) + max(0.0, 2 * ring - 2 * attention), rel=1e-12)
        assert cost.layer_activation(chunk) == pytest.approx(plain.layer_activation(chunk) / 4)
    assert cost.layer_collectives(one_piece(64)) > 0 == cost.layer_collectives(one_piece(1 << 16))
    with pytest.raises(ValueError, match="Ulysses sp and ring-attention cp together"):
        ParallelConfig(pp=1, sp=2, cp=2)


def test_zero3_shards_weights_and_gradients_too():
    model = ModelConfig("m", 4, 64, 16, 256, 100, dtype="bfloat16")
    base = ParallelConfig(pp=1, dp=4, reserved_gb=0.0)
    params = 4 * model.params_per_layer() + 2 * 100 * 64 + 2 * 64
    plain = CostModel(model, profile(), base)
    assert plain.static_bytes(0) == pytest.approx(params * (2 + 4 + 12 / 4))
    zero3 = CostModel(model, profile(), dataclasses.replace(base, zero3=True))
    assert zero3.static_bytes(0) == pytest.approx(params * (2 + 4 + 12) / 4)


def test_megatrons_per_layer_recomputation_holds_the_rebuilt_output_and_two_gradients():
    """CheckpointFunction.backward (megatron-core tensor_parallel/random.py) rebuilds a layer
    and backpropagates through it: beside the rebuilt layer's saved tensors, its output, the
    gradient arriving at it and the input's gradient, each [tokens / (sp tp), h]: 3 x 1024 / 4
    x 64 x 2 bytes = 98304 at SP 2 x TP 2 in BF16; the baselines' recomputation transient is
    the layer's saving plus these, the project's own recomputation (all checkpointed layers at
    once from the range's one kept input, boundaries not kept) the layers' saving and the
    inputs of the range's second and third layers, 2 x 1024 / 4 x 64 x 2 bytes."""
    from longctx.chunk_costs import ChunkCosts
    from megatron.plugin.pipeline.ir import Action, Kind

    chunk = one_piece(1024)
    cost = CostModel(TINY, profile(), ParallelConfig(pp=1, sp=2, tp=2))
    assert cost.recompute_boundary(chunk) == 3 * 1024 / 4 * 64 * 2 == 98304
    recompute = Action(0, Kind.RECOMPUTE, 0)
    megatron = ChunkCosts(cost, [chunk], lambda stage, unit: 3, per_layer_recompute=True)
    assert megatron.activation_bytes(recompute) == cost.layer_saving(chunk) + 98304
    project = ChunkCosts(cost, [chunk], lambda stage, unit: 3)
    assert project.activation_bytes(recompute) == 3 * cost.layer_saving(chunk) + 65536
