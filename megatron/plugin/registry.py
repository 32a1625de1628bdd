"""Schedule registry consulted by Megatron's ``get_forward_backward_func``.

A schedule is one :class:`~megatron.plugin.schedule_spec.ScheduleSpec` registered under its
name. ``1f1b`` and ``interleaved`` are Megatron's own functions; ``default`` keeps Megatron's
own choice. The project's schedules, and anyone else's, come in through package entry points
of the group :data:`ENTRY_POINTS` (each names a ``ScheduleSpec``; the project's are listed in
``setup.py``), through the environment variable :data:`ENVIRONMENT` (``module:attribute``
entries separated by commas, for a schedule in a module that is not installed), or by calling
:func:`register`. The core imports no schedule: the entry points are loaded the first time a
name is looked up.

megatron-core picks its schedule in ``get_forward_backward_func()`` from ``parallel_state`` and
offers no hook. :func:`use_schedule` rebinds that function — in
``megatron.core.pipeline_parallel.schedules``, in the ``megatron.core.pipeline_parallel`` package
and in every already-imported module that took the name with ``from ... import`` (Megatron-LM's
``megatron/training/training.py`` does) — to one that returns the registered schedule,
wrapped to take one global batch of documents per call (the iterators of
:mod:`megatron.plugin.document_data`) and cut it into that schedule's input.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as _schedules
from megatron.core.utils import get_model_config

from megatron.plugin import flop_count, loss_checks, random_states
from megatron.plugin.batches import MicroBatches, pack_micro_batches, padding_fraction
from megatron.plugin.drawing import DrawCommand, Drawable
from megatron.plugin.layers.devices import collective_device
from megatron.plugin.pipeline import grad_sync
from megatron.plugin.pipeline.catalog import SIMULATED, one_f_one_b_ir
from megatron.plugin.reporting import StepReporter, loss_entries
from megatron.plugin.schedule_spec import ScheduleSpec

_MEGATRON_DISPATCH = _schedules.get_forward_backward_func
ENTRY_POINTS = "megatron_longctx.schedules"
ENVIRONMENT = "LONGCTX_SCHEDULES"
DEFAULT = "default"

_SPECS: dict[str, ScheduleSpec] = {
    "1f1b": ScheduleSpec(
        "1f1b", build_ir=one_f_one_b_ir,
        megatron_function=_schedules.forward_backward_pipelining_without_interleaving),
    "interleaved": ScheduleSpec(
        "interleaved", megatron_function=_schedules.forward_backward_pipelining_with_interleaving),
}
_DISCOVERED = False


def register(spec: ScheduleSpec) -> None:
    """Register ``spec`` under its name (registering the same object again is a no-op).
    Refused: a name taken (``default``, a simulate-only drawing of
    :data:`~megatron.plugin.pipeline.catalog.SIMULATED`, another schedule), and a drawing flag
    that another schedule's function or ``scripts/show_schedule.py`` already has."""
    if not spec.name or spec.name == DEFAULT or spec.name in SIMULATED:
        raise ValueError(f"invalid schedule name {spec.name!r}")
    existing = _SPECS.get(spec.name)
    if existing is not None and existing is not spec:
        raise ValueError(f"schedule {spec.name!r} is already registered")
    if existing is None and spec.build_ir is not None:
        DrawCommand([*(_drawable(s) for s in _SPECS.values() if s.build_ir is not None),
                     _drawable(spec)])
    _SPECS[spec.name] = spec


def _discover() -> None:
    """Load the schedules of the entry points and of :data:`ENVIRONMENT`, once."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    found = [(entry.name, entry.value)
             for entry in importlib.metadata.entry_points(group=ENTRY_POINTS)]
    found += [(None, value.strip()) for value in os.environ.get(ENVIRONMENT, "").split(",")
              if value.strip()]
    for name, value in found:
        module, _, attribute = value.partition(":")
        if not attribute:
            raise ValueError(f"{ENVIRONMENT}: {value!r} is not MODULE:ATTRIBUTE")
        spec = getattr(importlib.import_module(module), attribute)
        if not isinstance(spec, ScheduleSpec):
            raise TypeError(f"{value} is a {type(spec).__name__}, not a ScheduleSpec")
        if name is not None and name != spec.name:
            raise ValueError(f"entry point {name!r} names schedule {spec.name!r} ({value})")
        register(spec)


def specs() -> list[ScheduleSpec]:
    """Every registered schedule, by name."""
    _discover()
    return [_SPECS[name] for name in sorted(_SPECS)]


def schedule_names() -> list[str]:
    """Valid values of ``--pipeline-schedule``."""
    return [DEFAULT, *(spec.name for spec in specs())]


def check_name(name: str) -> None:
    """Raise ``ValueError`` listing the valid names when ``name`` is not one."""
    if name not in schedule_names():
        raise ValueError(
            f"unknown pipeline schedule {name!r}; valid names: {', '.join(schedule_names())} "
            f"(a package's schedules are found through its entry points of the group "
            f"{ENTRY_POINTS}: install it, for this project `pip install -e .` in its checkout, "
            f"or name its MODULE:ATTRIBUTE in {ENVIRONMENT})")


def spec(name: str) -> ScheduleSpec | None:
    """The schedule registered under ``name`` (``None`` for ``default``)."""
    check_name(name)
    return _SPECS.get(name)


def is_megatron(name: str) -> bool:
    """Whether ``name`` runs one of Megatron's own schedule functions."""
    found = spec(name)
    return found is None or found.megatron_function is not None


