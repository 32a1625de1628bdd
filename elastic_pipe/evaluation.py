"""Simulated figures of a plan and of its baselines: what the CLI and the benchmark report.

Every number here comes from the project's simulator replaying the lowered schedule with
:class:`elastic_pipe.lowering.ElasticCosts` -- not from the planner's own estimate.
``recompute_time_s`` is the recomputation time summed over all stages (one GPU of each).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from megatron.plugin.pipeline.ir import Kind, format_schedule

from elastic_pipe import baselines
from longctx.cost_model import GB, CostModel
from elastic_pipe.lowering import ElasticCosts, simulate_plan
from elastic_pipe.plan_types import Plan
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic

BASELINES = ("seq1f1b", "1f1b_packed", "elastic_full_ckpt", "elastic_no_grouping")


def report(plan: Plan, cost: CostModel, with_schedule: bool = True) -> dict:
    """Simulated iteration time, bubble ratio, recompute time and per-stage peak memory."""
    schedule, result = simulate_plan(plan, cost)
    costs = ElasticCosts(cost, plan)
    recompute = sum(costs.duration(a) for row in schedule for a in row
                    if a.kind is Kind.RECOMPUTE)
    out = {"iteration_time_s": result.iteration_time, "bubble_ratio": result.bubble_ratio,
           "recompute_time_s": recompute,
           "peak_memory_gb": [peak / GB for peak in result.peak_memory],
           "memory_capacity_gb": cost.parallel.memory_gb,
           "solve_time_s": plan.solve_time_s,
           "num_chunks": len(plan.chunks()), "num_pipelines": len(plan.pipelines),
           "predicted_time_s": plan.predicted_time_s,
           "chunk_time_rsd": plan.chunk_time_rsd, "chunk_length_rsd": plan.chunk_length_rsd,
           "fallbacks": list(plan.fallbacks)}
    if with_schedule:
        out["schedule"] = format_schedule(schedule)
    return out


def baseline_plans(lengths: Sequence[int], cost: CostModel, config: SchedulerConfig,
                   context: int, elastic: Plan) -> dict[str, Plan | None]:
    """The four comparison plans (``None`` where one does not fit), each with its solve time."""
    plans = {}
    makers = {
        "seq1f1b": lambda: baselines.seq1f1b(lengths, cost, config),
        "1f1b_packed": lambda: baselines.packed_1f1b(lengths, cost, context),
        "elastic_full_ckpt": lambda: baselines.full_checkpointing(elastic, cost),
        "elastic_no_grouping": lambda: _or_none(
            lambda: plan_elastic(lengths, cost, dataclasses.replace(config, group_cuts=1))),
    }
    for name in BASELINES:
        started = time.perf_counter()
        plan = makers[name]()
        if plan is not None and not plan.solve_time_s:
            plan = dataclasses.replace(plan, solve_time_s=time.perf_counter() - started)
        plans[name] = plan
    return plans


def baseline_reports(plans: dict[str, Plan | None], cost: CostModel,
                     with_schedule: bool = True) -> dict[str, dict]:
    """``report`` of each baseline, ``{"oom": true}`` for one that does not fit."""
    return {name: {"oom": True} if plan is None else report(plan, cost, with_schedule)
            for name, plan in plans.items()}


def _or_none(make):
    """``make()``, or ``None`` when it raises the planner's out-of-memory ``ValueError``."""
    try:
        return make()
    except ValueError:
        return None
