"""Causal attention of one slice over its K/V context, without a mask and without copies.

A slice of ``s`` tokens after ``c`` context tokens attends to every context key and causally to
its own keys. Written as one SDPA call this needs the context K/V concatenated with the slice's
(a ``(c+s)``-token copy per layer) and an explicit ``[s, c+s]`` mask, because SDPA's
``is_causal`` is top-left aligned. On CPU both are saved for backward: the mask (4 bytes per
query-key pair as the additive bias the kernel keeps) grows quadratically with the context and,
for the last slice of a long document, dwarfs everything else the layer stashes.

:func:`attend_with_context` instead runs the fused CPU flash kernel once per block -- each
context block unmasked, the slice's own keys causally -- and merges the partial outputs by
their log-sum-exp: ``lse = log sum_j exp(lse_j)``, ``out = sum_j exp(lse_j - lse) out_j``.
Backward calls the kernel's backward per block with the *merged* ``out`` and ``lse``; softmax
gradients only need the row's final normaliser and ``rowsum(dO * O)``, so each block's
``dQ, dK, dV`` are exactly its share (the identity ring attention uses). What is saved: the
query, the slice's K/V and the context blocks themselves (the K/V store's leaves, no copies),
the merged output and the LSE -- linear in the tokens.

Used by :class:`~megatron.plugin.layers.attention.DocumentAttention` for slices with context on CPU
without dropout and without grouped-query heads; the other cases (dropout, GQA, CUDA's
flash-attn) keep the masked SDPA or flash-attn path, whose results are the same.
"""
from __future__ import annotations

import torch

flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""The fused CPU flash kernel SDPA picks for CPU inputs: ``(out, lse)`` of ``[b, heads, t, dim]``
inputs (also used by :mod:`helix.attention`)."""
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""Element types the CPU kernel takes."""


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[t, heads, dim]`` -> ``[1, heads, t, dim]`` (a view), the kernel's layout."""
    return t.transpose(0, 1).unsqueeze(0)


def supported(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`attend_with_context` serves these inputs (``[t, heads, dim]``)."""
    return (query.device.type == "cpu" and dropout == 0.0 and query.shape[1] == key.shape[1]
            and query.dtype in FLASH_DTYPES)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, query, key, value, *context):
        blocks = [(context[i], context[i + 1], False) for i in range(0, len(context), 2)]
        blocks.append((key, value, True))
        outs, lses = [], []
        for k, v, causal in blocks:
            out, lse = flash_forward(query, k, v, 0.0, causal, scale=scale)
            outs.append(out)
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        merged = sum(out * torch.exp(part - lse).unsqueeze(-1) for out, part in zip(outs, lses))
        merged = merged.to(query.dtype)
        ctx.scale = scale
        ctx.save_for_backward(query, key, value, merged, lse, *context)
        return merged

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse, *context = ctx.saved_tensors
        grad = grad.contiguous()
        blocks = [(context[i], context[i + 1], False) for i in range(0, len(context), 2)]
        blocks.append((key, value, True))
        grad_query = None
        block_grads = []
        for k, v, causal in blocks:
            dq, dk, dv = flash_backward(grad, query, k, v, out, lse, 0.0, causal,
                                        scale=ctx.scale)
            grad_query = dq if grad_query is None else grad_query + dq
            block_grads.append((dk, dv))
        *context_grads, (grad_key, grad_value) = block_grads
        flat = [g for pair in context_grads for g in pair]
        return None, grad_query, grad_key, grad_value, *flat


def attend_with_context(query, key, value, context, scale: float | None) -> torch.Tensor:
    """``[s, heads, dim]`` output of ``query`` over the ``context`` blocks (a list of
    ``(key, value)`` pairs, earlier tokens first, each ``[c_j, heads, dim]``) and causally over
    its own ``key``/``value`` (``[s, heads, dim]``); ``scale`` ``None`` is ``1/sqrt(dim)``."""
    flat = [heads_first(t) for pair in context for t in pair]
    out = _ContextAttention.apply(scale, heads_first(query), heads_first(key),
                                  heads_first(value), *flat)
    return out.squeeze(0).transpose(0, 1)
