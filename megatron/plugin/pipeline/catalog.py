"""Schedule generators by name, for tools that draw or price a schedule without running it
(``scripts/show_schedule.py``).

A generator takes ``(pp, microbatches)`` and returns the compute-only schedule; the catalog
adds the transfers (:func:`~megatron.plugin.pipeline.passes.add_communication`) and validates.
Schedules defined by ``(pp, microbatches)`` alone belong in :data:`_GENERATORS`.
"""
from __future__ import annotations

from typing import Callable

from megatron.plugin.pipeline.ir import Action
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.validation import validate

Generator = Callable[[int, int], list[list[Action]]]

_GENERATORS: dict[str, Generator] = {"1f1b": one_f_one_b}


def generator_names() -> list[str]:
    return sorted(_GENERATORS)


def build(name: str, pp: int, microbatches: int) -> list[list[Action]]:
    """The validated schedule ``name`` for ``pp`` stages and ``microbatches`` units."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(generator_names())}")
    schedule = add_communication(_GENERATORS[name](pp, microbatches), num_stages=pp)
    validate(schedule)
    return schedule
