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
"""
from __future__ import annotations

from typing import Sequence

from megatron.plugin.pipeline.ir import Action, Kind


def one_f_one_b(pp: int, microbatches: int,
                backward_order: Sequence[int] | None = None) -> list[list[Action]]:
    """Per-rank compute order of 1F1B for ``pp`` stages and ``microbatches`` units, forwards in
    unit order, backwards in ``backward_order`` (default: unit order, Megatron's 1F1B)."""
    if pp < 1 or microbatches < 1:
        raise ValueError(f"1F1B needs pp >= 1 and micro-batches >= 1 (got pp={pp}, "
                         f"micro-batches={microbatches})")
    order = list(range(microbatches)) if backward_order is None else list(backward_order)
    if sorted(order) != list(range(microbatches)):
        raise ValueError(f"backward_order must be a permutation of 0..{microbatches - 1}, "
                         f"got {order}")
    needed, furthest = [], -1
    for unit in order:
        furthest = max(furthest, unit)
        needed.append(furthest + 1)
    schedule = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        actions: list[Action] = []
        forwards = 0
        for k, unit in enumerate(order):
            target = min(microbatches, max(warmup + k + 1, needed[k]))
            while forwards < target:
                actions.append(Action(rank, Kind.FORWARD, forwards))
                forwards += 1
            actions.append(Action(rank, Kind.BACKWARD, unit))
        schedule.append(actions)
    return schedule


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
