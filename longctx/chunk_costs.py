"""The simulator's cost adapter for schedules whose units are chunks of documents (elastic,
seq1f1b, sppo): durations, transfers and stashed bytes from the cost model."""
from __future__ import annotations

from megatron.plugin.pipeline.ir import Action, Kind

from longctx.cost_model import CostModel


class ChunkCosts:
    """The simulator's cost protocol for units that are chunks: forward, backward, transfers
    and stash from the cost model; ``checkpointed(stage, unit)`` layers recomputed. A forward
    stashes all but the dK/dV sums of its non-final slices, which the first backward of a later
    slice of the document creates (:meth:`gradient_sums`).

    A ``RECOMPUTE`` rematerialises all the unit's checkpointed layers at once from the one
    input the forward kept, as this project's runtime does; ``per_layer_recompute`` prices
    Megatron's full recomputation instead, which keeps each checkpointed layer's input and
    rebuilds one layer at a time inside the backward (a transient of one layer and the tensors
    at its boundary, :meth:`~longctx.cost_model.CostModel.recompute_boundary`)."""

    def __init__(self, cost: CostModel, chunks, checkpointed, per_layer_recompute: bool = False):
        self.cost = cost
        self.chunks = chunks
        self.checkpointed = checkpointed
        self.per_layer_recompute = per_layer_recompute
        # per unit, the units that hold earlier slices of its documents
        holding: dict[tuple[int, int], int] = {}
        for unit, chunk in enumerate(chunks):
            for piece in chunk.pieces:
                holding[piece.doc, piece.slice] = unit
        self._earlier = [sorted({holding[piece.doc, index] for piece in chunk.pieces
                                 for index in range(piece.slice)})
                         for chunk in chunks]

    def duration(self, action: Action) -> float:
        chunk = self.chunks[action.unit]
        if action.kind is Kind.FORWARD:
            return self.cost.stage_forward(action.stage, chunk)
        if action.kind is Kind.BACKWARD:
            return self.cost.stage_backward(action.stage, chunk)
        if action.kind is Kind.RECOMPUTE:
            return self.checkpointed(action.stage, action.unit) * self.cost.layer_forward(chunk)
        raise ValueError(f"a schedule of chunks has no {action.kind.value} actions: {action}")

    def transfer_time(self, action: Action) -> float:
        return self.cost.p2p_time(self.chunks[action.unit])

    def activation_bytes(self, action: Action) -> float:
        chunk = self.chunks[action.unit]
        if action.kind is Kind.RECOMPUTE:
            if self.per_layer_recompute:
                return self.cost.layer_saving(chunk) + self.cost.recompute_boundary(chunk)
            return self.cost.checkpoint_saving(chunk, self.checkpointed(action.stage, action.unit))
        return self.cost.stash_bytes(action.stage, chunk, self.checkpointed(
            action.stage, action.unit), self.per_layer_recompute) \
            - self.cost.gradient_sum_bytes(action.stage, chunk)

    def gradient_sums(self, action: Action) -> tuple:
        """The dK/dV sums a backward creates: those of the earlier slices of its documents,
        which its attention's context gradients flow into."""
        return tuple((unit, self.cost.gradient_sum_bytes(action.stage, self.chunks[unit]))
                     for unit in self._earlier[action.unit])

    def head_bytes(self, action: Action) -> float:
        """What a backward frees before its first layer's: the head's share of the stash
        (last stage)."""
        return self.cost.head_bytes(action.stage, self.chunks[action.unit])

    def backward_layers(self, action: Action) -> int:
        """A backward runs its stage's layers one after the other, each making its own dK/dV
        sums (the simulator's step rule)."""
        return self.cost.layers(action.stage)

    def workspace_bytes(self, action: Action) -> float:
        """Bytes a running forward, backward or recomputation holds beyond the stash."""
        return self.cost.stage_workspace(action.stage, self.chunks[action.unit])

    def static_bytes(self, rank: int) -> float:
        return self.cost.static_bytes(rank)
