"""Checks every schedule passes before it runs; a failure shows the grid with the step marked.

:func:`validate` checks, in order:

1. placement: every stage lives on exactly one rank, no action appears twice on a rank;
2. pairing: every forward (foreign-attention forward) has exactly one backward (attention
   backward) on the same rank, every backward and recompute follows its forward, a
   recompute precedes its backward, a weight-gradient pass (``W``) follows its backward; an
   offload follows its forward and has its reload after
   it, and a reload follows its offload and precedes its backward (same stage, unit and part:
   the activations are back on the device before the backward reads them);
   :data:`ORDER_RULES` holds these orders and those of point 3, per kind of action;
3. local order of transfers: a send follows the compute that produced what it carries, a
   receive precedes the compute that consumes it. By default (layer-wise pipelines) that is
   the forward (backward) of the same unit and part; schedules whose transfers connect
   different parts (helix) pass a ``flow`` with ``producer(transfer)`` and
   ``consumer(transfer)`` returning ``(kind, unit, part)``;
4. matching: every send has exactly one receive on the peer's rank and vice versa, with equal
   shapes when ``shape_of`` is given;
5. channel order: between two ranks, receives are posted in the order of the sends. NCCL
   matches point-to-point transfers by issue order only, so this is what makes a schedule
   portable between gloo and NCCL;
6. a dry run (:func:`~megatron.plugin.pipeline.simulator.dry_run`) proves there is no
   deadlock under NCCL's rules: transfers posted in batches, one group per link, each link an
   in-order stream on each of its two ranks (a group starts when the previous one on that
   stream has completed and completes when both sides have posted); a rank waits for every
   group of its batch (or, when the flow has ``eager_sends``, for its receiving groups only,
   and for those of a receive that names a part right before its consumer);
7. with ``eager_sends``, the compute the simulator waits at for a receive that names a part
   (the first later compute of its unit and part that is not a recomputation) is the one
   ``flow.consumer`` names, the one the executor waits at
   (:mod:`~megatron.plugin.pipeline.parts`).

A failure raises :class:`ScheduleError` (a ``ValueError``) whose message holds the
per-rank grid around the failing step, the failing cells marked ``<-- ERROR HERE``.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from megatron.plugin.pipeline.ir import Action, Kind, Schedule, consumers
from megatron.plugin.pipeline.simulator import Deadlock, dry_run


#: Steps shown before and after the failing one.
_CONTEXT = 4


class ScheduleError(ValueError):
    """An invalid schedule; ``marks`` are the ``(rank, step)`` cells at fault."""

    def __init__(self, reason: str, schedule: Schedule, marks: list[tuple[int, int]]):
        self.reason = reason
        self.marks = marks
        super().__init__(f"invalid schedule: {reason}\n{format_grid(schedule, marks)}")


def format_grid(schedule: Schedule, marks: list[tuple[int, int]] = ()) -> str:
    """Step x rank table of ``schedule``; rows near ``marks`` only, marked cells flagged."""
    marks = set(marks)
    height = max((len(actions) for actions in schedule), default=0)
    if marks:
        rows = sorted({i for _, step in marks
                       for i in range(max(0, step - _CONTEXT), min(height, step + _CONTEXT + 1))})
    else:
        rows = list(range(height))
    cells = [[""] * len(schedule) for _ in rows]
    for line, step in enumerate(rows):
        for rank, actions in enumerate(schedule):
            if step < len(actions):
                cells[line][rank] = str(actions[step])
            if (rank, step) in marks:
                cells[line][rank] += " <-- ERROR HERE"
    widths = [max([len(f"rank {r}")] + [len(row[r]) for row in cells])
              for r in range(len(schedule))]
    header = "step | " + " | ".join(f"rank {r}".ljust(w) for r, w in enumerate(widths))
    out = [header, "-" * len(header)]
    previous = None
    for line, step in enumerate(rows):
        if previous is not None and step != previous + 1:
            out.append("  ...")
        out.append(f"{step:4d} | " + " | ".join(c.ljust(w) for c, w in zip(cells[line], widths)))
        previous = step
    return "\n".join(out)


def validate(schedule: Schedule, shape_of: Callable[[Action], tuple] | None = None,
             flow=None) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` can run correctly (see module doc)."""
    _check_placement(schedule)
    for rank, actions in enumerate(schedule):
        _check_rank(schedule, rank, actions, flow or LayerwiseFlow())
    _check_matching(schedule, shape_of)
    try:
        dry_run(schedule, eager_sends=getattr(flow, "eager_sends", False))
    except Deadlock as err:
        raise ScheduleError("deadlock: every unfinished rank waits for a receive whose send "
                            "never comes (marked)", schedule,
                            sorted(err.blocked.items())) from None
    if getattr(flow, "eager_sends", False):
        for rank, actions in enumerate(schedule):
            _check_waits(schedule, rank, actions, flow)


