"""Baselines and ablations of the elastic plan, priced by the same cost model and simulator.

- ``seq1f1b`` (the paper's "enhanced Seq1F1B"): fixed-size chunks of ``S`` tokens -- documents
  longer than ``S`` cut into ``S``-token slices, tails and short documents packed
  first-fit-decreasing into ``S``-token chunks (never two tails together) -- in one 1F1B
  pipeline, with the same number of checkpointed layers on every stage and chunk, the smallest
  that fits the worst in-flight window (or Megatron's ``--recompute-*`` table,
  :mod:`longctx.fixed_checkpointing`). ``S = ceil(longest / k)`` with ``k`` tuned over the same
  slice counts, and the forward lookahead over the same values, as the elastic planner by the
  same pipeline-time estimate. Where ``k = 1`` is tried and every document fits one of
  Megatron-LM's rows, Megatron's micro-batches are one more candidate, as for the elastic
  planner (:func:`~elastic_pipe.sequence_processor.megatron_chunking`): with ``k = 1`` the
  chunk size is the longest document, and a batch of documents much shorter than
  ``--seq-length`` would otherwise run in many more units than Megatron-LM's.
- ``1f1b_packed``: whole documents packed first-fit-decreasing into micro-batches of at most
  the context length, one 1F1B pipeline, uniform checkpointing as above.
- :func:`megatron_1f1b`: Megatron-LM's 1F1B on its own micro-batches, nothing recomputed (what
  the training script's ``default`` and ``1f1b`` run; the short-document comparisons).
- ``elastic_full_ckpt``: the elastic plan with every layer checkpointed.
- ``elastic_no_grouping``: the elastic planner restricted to one pipeline.

A baseline that does not fit even with every layer checkpointed is ``None`` (reported as OOM).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from elastic_pipe import checkpointing
from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel
from longctx.fixed_checkpointing import FixedCheckpointing
from elastic_pipe.plan_types import Plan, PipelinePlan
from elastic_pipe.scheduler import (PipelineCase, SchedulerConfig, check_lengths, pipeline_case,
                                    pipeline_cases)
from elastic_pipe.sequence_processor import (ChunkingConfig, chunk_balance, layout,
                                             megatron_chunking, slice_candidates)


def uniform_plan(cost: CostModel, case: PipelineCase, num_slices: int,
                 fixed: FixedCheckpointing | None = None) -> Plan | None:
    """The pipeline ``case`` with the smallest global uniform checkpointing that fits, or with
    Megatron's fixed table ``fixed``; ``None`` when none fits."""
    if fixed is not None:
        table = fixed.table(case.problem.layers, case.problem.chunks)
        if not checkpointing.fits(case.problem, table):
            return None
        return single_pipeline_plan(cost, case, table, num_slices, "fixed")
    for count in range(max(case.problem.layers) + 1):
        table = tuple((min(count, layers),) * case.problem.chunks
                      for layers in case.problem.layers)
        if checkpointing.fits(case.problem, table):
            return single_pipeline_plan(cost, case, table, num_slices)
    return None


def single_pipeline_plan(cost: CostModel, case: PipelineCase, table, num_slices: int,
                         status: str = "uniform") -> Plan:
    """A plan of one uniformly checkpointed pipeline (predicted time and memory filled in);
    ``status`` says how its table was found (``CheckpointSolution.status``)."""
    seconds = case.time(table) * checkpointing.TIME_UNIT
    peaks = checkpointing.memory_peaks(case.problem, table)
    time_rsd, length_rsd = chunk_balance(case.chunks, cost)
    return Plan((PipelinePlan(case.chunks, case.backward, table, seconds, status,
                              num_slices, case.lookahead),),
                seconds, checkpointing.peak_bytes(cost, case.problem, peaks),
                time_rsd, length_rsd, 0.0)


def fixed_chunks(lengths: Sequence[int], size: int) -> tuple[Chunk, ...]:
    """Seq1F1B's chunks: ``size``-token slices and ``size``-token packed chunks."""
    docs = sorted(enumerate(lengths), key=lambda d: (-d[1], d[0]))
    heads, items = {}, []
    for doc, length in docs:
        cuts = list(range(0, length, size)) + [length]
        pieces = [Piece(doc, j, cuts[j], cuts[j + 1], final=j + 2 == len(cuts))
                  for j in range(len(cuts) - 1)]
        if len(pieces) > 1:
            heads[doc] = [Chunk((piece,)) for piece in pieces[:-1]]
        items.append(pieces[-1])
    return layout(heads, first_fit(items, size))


