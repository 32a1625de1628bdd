"""The ``sppo`` schedule's input for one global batch: this replica's documents planned
(:mod:`sppo_offload.batch_plan`), their schedule built and each subsequence packed into a row,
with the activation offloader of this stage. The offloader writes into this stage's host tier,
kept across iterations (its arena is allocated once, sized for each iteration from the plan's
predicted host bytes of the stage)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin.default_loss import unit_weights
from megatron.plugin.pipeline.ir import Action
from megatron.plugin.pipeline.offload import ActivationOffloader, HostMemory, host_tier
from megatron.plugin.reporting import summary_level

from longctx.chunk_rows import ChunkRows, chunk_batch
from longctx.cost_model import GB, CostModel
from longctx.fixed_checkpointing import fixed_checkpointing
from longctx.job_costs import job_cost_model
from longctx.replicas import replica_share

from sppo_offload.batch_plan import (SubsequencePlan, check_budget, fastest_plan, megatron_plan,
                                     plan_subsequences, replay)
from sppo_offload.flags import memory_budget_gb
from sppo_offload.multiplex import (min_tokens, multiplexed_peaks, multiplexed_schedule,
                                   piece_tokens)
from sppo_offload.mux_runtime import block_groups
from sppo_offload.offload import AUTO, OFF
from sppo_offload.pipeline import build_schedule

log = logging.getLogger(__name__)

_TIERS: dict[tuple, HostMemory] = {}
"""The host tier of each device and capacity, made once in a process."""


def _tier(device, capacity: int | None) -> HostMemory:
    key = (str(device), capacity)
    if key not in _TIERS:
        _TIERS[key] = host_tier(device, capacity)
    return _TIERS[key]


@dataclass
class SubsequenceBatch(ChunkRows):
    """One replica's subsequences, their schedule, rows and this stage's offloader."""

    subsequences: SubsequencePlan
    offloader: ActivationOffloader
    multiplex: bool = False
    """The schedule is :func:`~sppo_offload.multiplex.multiplexed_schedule` (unit 0's shares
    run by :class:`~sppo_offload.mux_runtime.MultiplexProgram`)."""
    planned_activation_bytes: float | None = None
    """This stage's simulated peak device bytes less its model state: what the plan predicts
    the activations hold (the training loop reports it beside the measured peak)."""

    def shape_of(self, action: Action) -> tuple[int, int, int]:
        if action.part is None:
            return super().shape_of(action)
        tokens = piece_tokens(action, self.batches[0].seq_length, len(self.schedule))
        return (tokens, 1, self.hidden_size)


def prepare_input(documents, args, model):
    """``(SubsequenceBatch, number of units)`` of this replica's documents."""
    cost = job_cost_model(args, model)
    lengths, share = replica_share(documents, cost)
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    mine = [lengths[i] for i in share]
    host_gb = args.sppo_host_memory_gb
    fixed = fixed_checkpointing(args)
    checkpointed = () if fixed is None else tuple(fixed.layers(cost.layers(stage))
                                                  for stage in range(cost.pp))
    chunk = model[0] if isinstance(model, list) else model
    capacity = None if host_gb is None else int(host_gb * GB)
    tier = _tier(next(chunk.parameters()).device, capacity)
    host_gbps = math.inf if tier.synchronous else None
    plan, peaks = plan_batch(mine, cost, args, checkpointed, host_gbps)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    tier.start_step(replay(plan, cost, host_gbps)[1][stage])
    offloaded = lambda action: plan.alphas[action.stage][action.unit] > 0  # noqa: E731
    if args.sppo_multiplex:
        peaks = _check_multiplexable(plan, cost, memory_budget_gb(args), host_gbps)
        schedule = multiplexed_schedule(cost.pp, plan.counts[0], offloaded)
        block_groups(tuple(dist.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group())))
    else:
        schedule = build_schedule(cost.pp, plan.counts, offloaded,
                                  recomputed=lambda action: plan.recomputes(action.stage) > 0)
    weights = unit_weights(args, documents, len(plan.chunks))
    batches = [chunk_batch(chunk, documents, share, tp * cp, weights) for chunk in plan.chunks]
    slices = [((share[chunk.pieces[0].doc], chunk.pieces[0].slice),)
              if plan.is_slice(unit) else () for unit, chunk in enumerate(plan.chunks)]
    offloader = ActivationOffloader(tier, plan.alphas[stage].__getitem__)
    divisor = (tp if args.sequence_parallel else 1) * cp
    batch = SubsequenceBatch(schedule, batches, slices, args.hidden_size, divisor,
                             subsequences=plan, offloader=offloader,
                             multiplex=args.sppo_multiplex,
                             planned_activation_bytes=peaks[stage] - cost.static_bytes(stage))
    log.log(summary_level(), "sppo plan: %d documents in %d units, %d offloaded and %d layers "
            "of each recomputed on stage %d", len(share), len(batch),
            sum(a > 0 for a in plan.alphas[stage]), plan.recomputes(stage), stage)
    return batch, len(batch)


