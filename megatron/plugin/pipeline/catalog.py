"""Schedules as IR for tools that draw or price a schedule without running it
(``scripts/show_schedule.py``).

Each schedule's spec names its IR builder (``ScheduleSpec.build_ir``): ``build_ir(pp, units,
options, **knobs)`` returns a :class:`Built`, the validated schedule with its transfers, the
costs that price it and how the simulator must replay it (``eager_sends`` for helix, whose hops
run against the pipeline's direction). :class:`Options` carries what every schedule shares, the
unit costs; a schedule's own knobs are its drawing flags (``ScheduleSpec.draw_arguments``).

:data:`SIMULATED` holds the builders of schedules that are drawn and simulated but never
trained, so they are not ``ScheduleSpec`` objects and ``--pipeline-schedule`` refuses them:
ZB1P, whose ``W`` actions the executor refuses. The registry serves both
(:func:`megatron.plugin.registry.drawable`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.plugin.pipeline.ir import Schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.schedule_zb1p import zb1p
from megatron.plugin.pipeline.simulator import UniformCosts
from megatron.plugin.pipeline.validation import validate


@dataclass(frozen=True)
class Options:
    """The unit costs every IR builder takes."""

    forward: float = 1.0
    """Duration of a whole-stage forward (layer-wise schedules)."""
    backward: float = 2.0
    """Duration of a backward; for part schedules, ``backward / forward`` scales every part."""
    transfer: float = 0.0
    """Time from a send to the arrival of its data."""


@dataclass(frozen=True)
class Built:
    """A validated schedule, the costs that price it and how the simulator replays it."""

    schedule: Schedule
    costs: object
    eager_sends: bool = False
    time_unit: str = "units"
    """What the costs' durations count: unit costs, or seconds (a cost model's)."""
    memory_unit: str = "stashed units"
    """What the costs' memory counts: stashed forwards, or bytes (a cost model's)."""


def one_f_one_b_ir(pp: int, microbatches: int, options: Options) -> Built:
    """Megatron's non-interleaved 1F1B (``1f1b``, ``1f1b-ir``) with uniform unit costs."""
    schedule = add_communication(one_f_one_b(pp, microbatches), num_stages=pp)
    validate(schedule)
    return Built(schedule, UniformCosts(forward=options.forward, backward=options.backward,
                                        transfer=options.transfer))


def zb1p_ir(pp: int, microbatches: int, options: Options) -> Built:
    """ZB1P (:mod:`~megatron.plugin.pipeline.schedule_zb1p`) with the backward split evenly
    into its ``B`` and ``W`` passes, sends posted eagerly as the zero-bubble schedule needs."""
    schedule = add_communication(zb1p(pp, microbatches), num_stages=pp)
    validate(schedule)
    half = options.backward / 2
    return Built(schedule, UniformCosts(forward=options.forward, backward=half, weight=half,
                                        transfer=options.transfer), eager_sends=True)


SIMULATED = {"zb1p": zb1p_ir}
"""Name -> IR builder of the schedules that are drawn and simulated, never trained."""
