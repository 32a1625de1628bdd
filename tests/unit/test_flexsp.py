"""The FlexSP-style baseline (elastic_pipe.flexsp) against hand calculations: the partitions
it searches, the longest-first assignment within each group's micro-batch, the steps' spread,
the groups' lockstep, where short and long documents go, and that one group of all the GPUs is
the DeepSpeed-Ulysses baseline exactly."""
import pytest

from elastic_pipe.baselines import packed_1f1b
from elastic_pipe.evaluation import report
from elastic_pipe.flexsp import (assign, group_capacity, group_cost, layers_to_hold,
                                 partitions, plan_flexsp, spread)
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import profile_from_dict
from longctx.models import ModelConfig

MODEL = ModelConfig("m", 4, 1024, 16, 4096, 1000)
HARDWARE = profile_from_dict({
    "name": "hand", "source": "spec-derived", "peak_tflops": 100.0, "matmul_efficiency": 0.5,
    "attention_efficiency": 0.5, "layer_overhead_s": 1e-5, "backward_factor": 2.0,
    "hbm_gb": 80.0, "intra_node_gbps": 100.0, "intra_node_latency_s": 1e-5,
    "inter_node_gbps": 25.0, "inter_node_latency_s": 2e-5, "gpus_per_node": 8,
    "node_nic_gbps": 50.0})
GPUS, MEMORY, CONTEXT = 16, 80.0, 65536


def test_partitions_are_the_power_of_two_multisets():
    eight = list(partitions(8))
    assert eight[0] == (8,) and eight[-1] == (1,) * 8
    assert len(eight) == len(set(eight)) == 10  # the binary partitions of 8
    assert all(sum(p) == 8 and list(p) == sorted(p, reverse=True) for p in eight)
    assert all(size & (size - 1) == 0 for p in eight for size in p)
    assert len(list(partitions(32))) == 202


def test_longest_first_goes_where_it_finishes_earliest_with_room():
    """Sizes (2, 1, 1), a group of 2 holding 100 tokens and of 1 holding 50 (one micro-batch
    each), a document taking length / size seconds. 80 fits only the pair (0 + 40); 40 goes to
    the first single (0 + 40 ties the second, the earlier wins); 30 to the second single
    (0 + 30); 15 to the second single (30 + 15 = 45 beats the pair's 40 + 7.5 = 47.5; the first
    single, at 40 + 15 tokens, has no room); 10 to the pair (40 + 5 = 45 beats 40 + 10; the
    second single, at 45 + 10 tokens, has no room). Makespan 45."""
    groups, loads = assign([30, 80, 10, 40, 15], (2, 1, 1), {2: 100, 1: 50},
                           lambda size, length: length / size)
    assert groups == (2, 0, 0, 1, 2)
    assert loads == (45.0, 40.0, 45.0)
    with pytest.raises(ValueError, match="finds no room"):
        assign([30, 30], (1,), {1: 50}, lambda size, length: 1.0)


def test_a_tie_goes_to_the_larger_group():
    groups, _ = assign([10], (2, 1), {2: 10, 1: 10}, lambda size, length: 5.0)
    assert groups == (0,)
    with pytest.raises(ValueError, match="finds no room"):
        assign([60], (1, 1), {1: 50}, lambda size, length: 1.0)


def test_steps_spread_the_work_longest_first_within_their_tokens():
    """Work = tokens. 50 and 40 open the two steps; 30 joins the lighter (40 -> 70); 20 the
    other (50 -> 70); 10 ties, the earlier step (80 tokens, within 80). At 75 tokens a step
    the 10 finds no step with room."""
    lengths = [50, 40, 30, 20, 10]
    assert spread(lengths, range(5), 2, 80, lambda doc: lengths[doc]) == [[0, 3, 4], [1, 2]]
    assert spread(lengths, range(5), 2, 75, lambda doc: lengths[doc]) is None


