"""A training batch's subsequence plan (pure): the cut of every document, the offload ratios
within the host cap, and the check of the plan against the memory budgets before any rank
computes."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.plugin.packing import micro_batch_rows
from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.simulator import simulate

from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel

from sppo_offload.costs import OffloadCosts
from sppo_offload.offload import (AUTO, OFF, capped_ratios, offload_ratios, offloadable_bytes,
                                  raised)
from sppo_offload.partition import balanced_lengths, packed_documents, starts
from sppo_offload.pipeline import build_schedule
from sppo_offload.solver import SolverConfig


def auto_subsequences(tokens: int, pp: int, token_split: int) -> int:
    """``--sppo-subsequences auto`` for a ``tokens``-token document (module doc, step 2)."""
    return max(pp, math.ceil(tokens / (token_split * SolverConfig.max_tokens)))


@dataclass(frozen=True)
class SubsequencePlan:
    """The subsequences of one replica's documents and their offload ratios."""

    counts: tuple[int, ...]
    """Units per sequence, in the order of the sequences: a cut document's subsequences, or
    one for a row of whole documents (:func:`~sppo_offload.partition.packed_documents`)."""
    chunks: tuple[Chunk, ...]
    """One chunk per unit: one subsequence of a cut document, or whole documents
    (``Piece.doc``: the document's position in the share)."""
    alphas: tuple[tuple[float, ...], ...]
    """Offload ratio per stage and unit."""
    checkpointed: tuple[int, ...] = ()
    """Leading layers every unit of a stage checkpoints, per stage (Megatron's recompute
    flags, :mod:`longctx.fixed_checkpointing`); empty: none."""

    def recomputes(self, stage: int) -> int:
        """Layers each unit recomputes on ``stage``."""
        return self.checkpointed[stage] if self.checkpointed else 0

    def is_slice(self, unit: int) -> bool:
        """Whether ``unit`` is one subsequence of a cut document (it attends to the K/V of the
        document's earlier subsequences)."""
        piece = self.chunks[unit].pieces[0]
        return not (piece.start == 0 and piece.final)

    def to_dict(self) -> dict:
        return {"counts": list(self.counts),
                "lengths": [c.tokens for c in self.chunks],
                "documents": [len(c.pieces) for c in self.chunks],
                "alphas": [list(row) for row in self.alphas],
                "checkpointed": list(self.checkpointed)}


def plan_subsequences(lengths, cost: CostModel, subsequences, offload, token_split: int = 1,
                      host_cap_bytes: float | None = None, most_saving: bool = False,
                      checkpointed: tuple[int, ...] = ()) -> SubsequencePlan:
    """Cut documents of ``lengths`` tokens into subsequences, pack the short ones, and choose
    the offload ratios (:mod:`sppo_offload.runtime`, steps 2 and 5) for the stages of
    ``cost``'s layout: the longest subsequence of the documents cut into their wanted counts
    is the batch's *capacity*; documents of at most that many tokens are packed whole into
    rows of at most that many (:func:`~sppo_offload.partition.packed_documents`), a longer one
    is cut into the fewest FLOPs-balanced subsequences, at most its wanted count, whose
    longest (the first) is within the capacity: the document that sets the capacity gets
    exactly its wanted count (``--sppo-subsequences``), and the balanced cuts' unequal lengths
    never merge its subsequences into fewer. ``auto`` ratios are
    capped to ``host_cap_bytes`` per document and stage; ``most_saving`` raises them to 1
    first (the solver's most memory-saving option; a fixed ratio or ``off`` stays).
    ``checkpointed`` (layers per stage, Megatron's recompute flags) recomputes instead:
    nothing is offloaded then (:func:`sppo_offload.flags.check_args` refuses a fixed ratio
    with them)."""
    if any(checkpointed):
        offload = OFF

    def cut(tokens: int, count: int) -> list[int]:
        return balanced_lengths(tokens, min(count, tokens), cost.linear_per_token, cost.alpha1)

    def within(tokens: int, count: int) -> list[int]:
        cuts = (cut(tokens, k) for k in range(1, count + 1))
        return next((c for c in cuts if c[0] <= capacity), cut(tokens, count))

    wanted = [auto_subsequences(tokens, cost.pp, token_split) if subsequences == AUTO
              else subsequences for tokens in lengths]
    capacity = max(cut(tokens, count)[0] for tokens, count in zip(lengths, wanted))
    sequences = [(group[0], (Chunk(tuple(Piece(doc, 0, 0, lengths[doc], True)
                                          for doc in group)),))
                 for group in packed_documents(lengths, capacity)]
    for doc, (tokens, count) in enumerate(zip(lengths, wanted)):
        if tokens > capacity:
            lengths_of = within(tokens, count)
            sequences.append((doc, tuple(
                Chunk((Piece(doc, j, start, start + length, j == len(lengths_of) - 1),))
                for j, (start, length) in enumerate(zip(starts(lengths_of), lengths_of)))))
    return _assembled([mine for _, mine in sorted(sequences, key=lambda sequence: sequence[0])],
                      cost, offload, host_cap_bytes, most_saving, checkpointed)


