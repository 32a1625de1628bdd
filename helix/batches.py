"""The helix schedule's input: this data-parallel rank's packed micro-batches, completed to a
multiple of ``p x folds`` with empty slots."""
from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from helix.memory import helix_shape, planned_peaks
from helix.schedule import padding
from megatron.plugin.batches import pack_micro_batches


class HelixBatches:
    """This data-parallel rank's micro-batches; iterating yields them in order (stage 0's
    ``forward_step_func`` reads them), :attr:`batches` gives any by index."""

    def __init__(self, batches, padding_count: int, folds: int, recompute: bool,
                 mlp_rows: int | None = None, planned_activation_bytes: float | None = None):
        self.batches = list(batches)
        self.planned_activation_bytes = planned_activation_bytes
        """This stage's planned peak of activation bytes (:mod:`helix.memory`)."""
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
    dp = parallel_state.get_data_parallel_world_size()
    batches = pack_micro_batches(documents, args.seq_length, args.micro_batch_size, dp)
    mine = batches[parallel_state.get_data_parallel_rank()::dp]
    pp = args.pipeline_model_parallel_size
    empty = padding(len(mine), pp, args.helix_folds)
    shape = helix_shape(get_model_config(_chunk(model)), args,
                        next(_chunk(model).parameters()).device.type)
    planned = planned_peaks(shape, pp, args.num_layers, len(mine), args.helix_folds,
                            args.helix_recompute_without_attention) if mine else None
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return HelixBatches(mine, empty, args.helix_folds, args.helix_recompute_without_attention,
                        shape.mlp_chunk_rows, None if planned is None else planned[stage]), \
        len(mine)


def _chunk(model):
    return model[0] if isinstance(model, list) else model
