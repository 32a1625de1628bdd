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

Cost model of a real run: the model shape comes from the Megatron flags; the hardware profile
from ``--elastic-hardware-profile`` (default: the shipped profile matching the CUDA device name,
``a800`` on CPU -- the planner then only sees relative costs); the budget from
``--elastic-memory-gb`` (default: the device's memory on CUDA, 16 GB on CPU) minus
``--elastic-reserved-gb`` (default 2 GB on CUDA, 0 on CPU). Activation and model-state bytes
are counted in the run's ``params_dtype`` (4 bytes an element in FP32, 2 in BF16 and FP16)
whichever profile prices the time; a measured profile's activation bytes are used only if they
were counted in that dtype (otherwise the run stops). Rank 0 logs once which profile the
planner uses and for which dtype. With ``--elastic-refit-interval K`` the ranks record the
executor's forward and backward times and, every ``K`` training iterations, refit the profile's
eq. 1 coefficients and backward factor to them (:mod:`elastic_pipe.refit`); the log shows the
fit and its error.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import pickle
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from megatron.plugin.batches import MicroBatch, micro_batch, pack_row
from megatron.plugin.kv_store import KVStore
from megatron.plugin.pipeline.executor import ChunkState
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers
from megatron.plugin.pipeline.run_rank import megatron_process_groups, run_this_rank
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec

from elastic_pipe.chunks import Chunk, Piece
from elastic_pipe.cost_model import CostModel, ParallelConfig
from elastic_pipe.hardware import load_profile
from elastic_pipe.evaluation import plan_schedule
from elastic_pipe.lowering import activation_peaks, lower
from elastic_pipe.presolve import BackgroundPlanner, PlanTiming
from elastic_pipe.models import ModelConfig
from elastic_pipe.plan_types import Plan
from elastic_pipe.refit import Observation, observations, refit
from elastic_pipe.scheduler import SchedulerConfig
from elastic_pipe.sequence_processor import ChunkingConfig

log = logging.getLogger(__name__)
refit_log = logging.getLogger("elastic_pipe.refit")
"""The refits' summaries (``pretrain_gpt_elastic.py`` prints them with the training lines)."""
CPU_MEMORY_GB = 16.0
_PROFILE_BY_DEVICE = (("H100", "h100"), ("H20", "h20"), ("A800", "a800"), ("A100", "a100"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("elastic pipeline (InfiniPipe) and seq1f1b")
    g.add_argument("--elastic-memory-gb", type=float, default=None,
                   help="memory budget per device, GB; default: the CUDA device's memory, "
                        f"{CPU_MEMORY_GB:g} on CPU")
    g.add_argument("--elastic-reserved-gb", type=float, default=None,
                   help="part of the budget never planned for (CUDA context, NCCL buffers, "
                        "fragmentation); default 2 on CUDA, 0 on CPU")
    g.add_argument("--elastic-hardware-profile", default=None,
                   help="a800|a100|h100|h20 or a profile JSON (scripts/profile_costs.py); default: "
                        "matched from the CUDA device name, a800 on CPU")
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


def cost_model_from_args(args: argparse.Namespace, vocab_size: int) -> CostModel:
    """The planner's cost model for this job's model (in its ``params_dtype``), layout, device
    and budget (``vocab_size`` already padded); rank 0 logs the profile and dtype it uses."""
    cuda = torch.cuda.is_available()
    profile, origin = args.elastic_hardware_profile, "--elastic-hardware-profile"
    if profile is None:
        profile, origin = "a800", "the default on CPU"
        if cuda:
            name = torch.cuda.get_device_name()
            matched = next((p for key, p in _PROFILE_BY_DEVICE if key in name), None)
            profile = matched or "a800"
            origin = f"matched from {name}" if matched else f"no shipped profile matches {name}"
    memory = args.elastic_memory_gb
    if memory is None:
        memory = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda \
            else CPU_MEMORY_GB
    reserved = args.elastic_reserved_gb
    if reserved is None:
        reserved = 2.0 if cuda else 0.0
    model = ModelConfig("custom", args.num_layers, args.hidden_size, args.num_attention_heads,
                        args.ffn_hidden_size, vocab_size,
                        dtype=str(args.params_dtype).removeprefix("torch."),
                        gated_mlp=args.swiglu)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    parallel = ParallelConfig(pp=pp, sp=cp, tp=tp, dp=max(1, world // (tp * pp * cp)),
                              memory_gb=memory, reserved_gb=reserved,
                              distributed_optimizer=args.use_distributed_optimizer)
    cost = CostModel(model, load_profile(profile), parallel)
    if not dist.is_initialized() or dist.get_rank() == 0:
        counted = "measured in" if cost.hardware.activation_coefficients else "derived for"
        log.info("%s planner: hardware profile %s (%s, %s), activation bytes %s %s",
                 args.pipeline_schedule, profile, cost.hardware.source, origin, counted,
                 model.dtype)
    return cost


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    if args.elastic_solver_time_limit <= 0:
        raise ValueError("--elastic-solver-time-limit must be > 0 seconds")
    chunking = ChunkingConfig(min_slice_tokens=args.elastic_min_slice_tokens,
                              slice_counts=None if args.elastic_slices == "auto"
                              else (args.elastic_slices,))
    return SchedulerConfig(chunking=chunking, solver_time_limit=args.elastic_solver_time_limit,
                           workers=1)


def spread_over_replicas(lengths, replicas: int, cost: CostModel) -> list[list[int]]:
    """Document indices per data-parallel replica, balancing predicted layer-forward time
    (longest processing time first; ties to the lower replica). Each list is sorted."""
    work = [cost.layer_forward(Chunk((Piece(i, 0, 0, n, True),))) for i, n in enumerate(lengths)]
    loads = [0.0] * replicas
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for index in sorted(range(len(lengths)), key=lambda i: (-work[i], i)):
        target = min(range(replicas), key=lambda r: (loads[r], r))
        loads[target] += work[index]
        shares[target].append(index)
    return [sorted(share) for share in shares]


# -- the planned batch -----------------------------------------------------------------------

@dataclass
class ChunkRows:
    """A schedule of document chunks and its input: one packed row per unit (elastic,
    seq1f1b and sppo)."""

    schedule: list[list[Action]]
    batches: list[MicroBatch]
    slices: list[tuple[tuple[int, int], ...]]
    """Per unit: ``(doc_key, slice_index)`` of the pieces that belong to split documents."""
    hidden_size: int
    token_divisor: int

    def __len__(self) -> int:
        return len(self.batches)

    def shape_of(self, action: Action) -> tuple[int, int, int]:
        return (self.batches[action.unit].seq_length // self.token_divisor, 1,
                self.hidden_size)


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


def _is_split(piece: Piece) -> bool:
    return piece.slice > 0 or not piece.final


def chunk_row(chunk: Chunk, documents, doc_ids, multiple: int) -> tuple:
    """The packed row of one chunk (pieces in order), padded to a multiple of ``multiple``."""
    docs, slices = [], []
    for piece in chunk.pieces:
        doc = doc_ids[piece.doc]
        docs.append(documents[doc][piece.start:piece.end + 1])
        slices.append((doc, piece.slice, piece.start) if _is_split(piece) else (None, 0, 0))
    return pack_row(docs, pad_to=math.ceil(chunk.tokens / multiple) * multiple, slices=slices)


def planned_batch(plan: Plan, documents, doc_ids, args, timing: PlanTiming,
                  cost: CostModel) -> PlannedBatch:
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    cp = args.context_parallel_size
    multiple = args.tensor_model_parallel_size * cp
    chunks = plan.chunks()
    batches = [micro_batch([chunk_row(chunk, documents, doc_ids, multiple)]) for chunk in chunks]
    slices = [tuple((doc_ids[p.doc], p.slice) for p in chunk.pieces if _is_split(p))
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


def replica_share(documents, cost: CostModel) -> tuple[list[int], list[int]]:
    """``(lengths of all documents, ids of this data-parallel replica's)``, spread by cost."""
    lengths = [len(doc) - 1 for doc in documents]
    dp = parallel_state.get_data_parallel_world_size()
    share = spread_over_replicas(lengths, dp, cost)[parallel_state.get_data_parallel_rank()]
    if not share:
        raise ValueError(f"--global-batch-size {len(documents)} leaves data-parallel replicas "
                         f"without documents at {dp} replicas: raise it")
    return lengths, share


def _planning_inputs(name, documents, args, model):
    """This replica's document ids and the planner's arguments for them."""
    cost = job_cost_model(args, model)
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
                              job_cost_model(args, model))
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
    cost = job_cost_model(args, model)
    profile, summary = refit(cost, [o for seen in pooled for o in seen])
    if dist.get_rank() == 0:
        refit_log.info("%s: %s", name, summary)
    if profile is not None:
        _COSTS[_cost_key(args, model)] = CostModel(cost.model, profile, cost.parallel)
    return summary


_COSTS: dict[tuple, CostModel] = {}
_COST_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "params_dtype", "swiglu", "tensor_model_parallel_size",
               "pipeline_model_parallel_size", "context_parallel_size",
               "use_distributed_optimizer", "elastic_memory_gb", "elastic_reserved_gb",
               "elastic_hardware_profile")


def _cost_key(args: argparse.Namespace, model) -> tuple:
    chunk = model[0] if isinstance(model, list) else model
    return (get_attr_wrapped_model(chunk, "vocab_size"),
            *(getattr(args, flag) for flag in _COST_FLAGS))


def job_cost_model(args: argparse.Namespace, model) -> CostModel:
    """:func:`cost_model_from_args` for this job, built once (the vocabulary from the model;
    replaced by :func:`refit_cost_model` with ``--elastic-refit-interval``)."""
    key = _cost_key(args, model)
    if key not in _COSTS:
        _COSTS[key] = cost_model_from_args(args, key[0])
    return _COSTS[key]


# -- the schedule ----------------------------------------------------------------------------

_LAYERS: "weakref.WeakKeyDictionary[torch.nn.Module, LeadingLayers]" = \
    weakref.WeakKeyDictionary()


def leading_layers(model) -> LeadingLayers:
    """The :class:`LeadingLayers` of ``model`` (one per model: it hooks the model's layers)."""
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = LeadingLayers(model)
    return layers


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
                        add_arguments=add_arguments, check_args=check_args,
                        prepare_input=prepare_input, prefetch_input=prefetch_input,
                        report=_report)


ELASTIC = _spec("elastic")
SEQ1F1B = _spec("seq1f1b")
