"""Schedule IR: per-rank ordered lists of immutable, hashable actions, and their text form.

A schedule is ``list[list[Action]]``: entry ``r`` is what pipeline rank ``r`` does, in order.
Generators emit compute actions only; passes add communication, recomputation and offload.

Text form (round-trips through :func:`parse` / ``str``)::

    <stage><KIND><unit>[<part>][<peer-arrow><peer>][:<tensor>]

    0F3            forward of unit 3 on stage 0 (whole stage)
    1B0            backward of unit 0 on stage 1 (with a ``W`` of its own: input gradients only)
    0W3            weight gradients of unit 3 on stage 0 (zero-bubble schedules split the
                   backward into ``B`` and ``W``; simulated only, the executor refuses it)
    0F3[0:2]       forward of unit 3 over the stage's layers 0..1
    2F1.attn       forward of a layer part (helix: pre / attn / post, with a layer number)
    0SEND_F3>1     stage 0 sends unit 3's activations to stage 1
    1RECV_F3<0     stage 1 receives them from stage 0
    1SEND_B3>0     stage 1 sends unit 3's input gradients back to stage 0
    0OFFLOAD2      offload unit 2's stashed activations to the host (RELOAD brings them back)
    1ATTN_F0.l4>2  helix: attention-only work for another stage's layer

``stage`` is the *pipeline stage* the action belongs to (with one stage per rank, the rank);
``unit`` the micro-batch, chunk or slice; ``part`` an optional layer range ``[a:b]`` or a named
part ``.name``; ``peer`` the stage on the other side of a transfer; ``tensor`` names the tensor
set of a transfer when it is not the default (activations for ``*_F``, gradients for ``*_B``).

Queries of one rank's list that the validator, the simulator and the executor share:
:func:`transfer_batches` (the transfers posted and waited for together) and :func:`consumers`
(the compute action each named receive feeds).
"""
from __future__ import annotations

import enum
import re
from collections import defaultdict
from dataclasses import dataclass


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    RECOMPUTE = "R"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    ATTN_F = "ATTN_F"
    ATTN_B = "ATTN_B"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.RECOMPUTE, Kind.ATTN_F,
                     Kind.ATTN_B})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECVS = frozenset({Kind.RECV_F, Kind.RECV_B})
#: A send and the receive that matches it.
MATCHING_RECV = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
MATCHING_SEND = {recv: send for send, recv in MATCHING_RECV.items()}


@dataclass(frozen=True)
class Action:
    """One step of one rank. Immutable and hashable; ``str`` gives the text form."""

    stage: int
    kind: Kind
    unit: int
    part: str | None = None
    peer: int | None = None
    tensor: str | None = None

    def __post_init__(self):
        if self.stage < 0 or self.unit < 0:
            raise ValueError(f"stage and unit must be non-negative: {self!r}")
        if self.is_communication() and self.peer is None:
            raise ValueError(f"{self.kind.value} needs a peer stage: {self!r}")
        if self.peer is not None and not (self.is_communication() or
                                          self.kind in (Kind.ATTN_F, Kind.ATTN_B)):
            raise ValueError(f"only transfers and foreign attention have a peer: {self!r}")
        if self.part is not None and not _PART.fullmatch(self.part):
            raise ValueError(f"part {self.part!r}: use '[a:b]' or '.name'")

    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def is_communication(self) -> bool:
        return self.kind in SENDS or self.kind in RECVS

    def is_send(self) -> bool:
        return self.kind in SENDS

    def is_recv(self) -> bool:
        return self.kind in RECVS

    def is_memory(self) -> bool:
        return self.kind in (Kind.OFFLOAD, Kind.RELOAD)

    def link(self) -> tuple[int, int]:
        """``(source stage, destination stage)`` of a transfer: each ordered pair of stages
        is a link with a communicator of its own (:mod:`~megatron.plugin.pipeline.p2p`)."""
        return self.transfer_key()[:2]

    def transfer_key(self) -> tuple:
        """Identity shared by a send and its matching receive:
        ``(source stage, destination stage, send kind, unit, part, tensor)``."""
        if self.is_send():
            return (self.stage, self.peer, self.kind, self.unit, self.part, self.tensor)
        if self.is_recv():
            return (self.peer, self.stage, MATCHING_SEND[self.kind], self.unit, self.part,
                    self.tensor)
        raise ValueError(f"{self} is not a transfer")

    def layer_range(self) -> tuple[int, int] | None:
        """``(a, b)`` for a ``[a:b]`` part, else ``None``."""
        if self.part and self.part.startswith("["):
            a, b = self.part[1:-1].split(":")
            return int(a), int(b)
        return None

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.unit}{self.part or ''}"
        if self.peer is not None:
            text += (">" if self.is_send() or self.kind in (Kind.ATTN_F, Kind.ATTN_B) else "<")
            text += str(self.peer)
        if self.tensor is not None:
            text += f":{self.tensor}"
        return text


