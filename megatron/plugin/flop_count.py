"""Megatron-LM's FLOP count over the documents each training step really trains on.

Megatron-LM counts a step's floating-point operations (``num_floating_point_operations``:
the TFLOP/s of ``--log-throughput`` and the ``num_floating_point_operations_so_far`` of its
checkpoints) as if each of the step's samples were ``--seq-length`` tokens long, unless the
step recorded packed-sequence statistics: megatron-core 0.19 sums ``L`` and ``L**2`` over the
real sequence lengths each rank hands ``update_seqlen_stats_from_cu_seqlens``, and its loop
all-reduces them after the step (over every rank, divided by TP x CP x PP: each data-parallel
replica counts its own share once per model-parallel rank). :func:`record_documents` hands it
the step's documents.

Choices: a document's length is its number of inputs (a document of ``n + 1`` tokens trains on
``n`` positions), whatever a schedule does with it (slices with K/V context, packing, padding:
the count is the model's work on the documents, not the schedule's). The global batch is
shared among the data-parallel replicas by document index (replica ``r`` counts documents
``r, r + DP, ...``); only the sum over the replicas matters. A replica with no document records
one of length 0, so that every rank takes part in the loop's all-reduce. Evaluation steps
record nothing (Megatron counts training FLOPs only).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from megatron.core import parallel_state


def _recorder():
    """megatron-core's recorder of packed-sequence lengths, ``None`` where the release has none
    (0.17 counts every sample as ``--seq-length`` tokens)."""
    from megatron.training import training

    return getattr(training, "update_seqlen_stats_from_cu_seqlens", None)


def counts_real_lengths() -> bool:
    """Whether the installed megatron-core counts FLOPs over recorded sequence lengths."""
    return _recorder() is not None


def record_documents(documents: Sequence[np.ndarray]) -> None:
    """Record this data-parallel replica's share of one training step's ``documents`` (each
    ``n + 1`` tokens) for Megatron-LM's FLOP count; nothing where the release cannot take
    them."""
    recorder = _recorder()
    if recorder is None:
        return
    dp = parallel_state.get_data_parallel_world_size()
    share = documents[parallel_state.get_data_parallel_rank()::dp]
    lengths = [len(doc) - 1 for doc in share] or [0]
    recorder(torch.from_numpy(np.cumsum([0, *lengths], dtype=np.int64)))
