"""Megatron-LM's default loss (no ``--calculate-per-token-loss``) as per-token weights, for the
schedules whose units are not Megatron's micro-batches (``elastic``, ``seq1f1b``, ``sppo``).

Megatron's meaning: its ``forward_step`` divides each micro-batch's loss sum by the
micro-batch's loss tokens and by the replica's number of micro-batches ``M``, and its DDP
averages the replicas' gradients (it scales them by ``1 / (DP x CP)`` and sums them over the
data- and context-parallel ranks). Over a global batch as Megatron's schedules receive it here
(the documents packed by :func:`~megatron.plugin.batches.micro_batch_rows` into ``DP x M``
micro-batches of ``--micro-batch-size`` rows of ``--seq-length`` inputs), a token of a
micro-batch with ``n`` loss tokens therefore weighs ``1 / (n x M x DP)`` in the step's loss and
in every gradient. The logged ``lm loss`` is another figure: Megatron's ``train_step`` divides
the reported loss sums by the reported token counts, the per-token mean, under either loss.

A document schedule's loss is a sum of per-token losses however it cuts and places the
documents, so giving every token the weight Megatron's packing gives it reproduces Megatron's
loss and gradients exactly. A document holds at most ``--seq-length`` inputs and lies in one of
Megatron's micro-batches, so one weight per document suffices (:func:`document_weights`): on a
replica ``1 / (n x M)``, DDP's average over the replicas supplying ``1 / DP``, whichever replica
the schedule gives the document to. ``--micro-batch-size`` keeps Megatron's meaning for these
schedules: the micro-batch whose token mean weighs its tokens holds that many packed rows
(under ``--calculate-per-token-loss`` the loss does not depend on it, here as in Megatron).

With context parallelism the weights give the loss at one context-parallel rank (each
micro-batch's token mean), whatever share of a unit's tokens each rank holds.

The units still run through Megatron's ``forward_step``, which divides each unit's loss by the
unit's loss tokens on this rank and by the number of units ``K``, and through Megatron's DDP,
which divides by ``CP``: a unit's row carries ``K x CP`` times its documents' weights
(:func:`unit_weights`), and :func:`~megatron.plugin.batches.loss_func` multiplies the weighted
sum by the rank's token count.
"""
from __future__ import annotations

from typing import Sequence

from megatron.core import parallel_state

from megatron.plugin.batches import loss_tokens, micro_batch_rows


def document_weights(lengths: Sequence[int], seq_length: int, micro_batch_size: int,
                     data_parallel: int, loss_tokens: Sequence[int] | None = None) -> list[float]:
    """Per document of ``lengths`` inputs (the global batch in its order), the weight of each of
    its tokens in a replica's loss under Megatron's default loss: ``1 / (n x M)``, with ``n``
    the loss tokens of its micro-batch (the documents' ``loss_tokens``, their inputs less what
    ``--eod-mask-loss`` masks; by default all their inputs) and ``M`` the micro-batches per
    replica."""
    loss_tokens = lengths if loss_tokens is None else loss_tokens
    batches = micro_batch_rows(lengths, seq_length, micro_batch_size, data_parallel)
    per_replica = len(batches) // data_parallel
    weights = [0.0] * len(lengths)
    for rows in batches:
        members = [index for row in rows for index in row]
        tokens = max(sum(loss_tokens[index] for index in members), 1)
        for index in members:
            weights[index] = 1.0 / (tokens * per_replica)
    return weights


def unit_weights(args, documents, units: int) -> list[float] | None:
    """Per document of the global batch, the loss weight a row of one of this replica's
    ``units`` gives its tokens under Megatron's default loss (``K x CP`` times
    :func:`document_weights`, see the module doc); ``None`` under
    ``--calculate-per-token-loss``, where every token counts once."""
    if args.calculate_per_token_loss:
        return None
    scale = units * parallel_state.get_context_parallel_world_size()
    weights = document_weights([len(doc) - 1 for doc in documents], args.seq_length,
                               args.micro_batch_size,
                               parallel_state.get_data_parallel_world_size(),
                               [loss_tokens(doc) for doc in documents])
    return [scale * weight for weight in weights]
