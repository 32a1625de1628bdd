"""The cost model a training run plans with, and its refit to the executor's measured times
(``--elastic-refit-interval``)."""
from __future__ import annotations

import argparse
import logging

import torch.distributed as dist

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


class Measured:
    """Observations of the training iterations since the last refit (this rank's, whichever
    document schedule ran them: they measure the same layers on the same machine)."""

    def __init__(self):
        self.seen: list[Observation] = []
        self.iterations = 0

    def due(self, interval: int) -> bool:
        return self.iterations >= interval

    def record(self, planned, stage: int, events: list) -> None:
        units = {str(a): (a.kind, a.unit) for a in planned.schedule[stage]
                 if a.kind in (Kind.FORWARD, Kind.BACKWARD)}
        times: dict[int, list[float]] = {}
        for event in events:
            if event.category == "compute" and event.name in units:
                kind, unit = units[event.name]
                times.setdefault(unit, [0.0, 0.0])[kind is Kind.BACKWARD] += event.duration
        self.seen.extend(observations(stage, planned.plan.chunks(),
                                      {u: (f, b) for u, (f, b) in times.items()}))
        self.iterations += 1


MEASURED = Measured()


def refit_cost_model(name: str, args, model) -> str:
    """Pool every rank's observations, refit the job's cost model to them (every rank gets
    the same figures, so the ranks keep planning alike) and start counting again; ``name``
    labels the log line, which is also returned. Collective: every rank calls it at the same
    point. The plan the background worker made with the old figures is not used: every rank
    plans the next batch again in the foreground with the new ones."""
    measured = MEASURED
    pooled = [None] * dist.get_world_size()
    dist.all_gather_object(pooled, measured.seen)
    measured.seen, measured.iterations = [], 0
    cost = elastic_cost_model(args, model)
    profile, summary = refit(cost, [o for seen in pooled for o in seen])
    if dist.get_rank() == 0:
        refit_log.info("%s: %s", name, summary)
    if profile is not None:
        layers = tuple(cost.layers(stage) for stage in range(cost.pp))
        replace_job_cost_model(args, model, CostModel(cost.model, profile, cost.parallel, layers),
                               args.elastic_memory_gb, args.elastic_reserved_gb)
    return summary