def test_groups_of_a_step_run_one_micro_batch_each_in_lockstep():
    """ZeRO-3 over all the GPUs makes every layer a collective of every group: a step of
    several groups holds one micro-batch on each, and takes its slowest group's time. 64 2K
    documents at 3 GB (a group of one holds about 6K tokens) need several steps."""
    plan = plan_flexsp([2048] * 64, MODEL, HARDWARE, GPUS, 3.0, CONTEXT)
    assert len(plan.steps) > 1
    for step in plan.steps:
        if len(step) > 1:
            for group in step:
                assert group.plan is None or len(group.plan.chunks()) == 1
                assert sum(2048 for _ in group.documents) <= plan.capacity[group.size]
    assert plan.predicted_time_s == sum(max(group.predicted_time_s for group in step)
                                        for step in plan.steps)
    assert sorted(plan.assignment()) == list(range(64))


def test_zero3_shards_every_group_over_the_whole_cluster():
    whole = group_cost(MODEL, HARDWARE, GPUS, GPUS, MEMORY).static_bytes(0)
    for size in (1, 2, 8):
        assert group_cost(MODEL, HARDWARE, size, GPUS, MEMORY).static_bytes(0) == \
            pytest.approx(whole)


def test_capacity_is_the_context_or_what_memory_holds():
    """The model's full stash per token and layer, (8h + 2f) e and the FP32 statistics of
    its two norms (16 bytes) and of its 16 heads' softmax (64), over the group; the
    embedding's token and position ids (16); the head's final norm input, statistics and
    output-layer input (2h e + 8), its targets and masks (13) and its logits 4 V, over the
    group; and the loss's workspace while it runs (the logits in the model dtype beside their
    FP32 copy, e V: ``CostModel.stage_workspace``), against the budget left by the sharded
    model state."""
    cost = group_cost(MODEL, HARDWARE, 1, GPUS, 2.5)
    per_token = 4 * ((8 * 1024 + 2 * 4096) * 2 + 16 + 64) + 16 \
        + 2 * 1024 * 2 + 8 + 13 + 4 * 1000 + 2 * 1000
    tokens = group_capacity(cost, CONTEXT)
    assert tokens == pytest.approx(cost.activation_budget(0) / per_token, rel=1e-3)
    assert group_capacity(group_cost(MODEL, HARDWARE, 8, GPUS, 2.5), 1024) == 1024


def test_one_group_of_all_gpus_is_the_deepspeed_ulysses_baseline():
    lengths = [65536, 30000, 5000, 4000, 900, 700, 300, 120]
    flexsp = plan_flexsp(lengths, MODEL, HARDWARE, GPUS, MEMORY, CONTEXT, layouts=[(GPUS,)])
    assert flexsp.sizes == ((GPUS,),)
    cost = CostModel(MODEL, HARDWARE, ParallelConfig(pp=1, sp=GPUS, zero3=True,
                                                     memory_gb=MEMORY))
    deepspeed = report(packed_1f1b(lengths, cost, CONTEXT), cost, with_schedule=False)
    assert flexsp.iteration_time_s() == deepspeed["iteration_time_s"]
    best = plan_flexsp(lengths, MODEL, HARDWARE, GPUS, MEMORY, CONTEXT)
    assert best.predicted_time_s <= flexsp.predicted_time_s


def test_short_documents_stay_inside_a_node():
    """Many 2K documents: no group spans nodes (its all-to-all would cross the slow NICs)."""
    plan = plan_flexsp([2048] * 64, MODEL, HARDWARE, GPUS, MEMORY, CONTEXT)
    assert all(size <= HARDWARE.gpus_per_node for step in plan.sizes for size in step)
    assert sorted(plan.assignment()) == list(range(64))


def test_a_long_document_goes_to_a_group_that_holds_it():
    """At 3 GB a group of one holds about 6K tokens: a 20K document needs a larger group."""
    lengths = [20000] + [1000] * 40
    plan = plan_flexsp(lengths, MODEL, HARDWARE, GPUS, 3.0, CONTEXT)
    assert plan.capacity[1] < 20000
    step, index = plan.assignment()[0]
    group = plan.steps[step][index]
    assert group.size > 1 and plan.capacity[group.size] >= 20000
    for groups in plan.steps:
        for group in groups:
            assert all(lengths[doc] <= plan.capacity[group.size] for doc in group.documents)


