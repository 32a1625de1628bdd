"""Helix's attention part on CPU: packed documents through the fused flash kernel, saving only
what its backward needs.

A helix attention part projects the shipped QKV weight over the layer input ``x`` and attends
over the micro-batch's packed documents. Run through Megatron's ``SelfAttention`` with SDPA per
document, autograd keeps ``x`` (for the weight gradient), the fused QKV output, each document's
attention output, their concatenation and the softmax statistics: about ``6 bsh`` per
micro-batch and layer. This module keeps less:

* :func:`packed_attention` (``q``, ``k``, ``v`` -> ``o``) calls the fused CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``, the kernel SDPA itself picks for these
  inputs) once per document and writes every document's output and log-sum-exp into one
  preallocated ``[s, b, heads * dim]`` buffer and one ``[s, b, heads]`` buffer, which is all it
  saves besides ``q``, ``k``, ``v`` (no per-document outputs, no concatenated copy). Its
  backward calls the kernel's backward per document with those buffers.
* :func:`recomputed_attention` (``x``, weight, bias -> ``o``), used under
  ``--helix-recompute-without-attention``: the QKV projection (part of the pre-attention, so
  recomputed like the rest of it) runs without autograd in the forward, and the part saves only
  ``x``, the weight, the output and the log-sum-exp (about ``2 bsh``). Its backward projects
  again with autograd, runs the attention's backward from the saved output and log-sum-exp --
  the attention itself is never recomputed -- and back-propagates through the projection.

Grouped-query heads are expanded to the query heads per document (the kernel wants equal head
counts); the expanded gradients are summed back per group. The kernel has no dropout: with a
positive attention dropout in training, or off the CPU, :func:`supported` is false and helix
runs the attention through Megatron's module as before.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron.plugin.attention import Segment
from megatron.plugin.context_attention import (FLASH_DTYPES, flash_backward, flash_forward,
                                               heads_first)

Segments = Sequence[Sequence[Segment] | None]
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


def _covering(row, seq: int) -> Sequence[Segment]:
    if row is None:
        return (Segment(0, seq),)
    covered = sum(seg.length for seg in row)
    if covered != seq:
        raise ValueError(f"segments cover {covered} tokens of a {seq}-token row")
    return row


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


def _attend(q, k, v, segments: Segments, scale):
    """``([s, b, heads * dim]`` output, ``[s, b, heads]`` log-sum-exp) of causal attention
    within each segment; ``q`` is ``[s, b, heads, dim]``, ``k``/``v`` ``[s, b, groups, dim]``."""
    seq, batch, heads, dim = q.shape
    out = q.new_empty(seq, batch, heads * dim)
    # The kernel's statistics are float32 for half inputs, the input type otherwise.
    stats = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    lse = torch.empty(seq, batch, heads, dtype=stats, device=q.device)
    for b, row in enumerate(segments):
        for seg in _covering(row, seq):
            rows = slice(seg.start, seg.stop)
            o, logsumexp = flash_forward(heads_first(q[rows, b]),
                                    heads_first(_expanded(k[rows, b], heads)),
                                    heads_first(_expanded(v[rows, b], heads)),
                                    0.0, True, scale=scale)
            out[rows, b] = o[0].transpose(0, 1).reshape(seg.length, heads * dim)
            lse[rows, b] = logsumexp[0].transpose(0, 1)
    return out, lse


def _attend_backward(grad, q, k, v, out, lse, segments: Segments, scale):
    """``dq, dk, dv`` of :func:`_attend` from the output gradient, output and log-sum-exp."""
    seq, batch, heads, dim = q.shape
    groups = k.shape[2]
    grad = grad.view(seq, batch, heads, dim)
    out = out.view(seq, batch, heads, dim)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    for b, row in enumerate(segments):
        for seg in _covering(row, seq):
            rows = slice(seg.start, seg.stop)
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
        out, lse = _attend(q, k, v, segments, scale)
        ctx.segments, ctx.scale = segments, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        return None, None, *_attend_backward(grad, q, k, v, out, lse, ctx.segments, ctx.scale)


def packed_attention(q, k, v, segments: Segments, scale: float | None) -> torch.Tensor:
    """``[s, b, heads * dim]`` causal attention within each document segment (see the module
    docstring); ``scale`` ``None`` is ``1/sqrt(dim)``."""
    return _PackedAttention.apply(segments, scale, q, k, v)


class _RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, project, segments, scale, x, weight, bias):
        with torch.no_grad():
            q, k, v = project(x, weight, bias)
            out, lse = _attend(q, k, v, segments, scale)
        ctx.project, ctx.segments, ctx.scale = project, segments, scale
        ctx.save_for_backward(x, weight, bias, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, out, lse = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_(needs)
                  for t, needs in zip((x, weight, bias), ctx.needs_input_grad[3:])]
        with torch.enable_grad():
            q, k, v = ctx.project(*leaves)
        grads = _attend_backward(grad, q.detach(), k.detach(), v.detach(), out, lse,
                                 ctx.segments, ctx.scale)
        roots = [(t, g) for t, g in zip((q, k, v), grads) if t.requires_grad]
        torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        return None, None, None, *(None if t is None else t.grad for t in leaves)


def recomputed_attention(project: Callable, x, weight, bias, segments: Segments,
                         scale: float | None) -> torch.Tensor:
    """:func:`packed_attention` of ``project(x, weight, bias) -> (q, k, v)``, keeping ``x``,
    ``weight``, ``bias``, the output and the log-sum-exp, and projecting again in the backward
    (``project`` must be deterministic and differentiable)."""
    return _RecomputedAttention.apply(project, segments, scale, x, weight, bias)
