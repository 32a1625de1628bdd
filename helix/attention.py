"""Helix's attention part under recomputation without attention.

Helix's attention parts run :func:`megatron.plugin.layers.packed_attention.packed_attention`
(whole documents of a row in one kernel call or a few, into one output buffer, which is all
it saves besides ``q``, ``k``, ``v``), on every device and with dropout. Under
``--helix-recompute-without-attention`` they run :func:`recomputed_attention` (``x`` and the
shipped weights -> ``o``) instead: the QKV projection and the Q/K norms (part of the
pre-attention, so recomputed like the rest of it) run without autograd in the forward, and the
part saves only ``x``, the shipped weights, the output, the log-sum-exp and each document's
dropout state (about ``2 bsh`` instead of ``5 bsh``). Its backward projects again with
autograd, runs the attention's backward from the saved output and log-sum-exp -- the attention
itself is never recomputed, and its dropout masks are drawn again from their state -- and
back-propagates through the projection.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron.plugin.layers.attention_kernels import block_kernel
from megatron.plugin.layers.packed_attention import Segments, attend, attend_backward


class _RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, project, segments, kernel, x, *weights):
        with torch.no_grad():
            q, k, v = project(x, *weights)
            out, lse, states = attend(q, k, v, segments, kernel)
        ctx.project, ctx.segments, ctx.kernel, ctx.states = project, segments, kernel, states
        ctx.save_for_backward(out, lse, x, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, lse, *inputs = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_(needs)
                  for t, needs in zip(inputs, ctx.needs_input_grad[3:])]
        with torch.enable_grad():
            q, k, v = ctx.project(*leaves)
        *grads, _ = attend_backward(grad, q.detach(), k.detach(), v.detach(), out, lse,
                                    ctx.segments, ctx.kernel, ctx.states)
        roots = [(t, g) for t, g in zip((q, k, v), grads) if t.requires_grad]
        torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        return None, None, None, *(None if t is None else t.grad for t in leaves)


def recomputed_attention(project: Callable, x, weights: tuple, segments: Segments,
                         scale: float | None, dropout: float = 0.0,
                         backend: str = "auto") -> torch.Tensor:
    """:func:`~megatron.plugin.layers.packed_attention.packed_attention` of ``project(x,
    *weights) -> (q, k, v)``, keeping ``x``, ``weights`` (the QKV weight, its bias, the Q/K
    norms' weights: ``None`` for one that is absent), the output and the log-sum-exp, and
    projecting again in the backward (``project`` must be deterministic and
    differentiable); ``backend``: Megatron-LM's ``--attention-backend``."""
    kernel = block_kernel(x, dropout, scale, backend)
    return _RecomputedAttention.apply(project, segments, kernel, x, *weights)
