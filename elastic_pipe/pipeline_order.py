"""Per-rank compute order of one elastic 1F1B pipeline and the chunks each rank holds.

Slices of a split document must run their backwards in reverse slice order (slice ``j``'s
backward needs the dK/dV that later slices accumulate), while Megatron's 1F1B runs backwards in
forward order. The chunks of a pipeline are therefore laid out so that the slices of a document
sit in consecutive positions (a *block*, its last chunk holding the tail), and the backward order
is the forward order with every block reversed.

Each rank ``r`` of ``d`` follows the 1F1B rule generalised to that backward order, with a
forward *lookahead* ``h`` chosen per pipeline: the runtime's
``megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`` with ``backward_order`` and
``lookahead``, which without blocks is Megatron's 1F1B. Let ``D_j = m_j + 1 - j``, where
``m_j`` is the highest chunk among the first ``j + 1`` backwards (1 in plain 1F1B, up to ``k``
at the first backward of a block of ``k`` slices). The ``j``-th backward, of chunk
``border[j]``, follows ``j + (d - r - 1) + max(D_j, ..., D_{j+h})`` forwards (all of them when
fewer remain): rank ``r`` keeps its ``d - r - 1`` warm-up chunks on top of a block, holding up to
``d - r - 1 + k`` chunks (the paper's ``|W_p| = d - p + N_prefill``), so the ranks ahead go on
forwarding while a block's first gradient travels back instead of draining the pipeline. With
``h > 0`` the window rises ``h`` backwards before a block, so a block's slices are forwarded
between the backwards before it; it costs memory (more chunks held for longer), which the
planner weighs per pipeline. The ranks ahead then forward chunks that the next rank takes only
after a run of backwards; with rendezvous transfers those sends move into the batch where the
next rank receives them (``megatron.plugin.pipeline.passes.align_sends``), which the lowering
does and the validator checks.

The exact in-flight set at every backward is what the
checkpointing model constrains and what the simulator replays.
"""
from __future__ import annotations

from megatron.plugin.pipeline.schedule_1f1b import forward_counts

from longctx.chunks import Chunk

FORWARD, BACKWARD = "F", "B"


def backward_order(chunks: list[Chunk]) -> list[int]:
    """Local chunk indices in backward order: forward order with each document's block reversed.

    Raises ``ValueError`` when a document's slices are not in consecutive chunks in slice order.
    """
    order, block = [], []
    for index, chunk in enumerate(chunks):
        block.append(index)
        if not chunk.pieces[0].final:
            following = chunks[index + 1] if index + 1 < len(chunks) else None
            piece = chunk.pieces[0]
            if following is None or not any(p.doc == piece.doc and p.slice == piece.slice + 1
                                            for p in following.pieces):
                raise ValueError(f"slice {piece.slice + 1} of document {piece.doc} must follow "
                                 f"slice {piece.slice} in the next chunk")
            continue
        order.extend(reversed(block))
        block = []
    return order


def rank_orders(pp: int, border: list[int], lookahead: int) -> list[list[tuple[str, int]]]:
    """Per-rank ``(FORWARD|BACKWARD, local chunk)`` lists for ``len(border)`` chunks: the
    runtime's 1F1B with a backward order and a forward ``lookahead``
    (:func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`, from the same
    :func:`~megatron.plugin.pipeline.schedule_1f1b.forward_counts`), in the planner's light
    form."""
    orders = []
    for counts in forward_counts(pp, len(border), border, lookahead):
        row, forwards = [], 0
        for target, unit in zip(counts, border):
            row.extend((FORWARD, f) for f in range(forwards, target))
            forwards = target
            row.append((BACKWARD, unit))
        orders.append(row)
    return orders


def inflight_sets(orders: list[list[tuple[str, int]]]) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Per rank, for each backward: (its chunk, chunks forwarded but not yet backwarded)."""
    result = []
    for actions in orders:
        held, events = [], []
        for kind, unit in actions:
            if kind == FORWARD:
                held.append(unit)
            else:
                events.append((unit, tuple(held)))
                held.remove(unit)
        result.append(events)
    return result


def start_times(orders: list[list[tuple[str, int]]], forward, backward, recompute,
                transfer) -> list[list[float]]:
    """Per rank, when each action of ``orders`` starts, with ``[rank][chunk]`` forward, backward
    and recomputation durations and ``[chunk]`` stage-to-stage transfer times; a backward
    starts after its recomputation.

    A forward waits for the previous stage's forward of the chunk plus the transfer; a
    recomputation runs as soon as its rank is free (it needs no gradient) and the backward then
    waits for the next stage's backward plus the transfer. Sends are taken as non-blocking, so
    this is the dependency-graph timing the simulator reaches when no rank stalls on a send.
    Every start is non-decreasing in every duration (each is a max of sums of them).
    """
    pp = len(orders)
    f_end = [dict() for _ in range(pp)]
    b_end = [dict() for _ in range(pp)]
    starts: list[list[float]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            actions, began = orders[rank], starts[rank]
            while len(began) < len(actions):
                kind, unit = actions[len(began)]
                if kind == FORWARD:
                    if rank > 0 and unit not in f_end[rank - 1]:
                        break
                    ready = f_end[rank - 1][unit] + transfer[unit] if rank > 0 else 0.0
                    start = max(clock[rank], ready)
                    clock[rank] = f_end[rank][unit] = start + forward[rank][unit]
                else:
                    if rank < pp - 1 and unit not in b_end[rank + 1]:
                        break
                    ready = b_end[rank + 1][unit] + transfer[unit] if rank < pp - 1 else 0.0
                    start = max(clock[rank] + recompute[rank][unit], ready)
                    clock[rank] = b_end[rank][unit] = start + backward[rank][unit]
                began.append(start)
                progress = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        raise ValueError("the per-rank orders deadlock (a forward or backward never becomes "
                         "ready)")
    return starts


def makespan(orders: list[list[tuple[str, int]]], forward, backward, recompute,
             transfer) -> float:
    """Finish time of the per-rank ``orders`` (see :func:`start_times` for the timing rules)."""
    starts = start_times(orders, forward, backward, recompute, transfer)
    ends = [0.0]
    for rank, actions in enumerate(orders):
        for (kind, unit), start in zip(actions[-1:], starts[rank][-1:]):
            ends.append(start + (forward if kind == FORWARD else backward)[rank][unit])
    return max(ends)
