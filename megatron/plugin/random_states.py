"""The random states of a model's data-parallel replicas, kept equal across training steps.

Megatron-LM seeds every data-parallel replica alike (unless ``--data-parallel-random-init``),
and its schedules give every replica the same number of micro-batches of the same shape, so
the replicas draw the same numbers and their random states stay equal; its checkpoint keeps
the states of data-parallel rank 0 only (the checkpoint's ``rng_state`` entry is replicated
over the data-parallel and context-parallel ranks) and a resumed run gives them to every
replica. Here a replica runs its own share of the documents: a document schedule cuts and packs
them into a number of units of shapes of its own, and Megatron's schedules run the packed
micro-batches of its share, whose count can differ by one between replicas. With dropout on,
the replicas' states would part after the first step, and a resumed run would continue every
replica from rank 0's: the masks after the resume would not be those of the uninterrupted run.

Choice: after every training step each replica takes the random states of data-parallel rank 0
(of its data- and context-parallel group): Python's, NumPy's, torch's host and device
generators and the tensor-parallel tracker's, all that Megatron's checkpoint holds. The replicas
are then where Megatron's own schedules keep them (equal at every step's start), and a
checkpoint written at any step resumes every replica exactly. With ``--data-parallel-random-init``
the replicas are meant to differ and Megatron's checkpoint holds each one's states: nothing is
done.
"""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker


def states() -> dict:
    """This process's random states, as Megatron's checkpoint names them."""
    found = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        found["cuda_rng_state"] = torch.cuda.get_rng_state()
    return found


def set_states(found: dict) -> None:
    random.setstate(found["random_rng_state"])
    np.random.set_state(found["np_rng_state"])
    torch.set_rng_state(found["torch_rng_state"])
    if "cuda_rng_state" in found:
        torch.cuda.set_rng_state(found["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(found["rng_tracker_states"])


def follow_first_replica(data_parallel_random_init: bool) -> None:
    """Give this replica the random states of data-parallel rank 0 (module doc); a collective
    of the data- and context-parallel group."""
    if data_parallel_random_init or not dist.is_initialized():
        return
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    payload = [states() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if dist.get_rank(group) != 0:
        set_states(payload[0])
