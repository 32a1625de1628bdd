"""ZB1P (the zero-bubble ZB-H1 schedule) as data: 1F1B with the backward split into ``B``
(input gradients) and ``W`` (weight gradients), the ``W`` passes deferred to fill the cool-down.

Rule (stage ``s`` of ``p``, ``m`` micro-batches, all orders by micro-batch number):

1. warm-up: ``min(p - s, m)`` forwards, 1F1B's warm-up plus its first steady forward;
2. then, for ``k = 0 .. m - 1``: ``B_k``; the oldest pending ``W`` when more than ``s`` are
   pending (stage ``s`` runs its ``W`` passes ``s`` backwards behind its ``B`` passes); the
   next forward, if any is left;
3. the pending ``W`` passes, oldest first.

Stage ``s`` keeps 1F1B's order of forwards and ``B`` passes, so it holds at most ``p - s``
micro-batches between their forward and their ``B`` (1F1B's count); counting up to the ``W``,
every stage holds at most ``min(p, m)`` micro-batches, 1F1B's peak (stage 0's). The simulator
frees a stash at the ``B`` except what the ``W`` reads, and that at the ``W``
(:mod:`~megatron.plugin.pipeline.simulator`).

Sends are eager (``simulate(..., eager_sends=True)``), as the zero-bubble implementation posts
them asynchronously: with the executor's rendezvous batches a ``B``'s gradient send would wait
for the stage upstream to reach its receive, behind a forward or a ``W``. (Megatron's 1F1B
replays the same either way.) With unit costs ``F = B = W = 1`` and free transfers every stage
is busy from its first ``B`` on, and an iteration takes
``m (F + B + W) + (p - 1)(F + B - W)`` for ``m >= p`` (the zero-bubble paper's ZB-H1 bubble;
1F1B's is ``(p - 1)(F + B + W)``), and
``(p - 1 + m)(F + B) + W`` for ``m < p``, where the pipeline never fills
(``tests/unit/test_schedule_zb1p.py``). Generators emit compute actions only:
:func:`~megatron.plugin.pipeline.passes.add_communication` adds the transfers (``B`` sends
the input gradient upstream, as 1F1B's backward does; ``W`` sends nothing).
"""
from __future__ import annotations

from megatron.plugin.pipeline.ir import Action, Kind, Schedule


def zb1p(num_stages: int, microbatches: int) -> Schedule:
    """Per-rank compute order of ZB1P for ``num_stages`` stages and ``microbatches`` units
    (module docstring)."""
    if num_stages < 1 or microbatches < 1:
        raise ValueError(f"ZB1P needs num_stages >= 1 and micro-batches >= 1 (got "
                         f"num_stages={num_stages}, micro-batches={microbatches})")
    schedule = []
    for stage in range(num_stages):
        forwards = min(num_stages - stage, microbatches)
        actions = [Action(stage, Kind.FORWARD, unit) for unit in range(forwards)]
        weights = 0
        for unit in range(microbatches):
            actions.append(Action(stage, Kind.BACKWARD, unit))
            if unit - weights >= stage:
                actions.append(Action(stage, Kind.WEIGHT, weights))
                weights += 1
            if forwards < microbatches:
                actions.append(Action(stage, Kind.FORWARD, forwards))
                forwards += 1
        actions.extend(Action(stage, Kind.WEIGHT, unit)
                       for unit in range(weights, microbatches))
        schedule.append(actions)
    return schedule
