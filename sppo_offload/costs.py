"""The simulator's cost protocol for the subsequences of one sequence.

:class:`SequenceCosts`: unit ``j`` is subsequence ``j`` (a one-piece
:class:`~longctx.chunks.Chunk` whose context is its first token); forward, backward,
recomputation, stage-to-stage transfers, stash and model state come from
:class:`~longctx.cost_model.CostModel`. ``checkpointed[stage]``
layers of every unit on a stage are recomputed (0 for SPPO, all of them for Megatron's full
recomputation; the solver prices its baselines ``per_layer_recompute``, one layer rebuilt at a
time as Megatron does). An ``OFFLOAD`` / ``RELOAD`` of ``(stage, j)`` moves ``offloaded[stage][j]``
bytes over the host link in ``bytes / (host_gbps x allocator factor)`` seconds (``offloaded``
counts device bytes, the allocator's overhead included; PCIe copies of large pinned buffers
run at link speed; the start-up is negligible next to the hundreds of MB moved).
:class:`OffloadCosts` prices any one-piece units the same way (the documents of a training
batch, :mod:`sppo_offload.subsequence_batch`).
"""
from __future__ import annotations

from typing import Sequence

from megatron.plugin.pipeline.ir import Action

from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel
from longctx.chunk_costs import ChunkCosts

from sppo_offload.partition import starts


def subsequence_chunks(lengths: Sequence[int]) -> tuple[Chunk, ...]:
    """One chunk per subsequence of one sequence (document 0), the last one final."""
    last = len(lengths) - 1
    return tuple(Chunk((Piece(0, j, start, start + length, final=j == last),))
                 for j, (start, length) in enumerate(zip(starts(list(lengths)), lengths)))


class OffloadCosts(ChunkCosts):
    """The chunk costs of :class:`~longctx.chunk_costs.ChunkCosts` for the one-piece units
    ``chunks`` plus the copies of ``OFFLOAD`` / ``RELOAD`` (``offloaded[stage][unit]`` bytes).
    """

    def __init__(self, cost: CostModel, chunks: Sequence[Chunk],
                 offloaded: Sequence[Sequence[float]] | None = None,
                 checkpointed: Sequence[int] | None = None, host_gbps: float | None = None,
                 per_layer_recompute: bool = False):
        layers = tuple(checkpointed or (0,) * cost.pp)
        super().__init__(cost, chunks, lambda stage, unit: layers[stage], per_layer_recompute)
        self.offloaded = offloaded or [[0.0] * len(chunks) for _ in range(cost.pp)]
        if any(b > 0 for row in self.offloaded for b in row) and not host_gbps:
            raise ValueError("offloading needs the host link bandwidth (host_gbps)")
        self.host_gbps = host_gbps

    def duration(self, action: Action) -> float:
        if action.is_memory():
            return self.offloaded[action.stage][action.unit] / (self.host_gbps * GB
                                                                * self.cost.allocator)
        return super().duration(action)

    def activation_bytes(self, action: Action) -> float:
        if action.is_memory():
            return self.offloaded[action.stage][action.unit]
        return super().activation_bytes(action)


class SequenceCosts(OffloadCosts):
    """Costs of one sequence's subsequences on the stages of ``cost``'s layout
    (:class:`OffloadCosts` of its :func:`subsequence_chunks`)."""

    def __init__(self, cost: CostModel, lengths: Sequence[int],
                 offloaded: Sequence[Sequence[float]] | None = None,
                 checkpointed: Sequence[int] | None = None, host_gbps: float | None = None,
                 per_layer_recompute: bool = False):
        super().__init__(cost, subsequence_chunks(lengths), offloaded, checkpointed, host_gbps,
                         per_layer_recompute)
