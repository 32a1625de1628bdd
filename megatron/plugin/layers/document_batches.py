"""Causal attention of a run of whole documents (consecutive in a packed row, none with K/V
context) in one kernel call, or a few, rather than one per document.

A *run* is ``[T, heads, dim]`` query and ``[T, groups, dim]`` keys and values: documents of
``lengths`` one after another, each attending causally to itself only. Three ways, chosen by
the block kernel's :attr:`together` (:mod:`~megatron.plugin.layers.attention_kernels`):

* ``"varlen"`` (torch's flash operator on CUDA, fp16/bf16): one call of its variable-length
  form (``aten._flash_attention_forward`` with the documents' bounds as ``cu_seqlens``, what
  ``torch.nn.attention.varlen`` calls, which has no dropout), grouped-query heads taken
  natively; its log-sum-exp is ``[heads, T]`` and its dropout state is the Philox state it
  returns.
* ``"padded"`` (torch's memory-efficient operator on CUDA, fp32, whose own variable-length
  form pads its log-sum-exp per document and takes no grouped heads): the documents as batches
  ``[n, heads, L, dim]``, each document right-padded with zeros to the longest ``L`` of its
  batch, one causal block-kernel call per batch
  (:func:`~megatron.plugin.layers.context_attention.merged_forward` with one block). Causal
  attention makes right padding exact: no real query sees a padded key; in the backward the
  padded queries' output gradient and output are zero (their log-sum-exp is set to 0, any
  finite value serves), so they add nothing to a real key's gradient. Documents are batched by
  length class (``2**(c-1) < length <= 2**c``), so a document is padded to less than twice its
  length (less than four times its scores' work, cheap beside a GPU's launches).
* ``"equal"`` (the fused CPU flash kernel): each stretch of consecutive documents of one length
  is one batch, a view of the run (no padding, no copy); other documents one call each.
  Measured on the CPU (one thread, 4 heads of 32 channels, fp32, forward and backward, process
  CPU time): a row of 15 documents of 46 to 811 tokens took 59 ms one document at a time and
  78 ms as padded length classes (the padding's work outweighs the calls saved: about 120 us a
  call against 260 ps a score and channel); SDPA's CPU flash kernel over the whole row with a
  block-diagonal causal mask took 26 times the loop's forward (it computes all ``T x T``
  scores), as does flex attention, which runs eagerly only through its unfused reference. A row
  of equal documents (32 of 128 tokens) is one call.

The padded copies of ``q``, ``k``, ``v`` (``"padded"``) are temporaries: a caller saves the
run's own tensors and the output and log-sum-exp it writes, and the backward gathers them
again. A run's bounds and index tensors are made once per distinct ``lengths`` and device
(:func:`documents`, the last :data:`_CACHED_LAYOUTS` runs kept), not once per layer, and
copied to a GPU from pinned memory without a host sync.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from megatron.plugin.layers import context_attention

_CACHED_LAYOUTS = 64
"""How many distinct runs' index tensors stay cached."""


