"""What one rank's execution of a schedule needs besides its actions: :class:`StageContext`
(the Megatron call, the groups, the stage's place), :class:`ChunkState` (schedules of document
chunks: the K/V store and the leading layers to checkpoint) and :class:`PartProgram` (schedules
of layer parts). Read by :mod:`~megatron.plugin.pipeline.executor` and
:mod:`~megatron.plugin.pipeline.stage_run`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.pipeline.ir import Action
from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers
from megatron.plugin.pipeline.offload import ActivationOffloader


@dataclass
class ChunkState:
    """What schedules of document chunks add to a stage (see the module docstring)."""

    kv_store: KVStore
    layers: LeadingLayers
    checkpointed: Callable[[int], int]
    """Unit -> leading layers of this stage to checkpoint."""
    slices: Callable[[int], Sequence[tuple]]
    """Unit -> ``(doc_key, slice_index)`` of its pieces that record K/V."""


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
    chunks: ChunkState | None = None
    program: "PartProgram | None" = None
    """Part schedules (helix): runs every compute action (see :class:`PartProgram`)."""
    offload: ActivationOffloader | None = None
    """Runs ``OFFLOAD`` / ``RELOAD`` (see the module docstring)."""
    events: list = field(default_factory=list)
    device_times: bool = False
    """Wait for the device around every compute action, so that its traced duration is the
    device's time rather than the launch's (CUDA; costs overlap; the elastic refit needs it)."""


class PartProgram(Protocol):
    """What a schedule of layer *parts* supplies to the executor (helix, SPPO multiplexing).

    The program runs every compute action that has a part, and the transfers named by a part
    carry its tensors; actions without a part (the steady subsequences beside SPPO's
    multiplexed shares) run whole-stage as in a schedule without a program.

    Tensors flow between compute actions by name: ``forward(action, inputs)`` and
    ``backward(action, grads)`` take ``{tensor name: tensor}`` and return
    ``([(consumer kind, consumer part, tensor name, tensor), ...], loss tokens)``; the consumer
    is the compute action of the same unit that uses the tensor, on this stage (handed over
    directly) or on another (a transfer named by the consumer's part carries it; ``flow``
    gives the consumer of a transfer). ``recompute(action)`` rebuilds a forward's graph.
    Sent tensors are not pseudo-deallocated: a part's outputs may be its own inputs or
    parameters (the relayed residual, the shipped weight). With ``flow.eager_sends`` a batch is
    posted without waiting: each receive is waited for right before the first action that
    consumes it (traced as ``wait for <action>``), sends are released once polled complete and
    waited for at the end at the latest.
    """

    flow: object

    def forward(self, action: Action, inputs: dict) -> tuple[list, int]: ...

    def backward(self, action: Action, grads: dict) -> tuple[list, int]: ...

    def recompute(self, action: Action) -> None: ...
