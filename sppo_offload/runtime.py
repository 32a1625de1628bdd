"""``--pipeline-schedule=sppo``: SPPO's subsequence pipeline with adaptive offloading, trained.

Per iteration (:func:`prepare_input`, called by the training loop with the global batch):

1. the documents are spread over the data-parallel replicas by predicted cost (the elastic
   :func:`~longctx.replicas.replica_share`);
2. every document of this replica's share is cut into ``N`` FLOPs-balanced subsequences
   (:func:`~sppo_offload.partition.balanced_lengths` with the job's cost-model coefficients);
   a document of fewer than ``N`` tokens into as many one-token subsequences as it has tokens.
   ``N`` is ``--sppo-subsequences``, or with ``auto`` the smallest count the solver considers
   for the job's layout (:func:`~sppo_offload.solver.subsequence_counts`): the fewest
   subsequences, at least ``PP``, whose tokens per device (``S / (N x TP x CP)``) stay within
   the solver's 16K band top -- ``N = PP`` for every document shorter than that, as in the
   tiny CPU runs;
3. each subsequence is one unit: one packed row (padded to a multiple of the TP x CP token
   split) whose piece records its K/V and reads those of the document's earlier subsequences
   (the K/V-context execution of the elastic schedule's split chunks); a document of one
   subsequence is a whole document;
4. one pipeline over all the share's subsequences (:mod:`sppo_offload.pipeline`, several
   sequences): documents one after the other, each document's backwards last-first, the next
   document's forwards filling the current one's drain. One document is the SPPO case; a batch
   of several is trained in the same order of gradient additions whatever ``N``;
5. offload ratios per document and stage (:func:`~sppo_offload.offload.offload_ratios`:
   ``--sppo-offload auto`` sizes them to the hardware profile's host link, ``off`` moves
   nothing, a ``RATIO`` is used for every subsequence but a document's last); every unit with
   a positive ratio gets an ``OFFLOAD`` / ``RELOAD`` pair
   (:func:`~sppo_offload.pipeline.add_offload`), which the executor runs with an
   :class:`~megatron.plugin.pipeline.offload.ActivationOffloader` into a host tier of
   ``--sppo-host-memory-gb`` (pinned buffers and a side stream on CUDA). Under that cap the
   ``auto`` ratios of each document are lowered largest first, as the solver does
   (:func:`~sppo_offload.offload.capped`); a fixed ``RATIO`` is not lowered;
6. before any rank computes, :func:`check_budget` replays the batch's schedule in the
   simulator with the same cost model: when the predicted host bytes of a stage exceed
   ``--sppo-host-memory-gb``, or its peak device memory exceeds ``--sppo-memory-gb`` (default:
   the CUDA device's memory, 16 GB on CPU as for ``--elastic-memory-gb``), every rank stops
   with an error naming the number to change -- the host budget the ratios need, or the
   smallest device budget that fits (the ``auto`` ratios raised to 1 within the host cap, the
   solver's most memory-saving option), or that the batch cannot fit even fully offloaded.
   The executor's own host-tier check (:class:`~megatron.plugin.pipeline.offload.HostMemory`)
   stays as the guard on the real bytes.

With ``--sppo-multiplex`` (one document per replica) the schedule is
:func:`~sppo_offload.multiplex.multiplexed_schedule`: the first subsequence's shares run through
the executor's part program :class:`~sppo_offload.mux_runtime.MultiplexProgram`, the steady
subsequences whole-stage as above (the shares are not offloaded); step 6 replays the plain
schedule of the same subsequences.

Every rank plans the same schedule: the plan is arithmetic on the document lengths and the
flags, with no solver time limit involved. The cost model is the job's
(:func:`~longctx.job_costs.job_cost_model`: model shape and bytes per element from the
Megatron flags and ``params_dtype``; hardware profile from ``--hardware-profile``, by default
matched from the CUDA device name, ``a800`` on CPU; its ``host_link_gbps`` prices the
``auto`` ratios).
"""
from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin.batches import micro_batch
from megatron.plugin.kv_store import KVStore
from megatron.plugin.pipeline.executor import ChunkState
from megatron.plugin.pipeline.layer_checkpoint import leading_layers
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.offload import ActivationOffloader, host_tier
from megatron.plugin.pipeline.run_rank import megatron_process_groups, run_this_rank
from megatron.plugin.pipeline.simulator import simulate
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec

