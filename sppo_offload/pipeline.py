"""SPPO's subsequence pipeline as schedule IR, and the pass that adds offload and reload.

Order. The ``N`` subsequences of one sequence run on ``p`` stages; subsequence ``j`` attends to
the K/V of subsequences ``0..j-1`` (the K/V-context execution of the elastic schedule), so its
backward produces K/V gradients for all of them. Subsequence ``i``'s backward is therefore
complete only after the backwards of every ``j > i``, and those need the forwards of every
``j > i`` first. With one sequence in the pipeline the only valid per-stage order is

    F0 F1 ... F(N-1)  B(N-1) B(N-2) ... B0

which is :func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b` with the backward order
reversed: the 1F1B rule "the next backward once its unit has been forwarded" asks for every
forward before ``B(N-1)``. The forward of ``j`` on stage ``s`` follows the forward of ``j`` on
``s - 1`` (activations) and of ``j - 1`` on ``s`` (K/V); the backward of ``j`` on ``s`` follows
the backward of ``j`` on ``s + 1`` (output gradient) and of ``j + 1`` on ``s`` (dK/dV). The
pipeline's bubbles are its fill (stage ``s`` starts ``s`` forwards late) and its drain, which
:mod:`sppo_offload.multiplex` fills. Every stage holds all ``N`` subsequences at the turn from
forwards to backwards; offloading is what makes that fit.

Offload placement (:func:`add_offload`, a pure pass like ``add_recomputation``): the offload of
subsequence ``i - 1`` is issued right before the forward of ``i`` (after that forward's
receive), so its copy overlaps exactly the forward of ``i`` -- the pairing SPPO's ratio formula
assumes -- and a run of transfers is never split (the executor posts consecutive transfers as
one batch). A unit with no later forward on its stage is offloaded right after its forward and
its send. The reload of ``i`` is prefetched one backward ahead: issued right before the backward
that precedes ``B(i)`` in the stage's order (``B(i+1)`` here), so the copy overlaps that
backward; the first backward's own unit, having no predecessor, is reloaded right before its
backward. Offload and reload run on the copy stream (see the simulator).

Several sequences (the documents of one training batch, :mod:`sppo_offload.subsequence_batch`): units are
numbered across the sequences in order, each sequence's subsequences consecutive; every rank
runs the backwards sequence by sequence, each sequence last-first, and forwards the next
sequence's subsequences in the 1F1B way while it runs the current one's backwards
(:func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b` with
:func:`~megatron.plugin.pipeline.schedule_1f1b.reversed_within_groups`), so the next sequence
fills the current one's drain. A sequence may then have fewer subsequences than stages (a
short document); the ``N >= PP`` rule is for the one-sequence pipeline.
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatron.plugin.pipeline.catalog import Built, Options
from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.passes import add_communication, add_recomputation
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b, reversed_within_groups
from megatron.plugin.pipeline.simulator import UniformCosts
from megatron.plugin.pipeline.validation import validate


def subsequence_schedule(pp: int, num_subsequences: int | Sequence[int]) -> Schedule:
    """Compute-only per-rank order for ``num_subsequences`` subsequences of one sequence on
    ``pp`` stages: every forward in order, then the backwards last-first. A sequence of counts
    is several sequences, one after the other (module doc)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if not isinstance(num_subsequences, int):
        counts = list(num_subsequences)
        if not counts:
            raise ValueError("a batch needs at least one sequence")
        return one_f_one_b(pp, sum(counts), reversed_within_groups(counts))
    if num_subsequences < pp:
        raise ValueError(f"{num_subsequences} subsequences on {pp} pipeline stages leave "
                         f"stages without work; use at least {pp} subsequences (N >= PP)")
    return one_f_one_b(pp, num_subsequences, list(range(num_subsequences - 1, -1, -1)))


def add_offload(schedule: Schedule, offloaded: Callable[[Action], bool],
                prefetch: int = 1) -> Schedule:
    """Insert ``OFFLOAD`` / ``RELOAD`` for every forward ``f`` with ``offloaded(f)`` true
    (placement in the module doc; ``prefetch`` is how many backwards ahead a reload is issued,
    0 for right before its own backward). Works with or without transfers in ``schedule``."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    out: Schedule = []
    for actions in schedule:
        forwards = [a for a in actions if a.kind is Kind.FORWARD]
        backwards = [a for a in actions if a.kind is Kind.BACKWARD]
        marked = [(k, a) for k, a in enumerate(forwards) if offloaded(a)]
        offload_before: dict[Action, list[Action]] = {}
        offload_after: dict[Action, list[Action]] = {}
        for k, f in marked:
            memory = Action(f.stage, Kind.OFFLOAD, f.unit, f.part)
            if k + 1 < len(forwards):
                offload_before.setdefault(forwards[k + 1], []).append(memory)
            else:
                offload_after.setdefault(f, []).append(memory)
        reload_before: dict[Action, list[Action]] = {}
        position = {(b.stage, b.unit, b.part): k for k, b in enumerate(backwards)}
        for _, f in marked:
            k = position.get((f.stage, f.unit, f.part))
            if k is None:
                raise ValueError(f"{f} is offloaded but has no backward on its rank")
            issue = backwards[max(0, k - prefetch)]
            reload_before.setdefault(issue, []).append(Action(f.stage, Kind.RELOAD, f.unit,
                                                              f.part))
        row: list[Action] = []
        pending_after: list[Action] = []
        for a in actions:
            if pending_after and not (a.is_send() and a.kind is Kind.SEND_F):
                row.extend(pending_after)
                pending_after = []
            row.extend(offload_before.get(a, ()))
            row.extend(reload_before.get(a, ()))
            row.append(a)
            pending_after.extend(offload_after.get(a, ()))
        row.extend(pending_after)
        out.append(row)
    return out


def build_schedule(pp: int, num_subsequences: int | Sequence[int],
                   offloaded: Callable[[Action], bool] = lambda action: False,
                   prefetch: int = 1,
                   recomputed: Callable[[Action], bool] = lambda action: False) -> Schedule:
    """The validated SPPO schedule: compute (a ``RECOMPUTE`` before the backward of every
    forward ``recomputed`` marks: Megatron's recompute flags), transfers, offload and reload."""
    compute = add_recomputation(subsequence_schedule(pp, num_subsequences), recomputed)
    schedule = add_communication(compute, num_stages=pp)
    schedule = add_offload(schedule, offloaded, prefetch)
    validate(schedule)
    return schedule


def sppo_ir(pp: int, subsequences: int, options: Options, *, offload: bool) -> Built:
    """One sequence of ``subsequences`` subsequences with uniform unit costs
    (``ScheduleSpec.build_ir``; ``offload`` is its drawing flag,
    :func:`sppo_offload.flags.add_draw_arguments`): with ``offload`` every subsequence but the
    last is offloaded after its forward and reloaded one backward ahead (the copies cost
    nothing here: unit costs price compute only)."""
    last = subsequences - 1
    schedule = build_schedule(pp, subsequences, lambda action: offload and action.unit != last)
    return Built(schedule, UniformCosts(forward=options.forward, backward=options.backward,
                                        transfer=options.transfer))
