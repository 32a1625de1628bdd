"""What one rank's execution of a schedule needs besides its actions (:class:`StageContext`):
the Megatron call, the groups, the stage's place, the timeout, the trace and the schedule's
extensions (:mod:`~megatron.plugin.pipeline.extension`). Read by
:mod:`~megatron.plugin.pipeline.executor` and :mod:`~megatron.plugin.pipeline.stage_run`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron.plugin.pipeline.extension import StageExtension
from megatron.plugin.pipeline.ir import Action


@dataclass
class StageContext:
    """What an execution needs besides the actions (one model chunk, one pipeline rank)."""

    forward_step_func: Callable
    data_iterator: object
    model: torch.nn.Module
    num_microbatches: int
    shape_of: Callable[[Action], tuple]
    pp_group: object
    pg_collection: object
    is_first_stage: bool
    is_last_stage: bool
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: bool | None = None
    timeout_s: float = 600.0
    links: frozenset | None = None
    """The links the schedule declares (:mod:`~megatron.plugin.pipeline.p2p`); ``None``: every
    ordered pair of stages."""
    extensions: list[StageExtension] = field(default_factory=list)
    """What the schedule adds to the executor, hooks called in list order."""
    events: list = field(default_factory=list)
    device_times: bool = False
    """Wait for the device around every compute action, so that its traced duration is the
    device's time rather than the launch's (CUDA; costs overlap; the elastic refit needs it)."""
