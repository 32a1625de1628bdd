"""Short documents (#26): on a batch whose documents all fit ``--seq-length``, ``elastic`` and
``seq1f1b`` plan no more units than Megatron-LM's micro-batches at PP = 1 and are never
predicted slower than Megatron's 1F1B on them, at any PP; at PP = 2 with the host's time per
action priced, more units than Megatron's only when predicted faster with it; a fixed slice
count keeps its meaning."""
import dataclasses
import random

import pytest

from megatron.plugin.packing import micro_batch_rows

from elastic_pipe.baselines import megatron_1f1b, seq1f1b
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
from elastic_pipe.sequence_processor import ChunkingConfig, megatron_chunking
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import LayerCoefficients, load_profile
from longctx.models import ModelConfig

SEQ = 4096
#: The H200 run's model (8 layers x 1024, 16 heads, bf16, Megatron's default dropout).
MODEL = ModelConfig("gpu-run", 8, 1024, 16, 4096, 257, dtype="bfloat16", hidden_dropout=True)


def config(slices=None, micro_batch_size=1):
    return SchedulerConfig(ChunkingConfig(slice_counts=slices, seq_length=SEQ,
                                          micro_batch_size=micro_batch_size),
                           solver_time_limit=0.05, workers=1)


def cost_for(pp, profile="h200"):
    hardware = load_profile(profile)
    return CostModel(MODEL, hardware, ParallelConfig(pp=pp, memory_gb=hardware.hbm_gb))


