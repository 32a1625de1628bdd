"""``scripts/paper_terms.py``'s terms against hand calculations: NCCL's NVLink rate in an
all-to-all inside a node, ZeRO-3's exposed traffic over a stage's GPUs, the allocator's
fragmentation as reserved bytes per live byte, NCCL's buffers of Megatron-LM's communicators,
Megatron-LM's memory under full recomputation term by term (simulated and megatron-core's),
its exposed TP collectives, and the memory ledger the SPPO rows (``scripts/papers/sppo.py``) give
Megatron-LM's longest sequences."""
import dataclasses
import sys

import pytest

from harness import REPO
for folder in (REPO, f"{REPO}/scripts"):  # the papers' modules import paper_terms by name
    if folder not in sys.path:
        sys.path.insert(0, folder)

from papers import sppo  # noqa: E402
from scripts.paper_terms import (  # noqa: E402
    MIB, fragmented, megatron_communicators, megatron_recompute_ledger, nccl_buffer_bytes,
    nccl_nvlink, plan_collectives_s, zero3_exposed_s)

from elastic_pipe.plan_types import PipelinePlan, Plan  # noqa: E402
from longctx.chunks import Chunk, Piece  # noqa: E402
from longctx.cost_model import CostModel, ParallelConfig  # noqa: E402
from longctx.hardware import load_profile  # noqa: E402
from longctx.models import get_model  # noqa: E402


def test_nccl_nvlink_prices_an_all_to_all_inside_a_node_at_20_of_25_gb_s_a_link():
    """The A800's 200 GB/s a direction at 20 / 25: 160 GB/s. Ulysses SP 8 inside a node on a
    32K sequence: each GPU holds 4096 tokens x 5120 x 2 bytes = 41943040 bytes of each of
    q, k, v and the output, sends 7/8 of them over NVLink, so one all-to-all takes
    41943040 x 7/8 / 160e9 s plus the 10 us latency, four a layer's forward. Across two nodes
    of 50 GB/s NICs (SP 16: half of each GPU's 20971520 bytes through its 6.25 GB/s share of
    them, 20 us latency) the NICs decide and the NVLink rate changes nothing."""
    a800 = load_profile("a800")
    assert nccl_nvlink(a800).intra_node_gbps == pytest.approx(160.0)
    assert nccl_nvlink(a800).inter_node_gbps == a800.inter_node_gbps
    model = dataclasses.replace(get_model("gpt-13b"), num_heads=64)  # 16 divides it
    chunk = Chunk((Piece(0, 0, 0, 32768, True),))
    cost = CostModel(model, nccl_nvlink(a800), ParallelConfig(pp=1, sp=8))
    one = 41943040 * 7 / 8 / 160e9 + 1e-5
    assert cost.layer_collectives(chunk) == pytest.approx(4 * one)
    nic = dataclasses.replace(a800, node_nic_gbps=50.0)
    for hardware in (nic, nccl_nvlink(nic)):
        across = CostModel(model, hardware, ParallelConfig(pp=1, sp=16))
        assert across.layer_collectives(chunk) == pytest.approx(
            4 * (20971520 * 8 / 16 / 6.25e9 + 2e-5))


def test_zero3_over_a_stages_gpus_exposes_what_its_chunk_does_not_hide():
    """InfiniPipe's ZeRO-3 over a stage's 8 GPUs inside a node: a 13B layer's 314639360
    weights in BF16, 7/8 of them over 200 GB/s plus 10 us, a gather (and as much a
    reduce-scatter). A 256-token chunk computes less than that: on stage 1 of 4 (10 layers),
    3 of them recomputed, 7 layers expose 2 gathers + a scatter less their forward and backward,
    3 expose a third gather less a second forward too; stage 0, nothing recomputed, 10 x the
    first; a chunk long enough to hide it all exposes nothing."""
    cost = CostModel(get_model("gpt-13b"), load_profile("a800"),
                     ParallelConfig(pp=4, sp=8, memory_gb=80.0))

    def plan(tokens, ckpt):
        chunk = Chunk((Piece(0, 0, 0, tokens, True),))
        pipeline = PipelinePlan((chunk,), (0,), tuple((c,) for c in ckpt), 0.0, "hand", 1, 1)
        return Plan((pipeline,), 0.0, (0.0,) * 4, 0.0, 0.0, 0.0), chunk

    ring = 314639360 * 2 * 7 / 8 / 200e9 + 1e-5
    short, chunk = plan(256, (0, 3, 0, 0))
    forward, backward = cost.layer_forward(chunk), cost.layer_backward(chunk)
    plain, again = 3 * ring - forward - backward, 4 * ring - 2 * forward - backward
    assert plain > 0 and again > 0
    assert zero3_exposed_s(short, cost, 8, 1) == pytest.approx(7 * plain + 3 * again)
    assert zero3_exposed_s(short, cost, 8, 0) == pytest.approx(10 * plain)
    assert zero3_exposed_s(plan(32768, (0, 3, 0, 0))[0], cost, 8, 1) == 0.0


