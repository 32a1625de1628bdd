"""``--pipeline-schedule=elastic`` and ``seq1f1b``: plans of document chunks run by the executor.

Per iteration (:func:`prepare_input`, called by the training loop with the global batch):

1. the documents are spread over the data-parallel replicas so that their predicted costs
   balance (longest-processing-time first, by each document's layer-forward time);
2. each replica's documents are planned -- :func:`~elastic_pipe.scheduler.plan_elastic` for
   ``elastic``, :func:`~elastic_pipe.baselines.seq1f1b` (fixed-size chunks, uniform
   checkpointing) for ``seq1f1b`` -- and lowered to the IR, validated before anything runs.
   Every rank plans (the planner is deterministic: one CP-SAT worker, deterministic time
   limits); the ranks of one replica then compare a digest of their plans and stop with an error
   if they differ, so no rank can run a different schedule from its peers;
3. each chunk becomes one packed row (``[1, tokens]``, padded to a multiple of the TP x CP
   token split): pieces of split documents carry their document key and slice index, so the
   attention records and reads K/V context; whole documents carry none.

The schedule function then runs this rank's actions with
:class:`~megatron.plugin.pipeline.executor.ChunkState` (a fresh K/V store per iteration, the
plan's checkpointing table for this stage).

Cost model of a real run: the job's (:mod:`longctx.job_costs`: model shape and bytes per element
from the Megatron flags, ``--hardware-profile``) within ``--elastic-memory-gb`` (default: the
device's memory on CUDA, 16 GB on CPU) minus ``--elastic-reserved-gb`` (default 2 GB on CUDA, 0
on CPU). A measured profile's activation bytes are used only if they were counted in the run's
dtype (otherwise the run stops). With ``--elastic-refit-interval K`` the ranks record the
executor's forward and backward times and, every ``K`` training iterations, refit the profile's
eq. 1 coefficients and backward factor to them (:mod:`elastic_pipe.refit`); the log shows the
fit and its error.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import pickle
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin.batches import micro_batch
from megatron.plugin.kv_store import KVStore
from megatron.plugin.pipeline.executor import ChunkState
from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.layer_checkpoint import leading_layers
from megatron.plugin.pipeline.run_rank import megatron_process_groups, run_this_rank
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec

from longctx.chunk_rows import ChunkRows, chunk_row, is_split
from longctx.cost_model import CostModel
from longctx import job_costs
from longctx.job_costs import CPU_MEMORY_GB, job_cost_model, replace_job_cost_model
from longctx.replicas import replica_share

from elastic_pipe.evaluation import plan_schedule
from elastic_pipe.lowering import activation_peaks, lower
from elastic_pipe.presolve import BackgroundPlanner, PlanTiming
from elastic_pipe.plan_types import Plan
from elastic_pipe.refit import Observation, observations, refit
from elastic_pipe.scheduler import SchedulerConfig
from elastic_pipe.sequence_processor import ChunkingConfig

log = logging.getLogger(__name__)
refit_log = logging.getLogger("elastic_pipe.refit")
"""The refits' summaries (``pretrain_gpt_elastic.py`` prints them with the training lines)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("elastic pipeline (InfiniPipe) and seq1f1b")
    g.add_argument("--elastic-memory-gb", type=float, default=None,
                   help="memory budget per device, GB; default: the CUDA device's memory, "
                        f"{CPU_MEMORY_GB:g} on CPU")
    g.add_argument("--elastic-reserved-gb", type=float, default=None,
                   help="part of the budget never planned for (CUDA context, NCCL buffers, "
                        "fragmentation); default 2 on CUDA, 0 on CPU")
    g.add_argument("--elastic-solver-time-limit", type=float, default=0.2,
                   help="CP-SAT deterministic time limit per candidate pipeline, seconds")
    g.add_argument("--elastic-slices", default="auto", type=slices_flag,
                   help="slices of the longest document: N, or auto (tried 1, 2, 3, 4, 6, ... "
                        "while a slice keeps --elastic-min-slice-tokens)")
    g.add_argument("--elastic-min-slice-tokens", type=int, default=4096,
                   help="smallest first slice the automatic slice count goes down to")
    g.add_argument("--elastic-refit-interval", type=interval_flag, default=0,
                   help="every K training iterations, refit the cost model's eq. 1 "
                        "coefficients and backward factor to the executor's measured "
                        "forward and backward times (0: never)")