def _check_waits(schedule: Schedule, rank: int, actions: list[Action], flow) -> None:
    for step, waits_at in consumers(actions).items():
        a, at = actions[step], actions[waits_at]
        if flow.consumer(a) != (at.kind, at.unit, at.part):
            kind = flow.consumer(a)[0].name.lower()
            raise ScheduleError(f"{a} is posted before {at}, which would wait for it; its "
                                f"consumer is the {kind} of its unit and part: post it after "
                                f"{at}", schedule, [(rank, step), (rank, waits_at)])


def _check_placement(schedule: Schedule) -> None:
    owner: dict[int, int] = {}
    for rank, actions in enumerate(schedule):
        seen: dict[Action, int] = {}
        for step, a in enumerate(actions):
            if owner.setdefault(a.stage, rank) != rank:
                first = owner[a.stage]
                raise ScheduleError(f"stage {a.stage} has actions on ranks {first} and {rank}",
                                    schedule, [(rank, step)])
            if a in seen:
                raise ScheduleError(f"{a} appears twice on rank {rank}", schedule,
                                    [(rank, seen[a]), (rank, step)])
            seen[a] = step


class LayerwiseFlow:
    """Transfers of a layer-wise pipeline: activations come from the forward and go to the
    forward of the same unit and part, gradients likewise between backwards."""

    _COMPUTE = {Kind.SEND_F: Kind.FORWARD, Kind.RECV_F: Kind.FORWARD,
                Kind.SEND_B: Kind.BACKWARD, Kind.RECV_B: Kind.BACKWARD}

    eager_sends = False

    def producer(self, transfer: Action) -> tuple:
        return self._COMPUTE[transfer.kind], transfer.unit, transfer.part

    consumer = producer


@dataclass(frozen=True)
class OrderRule:
    """An action needs another action of its rank ``before`` (at or before its step),
    ``after`` (at or after it) or ``anywhere``; ``message`` (formatted with ``a``, ``rank``
    and the other action's ``kind``) says what is wrong when it is missing or misplaced."""

    other: Callable[[Action, object], tuple]
    """``(action, flow) -> (kind, stage, unit, part)`` of the action needed."""
    order: str
    message: str


_ORDER = {"before": operator.le, "after": operator.ge, "anywhere": lambda found, step: True}


def _same(kind: Kind) -> Callable[[Action, object], tuple]:
    """The action of ``kind`` with the same stage, unit and part."""
    return lambda a, flow: (kind, a.stage, a.unit, a.part)


def _produced(a: Action, flow) -> tuple:
    """The compute that produced what a send carries."""
    kind, unit, part = flow.producer(a)
    return kind, a.stage, unit, part


def _consumed(a: Action, flow) -> tuple:
    """The compute that consumes what a receive brings."""
    kind, unit, part = flow.consumer(a)
    return kind, a.stage, unit, part


_NO_BACKWARD = OrderRule(_same(Kind.BACKWARD), "after", "{a} has no backward after it")
_AFTER_FORWARD = OrderRule(_same(Kind.FORWARD), "before", "{a} comes before its forward")
_SENT = OrderRule(_produced, "before",
                  "{a} sends what no earlier {kind} on rank {rank} produced")
_RECEIVED = OrderRule(_consumed, "after",
                      "{a} receives what no later {kind} on rank {rank} uses")

