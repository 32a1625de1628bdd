"""The helix schedule's input: this data-parallel rank's packed micro-batches, completed to a
multiple of ``p x folds`` with empty slots."""
from __future__ import annotations


from megatron.core import parallel_state

from helix.schedule import padding
from megatron.plugin.batches import pack_micro_batches


class HelixBatches:
    """This data-parallel rank's micro-batches; iterating yields them in order (stage 0's
    ``forward_step_func`` reads them), :attr:`batches` gives any by index."""

    def __init__(self, batches, padding_count: int, folds: int, recompute: bool,
                 mlp_rows: int | None = None):
        self.batches = list(batches)
        self.padding = padding_count
        self.folds, self.recompute = folds, recompute
        self.mlp_rows = mlp_rows
        """Sequence rows of this rank per MLP chunk (``None``: no chunking)."""
        self._next = iter(self.batches)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._next)


def prepare_input(documents, args, model):
    del model
    dp = parallel_state.get_data_parallel_world_size()
    batches = pack_micro_batches(documents, args.seq_length, args.micro_batch_size, dp)
    mine = batches[parallel_state.get_data_parallel_rank()::dp]
    empty = padding(len(mine), args.pipeline_model_parallel_size, args.helix_folds)
    rows = args.helix_mlp_chunk_size
    if rows is not None and args.sequence_parallel:
        rows //= args.tensor_model_parallel_size
    return HelixBatches(mine, empty, args.helix_folds,
                        args.helix_recompute_without_attention, rows), len(mine)
