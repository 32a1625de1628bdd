"""Run-level settings of the IR schedules: transfer timeout and Chrome-trace output.

Megatron's forward-backward signature has no room for them, so the training script sets them
once (:func:`configure`, from ``--pipeline-timeout-s`` and ``--trace-dir``) and every IR
schedule reads them. With a trace directory, each call of an IR schedule writes the measured
per-action timeline of this rank, and the predicted one of its plan where the schedule gives it,
in the same Chrome-trace format as the simulator (open both in Perfetto or chrome://tracing,
or draw them with ``scripts/show_trace.py``); :mod:`~megatron.plugin.pipeline.trace_dir`
names the files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from megatron.plugin.pipeline import trace_dir
from megatron.plugin.pipeline.chrome_trace import write_chrome_trace


@dataclass
class RuntimeSettings:
    timeout_s: float = 600.0
    """Seconds a receive may wait before failing with the rank, action and peer named."""
    trace_dir: str | None = None
    """Where measured Chrome traces go; ``None`` records nothing."""


_settings = RuntimeSettings()
_calls = 0


def configure(timeout_s: float | None = None, trace_dir: str | None = None) -> None:
    if timeout_s is not None:
        if timeout_s <= 0:
            raise ValueError("--pipeline-timeout-s must be positive")
        _settings.timeout_s = float(timeout_s)
    _settings.trace_dir = trace_dir


def settings() -> RuntimeSettings:
    return _settings


def tracing() -> bool:
    """Whether calls are traced (``--trace-dir``): a schedule then also keeps its plan's
    predicted timeline for :func:`record`."""
    return _settings.trace_dir is not None


def record(events, predicted=()) -> None:
    """Write this call's measured ``events``, and the ``predicted`` ones of its plan when
    given, when a trace directory is configured."""
    global _calls
    _calls += 1
    if _settings.trace_dir is None:
        return
    os.makedirs(_settings.trace_dir, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(_settings.trace_dir, trace_dir.measured_name(_calls, rank))
    write_chrome_trace(events, path, name=f"rank {rank} call {_calls}")
    if predicted:
        path = os.path.join(_settings.trace_dir, trace_dir.plan_name(_calls, rank))
        write_chrome_trace(predicted, path, name=f"plan of call {_calls} (predicted)")
