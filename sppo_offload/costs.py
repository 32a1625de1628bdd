"""The simulator's cost protocol for the subsequences of one sequence.

Unit ``j`` is subsequence ``j`` (a one-piece :class:`~elastic_pipe.chunks.Chunk` whose context
is its first token); forward, backward, recomputation, stage-to-stage transfers, stash and
model state come from :class:`~elastic_pipe.cost_model.CostModel`. ``checkpointed[stage]``
layers of every unit on a stage are recomputed (0 for SPPO, all of them for Megatron's full
recomputation). An ``OFFLOAD`` / ``RELOAD`` of ``(stage, j)`` moves ``offloaded[stage][j]``
bytes over the host link in ``bytes / host_gbps`` seconds (PCIe copies of large pinned buffers
run at link speed; the start-up is negligible next to the hundreds of MB moved).
"""
from __future__ import annotations

from typing import Sequence

from megatron.plugin.pipeline.ir import Action, Kind

from elastic_pipe.chunks import Chunk, Piece
from elastic_pipe.cost_model import GB, CostModel

from sppo_offload.partition import starts


def subsequence_chunks(lengths: Sequence[int]) -> tuple[Chunk, ...]:
    """One chunk per subsequence of one sequence (document 0), the last one final."""
    last = len(lengths) - 1
    return tuple(Chunk((Piece(0, j, start, start + length, final=j == last),))
                 for j, (start, length) in enumerate(zip(starts(list(lengths)), lengths)))


class SequenceCosts:
    """Costs of one sequence's subsequences on the stages of ``cost``'s layout."""

    def __init__(self, cost: CostModel, lengths: Sequence[int],
                 offloaded: Sequence[Sequence[float]] | None = None,
                 checkpointed: Sequence[int] | None = None, host_gbps: float | None = None):
        self.cost = cost
        self.chunks = subsequence_chunks(lengths)
        self.offloaded = offloaded or [[0.0] * len(lengths) for _ in range(cost.pp)]
        self.checkpointed = tuple(checkpointed or (0,) * cost.pp)
        if any(b > 0 for row in self.offloaded for b in row) and not host_gbps:
            raise ValueError("offloading needs the host link bandwidth (host_gbps)")
        self.host_gbps = host_gbps

    def duration(self, action: Action) -> float:
        chunk = self.chunks[action.unit]
        if action.kind is Kind.FORWARD:
            return self.cost.stage_forward(action.stage, chunk)
        if action.kind is Kind.BACKWARD:
            return self.cost.stage_backward(action.stage, chunk)
        if action.kind is Kind.RECOMPUTE:
            return self.checkpointed[action.stage] * self.cost.layer_forward(chunk)
        if action.is_memory():
            return self.offloaded[action.stage][action.unit] / (self.host_gbps * GB)
        raise ValueError(f"a subsequence pipeline has no {action.kind.value} actions: {action}")

    def transfer_time(self, action: Action) -> float:
        return self.cost.p2p_time(self.chunks[action.unit])

    def activation_bytes(self, action: Action) -> float:
        chunk = self.chunks[action.unit]
        if action.kind is Kind.RECOMPUTE:
            return self.cost.layer_saving(chunk)
        if action.is_memory():
            return self.offloaded[action.stage][action.unit]
        return self.cost.stash_bytes(action.stage, chunk, self.checkpointed[action.stage])

    def static_bytes(self, rank: int) -> float:
        return self.cost.static_bytes(rank)
