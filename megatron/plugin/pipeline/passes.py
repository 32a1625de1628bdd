"""Pure passes over schedule IR: a schedule in, a new schedule out.

Generators emit compute actions only (``F``, ``B``); these passes add what a real run needs.
Each pass is independent and tested alone; :func:`~megatron.plugin.pipeline.validation.validate`
checks the result.
"""
from __future__ import annotations

from typing import Callable

from megatron.plugin.pipeline.ir import Action, Kind

Schedule = list[list[Action]]


def add_communication(schedule: Schedule, num_stages: int | None = None) -> Schedule:
    """Transfers of a layer-wise pipeline (stage ``s`` feeds stage ``s + 1``).

    A forward on a stage other than the first is preceded by the receive of its activations,
    and a forward on a stage other than the last is followed by the send of its output; a
    backward on a stage other than the last is preceded by the receive of its output gradient,
    and a backward on a stage other than the first is followed by the send of its input
    gradient. Receives sit right before the compute that needs them and sends right after the
    compute that produces them: receives are the only blocking actions, so the earliest sends
    and the latest receives give the validator's dry run the most room.

    A ``RECOMPUTE`` right before a backward stays before the backward's receive, so that the
    recomputation overlaps the wait for the gradient.
    """
    last = (num_stages if num_stages is not None
            else 1 + max((a.stage for actions in schedule for a in actions), default=0)) - 1
    out: Schedule = []
    for actions in schedule:
        if any(a.is_communication() for a in actions):
            raise ValueError("add_communication expects compute actions only; this schedule "
                             "has transfers already")
        row: list[Action] = []
        for a in actions:
            if a.kind is Kind.FORWARD:
                if a.stage > 0:
                    row.append(Action(a.stage, Kind.RECV_F, a.unit, a.part, a.stage - 1))
                row.append(a)
                if a.stage < last:
                    row.append(Action(a.stage, Kind.SEND_F, a.unit, a.part, a.stage + 1))
            elif a.kind is Kind.BACKWARD:
                if a.stage < last:
                    row.append(Action(a.stage, Kind.RECV_B, a.unit, a.part, a.stage + 1))
                row.append(a)
                if a.stage > 0:
                    row.append(Action(a.stage, Kind.SEND_B, a.unit, a.part, a.stage - 1))
            else:
                row.append(a)
        out.append(row)
    return out


def add_recomputation(schedule: Schedule, recomputed: Callable[[Action], bool]) -> Schedule:
    """Insert ``RECOMPUTE`` right before the backward of every forward ``f`` with
    ``recomputed(f)`` true (same stage, unit and part).

    The forward of such a unit keeps only what recomputation starts from (its input, and K/V
    where later slices need them); the recompute re-materialises the rest before the backward.
    Apply it to a compute-only schedule, before :func:`add_communication`.
    """
    out: Schedule = []
    for actions in schedule:
        marked = {(a.stage, a.unit, a.part) for a in actions
                  if a.kind is Kind.FORWARD and recomputed(a)}
        row: list[Action] = []
        for a in actions:
            if a.kind is Kind.BACKWARD and (a.stage, a.unit, a.part) in marked:
                row.append(Action(a.stage, Kind.RECOMPUTE, a.unit, a.part))
            row.append(a)
        out.append(row)
    return out
