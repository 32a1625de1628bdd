"""Activation-memory accounting that works on any device.

:class:`SavedTensorMeter` counts the bytes autograd holds for backward (saved-tensor hooks),
de-duplicated by storage, and tracks the peak. On CUDA the training loop also reports
``torch.cuda.max_memory_allocated``. Parameters (leaves that require grad) are not counted:
they are model state, not activations.
"""
from __future__ import annotations

import contextlib

import torch


class SavedTensorMeter:
    """Live and peak bytes of tensors saved for backward while the meter is active."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._live: dict[int, list] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, tensor: torch.Tensor):
        if tensor.is_leaf and tensor.requires_grad:
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.data_ptr() else id(storage)
        entry = self._live.get(key)
        if entry is None:
            entry = [storage.nbytes(), 0]
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
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _Saved:
    """Holds a saved tensor; when autograd drops it, the meter forgets its bytes."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


def device_peak_bytes() -> int | None:
    """``torch.cuda.max_memory_allocated`` on CUDA, ``None`` elsewhere."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return None
