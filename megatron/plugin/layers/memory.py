"""Activation-memory accounting that works on any device.

:class:`SavedTensorMeter` counts the bytes autograd holds for backward (saved-tensor hooks),
de-duplicated by storage, and tracks the peak. Parameters are not counted: they are model state,
not activations. Every other saved tensor is, leaves included: a stage's received input, the
boundary of a checkpointed range and the K/V store's context leaves are activations held until
a backward, like any other. On CUDA the training loop also reports the allocator's peak over
each forward-backward call (:func:`reset_device_peak` when it starts, :func:`device_peak_bytes`
after it): every allocation, model state included.

A schedule that keeps tensors for a later backward outside autograd (helix's per-part stash:
received inputs, graph outputs, recomputation inputs) holds them through :func:`keep`, so the
active meter counts them too (de-duplicated with what autograd saved) until they are dropped.
Offloaded activations (:mod:`megatron.plugin.pipeline.offload`) hold their tensors the same way:
their bytes leave the count when they move to host memory and come back with the reload.
"""
from __future__ import annotations

import contextlib

import torch


def storage_key(tensor: torch.Tensor):
    """Identity of the storage ``tensor`` is a view of (its address; the storage object for an
    empty one): tensors with the same key share their bytes."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.data_ptr() else id(storage)


class SavedTensorMeter:
    """Live and peak bytes of tensors saved for backward while the meter is active."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._live: dict[int, list] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        return self._count(tensor)

    def _count(self, tensor: torch.Tensor) -> "_Saved":
        key = storage_key(tensor)
        entry = self._live.get(key)
        if entry is None:
            entry = [tensor.untyped_storage().nbytes(), 0]
            self._live[key] = entry
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Saved(tensor, key, self)

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        return saved.tensor

    def _release(self, key) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    @contextlib.contextmanager
    def active(self):
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _ACTIVE.remove(self)


_ACTIVE: list[SavedTensorMeter] = []


class Kept:
    """A tensor held for later use; :attr:`tensor` gives it back."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def keep(tensor: torch.Tensor):
    """Hold ``tensor`` for a backward outside autograd: while a meter is active its bytes count
    as saved activation bytes until the returned handle is dropped (parameters never count).
    The handle's ``tensor`` attribute gives the tensor back."""
    if _ACTIVE and not isinstance(tensor, torch.nn.Parameter):
        return _ACTIVE[-1]._count(tensor)
    return Kept(tensor)


class _Saved:
    """Holds a saved tensor; when autograd drops it, the meter forgets its bytes."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


def reset_device_peak() -> None:
    """Start a new :func:`device_peak_bytes` window (CUDA's peak statistics); nothing elsewhere.
    Megatron-LM's own peak figures read the same statistics: its one-off memory report after
    the first logged iteration counts from there too, and under ``--log-memory-to-tensorboard``
    (a peak since the start of the run) the reporter does not reset them."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def device_peak_bytes() -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last :func:`reset_device_peak` on CUDA,
    ``None`` elsewhere."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return None
