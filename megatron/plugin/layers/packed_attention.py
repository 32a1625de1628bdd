"""Causal attention over packed rows of documents (and document slices with K/V context),
into one output buffer, saving only what its backward needs.

With attention called per document, autograd keeps each document's output and then the
concatenation (or stack) the caller builds from them -- which the output projection saves
again: two copies of ``[s, b, heads * dim]`` per layer. :func:`packed_attention`
(``q``, ``k``, ``v`` and each segment's K/V context -> ``o``) attends each segment of each row
over its context blocks and its own keys (:mod:`~megatron.plugin.layers.context_attention`:
block kernels merged by log-sum-exp; one block for a document without context) and writes
every segment's output and log-sum-exp into one preallocated ``[s, b, heads * dim]`` buffer
and one ``[s, b, heads]`` buffer, which is all it saves besides ``q``, ``k``, ``v``, the
context blocks (the K/V store's own tensors) and each block's dropout state; the output
projection's saved input is that same buffer. Its backward runs the blocks' backwards per
segment with those buffers and returns the context blocks' gradients to the store's leaves.

The block kernel (:mod:`~megatron.plugin.layers.attention_kernels`) is torch's flash or
memory-efficient operator on CUDA, the fused flash kernel on CPU, or the matrix-product kernel
for CPU dropout. Used by :class:`~megatron.plugin.layers.attention.DocumentAttention` and by
:mod:`helix.attention`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.plugin.layers import context_attention
from megatron.plugin.layers.attention_kernels import block_kernel, heads_first
from megatron.plugin.layers.layout import Segment

Segments = Sequence["Sequence[Segment] | None"]
"""Per row of the micro-batch, the documents' segments covering it (``None``: one document)."""
Contexts = Sequence[Sequence[Sequence[tuple]]]
"""Per row and segment, the ``(key, value)`` context blocks ``[c, groups, dim]`` it attends
to before its own keys, earlier tokens first (empty for a document without context)."""


def row_segments(layout, batch: int) -> Segments:
    """The document segments of each of ``batch`` rows (``None``: every row is one document;
    :func:`packed_attention` then attends over the whole row)."""
    if layout is not None and layout.segments:
        return layout.segments
    return (None,) * batch


def _covering(row, seq: int) -> list[slice]:
    """The token ranges of ``row``'s documents (the whole row for ``None``)."""
    if row is None:
        return [slice(0, seq)]
    covered = sum(seg.length for seg in row)
    if covered != seq:
        raise ValueError(f"segments cover {covered} tokens of a {seq}-token row")
    return [slice(seg.start, seg.stop) for seg in row]


def _documents(segments: Segments, seq: int, contexts: Contexts | None):
    """``(row, token range, context blocks)`` of every segment, rows in order."""
    for b, row in enumerate(segments):
        ranges = _covering(row, seq)
        blocks = contexts[b] if contexts is not None else [()] * len(ranges)
        yield from ((b, rows, context) for rows, context in zip(ranges, blocks))


def _blocks(k, v, b: int, rows: slice, context) -> list:
    """The blocks of one segment in the kernels' layout: its context, then its own keys."""
    own = (heads_first(k[rows, b]), heads_first(v[rows, b]), True)
    return [(heads_first(key), heads_first(value), False) for key, value in context] + [own]


def attend(q, k, v, segments: Segments, kernel, contexts: Contexts | None = None):
    """``([s, b, heads * dim]`` output, ``[s, b, heads]`` log-sum-exp, per-segment kernel
    states) of causal attention within each segment, after its context blocks, through the
    block ``kernel`` (:func:`~megatron.plugin.layers.attention_kernels.block_kernel`); ``q`` is
    ``[s, b, heads, dim]``, ``k``/``v`` ``[s, b, groups, dim]``."""
    seq, batch, heads, dim = q.shape
    out = q.new_empty(seq, batch, heads * dim)
    lse = torch.empty(seq, batch, heads, dtype=context_attention.work_dtype(q), device=q.device)
    states = []
    for b, rows, context in _documents(segments, seq, contexts):
        o, logsumexp, state = context_attention.merged_forward(
            kernel, heads_first(q[rows, b]), _blocks(k, v, b, rows, context))
        out[rows, b] = o[0].transpose(0, 1).reshape(-1, heads * dim)
        lse[rows, b] = logsumexp[0].transpose(0, 1)
        states.append(state)
    return out, lse, states


def attend_backward(grad, q, k, v, out, lse, segments: Segments, kernel, states,
                    contexts: Contexts | None = None):
    """``(dq, dk, dv, context gradients)`` of :func:`attend` from the output gradient, output,
    log-sum-exp and kernel states of its forward; the context gradients are ``(dk, dv)`` pairs
    in the order of the context blocks, row by row and segment by segment."""
    seq, batch, heads, dim = q.shape
    grad = grad.view(seq, batch, heads, dim)
    out = out.view(seq, batch, heads, dim)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    context_grads = []
    for (b, rows, context), state in zip(_documents(segments, seq, contexts), states):
        gq, block_grads = context_attention.merged_backward(
            kernel, heads_first(grad[rows, b]).contiguous(), heads_first(q[rows, b]),
            _blocks(k, v, b, rows, context), heads_first(out[rows, b]),
            lse[rows, b].transpose(0, 1).unsqueeze(0), state)
        *before, (gk, gv) = block_grads
        dq[rows, b] = gq[0].transpose(0, 1)
        dk[rows, b] = gk[0].transpose(0, 1)
        dv[rows, b] = gv[0].transpose(0, 1)
        context_grads.extend((g[0].transpose(0, 1), h[0].transpose(0, 1)) for g, h in before)
    return dq, dk, dv, context_grads


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segments, kernel, contexts, q, k, v, *flat_context):
        out, lse, states = attend(q, k, v, segments, kernel, contexts)
        ctx.segments, ctx.kernel, ctx.states = segments, kernel, states
        ctx.shape = [[len(blocks) for blocks in row] for row in contexts] if contexts else None
        ctx.save_for_backward(q, k, v, out, lse, *flat_context)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, *flat_context = ctx.saved_tensors
        contexts = _nested(flat_context, ctx.shape)
        dq, dk, dv, context_grads = attend_backward(grad, q, k, v, out, lse, ctx.segments,
                                                    ctx.kernel, ctx.states, contexts)
        flat = [g for pair in context_grads for g in pair]
        return None, None, None, dq, dk, dv, *flat


def _nested(flat: list, shape) -> Contexts | None:
    """The ``(key, value)`` blocks of :data:`Contexts` from their flat list and the count per
    row and segment."""
    if shape is None:
        return None
    pairs = iter(zip(flat[::2], flat[1::2]))
    return [[[next(pairs) for _ in range(count)] for count in row] for row in shape]


def packed_attention(q, k, v, segments: Segments, scale: float | None, dropout: float = 0.0,
                     contexts: Contexts | None = None, backend: str = "auto") -> torch.Tensor:
    """``[s, b, heads * dim]`` causal attention within each document segment, after its K/V
    ``contexts`` (see the module docstring); ``scale`` ``None`` is ``1/sqrt(dim)``;
    ``dropout`` on the probabilities; ``backend``: Megatron-LM's ``--attention-backend``
    (:func:`~megatron.plugin.layers.attention_kernels.block_kernel`)."""
    flat = [t for row in contexts for blocks in row for pair in blocks for t in pair] \
        if contexts else []
    return _PackedAttention.apply(segments, block_kernel(q, dropout, scale, backend), contexts, q, k, v,
                                  *flat)
