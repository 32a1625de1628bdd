"""Attention kernels over one block of keys that return and accept their softmax statistics.

A *block kernel* attends a query ``[1, heads, s, dim]`` to one block of keys and values
``[1, heads, t, dim]`` (unmasked, or causally when the block is the query's own tokens, ``t ==
s``) and returns ``(out, lse, state)``: the block's output in the input dtype, the log-sum-exp of
each query row's scores over the block (``[1, heads, s]``, fp32, or fp64 for fp64 inputs) and what its backward needs to
draw the same dropout mask again. Its backward takes the gradient of the *merged* output over all
blocks together with the merged output and log-sum-exp (``rowsum(dO * O)`` and the row's final
normaliser are all a softmax backward needs of the other blocks), so each block's ``dQ, dK, dV``
are exactly its share; :mod:`~megatron.plugin.layers.context_attention` merges the blocks.

Kernels, chosen by :func:`block_kernel` from the device, the dtype, the dropout and Megatron-LM's
``--attention-backend``:

* :class:`CudaFlash`: torch's flash-attention operator
  (``aten._scaled_dot_product_flash_attention`` and its backward) for fp16/bf16 on CUDA; dropout
  from the CUDA generator, its Philox state returned by the forward and handed to the backward.
* :class:`CudaEfficient`: torch's memory-efficient operator for fp32 on CUDA (its log-sum-exp
  is padded along the queries; the kernel trims it and pads the merged one back).
* :class:`CpuFlash`: the fused CPU flash kernel SDPA picks on CPU, without dropout.
* :class:`CpuMath`: the block computed with matrix products (any device and dtype, dropout
  included): the mask is drawn from the default generator of the inputs' device
  (:func:`~megatron.plugin.layers.rng.device_generator`: on CUDA the GPU's, on the CPU the
  CPU's), the one Megatron's RNG tracker forks there, as torch's operators draw theirs; the
  forward keeps that generator's state (16 bytes on CUDA, 5056 on the CPU) and the backward
  draws the mask again from it (the state rather than a seed drawn from the generator: on CUDA
  such a seed would be read back to the host, a synchronisation per block); nothing of the
  block's ``[heads, s, t]`` scores is kept.

Each kernel names in :attr:`together` how a run of whole documents (no K/V context) is
attended in one call (:mod:`~megatron.plugin.layers.document_batches`): ``"varlen"`` (the CUDA
flash operator's variable-length form, :meth:`CudaFlash.forward_varlen`), ``"padded"`` (the
documents as zero-padded batches through :meth:`forward`), ``"equal"`` (consecutive documents of
one length as one batch, a view: no padding, no copy) or ``None`` (one call per document:
the matrix-product kernel, whose dropout masks are drawn block by block and whose scores a batch
would materialise for every document at once).

Torch's operators rather than flash-attn's: they ship with every torch the project supports
(2.6 on), take the same arguments on every GPU, and their forward returns the log-sum-exp and
the dropout state that their backward accepts (flash-attn's varlen functions hide both behind
their autograd function). Grouped-query heads are expanded per block by the caller.

Softmax precision (Megatron-LM's ``--attention-softmax-in-fp32``): every kernel computes the
scores' softmax and its log-sum-exp in fp32 (fp64 for fp64 inputs), whatever the input dtype:
:class:`CpuMath` upcasts the inputs before the product, torch's CPU flash and CUDA flash and
memory-efficient operators accumulate the scores, the running maximum and the normaliser in
fp32 and return an fp32 log-sum-exp, and the blocks are merged in fp32
(:mod:`~megatron.plugin.layers.context_attention`). Megatron's
``--apply-query-key-layer-scaling`` (scores divided by the layer number before an fp16 product
and multiplied back inside the fp32 softmax) is therefore the identity here.

Determinism (Megatron-LM's ``--deterministic-mode``, which calls
``torch.use_deterministic_algorithms(True)``): the CPU kernels are deterministic; torch's CUDA
flash and memory-efficient backwards read that global switch and then run their deterministic
reductions (no split-key atomics); the blocks are merged and their gradients summed in a fixed
order.
"""
from __future__ import annotations

