"""LM head and per-token loss over sequence chunks (with ``--helix-mlp-chunk-size``).

Helix computes the logits and the loss in the backward of the last boundary on stage 0, so the
``[s, b, vocab]`` logits are never stashed; they still exist while that backward runs, which is
when the stage holds a whole loop's stash (the first backward of a loop), and for small hidden
sizes they are several times one ``[s, b, h]`` activation. :func:`chunked_loss` runs the LM
head and the cross entropy over sequence chunks as one autograd node, like
:mod:`helix.chunked_mlp`: its forward computes each chunk's per-token losses without autograd,
writing them into one ``[b, s]`` buffer, and keeps only the final hidden state and the labels;
its backward recomputes one chunk at a time with autograd and back-propagates it at once (the
output layer's weight gradient accumulates as usual), writing the chunk's input gradient into
one buffer. Only one chunk's logits exist at any moment.

Choices where HelixPipe is vague: the chunk size is the MLP's (``--helix-mlp-chunk-size``
positions of the full sequence, ``TOKENS / tp`` rows of each rank's shard with
``--sequence-parallel``). With sequence parallelism the output layer all-gathers a chunk's rows
from every tensor-parallel rank, so the chunk covers ``rows`` positions of each of the ``tp``
shards of the sequence; its labels are taken, and its losses written back, at those
positions. The cross entropy is token-wise, so the losses equal the unchunked ones.
"""
from __future__ import annotations

from typing import Callable

import torch


def chunked_loss(head_loss: Callable, hidden: torch.Tensor, labels: torch.Tensor, rows: int,
                 shards: int = 1) -> torch.Tensor:
    """``[b, s]`` per-token losses of ``head_loss(hidden_rows, label_rows) -> losses`` over
    chunks of ``rows`` rows of ``hidden`` (``[s / shards, b, h]``, this rank's shard);
    ``labels`` is ``[b, s]``, ``shards`` the tensor-parallel size under sequence parallelism
    (1 otherwise)."""
    if rows < 1:
        raise ValueError(f"chunk rows must be positive, got {rows}")
    if labels.shape[1] != hidden.shape[0] * shards:
        raise ValueError(f"{labels.shape[1]} labels a row for {hidden.shape[0]} hidden rows "
                         f"on each of {shards} shards")
    if not torch.is_grad_enabled():
        return _run_chunks(head_loss, hidden, labels, rows, shards)
    return _ChunkedLoss.apply(head_loss, rows, shards, hidden, labels)


def _chunks(hidden, labels, rows, shards):
    """``(rows of hidden, their labels [b, shards * n], where they go in [b, shards, s /
    shards])`` per chunk."""
    local = hidden.shape[0]
    by_shard = labels.reshape(labels.shape[0], shards, local)
    for start in range(0, local, rows):
        where = (slice(None), slice(None), slice(start, start + rows))
        yield hidden[start:start + rows], by_shard[where].reshape(labels.shape[0], -1), where


def _run_chunks(head_loss, hidden, labels, rows, shards):
    losses = None
    for piece, piece_labels, where in _chunks(hidden, labels, rows, shards):
        out = head_loss(piece, piece_labels)
        if losses is None:
            losses = out.new_empty(labels.shape)
        by_shard = losses.view(labels.shape[0], shards, hidden.shape[0])
        by_shard[where] = out.view(labels.shape[0], shards, -1)
    return losses


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, head_loss, rows, shards, hidden, labels):
        ctx.head_loss, ctx.rows, ctx.shards = head_loss, rows, shards
        ctx.save_for_backward(hidden, labels)
        return _run_chunks(head_loss, hidden, labels, rows, shards)

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, labels = ctx.saved_tensors
        grad_in = torch.empty_like(hidden)
        batch, shards = labels.shape[0], ctx.shards
        grads = grad_losses.reshape(batch, shards, hidden.shape[0])
        with torch.enable_grad():
            for piece, piece_labels, where in _chunks(hidden, labels, ctx.rows, shards):
                leaf = piece.detach().requires_grad_()
                out = ctx.head_loss(leaf, piece_labels)
                torch.autograd.backward(out, grads[where].reshape(out.shape))
                grad_in[where[2]] = leaf.grad
        return None, None, None, grad_in, None
