"""Per-document, per-layer store of the K/V of earlier slices (slicing with K/V context).

When a long document is cut into slices, slice ``j`` attends to its own tokens and to the K/V of
slices ``0..j-1`` of the same document, layer by layer. The store keeps, for every recorded
(document key, slice index, layer):

* the K and V produced by that slice's forward, still attached to its autograd graph, so that
  the slice's backward can push the K/V gradients coming from later slices into it;
* a detached leaf copy (``requires_grad=True``, sharing storage; also when the slice ran
  without autograd, as checkpointed layers do) handed to later slices as context. Autograd accumulates the gradients of every later slice into the leaf's ``.grad``:
  that sum is exactly the dK/dV the slice's own backward needs.

Backward of slice ``i`` is therefore one multi-tensor call
``torch.autograd.backward([out_i, K_i.., V_i..], [dout_i, leaf_K_i.grad.., leaf_V_i.grad..])``
(:meth:`KVStore.backward_targets` returns the extra pairs), run after the backward of every later
slice. :meth:`KVStore.release` then frees the slice's tensors; an empty store between iterations
is the no-leak invariant.

Recomputation: re-recording an existing (key, slice, layer) replaces the graph-attached tensors
by the recomputed ones and keeps the leaves (and their accumulated gradients) untouched, so a
recomputed forward never appends to nor resets the context seen by other slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.plugin.memory import storage_key


@dataclass
class _Entry:
    key: torch.Tensor
    value: torch.Tensor
    key_leaf: torch.Tensor
    value_leaf: torch.Tensor


class KVStore:
    """K/V of document slices, by ``(doc_key, slice_index)`` and layer number."""

    def __init__(self):
        self._entries: dict[tuple[object, int], dict[int, _Entry]] = {}

    def record(self, doc_key, slice_index: int, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Record the K/V ``[tokens, heads, dim]`` of one slice at one layer."""
        layers = self._entries.setdefault((doc_key, slice_index), {})
        entry = layers.get(layer)
        if entry is None:
            layers[layer] = _Entry(key, value, key.detach().requires_grad_(True),
                                   value.detach().requires_grad_(True))
        else:
            entry.key, entry.value = key, value

    def context(self, doc_key, slice_index: int, layer: int):
        """Leaves ``(K, V)`` of slices ``0..slice_index-1`` at ``layer``, concatenated on tokens.

        Returns ``None`` for the first slice. Raises ``KeyError`` when an earlier slice was not
        recorded (a forward ran out of slice order).
        """
        if slice_index == 0:
            return None
        keys, values = [], []
        for index in range(slice_index):
            layers = self._entries.get((doc_key, index))
            if layers is None or layer not in layers:
                raise KeyError(
                    f"K/V of slice {index} of document {doc_key!r} at layer {layer} is missing: "
                    f"slices must run their forward in order (asked by slice {slice_index})"
                )
            keys.append(layers[layer].key_leaf)
            values.append(layers[layer].value_leaf)
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=0), torch.cat(values, dim=0)

    def backward_targets(self, doc_key, slice_index: int, layers=None):
        """``(tensors, grads)``: this slice's K/V and the gradients later slices sent to them,
        at every recorded layer or only at the layer numbers in ``layers``."""
        tensors, grads = [], []
        for layer, entry in self._entries.get((doc_key, slice_index), {}).items():
            if layers is not None and layer not in layers:
                continue
            for tensor, leaf in ((entry.key, entry.key_leaf), (entry.value, entry.value_leaf)):
                if leaf.grad is not None and tensor.requires_grad:
                    tensors.append(tensor)
                    grads.append(leaf.grad)
        return tensors, grads

    def release(self, doc_key, slice_index: int) -> None:
        """Free the K/V (and their gradients) of one slice after its backward."""
        self._entries.pop((doc_key, slice_index), None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def storage_keys(self) -> set:
        """:func:`~megatron.plugin.memory.storage_key` of every recorded K and V (the context
        leaves share their storage): what activation offloading must leave on the device."""
        return {storage_key(tensor) for layers in self._entries.values()
                for entry in layers.values() for tensor in (entry.key, entry.value)}

    def nbytes(self) -> int:
        """Bytes held by recorded K/V and the accumulated context gradients."""
        total = 0
        for layers in self._entries.values():
            for entry in layers.values():
                for tensor in (entry.key, entry.value, entry.key_leaf.grad, entry.value_leaf.grad):
                    if tensor is not None:
                        total += tensor.numel() * tensor.element_size()
        return total
