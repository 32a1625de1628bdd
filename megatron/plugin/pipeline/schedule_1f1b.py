"""Megatron's non-interleaved 1F1B as data (compute actions only; passes add the transfers),
and its generalisation to units whose backwards must run in another order.

Rank ``r`` of ``p`` runs ``w = min(p - r - 1, m)`` warm-up forwards, then alternates one
forward and one backward while forwards remain, then the cool-down backwards: the order of
``forward_backward_pipelining_without_interleaving`` in megatron-core.

Slices of one document (elastic split chunks, SPPO subsequences, Seq1F1B) need their backwards
in *reverse* slice order, because slice ``j``'s backward produces the K/V gradients that slice
``i < j`` needs. :func:`one_f_one_b` therefore takes an optional ``backward_order``: a
permutation of the units. Before its ``k``-th backward a rank has run
``min(m, max(w + k + 1, 1 + max(position of backward_order[0..k])))`` forwards: the 1F1B count,
or more when the next backward's unit has not been forwarded yet (as Seq1F1B does: a rank
forwards every slice of a document before the backward of its last slice). Every rank uses the
same forward and backward orders, so transfers pair up in order on every channel.

With a ``lookahead`` ``h`` (an integer >= 0) a rank keeps its ``w`` warm-up forwards *on top of*
the forwards the backwards need. Let ``D_k = n_k - k`` be the units the last stage must hold
at its ``k``-th backward, ``n_k = 1 + max(position of backward_order[0..k])`` (``k + 1`` in
plain 1F1B, up to ``k + s`` at the first backward of a document of ``s`` slices). Before its
``k``-th backward a rank has run ``min(m, w + k + max(D_k, ..., D_{k+h}))`` forwards. With
``h = 0`` rank ``r`` holds up to ``p - r - 1 + s`` units in a document of ``s`` slices
(InfiniPipe's window ``|W_p| = d - p + N_prefill``): the ranks ahead keep forwarding the units
after a document while its first gradient travels back instead of draining the pipeline. A
larger ``h`` raises the window ``h`` backwards before a document, so that the stages forward
its slices between the backwards of the units before it (one forward for each backward, as
1F1B does) instead of all at once when its turn comes; the windows are larger for longer.
Without slices every ``h`` is the plain 1F1B. The ranks' forward counts differ by one unit
from stage to stage as in 1F1B, but a rank forwards units that the next rank receives only
after a run of backwards, so the transfers need
:func:`~megatron.plugin.pipeline.passes.align_sends`.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from megatron.plugin.pipeline.ir import Action, Kind


def one_f_one_b(pp: int, microbatches: int, backward_order: Sequence[int] | None = None,
                lookahead: int | None = None) -> list[list[Action]]:
    """Per-rank compute order of 1F1B for ``pp`` stages and ``microbatches`` units, forwards in
    unit order, backwards in ``backward_order`` (default: unit order, Megatron's 1F1B); with a
    ``lookahead`` the warm-up forwards come on top of the slices of a document (see the module
    docstring)."""
    order = list(range(microbatches)) if backward_order is None else list(backward_order)
    schedule = []
    for rank, counts in enumerate(forward_counts(pp, microbatches, order, lookahead)):
        actions: list[Action] = []
        forwards = 0
        for target, unit in zip(counts, order):
            actions.extend(Action(rank, Kind.FORWARD, f) for f in range(forwards, target))
            forwards = target
            actions.append(Action(rank, Kind.BACKWARD, unit))
        schedule.append(actions)
    return schedule


def forward_counts(pp: int, microbatches: int, backward_order: Sequence[int],
                   lookahead: int | None = None) -> list[list[int]]:
    """Per rank, how many forwards :func:`one_f_one_b` has run before each backward (in
    ``backward_order``); for callers that want the order without building actions."""
    if pp < 1 or microbatches < 1:
        raise ValueError(f"1F1B needs pp >= 1 and micro-batches >= 1 (got pp={pp}, "
                         f"micro-batches={microbatches})")
    if sorted(backward_order) != list(range(microbatches)):
        raise ValueError(f"backward_order must be a permutation of 0..{microbatches - 1}, "
                         f"got {list(backward_order)}")
    needed, furthest = [], -1
    for unit in backward_order:
        furthest = max(furthest, unit)
        needed.append(furthest + 1)
    if lookahead is not None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 backwards, got {lookahead}")
        depth = window_max([n - k for k, n in enumerate(needed)], lookahead)
    counts = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        if lookahead is None:
            counts.append([min(microbatches, max(warmup + k + 1, n))
                           for k, n in enumerate(needed)])
        else:
            counts.append([min(microbatches, warmup + k + d) for k, d in enumerate(depth)])
    return counts


def window_max(values: Sequence[int], ahead: int) -> list[int]:
    """``max(values[k:k + ahead + 1])`` for every ``k`` (a monotonic queue: linear time)."""
    result, queue = [0] * len(values), deque()
    for k in range(len(values) - 1, -1, -1):
        while queue and values[queue[-1]] <= values[k]:
            queue.pop()
        queue.append(k)
        if queue[0] > k + ahead:
            queue.popleft()
        result[k] = values[queue[0]]
    return result


def reversed_within_groups(group_sizes: Sequence[int]) -> list[int]:
    """Backward order for consecutive groups of units (the slices of one document): groups in
    order, units of each group last-first. ``[3, 1, 2]`` -> ``[2, 1, 0, 3, 5, 4]``."""
    order, start = [], 0
    for size in group_sizes:
        if size < 1:
            raise ValueError(f"group sizes must be positive, got {list(group_sizes)}")
        order.extend(range(start + size - 1, start - 1, -1))
        start += size
    return order