def megatron_plan(lengths, cost: CostModel, seq_length: int, micro_batch_size: int, offload,
                  host_cap_bytes: float | None = None,
                  checkpointed: tuple[int, ...] = ()) -> SubsequencePlan | None:
    """Megatron-LM's micro-batches of documents of ``lengths`` tokens as a plan: its
    best-fit-decreasing rows of ``seq_length`` inputs, ``micro_batch_size`` rows a unit
    (:func:`~megatron.plugin.packing.micro_batch_rows`), every document whole, in Megatron's
    order; the offload ratios as :func:`plan_subsequences` chooses them (a document's last
    subsequence, here every one, is never offloaded). ``None`` when a document is longer than
    ``seq_length``."""
    if max(lengths) > seq_length:
        return None
    if any(checkpointed):
        offload = OFF
    sequences = [(Chunk(tuple(Piece(doc, 0, 0, lengths[doc], True)
                              for row in batch for doc in sorted(row))),)
                 for batch in micro_batch_rows(list(lengths), seq_length, micro_batch_size)]
    return _assembled(sequences, cost, offload, host_cap_bytes, False, checkpointed)


def _assembled(sequences, cost: CostModel, offload, host_cap_bytes: float | None,
               most_saving: bool, checkpointed: tuple[int, ...]) -> SubsequencePlan:
    """The plan of ``sequences`` (each a tuple of chunks, in pipeline order) with their offload
    ratios (:func:`plan_subsequences`)."""
    counts, chunks = [], []
    alphas: list[list[float]] = [[] for _ in range(cost.pp)]
    for mine in sequences:
        ratios = offload_ratios(cost, mine, offload, cost.hardware.host_gbps_per_gpu)
        if offload == AUTO and most_saving:
            ratios = raised(ratios, 1.0)
        if offload == AUTO and host_cap_bytes is not None:
            ratios = capped_ratios(cost, mine, ratios, host_cap_bytes)
        for stage, row in enumerate(ratios):
            alphas[stage].extend(row)
        counts.append(len(mine))
        chunks.extend(mine)
    return SubsequencePlan(tuple(counts), tuple(chunks), tuple(tuple(row) for row in alphas),
                           tuple(checkpointed))


