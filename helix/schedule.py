"""HelixPipe's first-in-last-out schedule as IR, its transfers, and per-part costs.

Actions (see :mod:`helix.model` for the parts): ``FORWARD``/``BACKWARD`` of unit ``m`` with
part ``.l<b>`` are the *boundary* ``b`` (``post(b - 1)`` + ``pre(b)``) on stage ``b mod p``;
``ATTN_F``/``ATTN_B`` with part ``.l<l>`` are the attention of layer ``l`` on stage
:func:`~helix.model.attention_stage`. A transfer carries one tensor and is named by its
*consumer's* part; the tensors are ``x`` (normed input), ``r`` (residual), ``w`` / ``wb`` (QKV
weight and bias, weight shipping) from a boundary to its attention, and ``o`` (attention output)
and ``res`` (the residual, relayed) from the attention to the next boundary; gradients travel
back under the same names.

Order (:func:`helix_order`). Micro-batches form *loops* of at most ``p F`` (``F`` folds, 2
for the two-fold schedule); in a full loop micro-batch ``m`` has *slot* ``d = (m // F) mod p``
(its fold is ``m mod F``). Its attention of layer ``l`` runs on stage ``(l + d + 1) mod p``,
so the ``p`` slots spread every layer's attention over all stages. Stage ``s`` walks its
boundaries ``c = s, s + p, ...`` (one past the last too, for the attention left over). For each
``c``:

1. attention part, slots ``d = p - 2 .. 0``: the attention of layer ``c - 1 - d`` (it arrived
   from boundary ``c - 1 - d`` and feeds boundary ``c - d``); at ``d = 0`` it feeds this stage's
   own boundary ``c``, which runs right after it;
2. boundary part, slots ``d = 1 .. p - 1``: boundary ``c``; at ``d = p - 1`` the attention of
   layer ``c`` is local and runs right after it.

With one stage (``p = 1``) there is one slot, and each boundary ``c`` is followed by the
attention of layer ``c``. Each slot runs its folds back to back. A loop's forwards come first,
then its backwards in exactly the reverse order (first in, last out: each stage's backward list
for the loop is its forward list reversed), then the next loop. So at most one loop (``p F``
micro-batches) is stashed at any time, whatever the micro-batch count, and each loop adds its
own bubble. With ``F = 2`` two micro-batches are in flight on every hop, so one fold's transfer
can overlap the other fold's compute.

Transfers (:func:`add_helix_communication`): sends right after the compute that produces
them (eager: the stage goes on at once); receives are *posted one compute ahead*
(:func:`post_receives_ahead`): before the compute action preceding their consumer, and waited
for right before the consumer itself (the executor's part extension and the simulator wait
there, :mod:`~megatron.plugin.pipeline.parts`). So while a stage runs one fold's attention
(or boundary), the other fold's inputs cross the network: the paper's Fig. 6b, where one
fold's transfers run behind the other fold's attention. A receive is never posted ahead of an
earlier receive on its link (the channel order NCCL matches by) nor ahead of a compute of its
own unit and part other than a recomputation (the consumer is the first of those; a boundary's
gradients are received while its recomputation runs). One compute ahead is the paper's
overlap; posting further ahead gains nothing at the paper's settings (the simulator's idle time
at 7B / H20 / 128K grows from 3.4 s one ahead to 3.9 s eight ahead) and holds receive buffers
longer.

Per-stage idle time per loop with uniform part costs (forward ``t``, backward ``2t``, transfers free) is
``3 F (p - 1)(t_pre + t_post)`` -- the paper's ``3(p-1)`` for one fold and ``6(p-1)`` for two --
and ``4 F (p - 1)(t_pre + t_post)`` when the boundaries are recomputed before their backward
(the paper's ``8(p-1)``); attention never appears in it. ``tests/unit/test_helix_schedule.py``
checks this against :func:`~megatron.plugin.pipeline.simulator.simulate`.

Micro-batch counts that are not a multiple of ``p F`` (:func:`helix_loops`): the loops are
as many as for the next multiple, but the empty slots are spread over them (loop sizes within
one of each other, and the slots of a loop within one micro-batch of each other) instead of
being left at the end: ``2p + 1`` micro-batches at ``p = 2`` run as loops of 3 and 2 rather
than 4 and a lone micro-batch, whose parts would run one after another on alternating stages
(the simulator's idle time at uniform part costs: two loops' bubbles instead of five). A slot with
fewer folds simply has less to overlap. :func:`padding` counts the empty slots (the log and the
metrics report it); an empty slot runs nothing and sends nothing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from helix.mapping import attention_stage
from megatron.plugin.pipeline.catalog import Built, Options
from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.passes import add_recomputation
from megatron.plugin.pipeline.simulator import CostDefaults
from megatron.plugin.pipeline.validation import validate


PRE_TENSORS = ("x", "r", "w")
"""What a boundary sends its attention (plus ``wb`` when the QKV projection has a bias)."""
POST_TENSORS = ("o", "res")
"""What an attention sends the next boundary."""


def part(index: int) -> str:
    return f".l{index}"


def part_index(name: str) -> int:
    return int(name[2:])


def padding(microbatches: int, pp: int, folds: int) -> int:
    """Empty slots of the loops: what completes ``microbatches`` to a multiple of ``pp x
    folds``."""
    return -microbatches % (pp * folds)


def helix_loops(microbatches: int, pp: int, folds: int) -> list[list[list[int]]]:
    """The units of each loop, per slot: ``loops[i][d]`` are the micro-batches of slot ``d`` in
    loop ``i``. As few loops as ``p x folds`` allows, their sizes as equal as possible (larger
    first); within a loop the slots' counts are as equal as possible (earlier slots first) and
    each slot takes consecutive units, so a full loop gives slot ``d`` the units
    ``first + d F .. first + d F + F - 1``."""
    count = -(-microbatches // (pp * folds))
    loops, first = [], 0
    for i in range(count):
        size = microbatches // count + (i < microbatches % count)
        loop = []
        for d in range(pp):
            n = size // pp + (d < size % pp)
            loop.append(list(range(first, first + n)))
            first += n
        loops.append(loop)
    return loops


def helix_order(pp: int, num_layers: int, microbatches: int, folds: int = 2) -> Schedule:
    """Per-stage compute order: loop after loop (:func:`helix_loops`), each loop's forwards,
    then the same list reversed as its backwards."""
    if pp < 1 or num_layers % pp:
        raise ValueError(f"helix needs pp >= 1 and layers divisible by pp (got pp={pp}, "
                         f"layers={num_layers})")
    if microbatches < 1 or folds < 1:
        raise ValueError(f"helix needs micro-batches >= 1 and folds >= 1 (got "
                         f"{microbatches}, {folds})")
    schedule = []
    for stage in range(pp):
        actions: list[Action] = []
        for units in helix_loops(microbatches, pp, folds):
            forwards = _loop_forwards(stage, pp, num_layers, units)
            actions += forwards
            actions += [Action(a.stage, _BACKWARD_OF[a.kind], a.unit, a.part)
                        for a in reversed(forwards)]
        schedule.append(actions)
    return schedule


def _loop_forwards(stage: int, pp: int, num_layers: int, units: list[list[int]]) -> list:
    """Stage ``stage``'s forwards of one loop (``units[d]``: the micro-batches of slot ``d``).
    With one stage there is one slot, and each boundary is followed by its layer's
    attention."""
    forwards: list[Action] = []
    if pp == 1:
        for c in range(num_layers + 1):
            for m in units[0]:
                forwards.append(Action(stage, Kind.FORWARD, m, part(c)))
                if c < num_layers:
                    forwards.append(Action(stage, Kind.ATTN_F, m, part(c)))
        return forwards
    for c in range(stage, num_layers + pp, pp):
        for d in range(pp - 2, -1, -1):
            layer = c - 1 - d
            for m in units[d]:
                if 0 <= layer < num_layers:
                    forwards.append(Action(stage, Kind.ATTN_F, m, part(layer)))
                if d == 0 and c <= num_layers:
                    forwards.append(Action(stage, Kind.FORWARD, m, part(c)))
        if c > num_layers:
            continue
        for d in range(1, pp):
            for m in units[d]:
                forwards.append(Action(stage, Kind.FORWARD, m, part(c)))
                if d == pp - 1 and c < num_layers:
                    forwards.append(Action(stage, Kind.ATTN_F, m, part(c)))
    return forwards


_BACKWARD_OF = {Kind.FORWARD: Kind.BACKWARD, Kind.ATTN_F: Kind.ATTN_B}


@dataclass(frozen=True)
class HelixFlow:
    """Where each helix transfer comes from and goes to (for the validator and executor)."""

    pp: int
    num_layers: int
    folds: int
    microbatches: int
    eager_sends = True
    """Hops run both ways round the ring, so a send cannot wait for its receive (see
    :func:`~megatron.plugin.pipeline.simulator.simulate`)."""

    @functools.cached_property
    def slots(self) -> dict[int, int]:
        """Unit -> its slot in its loop (:func:`helix_loops`)."""
        return {m: d for loop in helix_loops(self.microbatches, self.pp, self.folds)
                for d, units in enumerate(loop) for m in units}

    def attention_stage(self, layer: int, unit: int) -> int:
        return attention_stage(layer, self.slots[unit], self.pp)

    def producer(self, transfer: Action) -> tuple[Kind, int, str]:
        """``(kind, unit, part)`` of the compute that makes what ``transfer`` carries."""
        index = part_index(transfer.part)
        forward = transfer.kind in (Kind.SEND_F, Kind.RECV_F)
        if transfer.tensor in POST_TENSORS:
            if forward:
                return Kind.ATTN_F, transfer.unit, part(index - 1)
            return Kind.BACKWARD, transfer.unit, part(index + 1)
        if forward:
            return Kind.FORWARD, transfer.unit, transfer.part
        return Kind.ATTN_B, transfer.unit, transfer.part

    def consumer(self, transfer: Action) -> tuple[Kind, int, str]:
        """``(kind, unit, part)`` of the compute that uses what ``transfer`` carries."""
        forward = transfer.kind in (Kind.SEND_F, Kind.RECV_F)
        if transfer.tensor in POST_TENSORS:
            kind = Kind.FORWARD if forward else Kind.ATTN_B
        else:
            kind = Kind.ATTN_F if forward else Kind.BACKWARD
        return kind, transfer.unit, transfer.part


def add_helix_communication(schedule: Schedule, flow: HelixFlow,
                            pre_tensors=PRE_TENSORS) -> Schedule:
    """Transfers of every hop whose two ends are on different stages: receives right before
    the compute that consumes them, sends right after the compute that produces them."""
    L = flow.num_layers
    out: Schedule = []
    for actions in schedule:
        row: list[Action] = []
        for a in actions:
            index = part_index(a.part)
            if a.kind is Kind.FORWARD:
                if index > 0:
                    src = flow.attention_stage(index - 1, a.unit)
                    if src != a.stage:
                        row += [Action(a.stage, Kind.RECV_F, a.unit, a.part, src, t)
                                for t in POST_TENSORS]
                row.append(a)
                if index < L:
                    dst = flow.attention_stage(index, a.unit)
                    if dst != a.stage:
                        row += [Action(a.stage, Kind.SEND_F, a.unit, a.part, dst, t)
                                for t in pre_tensors]
            elif a.kind is Kind.ATTN_F:
                src, dst = index % flow.pp, (index + 1) % flow.pp
                if src != a.stage:
                    row += [Action(a.stage, Kind.RECV_F, a.unit, a.part, src, t)
                            for t in pre_tensors]
                row.append(a)
                if dst != a.stage:
                    row += [Action(a.stage, Kind.SEND_F, a.unit, part(index + 1), dst, t)
                            for t in POST_TENSORS]
            elif a.kind is Kind.BACKWARD:
                if index < L:
                    src = flow.attention_stage(index, a.unit)
                    if src != a.stage:
                        row += [Action(a.stage, Kind.RECV_B, a.unit, a.part, src, t)
                                for t in pre_tensors]
                row.append(a)
                if index > 0:
                    dst = flow.attention_stage(index - 1, a.unit)
                    if dst != a.stage:
                        row += [Action(a.stage, Kind.SEND_B, a.unit, part(index - 1), dst, t)
                                for t in POST_TENSORS]
            elif a.kind is Kind.ATTN_B:
                src, dst = (index + 1) % flow.pp, index % flow.pp
                if src != a.stage:
                    row += [Action(a.stage, Kind.RECV_B, a.unit, a.part, src, t)
                            for t in POST_TENSORS]
                row.append(a)
                if dst != a.stage:
                    row += [Action(a.stage, Kind.SEND_B, a.unit, a.part, dst, t)
                            for t in pre_tensors]
            else:
                row.append(a)
        out.append(row)
    return out


def post_receives_ahead(schedule: Schedule) -> Schedule:
    """Each receive moved before the compute action that precedes it (module doc): not
    before an earlier receive on its link, nor before a compute of its unit and part that is
    not a recomputation."""
    out: Schedule = []
    for actions in schedule:
        row: list[Action] = []
        last_on_link: dict[tuple, int] = {}
        for a in actions:
            at = len(row)
            if a.is_recv():
                floor = last_on_link.get(a.link(), -1) + 1
                passed = False
                while at > floor:
                    before = row[at - 1]
                    if before.is_compute():
                        own = (before.unit, before.part) == (a.unit, a.part) \
                            and before.kind is not Kind.RECOMPUTE
                        if passed or own:
                            break
                        passed = True
                    at -= 1
                for link, index in last_on_link.items():
                    if index >= at:
                        last_on_link[link] = index + 1
                last_on_link[a.link()] = at
            row.insert(at, a)
        out.append(row)
    return out


def planned_helix(pp: int, num_layers: int, microbatches: int, folds: int = 2,
                  recompute: bool = False, pre_tensors=PRE_TENSORS) -> Schedule:
    """The validated helix schedule with transfers (and recomputation of the boundaries)."""
    flow = HelixFlow(pp, num_layers, folds, microbatches)
    schedule = helix_order(pp, num_layers, microbatches, folds)
    if recompute:
        schedule = add_recomputation(schedule, lambda a: a.kind is Kind.FORWARD)
    schedule = post_receives_ahead(add_helix_communication(schedule, flow, pre_tensors))
    validate(schedule, flow=flow)
    return schedule


@dataclass(frozen=True)
class HelixCosts(CostDefaults):
    """Per-part costs for the simulator: a boundary costs ``t_post + t_pre`` (only ``t_pre``
    at boundary 0, only ``t_post`` at boundary ``L``), an attention ``t_attn``; backwards cost
    ``backward`` times their forward, a recompute the forward again; transfers ``transfer``.
    Memory stashed per forward (and per recompute): ``pre_bytes`` + ``post_bytes`` for a
    boundary (only its own part at boundaries 0 and ``L``), ``attention_bytes`` for an
    attention."""

    t_pre: float
    t_attn: float
    t_post: float
    num_layers: int
    backward: float = 2.0
    transfer: float = 0.0
    pre_bytes: float = 1.0
    post_bytes: float = 1.0
    attention_bytes: float = 1.0
    tensor_transfer: tuple[tuple[str, float], ...] = ()
    """``(tensor, seconds)``: the transfer time of the named tensors (their sizes differ: the
    QKV weight is not an activation); any other tensor takes ``transfer``."""

    def _boundary(self, action: Action, pre: float | None = None,
                  post: float | None = None) -> float:
        index = part_index(action.part)
        pre = self.t_pre if pre is None else pre
        post = self.t_post if post is None else post
        return (pre if index < self.num_layers else 0.0) + (post if index > 0 else 0.0)

    def duration(self, action: Action) -> float:
        if action.kind in (Kind.FORWARD, Kind.RECOMPUTE):
            return self._boundary(action)
        if action.kind is Kind.BACKWARD:
            return self.backward * self._boundary(action)
        if action.kind is Kind.ATTN_F:
            return self.t_attn
        if action.kind is Kind.ATTN_B:
            return self.backward * self.t_attn
        return 0.0

    def transfer_time(self, action: Action) -> float:
        return dict(self.tensor_transfer).get(action.tensor, self.transfer)

    def activation_bytes(self, action: Action) -> float:
        if action.kind is Kind.ATTN_F:
            return self.attention_bytes
        return self._boundary(action, self.pre_bytes, self.post_bytes)



def helix_ir(pp: int, microbatches: int, options: Options, *, num_layers: int | None,
             helix_folds: int, recompute: bool, pre_cost: float, attention_cost: float,
             post_cost: float) -> Built:
    """The helix schedule priced per part (``ScheduleSpec.build_ir``; the keywords are its
    drawing flags, :func:`helix.flags.add_draw_arguments`): ``num_layers`` layers (``None``:
    ``2 pp``), its folds and recomputation, the pre-attention, attention and post-attention
    forward costs; the backward of every part is ``options.backward / options.forward`` times
    its forward."""
    layers = num_layers if num_layers is not None else 2 * pp
    schedule = planned_helix(pp, layers, microbatches, helix_folds, recompute)
    costs = HelixCosts(pre_cost, attention_cost, post_cost, layers,
                       backward=options.backward / options.forward, transfer=options.transfer)
    return Built(schedule, costs, eager_sends=True)
