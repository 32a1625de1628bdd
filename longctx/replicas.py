"""Documents spread over the data-parallel replicas by predicted cost."""
from __future__ import annotations

from megatron.core import parallel_state

from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel


def spread_over_replicas(lengths, replicas: int, cost: CostModel) -> list[list[int]]:
    """Document indices per data-parallel replica, balancing predicted layer-forward time
    (longest processing time first; ties to the lower replica). Each list is sorted."""
    work = [cost.layer_forward(Chunk((Piece(i, 0, 0, n, True),))) for i, n in enumerate(lengths)]
    loads = [0.0] * replicas
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for index in sorted(range(len(lengths)), key=lambda i: (-work[i], i)):
        target = min(range(replicas), key=lambda r: (loads[r], r))
        loads[target] += work[index]
        shares[target].append(index)
    return [sorted(share) for share in shares]


def replica_share(documents, cost: CostModel) -> tuple[list[int], list[int]]:
    """``(lengths of all documents, ids of this data-parallel replica's)``, spread by cost."""
    lengths = [len(doc) - 1 for doc in documents]
    dp = parallel_state.get_data_parallel_world_size()
    share = spread_over_replicas(lengths, dp, cost)[parallel_state.get_data_parallel_rank()]
    if not share:
        raise ValueError(f"--global-batch-size {len(documents)} leaves data-parallel replicas "
                         f"without documents at {dp} replicas: raise it")
    return lengths, share
