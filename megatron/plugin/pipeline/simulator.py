"""Replay of schedule IR against a cost model: iteration time, bubbles, memory timeline.

Execution model (the executor's): each rank runs its actions in order. Compute actions
(forward, backward, weight gradients, recompute, foreign attention) occupy the rank for
``costs.duration(action)``. A run of consecutive transfers is one *batch* (Megatron's
``send_forward_recv_backward`` and friends), posted as one group per *link* (ordered pair of
stages, :mod:`~megatron.plugin.pipeline.p2p`). Each rank has one stream per link, as NCCL
has one per communicator: a group starts when it is posted and the previous group on its
stream has completed, a transfer completes ``costs.transfer_time(send)`` after the later of
its two groups' starts -- and after the previous transfer of its sending group, whose
transfers share the link's bandwidth (they go back to back: the group completes when all its
bytes have crossed, as if they had shared the wire) -- and a group completes with its last
transfer. The rank waits for every
group of the batch; waiting is the rank's idle time. A schedule that finishes here cannot
deadlock on NCCL or gloo.

With ``eager_sends`` (schedules whose hops run against the pipeline's direction, helix) a rank
posts its sends and goes on at once: only the batch's receiving groups are waited for, and the
sends complete in the background, in order on their link's stream (the executor waits for them
at the end of the schedule). A receive that names a part (what a part program's executor
extension carries, :mod:`~megatron.plugin.pipeline.parts`) is not waited for at its batch
either: its group is waited for right before its *consumer*, the first later compute action of
the rank with the receive's unit and part other than a recomputation (which rebuilds from what
the forward kept), as that extension waits. A schedule can so post a receive ahead of other
compute and have its data cross meanwhile.

Memory model: a ``FORWARD`` or ``RECOMPUTE`` adds ``costs.activation_bytes(action)`` to the
stash of its ``(stage, unit, part)`` when it ends; the ``BACKWARD`` of that key releases the
whole stash when it ends (``ATTN_F`` / ``ATTN_B`` likewise, in a stash of their own). A key
whose backward is split (zero-bubble schedules: ``B`` input gradients, then ``W`` weight
gradients on the same rank) splits its stash: the ``B`` releases all but
``costs.activation_bytes(w)`` of it (what the weight gradients read: the GEMMs' inputs and
output gradients), and the ``W`` releases the rest when it ends. While a
compute action runs it also holds ``costs.workspace_bytes(action)`` (buffers freed at its end,
such as tensor parallelism's all-gathered inputs): the peak counts them on top of the memory
at the action's start and, for an action that stashes, at its end. A ``BACKWARD`` may also
create gradient sums that other units of its stage keep until their own backward (the K/V
store's dK/dV sums of a document's earlier slices): ``costs.gradient_sums(action)`` lists them
as ``(unit, bytes)``; the first backward that names a unit adds those bytes to its stash. The
backward creates them in ``costs.backward_layers(action)`` equal steps (one per layer: a layer's
attention backward makes that layer's sums), each while its own layer's share of the stash is
still held and after the later layers' shares were freed; before its steps it frees
``costs.head_bytes(action)`` (the model's head, whose backward runs first): the peak counts the
first step's sums on top of the rest of the stash, and all the sums beside the last step's
share of it. Each rank starts at
``costs.static_bytes(rank)`` (model state). The timeline lists ``(time, bytes)`` after every
change of the stash; the peak is its maximum, plus the workspace of the actions running then.

Offload and reload (``OFFLOAD`` / ``RELOAD``) run on a per-rank *copy stream* beside the compute
stream (CUDA: a side stream and pinned host buffers). Reaching one in its list, a rank enqueues
it and goes on at once; the copy stream runs its copies one after another, each starting when
it is enqueued or when the previous copy ends, whichever is later, and lasting
``costs.duration(action)``. ``costs.activation_bytes(action)`` is what a copy moves: an offload
takes those bytes off the device stash of its ``(stage, unit, part)`` when the copy *ends* (the
device buffer is live until then), a reload puts them back when it *starts* (the device buffer
is allocated first). A ``BACKWARD`` waits until the last copy of its key has ended.
Copy time is not compute time (``busy``); a rank's finish time includes its copy stream; a
schedule without memory actions has no copy stream.

The engine is a work list: a rank hands its actions, in order, to the handler of their kind
(:data:`HANDLERS`: a new kind of action is a new entry) until a group it waits for has a
transfer whose peer has not started it, parks, and is woken when that group completes. Every action is visited once, so
64 stages x 512 micro-batches replay in well under a second. A rank parked when the work list
empties is a deadlock (so is a group that never completes after its rank's last action):
:class:`Deadlock` names the blocked batch of every unfinished rank (the validator turns it into
the grid).
"""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