from longctx.chunk_rows import ChunkRows, chunk_row
from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel
from longctx import job_costs
from longctx.job_costs import CPU_MEMORY_GB, job_cost_model
from longctx.replicas import replica_share

from sppo_offload.costs import OffloadCosts
from sppo_offload.multiplex import min_tokens, multiplexed_schedule, piece_tokens
from sppo_offload.mux_runtime import MultiplexProgram, block_groups
from sppo_offload.offload import (AUTO, capped_ratios, offload_ratios, offloadable_bytes,
                                  parse_offload, raised)
from sppo_offload.partition import balanced_lengths, starts
from sppo_offload.pipeline import build_schedule, sppo_ir
from sppo_offload.solver import SolverConfig

log = logging.getLogger(__name__)
NAME = "sppo"


def subsequences_flag(value: str):
    """``--sppo-subsequences``: ``"auto"`` or a positive integer."""
    if value == AUTO:
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return int(value)


def offload_flag(value: str):
    """``--sppo-offload``: ``"auto"``, ``"off"`` or a ratio in ``[0, 1]``."""
    try:
        return parse_offload(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("subsequence pipeline with offloading (SPPO)")
    g.add_argument("--sppo-subsequences", default=AUTO, type=subsequences_flag,
                   help="subsequences N per document (N >= pipeline stages), or auto: the "
                        "fewest, at least PP, that keep 16K tokens per device or fewer")
    g.add_argument("--sppo-offload", default=AUTO, type=offload_flag,
                   help="auto (ratios sized to the host link of the hardware profile), off, "
                        "or a ratio in [0, 1] of every subsequence's offloadable activations "
                        "(a document's last subsequence is never offloaded)")
    g.add_argument("--sppo-host-memory-gb", type=float, default=None,
                   help="host memory one rank's offloaded activations may use, GB; default: "
                        "no limit")
    g.add_argument("--sppo-multiplex", action="store_true",
                   help="multiplexed sequence partitioning: the first subsequence's forward "
                        "and backward run split over the stages that would idle in the "
                        "warm-up and cool-down (one document per data-parallel replica; see "
                        "sppo_offload/multiplex.py)")
    g.add_argument("--sppo-memory-gb", type=float, default=None,
                   help="device memory budget per GPU the batch's plan is checked against "
                        f"before computing, GB; default: the CUDA device's memory, "
                        f"{CPU_MEMORY_GB:g} on CPU")



def check_args(args: argparse.Namespace) -> None:
    """Refuse what ``sppo`` cannot run, naming the flag to change."""
    pp = args.pipeline_model_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError("sppo runs one model chunk per rank: drop "
                         "--num-layers-per-virtual-pipeline-stage")
    if args.sppo_subsequences != AUTO and args.sppo_subsequences < pp:
        raise ValueError(f"--sppo-subsequences {args.sppo_subsequences} is smaller than "
                         f"--pipeline-model-parallel-size {pp}: the subsequence pipeline needs "
                         f"N >= PP; use at least {pp} subsequences, or auto")
    if args.recompute_granularity is not None:
        raise ValueError("sppo keeps activations by offloading them, not by recomputation: drop "
                         "--recompute-granularity (elastic and seq1f1b checkpoint per chunk)")
    if args.micro_batch_size != 1:
        raise ValueError(f"sppo runs each subsequence as one row: set --micro-batch-size 1 "
                         f"(got {args.micro_batch_size}); --global-batch-size sets the "
                         "documents per iteration")
    if args.sppo_multiplex:
        if pp < 2:
            raise ValueError("--sppo-multiplex fills pipeline bubbles: it needs "
                             "--pipeline-model-parallel-size >= 2")
        if args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1:
            raise ValueError("--sppo-multiplex runs with --tensor-model-parallel-size 1 and "
                             "--context-parallel-size 1: set both to 1, or drop "
                             "--sppo-multiplex")
    if args.sppo_host_memory_gb is not None and args.sppo_host_memory_gb <= 0:
        raise ValueError(f"--sppo-host-memory-gb must be > 0, got {args.sppo_host_memory_gb}")
    if args.sppo_memory_gb is not None and args.sppo_memory_gb <= 0:
        raise ValueError(f"--sppo-memory-gb must be > 0, got {args.sppo_memory_gb}")


def memory_budget_gb(args: argparse.Namespace) -> float:
    """``--sppo-memory-gb``, by default the CUDA device's memory, ``CPU_MEMORY_GB`` on CPU."""
    if args.sppo_memory_gb is not None:
        return args.sppo_memory_gb
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GB
    return CPU_MEMORY_GB


# -- planning (pure) ---------------------------------------------------------------------------

def auto_subsequences(tokens: int, pp: int, token_split: int) -> int:
    """``--sppo-subsequences auto`` for a ``tokens``-token document (module doc, step 2)."""
    return max(pp, math.ceil(tokens / (token_split * SolverConfig.max_tokens)))


@dataclass(frozen=True)
class SubsequencePlan:
    """The subsequences of one replica's documents and their offload ratios."""

    counts: tuple[int, ...]
    """Subsequences per document, in the order of the documents."""
    chunks: tuple[Chunk, ...]
    """One one-piece chunk per unit (``Piece.doc``: the document's position in the share)."""
    alphas: tuple[tuple[float, ...], ...]
    """Offload ratio per stage and unit."""

    def to_dict(self) -> dict:
        return {"counts": list(self.counts),
                "lengths": [c.pieces[0].tokens for c in self.chunks],
                "alphas": [list(row) for row in self.alphas]}


def plan_subsequences(lengths, cost: CostModel, subsequences, offload, token_split: int = 1,
                      host_cap_bytes: float | None = None,
                      most_saving: bool = False) -> SubsequencePlan:
    """Cut documents of ``lengths`` tokens into subsequences and choose their offload ratios
    (module doc, steps 2 and 5) for the stages of ``cost``'s layout. ``auto`` ratios are
    capped to ``host_cap_bytes`` per document and stage; ``most_saving`` raises them to 1
    first (the solver's most memory-saving option; a fixed ratio or ``off`` stays)."""
    counts, chunks = [], []
    alphas: list[list[float]] = [[] for _ in range(cost.pp)]
    for doc, tokens in enumerate(lengths):
        wanted = auto_subsequences(tokens, cost.pp, token_split) if subsequences == AUTO \
            else subsequences
        cut = balanced_lengths(tokens, min(wanted, tokens), cost.linear_per_token, cost.alpha1)
        mine = tuple(Chunk((Piece(doc, j, start, start + length, j == len(cut) - 1),))
                     for j, (start, length) in enumerate(zip(starts(cut), cut)))
        ratios = offload_ratios(cost, mine, offload, cost.hardware.host_link_gbps)
        if offload == AUTO and most_saving:
            ratios = raised(ratios, 1.0)
        if offload == AUTO and host_cap_bytes is not None:
            ratios = capped_ratios(cost, mine, ratios, host_cap_bytes)
        for stage, row in enumerate(ratios):
            alphas[stage].extend(row)
        counts.append(len(cut))
        chunks.extend(mine)
    return SubsequencePlan(tuple(counts), tuple(chunks), tuple(tuple(row) for row in alphas))


def check_budget(lengths, plan: SubsequencePlan, cost: CostModel, subsequences, offload,
                 memory_gb: float, host_memory_gb: float | None, token_split: int = 1) -> None:
    """Raise before any compute when the plan of documents of ``lengths`` tokens does not fit
    (module doc, step 6); ``subsequences``, ``offload`` and ``token_split`` as planned."""
    peak, host = replay(plan, cost)
    if host_memory_gb is not None and max(host) > host_memory_gb * GB:
        stage = host.index(max(host))
        raise ValueError(
            f"sppo: the offload ratios of this batch (--sppo-offload {offload}) put "
            f"{max(host) / GB:.4g} GB of activations in host memory on stage {stage}, more than "
            f"--sppo-host-memory-gb {host_memory_gb:g}; raise it to at least "
            f"{_ceil_gb(max(host)):g}" + (", or lower --sppo-offload, or use auto (it lowers "
                                          "the ratios to fit)" if offload != AUTO else ""))
    if max(peak) <= memory_gb * GB:
        return
    cap = None if host_memory_gb is None else host_memory_gb * GB
    saver = plan if offload != AUTO else plan_subsequences(
        lengths, cost, subsequences, offload, token_split, cap, most_saving=True)
    least = _ceil_gb(max(replay(saver, cost)[0]))
    message = (f"sppo: this batch ({len(lengths)} documents of {max(lengths)} tokens at most, "
               f"{len(plan.chunks)} subsequences) needs {max(peak) / GB:.4g} GB per GPU, more "
               f"than --sppo-memory-gb {memory_gb:g}; ")
    how = "fully offloaded" + ("" if cap is None else
                               f" within {host_memory_gb:g} GB of host memory")
    if offload != AUTO:
        message += (f"the smallest budget that fits with --sppo-offload {offload} is "
                    f"{least:g} GB; or let SPPO choose the ratios (--sppo-offload auto)")
    elif least > cost.hardware.hbm_gb:
        message += (f"it cannot fit even {how} ({least:g} GB, more than the "
                    f"{cost.hardware.hbm_gb:g} GB of one {cost.hardware.name} GPU); use more "
                    f"GPUs or shorter sequences")
    else:
        message += f"the smallest budget that fits is {least:g} GB ({how})"
    raise ValueError(message)


def replay(plan: SubsequencePlan, cost: CostModel) -> tuple[list[float], list[float]]:
    """``(peak device bytes, peak host bytes)`` per stage of the batch's schedule, simulated
    with ``cost``: an ``OFFLOAD`` puts its unit's predicted bytes in host memory, its
    ``RELOAD`` takes them back, in the order each rank runs them."""
    offloaded = [[a * offloadable_bytes(cost, stage, chunk) if a else 0.0
                  for a, chunk in zip(row, plan.chunks)] for stage, row in enumerate(plan.alphas)]
    schedule = build_schedule(cost.pp, plan.counts,
                              lambda action: plan.alphas[action.stage][action.unit] > 0)
    result = simulate(schedule, OffloadCosts(cost, plan.chunks, offloaded, None,
                                             cost.hardware.host_link_gbps), trace=False)
    host = []
    for stage, row in enumerate(schedule):
        held = most = 0.0
        for action in row:
            if action.is_memory():
                held += offloaded[stage][action.unit] * (1 if action.kind is Kind.OFFLOAD
                                                         else -1)
                most = max(most, held)
        host.append(most)
    return list(result.peak_memory), host


def _ceil_gb(nbytes: float) -> float:
    """``nbytes`` in GB rounded up to four significant digits (the figure an error names)."""
    gb = nbytes / GB
    scale = 10.0 ** (3 - math.floor(math.log10(gb)))
    return math.ceil(gb * scale) / scale


# -- the planned batch -------------------------------------------------------------------------

@dataclass
class SubsequenceBatch(ChunkRows):
    """One replica's subsequences, their schedule, rows and this stage's offloader."""

    subsequences: SubsequencePlan
    offloader: ActivationOffloader
    multiplex: bool = False
    """The schedule is :func:`~sppo_offload.multiplex.multiplexed_schedule` (unit 0's shares
    run by :class:`~sppo_offload.mux_runtime.MultiplexProgram`)."""

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
    plan = plan_subsequences(mine, cost, args.sppo_subsequences, args.sppo_offload, tp * cp,
                             None if host_gb is None else host_gb * GB)
    check_budget(mine, plan, cost, args.sppo_subsequences, args.sppo_offload,
                 memory_budget_gb(args), host_gb, tp * cp)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    offloaded = lambda action: plan.alphas[action.stage][action.unit] > 0  # noqa: E731
    if args.sppo_multiplex:
        _check_multiplexable(plan, cost.pp)
        schedule = multiplexed_schedule(cost.pp, plan.counts[0], offloaded)
        block_groups(tuple(dist.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group())))
    else:
        schedule = build_schedule(cost.pp, plan.counts, offloaded)
    batches = [micro_batch([chunk_row(chunk, documents, share, tp * cp)])
               for chunk in plan.chunks]
    slices = [((share[p.doc], p.slice),) if plan.counts[p.doc] > 1 else ()
              for p in (chunk.pieces[0] for chunk in plan.chunks)]
    chunk = model[0] if isinstance(model, list) else model
    capacity = None if host_gb is None else int(host_gb * GB)
    offloader = ActivationOffloader(host_tier(next(chunk.parameters()).device, capacity),
                                    plan.alphas[stage].__getitem__)
    divisor = (tp if args.sequence_parallel else 1) * cp
    batch = SubsequenceBatch(schedule, batches, slices, args.hidden_size, divisor,
                             subsequences=plan, offloader=offloader,
                             multiplex=args.sppo_multiplex)
    log.info("sppo plan: %d documents in %d subsequences, %d offloaded on stage %d",
             len(share), len(batch), sum(a > 0 for a in plan.alphas[stage]), stage)
    return batch, len(batch)


