"""Causal attention of a run of whole documents (consecutive in a packed row, none with K/V
context) in one kernel call, or one per length class, rather than one per document.

A *run* is ``[T, heads, dim]`` query and ``[T, groups, dim]`` keys and values: documents of
``lengths`` one after another, each attending causally to itself only. Two ways, chosen by
the block kernel's :attr:`together` (:mod:`~megatron.plugin.layers.attention_kernels`):

* ``"varlen"`` (torch's flash operator on CUDA, fp16/bf16): one call of its variable-length
  form (``aten._flash_attention_forward`` with the documents' bounds as ``cu_seqlens``, what
  ``torch.nn.attention.varlen`` calls, which has no dropout), grouped-query heads taken
  natively; its log-sum-exp is ``[heads, T]`` and its dropout state is the Philox state it
  returns.
* ``"padded"`` (the fused CPU flash kernel; torch's memory-efficient operator on CUDA, whose
  variable-length form pads its log-sum-exp per document): the documents as a batch
  ``[n, heads, L, dim]``, each right-padded with zeros to the longest ``L`` of its batch, one
  causal block-kernel call per batch (:func:`~megatron.plugin.layers.context_attention.
  merged_forward` with one block). Causal attention makes right padding exact: no real query
  sees a padded key; in the backward the padded queries' output gradient and output are zero
  (their log-sum-exp is set to 0, any finite value serves), so they add nothing to a real
  key's gradient. Documents are batched by length class (``L`` a power of two's range,
  ``2**(c-1) < length <= 2**c``) so a document is padded to at most twice its length (at most
  four times its scores' work); a row of 32 documents of 128 tokens is one call.

  On the CPU this was measured against the alternatives (one thread, 4 heads of 32 channels,
  fp32): for 32 documents of 128 tokens the per-document loop took 12-19 ms a forward, the
  padded batch 13-18 ms, SDPA's CPU flash kernel over the whole row with a block-diagonal
  causal mask 313 ms (it computes every one of the row's ``T x T`` scores); flex attention
  runs eagerly on the CPU only through its unfused reference (the ``T x T`` scores again).

The padded copies of ``q``, ``k``, ``v`` are temporaries: a caller saves the run's own tensors
and the output and log-sum-exp it writes, and the backward gathers them again. A run's index
tensors are made once per distinct ``lengths`` and device (:func:`documents`), not once per
layer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from megatron.plugin.layers import context_attention

_CACHED_LAYOUTS = 256
"""How many distinct runs' index tensors stay cached."""


@dataclass(frozen=True)
class LengthClass:
    """The documents of a run padded into one batch: ``count`` documents of at most ``longest``
    tokens; run token ``tokens[i]`` sits at ``slots[i]`` of the flattened
    ``[count * longest]`` batch."""

    count: int
    longest: int
    tokens: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class Documents:
    """The documents of one run, by length, with their index tensors per device."""

    lengths: tuple[int, ...]
    _per_device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def bounds(self, device) -> torch.Tensor:
        """``cu_seqlens``: the documents' bounds, int32 on ``device``."""
        return self._on(device)[0]

    def classes(self, device) -> list[LengthClass]:
        """The run's length classes (module docstring), index tensors on ``device``."""
        return self._on(device)[1]

    def _on(self, device):
        device = torch.device(device)
        made = self._per_device.get(device)
        if made is None:
            made = (self._bounds(device), self._classes(device))
            self._per_device[device] = made
        return made

    def _bounds(self, device) -> torch.Tensor:
        bounds = [0]
        for length in self.lengths:
            bounds.append(bounds[-1] + length)
        return torch.tensor(bounds, dtype=torch.int32, device=device)

    def _classes(self, device) -> list[LengthClass]:
        members: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for length in self.lengths:
            members.setdefault((length - 1).bit_length(), []).append((start, length))
            start += length
        classes = []
        for _, docs in sorted(members.items()):
            longest = max(length for _, length in docs)
            tokens = [start + i for start, length in docs for i in range(length)]
            slots = [n * longest + i for n, (_, length) in enumerate(docs) for i in range(length)]
            classes.append(LengthClass(len(docs), longest,
                                       torch.tensor(tokens, dtype=torch.long, device=device),
                                       torch.tensor(slots, dtype=torch.long, device=device)))
        return classes


@functools.lru_cache(maxsize=_CACHED_LAYOUTS)
def documents(lengths: tuple[int, ...]) -> Documents:
    """The (cached) :class:`Documents` of a run of documents of ``lengths`` tokens."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a run of documents needs positive lengths, got {lengths}")
    return Documents(tuple(lengths))


def _padded(x: torch.Tensor, group: LengthClass) -> torch.Tensor:
    """``x`` ``[T, heads, ...]`` -> the class's zero-padded batch ``[count, heads, longest,
    ...]``."""
    batch = x.new_zeros(group.count * group.longest, *x.shape[1:])
    batch[group.slots] = x[group.tokens]
    return batch.view(group.count, group.longest, *x.shape[1:]).transpose(1, 2)


def _unpadded(batch: torch.Tensor, group: LengthClass, into: torch.Tensor) -> None:
    """Write the real tokens of ``batch`` ``[count, heads, longest, ...]`` into their rows of
    ``into`` ``[T, heads, ...]``."""
    flat = batch.transpose(1, 2).reshape(group.count * group.longest, *into.shape[1:])
    into[group.tokens] = flat[group.slots].to(into.dtype)


def forward(kernel, q, k, v, docs: Documents, out: torch.Tensor, lse: torch.Tensor):
    """The run's attention through ``kernel`` written into ``out`` ``[T, heads, dim]`` and
    its log-sum-exp into ``lse`` ``[T, heads]`` (in
    :func:`~megatron.plugin.layers.context_attention.work_dtype`); returns the kernel state
    its backward needs."""
    if kernel.together == "varlen":
        o, part, state = kernel.forward_varlen(q, k, v, docs.bounds(q.device), docs.longest)
        out.copy_(o)
        lse.copy_(part.t())
        return state
    states = []
    for group in docs.classes(q.device):
        o, part, state = context_attention.merged_forward(
            kernel, _padded(q, group), [(_padded(k, group), _padded(v, group), True)])
        _unpadded(o, group, out)
        _unpadded(part.unsqueeze(-1), group, lse.unsqueeze(-1))
        states.append(state)
    return states


def backward(kernel, grad, q, k, v, out, lse, docs: Documents, state, into) -> None:
    """The gradients of :func:`forward` (from the output gradient ``[T, heads, dim]``, its
    output, log-sum-exp and state) written into ``into``: ``(dq, dk, dv)``."""
    if kernel.together == "varlen":
        grads = kernel.backward_varlen(grad.contiguous(), q, k, v, out, lse.t().contiguous(),
                                       docs.bounds(q.device), docs.longest, state)
        for g, target in zip(grads, into):
            target.copy_(g)
        return
    for group, states in zip(docs.classes(q.device), state):
        block = (_padded(k, group), _padded(v, group), True)
        gq, ((gk, gv),) = context_attention.merged_backward(
            kernel, _padded(grad, group), _padded(q, group), [block], _padded(out, group),
            _padded(lse.unsqueeze(-1), group).squeeze(-1), states)
        for g, target in zip((gq, gk, gv), into):
            _unpadded(g, group, target)
