"""Causal attention over packed rows of documents (and document slices with K/V context),
into one output buffer, saving only what its backward needs.

With attention called per document, autograd keeps each document's output and then the
concatenation (or stack) the caller builds from them -- which the output projection saves
again: two copies of ``[s, b, heads * dim]`` per layer. :func:`packed_attention`
(``q``, ``k``, ``v`` and each segment's K/V context -> ``o``) attends each row in parts:

* a run of two or more consecutive whole documents (segments without context: the common case
  of short documents packed into a row, often the whole row) in one kernel call or a few, as
  the block kernel offers (:mod:`~megatron.plugin.layers.document_batches`: on CUDA the flash
  operator's variable-length form, or zero-padded batches per length class; on the CPU one
  call per stretch of documents of one length; the matrix-product kernel keeps one call per
  document);
* every other segment (a later slice of a document, with its K/V context) over its context
  blocks and its own keys (:mod:`~megatron.plugin.layers.context_attention`: block kernels
  merged by log-sum-exp; a lone document is the case of one block);

and writes every part's output and log-sum-exp into one preallocated ``[s, b, heads * dim]``
buffer and one ``[s, b, heads]`` buffer, which is all it saves besides ``q``, ``k``, ``v``, the
context blocks (the K/V store's own tensors) and each call's dropout state; the output
projection's saved input is that same buffer. Its backward runs the parts' backwards with those
buffers and returns the context blocks' gradients to the store's leaves.

The block kernel (:mod:`~megatron.plugin.layers.attention_kernels`) is torch's flash or
memory-efficient operator on CUDA, the fused flash kernel on CPU, or the matrix-product kernel
for CPU dropout. Used by :class:`~megatron.plugin.layers.attention.DocumentAttention` and by
:mod:`helix.attention`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.plugin.layers import context_attention, document_batches
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


def _parts(segments: Segments, seq: int, contexts: Contexts | None, together: bool):
    """``(row, token range, context blocks, documents)`` of every part of the rows, in order:
    with ``together``, each maximal run of two or more consecutive segments of a row without
    context is one part (``documents``: their
    :func:`~megatron.plugin.layers.document_batches.documents`, ``context`` empty); every
    other segment is a part of its own (``documents`` ``None``). Each segment is yielded on as
    :func:`_documents` yields it, before the next is read."""
    run: list = []

    def flushed():
        if len(run) == 1:
            yield run[0][0], run[0][1], (), None
        elif run:
            lengths = tuple(rows.stop - rows.start for _, rows in run)
            yield run[0][0], slice(run[0][1].start, run[-1][1].stop), (), \
                document_batches.documents(lengths)
        run.clear()

    for b, rows, context in _documents(segments, seq, contexts):
        if together and not context:
            if run and (run[-1][0] != b or run[-1][1].stop != rows.start):
                yield from flushed()
            run.append((b, rows))
            continue
        yield from flushed()
        yield b, rows, context, None
    yield from flushed()


def _blocks(k, v, b: int, rows: slice, context) -> list:
    """The blocks of one segment in the kernels' layout: its context, then its own keys."""
    own = (heads_first(k[rows, b]), heads_first(v[rows, b]), True)
    return [(heads_first(key), heads_first(value), False) for key, value in context] + [own]


def attend(q, k, v, segments: Segments, kernel, contexts: Contexts | None = None):
    """``([s, b, heads * dim]`` output, ``[s, b, heads]`` log-sum-exp, per-part kernel
    states) of causal attention within each segment, after its context blocks, through the
    block ``kernel`` (:func:`~megatron.plugin.layers.attention_kernels.block_kernel`); ``q`` is
    ``[s, b, heads, dim]``, ``k``/``v`` ``[s, b, groups, dim]``."""
    seq, batch, heads, dim = q.shape
    out = q.new_empty(seq, batch, heads * dim)
    lse = torch.empty(seq, batch, heads, dtype=context_attention.work_dtype(q), device=q.device)
    states = []
    for b, rows, context, docs in _parts(segments, seq, contexts, kernel.together is not None):
        if docs is not None:
            states.append(document_batches.forward(
                kernel, q[rows, b], k[rows, b], v[rows, b], docs,
                out[rows, b].view(-1, heads, dim), lse[rows, b]))
            continue
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
    parts = _parts(segments, seq, contexts, kernel.together is not None)
    for (b, rows, context, docs), state in zip(parts, states):
        if docs is not None:
            document_batches.backward(
                kernel, grad[rows, b], q[rows, b], k[rows, b], v[rows, b], out[rows, b],
                lse[rows, b], docs, state, (dq[rows, b], dk[rows, b], dv[rows, b]))
            continue
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
