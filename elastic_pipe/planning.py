"""The plan a training run of ``elastic`` or ``seq1f1b`` executes for one replica's documents
(:mod:`elastic_pipe.planned_batch` runs it in the background; the drawing and the benchmarks
plan the same way)."""
from __future__ import annotations

import dataclasses

from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig

from elastic_pipe import baselines
from elastic_pipe.plan_types import Plan
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic

RUNTIME_SCHEDULES = ("elastic", "seq1f1b")


def plan_schedule(lengths: tuple[int, ...], name: str, model: ModelConfig,
                  hardware: HardwareProfile, parallel: ParallelConfig,
                  config: SchedulerConfig) -> Plan:
    """The plan a training run of schedule ``name`` executes for documents of ``lengths``.

    Takes the cost model's parts (it is rebuilt here) so that it can run in a worker process.
    """
    cost = CostModel(model, hardware, parallel)
    if name == "elastic":
        return plan_elastic(list(lengths), cost, config)
    if name != "seq1f1b":
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(RUNTIME_SCHEDULES)}")
    plan = baselines.seq1f1b(list(lengths), cost, config)
    if plan is None and config.fixed is not None:
        raise ValueError(f"seq1f1b: no fixed chunk size fits {parallel.memory_gb:g} GB per "
                         f"device with the checkpointing table {config.fixed.flags()} fixes; "
                         f"raise --elastic-memory-gb, recompute more layers (--recompute-method "
                         f"uniform recomputes every layer), or drop the --recompute-* flags and "
                         f"let seq1f1b choose how many layers to recompute")
    if plan is None:
        raise ValueError(f"seq1f1b: no fixed chunk size fits {parallel.memory_gb:g} GB per "
                         f"device even with every layer checkpointed; raise the memory budget "
                         f"(--elastic-memory-gb), add pipeline stages or shorten --seq-length")
    return plan


def plan_schedule_with_workers(workers: int, lengths: tuple[int, ...], name: str,
                               model: ModelConfig, hardware: HardwareProfile,
                               parallel: ParallelConfig, config: SchedulerConfig) -> Plan:
    """:func:`plan_schedule` with ``workers`` solver processes: the same plan (the scheduler's
    plan does not depend on them), for a process that may fork (the background planner's)."""
    return plan_schedule(lengths, name, model, hardware, parallel,
                         dataclasses.replace(config, workers=workers))
