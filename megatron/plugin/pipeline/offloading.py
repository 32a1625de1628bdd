"""Activation offloading on a stage (the SPPO schedule): :class:`Offloading`, the executor
extension that runs ``OFFLOAD`` and ``RELOAD`` with an
:class:`~megatron.plugin.pipeline.offload.ActivationOffloader`.

The forward of every unit with an ``OFFLOAD`` in this rank's list runs under the offloader's
capture hooks; ``OFFLOAD`` moves the unit's share of saved activations to the host tier, leaving
on the device the storages of the unit's input and output and those the schedule names as
resident (the K/V store); ``RELOAD`` brings them back, and the backward waits for the copies
first. Nothing may stay captured when the schedule ends. With ``forward_only`` the memory
actions are skipped (nothing is saved).
"""
from __future__ import annotations

import contextlib
from typing import Callable

from megatron.plugin.layers.memory import storage_key
from megatron.plugin.pipeline.extension import StageExtension
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.offload import ActivationOffloader


class Offloading(StageExtension):
    """``OFFLOAD`` / ``RELOAD`` of whole-stage units (see the module docstring)."""

    def __init__(self, offloader: ActivationOffloader, resident: Callable[[], set] = set):
        self.offloader = offloader
        self.resident = resident
        """The storage keys that stay on the device besides each unit's input and output."""
        self.captured: set[tuple] = set()
        """``(unit, part)`` of the units this rank offloads."""
        self.handlers = {Kind.OFFLOAD: self._offload, Kind.RELOAD: self._reload}

    def start(self, run) -> None:
        if run.training:
            self.captured = {(a.unit, a.part) for a in run.actions if a.kind is Kind.OFFLOAD}
        if any(part is not None for _, part in self.captured):
            raise ValueError(f"pipeline rank {run.rank}: OFFLOAD actions need whole-stage "
                             f"compute, not a part")

    def handler(self, action: Action):
        return self.handlers.get(action.kind)

    def forward(self, run, action: Action):
        key = (action.unit, action.part)
        return self.offloader.capture(key) if key in self.captured else contextlib.nullcontext()

    @contextlib.contextmanager
    def backward(self, run, action: Action):
        """Waits for the unit's reloaded copies first, forgets the unit after."""
        key = (action.unit, action.part)
        if key not in self.captured:
            yield
            return
        self.offloader.before_backward(key)
        yield
        self.offloader.release(key)

    def finish(self, run) -> None:
        if self.captured:
            self.offloader.check_empty(f"pipeline rank {run.rank}")

    def _offload(self, run, index: int, action: Action) -> None:
        """Move the unit's share of saved activations to the host tier, keeping on the device
        what others still read."""
        if not run.training:
            return
        key = (action.unit, action.part)
        kept = {storage_key(t) for t in (run.inputs.get(key), run.outputs.get(key))
                if t is not None}
        self.offloader.offload(key, kept | self.resident())

    def _reload(self, run, index: int, action: Action) -> None:
        if run.training:
            self.offloader.reload((action.unit, action.part))
