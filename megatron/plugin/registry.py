"""Schedule registry consulted by Megatron's ``get_forward_backward_func``.

megatron-core picks its schedule in ``get_forward_backward_func()`` from ``parallel_state`` and
offers no hook. :func:`use_schedule` rebinds that function — in
``megatron.core.pipeline_parallel.schedules``, in the ``megatron.core.pipeline_parallel`` package
and in every already-imported module that took the name with ``from ... import`` (Megatron-LM's
``megatron/training/training.py`` does) — to one that returns the registered schedule,
wrapped to take one global batch of documents per call (the iterators of
:mod:`megatron.plugin.document_data`) and cut it into that schedule's input.

Names: ``1f1b`` and ``interleaved`` are Megatron's own functions; ``default`` keeps Megatron's
own choice. New schedules call :func:`register_schedule` when their package is imported.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as _schedules

from megatron.plugin.batches import MicroBatches, pack_micro_batches, padding_fraction
from megatron.plugin.devices import collective_device
from megatron.plugin.reporting import StepReporter, loss_entries

_MEGATRON_DISPATCH = _schedules.get_forward_backward_func
_MEGATRON_SCHEDULES = (_schedules.forward_backward_no_pipelining,
                       _schedules.forward_backward_pipelining_without_interleaving,
                       _schedules.forward_backward_pipelining_with_interleaving)

_ARGUMENT_GROUPS: list[Callable] = []
_REGISTRY: dict[str, Callable] = {
    "1f1b": _schedules.forward_backward_pipelining_without_interleaving,
    "interleaved": _schedules.forward_backward_pipelining_with_interleaving,
}
DEFAULT = "default"


def register_schedule(name: str, fn: Callable) -> None:
    """Register ``fn`` (Megatron's forward-backward signature) under ``name``."""
    if not name or name == DEFAULT:
        raise ValueError(f"invalid schedule name {name!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not fn:
        raise ValueError(f"schedule {name!r} is already registered")
    _REGISTRY[name] = fn


def register_argument_group(add: Callable) -> None:
    """Let a schedule package add its flags: ``add(parser)`` runs when the parser is built."""
    if add not in _ARGUMENT_GROUPS:
        _ARGUMENT_GROUPS.append(add)


def argument_groups() -> list[Callable]:
    return list(_ARGUMENT_GROUPS)


def schedule_names() -> list[str]:
    """Valid values of ``--pipeline-schedule``."""
    return [DEFAULT, *sorted(_REGISTRY)]


def check_name(name: str) -> None:
    """Raise ``ValueError`` listing the valid names when ``name`` is not one."""
    if name not in schedule_names():
        raise ValueError(
            f"unknown pipeline schedule {name!r}; valid names: {', '.join(schedule_names())}")


def schedule_hook(name: str, hook: str):
    """Attribute ``hook`` of the schedule registered under ``name`` (``check_args``,
    ``build_model``, ``prepare_input``, ...), or ``None`` (also for ``default``)."""
    check_name(name)
    return getattr(_REGISTRY.get(name), hook, None)


def get_schedule(name: str) -> Callable:
    """The forward-backward function registered under ``name``."""
    check_name(name)
    if name == DEFAULT:
        return _MEGATRON_DISPATCH()
    return _REGISTRY[name]


class DocumentSchedule:
    """What ``get_forward_backward_func()`` returns while :func:`use_schedule` is in force:
    Megatron's forward-backward signature over one global batch of documents per call.

    ``data_iterator`` yields :class:`~megatron.plugin.document_data.GlobalBatch` objects (one
    iterator per model chunk under virtual pipelining, all equal); ``num_microbatches``
    (Megatron's ``global batch / (micro-batch size x data-parallel size)``) is replaced by what
    the schedule's input has. A schedule with a ``prepare_input(documents, args, model)`` hook
    makes its own input; Megatron's schedules get this replica's packed ``--seq-length``
    micro-batches. The losses come back as one ``{"lm loss": [sum, tokens], ...}`` dict on the
    last pipeline stage (summed over the stages, since a schedule other than Megatron's may
    compute its loss on any stage; the same sum Megatron forms), with a training step's report
    next to it (:mod:`megatron.plugin.reporting`); :attr:`reporter` keeps the latest record and
    :attr:`last_input` the latest schedule input (plans, offload records: for inspection).
    """

    def __init__(self, name: str, pp_size=None, vp_size=None):
        self.name = name
        if name == DEFAULT:
            self.schedule = _MEGATRON_DISPATCH(pp_size=pp_size, vp_size=vp_size)
        else:
            self.schedule = _REGISTRY[name]
        self.reporter = StepReporter()
        self.last_input = None

    def __call__(self, *, data_iterator, model, num_microbatches=None, forward_only=False,
                 **kwargs):
        from megatron.training import get_args

        del num_microbatches
        args = get_args()
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        batch = [next(iterator) for iterator in iterators][0]
        start = time.perf_counter()
        prepare = getattr(self.schedule, "prepare_input", None)
        if prepare is None:
            prepared, count = _packed_input(batch.documents, args, model)
        else:
            prepared, count = prepare(batch.documents, args, model)
        self.reporter.prepare_s = time.perf_counter() - start
        self.last_input = prepared
        prefetch = getattr(self.schedule, "prefetch_input", None)
        if prefetch is not None and not forward_only:
            prefetch(batch.upcoming(), args, model)
        with self.reporter.measure(device_window=not args.log_memory_to_tensorboard):
            losses = self.schedule(data_iterator=prepared, model=model, num_microbatches=count,
                                   forward_only=forward_only, **kwargs)
        totals = _pipeline_totals(losses)
        record = self.reporter.finish(totals, prepared, count, args, forward_only)
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