from megatron.plugin.pipeline.ir import Action, Kind, Schedule, consumers, transfer_batches
from megatron.plugin.pipeline.chrome_trace import TraceEvent


class CostDefaults:
    """The cost protocol's answers for what a schedule's costs do not model: no transfer time,
    no workspace, no gradient sums created for other units, no model state. A costs class
    inherits them and overrides what it prices."""

    def transfer_time(self, action: Action) -> float:
        del action
        return 0.0

    def workspace_bytes(self, action: Action) -> float:
        del action
        return 0.0

    def gradient_sums(self, action: Action) -> tuple:
        del action
        return ()

    def backward_layers(self, action: Action) -> int:
        """Equal steps in which a backward frees its stash and creates its gradient sums
        (module doc): 1, all at once."""
        del action
        return 1

    def head_bytes(self, action: Action) -> float:
        """Bytes of the stash a backward frees before its steps (the model's head): none."""
        del action
        return 0.0

    def static_bytes(self, rank: int) -> float:
        del rank
        return 0.0


@dataclass(frozen=True)
class UniformCosts(CostDefaults):
    """Unit costs: forward 1, backward 2 (the textbook 1F1B picture), free transfers, one
    memory unit per stashed forward."""

    forward: float = 1.0
    """Duration of a forward (and of a foreign-attention forward)."""
    backward: float = 2.0
    """Duration of a backward (and of a foreign-attention backward)."""
    weight: float = 1.0
    """Duration of a weight-gradient pass (``W``, zero-bubble schedules)."""
    recompute: float = 1.0
    """Duration of a recomputation."""
    transfer: float = 0.0
    """Time from a send to the arrival of its data."""
    activation: float = 1.0
    """Memory a forward (or a recompute) stashes until its backward."""
    weight_activation: float = 0.0
    """Part of that stash a split backward's ``B`` leaves for its ``W``."""

    def duration(self, action: Action) -> float:
        if action.kind in (Kind.FORWARD, Kind.ATTN_F):
            return self.forward
        if action.kind in (Kind.BACKWARD, Kind.ATTN_B):
            return self.backward
        if action.kind is Kind.RECOMPUTE:
            return self.recompute
        if action.kind is Kind.WEIGHT:
            return self.weight
        return 0.0

    def transfer_time(self, action: Action) -> float:
        del action
        return self.transfer

    def activation_bytes(self, action: Action) -> float:
        return self.weight_activation if action.kind is Kind.WEIGHT else self.activation

    workspace: float = 0.0
    """Memory a compute action holds while it runs, beyond its stash."""

    def workspace_bytes(self, action: Action) -> float:
        del action
        return self.workspace

class Deadlock(RuntimeError):
    """Replay stopped with ranks parked on transfers that their peers never post."""

    def __init__(self, blocked: dict[int, int]):
        self.blocked = blocked
        where = ", ".join(f"rank {r} at step {i}" for r, i in sorted(blocked.items()))
        super().__init__(f"deadlock: {where}")


@dataclass
class SimResult:
    iteration_time: float
    busy: list[float]
    """Per rank: time spent in compute actions."""
    idle: list[float]
    """Per rank: ``iteration_time - busy`` (waiting for data, or done early)."""
    peak_memory: list[float]
    memory_timeline: list[list[tuple[float, float]]]
    events: list[TraceEvent] = field(default_factory=list)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the ranks' time: ``sum(idle) / (ranks x iteration_time)``."""
        if self.iteration_time <= 0:
            return 0.0
        return sum(self.idle) / (len(self.idle) * self.iteration_time)


class _Group:
    """The transfers of one batch on one link, posted on the rank's stream for that link:
    launched when the stream is free, complete when every transfer in it is."""

    __slots__ = ("rank", "link", "index", "ops", "posted", "start", "finish", "open", "wire")

    def __init__(self, rank: int, link: tuple, index: int, ops: list[Action], posted: float):
        self.rank, self.link, self.index, self.ops = rank, link, index, ops
        self.posted = posted
        self.start = self.finish = self.wire = posted
        self.open = len(ops)

    def launch(self, stream_free: float) -> None:
        self.start = self.finish = self.wire = max(self.posted, stream_free)


