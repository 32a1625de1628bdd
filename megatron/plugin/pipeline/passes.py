"""Pure passes over schedule IR: a schedule in, a new schedule out.

Generators emit compute actions only (``F``, ``B``); these passes add what a real run needs.
Each pass is independent and tested alone; :func:`~megatron.plugin.pipeline.validation.validate`
checks the result.
"""
from __future__ import annotations

import itertools
from typing import Callable

from megatron.plugin.pipeline.ir import Action, Kind, Schedule


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


def align_sends(schedule: Schedule) -> Schedule:
    """Move sends later so that both ends of every channel meet its transfers in the same
    batches (runs of consecutive transfers, posted and waited for together).

    A send whose receiver first waits, in an earlier or the same batch, for a transfer that the
    sender meets only in a later batch would block its batch until then; with rendezvous
    transfers (NCCL, and the simulator's model) that is a deadlock when the sender's later
    batch needs the receiver to go on. Such a send moves into that later batch, right before
    the transfer it waited for. Receives never move, nor compute, so every action keeps its
    data; a send only waits longer in its buffer. A schedule whose channels already agree is
    returned unchanged (Megatron's 1F1B is). Repeated until no send moves: a send only moves
    later, so this ends.
    """
    out = [list(actions) for actions in schedule]
    owner = {a.stage: rank for rank, actions in enumerate(out) for a in actions}
    moved = True
    while moved:
        moved = False
        for rank in range(len(out)):
            for peer in sorted({owner[a.peer] for a in out[rank] if a.is_communication()}):
                if peer != rank and _align_channel(out, rank, peer, owner):
                    moved = True
    return out


def _batch_numbers(actions: list[Action]) -> list[int]:
    """Per action, the number of the batch of consecutive transfers it belongs to (compute
    actions get the number of the batch before them, 0 before the first)."""
    numbers, batch = [], 0
    for index, a in enumerate(actions):
        if index and a.is_communication() != actions[index - 1].is_communication():
            batch += a.is_communication()
        numbers.append(batch)
    return numbers


def _align_channel(out: list[list[Action]], rank: int, peer: int, owner: dict) -> bool:
    """Move ``rank``'s sends to ``peer`` into the batch the peer's order needs them in; True if
    any moved."""
    mine, theirs = out[rank], out[peer]
    my_batch, their_batch = _batch_numbers(mine), _batch_numbers(theirs)
    where = {a.transfer_key(): i for i, a in enumerate(mine)
             if a.is_communication() and owner[a.peer] == peer}
    channel = [i for i, a in enumerate(theirs)
               if a.is_communication() and owner[a.peer] == rank]
    moves: dict[int, int] = {}
    anchor = -1
    for _, batch in itertools.groupby(channel, key=lambda i: their_batch[i]):
        pairs = [(theirs[i], where[theirs[i].transfer_key()]) for i in batch]
        anchor = max([anchor, *(mine_at for _, mine_at in pairs)])
        for action, mine_at in pairs:
            if action.is_recv() and my_batch[mine_at] < my_batch[anchor]:
                moves[mine_at] = anchor
    if not moves:
        return False
    row: list[Action] = []
    for index, action in enumerate(mine):
        row.extend(mine[source] for source, target in moves.items() if target == index)
        if index not in moves:
            row.append(action)
    out[rank] = row
    return True
