"""The planner end to end: orders, lowering, simulated memory, determinism, pruning, bad
input."""
import dataclasses
import random
import re

import pytest

from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b

from elastic_pipe import checkpointing, scheduler
from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import load_profile
from elastic_pipe.lowering import compute_schedule, simulate_plan
from longctx.models import ModelConfig
from elastic_pipe.pipeline_order import FORWARD, backward_order, rank_orders
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
from elastic_pipe.sequence_processor import ChunkingConfig

SMALL = ModelConfig("small", 8, 1024, 8, 4096, 1000)
CONFIG = SchedulerConfig(chunking=ChunkingConfig(min_slice_tokens=1024),
                         solver_time_limit=0.02, workers=1)


def cost_for(memory_gb, pp=4):
    return CostModel(SMALL, load_profile("a800"),
                     ParallelConfig(pp=pp, sp=1, memory_gb=memory_gb, reserved_gb=0.25))


def lengths_for(seed, count=24, longest=16384):
    rng = random.Random(seed)
    lengths = [max(1, min(longest, int(rng.lognormvariate(7, 1.5)))) for _ in range(count)]
    return lengths + [longest]


@pytest.mark.parametrize("lookahead", [0, 16])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_orders_without_split_documents_are_megatrons_1f1b(pp, n, lookahead):
    ours = rank_orders(pp, list(range(n)), lookahead)
    theirs = one_f_one_b(pp, n)
    assert [[(kind, unit) for kind, unit in row] for row in ours] == \
        [[("F" if a.kind is Kind.FORWARD else "B", a.unit) for a in row] for row in theirs]


def test_split_documents_run_backwards_in_reverse_slice_order():
    plan = plan_elastic(lengths_for(1), cost_for(1.5), CONFIG)
    schedule = compute_schedule(plan, 4)
    chunks = plan.chunks()
    for row in schedule:
        seen = {}
        for action in row:
            if action.kind is Kind.BACKWARD:
                for piece in chunks[action.unit].pieces:
                    assert seen.get(piece.doc, piece.slice + 1) == piece.slice + 1, piece
                    seen[piece.doc] = piece.slice
    assert any(chunk.kind == "split" for chunk in chunks)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("memory_gb", [1.4, 1.6, 3.0])
def test_simulated_memory_never_exceeds_capacity(seed, memory_gb):
    cost = cost_for(memory_gb)
    plan = plan_elastic(lengths_for(seed), cost, CONFIG)
    schedule, result = simulate_plan(plan, cost)
    assert max(result.peak_memory) <= memory_gb * GB
    # the oracle is the simulator's own replay; the plan's bound must not be below it either
    assert all(sim <= bound + 1 for sim, bound in zip(result.peak_memory,
                                                       plan.peak_memory_bytes))
    if memory_gb == 1.4:
        assert any(a.kind is Kind.RECOMPUTE for row in schedule for a in row)


def test_same_input_same_plan_in_process_and_in_workers():
    lengths, cost = lengths_for(7), cost_for(1.4)
    first = plan_elastic(lengths, cost, CONFIG)
    again = plan_elastic(lengths, cost, CONFIG)
    pooled = plan_elastic(lengths, cost, SchedulerConfig(
        chunking=CONFIG.chunking, solver_time_limit=CONFIG.solver_time_limit, workers=2))
    assert first.to_dict() == again.to_dict() == pooled.to_dict()


@pytest.mark.parametrize("seed, count, memory_gb", [(0, 24, 1.4), (5, 24, 1.4), (1, 24, 2.0)])
def test_dropping_candidates_by_bound_keeps_the_plan(monkeypatch, seed, count, memory_gb):
    """The branch and bound solves fewer candidates and returns the plan that solving every
    candidate the zero-checkpointing bounds leave open returns (a limit CP-SAT proves optimal
    in, so the solves do not depend on the machine's load)."""
    solved = []
    solve = checkpointing.solve
    monkeypatch.setattr(checkpointing, "solve",
                        lambda problem, limit: solved.append(problem) or solve(problem, limit))
    config = dataclasses.replace(CONFIG, solver_time_limit=0.5)
    lengths, cost = lengths_for(seed, count=count), cost_for(memory_gb)
    scheduler._memo.clear()
    pruned = plan_elastic(lengths, cost, config)
    dropped = len(solved)
    monkeypatch.setattr(scheduler, "_promising",
                        lambda keys, values, floors, points: sorted(keys))
    scheduler._memo.clear()
    solved.clear()
    everything = plan_elastic(lengths, cost, config)
    assert dropped < len(solved)
    assert pruned.to_dict() == everything.to_dict()