#: The rules each kind of action obeys on its rank, checked in order (a new kind of action
#: is a new entry).
ORDER_RULES: dict[Kind, tuple[OrderRule, ...]] = {
    Kind.FORWARD: (OrderRule(_same(Kind.BACKWARD), "anywhere",
                             "{a} has no backward on rank {rank}"),),
    Kind.ATTN_F: (OrderRule(_same(Kind.ATTN_B), "anywhere",
                            "{a} has no backward on rank {rank}"),),
    Kind.BACKWARD: (_AFTER_FORWARD,),
    Kind.ATTN_B: (OrderRule(_same(Kind.ATTN_F), "before", "{a} comes before its forward"),),
    Kind.RECOMPUTE: (_AFTER_FORWARD, _NO_BACKWARD),
    Kind.WEIGHT: (OrderRule(_same(Kind.BACKWARD), "before", "{a} comes before its backward"),),
    Kind.OFFLOAD: (OrderRule(_same(Kind.FORWARD), "before",
                             "{a} offloads what no earlier forward stashed"),
                   OrderRule(_same(Kind.RELOAD), "after", "{a} has no reload after it")),
    Kind.RELOAD: (OrderRule(_same(Kind.OFFLOAD), "before",
                            "{a} reloads what no earlier offload stored"), _NO_BACKWARD),
    Kind.SEND_F: (_SENT,), Kind.SEND_B: (_SENT,),
    Kind.RECV_F: (_RECEIVED,), Kind.RECV_B: (_RECEIVED,),
}


def _check_rank(schedule: Schedule, rank: int, actions: list[Action], flow) -> None:
    where: dict[tuple, int] = {}
    for step, a in enumerate(actions):
        if a.is_compute() or a.is_memory():
            where[(a.kind, a.stage, a.unit, a.part)] = step
    for step, a in enumerate(actions):
        for rule in ORDER_RULES[a.kind]:
            other = rule.other(a, flow)
            found = where.get(other)
            if found is None or not _ORDER[rule.order](found, step):
                raise ScheduleError(rule.message.format(a=a, rank=rank,
                                                        kind=other[0].name.lower()),
                                    schedule, [(rank, step)])


def _check_matching(schedule: Schedule, shape_of) -> None:
    rank_of = {a.stage: r for r, actions in enumerate(schedule) for a in actions}
    sends: dict[tuple, tuple[int, int]] = {}
    recvs: dict[tuple, tuple[int, int]] = {}
    channel_sends = defaultdict(list)
    channel_recvs = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for step, a in enumerate(actions):
            if not a.is_communication():
                continue
            if a.peer not in rank_of:
                raise ScheduleError(f"{a}: peer stage {a.peer} runs nothing", schedule,
                                    [(rank, step)])
            key = a.transfer_key()
            book, channels = (sends, channel_sends) if a.is_send() else (recvs, channel_recvs)
            book[key] = (rank, step)
            src, dst = (rank, rank_of[a.peer]) if a.is_send() else (rank_of[a.peer], rank)
            channels[(src, dst)].append(key)
    for key, (rank, step) in sends.items():
        if key not in recvs:
            raise ScheduleError(f"{schedule[rank][step]} has no matching receive on stage "
                                f"{key[1]}", schedule, [(rank, step)])
    for key, (rank, step) in recvs.items():
        if key not in sends:
            raise ScheduleError(f"{schedule[rank][step]} has no matching send on stage {key[0]}",
                                schedule, [(rank, step)])
        if shape_of is not None:
            send = schedule[sends[key][0]][sends[key][1]]
            recv = schedule[rank][step]
            if tuple(shape_of(send)) != tuple(shape_of(recv)):
                raise ScheduleError(f"{send} sends shape {tuple(shape_of(send))} but {recv} "
                                    f"expects {tuple(shape_of(recv))}", schedule,
                                    [sends[key], (rank, step)])
    for channel, order in channel_sends.items():
        for sent, received in zip(order, channel_recvs[channel]):
            if sent != received:
                raise ScheduleError(
                    f"rank {channel[1]} receives from rank {channel[0]} out of send order "
                    f"(NCCL matches transfers between two ranks by order only)", schedule,
                    [sends[sent], recvs[received]])
