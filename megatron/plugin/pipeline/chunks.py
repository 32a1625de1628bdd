"""Document chunks on a stage (the elastic and SPPO schedules): :class:`DocumentChunks`, the
executor extension of the K/V store and the leading-layer checkpointing, and the backward of one
chunk (:func:`chunk_backward`).

Forwards record and read K/V context in a :class:`~megatron.plugin.layers.kv_store.KVStore`
(``forward_step_func`` gets ``kv_store=`` and ``record_kv=True``); a forward checkpoints the
leading layers the plan gives for (stage, unit) (:mod:`~megatron.plugin.pipeline.layer_checkpoint`);
``RECOMPUTE`` rebuilds them; a backward is one multi-root autograd call over the stage output and
the unit's own K/V (with the dK/dV later slices accumulated), split in two at the checkpoint
boundary, after which the unit's K/V are released. The store must be empty when the schedule
ends (it is cleared under ``forward_only``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.pipeline.extension import StageExtension, run_backward
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers


@dataclass
class DocumentChunks(StageExtension):
    """The K/V store and leading-layer checkpointing of a stage (see the module docstring)."""

    kv_store: KVStore
    layers: LeadingLayers
    checkpointed: Callable[[int], int]
    """Unit -> leading layers of this stage to checkpoint."""
    slices: Callable[[int], Sequence[tuple]]
    """Unit -> ``(doc_key, slice_index)`` of its pieces that record K/V."""
    stashes: dict = field(default_factory=dict)
    """``(unit, part)`` -> what a checkpointed forward kept for its recomputation."""

    def step_kwargs(self) -> dict:
        return {"kv_store": self.kv_store, "record_kv": True}

    def handler(self, action: Action):
        return self._recompute if action.kind is Kind.RECOMPUTE else None

    @contextlib.contextmanager
    def forward(self, run, action: Action):
        """Checkpoints the plan's leading layers of the unit (when training)."""
        count = self.checkpointed(action.unit) if run.training else 0
        if not count:
            yield
            return
        with self.layers.armed(count):
            yield
        self.stashes[(action.unit, action.part)] = self.layers.take()

    def unit_backward(self, run, action: Action, input_tensor, output, output_grad):
        return chunk_backward(self, action.unit, input_tensor, output, output_grad,
                              self.stashes.pop((action.unit, action.part), None), run.config)

    def finish(self, run) -> None:
        if not run.training:
            self.kv_store.clear()
        elif len(self.kv_store):
            raise RuntimeError(f"pipeline rank {run.rank}: K/V of {len(self.kv_store)} slices "
                               f"were never released: a slice's backward is missing")
        if self.stashes:
            raise RuntimeError(f"pipeline rank {run.rank}: checkpointed layers of units "
                               f"{sorted(k[0] for k in self.stashes)} were never used by a "
                               f"backward")

    def _recompute(self, run, index: int, action: Action) -> None:
        """Rebuild the checkpointed leading layers of a chunk before its backward."""
        if not run.training:
            return
        stash = self.stashes.get((action.unit, action.part))
        if stash is None:
            raise RuntimeError(f"{action}: the forward of unit {action.unit} checkpointed no "
                               f"layer on this stage")
        self.layers.recompute(stash)


def chunk_backward(chunks: DocumentChunks, unit: int, input_tensor, output, output_grad, stash,
                   config):
    """Backward of one document chunk on one stage; returns the input's gradient.

    Megatron's ``backward_step`` plus the unit's K/V as extra roots: first from the output (the
    loss scaled by ``grad_scale_func`` on the last stage) and the K/V of layers the forward ran
    with autograd, down to the input or the checkpoint boundary; then, when layers were
    checkpointed, from the recomputed boundary and those layers' K/V down to the input.
    """
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_grad is None:
        if config.grad_scale_func is not None:
            output = config.grad_scale_func(output)
        output_grad = torch.ones_like(output)
    store, slices = chunks.kv_store, chunks.slices(unit)

    def targets(layers):
        tensors, grads = [], []
        for doc_key, index in slices:
            more, more_grads = store.backward_targets(doc_key, index, layers)
            tensors += more
            grads += more_grads
        return tensors, grads

    tensors, grads = targets(set(chunks.layers.graph_layers(stash)))
    run_backward([output, *tensors], [output_grad, *grads])
    if stash is not None:
        if stash.recomputed is None:
            raise RuntimeError(f"unit {unit}: checkpointed layers were not recomputed before "
                               f"the backward (missing RECOMPUTE action)")
        tensors, grads = targets(set(chunks.layers.checkpointed_layers(stash)))
        run_backward([stash.recomputed, *tensors], [stash.boundary.grad, *grads])
    for doc_key, index in slices:
        store.release(doc_key, index)
    return input_tensor.grad if input_tensor is not None else None