def get_schedule(name: str) -> Callable:
    """The forward-backward function (Megatron's signature) of schedule ``name``."""
    found = spec(name)
    if found is None:
        return _MEGATRON_DISPATCH()
    return found.forward_backward


def _drawable(found: ScheduleSpec) -> Drawable:
    return Drawable(found.name, found.build_ir, found.draw_arguments, found.draw_units,
                    found.draw_missing)


def drawables() -> list[Drawable]:
    """What ``scripts/show_schedule.py`` draws, by name: the schedules with an IR builder
    (``ScheduleSpec.build_ir``) and the simulate-only ones, which ``--pipeline-schedule``
    refuses (:data:`~megatron.plugin.pipeline.catalog.SIMULATED`)."""
    found = {s.name: _drawable(s) for s in specs() if s.build_ir is not None}
    found.update((name, Drawable(name, build)) for name, build in SIMULATED.items())
    return [found[name] for name in sorted(found)]


def drawable_names() -> list[str]:
    """The names of :func:`drawables`."""
    return [found.name for found in drawables()]


def drawable(name: str) -> Drawable:
    """The drawable ``name``: a simulate-only one, or a registered schedule with an IR
    builder."""
    if name in SIMULATED:
        return Drawable(name, SIMULATED[name])
    found = spec(name)
    if found is None or found.build_ir is None:
        raise ValueError(f"schedule {name!r} has no IR builder; schedules with one: "
                         f"{', '.join(drawable_names())}")
    return _drawable(found)


def build_ir(name: str) -> Callable:
    """The IR builder of drawable ``name`` (``ScheduleSpec.build_ir``)."""
    return drawable(name).build_ir


class DocumentSchedule:
    """What ``get_forward_backward_func()`` returns while :func:`use_schedule` is in force:
    Megatron's forward-backward signature over one global batch of documents per call.

    ``data_iterator`` yields :class:`~megatron.plugin.document_data.GlobalBatch` objects (one
    iterator per model chunk under virtual pipelining, all equal); ``num_microbatches``
    (Megatron's ``global batch / (micro-batch size x data-parallel size)``) is replaced by what
    the schedule's input has. A training step's documents are recorded for Megatron-LM's FLOP
    count (:mod:`megatron.plugin.flop_count`). A schedule with ``prepare_input`` makes its own
    input (and reports on it and on the step with ``report``, after the step); the others get this replica's packed
    ``--seq-length`` micro-batches (and report their padding fraction). The losses come back as one ``{"lm loss": [sum,
    tokens], ...}`` dict on the last pipeline stage (summed over the stages, since a schedule
    other than Megatron's may compute its loss on any stage; the same sum Megatron forms), with
    a training step's report next to it (:mod:`megatron.plugin.reporting`); :attr:`reporter`
    keeps the latest record and :attr:`last_input` the latest schedule input (plans, offload
    records: for inspection). After a training step every data-parallel replica takes rank 0's
    random states (:mod:`megatron.plugin.random_states`). Under every schedule Megatron's
    ``grad_sync_func`` starts each gradient bucket's reduction once in a step
    (:func:`~megatron.plugin.pipeline.grad_sync.one_start_per_step`), and the step's losses
    are checked together at its end (:func:`~megatron.plugin.loss_checks.once_per_step`).
    """

    def __init__(self, name: str, pp_size=None, vp_size=None):
        self.name = name
        self.spec = spec(name)
        if self.spec is None:
            self.schedule = _MEGATRON_DISPATCH(pp_size=pp_size, vp_size=vp_size)
        else:
            self.schedule = self.spec.forward_backward
        self.reporter = StepReporter()
        self.last_input = None

    def __call__(self, *, data_iterator, model, num_microbatches=None, forward_only=False,
                 **kwargs):
        from megatron.training import get_args

        del num_microbatches
        args = get_args()
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        batch = [next(iterator) for iterator in iterators][0]
        if not forward_only:
            flop_count.record_documents(batch.documents)
        start = time.perf_counter()
        own = self.spec if self.spec is not None and self.spec.prepare_input else None
        if own is None:
            prepared, count = _packed_input(batch.documents, args, model)
        else:
            prepared, count = own.prepare_input(batch.documents, args, model)
        self.reporter.prepare_s = time.perf_counter() - start
        self.last_input = prepared
        upcoming = batch.upcoming() if own is not None and own.prefetch_input is not None \
            and not forward_only else None
        if upcoming is not None:
            own.prefetch_input(upcoming, args, model)
        config = get_model_config(model[0])
        with self.reporter.measure(device_window=not args.log_memory_to_tensorboard), \
                grad_sync.one_start_per_step(config), loss_checks.once_per_step(config):
            losses = self.schedule(data_iterator=prepared, model=model, num_microbatches=count,
                                   forward_only=forward_only, **kwargs)
        if not forward_only:
            random_states.follow_first_replica(args.data_parallel_random_init)
        if own is None:
            reported = {"padding_fraction": _first(prepared).padding_fraction}
        else:
            reported = own.report(prepared) if own.report else {}
        totals = _pipeline_totals(losses)
        record = self.reporter.finish(totals, reported, count, args, forward_only)
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return []
        device = next(model[0].parameters()).device
        losses = {"lm loss": totals.to(device, torch.float32)}
        if not forward_only:  # Megatron's evaluation would print every entry's perplexity
            losses.update(loss_entries(record, device))
        return [losses]