def test_tiny_time_limit_returns_and_records_fallbacks():
    config = SchedulerConfig(chunking=CONFIG.chunking, solver_time_limit=1e-4, workers=2)
    plan = plan_elastic(lengths_for(3, count=60), cost_for(1.4), config)
    statuses = {p.status for p in plan.pipelines}
    assert {f["status"] for f in plan.fallbacks} == statuses - {"optimal", "trivial"}
    assert statuses - {"optimal", "trivial"}


def test_backward_order_refuses_slices_out_of_order():
    from longctx.chunks import Chunk, Piece
    head, tail = Piece(0, 0, 0, 10, False), Piece(0, 1, 10, 20, True)
    assert backward_order([Chunk((head,)), Chunk((tail,))]) == [1, 0]
    with pytest.raises(ValueError, match="must follow"):
        backward_order([Chunk((head,)), Chunk((Piece(1, 0, 0, 5, True),)), Chunk((tail,))])
    assert rank_orders(2, [1, 0], 0)[1][:2] == [(FORWARD, 0), (FORWARD, 1)]


@pytest.mark.parametrize("lengths, message", [
    ([], "no document lengths"),
    ([5, 0, 3], "document 1 has length 0"),
    ([5, -2], "document 1 has length -2"),
])
def test_bad_lengths(lengths, message):
    with pytest.raises(ValueError, match=message):
        plan_elastic(lengths, cost_for(2.0), CONFIG)


def test_infeasible_budget_names_the_smallest_that_fits():
    lengths = lengths_for(2)
    with pytest.raises(ValueError, match="smallest budget that fits is") as error:
        plan_elastic(lengths, cost_for(0.9), CONFIG)
    need = float(re.search(r"fits is ([0-9.]+) GB", str(error.value)).group(1))
    assert need > 0.9
    plan = plan_elastic(lengths, cost_for(need), CONFIG)
    assert plan.pipelines
    with pytest.raises(ValueError, match="smallest budget"):
        plan_elastic(lengths, cost_for(need - 0.02), CONFIG)


@pytest.mark.parametrize("memory_gb", [1.4, 3.0])
def test_each_pipeline_runs_the_lookahead_it_was_planned_with(memory_gb):
    """The lowered order of every pipeline is the runtime's 1F1B with the pipeline's own
    lookahead (one of the configured ones), and the plan records it."""
    plan = plan_elastic(lengths_for(3), cost_for(memory_gb), CONFIG)
    schedule, offset = compute_schedule(plan, 4), 0
    for number, pipeline in enumerate(plan.pipelines):
        assert pipeline.lookahead in CONFIG.lookaheads
        assert plan.to_dict()["pipelines"][number]["lookahead"] == pipeline.lookahead
        units = range(offset, offset + len(pipeline.chunks))
        expected = one_f_one_b(4, len(pipeline.chunks), list(pipeline.backward),
                               pipeline.lookahead)
        for rank in range(4):
            ours = [(a.kind, a.unit - offset) for a in schedule[rank] if a.unit in units]
            assert ours == [(a.kind, a.unit) for a in expected[rank]]
        offset += len(pipeline.chunks)


@pytest.mark.parametrize("lookaheads", [(), (0, -1)])
def test_bad_lookaheads_are_refused(lookaheads):
    with pytest.raises(ValueError, match="lookaheads"):
        SchedulerConfig(lookaheads=lookaheads)
