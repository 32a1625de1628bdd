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
at the end of the schedule).

Memory model: a ``FORWARD`` or ``RECOMPUTE`` adds ``costs.activation_bytes(action)`` to the
stash of its ``(stage, unit, part)`` when it ends; the ``BACKWARD`` of that key releases the
whole stash when it ends (``ATTN_F`` / ``ATTN_B`` likewise, in a stash of their own). A key
whose backward is split (zero-bubble schedules: ``B`` input gradients, then ``W`` weight
gradients on the same rank) splits its stash: the ``B`` releases all but
``costs.activation_bytes(w)`` of it (what the weight gradients read: the GEMMs' inputs and
output gradients), and the ``W`` releases the rest when it ends. While a
compute action runs it also holds ``costs.workspace_bytes(action)`` (buffers freed at its end,
such as tensor parallelism's all-gathered inputs): the peak counts them on top of the memory
at the action's start and, for an action that stashes, at its end. Each rank starts at
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
Copy time is not compute time (``busy``); a rank's finish time includes its copy stream. A
schedule without memory actions replays exactly as before.

The engine is a work list: a rank runs until a group it waits for has a transfer whose peer has
not started it, parks, and is woken when that group completes. Every action is visited once, so
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

from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.chrome_trace import TraceEvent


@dataclass(frozen=True)
class UniformCosts:
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

    def static_bytes(self, rank: int) -> float:
        del rank
        return 0.0


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


_STASH = (Kind.FORWARD, Kind.RECOMPUTE, Kind.ATTN_F)
_RELEASE = (Kind.BACKWARD, Kind.WEIGHT, Kind.ATTN_B)


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


def simulate(schedule: Schedule, costs=None, trace: bool = True,
             eager_sends: bool = False) -> SimResult:
    """Replay ``schedule`` (with its transfers) against ``costs`` (default
    :class:`UniformCosts`). Raises :class:`Deadlock` when the schedule cannot finish."""
    costs = costs or UniformCosts()
    ranks = len(schedule)
    batch_end = [dict(transfer_batches(actions)) for actions in schedule]
    clock = [0.0] * ranks
    busy = [0.0] * ranks
    position = [0] * ranks
    memory = [float(costs.static_bytes(r)) for r in range(ranks)]
    timeline = [[(0.0, memory[r])] for r in range(ranks)]
    peak = list(memory)
    stash: list[dict] = [{} for _ in range(ranks)]
    weights = [{(a.stage, a.unit, a.part, False): a for a in actions if a.kind is Kind.WEIGHT}
               for actions in schedule]
    events: list[TraceEvent] = []
    parked = [False] * ranks
    copy_free = [0.0] * ranks
    copied: list[dict] = [{} for _ in range(ranks)]
    pending: list[list] = [[] for _ in range(ranks)]
    order = itertools.count()

    def settle(r: int, until: float) -> None:
        """Apply rank ``r``'s copy-stream memory changes due by ``until``, in time order."""
        due = pending[r]
        while due and due[0][0] <= until:
            at, _, slot, delta = heapq.heappop(due)
            stash[r][slot] = stash[r].get(slot, 0.0) + delta
            memory[r] += delta
            peak[r] = max(peak[r], memory[r])
            timeline[r].append((at, memory[r]))

    # Communication streams, one per rank and link (key ``(rank, link)``).
    queue: dict[tuple, deque] = defaultdict(deque)
    current: dict[tuple, _Group] = {}
    stream_free: dict[tuple, float] = defaultdict(float)
    launched: dict[tuple, tuple[_Group, Action]] = {}
    awaited: list[list[_Group]] = [[] for _ in range(ranks)]
    ready = deque(range(ranks))

    def advance(first: tuple) -> None:
        """Launch queued batches on every stream that has become free, matching transfers
        whose peers are launched too; wake ranks whose awaited batches completed."""
        free = [first]
        while free:
            stream = free.pop()
            while stream not in current and queue[stream]:
                group = queue[stream].popleft()
                group.launch(stream_free[stream])
                current[stream] = group
                for op in group.ops:
                    other = launched.pop(op.transfer_key(), None)
                    if other is None:
                        launched[op.transfer_key()] = (group, op)
                        continue
                    peer, peer_op = other
                    send, sender = (op, group) if op.is_send() else (peer_op, peer)
                    at = max(group.start, peer.start, sender.wire) + costs.transfer_time(send)
                    sender.wire = at
                    for side in (group, peer):
                        side.finish = max(side.finish, at)
                        side.open -= 1
                    if peer.open == 0:
                        free.append(complete(peer))
                if group.open == 0:
                    complete(group)

    def complete(group: _Group) -> tuple:
        stream = (group.rank, group.link)
        del current[stream]
        stream_free[stream] = group.finish
        q = group.rank
        if parked[q] and all(g.open == 0 for g in awaited[q]):
            parked[q] = False
            ready.append(q)
        return stream

    while ready:
        r = ready.popleft()
        parked[r] = False
        actions = schedule[r]
        ends = batch_end[r]
        i, now = position[r], clock[r]
        while i < len(actions):
            a = actions[i]
            kind = a.kind
            if a.is_communication():
                stop = ends[i]
                if not awaited[r]:
                    per_link: dict[tuple, list[Action]] = {}
                    for op in actions[i:stop]:
                        per_link.setdefault(op.link(), []).append(op)
                    for link in sorted(per_link):
                        group = _Group(r, link, i, per_link[link], now)
                        queue[(r, link)].append(group)
                        if not eager_sends or group.ops[0].is_recv():
                            awaited[r].append(group)
                        advance((r, link))
                if any(group.open for group in awaited[r]):
                    parked[r] = True
                    break
                now = max([now, *(group.finish for group in awaited[r])])
                awaited[r].clear()
                i = stop
                continue
            if a.is_memory():
                start = max(now, copy_free[r])
                took = costs.duration(a)
                copy_free[r] = start + took
                moved = costs.activation_bytes(a)
                slot = (a.stage, a.unit, a.part, False)
                copied[r][slot] = copy_free[r]
                if kind is Kind.RELOAD:
                    heapq.heappush(pending[r], (start, next(order), slot, moved))
                else:
                    heapq.heappush(pending[r], (copy_free[r], next(order), slot, -moved))
                if trace:
                    events.append(TraceEvent(r, str(a), start, took, "memory"))
                i += 1
                continue
            if kind is Kind.BACKWARD:
                now = max(now, copied[r].pop((a.stage, a.unit, a.part, False), now))
            took = costs.duration(a)
            settle(r, now)
            peak[r] = max(peak[r], memory[r] + costs.workspace_bytes(a))
            if trace:
                events.append(TraceEvent(r, str(a), now, took, "compute"))
            now += took
            busy[r] += took
            if kind in _STASH or kind in _RELEASE:
                settle(r, now)
                held = stash[r]
                slot = (a.stage, a.unit, a.part, kind in (Kind.ATTN_F, Kind.ATTN_B))
                if kind in _RELEASE:
                    freed = held.pop(slot, 0.0)
                    if kind is Kind.BACKWARD and slot in weights[r]:
                        held[slot] = min(freed, costs.activation_bytes(weights[r][slot]))
                        freed -= held[slot]
                    memory[r] -= freed
                else:
                    added = costs.activation_bytes(a)
                    held[slot] = held.get(slot, 0.0) + added
                    memory[r] += added
                    peak[r] = max(peak[r], memory[r] + costs.workspace_bytes(a))
                timeline[r].append((now, memory[r]))
            i += 1
        position[r], clock[r] = i, now
    blocked = {r: position[r] for r in range(ranks) if position[r] < len(schedule[r])}
    for (r, _), group in current.items():
        blocked[r] = min(blocked.get(r, group.index), group.index)
    if blocked:
        raise Deadlock(blocked)
    for r in range(ranks):
        settle(r, float("inf"))
        clock[r] = max([clock[r], copy_free[r],
                        *(free for (q, _), free in stream_free.items() if q == r)])
    total = max(clock, default=0.0)
    return SimResult(iteration_time=total, busy=busy, idle=[total - b for b in busy],
                     peak_memory=peak, memory_timeline=timeline, events=events)


def dry_run(schedule: Schedule, eager_sends: bool = False) -> None:
    """Raise :class:`Deadlock` when ``schedule`` cannot run to completion (costs ignored)."""
    simulate(schedule, UniformCosts(), trace=False, eager_sends=eager_sends)
