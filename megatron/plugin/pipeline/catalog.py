"""Schedules as IR for tools that draw or price a schedule without running it
(``scripts/show_schedule.py``).

Each schedule's spec names its IR builder (``ScheduleSpec.build_ir``): ``build_ir(pp, units,
options)`` returns a :class:`Built`, the validated schedule with its transfers, the unit costs
that price it and how the simulator must replay it (``eager_sends`` for helix, whose hops run
against the pipeline's direction). :class:`Options` carries what a schedule needs besides
``(pp, units)`` (helix: layers, folds, recomputation) and the unit costs. The registry looks a
builder up by schedule name (:func:`megatron.plugin.registry.build_ir`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.plugin.pipeline.ir import Schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import UniformCosts
from megatron.plugin.pipeline.validation import validate


@dataclass(frozen=True)
class Options:
    forward: float = 1.0
    """Duration of a whole-stage forward (layer-wise schedules)."""
    backward: float = 2.0
    """Duration of a backward; for part schedules, ``backward / forward`` scales every part."""
    transfer: float = 0.0
    num_layers: int | None = None
    """Part schedules (helix): transformer layers, a multiple of ``pp``; default ``2 pp``."""
    folds: int = 2
    """Helix: micro-batches in flight per slot."""
    recompute: bool = False
    """Helix: recompute the pre/post-attention parts before their backward."""
    offload: bool = False
    """SPPO: offload every subsequence but the last and reload it before its backward."""
    t_pre: float = 1.0
    """Helix: pre-attention forward (input norm, QKV projection)."""
    t_attn: float = 1.0
    """Helix: attention forward."""
    t_post: float = 2.0
    """Helix: post-attention forward (output projection, residual, norm, MLP)."""


@dataclass(frozen=True)
class Built:
    schedule: Schedule
    costs: object
    eager_sends: bool = False


def one_f_one_b_ir(pp: int, microbatches: int, options: Options) -> Built:
    """Megatron's non-interleaved 1F1B (``1f1b``, ``1f1b-ir``) with uniform unit costs."""
    schedule = add_communication(one_f_one_b(pp, microbatches), num_stages=pp)
    validate(schedule)
    return Built(schedule, UniformCosts(forward=options.forward, backward=options.backward,
                                        transfer=options.transfer))