def short_batch(seed, count=48, longest=SEQ // 4):
    """Log-normal lengths well under the context, as a batch of short documents has them."""
    rng = random.Random(seed)
    return [max(2, min(longest, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(count)]


def megatron_units(lengths, micro_batch_size=1):
    return micro_batch_rows(lengths, SEQ, micro_batch_size)


def megatron_seconds(lengths, cost, micro_batch_size=1):
    """Megatron's 1F1B over its own micro-batches, nothing recomputed, in the planner's
    pipeline time (the same the plans are predicted with)."""
    return megatron_1f1b(lengths, cost, SEQ, micro_batch_size).predicted_time_s


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_megatron_chunking_is_megatrons_micro_batches(seed, micro_batch_size):
    lengths = short_batch(seed) + [SEQ]
    docs = sorted(enumerate(lengths), key=lambda d: (-d[1], d[0]))
    chunking = megatron_chunking(docs, cost_for(1), ChunkingConfig(
        seq_length=SEQ, micro_batch_size=micro_batch_size))
    theirs = {frozenset(i for row in batch for i in row)
              for batch in megatron_units(lengths, micro_batch_size)}
    ours = {frozenset(piece.doc for piece in chunk.pieces) for chunk in chunking.chunks}
    assert ours == theirs
    assert all(chunk.kind == "batched" for chunk in chunking.chunks)
    assert chunking.token_threshold == SEQ * micro_batch_size


def test_no_megatron_candidate_for_a_longer_document_or_without_seq_length():
    assert megatron_chunking([(0, SEQ + 1), (1, 5)], cost_for(1),
                             ChunkingConfig(seq_length=SEQ)) is None
    assert megatron_chunking([(0, 5)], cost_for(1), ChunkingConfig()) is None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b"])
def test_short_documents_run_in_no_more_units_than_megatron_at_pp1(schedule, seed):
    """Without Megatron's micro-batches as a candidate these batches planned 15-18 (elastic)
    and 17-20 (seq1f1b) units against Megatron's 5, predicted at 0.53-0.61x its speed."""
    lengths = short_batch(seed)
    cost = cost_for(1)
    plan = (plan_elastic(lengths, cost, config()) if schedule == "elastic"
            else seq1f1b(lengths, cost, config()))
    assert len(plan.chunks()) <= len(megatron_units(lengths))
    assert plan.predicted_time_s <= megatron_seconds(lengths, cost) * (1 + 1e-9)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b"])
def test_short_documents_never_predicted_slower_than_megatron(schedule, micro_batch_size, pp):
    lengths = short_batch(pp + micro_batch_size) + [SEQ]
    cost = cost_for(pp, "h100")
    chosen = config(micro_batch_size=micro_batch_size)
    plan = (plan_elastic(lengths, cost, chosen) if schedule == "elastic"
            else seq1f1b(lengths, cost, chosen))
    assert plan.predicted_time_s <= megatron_seconds(lengths, cost, micro_batch_size) \
        * (1 + 1e-9)


def test_a_fixed_slice_count_still_cuts_the_longest_document():
    """``--elastic-slices 2`` is the slice count asked for: Megatron's micro-batches (which cut
    nothing) are no candidate then."""
    lengths = short_batch(0) + [SEQ]
    plan = plan_elastic(lengths, cost_for(1), config(slices=(2,)))
    assert any(chunk.kind == "split" for chunk in plan.chunks())
    assert {p.num_slices for p in plan.pipelines} == {2}


def test_without_megatrons_candidate_short_documents_run_in_more_units():
    """What the candidate changes: Algorithm 1 alone sizes chunks by the longest document."""
    lengths = short_batch(1)
    cost = cost_for(1)
    plain = dataclasses.replace(config(), chunking=ChunkingConfig())
    assert len(plan_elastic(lengths, cost, plain).chunks()) > len(megatron_units(lengths))


#: The CPU bench's model (scripts/bench_schedules.py: 4 layers x hidden 64, fp32) and the eq. 1
#: fit its run refitted to (benchmarks/results/bench_schedules_short.txt), on a synchronous host.
CPU_MODEL = ModelConfig("cpu-bench", 4, 64, 4, 256, 257)
CPU_SEQ = 1024


def cpu_cost(host_action_s):
    fit = LayerCoefficients(8.572e-08, 0.0, 1.688e-03, hidden_size=64, sp=1, tp=1)
    hardware = dataclasses.replace(load_profile("a800"), source="measured",
                                   layer_coefficients=fit, backward_factor=2.746,
                                   host_asynchronous=False, host_action_s=host_action_s)
    return CostModel(CPU_MODEL, hardware, ParallelConfig(pp=2, memory_gb=80))


@pytest.mark.parametrize("host_action_s", [1e-4, 3e-3])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b"])
def test_at_pp2_more_units_than_megatron_only_when_faster_with_the_host_time(schedule, seed,
                                                                             host_action_s):
    """PP = 2 with a host time per action (1e-4 s: the executor's own work measured on this
    CPU by ``scripts/profile_costs.py``; 3e-3 s: a slower host): every extra unit pays it
    twice a stage, and a plan with more units than Megatron's micro-batches is chosen only when
    predicted faster than Megatron's 1F1B with that cost counted in both."""
    lengths = short_batch(seed, count=32, longest=CPU_SEQ)
    cost = cpu_cost(host_action_s)
    chosen = SchedulerConfig(ChunkingConfig(seq_length=CPU_SEQ), solver_time_limit=0.05,
                             workers=1)
    plan = (plan_elastic(lengths, cost, chosen) if schedule == "elastic"
            else seq1f1b(lengths, cost, chosen))
    megatron = megatron_1f1b(lengths, cost, CPU_SEQ, 1)
    without_host = megatron_1f1b(lengths, cpu_cost(0.0), CPU_SEQ, 1)
    units = len(micro_batch_rows(lengths, CPU_SEQ, 1))
    # Megatron's 1F1B pays 2 x units actions a stage; on its critical path at least 2 x units
    assert megatron.predicted_time_s >= without_host.predicted_time_s \
        + 2 * units * host_action_s * (1 - 1e-9)
    if len(plan.chunks()) > units:
        assert plan.predicted_time_s < megatron.predicted_time_s
    assert plan.predicted_time_s <= megatron.predicted_time_s * (1 + 1e-9)
