"""Causal attention of one document segment over its K/V context, block by block, merged by
log-sum-exp.

A segment of ``s`` tokens after ``c`` context tokens attends to every context key and causally
to its own keys. :func:`merged_forward` runs a block kernel
(:mod:`~megatron.plugin.layers.attention_kernels`) once per block -- each context block (one
earlier slice's K/V, as the K/V store holds it) unmasked, the segment's own keys causally --
and merges the partial outputs as they come: ``lse = log(exp(lse_a) + exp(lse_b))``, ``out =
exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``, in fp32 (fp64 for fp64 inputs).
:func:`merged_backward` runs each block's kernel backward with the merged output and
log-sum-exp; the query's gradient is summed over the blocks in the same precision. With
dropout, each block draws its own mask (the masks of a whole-row kernel are drawn in another
order: the same distribution, not the same bits) and its backward draws it again. A document
without context is the case of one block.

Nothing larger than one block is materialised: a caller
(:mod:`~megatron.plugin.layers.packed_attention`) saves the query, the segment's own K/V, the
context blocks themselves (the K/V store's leaves, no copies), the merged output, its
log-sum-exp and the blocks' dropout states -- linear in the tokens. Grouped-query heads are
expanded to the query heads one block at a time (a temporary) and their gradients summed back
per group. One piece of code on every device: only the block kernel differs.

Tensors here are in the kernels' layout, ``[batch, heads, tokens, dim]``: batch 1 for one
segment (:func:`~megatron.plugin.layers.attention_kernels.heads_first`), several documents for
a padded batch (:mod:`~megatron.plugin.layers.document_batches`, one block); a block is
``(key, value, causal)``.
"""
from __future__ import annotations

import torch


def work_dtype(query: torch.Tensor) -> torch.dtype:
    """What the merge and the query's gradient accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(query.dtype, torch.float32)


def _expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, groups, t, dim]`` with each group repeated for its query heads (Megatron's
    ``repeat_interleave`` order)."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def _grouped(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expanded`: ``[batch, heads, t, dim]`` summed per group."""
    batch, heads = grad.shape[:2]
    if groups == heads:
        return grad
    return grad.view(batch, groups, heads // groups, *grad.shape[2:]).sum(2)


def merged_forward(kernel, query: torch.Tensor, blocks) -> tuple:
    """``(out, lse, states)``: the query's attention over ``blocks`` (earlier tokens first),
    ``out`` in the query's dtype, ``lse`` (``[1, heads, s]``) in :func:`work_dtype`, one
    kernel state per block."""
    heads, work = query.shape[1], work_dtype(query)
    merged, lse, states = None, None, []
    for key, value, causal in blocks:
        out, part, state = kernel.forward(query, _expanded(key, heads),
                                          _expanded(value, heads), causal)
        states.append(state)
        out, part = out.to(work), part.to(work)
        if merged is None:
            merged, lse = out, part
            continue
        total = torch.logaddexp(lse, part)
        merged = merged * torch.exp(lse - total).unsqueeze(-1) \
            + out * torch.exp(part - total).unsqueeze(-1)
        lse = total
    return merged.to(query.dtype), lse, states


def merged_backward(kernel, grad, query, blocks, out, lse, states) -> tuple:
    """``(grad_query, [(grad_key, grad_value) per block])`` of :func:`merged_forward` from the
    output gradient, its output, log-sum-exp and states; each in its input's dtype."""
    heads, work = query.shape[1], work_dtype(query)
    grad_query, grads = None, []
    for (key, value, causal), state in zip(blocks, states):
        dq, dk, dv = kernel.backward(grad, query, _expanded(key, heads),
                                     _expanded(value, heads), out, lse, causal, state)
        grad_query = dq.to(work) if grad_query is None else grad_query + dq.to(work)
        grads.append((_grouped(dk, key.shape[1]), _grouped(dv, value.shape[1])))
    return grad_query.to(query.dtype), grads
