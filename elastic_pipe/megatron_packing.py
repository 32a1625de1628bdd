"""Megatron-LM's sequence-packing schedulers (``--sequence-packing-scheduler``, Megatron-LM's
dev branch, ``megatron/core/datasets/data_schedule.py`` and ``data_schedule_utils.py``): which
documents of a global batch run together, on which data- and context-parallel ranks.

Pure functions of the document lengths, re-derived from the behaviour of Megatron-LM's code
(not copied): the same packs, groups and micro-batch counts for the same lengths.

- :func:`dp_balanced` (``DpBalancedScheduler``): documents in their batch order are packed
  into one pack until the next would take it past ``max_seqlen_per_dp_cp_rank x cp`` tokens (or
  past ``max_num_seqs`` documents); a document longer than that is a pack of its own. Until the
  pack count is a multiple of ``dp``, the last document of the last pack holding more than one
  moves into a pack of its own (appended at the end). Micro-batch ``i`` gives data-parallel
  rank ``d`` the pack ``i dp + d``, split over its ``cp`` context-parallel ranks (THD,
  per-sequence zigzag). Despite its name nothing balances the ranks' work: the order of the
  batch decides.
- :func:`dynamic_cp` (``DefaultDynamicCPScheduler``, ``--dynamic-context-parallel``): every
  micro-batch spreads documents over all ``dp x cp`` ranks in *groups*, each group a
  context-parallel ring of a power-of-two size of its own running its packed documents. A
  document of ``n`` tokens needs at least ``max(min_cp, 2^ceil(log2(n / m)))`` ranks (``m``:
  ``max_seqlen_per_dp_cp_rank``). The longest opens a group of exactly that many on the first
  ranks; then, longest first, each document joins the group, or opens the
  group on free ranks, of the size (its least, then doubling) that gives the lowest largest
  rank workload, a document's workload on a group of ``c`` being ``n^2 / c`` on each of its
  ranks, among those whose per-rank tokens stay within ``m`` and whose largest workload stays
  within ``1.05 x longest x m`` (the micro-batch's longest document); a document that finds
  none waits for the next micro-batch. Ranks left empty are then filled by doubling the first
  smallest group that can grow (the groups after it shift up), and where none can, the
  micro-batch becomes one group of all ``dp x cp`` ranks holding, longest first, the
  documents whose share ``n / (dp cp)`` still fits within ``m`` (the others wait).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WORKLOAD_CAP_DELTA = 0.05
"""Megatron-LM's ``_DYNAMIC_CP_WORKLOAD_CAP_DELTA``: the slack on the largest rank workload a
dynamic-CP micro-batch may reach, ``(1 + delta) x longest x m``."""


@dataclass(frozen=True)
class CPGroup:
    """One context-parallel ring of a micro-batch and the documents it runs packed."""

    size: int
    """Its ranks (the ring's CP size)."""
    documents: tuple[int, ...]
    """Indices in the batch."""


def _check(lengths: Sequence[int], max_seqlen_per_rank: int, ranks: int) -> None:
    if not lengths or min(lengths) < 1:
        raise ValueError("the batch needs at least one document and every length >= 1")
    if max_seqlen_per_rank < 1:
        raise ValueError(f"--max-seqlen-per-dp-cp-rank must be >= 1, got {max_seqlen_per_rank}")
    if ranks < 1:
        raise ValueError(f"dp x cp must be >= 1, got {ranks}")


def dp_balanced(lengths: Sequence[int], cp: int, dp: int, max_seqlen_per_rank: int,
                max_num_seqs: int | None = None) -> list[list[tuple[int, ...]]]:
    """Per micro-batch, the pack (document indices) of each data-parallel rank (module doc).
    ``ValueError`` when there are fewer documents than ``dp`` (Megatron-LM asserts)."""
    _check(lengths, max_seqlen_per_rank, cp * dp)
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} documents cannot give each of dp={dp} ranks a pack; "
                         f"raise the global batch size")
    capacity = max_seqlen_per_rank * cp
    packs: list[list[int]] = []
    tokens = 0
    for doc, length in enumerate(lengths):
        if packs and tokens + length <= capacity and (
                max_num_seqs is None or len(packs[-1]) < max_num_seqs):
            packs[-1].append(doc)
            tokens += length
        else:
            packs.append([doc])
            tokens = length
    index = len(packs) - 1
    while len(packs) % dp:
        while index >= 0 and len(packs[index]) == 1:
            index -= 1
        if index < 0:
            raise ValueError(f"{len(lengths)} documents cannot fill a multiple of dp={dp} "
                             f"packs; raise the global batch size")
        packs.append([packs[index].pop()])
    return [[tuple(pack) for pack in packs[step * dp:(step + 1) * dp]]
            for step in range(len(packs) // dp)]


def ranks_needed(length: int, max_seqlen_per_rank: int, min_cp: int = 1) -> int:
    """Megatron-LM's ``dcp_gpus_needed``: the least power-of-two ring holding ``length``
    tokens at ``max_seqlen_per_rank`` a rank, at least ``min_cp``."""
    return max(min_cp, 2 ** max(0, math.ceil(math.log2(length / max_seqlen_per_rank))))


def dynamic_cp(lengths: Sequence[int], ranks: int, max_seqlen_per_rank: int,
               min_cp: int = 1) -> list[tuple[CPGroup, ...]]:
    """The micro-batches of ``--dynamic-context-parallel`` over ``ranks`` = dp x cp ranks,
    each its groups in rank order (module doc). ``ValueError`` when a document needs more
    ranks than there are."""
    _check(lengths, max_seqlen_per_rank, ranks)
    longest = max(range(len(lengths)), key=lambda doc: lengths[doc])
    if ranks_needed(lengths[longest], max_seqlen_per_rank, min_cp) > ranks:
        raise ValueError(f"document {longest} of {lengths[longest]} tokens needs "
                         f"{ranks_needed(lengths[longest], max_seqlen_per_rank, min_cp)} ranks "
                         f"at --max-seqlen-per-dp-cp-rank {max_seqlen_per_rank}, more than "
                         f"dp x cp = {ranks}; raise it or add ranks")
    waiting = sorted(range(len(lengths)), key=lambda doc: -lengths[doc])
    steps = []
    while waiting:
        groups, waiting = _micro_batch(waiting, lengths, ranks, max_seqlen_per_rank, min_cp)
        steps.append(groups)
    return steps


def _micro_batch(order: list[int], lengths: Sequence[int], ranks: int, limit: int,
                 min_cp: int) -> tuple[tuple[CPGroup, ...], list[int]]:
    """One micro-batch's groups from ``order`` (longest first) and the documents left."""
    first = lengths[order[0]]
    cap = first * limit * (1.0 + WORKLOAD_CAP_DELTA)
    size = ranks_needed(first, limit, min_cp)
    sizes, members = [size], [[order[0]]]
    work, per_rank_tokens = [first * first / size], [first / size]
    left = []
    for doc in order[1:]:
        length = lengths[doc]
        peak = max(work)
        best = None
        size = ranks_needed(length, limit, min_cp)
        while size <= ranks:
            load = length * length / size
            for group, group_size in enumerate(sizes):
                if group_size == size and per_rank_tokens[group] + length / size <= limit:
                    projected = max(peak, work[group] + load)
                    if projected <= cap and (best is None or projected < best[0]):
                        best = (projected, group, size)
            if ranks - sum(sizes) >= size:
                projected = max(peak, load)
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, None, size)
            size *= 2
        if best is None:
            left.append(doc)
            continue
        _, group, size = best
        if group is None:
            sizes.append(size)
            members.append([])
            work.append(0.0)
            per_rank_tokens.append(0.0)
            group = len(sizes) - 1
        members[group].append(doc)
        work[group] += length * length / size
        per_rank_tokens[group] += length / size
    while sum(sizes) < ranks:
        if not _grow_smallest(sizes, ranks):
            return _whole(order, lengths, ranks, limit)
    return tuple(CPGroup(size, tuple(docs)) for size, docs in zip(sizes, members)), left


def _grow_smallest(sizes: list[int], ranks: int) -> bool:
    """Double the first smallest group whose doubled ring still ends within the ranks, and
    whose growth leaves the groups after it within them too (where Megatron-LM's code would
    index past the last rank, possible only when ``dp x cp`` is not a power of two, the
    growth is taken as impossible: the fallback follows)."""
    smallest = min(sizes)
    start, used = 0, sum(sizes)
    for group, size in enumerate(sizes):
        grown = min(2 * size, ranks)
        if size == smallest and start + grown <= ranks and used + grown - size <= ranks:
            sizes[group] = grown
            return True
        start += size
    return False


def _whole(order: list[int], lengths: Sequence[int], ranks: int,
           limit: int) -> tuple[tuple[CPGroup, ...], list[int]]:
    """The fallback: one group of all the ranks, longest first while the share fits."""
    chosen, left, share = [], [], 0.0
    for doc in order:
        if share + lengths[doc] / ranks <= limit:
            chosen.append(doc)
            share += lengths[doc] / ranks
        else:
            left.append(doc)
    if not chosen:
        raise ValueError(f"no document fits one group of all {ranks} ranks at "
                         f"--max-seqlen-per-dp-cp-rank {limit}; raise it")
    return (CPGroup(ranks, tuple(chosen)),), left
