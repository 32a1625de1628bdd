"""Megatron's non-interleaved 1F1B as data (compute actions only; passes add the transfers).

Rank ``r`` of ``p`` runs ``w = min(p - r - 1, m)`` warm-up forwards, then alternates one
forward and one backward while forwards remain, then the cool-down backwards: the order of
``forward_backward_pipelining_without_interleaving`` in megatron-core.
"""
from __future__ import annotations

from megatron.plugin.pipeline.ir import Action, Kind


def one_f_one_b(pp: int, microbatches: int) -> list[list[Action]]:
    """Per-rank compute order of 1F1B for ``pp`` stages and ``microbatches`` micro-batches."""
    if pp < 1 or microbatches < 1:
        raise ValueError(f"1F1B needs pp >= 1 and micro-batches >= 1 (got pp={pp}, "
                         f"micro-batches={microbatches})")
    schedule = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        actions = [Action(rank, Kind.FORWARD, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions.append(Action(rank, Kind.FORWARD, warmup + i))
            actions.append(Action(rank, Kind.BACKWARD, i))
        actions.extend(Action(rank, Kind.BACKWARD, i)
                       for i in range(microbatches - warmup, microbatches))
        schedule.append(actions)
    return schedule
