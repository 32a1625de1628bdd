"""Causal attention over packed documents through the fused CPU flash kernel, saving only what
its backward needs.

With SDPA called per document, autograd keeps each document's attention output and then the
concatenation (or stack) the caller builds from them -- which the output projection saves
again: two copies of ``[s, b, heads * dim]`` per layer. :func:`packed_attention`
(``q``, ``k``, ``v`` -> ``o``) calls the fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, the kernel SDPA itself picks for these
inputs) once per document and writes every document's output and log-sum-exp into one
preallocated ``[s, b, heads * dim]`` buffer and one ``[s, b, heads]`` buffer, which is all it
saves besides ``q``, ``k``, ``v``; the output projection's saved input is that same buffer. Its
backward calls the kernel's backward per document with those buffers.

Grouped-query heads are expanded to the query heads per document (the kernel wants equal head
counts); the expanded gradients are summed back per group. The kernel has no dropout: with a
positive attention dropout in training, or off the CPU, :func:`supported` is false and callers
keep their SDPA / flash-attn path. Used by
:class:`~megatron.plugin.layers.attention.DocumentAttention`
for documents without K/V context and by :mod:`helix.attention`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.plugin.layers.context_attention import (FLASH_DTYPES, flash_backward, flash_forward,
                                                      heads_first)

from megatron.plugin.layers.layout import Segment

Segments = Sequence["Sequence[Segment] | None"]
"""Per row of the micro-batch, the documents' segments covering it (``None``: one document)."""


def supported(x: torch.Tensor, dropout: float) -> bool:
    """Whether this module serves an attention over ``x`` with this (effective) dropout."""
    return x.device.type == "cpu" and dropout == 0.0 and x.dtype in FLASH_DTYPES


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


def attend(q, k, v, segments: Segments, scale):
    """``([s, b, heads * dim]`` output, ``[s, b, heads]`` log-sum-exp) of causal attention
    within each segment; ``q`` is ``[s, b, heads, dim]``, ``k``/``v`` ``[s, b, groups, dim]``."""
    seq, batch, heads, dim = q.shape
    out = q.new_empty(seq, batch, heads * dim)
    # The kernel's statistics are float32 for half inputs, the input type otherwise.
    stats = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    lse = torch.empty(seq, batch, heads, dtype=stats, device=q.device)
    for b, row in enumerate(segments):
        for rows in _covering(row, seq):
            o, logsumexp = flash_forward(heads_first(q[rows, b]),
                                    heads_first(_expanded(k[rows, b], heads)),
                                    heads_first(_expanded(v[rows, b], heads)),
                                    0.0, True, scale=scale)
            out[rows, b] = o[0].transpose(0, 1).reshape(-1, heads * dim)
            lse[rows, b] = logsumexp[0].transpose(0, 1)
    return out, lse


def attend_backward(grad, q, k, v, out, lse, segments: Segments, scale):
    """``dq, dk, dv`` of :func:`attend` from the output gradient, output and log-sum-exp."""
    seq, batch, heads, dim = q.shape
    groups = k.shape[2]
    grad = grad.view(seq, batch, heads, dim)
    out = out.view(seq, batch, heads, dim)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    for b, row in enumerate(segments):
        for rows in _covering(row, seq):
            gq, gk, gv = flash_backward(
                heads_first(grad[rows, b]), heads_first(q[rows, b]),
                heads_first(_expanded(k[rows, b], heads)),
                heads_first(_expanded(v[rows, b], heads)), heads_first(out[rows, b]),
                lse[rows, b].transpose(0, 1).unsqueeze(0), 0.0, True, scale=scale)
            dq[rows, b] = gq[0].transpose(0, 1)
            dk[rows, b] = _grouped(gk[0].transpose(0, 1), groups)
            dv[rows, b] = _grouped(gv[0].transpose(0, 1), groups)
    return dq, dk, dv


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segments, scale, q, k, v):
        out, lse = attend(q, k, v, segments, scale)
        ctx.segments, ctx.scale = segments, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        return None, None, *attend_backward(grad, q, k, v, out, lse, ctx.segments, ctx.scale)


def packed_attention(q, k, v, segments: Segments, scale: float | None) -> torch.Tensor:
    """``[s, b, heads * dim]`` causal attention within each document segment (see the module
    docstring); ``scale`` ``None`` is ``1/sqrt(dim)``."""
    return _PackedAttention.apply(segments, scale, q, k, v)
