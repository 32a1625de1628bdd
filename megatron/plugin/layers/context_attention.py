"""Causal attention of one slice over its K/V context, block by block, merged by log-sum-exp.

A slice of ``s`` tokens after ``c`` context tokens attends to every context key and causally to
its own keys. :func:`attend_with_context` runs a block kernel
(:mod:`~megatron.plugin.layers.attention_kernels`) once per block -- each context block (one
earlier slice's K/V, as the K/V store holds it) unmasked, the slice's own keys causally -- and
merges the partial outputs as they come: ``lse = log(exp(lse_a) + exp(lse_b))``, ``out =
exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``, in fp32 (fp64 for fp64 inputs). Backward runs each block's kernel
backward with the merged output and log-sum-exp; the query's gradient is summed over the blocks
in fp32. With dropout, each block draws its own mask (the masks of a whole-row kernel are drawn
in another order: the same distribution, not the same bits) and its backward draws it again.

Nothing larger than one block is materialised, and what is saved is linear in the tokens: the
query, the slice's own K/V, the context blocks themselves (the K/V store's leaves, no copies),
the merged output, its log-sum-exp and each block's dropout state. Grouped-query heads are
expanded to the query heads one block at a time (a temporary) and their gradients summed back
per group. One piece of code on every device: only the block kernel differs.
"""
from __future__ import annotations

import torch

from megatron.plugin.layers.attention_kernels import block_kernel, heads_first


def _expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[1, groups, t, dim]`` with each group repeated for its query heads (Megatron's
    ``repeat_interleave`` order)."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def _grouped(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expanded`: ``[1, heads, t, dim]`` summed per group."""
    heads = grad.shape[1]
    if groups == heads:
        return grad
    return grad.view(1, groups, heads // groups, *grad.shape[2:]).sum(2)


def _work_dtype(query: torch.Tensor) -> torch.dtype:
    """What the merge and the query's gradient accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(query.dtype, torch.float32)


def _blocks(key, value, context):
    """``(key, value, causal)`` of every block: the context blocks, then the slice's own."""
    pairs = [(context[i], context[i + 1], False) for i in range(0, len(context), 2)]
    return pairs + [(key, value, True)]


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, query, key, value, *context):
        heads, work = query.shape[1], _work_dtype(query)
        merged, lse, states = None, None, []
        for k, v, causal in _blocks(key, value, context):
            out, part, state = kernel.forward(query, _expanded(k, heads), _expanded(v, heads),
                                              causal)
            states.append(state)
            out, part = out.to(work), part.to(work)
            if merged is None:
                merged, lse = out, part
                continue
            total = torch.logaddexp(lse, part)
            merged = merged * torch.exp(lse - total).unsqueeze(-1) \
                + out * torch.exp(part - total).unsqueeze(-1)
            lse = total
        merged = merged.to(query.dtype)
        ctx.kernel, ctx.states = kernel, states
        ctx.save_for_backward(query, key, value, merged, lse, *context)
        return merged

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse, *context = ctx.saved_tensors
        grad = grad.contiguous()
        heads, work = query.shape[1], _work_dtype(query)
        grad_query, grads = None, []
        for (k, v, causal), state in zip(_blocks(key, value, context), ctx.states):
            dq, dk, dv = ctx.kernel.backward(grad, query, _expanded(k, heads),
                                             _expanded(v, heads), out, lse, causal, state)
            grad_query = dq.to(work) if grad_query is None else grad_query + dq.to(work)
            grads.append((_grouped(dk, k.shape[1]), _grouped(dv, v.shape[1])))
        *context_grads, (grad_key, grad_value) = grads
        flat = [g for pair in context_grads for g in pair]
        return None, grad_query.to(query.dtype), grad_key, grad_value, *flat


def attend_with_context(query, key, value, context, scale: float | None,
                        dropout: float = 0.0) -> torch.Tensor:
    """``[s, heads, dim]`` output of ``query`` over the ``context`` blocks (a list of
    ``(key, value)`` pairs, earlier tokens first, each ``[c_j, groups, dim]``; empty for a
    whole document) and causally over its own ``key``/``value`` (``[s, groups, dim]``, groups
    dividing heads); ``scale`` ``None`` is ``1/sqrt(dim)``; ``dropout`` on the attention
    probabilities."""
    kernel = block_kernel(query, dropout, scale)
    flat = [heads_first(t) for pair in context for t in pair]
    out = _ContextAttention.apply(kernel, heads_first(query), heads_first(key),
                                  heads_first(value), *flat)
    return out.squeeze(0).transpose(0, 1)
