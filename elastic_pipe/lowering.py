"""A plan as the project's schedule IR, and the cost adapter that prices it in the simulator.

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

from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.passes import (add_communication, add_recomputation,
                                             align_sends)
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import SimResult, simulate
from megatron.plugin.pipeline.validation import validate

from elastic_pipe.cost_model import CostModel
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


class ChunkCosts:
    """The simulator's cost protocol for units that are chunks: forward, backward, transfers
    and stash from the cost model; ``checkpointed(stage, unit)`` layers recomputed.

    A ``RECOMPUTE`` rematerialises all the unit's checkpointed layers at once, as this project's
    runtime does; ``per_layer_recompute`` prices Megatron's full recomputation instead, which
    rebuilds one layer at a time inside the backward (a transient of one layer)."""

    def __init__(self, cost: CostModel, chunks, checkpointed, per_layer_recompute: bool = False):
        self.cost = cost
        self.chunks = chunks
        self.checkpointed = checkpointed
        self.per_layer_recompute = per_layer_recompute

    def duration(self, action: Action) -> float:
        chunk = self.chunks[action.unit]
        if action.kind is Kind.FORWARD:
            return self.cost.stage_forward(action.stage, chunk)
        if action.kind is Kind.BACKWARD:
            return self.cost.stage_backward(action.stage, chunk)
        if action.kind is Kind.RECOMPUTE:
            return self.checkpointed(action.stage, action.unit) * self.cost.layer_forward(chunk)
        raise ValueError(f"a schedule of chunks has no {action.kind.value} actions: {action}")

    def transfer_time(self, action: Action) -> float:
        return self.cost.p2p_time(self.chunks[action.unit])

    def activation_bytes(self, action: Action) -> float:
        chunk = self.chunks[action.unit]
        if action.kind is Kind.RECOMPUTE:
            layers = 1 if self.per_layer_recompute else self.checkpointed(action.stage,
                                                                          action.unit)
            return layers * self.cost.layer_saving(chunk)
        return self.cost.stash_bytes(action.stage, chunk,
                                     self.checkpointed(action.stage, action.unit))

    def static_bytes(self, rank: int) -> float:
        return self.cost.static_bytes(rank)


class ElasticCosts(ChunkCosts):
    """:class:`ChunkCosts` of a plan's chunks and checkpointing table."""

    def __init__(self, cost: CostModel, plan: Plan):
        table = plan.ckpt_table()
        super().__init__(cost, plan.chunks(), lambda stage, unit: table[stage][unit])


def activation_peaks(schedule: Schedule, plan: Plan, cost: CostModel) -> list[float]:
    """Per stage, the activation bytes ``plan`` is predicted to hold at its peak: the simulator's
    memory peak of the lowered ``schedule`` less the stage's model state and reserve."""
    result = simulate(schedule, ElasticCosts(cost, plan))
    return [peak - cost.static_bytes(rank) for rank, peak in enumerate(result.peak_memory)]


def simulate_plan(plan: Plan, cost: CostModel, trace: bool = False) -> tuple[Schedule, SimResult]:
    """Lower ``plan`` and replay it: the authoritative time, bubble ratio and memory."""
    schedule = lower(plan, cost.pp)
    return schedule, simulate(schedule, ElasticCosts(cost, plan), trace=trace)