def check_args(args: argparse.Namespace) -> None:
    """Refuse the Megatron options ``elastic`` and ``seq1f1b`` would not honour, naming them.

    Recomputation is the plan's own (the first ``ckpt(stage, chunk)`` layers of each chunk,
    chosen by CP-SAT within ``--elastic-memory-gb``); Megatron's ``--recompute-granularity``
    would run the forward without autograd and leave the K/V that later slices read without a
    graph. Each chunk is one packed row of the plan's length, so a micro-batch size other than
    1 has nothing to count.
    """
    if args.recompute_granularity is not None:
        raise ValueError(f"{args.pipeline_schedule} checkpoints layers per chunk itself (chosen "
                         "within --elastic-memory-gb): drop --recompute-granularity, and lower "
                         "--elastic-memory-gb to make it recompute more")
    if args.micro_batch_size != 1:
        raise ValueError(f"{args.pipeline_schedule} runs each chunk as one packed row: set "
                         f"--micro-batch-size 1 (got {args.micro_batch_size}); "
                         "--global-batch-size sets the documents per iteration")


# -- planning --------------------------------------------------------------------------------

def interval_flag(value: str) -> int:
    """``--elastic-refit-interval``: a number of iterations, ``0`` for never."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: never), got {value!r}")
    return int(value)


def slices_flag(value: str):
    """``--elastic-slices``: ``"auto"`` or a positive integer."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return int(value)


def elastic_cost_model(args: argparse.Namespace, model) -> CostModel:
    """The job's cost model within ``--elastic-memory-gb`` less ``--elastic-reserved-gb``
    (replaced by :func:`refit_cost_model` with ``--elastic-refit-interval``)."""
    return job_cost_model(args, model, args.elastic_memory_gb, args.elastic_reserved_gb)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    if args.elastic_solver_time_limit <= 0:
        raise ValueError("--elastic-solver-time-limit must be > 0 seconds")
    chunking = ChunkingConfig(min_slice_tokens=args.elastic_min_slice_tokens,
                              slice_counts=None if args.elastic_slices == "auto"
                              else (args.elastic_slices,))
    return SchedulerConfig(chunking=chunking, solver_time_limit=args.elastic_solver_time_limit,
                           workers=1)


# -- the planned batch -----------------------------------------------------------------------

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


def planned_batch(plan: Plan, documents, doc_ids, args, timing: PlanTiming,
                  cost: CostModel) -> PlannedBatch:
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    cp = args.context_parallel_size
    multiple = args.tensor_model_parallel_size * cp
    chunks = plan.chunks()
    batches = [micro_batch([chunk_row(chunk, documents, doc_ids, multiple)]) for chunk in chunks]
    slices = [tuple((doc_ids[p.doc], p.slice) for p in chunk.pieces if is_split(p))
              for chunk in chunks]
    schedule = lower(plan, args.pipeline_model_parallel_size)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    planned = activation_peaks(schedule, plan, cost)[stage]
    return PlannedBatch(schedule, batches, slices, args.hidden_size, tp * cp, plan=plan,
                        timing=timing, planned_activation_bytes=planned,
                        refit=args.elastic_refit_interval > 0)


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
        _PLANNERS[name] = BackgroundPlanner(plan_schedule, timeout_s=args.pipeline_timeout_s)
    return _PLANNERS[name]


def _planning_inputs(name, documents, args, model):
    """This replica's document ids and the planner's arguments for them."""
    cost = elastic_cost_model(args, model)
    lengths, share = replica_share(documents, cost)
    key = tuple(lengths[i] for i in share)
    return share, (key, name, cost.model, cost.hardware, cost.parallel, scheduler_config(args))


