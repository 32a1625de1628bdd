"""Chunked MLP (``--helix-mlp-chunk-size TOKENS``): a layer's MLP block over sequence chunks.

The MLP block (``TransformerLayer._forward_mlp``: pre-MLP norm, MLP, bias-dropout-add) is
token-wise, so it can run over slices of the sequence. :func:`chunked_mlp` runs it as one
autograd node whose forward computes the chunks one after another without autograd, writing
each into one output buffer, and keeps only the block's input; its backward recomputes one chunk
at a time with autograd, back-propagates it at once (the parameters' gradients accumulate as
usual, Megatron DDP's hooks included) and writes the chunk's input gradient into one buffer.
Only one chunk's intermediate activations (the ``4h``-wide MLP hidden, the activation's input)
exist at any moment, in the forward and in the backward: the MLP block's stash shrinks to its
input, at the price of one more MLP forward per backward.

Choices where HelixPipe is vague:

* ``TOKENS`` counts positions of the full sequence, the length the MLP sees after the
  sequence-parallel all-gather. With ``--sequence-parallel`` every tensor-parallel rank chunks
  its own shard into ``TOKENS / tp`` rows; the ranks run the same number of chunks, so each
  chunk's all-gather (``fc1``) and reduce-scatter (``fc2``) pair up across the group, and the
  block stays token-wise (a chunk gathers rows from every shard).
* Under ``--helix-recompute-without-attention`` the boundary's recomputation runs the node
  again (the MLP's forward without autograd, before the backward), so the MLP runs three times
  per step: the stash keeps no MLP output (it would be one more ``[s, b, h]`` per boundary
  for the whole loop, against one MLP forward; the MLP is the cheap part of the
  attention-dominated shapes helix is for).
* The random state is captured when the node runs and restored for the backward's
  recomputation, which draws the same dropout masks chunk by chunk in the same order.
"""
from __future__ import annotations

import torch

from megatron.plugin.layers.rng import rng_restored, rng_state


def chunked_mlp(block, hidden: torch.Tensor, rows: int) -> torch.Tensor:
    """``block(hidden)`` (a token-wise ``[s, b, h] -> [s, b, h]`` function) over chunks of
    ``rows`` sequence rows."""
    if rows < 1:
        raise ValueError(f"chunk rows must be positive, got {rows}")
    if not torch.is_grad_enabled():
        return _run_chunks(block, hidden, rows)
    return _ChunkedBlock.apply(block, rows, rng_state(), hidden)


def _run_chunks(block, hidden: torch.Tensor, rows: int) -> torch.Tensor:
    out = None
    for start in range(0, hidden.shape[0], rows):
        piece = block(hidden[start:start + rows])
        if out is None:
            out = hidden.new_empty((hidden.shape[0], *piece.shape[1:]))
        out[start:start + rows] = piece
    return out


class _ChunkedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, rows, rng, hidden):
        ctx.block, ctx.rows, ctx.rng = block, rows, rng
        ctx.save_for_backward(hidden)
        return _run_chunks(block, hidden, rows)

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        grad_in = torch.empty_like(hidden)
        rows = ctx.rows
        with rng_restored(ctx.rng), torch.enable_grad():
            for start in range(0, hidden.shape[0], rows):
                leaf = hidden[start:start + rows].detach().requires_grad_()
                piece = ctx.block(leaf)
                torch.autograd.backward(piece, grad_out[start:start + rows])
                grad_in[start:start + rows] = leaf.grad
        return None, None, None, grad_in
