"""Schedule registry consulted by Megatron's ``get_forward_backward_func``.

megatron-core picks its schedule in ``get_forward_backward_func()`` from ``parallel_state`` and
offers no hook. :func:`use_schedule` rebinds that function — in
``megatron.core.pipeline_parallel.schedules``, in the ``megatron.core.pipeline_parallel`` package
and in every already-imported module that took the name with ``from ... import`` (Megatron-LM's
``megatron/training/training.py`` does) — to one that returns the registered schedule.

Usage from one's own Megatron-LM training script::

    from megatron.plugin.registry import use_schedule
    use_schedule("elastic")        # after the schedules' packages are imported

Names: ``1f1b`` and ``interleaved`` are Megatron's own functions; ``default`` keeps Megatron's
own choice. New schedules call :func:`register_schedule` when their package is imported.
"""
from __future__ import annotations

import sys
from typing import Callable

from megatron.core.pipeline_parallel import schedules as _schedules

_MEGATRON_DISPATCH = _schedules.get_forward_backward_func

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


def _dispatcher(name: str) -> Callable:
    def get_forward_backward_func(pp_size=None, vp_size=None):
        del pp_size, vp_size  # the named schedule handles any layout it supports
        return _REGISTRY[name]

    get_forward_backward_func.schedule_name = name
    return get_forward_backward_func


def use_schedule(name: str) -> Callable:
    """Make every ``get_forward_backward_func`` in the process return schedule ``name``.

    ``default`` puts Megatron's own dispatcher back. Returns the dispatcher now in place.
    Unknown names raise ``ValueError`` listing the valid ones.
    """
    check_name(name)
    dispatcher = _MEGATRON_DISPATCH if name == DEFAULT else _dispatcher(name)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        current = namespace.get("get_forward_backward_func")
        if current is _MEGATRON_DISPATCH or getattr(current, "schedule_name", None) is not None:
            setattr(module, "get_forward_backward_func", dispatcher)
    return dispatcher


def active_schedule_name() -> str:
    """Name the dispatcher currently answers with (``default`` when never set)."""
    return getattr(_schedules.get_forward_backward_func, "schedule_name", DEFAULT)
