"""Schedule generators by name, for tools that draw or price a schedule without running it
(``scripts/show_schedule.py``).

:func:`build` returns the validated schedule with its transfers, the unit costs that price it
and how the simulator must replay it (``eager_sends`` for helix, whose hops run against the
pipeline's direction). :class:`Options` carries what a schedule needs besides
``(pp, microbatches)`` (helix: layers, folds, recomputation) and the unit costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from helix.schedule import HelixCosts, planned_helix
from megatron.plugin.pipeline.ir import Action
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import UniformCosts
from megatron.plugin.pipeline.validation import validate

Schedule = list[list[Action]]


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


def _one_f_one_b(pp: int, microbatches: int, options: Options) -> Built:
    schedule = add_communication(one_f_one_b(pp, microbatches), num_stages=pp)
    validate(schedule)
    return Built(schedule, UniformCosts(forward=options.forward, backward=options.backward,
                                        transfer=options.transfer))


def _helix(pp: int, microbatches: int, options: Options) -> Built:
    layers = options.num_layers if options.num_layers is not None else 2 * pp
    schedule = planned_helix(pp, layers, microbatches, options.folds, options.recompute)
    costs = HelixCosts(options.t_pre, options.t_attn, options.t_post, layers,
                       backward=options.backward / options.forward,
                       transfer=options.transfer)
    return Built(schedule, costs, eager_sends=True)


_GENERATORS: dict[str, Callable[[int, int, Options], Built]] = {
    "1f1b": _one_f_one_b, "helix": _helix}


def generator_names() -> list[str]:
    return sorted(_GENERATORS)


def build(name: str, pp: int, microbatches: int, options: Options = Options()) -> Built:
    """The validated schedule ``name`` for ``pp`` stages and ``microbatches`` units."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(generator_names())}")
    return _GENERATORS[name](pp, microbatches, options)