def test_documents_that_need_every_gpu_run_in_a_step_of_their_own():
    """Only the group of all 16 GPUs holds 60K tokens at 3 GB: that document runs first on
    it, the short ones after on groups of the best partition."""
    cost = group_cost(MODEL, HARDWARE, GPUS // 2, GPUS, 3.0)
    assert group_capacity(cost, CONTEXT) < 60000
    lengths = [60000] + [2048] * 64
    plan = plan_flexsp(lengths, MODEL, HARDWARE, GPUS, 3.0, CONTEXT)
    assert plan.sizes[0] == (GPUS,) and plan.steps[0][0].documents == (0,)
    one_group = plan_flexsp(lengths, MODEL, HARDWARE, GPUS, 3.0, CONTEXT, layouts=[(GPUS,)])
    assert plan.predicted_time_s < one_group.predicted_time_s


def test_a_batch_no_step_count_fits_is_refused_with_what_to_allow():
    """Layouts of two groups of 8 only, documents just over half a group's micro-batch: each
    step holds two, the fewest steps by tokens about a quarter of the documents, and four
    more are not enough for 40."""
    capacity = group_capacity(group_cost(MODEL, HARDWARE, 8, GPUS, 3.0), CONTEXT)
    with pytest.raises(ValueError, match="allow more layouts"):
        plan_flexsp([capacity // 2 + 1] * 40, MODEL, HARDWARE, GPUS, 3.0, CONTEXT,
                    layouts=[(8, 8)])


def test_documents_too_long_are_refused():
    with pytest.raises(ValueError, match="fits no SP group: the largest, SP 16"):
        plan_flexsp([65536], MODEL, HARDWARE, GPUS, 2.1, CONTEXT)
    with pytest.raises(ValueError, match="exceeds the context"):
        plan_flexsp([CONTEXT + 1], MODEL, HARDWARE, GPUS, MEMORY, CONTEXT)
    with pytest.raises(ValueError, match="power of two"):
        plan_flexsp([10], MODEL, HARDWARE, 12, MEMORY, CONTEXT)


def test_layers_recomputed_one_at_a_time_keep_their_input_and_one_layer():
    """With k of the 4 layers recomputed one at a time (DeepSpeed's and Megatron-LM's layer
    checkpointing), a token keeps the full stash of each layer not recomputed, (8h + 2f) e
    and 80 bytes of FP32 statistics, the input of each recomputed one, h e, and the
    embedding's 16 bytes. Two moments bound it: the head's backward, with the head's
    2h e + 21 + 4V and the loss's workspace e V; and a recomputed layer's backward, after the
    head is freed, with that layer's stash less its input back and the three h e tensors at its
    boundary (its rebuilt output and the gradients at its output and input). Here the second
    is the larger, so recomputing one layer already saves the head's bytes less the boundary's;
    a micro-batch that fits with 2 needs 2."""
    full, kept = (8 * 1024 + 2 * 4096) * 2 + 80, 2 * 1024
    head = 2 * 1024 * 2 + 8 + 13 + 4 * 1000 + 2 * 1000
    cost = group_cost(MODEL, HARDWARE, 1, GPUS, 2.5)
    for k in range(5):
        stash = (4 - k) * full + k * kept + 16
        per_token = stash + head if k == 0 else max(stash + head, stash + full - kept + 3 * kept)
        assert group_capacity(cost, CONTEXT, k) == pytest.approx(
            cost.activation_budget(0) / per_token, rel=1e-3)
    assert group_capacity(cost, CONTEXT, 1) > group_capacity(cost, CONTEXT, 0)
    assert layers_to_hold(cost, group_capacity(cost, CONTEXT, 2)) == 2
    assert layers_to_hold(cost, 10 ** 7) is None


def test_a_fixed_configuration_recomputes_in_every_group():
    lengths = [20000] + [1000] * 40
    plan = plan_flexsp(lengths, MODEL, HARDWARE, GPUS, 3.0, CONTEXT, checkpointed=4)
    for size, tokens in plan.capacity.items():
        assert tokens == group_capacity(group_cost(MODEL, HARDWARE, size, GPUS, 3.0), CONTEXT, 4)
    assert plan.capacity[1] > plan_flexsp(lengths, MODEL, HARDWARE, GPUS, 3.0,
                                          CONTEXT).capacity[1]
    for step in plan.steps:
        for group in step:
            if group.plan is not None:
                assert set(group.plan.ckpt_table()[0]) == {4}