@dataclass
class _Rank:
    """One rank's replay: where it is in its list, its clocks and its memory."""

    number: int
    actions: list[Action]
    memory: float
    """Static bytes plus what is stashed now."""
    batch_end: dict[int, int] = field(init=False)
    """Start of each transfer batch -> its stop."""
    weights: dict[tuple, Action] = field(init=False)
    """Stash slot -> the ``W`` that reads part of it (split backwards)."""
    peak: float = field(init=False)
    timeline: list[tuple[float, float]] = field(init=False)
    clock: float = 0.0
    """Time on the compute stream."""
    busy: float = 0.0
    position: int = 0
    parked: bool = False
    copy_free: float = 0.0
    """When the copy stream has run its last enqueued copy."""
    stash: dict[tuple, float] = field(default_factory=dict)
    summed: set = field(default_factory=set)
    """Stash slots whose gradient sums a backward has created."""
    copied: dict[tuple, float] = field(default_factory=dict)
    """Stash slot -> end of its last copy (its backward waits for it)."""
    pending: list[tuple] = field(default_factory=list)
    """Heap of the copy stream's ``(time, order, slot, bytes)`` memory changes to come."""
    awaited: list[_Group] = field(default_factory=list)
    """Groups of the batch the rank waits for."""
    arriving: dict[int, list[_Group]] = field(default_factory=dict)
    """Position of a consumer -> the posted receiving groups it waits for (eager sends)."""
    consumer: dict[int, int] = field(init=False)
    """Position of a receive that names a part -> the position of its consumer."""

    def __post_init__(self):
        self.batch_end = dict(transfer_batches(self.actions))
        self.consumer = consumers(self.actions)
        self.weights = {_slot(a): a for a in self.actions if a.kind is Kind.WEIGHT}
        self.peak = self.memory
        self.timeline = [(0.0, self.memory)]

    def settle(self, until: float) -> None:
        """Apply the copy stream's memory changes due by ``until``, in time order."""
        while self.pending and self.pending[0][0] <= until:
            at, _, slot, delta = heapq.heappop(self.pending)
            self.stash[slot] = self.stash.get(slot, 0.0) + delta
            self.memory += delta
            self.peak = max(self.peak, self.memory)
            self.timeline.append((at, self.memory))


def _slot(action: Action) -> tuple:
    """The stash an action fills or frees: its stage, unit and part, foreign attention apart."""
    return (action.stage, action.unit, action.part, action.kind in (Kind.ATTN_F, Kind.ATTN_B))


