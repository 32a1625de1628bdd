"""Megatron-LM's default loss under context parallelism as per-token weights of Megatron's
micro-batches: the schedules that run those micro-batches (``default``, ``1f1b``,
``interleaved``, ``1f1b-ir``) weigh their tokens with them, and the document schedules give each
token the weight of its position in Megatron's packed row (:mod:`megatron.plugin.default_loss`).

Megatron's meaning (megatron-core 0.19, ``pretrain_gpt.py``): ``get_batch_on_this_cp_rank``
cuts every row of a micro-batch into ``2 x CP`` equal chunks and gives context-parallel rank
``r`` chunks ``r`` and ``2 x CP - 1 - r`` (causal load balance); ``loss_func`` returns the
rank's loss sum and its own loss-token count ``n_r``, ``forward_step`` divides the one by the
other (and by the micro-batches ``M``), and DDP averages the gradients over the data- and
context-parallel ranks. A micro-batch's loss is therefore the mean over the context-parallel
ranks of their shares' token means: a token of share ``r`` weighs ``1 / (CP x n_r x M)``. That
equals the micro-batch's token mean (the loss at one context-parallel rank) only when every
share holds as many loss tokens; packed rows end in padding, so here they usually do not.
Under ``--calculate-per-token-loss`` the shares' sums are added and divided by the tokens of
the whole global batch: the same loss at every degree.

The project's attention is Ulysses: each rank holds a contiguous ``1 / CP`` of every row
(:meth:`~megatron.plugin.batches.MicroBatch.context_share`), not Megatron's two chunks. The
attention's result does not depend on the split, and the loss is a weighted sum of per-token
losses, so giving each token the weight of the chunk Megatron would have put it in
(:func:`megatron_share_weights`) reproduces Megatron's loss and gradients exactly, whichever
rank computes the token.
"""
from __future__ import annotations

import torch


def megatron_share_weights(loss_mask: torch.Tensor, size: int) -> torch.Tensor:
    """``[b, s]`` per-token weights ``1 / n_r`` for a micro-batch's ``loss_mask`` (its loss
    tokens, ``[b, s]``) over ``size`` context-parallel ranks, ``n_r`` the loss tokens of the
    share Megatron's ``get_batch_on_this_cp_rank`` gives the rank ``r`` whose chunks hold the
    token (at least 1, as Megatron's ``forward_step`` clamps it).

    With these weights a rank's weighted sum, times its own token count as
    :func:`~megatron.plugin.batches.loss_func` returns it, divided by that count and ``M`` by
    Megatron's ``forward_step`` and averaged over the ranks by its DDP, is Megatron's loss
    (module doc)."""
    batch, seq = loss_mask.shape
    if seq % (2 * size):
        raise ValueError(f"Megatron splits a {seq}-token row into 2 x {size} equal chunks "
                         f"under context parallelism: the row length must be divisible by "
                         f"{2 * size}")
    chunk = seq // (2 * size)
    chunks = torch.arange(2 * size)
    owner = torch.minimum(chunks, 2 * size - 1 - chunks)
    counts = loss_mask.to(torch.float64).view(batch, 2 * size, chunk).sum(dim=(0, 2))
    per_rank = torch.zeros(size, dtype=torch.float64).index_add_(0, owner, counts)
    weights = 1.0 / per_rank.clamp(min=1)
    return weights[owner].repeat_interleave(chunk).expand(batch, seq).to(loss_mask.device)