def first_fit(items: list[Piece], size: int) -> list[Chunk]:
    """First-fit-decreasing by tokens into bins of ``size`` tokens, at most one tail a bin."""
    bins: list[list[Piece]] = []
    loads: list[int] = []
    for piece in sorted(items, key=lambda p: (-p.tokens, p.doc)):
        for index, members in enumerate(bins):
            if loads[index] + piece.tokens <= size and not (
                    piece.is_tail and any(p.is_tail for p in members)):
                members.append(piece)
                loads[index] += piece.tokens
                break
        else:
            bins.append([piece])
            loads.append(piece.tokens)
    return [Chunk(tuple(members)) for members in bins]


def seq1f1b(lengths: Sequence[int], cost: CostModel, config: SchedulerConfig) -> Plan | None:
    """The enhanced Seq1F1B baseline (best ``k`` and forward lookahead by predicted time), or
    ``None`` when OOM."""
    check_lengths(lengths)
    longest = max(lengths)
    best = None
    counts = slice_candidates(longest, config.chunking)
    candidates = [(k, fixed_chunks(lengths, math.ceil(longest / k))) for k in counts]
    megatron = megatron_chunking(list(enumerate(lengths)), cost, config.chunking) \
        if 1 in counts else None
    if megatron is not None:
        candidates.append((1, megatron.chunks))
    for k, chunks in candidates:
        for case in pipeline_cases(cost, chunks, config.lookaheads):
            plan = uniform_plan(cost, case, k, config.fixed)
            if plan is not None and (best is None or
                                     plan.predicted_time_s < best.predicted_time_s):
                best = plan
    return best


def packed_1f1b(lengths: Sequence[int], cost: CostModel, context: int) -> Plan | None:
    """Whole documents packed into ``context``-token micro-batches, or ``None`` when OOM."""
    check_lengths(lengths)
    if max(lengths) > context:
        raise ValueError(f"a document of {max(lengths)} tokens exceeds the context {context}; "
                         f"truncate the lengths first")
    items = [Piece(doc, 0, 0, length, final=True) for doc, length in enumerate(lengths)]
    return uniform_plan(cost, pipeline_case(cost, first_fit(items, context), 0), 1)


def megatron_1f1b(lengths: Sequence[int], cost: CostModel, seq_length: int,
                  micro_batch_size: int = 1) -> Plan:
    """Megatron-LM's own 1F1B as the ``default`` and ``1f1b`` schedules run it here: its
    micro-batches (best-fit-decreasing rows of ``seq_length`` inputs, ``micro_batch_size``
    rows each) in one 1F1B pipeline, nothing recomputed (whatever the budget says: Megatron
    plans no memory)."""
    check_lengths(lengths)
    config = ChunkingConfig(seq_length=seq_length, micro_batch_size=micro_batch_size)
    chunking = megatron_chunking(list(enumerate(lengths)), cost, config)
    if chunking is None:
        raise ValueError(f"a document of {max(lengths)} tokens exceeds --seq-length "
                         f"{seq_length}; truncate the lengths first")
    case = pipeline_case(cost, chunking.chunks, 0)
    nothing = tuple((0,) * case.problem.chunks for _ in case.problem.layers)
    return single_pipeline_plan(cost, case, nothing, 1)


def full_checkpointing(plan: Plan, cost: CostModel) -> Plan | None:
    """``plan``'s pipelines with every layer checkpointed, or ``None`` when even that is OOM."""
    pipelines, peaks = [], [0] * cost.pp
    for pipeline in plan.pipelines:
        case = pipeline_case(cost, pipeline.chunks, pipeline.lookahead)
        table = checkpointing.full_table(case.problem)
        if not checkpointing.fits(case.problem, table):
            return None
        pipelines.append(PipelinePlan(case.chunks, case.backward, table,
                                      case.time(table) * checkpointing.TIME_UNIT, "full",
                                      pipeline.num_slices, pipeline.lookahead))
        peaks = [max(x, y) for x, y in zip(peaks, checkpointing.peak_bytes(
            cost, case.problem, checkpointing.memory_peaks(case.problem, table)))]
    return Plan(tuple(pipelines), sum(p.predicted_time_s for p in pipelines), tuple(peaks),
                plan.chunk_time_rsd, plan.chunk_length_rsd, 0.0)