class _Replay:
    """The work list: ranks ready to run, and one communication stream per rank and link
    (key ``(rank, link)``)."""

    def __init__(self, schedule: Schedule, costs, trace: bool, eager_sends: bool):
        self.costs, self.trace, self.eager_sends = costs, trace, eager_sends
        self.ranks = [_Rank(r, actions, float(costs.static_bytes(r)))
                      for r, actions in enumerate(schedule)]
        self.events: list[TraceEvent] = []
        self.order = itertools.count()
        self.queue: dict[tuple, deque] = defaultdict(deque)
        self.current: dict[tuple, _Group] = {}
        self.stream_free: dict[tuple, float] = defaultdict(float)
        self.launched: dict[tuple, tuple[_Group, Action]] = {}
        self.ready = deque(range(len(schedule)))

    def run(self) -> None:
        """Run ready ranks until each finishes or parks on a batch (woken when it completes)."""
        while self.ready:
            rank = self.ranks[self.ready.popleft()]
            rank.parked = False
            while rank.position < len(rank.actions):
                action = rank.actions[rank.position]
                if rank.position in rank.arriving and not self.arrived(rank):
                    rank.parked = True
                    break
                following = HANDLERS[action.kind](self, rank, action)
                if following is None:
                    rank.parked = True
                    break
                rank.position = following

    def post(self, rank: _Rank, stop: int) -> None:
        """Queue the batch ``[rank.position, stop)`` as one group per link; the rank awaits
        them all, or only its receiving groups with ``eager_sends``."""
        per_link: dict[tuple, list[int]] = {}
        for i in range(rank.position, stop):
            per_link.setdefault(rank.actions[i].link(), []).append(i)
        for link in sorted(per_link):
            group = _Group(rank.number, link, rank.position,
                           [rank.actions[i] for i in per_link[link]], rank.clock)
            self.queue[(rank.number, link)].append(group)
            if not self.eager_sends:
                rank.awaited.append(group)
            elif group.ops[0].is_recv():
                deferred = {rank.consumer.get(i) for i in per_link[link]}
                if None in deferred:
                    rank.awaited.append(group)
                for position in deferred - {None}:
                    rank.arriving.setdefault(position, []).append(group)
            self.advance((rank.number, link))

    def arrived(self, rank: _Rank) -> bool:
        """Whether the receiving groups the action at the rank's position consumes have
        completed; then the rank's clock moves past the last of them."""
        groups = rank.arriving[rank.position]
        if any(group.open for group in groups):
            rank.awaited = groups
            return False
        rank.clock = max([rank.clock, *(group.finish for group in groups)])
        del rank.arriving[rank.position]
        rank.awaited = []
        return True

    def advance(self, first: tuple) -> None:
        """Launch queued batches on every stream that has become free, matching transfers
        whose peers are launched too; wake ranks whose awaited batches completed."""
        free = [first]
        while free:
            stream = free.pop()
            while stream not in self.current and self.queue[stream]:
                group = self.queue[stream].popleft()
                group.launch(self.stream_free[stream])
                self.current[stream] = group
                for op in group.ops:
                    other = self.launched.pop(op.transfer_key(), None)
                    if other is None:
                        self.launched[op.transfer_key()] = (group, op)
                        continue
                    peer, peer_op = other
                    send, sender = (op, group) if op.is_send() else (peer_op, peer)
                    at = max(group.start, peer.start, sender.wire) + self.costs.transfer_time(send)
                    sender.wire = at
                    for side in (group, peer):
                        side.finish = max(side.finish, at)
                        side.open -= 1
                    if peer.open == 0:
                        free.append(self.complete(peer))
                if group.open == 0:
                    self.complete(group)

    def complete(self, group: _Group) -> tuple:
        """Free the group's stream; returns the stream."""
        stream = (group.rank, group.link)
        del self.current[stream]
        self.stream_free[stream] = group.finish
        waiting = self.ranks[group.rank]
        if waiting.parked and all(g.open == 0 for g in waiting.awaited):
            waiting.parked = False
            self.ready.append(group.rank)
        return stream

    def compute(self, rank: _Rank, action: Action) -> None:
        """Occupy the rank for the action's duration, holding its workspace meanwhile, and
        apply the copy stream's memory changes due by its end."""
        took = self.costs.duration(action)
        rank.settle(rank.clock)
        rank.peak = max(rank.peak, rank.memory + self.costs.workspace_bytes(action))
        if self.trace:
            self.events.append(TraceEvent(rank.number, str(action), rank.clock, took, "compute"))
        rank.clock += took
        rank.busy += took
        rank.settle(rank.clock)

    def copy(self, rank: _Rank, action: Action) -> tuple[float, float, float]:
        """Enqueue the action on the rank's copy stream; returns its start, end and bytes."""
        start = max(rank.clock, rank.copy_free)
        took = self.costs.duration(action)
        rank.copy_free = start + took
        moved = self.costs.activation_bytes(action)
        rank.copied[_slot(action)] = rank.copy_free
        if self.trace:
            self.events.append(TraceEvent(rank.number, str(action), start, took, "memory"))
        return start, rank.copy_free, moved

    def blocked(self) -> dict[int, int]:
        """Rank -> the step it is stuck at, for every rank with actions or groups left."""
        blocked = {rank.number: rank.position for rank in self.ranks
                   if rank.position < len(rank.actions)}
        for (r, _), group in self.current.items():
            blocked[r] = min(blocked.get(r, group.index), group.index)
        return blocked

    def result(self) -> SimResult:
        """Drain the copy streams; a rank finishes with its last compute, copy or group."""
        for rank in self.ranks:
            rank.settle(float("inf"))
            rank.clock = max([rank.clock, rank.copy_free,
                              *(free for (q, _), free in self.stream_free.items()
                                if q == rank.number)])
        total = max((rank.clock for rank in self.ranks), default=0.0)
        busy = [rank.busy for rank in self.ranks]
        return SimResult(iteration_time=total, busy=busy, idle=[total - b for b in busy],
                         peak_memory=[rank.peak for rank in self.ranks],
                         memory_timeline=[rank.timeline for rank in self.ranks],
                         events=self.events)


Handler = Callable[[_Replay, _Rank, Action], "int | None"]
"""Replays one action at ``rank.position``; returns the position of the rank's next action, or
``None`` when the rank parks there."""