import math

import torch

from megatron.plugin.layers import rng

FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""Element types the fused CPU flash kernel takes."""
flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""The fused CPU flash kernel: ``(out, lse)`` of ``[b, heads, t, dim]`` inputs."""
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[t, heads, dim]`` -> ``[1, heads, t, dim]`` (a view), the kernels' layout."""
    return t.transpose(0, 1).unsqueeze(0)


class CpuFlash:
    """The fused CPU flash kernel (no dropout)."""

    together = "equal"

    def __init__(self, dropout: float, scale: float | None):
        del dropout
        self.scale = scale

    def forward(self, q, k, v, causal: bool):
        out, lse = flash_forward(q, k, v, 0.0, causal, scale=self.scale)
        return out, lse, None

    def backward(self, grad, q, k, v, out, lse, causal: bool, state):
        del state
        return flash_backward(grad, q, k, v, out, lse, 0.0, causal, scale=self.scale)


class CpuMath:
    """The block by matrix products in fp32 (fp64 for fp64 inputs), with dropout drawn again in
    backward."""

    together = None

    def __init__(self, dropout: float, scale: float | None):
        self.dropout = dropout
        self.scale = scale

    def _scale(self, q) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])

    def _probabilities(self, q, k, causal: bool, lse=None):
        """``(p, lse)``: softmax probabilities of the block (normalised by ``lse`` when given,
        else by the block's own log-sum-exp)."""
        work = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * self._scale(q)
        if causal:
            s, t = scores.shape[-2:]
            scores = scores.masked_fill(
                torch.ones(s, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def _keep(self, p: torch.Tensor, generator: torch.Generator | None):
        """``p`` with dropout applied (scaled by ``1 / (1 - dropout)``), its mask drawn from
        ``generator`` (``None``: no dropout)."""
        if generator is None:
            return p
        kept = torch.rand(p.shape, generator=generator, device=p.device) >= self.dropout
        return p * kept / (1.0 - self.dropout)

    @staticmethod
    def _replayed(state, device) -> torch.Generator | None:
        """A generator of ``device`` at the forward's ``state`` (``None`` without dropout)."""
        return None if state is None else torch.Generator(device=device).set_state(state)

    def forward(self, q, k, v, causal: bool):
        p, lse = self._probabilities(q, k, causal)
        generator = rng.device_generator(p.device) if self.dropout > 0 else None
        state = None if generator is None else generator.get_state()
        out = torch.matmul(self._keep(p, generator), v.to(p.dtype))
        return out.to(q.dtype), lse, state

    def backward(self, grad, q, k, v, out, lse, causal: bool, state):
        p, _ = self._probabilities(q, k, causal, lse)
        work = p.dtype
        grad = grad.to(work)
        dropped = self._keep(p, self._replayed(state, p.device))
        grad_value = torch.matmul(dropped.transpose(-1, -2), grad)
        grad_p = self._keep(torch.matmul(grad, v.to(work).transpose(-1, -2)),
                            self._replayed(state, p.device))
        row = (grad * out.to(work)).sum(-1, keepdim=True)
        grad_scores = p * (grad_p - row) * self._scale(q)
        grad_query = torch.matmul(grad_scores, k.to(work))
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), q.to(work))
        return grad_query.to(q.dtype), grad_key.to(k.dtype), grad_value.to(v.dtype)


