"""Per-document, per-layer store of the K/V of earlier slices (slicing with K/V context).

When a long document is cut into slices, slice ``j`` attends to its own tokens and to the K/V of
slices ``0..j-1`` of the same document, layer by layer. The store keeps, for every recorded
(document key, slice index, layer):

* the K and V produced by that slice's forward, still attached to its autograd graph, so that
  the slice's backward can push the K/V gradients coming from later slices into it;
* a detached leaf copy (``requires_grad=True``, sharing storage; also when the slice ran
  without autograd, as checkpointed layers do) handed to later slices as context. The
  gradient each later slice sends to the leaf is added into an accumulator of at least fp32
  (:func:`accumulator_dtype`; the leaf's ``.grad`` is taken and cleared by a post-accumulate
  hook, so autograd never sums in a half-precision ``.grad``): that sum is exactly the dK/dV the
  slice's own backward needs, rounded to the K/V's dtype once, when it is used. A single
  attention kernel over the whole document accumulates dK/dV in fp32 the same way.

Backward of slice ``i`` is therefore one multi-tensor call
``torch.autograd.backward([out_i, K_i.., V_i..], [dout_i, dK_i.., dV_i..])``
(:meth:`KVStore.backward_targets` returns the extra pairs), run after the backward of every later
slice. :meth:`KVStore.release` then frees the slice's tensors; an empty store between iterations
is the no-leak invariant.

Memory accounting: every recorded K/V and every accumulator is held through
:func:`~megatron.plugin.layers.memory.keep`, so an active saved-tensor meter counts the store
(once per storage) also for slices that ran without autograd and for the dK/dV accumulators,
which autograd itself does not save; the planners price an accumulator at four bytes an element
(:class:`longctx.cost_model.CostModel`'s ``dkv_per_token``) in bf16/fp16 runs.

Storage. K and V recorded with their graph are views of the QKV projection's output, which the
slice's own attention saves anyway: the store adds no bytes. Recorded without a graph (a
checkpointed forward), they are copied into storages of their own, so the projection's output,
Q included, is freed with the forward: the store then holds ``2h`` elements a token, what the
planners price for a checkpointed slice.

Recomputation: re-recording an existing (key, slice, layer) replaces the graph-attached tensors
by the recomputed ones and keeps the leaves (and their accumulated gradients) untouched, so a
recomputed forward never appends to nor resets the context seen by other slices. The leaves'
data become the recomputed K/V (the same values: the recomputation restores the forward's RNG
state), so the first forward's copies are freed instead of living on beside the recomputed ones
until the slice's release.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.plugin.layers.memory import keep, storage_key


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What context gradients of K/V in ``dtype`` are summed in: fp32, or ``dtype`` if wider."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class _Entry:
    key: torch.Tensor
    value: torch.Tensor
    key_leaf: torch.Tensor
    value_leaf: torch.Tensor
    sums: list = field(default_factory=lambda: [None, None])
    """The accumulated context gradients of K and V (``None`` until a later slice sends one)."""
    held: list = field(default_factory=list)
    """:func:`~megatron.plugin.layers.memory.keep` handles of K, V and the two accumulators."""

    def hold(self) -> None:
        """Count K/V (and, as they accumulate, their context gradients) as activation bytes."""
        self.held[:] = [keep(self.key), keep(self.value), None, None]
        for slot, leaf in ((0, self.key_leaf), (1, self.value_leaf)):
            leaf.register_post_accumulate_grad_hook(_accumulate(self.sums, self.held, slot))


def _accumulate(sums: list, held: list, slot: int):
    """Hook that moves a leaf's gradient into ``sums[slot]`` (kept in ``held[2 + slot]``) and
    clears ``.grad``; it refers to the lists only, so no reference cycle keeps the entry (and
    its bytes) alive after its release."""
    def hook(leaf):
        grad, leaf.grad = leaf.grad, None
        if sums[slot] is None:
            sums[slot] = grad.to(accumulator_dtype(grad.dtype))
            held[2 + slot] = keep(sums[slot])
        else:
            sums[slot].add_(grad)
    return hook


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied into a storage of its own when it is a view of a larger one (K of the
    fused QKV projection's output, whose Q nothing else keeps)."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


class KVStore:
    """K/V of document slices, by ``(doc_key, slice_index)`` and layer number."""

    def __init__(self):
        self._entries: dict[tuple[object, int], dict[int, _Entry]] = {}

    def record(self, doc_key, slice_index: int, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Record the K/V ``[tokens, heads, dim]`` of one slice at one layer."""
        layers = self._entries.setdefault((doc_key, slice_index), {})
        entry = layers.get(layer)
        if entry is None:
            if not key.requires_grad:
                key, value = _own_storage(key), _own_storage(value)
            entry = layers[layer] = _Entry(key, value, key.detach().requires_grad_(True),
                                           value.detach().requires_grad_(True))
            entry.hold()
        else:
            entry.key, entry.value = key, value
            entry.held[:2] = [keep(key), keep(value)]
            entry.key_leaf.data, entry.value_leaf.data = key.detach(), value.detach()

    def context(self, doc_key, slice_index: int, layer: int) -> list:
        """Leaves ``(K, V)`` of slices ``0..slice_index-1`` at ``layer``, one pair per slice in
        token order (empty for the first slice); no copy is made.

        Raises ``KeyError`` when an earlier slice was not recorded (a forward ran out of slice
        order).
        """
        blocks = []
        for index in range(slice_index):
            layers = self._entries.get((doc_key, index))
            if layers is None or layer not in layers:
                raise KeyError(
                    f"K/V of slice {index} of document {doc_key!r} at layer {layer} is missing: "
                    f"slices must run their forward in order (asked by slice {slice_index})"
                )
            blocks.append((layers[layer].key_leaf, layers[layer].value_leaf))
        return blocks

    def backward_targets(self, doc_key, slice_index: int, layers=None):
        """``(tensors, grads)``: this slice's K/V and the gradients later slices sent to them,
        at every recorded layer or only at the layer numbers in ``layers``."""
        tensors, grads = [], []
        for layer, entry in self._entries.get((doc_key, slice_index), {}).items():
            if layers is not None and layer not in layers:
                continue
            for tensor, total in zip((entry.key, entry.value), entry.sums):
                if total is not None and tensor.requires_grad:
                    tensors.append(tensor)
                    grads.append(total.to(tensor.dtype))
        return tensors, grads

    def release(self, doc_key, slice_index: int) -> None:
        """Free the K/V (and their gradients) of one slice after its backward."""
        self._entries.pop((doc_key, slice_index), None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def storage_keys(self) -> set:
        """:func:`~megatron.plugin.layers.memory.storage_key` of every recorded K and V (the context
        leaves share their storage): what activation offloading must leave on the device."""
        return {storage_key(tensor) for layers in self._entries.values()
                for entry in layers.values() for tensor in (entry.key, entry.value)}

    def nbytes(self) -> int:
        """Bytes held by recorded K/V and the accumulated context gradients."""
        total = 0
        for layers in self._entries.values():
            for entry in layers.values():
                for tensor in (entry.key, entry.value, *entry.sums):
                    if tensor is not None:
                        total += tensor.numel() * tensor.element_size()
        return total