def _check_multiplexable(plan: SubsequencePlan, pp: int) -> None:
    """Multiplexing fills the warm-up and cool-down of one sequence's pipeline. Every rank
    learns every replica's verdict (one gather) and they all raise the first problem found, so
    no replica is left waiting in a collective for one that stopped."""
    problem = None
    first = plan.chunks[0].pieces[0].tokens
    if len(plan.counts) != 1:
        problem = (f"--sppo-multiplex splits the first subsequence of one document; a "
                   f"data-parallel replica got {len(plan.counts)} documents (with several, the "
                   f"next document already fills the drain): train one document per replica "
                   f"(--global-batch-size equal to the data-parallel size) or drop "
                   f"--sppo-multiplex")
    elif plan.counts[0] < 2 or first < min_tokens(pp):
        problem = (f"--sppo-multiplex needs at least 2 subsequences and a first subsequence of "
                   f"at least {min_tokens(pp)} tokens on {pp} stages; got {plan.counts[0]} "
                   f"subsequences, the first of {first} tokens: use fewer --sppo-subsequences "
                   f"(at least 2), longer documents, or drop --sppo-multiplex")
    verdicts = [problem]
    if dist.is_initialized():
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
    found = next((verdict for verdict in verdicts if verdict is not None), None)
    if found is not None:
        raise ValueError(found)


