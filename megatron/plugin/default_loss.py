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
loss and gradients exactly (:func:`token_weights`): on a replica, DDP's average over the
replicas supplying ``1 / DP``, whichever replica the schedule gives the document to.
``--micro-batch-size`` keeps Megatron's meaning for these schedules: the micro-batch whose
token mean weighs its tokens holds that many packed rows (under ``--calculate-per-token-loss``
the loss does not depend on it, here as in Megatron).

Without context parallelism a document holds at most ``--seq-length`` inputs and lies in one of
Megatron's micro-batches, so all its tokens weigh alike, ``1 / (n x M)``
(:func:`document_weights`). With ``CP`` context-parallel ranks Megatron's loss depends on the
degree (:mod:`megatron.plugin.context_loss`): a micro-batch's loss is the mean over the ranks
of their shares' token means, a share being 2 of the ``2 x CP`` equal chunks of every row, so a
token weighs ``1 / (CP x n_r x M)``, ``n_r`` the loss tokens of the share its position in
Megatron's packed row falls in. The weights are then per token: each document is placed where
Megatron's packing puts it (its row, from the offset of the documents before it) and
:func:`~megatron.plugin.context_loss.megatron_share_weights` weighs the micro-batch's loss mask.

The units still run through Megatron's ``forward_step``, which divides each unit's loss by the
unit's loss tokens on this rank and by the number of units ``K``, and through Megatron's DDP,
which divides by ``DP x CP``: a unit's row carries ``K x CP`` times its tokens' weights
(:func:`unit_weights`), and :func:`~megatron.plugin.batches.loss_func` multiplies the weighted
sum by the rank's token count. The Ulysses share a rank computes (a contiguous ``1 / CP`` of the
unit's row, not Megatron's two chunks) changes nothing: every token carries its own weight,
whichever rank computes it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from megatron.core import parallel_state

from megatron.plugin.batches import document_loss_mask, micro_batch_rows
from megatron.plugin.context_loss import megatron_share_weights


def document_weights(lengths: Sequence[int], seq_length: int, micro_batch_size: int,
                     data_parallel: int, loss_tokens: Sequence[int] | None = None) -> list[float]:
    """Per document of ``lengths`` inputs (the global batch in its order), the weight of each of
    its tokens in a replica's loss under Megatron's default loss without context parallelism:
    ``1 / (n x M)``, with ``n`` the loss tokens of its micro-batch (the documents'
    ``loss_tokens``, their inputs less what ``--eod-mask-loss`` masks; by default all their
    inputs) and ``M`` the micro-batches per replica."""
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


def token_weights(masks: Sequence[np.ndarray], seq_length: int, micro_batch_size: int,
                  data_parallel: int, context_parallel: int) -> list[np.ndarray]:
    """Per document of the global batch (in its order, each given by its loss mask: one 0 or 1
    per input), the weight of each of its inputs in a replica's loss under Megatron's default
    loss at ``context_parallel`` ranks: ``1 / (CP x n_r x M)``, ``n_r`` the loss tokens of the
    share of its micro-batch that Megatron's split of the packed rows gives the token's
    position (module doc); at one rank every input of a document weighs
    :func:`document_weights`'."""
    lengths = [len(mask) for mask in masks]
    if context_parallel == 1:
        weights = document_weights(lengths, seq_length, micro_batch_size, data_parallel,
                                   [int(mask.sum()) for mask in masks])
        return [np.full(n, weight) for n, weight in zip(lengths, weights)]
    batches = micro_batch_rows(lengths, seq_length, micro_batch_size, data_parallel)
    scale = 1.0 / (context_parallel * (len(batches) // data_parallel))
    weights: list[np.ndarray] = [np.zeros(0)] * len(masks)
    for rows in batches:
        packed = np.zeros((micro_batch_size, seq_length))
        places = []
        for row, members in enumerate(rows):
            start = 0
            for index in members:
                packed[row, start:start + lengths[index]] = masks[index]
                places.append((index, row, start))
                start += lengths[index]
        if not places:
            continue
        shares = megatron_share_weights(torch.from_numpy(packed), context_parallel).numpy()
        for index, row, start in places:
            weights[index] = shares[row, start:start + lengths[index]] * scale
    return weights


def unit_weights(args, documents, units: int) -> list[np.ndarray] | None:
    """Per document of the global batch, the loss weight of each of its inputs in a row of one
    of this replica's ``units`` under Megatron's default loss (``K x CP`` times
    :func:`token_weights`, see the module doc); ``None`` under ``--calculate-per-token-loss``,
    where every token counts once."""
    if args.calculate_per_token_loss:
        return None
    cp = parallel_state.get_context_parallel_world_size()
    weights = token_weights([document_loss_mask(doc) for doc in documents], args.seq_length,
                            args.micro_batch_size,
                            parallel_state.get_data_parallel_world_size(), cp)
    return [units * cp * weight for weight in weights]