Schedule = list[list[Action]]
"""One ordered list of actions per pipeline rank."""

_PART = re.compile(r"\[\d+:\d+\]|\.[A-Za-z_][A-Za-z0-9_]*")
#: The kind each text form names: :func:`parse` looks kinds up here.
KIND_OF_TEXT: dict[str, Kind] = {kind.value: kind for kind in Kind}
_ACTION = re.compile(
    rf"(?P<stage>\d+)(?P<kind>[A-Z][A-Z_]*)(?P<unit>\d+)(?P<part>{_PART.pattern})?"
    r"(?:(?P<arrow>[<>])(?P<peer>\d+))?(?::(?P<tensor>[A-Za-z_][A-Za-z0-9_]*))?")


def parse(text: str) -> Action:
    """Inverse of ``str(action)``."""
    match = _ACTION.fullmatch(text.strip())
    kind = None if match is None else KIND_OF_TEXT.get(match["kind"])
    if kind is None:
        raise ValueError(f"not an action: {text!r} (e.g. '0F3', '1RECV_F3<0', '0B2[0:4]')")
    peer = None if match["peer"] is None else int(match["peer"])
    if peer is not None:
        expected = ">" if kind in SENDS or kind in (Kind.ATTN_F, Kind.ATTN_B) else "<"
        if match["arrow"] != expected:
            raise ValueError(f"{text!r}: {kind.value} takes '{expected}' before its peer")
    return Action(int(match["stage"]), kind, int(match["unit"]), match["part"], peer,
                  match["tensor"])


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: ``rank: action action ...`` (the golden-file form)."""
    return "\n".join(f"{rank}: {' '.join(str(a) for a in actions)}"
                     for rank, actions in enumerate(schedule))


def parse_schedule(text: str) -> Schedule:
    """Inverse of :func:`format_schedule`."""
    schedule = []
    for number, line in enumerate(text.strip().splitlines()):
        rank, _, body = line.partition(":")
        if int(rank) != number:
            raise ValueError(f"line {number + 1} is for rank {rank}, expected {number}")
        schedule.append([parse(token) for token in body.split()])
    return schedule


def transfer_batches(actions: list[Action]) -> list[tuple[int, int]]:
    """``[start, stop)`` of every maximal run of consecutive transfers in one rank's list:
    the groups the executor posts together (``batch_isend_irecv``) and waits for together."""
    batches, i = [], 0
    while i < len(actions):
        if actions[i].is_communication():
            j = i
            while j < len(actions) and actions[j].is_communication():
                j += 1
            batches.append((i, j))
            i = j
        else:
            i += 1
    return batches


def consumers(actions: list[Action]) -> dict[int, int]:
    """Position of each receive that names a part -> the position of the first later compute
    action with its unit and part that is not a recomputation."""
    found, waiting = {}, defaultdict(list)
    for i, action in enumerate(actions):
        if action.kind in (Kind.RECV_F, Kind.RECV_B) and action.part is not None:
            waiting[(action.unit, action.part)].append(i)
        elif not action.is_communication() and action.kind is not Kind.RECOMPUTE:
            for j in waiting.pop((action.unit, action.part), ()):
                found[j] = i
    return found