def _dispatcher(name: str) -> Callable:
    schedules: dict = {}

    def get_forward_backward_func(pp_size=None, vp_size=None, **unused):
        del unused  # 0.19's schedule_pg_collection: Megatron's default groups are used
        key = (pp_size, vp_size)
        if key not in schedules:
            schedules[key] = DocumentSchedule(name, pp_size, vp_size)
        return schedules[key]

    get_forward_backward_func.schedule_name = name
    return get_forward_backward_func


def _packed_input(documents, args, model):
    """Megatron's schedules: this data-parallel replica's share of the documents packed into
    ``--seq-length`` micro-batches; every model chunk (virtual stage) reads the same ones."""
    dp = parallel_state.get_data_parallel_world_size()
    batches = pack_micro_batches(documents, args.seq_length, args.micro_batch_size, dp)
    mine = batches[parallel_state.get_data_parallel_rank()::dp]
    padding = padding_fraction(batches)
    if len(model) == 1:
        return MicroBatches(mine, padding), len(mine)
    return [MicroBatches(mine, padding) for _ in model], len(mine)


def _first(prepared):
    return prepared[0] if isinstance(prepared, list) else prepared


def _pipeline_totals(losses) -> torch.Tensor:
    """This replica's ``(loss sum, tokens)`` as float64, on every pipeline stage."""
    group = parallel_state.get_pipeline_model_parallel_group()
    totals = torch.zeros(2, dtype=torch.float64, device=collective_device(group))
    for report in losses:
        totals += report["lm loss"].detach().to(totals.device, torch.float64)
    dist.all_reduce(totals, group=group)
    return totals.cpu()


def use_schedule(name: str) -> Callable:
    """Make every ``get_forward_backward_func`` in the process return schedule ``name``, fed
    with global batches of documents (:class:`DocumentSchedule`).

    ``default`` keeps Megatron's choice of schedule. :func:`restore_megatron` undoes it.
    Unknown names raise ``ValueError`` listing the valid ones. Returns the dispatcher.
    """
    check_name(name)
    dispatcher = _dispatcher(name)
    _rebind(dispatcher)
    return dispatcher


def restore_megatron() -> None:
    """Put Megatron's own ``get_forward_backward_func`` back everywhere."""
    _rebind(_MEGATRON_DISPATCH)


def _rebind(dispatcher: Callable) -> None:
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        current = namespace.get("get_forward_backward_func")
        if current is _MEGATRON_DISPATCH or getattr(current, "schedule_name", None) is not None:
            setattr(module, "get_forward_backward_func", dispatcher)


def active_schedule_name() -> str | None:
    """Name the dispatcher currently answers with (``None`` while Megatron's own is in
    place)."""
    return getattr(_schedules.get_forward_backward_func, "schedule_name", None)
