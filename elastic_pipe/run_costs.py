"""The cost model a training run plans with, and its refit to the executor's measured times
(``--elastic-refit-interval``).

``--elastic-refit-interval auto`` (the default) prices a unit with what it costs on the
device the job runs on, at the price of a few timed iterations at start-up: the actions of
training iterations 2 and 3 are timed (iteration 1 warms the device up: CUDA's context, kernel
selection, the allocator's first growth; its times would overprice every unit) and the cost
model is refitted to them before iteration 4 is planned; a refit that the data cannot support
(too few chunk shapes, or a fit that fails :mod:`~elastic_pipe.refit`'s acceptance criteria)
is tried again on the next two
iterations, at most :data:`AUTO_ATTEMPTS` times in all. After that nothing is timed: timing
waits for the device around every action (CUDA launches are asynchronous), which a run that
trains on would pay at every unit. ``K`` refits every ``K`` iterations from the first on,
timing every action of the run; ``0`` never refits (the profile's prices).

The iterations counted are the training steps this process runs under a document schedule
(:class:`Measured`): one per Megatron-LM training iteration (``train_step`` calls the schedule
once; evaluation is not counted), so ``K`` has the meaning of Megatron's other intervals.
Megatron's rerun of an iteration under ``--rerun-mode validate_results`` (after a NaN or a
spiky loss) is a step too and counts again, as are the steps of every schedule that a
benchmark runs one after another within a round (``scripts/bench_schedules.py`` and
``scripts/_sweep.py`` refit by hand after their warm-up round instead).

Where ``auto`` times nothing (the choice made here): a refit makes the plans depend on measured
times, so the chunks, and with them the order of the additions, vary from run to run and
between a run and its resumption from a checkpoint (the refitted figures are not saved). A run
that is otherwise reproducible bit for bit stays so: ``auto`` is off on a CPU (the test
machines; ``scripts/bench_schedules.py`` refits on its own) and under Megatron-LM's
``--deterministic-mode``, and under :mod:`~megatron.plugin.shared_gpu`'s time-slicing, where
the times mean nothing. There the profile prices the units; ``K`` asks for refits anyway.
"""
from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

from megatron.plugin import shared_gpu
from megatron.plugin.pipeline.ir import Kind

from longctx.cost_model import CostModel
from longctx.job_costs import job_cost_model, replace_job_cost_model

from elastic_pipe.refit import Observation, observations, refit

refit_log = logging.getLogger("elastic_pipe.refit")
"""The refits' summaries (``pretrain_gpt_elastic.py`` prints them with the training lines)."""


def elastic_cost_model(args: argparse.Namespace, model) -> CostModel:
    """The job's cost model within ``--elastic-memory-gb`` less ``--elastic-reserved-gb``
    (replaced by :func:`refit_cost_model` with ``--elastic-refit-interval``)."""
    return job_cost_model(args, model, args.elastic_memory_gb, args.elastic_reserved_gb)


AUTO = "auto"
"""``--elastic-refit-interval auto`` (module doc)."""
AUTO_WARMUP = 1
"""Training iterations ``auto`` leaves untimed before it measures."""
AUTO_ITERATIONS = 2
"""Timed training iterations an ``auto`` refit fits."""
AUTO_ATTEMPTS = 3
"""Refits ``auto`` tries before it stops timing, when the earlier ones were skipped."""


def refit_interval(args: argparse.Namespace) -> int | str:
    """The run's ``--elastic-refit-interval``: ``auto``, or ``K`` iterations (0: never);
    ``auto`` is 0 without CUDA, under ``--deterministic-mode`` and while ranks share a GPU
    (module doc)."""
    interval = args.elastic_refit_interval
    if interval == AUTO and (not torch.cuda.is_available() or shared_gpu.enabled()
                             or getattr(args, "deterministic_mode", False)):
        return 0
    return interval


class Measured:
    """Observations of the training iterations since the last refit (this rank's, whichever
    document schedule ran them: they measure the same layers on the same machine), and the
    count of training iterations and refits that says when the next ones are timed and
    refitted (every rank counts alike, so all of them call the collective refit together)."""

    def __init__(self):
        self.seen: list[Observation] = []
        self.iterations = 0
        """Timed training iterations since the last refit."""
        self.trained = 0
        """Training iterations run (timed or not)."""
        self.attempts = 0
        """Refits tried."""
        self.fitted = False
        """Whether a refit replaced the profile's coefficients."""

    def timing(self, interval: int | str) -> bool:
        """Whether the next training iteration's actions are timed under ``interval``."""
        if interval == AUTO:
            return (not self.fitted and self.attempts < AUTO_ATTEMPTS
                    and self.trained >= AUTO_WARMUP)
        return interval > 0

    def due(self, interval: int | str) -> bool:
        """Whether the cost model is refitted before the next batch is planned."""
        if interval == AUTO:
            return self.timing(interval) and self.iterations >= AUTO_ITERATIONS
        return interval > 0 and self.iterations >= interval

    def refitted(self, fitted: bool) -> None:
        """A refit was tried (``fitted``: it replaced the coefficients); count afresh."""
        self.seen, self.iterations = [], 0
        self.attempts += 1
        self.fitted |= fitted

    def ran(self) -> None:
        """One training iteration ran untimed."""
        self.trained += 1

    def record(self, planned, stage: int, events: list) -> None:
        """One timed training iteration's compute events on ``stage`` of ``planned``."""
        units = {str(a): (a.kind, a.unit) for a in planned.schedule[stage]
                 if a.kind in (Kind.FORWARD, Kind.BACKWARD)}
        times: dict[int, list[float]] = {}
        for event in events:
            if event.category == "compute" and event.name in units:
                kind, unit = units[event.name]
                times.setdefault(unit, [0.0, 0.0])[kind is Kind.BACKWARD] += event.duration
        self.record_observations(observations(stage, planned.plan.chunks(),
                                              {u: (f, b) for u, (f, b) in times.items()}))

    def record_observations(self, found: list[Observation]) -> None:
        """One timed training iteration's observations on this rank."""
        self.seen.extend(found)
        self.iterations += 1
        self.trained += 1


MEASURED = Measured()


def refit_cost_model(name: str, args, model) -> str:
    """Pool every rank's observations, refit the job's cost model to them and start counting
    again; ``name`` labels the log line (one, from rank 0), which is also returned. The first
    rank fits and sends every rank its result, the refitted profile or none (a fit that
    :func:`~elastic_pipe.refit.refit` skips or rejects keeps the profile), so the ranks keep
    planning alike even where their numerical libraries round differently. Collective: every
    rank calls it at the same point. The plan the background worker made with the old figures
    is not used: every rank plans the next batch again in the foreground with the new ones."""
    measured = MEASURED
    pooled = [None] * dist.get_world_size()
    dist.all_gather_object(pooled, measured.seen)
    cost = elastic_cost_model(args, model)
    result = [refit(cost, [o for seen in pooled for o in seen]) if dist.get_rank() == 0
              else None]
    dist.broadcast_object_list(result, src=0)
    profile, summary = result[0]
    measured.refitted(profile is not None)
    if dist.get_rank() == 0:
        refit_log.log(logging.INFO if profile is not None else logging.WARNING, "%s: %s",
                      name, summary)
    if profile is not None:
        layers = tuple(cost.layers(stage) for stage in range(cost.pp))
        replace_job_cost_model(args, model, CostModel(cost.model, profile, cost.parallel, layers),
                               args.elastic_memory_gb, args.elastic_reserved_gb)
    return summary