class CudaFlash:
    """torch's CUDA flash-attention operator (fp16, bf16)."""

    together = "varlen"

    def __init__(self, dropout: float, scale: float | None):
        self.dropout = dropout
        self.scale = scale

    def forward(self, q, k, v, causal: bool):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, self.dropout, causal, False, scale=self.scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, grad, q, k, v, out, lse, causal: bool, state):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        # The operator reads the log-sum-exp as a contiguous [batch, heads, s] array whatever
        # its strides (a view into the packed [s, b, heads] buffer is not one).
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, self.dropout, causal, seed,
            offset, scale=self.scale)

    def forward_varlen(self, q, k, v, bounds: torch.Tensor, longest: int):
        """``(out [T, heads, dim], lse [heads, T], state)`` of the documents whose bounds
        (``cu_seqlens``, int32) are ``bounds``, each causal, in one call; ``q`` is
        ``[T, heads, dim]``, ``k``/``v`` ``[T, groups, dim]`` (grouped heads taken as they
        are)."""
        out, lse, philox, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, bounds, longest, longest, self.dropout, True, False,
            scale=self.scale)
        return out, lse, (philox, unused)

    def backward_varlen(self, grad, q, k, v, out, lse, bounds: torch.Tensor, longest: int,
                        state):
        """``(dq, dk, dv)`` of :meth:`forward_varlen` (``lse`` contiguous ``[heads, T]``)."""
        philox, unused = state
        return torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, bounds, bounds, longest, longest, self.dropout, True,
            philox, unused, scale=self.scale)


class CudaEfficient:
    """torch's CUDA memory-efficient operator (fp32); its log-sum-exp rows are padded."""

    together = "padded"

    def __init__(self, dropout: float, scale: float | None):
        self.dropout = dropout
        self.scale = scale

    def forward(self, q, k, v, causal: bool):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, self.dropout, causal, scale=self.scale)
        return out, lse[..., :q.shape[2]].float(), (seed, offset, lse.shape[-1])

    def backward(self, grad, q, k, v, out, lse, causal: bool, state):
        seed, offset, padded = state
        # The operator wants its padded, contiguous log-sum-exp back (a view into the packed
        # [s, b, heads] buffer is neither, and padding by nothing returns the view itself).
        lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])).contiguous()
        grad_query, grad_key, grad_value, _ = \
            torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                grad, q, k, v, None, out, lse, seed, offset, self.dropout,
                [True, True, True, False], causal, scale=self.scale)
        return grad_query, grad_key, grad_value


BACKENDS = ("auto", "flash", "fused", "unfused")
"""The values of Megatron-LM's ``--attention-backend`` (``AttnBackend`` names) the kernels
serve; ``local`` is refused at start-up (Megatron-LM takes it only with ``--spec local``)."""


def block_kernel(query: torch.Tensor, dropout: float, scale: float | None,
                 backend: str = "auto"):
    """The block kernel for ``query``'s device and dtype with this (effective) dropout, as
    Megatron-LM's ``--attention-backend`` asks:

    * ``auto``: on CUDA the flash operator for fp16/bf16, the memory-efficient one for fp32;
    * ``flash``: torch's flash operator (fp16/bf16 only: the start-up refuses it otherwise);
    * ``fused``: torch's memory-efficient operator (the fused kernel that takes every dtype);
    * ``unfused`` (and Megatron's ``local``): the matrix-product kernel, on every device.

    On CPU there is no flash or fused CUDA kernel: ``auto``, ``flash`` and ``fused`` all run
    the fused CPU flash kernel (the matrix-product one with dropout or an odd dtype).
    """
    if backend not in BACKENDS and backend != "local":
        raise ValueError(f"unknown attention backend {backend!r}: use one of {BACKENDS}")
    if backend in ("unfused", "local"):
        return CpuMath(dropout, scale)
    if query.is_cuda:
        if backend == "fused":
            return CudaEfficient(dropout, scale)
        if backend == "flash" and query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend flash takes fp16 or bf16 inputs, not "
                             f"{query.dtype}: train with --bf16 or --fp16, or use "
                             f"--attention-backend fused")
        if query.dtype in (torch.float16, torch.bfloat16):
            return CudaFlash(dropout, scale)
        return CudaEfficient(dropout, scale)
    if dropout == 0.0 and query.device.type == "cpu" and query.dtype in FLASH_DTYPES:
        return CpuFlash(dropout, scale)
    return CpuMath(dropout, scale)
