"""One replica's planned batch: the documents spread over the replicas by cost, planned in the
background while the previous batch trains (:class:`~elastic_pipe.presolve.BackgroundPlanner`),
checked to agree across the replica's ranks, lowered, and cut into chunk rows."""
from __future__ import annotations

import functools
import hashlib
import logging
import pickle
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin.default_loss import unit_weights
from megatron.plugin.pipeline import run_settings
from megatron.plugin.pipeline.simulator import simulate
from megatron.plugin.reporting import summary_level

from longctx.chunk_rows import ChunkRows, chunk_batch, is_split
from longctx.cost_model import CostModel
from longctx.replicas import replica_share

from elastic_pipe.planning import plan_schedule, plan_schedule_with_workers
from elastic_pipe.flags import scheduler_config
from elastic_pipe.lowering import ElasticCosts, activation_peaks, lower
from elastic_pipe.plan_types import Plan
from elastic_pipe.presolve import BackgroundPlanner, PlanTiming, planner_processes
from elastic_pipe.run_costs import (MEASURED, elastic_cost_model, refit_cost_model,
                                    refit_interval)

log = logging.getLogger(__name__)


@dataclass
class PlannedBatch(ChunkRows):
    """One replica's plan, its lowered schedule and the chunk rows (the schedule's input)."""

    plan: Plan
    timing: PlanTiming
    planned_activation_bytes: float
    """The activation peak the plan predicts for this rank's stage (the training log shows it
    beside the measured one)."""
    refit: bool = False
    """Record the measured action times (``--elastic-refit-interval``)."""
    predicted: tuple = ()
    """The plan's simulated timeline (:class:`~megatron.plugin.pipeline.chrome_trace.TraceEvent`
    s), kept on the first pipeline stage when the run writes traces (``--trace-dir``)."""


def planned_batch(plan: Plan, documents, doc_ids, args, timing: PlanTiming,
                  cost: CostModel) -> PlannedBatch:
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    cp = args.context_parallel_size
    multiple = args.tensor_model_parallel_size * cp
    chunks = plan.chunks()
    weights = unit_weights(args, documents, len(chunks))
    batches = [chunk_batch(chunk, documents, doc_ids, multiple, weights) for chunk in chunks]
    slices = [tuple((doc_ids[p.doc], p.slice) for p in chunk.pieces if is_split(p))
              for chunk in chunks]
    schedule = lower(plan, args.pipeline_model_parallel_size)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    planned = activation_peaks(schedule, plan, cost)[stage]
    predicted = tuple(simulate(schedule, ElasticCosts(cost, plan)).events) \
        if stage == 0 and run_settings.tracing() else ()
    return PlannedBatch(schedule, batches, slices, args.hidden_size, tp * cp, plan=plan,
                        timing=timing, planned_activation_bytes=planned,
                        refit=MEASURED.timing(refit_interval(args)),
                        predicted=predicted)


def _check_agreement(plan: Plan) -> None:
    """Every rank of this replica planned the same (one digest compared per group)."""
    digest = hashlib.sha256(pickle.dumps(plan.to_dict())).hexdigest()
    for group in (parallel_state.get_pipeline_model_parallel_group(),
                  parallel_state.get_tensor_model_parallel_group(),
                  parallel_state.get_context_parallel_group()):
        if dist.get_world_size(group) == 1:
            continue
        digests = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, digest, group=group)
        if len(set(digests)) != 1:
            raise RuntimeError("the ranks of one model replica planned different schedules for "
                               "the same documents; the planner must be deterministic "
                               "(check --elastic-solver-time-limit and the profile files)")


_PLANNERS: dict[str, BackgroundPlanner] = {}


def _planner(name: str, args) -> BackgroundPlanner:
    if name not in _PLANNERS:
        _PLANNERS[name] = BackgroundPlanner(
            plan_schedule, timeout_s=args.pipeline_timeout_s,
            worker_fn=functools.partial(plan_schedule_with_workers, planner_processes()))
    return _PLANNERS[name]


def _planning_inputs(name, documents, args, model):
    """This replica's document ids and the planner's arguments for them."""
    cost = elastic_cost_model(args, model)
    lengths, share = replica_share(documents, cost)
    key = tuple(lengths[i] for i in share)
    return share, (key, name, cost.model, cost.hardware, cost.parallel, scheduler_config(args))


def input_functions(name: str):
    """``(prepare_input, prefetch_input)`` of schedule ``name`` (``ScheduleSpec``)."""
    def prepare_input(documents, args, model):
        """``(PlannedBatch, number of chunks)`` of this replica's documents."""
        if MEASURED.due(refit_interval(args)):
            refit_cost_model(name, args, model)
        share, inputs = _planning_inputs(name, documents, args, model)
        plan, timing = _planner(name, args).take(*inputs)
        _check_agreement(plan)
        batch = planned_batch(plan, documents, share, args, timing,
                              elastic_cost_model(args, model))
        log.log(summary_level(), "%s plan: %d chunks in %d pipelines, predicted %.3f s, "
                "solved in %.2f s, waited %.2f s for it", name, len(batch), len(plan.pipelines),
                plan.predicted_time_s, timing.solve_s, timing.waited_s)
        return batch, len(batch)

    def prefetch_input(documents, args, model):
        """Start planning the next batch's documents in the background."""
        _, inputs = _planning_inputs(name, documents, args, model)
        _planner(name, args).submit(*inputs)

    return prepare_input, prefetch_input