def test_fragmentation_is_a_share_of_the_reservation():
    """15% of the reservation unused: 0.15 / 0.85 reserved bytes beyond each live byte, so a
    checkpointed 7B layer input at TP 32 (4096 x 2 / 32 = 256 bytes a token) costs 256 / 0.85
    bytes, and TP's two full-sequence buffers 2 x 4096 x 2 / 0.85 a token."""
    a100 = load_profile("a100")
    assert fragmented(a100).allocator_overhead == pytest.approx(0.15 / 0.85)
    assert fragmented(a100, 0.0).allocator_overhead == 0.0
    cost = CostModel(get_model("gpt-7b"), fragmented(a100), ParallelConfig(pp=1, tp=32))
    assert cost.ckpt_per_token == pytest.approx(256 / 0.85)
    chunk = Chunk((Piece(0, 0, 0, 1000, True),))
    assert cost.layer_workspace(chunk) == pytest.approx(1000 * 2 * 4096 * 2 / 0.85)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"fragmentation must be in \[0, 1\)"):
            fragmented(a100, bad)


def test_nccl_buffers_of_megatron_communicators():
    """SP 32 x PP 1: tensor parallelism's communicator and the gradient norm's (same 32 GPUs, a
    communicator of its own), 2 x 688 MiB; SP 64 x PP 2 adds the pipeline's two GPUs, 544 MiB;
    one GPU has none."""
    assert megatron_communicators(32, 1) == {"tensor parallel": 32, "gradient norm": 32}
    assert nccl_buffer_bytes(32, 1) == 2 * 688 * MIB
    assert megatron_communicators(64, 2) == {"tensor parallel": 64, "pipeline send/receive": 2,
                                             "gradient norm": 128}
    assert nccl_buffer_bytes(64, 2) == (688 + 544 + 688) * MIB
    assert nccl_buffer_bytes(2, 1) == 2 * 544 * MIB
    assert nccl_buffer_bytes(1, 1) == 0


def test_megatron_memory_ledger_at_the_papers_length():
    """GPT-7B at SP 32 x PP 1 on 32 A100s at 896K tokens (the SPPO paper's longest for
    Megatron-LM): TP's two full-sequence buffers 2 x 917504 x 4096 x 2 bytes, the loss's BF16
    logits 917504 x 50304 / 32 x 2 beside the FP32 ones (x 4), the model state 18 bytes a
    parameter (one replica: nothing to shard), NCCL's two communicators; the fragmentation at
    15% of the reservation adds 0.15 / 0.85 of everything but the model state and the
    reserved 2 GB."""
    seven = get_model("gpt-7b")
    why, ledger = sppo.megatron_memory(sppo.testbed(), seven, 32, (32, 1), 896, 1728.0)
    gb, tokens = 1e9, 917504
    memory = ledger["memory_at_published_gb"]
    assert memory["tp_sp_buffers"] == pytest.approx(2 * tokens * 4096 * 2 / gb)
    assert memory["loss_buffers"] == pytest.approx(tokens * 50304 / 32 * 2 / gb)
    assert memory["fp32_logits"] == pytest.approx(tokens * 50304 / 32 * 4 / gb)
    params = seven.num_layers * seven.params_per_layer() + 2 * 50304 * 4096 + 2 * 4096
    assert memory["model_state"] == pytest.approx(params / 32 * 18 / gb)
    assert memory["nccl_buffers"] == pytest.approx(2 * 688 * MIB / gb)
    assert memory["free"] == pytest.approx(80.0 - memory["peak"])
    live = memory["peak"] - memory["model_state"] - memory["reserved"]
    assert why["size"] == pytest.approx(live * 0.15 / 0.85)
    assert why["simulated_with"] == 1728.0


