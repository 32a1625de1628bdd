"""``elastic`` and ``seq1f1b`` as IR for the drawing tools (``ScheduleSpec.build_ir``): the plan
a training run executes for one batch of documents (:func:`~elastic_pipe.planning.plan_schedule`),
the batch, model and layout given by the flags of :mod:`elastic_pipe.batch_flags`, lowered
(:func:`~elastic_pipe.lowering.lower`) and priced by the cost model in seconds and bytes. The
units are the plan's chunks, so the drawing takes no unit count (``draw_units=False``) and no
unit costs."""
from __future__ import annotations

import argparse
from typing import Callable

from megatron.plugin.pipeline.catalog import Built, Options

from longctx.model_flags import add_num_layers
from elastic_pipe.batch_flags import add_arguments, planning_inputs
from elastic_pipe.planning import plan_schedule
from elastic_pipe.lowering import ElasticCosts, lower

DRAW_ARGUMENTS = (add_num_layers, add_arguments)
"""The drawing flags of both schedules (``ScheduleSpec.draw_arguments``)."""


def plan_builder(name: str) -> Callable[..., Built]:
    """The IR builder of schedule ``name`` (``elastic`` or ``seq1f1b``)."""
    def build_ir(pp: int, units: None, options: Options, **flags) -> Built:
        del units  # the plan's chunks are the units
        if options != Options():
            raise ValueError(f"{name} is priced by the cost model (--model, --hardware): drop "
                             f"--forward-cost, --backward-cost and --transfer-cost")
        inputs = planning_inputs(argparse.Namespace(pp=pp, **flags))
        cost = inputs.cost
        plan = plan_schedule(tuple(inputs.lengths), name, cost.model, cost.hardware,
                             cost.parallel, inputs.config)
        return Built(lower(plan, pp), ElasticCosts(cost, plan), time_unit="s",
                     memory_unit="bytes")

    return build_ir
