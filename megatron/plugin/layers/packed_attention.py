"""Causal attention over packed documents, one block-kernel call per document into one
output buffer, saving only what its backward needs.

With SDPA called per document, autograd keeps each document's attention output and then the
concatenation (or stack) the caller builds from them -- which the output projection saves
again: two copies of ``[s, b, heads * dim]`` per layer. :func:`packed_attention`
(``q``, ``k``, ``v`` -> ``o``) calls a block kernel
(:mod:`~megatron.plugin.layers.attention_kernels`: torch's flash or memory-efficient operator
on CUDA, the fused flash kernel on CPU, the matrix-product kernel for CPU dropout) once per
document, causally, and writes every document's output and log-sum-exp into one preallocated
``[s, b, heads * dim]`` buffer and one ``[s, b, heads]`` buffer, which is all it saves besides
``q``, ``k``, ``v`` and each document's dropout state; the output projection's saved input is
that same buffer. Its backward calls the kernel's backward per document with those buffers.

Grouped-query heads are expanded to the query heads per document (the kernels want equal head
counts); the expanded gradients are summed back per group. Used by
:class:`~megatron.plugin.layers.attention.DocumentAttention` for rows without K/V context and by
:mod:`helix.attention`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.plugin.layers.attention_kernels import block_kernel, heads_first
from megatron.plugin.layers.layout import Segment

Segments = Sequence["Sequence[Segment] | None"]
"""Per row of the micro-batch, the documents' segments covering it (``None``: one document)."""


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


def _expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[t, groups, dim]`` with each group repeated for its query heads."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def _grouped(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum a ``[t, heads, dim]`` gradient back over the query heads of each group."""
    t, heads, dim = grad.shape
    if groups == heads:
        return grad
    return grad.view(t, groups, heads // groups, dim).sum(2)


def attend(q, k, v, segments: Segments, kernel):
    """``([s, b, heads * dim]`` output, ``[s, b, heads]`` log-sum-exp, per-document kernel
    states) of causal attention within each segment through the block ``kernel``
    (:func:`~megatron.plugin.layers.attention_kernels.block_kernel`); ``q`` is
    ``[s, b, heads, dim]``, ``k``/``v`` ``[s, b, groups, dim]``."""
    seq, batch, heads, dim = q.shape
    out = q.new_empty(seq, batch, heads * dim)
    lse = torch.empty(seq, batch, heads, dtype=torch.promote_types(q.dtype, torch.float32),
                      device=q.device)
    states = []
    for b, row in enumerate(segments):
        for rows in _covering(row, seq):
            o, logsumexp, state = kernel.forward(heads_first(q[rows, b]),
                                                 heads_first(_expanded(k[rows, b], heads)),
                                                 heads_first(_expanded(v[rows, b], heads)), True)
            out[rows, b] = o[0].transpose(0, 1).reshape(-1, heads * dim)
            lse[rows, b] = logsumexp[0].transpose(0, 1)
            states.append(state)
    return out, lse, states


def attend_backward(grad, q, k, v, out, lse, segments: Segments, kernel, states):
    """``dq, dk, dv`` of :func:`attend` from the output gradient, output, log-sum-exp and the
    kernel states of its forward."""
    seq, batch, heads, dim = q.shape
    groups = k.shape[2]
    grad = grad.view(seq, batch, heads, dim)
    out = out.view(seq, batch, heads, dim)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    documents = ((b, rows) for b, row in enumerate(segments) for rows in _covering(row, seq))
    for (b, rows), state in zip(documents, states):
        gq, gk, gv = kernel.backward(
            heads_first(grad[rows, b]).contiguous(), heads_first(q[rows, b]),
            heads_first(_expanded(k[rows, b], heads)),
            heads_first(_expanded(v[rows, b], heads)), heads_first(out[rows, b]),
            lse[rows, b].transpose(0, 1).unsqueeze(0), True, state)
        dq[rows, b] = gq[0].transpose(0, 1)
        dk[rows, b] = _grouped(gk[0].transpose(0, 1), groups)
        dv[rows, b] = _grouped(gv[0].transpose(0, 1), groups)
    return dq, dk, dv


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segments, kernel, q, k, v):
        out, lse, states = attend(q, k, v, segments, kernel)
        ctx.segments, ctx.kernel, ctx.states = segments, kernel, states
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        return None, None, *attend_backward(grad, q, k, v, out, lse, ctx.segments, ctx.kernel,
                                            ctx.states)


def packed_attention(q, k, v, segments: Segments, scale: float | None,
                     dropout: float = 0.0) -> torch.Tensor:
    """``[s, b, heads * dim]`` causal attention within each document segment (see the module
    docstring); ``scale`` ``None`` is ``1/sqrt(dim)``; ``dropout`` on the probabilities."""
    return _PackedAttention.apply(segments, block_kernel(q, dropout, scale), q, k, v)