def _transfers(replay: _Replay, rank: _Rank, action: Action) -> int | None:
    """A batch of transfers: posted on first visit, passed once its awaited groups complete
    (the rank waits for the last of them)."""
    stop = rank.batch_end[rank.position]
    if not rank.awaited:
        replay.post(rank, stop)
    if any(group.open for group in rank.awaited):
        return None
    rank.clock = max([rank.clock, *(group.finish for group in rank.awaited)])
    rank.awaited.clear()
    return stop


def _stash(replay: _Replay, rank: _Rank, action: Action) -> int:
    """Forward, recompute, foreign-attention forward: its activations join its stash when it
    ends (the peak counts its workspace on top)."""
    replay.compute(rank, action)
    added = replay.costs.activation_bytes(action)
    slot = _slot(action)
    rank.stash[slot] = rank.stash.get(slot, 0.0) + added
    rank.memory += added
    rank.peak = max(rank.peak, rank.memory + replay.costs.workspace_bytes(action))
    rank.timeline.append((rank.clock, rank.memory))
    return rank.position + 1


def _backward(replay: _Replay, rank: _Rank, action: Action) -> int:
    """Backward: waits for the last copy of its stash, adds the gradient sums it creates for
    other units, frees its own stash when it ends but for what its own ``W`` reads."""
    slot = _slot(action)
    rank.clock = max(rank.clock, rank.copied.pop(slot, rank.clock))
    replay.compute(rank, action)
    created = 0.0
    for unit, added in replay.costs.gradient_sums(action):
        target = (action.stage, unit, action.part, False)
        if target in rank.stash and target not in rank.summed:
            rank.summed.add(target)
            rank.stash[target] += added
            created += added
    if created:
        steps = replay.costs.backward_layers(action)
        held = rank.stash.get(slot, 0.0)
        head = min(replay.costs.head_bytes(action), held)
        own, before = held - head, rank.memory - head
        rank.peak = max(rank.peak, before + created / steps,
                        before - own * (steps - 1) / steps + created)
        rank.memory += created
        rank.timeline.append((rank.clock, rank.memory))
    freed = rank.stash.pop(slot, 0.0)
    if slot in rank.weights:
        rank.stash[slot] = min(freed, replay.costs.activation_bytes(rank.weights[slot]))
        freed -= rank.stash[slot]
    rank.memory -= freed
    rank.timeline.append((rank.clock, rank.memory))
    return rank.position + 1


def _release(replay: _Replay, rank: _Rank, action: Action) -> int:
    """Weight gradients, foreign-attention backward: free what is left of the stash."""
    replay.compute(rank, action)
    rank.memory -= rank.stash.pop(_slot(action), 0.0)
    rank.timeline.append((rank.clock, rank.memory))
    return rank.position + 1


def _offload(replay: _Replay, rank: _Rank, action: Action) -> int:
    """Offload: its bytes leave the device stash when the copy ends."""
    _, end, moved = replay.copy(rank, action)
    heapq.heappush(rank.pending, (end, next(replay.order), _slot(action), -moved))
    return rank.position + 1


def _reload(replay: _Replay, rank: _Rank, action: Action) -> int:
    """Reload: its bytes are back in the device stash when the copy starts."""
    start, _, moved = replay.copy(rank, action)
    heapq.heappush(rank.pending, (start, next(replay.order), _slot(action), moved))
    return rank.position + 1


#: The handler of each action kind (a new kind of action is a new entry).
HANDLERS: dict[Kind, Handler] = {
    Kind.FORWARD: _stash, Kind.RECOMPUTE: _stash, Kind.ATTN_F: _stash,
    Kind.BACKWARD: _backward, Kind.WEIGHT: _release, Kind.ATTN_B: _release,
    Kind.OFFLOAD: _offload, Kind.RELOAD: _reload,
    Kind.SEND_F: _transfers, Kind.RECV_F: _transfers,
    Kind.SEND_B: _transfers, Kind.RECV_B: _transfers,
}


def simulate(schedule: Schedule, costs=None, trace: bool = True,
             eager_sends: bool = False) -> SimResult:
    """Replay ``schedule`` (with its transfers) against ``costs`` (default
    :class:`UniformCosts`). Raises :class:`Deadlock` when the schedule cannot finish."""
    replay = _Replay(schedule, costs or UniformCosts(), trace, eager_sends)
    replay.run()
    blocked = replay.blocked()
    if blocked:
        raise Deadlock(blocked)
    return replay.result()


def dry_run(schedule: Schedule, eager_sends: bool = False) -> None:
    """Raise :class:`Deadlock` when ``schedule`` cannot run to completion (costs ignored)."""
    simulate(schedule, UniformCosts(), trace=False, eager_sends=eager_sends)