def check_budget(lengths, plan: SubsequencePlan, cost: CostModel, subsequences, offload,
                 memory_gb: float, host_memory_gb: float | None,
                 token_split: int = 1, host_gbps: float | None = None) -> list[float]:
    """The simulated peak device bytes per stage of the plan of documents of ``lengths``
    tokens; raises before any compute when it does not fit (module doc, step 6);
    ``subsequences``, ``offload`` and ``token_split`` as planned, ``host_gbps`` as in
    :func:`replay`."""
    peak, host = replay(plan, cost, host_gbps)
    if host_memory_gb is not None and max(host) > host_memory_gb * GB:
        stage = host.index(max(host))
        raise ValueError(
            f"sppo: the offload ratios of this batch (--sppo-offload {offload}) put "
            f"{max(host) / GB:.4g} GB of activations in host memory on stage {stage}, more than "
            f"--sppo-host-memory-gb {host_memory_gb:g}; raise it to at least "
            f"{_ceil_gb(max(host)):g}" + (", or lower --sppo-offload, or use auto (it lowers "
                                          "the ratios to fit)" if offload != AUTO else ""))
    if max(peak) <= memory_gb * GB:
        return peak
    cap = None if host_memory_gb is None else host_memory_gb * GB
    saver = plan if offload != AUTO or any(plan.checkpointed) else plan_subsequences(
        lengths, cost, subsequences, offload, token_split, cap, most_saving=True)
    least = _ceil_gb(max(replay(saver, cost, host_gbps)[0]))
    message = (f"sppo: this batch ({len(lengths)} documents of {max(lengths)} tokens at most, "
               f"{len(plan.chunks)} subsequences) needs {max(peak) / GB:.4g} GB per GPU, more "
               f"than --sppo-memory-gb {memory_gb:g}; ")
    how = "fully offloaded" + ("" if cap is None else
                               f" within {host_memory_gb:g} GB of host memory")
    if any(plan.checkpointed):
        message += (f"with Megatron's recomputation (--recompute-granularity full) it needs "
                    f"{least:g} GB; recompute more layers (--recompute-method uniform), or "
                    f"drop the recompute flags and let SPPO offload (--sppo-offload auto)")
    elif offload != AUTO:
        message += (f"the smallest budget that fits with --sppo-offload {offload} is "
                    f"{least:g} GB; or let SPPO choose the ratios (--sppo-offload auto)")
    elif least > cost.hardware.hbm_gb:
        message += (f"it cannot fit even {how} ({least:g} GB, more than the "
                    f"{cost.hardware.hbm_gb:g} GB of one {cost.hardware.name} GPU); use more "
                    f"GPUs or shorter sequences")
    else:
        message += f"the smallest budget that fits is {least:g} GB ({how})"
    raise ValueError(message)


def fastest_plan(plan: SubsequencePlan, megatron: SubsequencePlan | None, cost: CostModel,
                 memory_gb: float, host_gbps: float | None = None) -> SubsequencePlan:
    """``megatron`` (Megatron-LM's micro-batches, :func:`megatron_plan`) where it fits
    ``memory_gb`` per GPU and ``plan`` does not, or both fit and it is predicted no slower
    (the simulated iteration time, each unit's fixed cost included:
    :meth:`~longctx.cost_model.CostModel.stage_forward`); else ``plan``. Under
    ``--sppo-subsequences auto`` a batch is then planned in more units than Megatron's only
    where they are predicted faster."""
    if megatron is None or (megatron.counts, megatron.chunks) == (plan.counts, plan.chunks):
        return plan
    theirs = _simulated(megatron, cost, host_gbps)[0]
    if max(theirs.peak_memory) > memory_gb * GB:
        return plan
    ours = _simulated(plan, cost, host_gbps)[0]
    if max(ours.peak_memory) > memory_gb * GB:
        return megatron
    return megatron if theirs.iteration_time <= ours.iteration_time else plan


def _simulated(plan: SubsequencePlan, cost: CostModel, host_gbps: float | None):
    """``(simulator result, schedule, offloaded bytes per stage and unit)`` of ``plan``
    (:func:`replay`)."""
    offloaded = [[a * offloadable_bytes(cost, stage, chunk) if a else 0.0
                  for a, chunk in zip(row, plan.chunks)] for stage, row in enumerate(plan.alphas)]
    schedule = build_schedule(cost.pp, plan.counts,
                              lambda action: plan.alphas[action.stage][action.unit] > 0,
                              recomputed=lambda action: plan.recomputes(action.stage) > 0)
    link = cost.hardware.host_gbps_per_gpu if host_gbps is None else host_gbps
    costs = OffloadCosts(cost, plan.chunks, offloaded, plan.checkpointed or None, link)
    return simulate(schedule, costs, trace=False), schedule, offloaded


def replay(plan: SubsequencePlan, cost: CostModel,
           host_gbps: float | None = None) -> tuple[list[float], list[float]]:
    """``(peak device bytes, peak host bytes)`` per stage of the batch's schedule, simulated
    with ``cost``: an ``OFFLOAD`` puts its unit's predicted bytes in host memory, its
    ``RELOAD`` takes them back, in the order each rank runs them. The copies run at
    ``host_gbps`` (default: the profile's host link): on a side stream, an offload's bytes
    leave the device when its copy ends and a reload's are back when it starts; with
    ``math.inf``, the host tier that copies synchronously (the CPU twin), at the action."""
    result, schedule, offloaded = _simulated(plan, cost, host_gbps)
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