def _prepare(name: str):
    def prepare_input(documents, args, model):
        """``(PlannedBatch, number of chunks)`` of this replica's documents."""
        if args.elastic_refit_interval and _MEASURED.due(args.elastic_refit_interval):
            refit_cost_model(name, args, model)
        share, inputs = _planning_inputs(name, documents, args, model)
        plan, timing = _planner(name, args).take(*inputs)
        _check_agreement(plan)
        batch = planned_batch(plan, documents, share, args, timing,
                              elastic_cost_model(args, model))
        log.info("%s plan: %d chunks in %d pipelines, predicted %.3f s, solved in %.2f s, "
                 "%.2f s of it hidden", name, len(batch), len(plan.pipelines),
                 plan.predicted_time_s, timing.solve_s, timing.solve_s - timing.waited_s)
        return batch, len(batch)

    def prefetch_input(documents, args, model):
        """Start planning the next batch's documents in the background."""
        _, inputs = _planning_inputs(name, documents, args, model)
        _planner(name, args).submit(*inputs)

    return prepare_input, prefetch_input


class _Measured:
    """Observations of the training iterations since the last refit (this rank's, whichever
    document schedule ran them: they measure the same layers on the same machine)."""

    def __init__(self):
        self.seen: list[Observation] = []
        self.iterations = 0

    def due(self, interval: int) -> bool:
        return self.iterations >= interval

    def record(self, planned: "PlannedBatch", stage: int, events: list) -> None:
        units = {str(a): (a.kind, a.unit) for a in planned.schedule[stage]
                 if a.kind in (Kind.FORWARD, Kind.BACKWARD)}
        times: dict[int, list[float]] = {}
        for event in events:
            if event.category == "compute" and event.name in units:
                kind, unit = units[event.name]
                times.setdefault(unit, [0.0, 0.0])[kind is Kind.BACKWARD] += event.duration
        self.seen.extend(observations(stage, planned.plan.chunks(),
                                      {u: (f, b) for u, (f, b) in times.items()}))
        self.iterations += 1


_MEASURED = _Measured()


def refit_cost_model(name: str, args, model) -> str:
    """Pool every rank's observations, refit the job's cost model to them (every rank gets
    the same figures, so the ranks keep planning alike) and start counting again; ``name``
    labels the log line, which is also returned. Collective: every rank calls it at the same
    point. The plan the background worker made with the old figures is not used: every rank
    plans the next batch again in the foreground with the new ones."""
    measured = _MEASURED
    pooled = [None] * dist.get_world_size()
    dist.all_gather_object(pooled, measured.seen)
    measured.seen, measured.iterations = [], 0
    cost = elastic_cost_model(args, model)
    profile, summary = refit(cost, [o for seen in pooled for o in seen])
    if dist.get_rank() == 0:
        refit_log.info("%s: %s", name, summary)
    if profile is not None:
        replace_job_cost_model(args, model, CostModel(cost.model, profile, cost.parallel),
                               args.elastic_memory_gb, args.elastic_reserved_gb)
    return summary


# -- the schedule ----------------------------------------------------------------------------

def _run(call: RankCall) -> list:
    """This rank's actions of the planned batch, with a fresh K/V store and the plan's
    checkpointing table for this stage."""
    planned = call.input
    groups = megatron_process_groups()
    rank = groups.pp.rank()
    stage = planned.plan.ckpt_table()[rank]
    chunks = ChunkState(kv_store=KVStore(), layers=leading_layers(call.model),
                        checkpointed=stage.__getitem__, slices=planned.slices.__getitem__)
    events = [] if planned.refit and not call.forward_only else None
    result = run_this_rank(planned.schedule, groups, call, data_iterator=iter(planned.batches),
                           shape_of=planned.shape_of, chunks=chunks, events=events)
    if events is not None:
        _MEASURED.record(planned, rank, events)
    return result


def _report(planned: PlannedBatch) -> dict:
    return {"planned_activation_bytes": planned.planned_activation_bytes,
            "plan_solve_s": planned.timing.solve_s, "plan_wait_s": planned.timing.waited_s}


def _spec(name: str) -> ScheduleSpec:
    prepare_input, prefetch_input = _prepare(name)
    return ScheduleSpec(name, run=_run, input_type=PlannedBatch,
                        argument_groups=(job_costs.add_arguments, add_arguments),
                        check_args=check_args,
                        prepare_input=prepare_input, prefetch_input=prefetch_input,
                        report=_report)


ELASTIC = _spec("elastic")
SEQ1F1B = _spec("seq1f1b")