# -- the schedule --------------------------------------------------------------------------------

def run(call: RankCall) -> list:
    """This rank's actions over ``call.input`` (:class:`SubsequenceBatch`)."""
    planned = call.input
    chunks = ChunkState(kv_store=KVStore(), layers=leading_layers(call.model),
                        checkpointed=lambda unit: 0, slices=planned.slices.__getitem__)
    groups = megatron_process_groups()
    program, store, batches = None, [], planned.batches
    if planned.multiplex:
        program = MultiplexProgram(
            model=call.model, u0=batches[0], doc_key=planned.slices[0][0][0],
            stage=groups.pp.rank(), pp=groups.pp.size(),
            groups=block_groups(tuple(dist.get_process_group_ranks(groups.pp))),
            chunks=chunks, forward_step_func=call.forward_step_func, forward_data_store=store,
            num_microbatches=call.num_microbatches, forward_only=call.forward_only,
            collect_non_loss_data=call.collect_non_loss_data)
        batches = batches[1:]
    result = run_this_rank(planned.schedule, groups, call, data_iterator=iter(batches),
                           shape_of=planned.shape_of, chunks=chunks, offload=planned.offloader,
                           program=program)
    return store + result


SPEC = ScheduleSpec(NAME, run=run, input_type=SubsequenceBatch,
                    argument_groups=(job_costs.add_arguments, add_arguments),
                    check_args=check_args, prepare_input=prepare_input, build_ir=sppo_ir)