def test_megatron_recompute_ledger_term_by_term_at_tp_32():
    """GPT-7B at SP 32 x PP 1, 64K tokens (2048 a GPU). The simulation's peak is a layer's
    recomputation: 32 checkpointed inputs of 2048 x 4096 x 2 bytes, the rebuilt output and two
    boundary gradients (3 more), the FP32 logits 65536 x 50304 / 32 x 4 and TP's two
    full-sequence buffers 2 x 65536 x 4096 x 2 (larger than the loss's BF16 logits): their sum
    is the simulated peak. megatron-core's largest moment is a layer's backward, where the FP32
    softmax is gone (the logits' gradient, consumed by the output layer's backward) and the
    global buffer and the input gradient are the two buffers: it holds the FP32 logits and the
    head's saved tensors less."""
    from sppo_offload.solver import MEGATRON, SolverConfig, solve

    seven, tokens = get_model("gpt-7b"), 65536
    plan = solve(MEGATRON, tokens, seven, sppo.testbed(),
                 SolverConfig(gpus=32, memory_gb=80.0, layout=(32, 1)))
    ledger = megatron_recompute_ledger(plan.costs.cost, tokens, 0)
    simulated, held = ledger["simulated"], ledger["megatron_core"]
    assert simulated["checkpointed layer inputs"] == 32 * 2048 * 4096 * 2
    assert simulated["the rebuilt output and two boundary gradients"] == 3 * 2048 * 4096 * 2
    fp32 = simulated["FP32 logits (kept to the stage's backward end)"]
    assert fp32 == tokens * 50304 / 32 * 4
    assert simulated["workspace (TP + SP's two buffers, or the loss's BF16 logits)"] == \
        2 * tokens * 4096 * 2
    assert sum(simulated.values()) == pytest.approx(plan.peak_memory_bytes[0])
    assert ledger["megatron_core_moment"] == "a layer's backward"
    assert held["global buffer: the re-gathered input (layers.py:614)"] == tokens * 4096 * 2
    assert held["full-sequence input gradient (layers.py:627)"] == tokens * 4096 * 2
    head = simulated["final norm, output-layer input, loss targets"]
    assert ledger["over_counted"] == pytest.approx(fp32 + head)


def test_megatron_recompute_ledger_peaks_at_the_loss_when_the_logits_are_wide():
    """GPT-13B at SP 8 x PP 8, last stage, 512K tokens: a GPU's share of the vocabulary is
    50304 / 8, so the loss's backward (FP32 softmax turned gradient beside its BF16 cast, and
    the global buffer held since the forward, 524288 x 5120 x 2) outweighs a layer's backward
    and is megatron-core's peak; the simulation adds the rematerialised layer and TP's second
    buffer on top of the FP32 logits instead of the BF16 cast."""
    from sppo_offload.solver import MEGATRON, SolverConfig, solve

    thirteen, tokens = get_model("gpt-13b"), 524288
    plan = solve(MEGATRON, tokens, thirteen, sppo.testbed(),
                 SolverConfig(gpus=64, memory_gb=80.0, layout=(8, 8)))
    cost = plan.costs.cost
    ledger = megatron_recompute_ledger(cost, tokens, 7)
    held = ledger["megatron_core"]
    assert ledger["megatron_core_moment"] == "the loss's backward"
    assert held["FP32 softmax turned gradient (cross_entropy.py:181, 190)"] == \
        tokens * 50304 / 8 * 4
    assert held["its BF16 cast (cross_entropy.py:25 undone)"] == tokens * 50304 / 8 * 2
    assert held["global buffer, held since the forward (layers.py:570)"] == tokens * 5120 * 2
    assert sum(ledger["simulated"].values()) == pytest.approx(plan.peak_memory_bytes[7])
    remat = cost.layer_saving(Chunk((Piece(0, 0, 0, tokens, True),))) + 3 * tokens / 8 * 5120 * 2
    assert ledger["over_counted"] == pytest.approx(remat + 2 * tokens * 5120 * 2
                                                   - tokens * 50304 / 8 * 2 - tokens * 5120 * 2)


def test_megatron_collectives_are_its_forward_recomputed_forward_and_backward():
    """One sequence at SP 32 x PP 1: every layer runs its TP collectives in the forward, again
    in the recomputed forward, and in the backward (the same bytes): 32 x 3 times a forward's."""
    from sppo_offload.costs import subsequence_chunks
    from sppo_offload.solver import MEGATRON, SolverConfig, solve

    plan = solve(MEGATRON, 65536, get_model("gpt-7b"), sppo.testbed(),
                 SolverConfig(gpus=32, memory_gb=80.0, layout=(32, 1)))
    (chunk,) = subsequence_chunks(plan.lengths)
    forward = plan.costs.cost.layer_collectives(chunk)
    assert forward > 0
    assert plan_collectives_s(plan) == pytest.approx(32 * 3 * forward)
