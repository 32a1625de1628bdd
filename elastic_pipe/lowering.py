"""A plan as the project's schedule IR, priced in the simulator by the chunk cost adapter.

Each pipeline becomes per-rank compute actions: 1F1B (``schedule_1f1b.one_f_one_b``) with the
split documents' backwards reversed (:mod:`elastic_pipe.pipeline_order`) and the pipeline's
forward lookahead; Megatron's 1F1B order when no document is split inside it. Units are
numbered globally across pipelines and the pipelines are concatenated per rank (a rank starts
the next pipeline's forwards as soon as it is done with the previous one's backwards). The
project's passes then insert a ``RECOMPUTE`` before the backward of every (stage, chunk) with a
checkpointed layer and the transfers, and move the sends that the lookahead puts ahead of
their receivers into the batch where the receiver takes them
(:func:`~megatron.plugin.pipeline.passes.align_sends`); the result is validated (matching sends
and receives, no deadlock under rendezvous transfers) before it is returned.
"""
from __future__ import annotations

from megatron.plugin.pipeline.ir import Action, Schedule
from megatron.plugin.pipeline.passes import (add_communication, add_recomputation,
                                             align_sends)
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import SimResult, simulate
from megatron.plugin.pipeline.validation import validate

from longctx.chunk_costs import ChunkCosts
from longctx.cost_model import CostModel
from elastic_pipe.plan_types import Plan


def compute_schedule(plan: Plan, pp: int) -> Schedule:
    """Per-rank forwards and backwards of every pipeline, units numbered globally."""
    schedule: Schedule = [[] for _ in range(pp)]
    offset = 0
    for pipeline in plan.pipelines:
        n = len(pipeline.chunks)
        rows = [[Action(r, a.kind, a.unit + offset) for a in row]
                for r, row in enumerate(one_f_one_b(pp, n, list(pipeline.backward),
                                                      pipeline.lookahead))]
        for rank in range(pp):
            schedule[rank].extend(rows[rank])
        offset += n
    return schedule


def lower(plan: Plan, pp: int) -> Schedule:
    """The validated schedule of ``plan``: compute, recomputation and transfers."""
    table = plan.ckpt_table()
    schedule = add_recomputation(compute_schedule(plan, pp),
                                 lambda action: table[action.stage][action.unit] > 0)
    schedule = align_sends(add_communication(schedule, pp))
    validate(schedule)
    return schedule


class ElasticCosts(ChunkCosts):
    """:class:`ChunkCosts` of a plan's chunks and checkpointing table."""

    def __init__(self, cost: CostModel, plan: Plan):
        table = plan.ckpt_table()
        super().__init__(cost, plan.chunks(), lambda stage, unit: table[stage][unit])


class _SavedOnly(ElasticCosts):
    """The plan's costs without a running action's workspace: the bytes kept for backward,
    which the training loop's meter counts."""

    def workspace_bytes(self, action) -> float:
        return 0.0


def activation_peaks(schedule: Schedule, plan: Plan, cost: CostModel) -> list[float]:
    """Per stage, the activation bytes ``plan`` is predicted to hold at its peak: the simulator's
    memory peak of the lowered ``schedule`` less the stage's model state and reserve, without
    the workspace of the running action (set aside by the planner, not kept for backward)."""
    result = simulate(schedule, _SavedOnly(cost, plan))
    return [peak - cost.static_bytes(rank) for rank, peak in enumerate(result.peak_memory)]


def simulate_plan(plan: Plan, cost: CostModel, trace: bool = False) -> tuple[Schedule, SimResult]:
    """Lower ``plan`` and replay it: the authoritative time, bubble ratio and memory."""
    schedule = lower(plan, cost.pp)
    return schedule, simulate(schedule, ElasticCosts(cost, plan), trace=trace)