def plan_batch(lengths, cost: CostModel, args, checkpointed: tuple[int, ...],
               host_gbps: float | None) -> tuple[SubsequencePlan, list[float]]:
    """The plan of one replica's documents of ``lengths`` tokens and its simulated peak device
    bytes per stage: planned within ``--sppo-memory-gb`` and ``--sppo-host-memory-gb``
    (:func:`_plan`) and refused before any compute where it does not fit them
    (:func:`~sppo_offload.batch_plan.check_budget`)."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    plan = _plan(lengths, cost, args, checkpointed, host_gbps)
    return plan, check_budget(lengths, plan, cost, args.sppo_subsequences, args.sppo_offload,
                              memory_budget_gb(args), args.sppo_host_memory_gb, tp * cp,
                              host_gbps)


def _plan(lengths, cost: CostModel, args, checkpointed: tuple[int, ...],
          host_gbps: float | None) -> SubsequencePlan:
    """The subsequences of documents of ``lengths`` tokens; under ``--sppo-subsequences auto``
    with ``--sppo-offload auto`` or ``off`` (no fixed ratio to honour) and no
    ``--sppo-multiplex`` (which cuts one document), Megatron-LM's micro-batches where they fit
    and are predicted no slower (:func:`~sppo_offload.batch_plan.fastest_plan`)."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    host_gb = args.sppo_host_memory_gb
    cap = None if host_gb is None else host_gb * GB
    plan = plan_subsequences(lengths, cost, args.sppo_subsequences, args.sppo_offload, tp * cp,
                             cap, checkpointed=checkpointed)
    if args.sppo_subsequences != AUTO or args.sppo_offload not in (AUTO, OFF) \
            or args.sppo_multiplex:
        return plan
    megatron = megatron_plan(lengths, cost, args.seq_length, args.micro_batch_size,
                             args.sppo_offload, cap, checkpointed)
    return fastest_plan(plan, megatron, cost, memory_budget_gb(args), host_gbps)


def _check_multiplexable(plan: SubsequencePlan, cost: CostModel, memory_gb: float,
                         host_gbps: float | None = None) -> list[float] | None:
    """Multiplexing fills the warm-up and cool-down of one sequence's pipeline, and must fit
    the memory budget the plain schedule was planned for (its helpers hold the weights they
    borrow: the simulated peak is refused when over ``memory_gb``, naming the stage). Every
    rank learns every replica's verdict (one gather) and they all raise the first problem
    found, so no replica is left waiting in a collective for one that stopped. Returns the
    multiplexed schedule's simulated peak device bytes per stage, its copies at ``host_gbps``
    (:func:`~sppo_offload.multiplex.multiplexed_peaks`)."""
    problem, peaks = None, None
    pp = cost.pp
    first = plan.chunks[0].pieces[0].tokens
    documents = len({piece.doc for chunk in plan.chunks for piece in chunk.pieces})
    if documents != 1:
        problem = (f"--sppo-multiplex splits the first subsequence of one document; a "
                   f"data-parallel replica got {documents} documents (with several, the "
                   f"next document already fills the drain): train one document per replica "
                   f"(--global-batch-size equal to the data-parallel size) or drop "
                   f"--sppo-multiplex")
    elif plan.counts[0] < 2 or first < min_tokens(pp):
        problem = (f"--sppo-multiplex needs at least 2 subsequences and a first subsequence of "
                   f"at least {min_tokens(pp)} tokens on {pp} stages; got {plan.counts[0]} "
                   f"subsequences, the first of {first} tokens: use fewer --sppo-subsequences "
                   f"(at least 2), longer documents, or drop --sppo-multiplex")
    else:
        peaks = multiplexed_peaks(cost, [chunk.pieces[0].tokens for chunk in plan.chunks],
                                  plan.alphas, host_gbps)
        if max(peaks) > memory_gb * GB:
            stage = peaks.index(max(peaks))
            problem = (f"--sppo-multiplex: the multiplexed schedule of this batch needs "
                       f"{max(peaks) / GB:.4g} GB on stage {stage} (its helpers hold the "
                       f"weights they borrow), more than --sppo-memory-gb {memory_gb:g}, "
                       f"which the plain schedule fits: raise --sppo-memory-gb to at least "
                       f"{math.ceil(max(peaks) / GB * 100) / 100:g}, or drop --sppo-multiplex")
    verdicts = [problem]
    if dist.is_initialized():
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
    found = next((verdict for verdict in verdicts if verdict is not None), None)
    if found is not None:
        raise ValueError(found)
    return peaks