@dataclass(frozen=True)
class Batch:
    """``count`` documents of a run attended as one batch ``[count, heads, longest, dim]``.

    ``start`` not ``None``: they are consecutive and all ``longest`` tokens long, the batch is
    a view of the run's tokens from ``start`` on. Otherwise run token ``tokens[i]`` sits at
    ``slots[i]`` of the flattened zero-padded ``[count * longest]`` batch."""

    count: int
    longest: int
    start: int | None = None
    tokens: torch.Tensor | None = None
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class Documents:
    """The documents of one run, by length, with their index tensors per device."""

    lengths: tuple[int, ...]
    _per_device: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def bounds(self, device) -> torch.Tensor:
        """``cu_seqlens``: the documents' bounds, int32 on ``device``."""
        return self._made("bounds", device)

    def batches(self, device, padded: bool) -> list[Batch]:
        """The run's batches (module docstring): by length class when ``padded``, else each
        stretch of consecutive documents of one length; index tensors on ``device``."""
        return self._made("padded" if padded else "equal", device)

    def _made(self, what: str, device):
        device = torch.device(device)
        made = self._per_device.get((what, device))
        if made is None:
            made = self._bounds(device) if what == "bounds" \
                else [self._batch(docs, device) for docs in self._groups(what == "padded")]
            self._per_device[(what, device)] = made
        return made

    def _bounds(self, device) -> torch.Tensor:
        bounds = [0]
        for length in self.lengths:
            bounds.append(bounds[-1] + length)
        return _tensor(bounds, torch.int32, device)

    def _groups(self, padded: bool) -> list[list[tuple[int, int]]]:
        """The ``(start, length)`` of each batch's documents."""
        docs, start = [], 0
        for length in self.lengths:
            docs.append((start, length))
            start += length
        if not padded:
            groups = [[docs[0]]]
            for doc in docs[1:]:
                if doc[1] == groups[-1][-1][1]:
                    groups[-1].append(doc)
                else:
                    groups.append([doc])
            return groups
        classes: dict[int, list[tuple[int, int]]] = {}
        for doc in docs:
            classes.setdefault((doc[1] - 1).bit_length(), []).append(doc)
        return [classes[c] for c in sorted(classes)]

    @staticmethod
    def _batch(docs: list[tuple[int, int]], device) -> Batch:
        longest = max(length for _, length in docs)
        first = docs[0][0]
        if all(start == first + n * longest and length == longest
               for n, (start, length) in enumerate(docs)):
            return Batch(len(docs), longest, start=first)
        tokens = [start + i for start, length in docs for i in range(length)]
        slots = [n * longest + i for n, (_, length) in enumerate(docs) for i in range(length)]
        return Batch(len(docs), longest, tokens=_tensor(tokens, torch.long, device),
                     slots=_tensor(slots, torch.long, device))


def _tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``; to a GPU from pinned memory without blocking the host."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@functools.lru_cache(maxsize=_CACHED_LAYOUTS)
def documents(lengths: tuple[int, ...]) -> Documents:
    """The (cached) :class:`Documents` of a run of documents of ``lengths`` tokens."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a run of documents needs positive lengths, got {lengths}")
    return Documents(tuple(lengths))


def _padded(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``x`` ``[T, heads, ...]`` -> the batch ``[count, heads, longest, ...]`` (zero-padded)."""
    shape = (batch.count, batch.longest, *x.shape[1:])
    if batch.start is not None:
        return x[batch.start:batch.start + batch.count * batch.longest].view(shape) \
            .transpose(1, 2)
    padded = x.new_zeros(batch.count * batch.longest, *x.shape[1:])
    padded[batch.slots] = x[batch.tokens]
    return padded.view(shape).transpose(1, 2)


def _unpadded(x: torch.Tensor, batch: Batch, into: torch.Tensor) -> None:
    """Write the real tokens of ``x`` ``[count, heads, longest, ...]`` into their rows of
    ``into`` ``[T, heads, ...]``."""
    flat = x.transpose(1, 2).reshape(batch.count * batch.longest, *into.shape[1:])
    if batch.start is not None:
        into[batch.start:batch.start + flat.shape[0]] = flat
    else:
        into[batch.tokens] = flat[batch.slots].to(into.dtype)


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
    for batch in docs.batches(q.device, kernel.together == "padded"):
        o, part, state = context_attention.merged_forward(
            kernel, _padded(q, batch), [(_padded(k, batch), _padded(v, batch), True)])
        _unpadded(o, batch, out)
        _unpadded(part.unsqueeze(-1), batch, lse.unsqueeze(-1))
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
    for batch, states in zip(docs.batches(q.device, kernel.together == "padded"), state):
        block = (_padded(k, batch), _padded(v, batch), True)
        gq, ((gk, gv),) = context_attention.merged_backward(
            kernel, _padded(grad, batch), _padded(q, batch), [block], _padded(out, batch),
            _padded(lse.unsqueeze(-1), batch).squeeze(-1), states)
        for g, target in zip((gq, gk, gv), into):
            _unpadded(g, batch, target)
