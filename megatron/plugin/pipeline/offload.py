"""Saved activations moved to host memory and back: what the executor's ``OFFLOAD`` and
``RELOAD`` actions run (through :mod:`~megatron.plugin.pipeline.offloading`).

Capture. During the forward of a unit the schedule offloads, :meth:`ActivationOffloader.capture`
installs saved-tensor hooks: autograd keeps a :class:`SavedHandle` instead of each tensor it
saves. Leaves that require grad (parameters, a stage's received input, the K/V context leaves)
are not the unit's activations and pass through untouched; views of them (a transposed weight)
get handles but are never offloaded. A handle holds its tensor through
:func:`megatron.plugin.layers.memory.keep`, so the active
:class:`~megatron.plugin.layers.memory.SavedTensorMeter` counts it like any saved tensor.

Offload (``OFFLOAD`` of a unit, ratio ``alpha``). The unit of transfer is a *storage*: the saved
tensors that share one (views of one GEMM output) move together and come back as views of one
new storage, so a reload is bit for bit and keeps their sharing. Two levels: a storage in the
``resident`` set the caller passes (the executor's offloading passes the K/V store's entries --
read by every later slice, which with Megatron's fused QKV projection is the whole QKV output --
and the unit's own input and output, held by the executor anyway) stays on the device; the
others are *offloadable*.
Choice, deterministic: offloadable storages largest first (ties in capture order), each taken
while the moved total stays within ``alpha x offloadable bytes``; then the smallest storage left
behind is added when that brings the total nearer to the target (so ``alpha = 1`` takes all,
``alpha = 0`` none). A greedy that also took a large storage whenever it got nearer would
overshoot when one kind of tensor (the MLP's ``4h`` activations) dominates: 56% moved for
``alpha = 0.5`` on the golden model. The whole selection is checked against the host
tier's capacity before anything is copied; a tier that cannot hold it raises
:class:`HostMemoryExhausted` and the unit is left as it was (nothing half-written; a copy that
fails midway leaves the handles untouched too, and its partial copies are dropped). Then the
handles drop their device tensors: their bytes leave the meter's count.

Reload (``RELOAD``). Each moved storage is copied back into a new device storage, the saved
views are rebuilt on it, and the handles count in the meter again. :meth:`before_backward`
makes the compute stream wait for the copies (a no-op on CPU); the backward's unpack hook hands
out the reloaded tensors, and raises when a tensor is still on the host (the schedule lacks a
``RELOAD``). :meth:`release` forgets the unit after its backward.

Host tiers (one interface: ``start_step``, ``check``, ``write``, ``hold``, ``read``, ``wait``,
``free``), both writing into one :class:`HostArena` a stage keeps across iterations:
:class:`HostMemory`, copies made synchronously (the CPU twin: on CPU the "device" and the host
are the same memory, but the copies live in the tier and the accounting shows device-resident
bytes falling), and :class:`PinnedHostMemory`, a pinned arena written and read on a side CUDA
stream (whether a copy overlaps a kernel is the device's business: ``scripts/trace_offload.py``
measures it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron.plugin.layers.memory import keep, storage_key

MIB = 2 ** 20


class HostMemoryExhausted(RuntimeError):
    """The host tier cannot hold what an offload asks for."""


class HostArena:
    """One host buffer for every offload of a stage, allocated once and reused every iteration
    (in pinned memory for a CUDA device): regions are carved first fit and merged when freed.

    :meth:`reserve` sizes it before an iteration (from the plan's host bytes); a region that
    does not fit is a buffer of its own for that iteration, and the next :meth:`reserve` grows
    the arena to the most bytes held at once, so a steady run allocates nothing.
    ``allocations`` counts the host buffers ever allocated (the arena's and the overflows).
    Region offsets are multiples of :data:`ALIGN` bytes."""

    ALIGN = 512

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self.buffer: torch.Tensor | None = None
        self.allocations = 0
        self._free: list[tuple[int, int]] = []  # (offset, bytes), by offset
        self._taken: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, bytes); -1: own
        self._held = 0
        self._most = 0

    @property
    def size(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reserve(self, nbytes: int) -> None:
        """Grow the buffer to ``nbytes`` or the most bytes held at once so far, whichever is
        larger, when nothing is held (a buffer in use is never replaced)."""
        wanted = _aligned(max(int(nbytes), self._most))
        if wanted > self.size and not self._taken:
            self.buffer = self._allocate(wanted)
            self._free = [(0, wanted)]

    def take(self, nbytes: int) -> torch.Tensor:
        """A free region of ``nbytes`` (``uint8``, one dimension)."""
        size = _aligned(nbytes)
        self._held += size
        self._most = max(self._most, self._held)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                self._free[i:i + 1] = [(offset + size, free - size)] if free > size else []
                region = self.buffer[offset:offset + nbytes]
                self._taken[region.data_ptr()] = (offset, size)
                return region
        region = self._allocate(nbytes)
        self._taken[region.data_ptr()] = (-1, size)
        return region

    def give(self, region: torch.Tensor) -> None:
        """Free ``region`` (from :meth:`take`)."""
        offset, size = self._taken.pop(region.data_ptr())
        self._held -= size
        if offset < 0:
            return
        self._free.append((offset, size))
        self._free.sort()
        merged = [self._free[0]]
        for start, length in self._free[1:]:
            last, last_length = merged[-1]
            if last + last_length == start:
                merged[-1] = (last, last_length + length)
            else:
                merged.append((start, length))
        self._free = merged

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // HostArena.ALIGN) * HostArena.ALIGN


class HostMemory:
    """Host tier in a :class:`HostArena` of plain memory, copied synchronously (see the module
    doc).

    ``capacity_bytes``: most bytes held at once (``None``: no limit). ``used`` and ``peak``
    are the bytes held now and at most in this iteration (since :meth:`start_step`); ``moved``
    all bytes ever written.
    """

    synchronous = True
    """A copy is done when ``write`` or ``read`` returns: SPPO's plan then replays its copies
    at their actions, not at the profile's host link (:func:`sppo_offload.batch_plan.replay`
    with ``host_gbps=math.inf``)."""

    def __init__(self, capacity_bytes: int | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"host capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self.peak = 0
        self.moved = 0
        self.arena = HostArena(pinned=False)
        self._allocations_before = 0

    def start_step(self, planned_bytes: float) -> None:
        """Before an iteration: size the arena for the plan's host bytes (at most the
        capacity) and start counting this iteration's host allocations."""
        if self.capacity is not None:
            planned_bytes = min(planned_bytes, self.capacity)
        self._allocations_before = self.allocations()
        self.arena.reserve(int(planned_bytes))
        self.peak = self.used

    def allocations(self) -> int:
        """Host buffers allocated so far: the arena's count."""
        return self.arena.allocations

    def step_allocations(self) -> int:
        """Host buffers allocated since :meth:`start_step` began (its sizing included)."""
        return self.allocations() - self._allocations_before

    def resident(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in the memory this tier offloads from: any tensor for the twin
        (the CPU stands in for the device)."""
        del tensor
        return True

    def check(self, nbytes: int, what: str) -> None:
        """Raise before anything is written when ``nbytes`` more do not fit."""
        if self.capacity is not None and self.used + nbytes > self.capacity:
            raise HostMemoryExhausted(
                f"host memory exhausted: offloading {what} needs {nbytes / MIB:.3f} MiB, "
                f"{self.used / MIB:.3f} of the {self.capacity / MIB:.3f} MiB host budget are in "
                f"use; raise the budget (--sppo-host-memory-gb) or offload less (--sppo-offload)")

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` just written."""
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.moved += nbytes

    def free(self, host: torch.Tensor) -> None:
        """Give back the region of ``host`` (from :meth:`write`)."""
        self.used -= host.numel()
        self.arena.give(host)

    def write(self, data: torch.Tensor) -> torch.Tensor:
        """A host copy of the bytes ``data`` (``uint8``, one dimension), in the arena."""
        host = self.arena.take(data.numel())
        host.copy_(data)
        return host

    def read(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
        """``(device copy of host, what to wait for before using it)``."""
        return host.to(device, copy=True), None

    def wait(self, ready: object) -> None:
        """Make the compute stream wait for a :meth:`read` (nothing to wait for here)."""
        del ready


class PinnedHostMemory(HostMemory):  # pragma: no cover - CUDA only, tested where a GPU is
    """Host tier in a pinned :class:`HostArena`, copied on a side stream of ``device``.

    Offload: the side stream waits for the compute stream (the activations are written), copies
    into the arena, and the device block is marked in use by the side stream
    (``record_stream``) so the caching allocator reuses it only once the copy is done. Reload:
    the device buffer is allocated on the side stream and filled there, and an event marks the
    copy; :meth:`wait` makes the compute stream wait for it, and the buffer is marked in use by
    the compute stream. An arena region freed after its reload is rewritten only by a later
    copy on the same side stream, so after the read. ``allocations`` is CUDA's count of pinned
    host allocations (``torch.cuda.host_memory_stats``), the process's all.
    """

    synchronous = False

    def __init__(self, device: torch.device, capacity_bytes: int | None = None):
        super().__init__(capacity_bytes)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.arena = HostArena(pinned=True)

    def allocations(self) -> int:
        return torch.cuda.host_memory_stats().get("num_host_alloc", 0)

    def resident(self, tensor: torch.Tensor) -> bool:
        """Device tensors only: what a layer saves on the host stays where it is."""
        return tensor.device.type == "cuda"

    def write(self, data: torch.Tensor) -> torch.Tensor:
        host = self.arena.take(data.numel())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(data, non_blocking=True)
        data.record_stream(self.stream)
        return host

    def read(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = torch.empty(host.numel(), dtype=torch.uint8, device=device)
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, (event, out)

    def wait(self, ready: object) -> None:
        if ready is not None:
            event, out = ready
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            out.record_stream(compute)


def host_tier(device: torch.device, capacity_bytes: int | None = None) -> HostMemory:
    """The host tier for ``device``: a pinned arena and a side stream on CUDA, else the twin."""
    if torch.device(device).type == "cuda":
        return PinnedHostMemory(device, capacity_bytes)
    return HostMemory(capacity_bytes)


class SavedHandle:
    """What autograd keeps for one saved tensor of an offloadable unit."""

    __slots__ = ("held", "label")

    def __init__(self, tensor: torch.Tensor, label: str):
        self.held = keep(tensor)
        self.label = label

    @property
    def tensor(self) -> torch.Tensor | None:
        """The tensor on the device, ``None`` while it is on the host."""
        return None if self.held is None else self.held.tensor

    def get(self) -> torch.Tensor:
        if self.held is None:
            raise RuntimeError(f"a saved activation of {self.label} is in host memory at its "
                               f"backward: the schedule has no RELOAD of it before the backward")
        return self.held.tensor


@dataclass
class _Moved:
    """One storage in the host tier and the saved views to rebuild on it."""

    host: torch.Tensor
    views: list[tuple[SavedHandle, torch.dtype, int, tuple, tuple]]
    device: torch.device


@dataclass
class _Unit:
    handles: list[SavedHandle] = field(default_factory=list)
    moved: list[_Moved] = field(default_factory=list)
    waiting: list[object] = field(default_factory=list)


@dataclass(frozen=True)
class OffloadRecord:
    """What one ``OFFLOAD`` did: the unit, its ratio, its offloadable and moved bytes."""

    unit: tuple
    ratio: float
    offloadable: int
    moved: int


class ActivationOffloader:
    """Saved activations of the offloaded units of one stage (see the module doc).

    ``ratio(unit)`` is the fraction of a unit's offloadable bytes its ``OFFLOAD`` moves.
    ``records`` lists what every offload did, in order.
    """

    def __init__(self, tier: HostMemory, ratio: Callable[[int], float]):
        self.tier = tier
        self.ratio = ratio
        self.records: list[OffloadRecord] = []
        self._units: dict[tuple, _Unit] = {}

    @contextlib.contextmanager
    def capture(self, key: tuple):
        """Hand autograd a :class:`SavedHandle` for what the forward of unit ``key`` saves."""
        if key in self._units:
            raise RuntimeError(f"unit {key}: its saved activations are captured already (a "
                               f"second forward before its backward)")
        unit = self._units[key] = _Unit()
        label = f"unit {key[0]}" + (f" part {key[1]}" if key[1] else "")

        def pack(tensor):
            if tensor.is_leaf and tensor.requires_grad:
                return tensor
            handle = SavedHandle(tensor, label)
            unit.handles.append(handle)
            return handle

        def unpack(saved):
            return saved if isinstance(saved, torch.Tensor) else saved.get()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def offload(self, key: tuple, resident: set) -> OffloadRecord:
        """Move the ratio's share of unit ``key``'s offloadable storages to the host tier;
        storages whose :func:`~megatron.plugin.layers.memory.storage_key` is in ``resident``
        stay."""
        unit = self._unit(key, "OFFLOAD")
        if unit.moved:
            raise RuntimeError(f"unit {key}: offloaded twice without a reload")
        storages: dict[object, list[SavedHandle]] = {}
        state = set()
        for handle in unit.handles:
            tensor = handle.tensor
            if (tensor is not None and tensor.layout is torch.strided
                    and self.tier.resident(tensor)):
                storages.setdefault(storage_key(tensor), []).append(handle)
                if _is_model_state(tensor):
                    state.add(storage_key(tensor))
        sizes = {k: hs[0].tensor.untyped_storage().nbytes() for k, hs in storages.items()
                 if k not in resident and k not in state}
        offloadable = sum(sizes.values())
        target = self.ratio(key[0]) * offloadable
        chosen, moved, skipped = [], 0, []
        for k in sorted(sizes, key=lambda k: -sizes[k]):  # stable: capture order breaks ties
            if sizes[k] and moved + sizes[k] <= target:
                chosen.append(k)
                moved += sizes[k]
            elif sizes[k]:
                skipped.append(k)
        if skipped and moved + sizes[skipped[-1]] - target < target - moved:
            chosen.append(skipped[-1])
            moved += sizes[skipped[-1]]
        self.tier.check(moved, f"unit {key}")
        copies = [self.tier.write(_as_bytes(storages[k][0].tensor)) for k in chosen]
        self.tier.hold(moved)
        for k, host in zip(chosen, copies):
            views = [(h, h.tensor.dtype, h.tensor.storage_offset(), tuple(h.tensor.size()),
                      h.tensor.stride()) for h in storages[k]]
            unit.moved.append(_Moved(host, views, storages[k][0].tensor.device))
        for k in chosen:
            for handle in storages[k]:
                handle.held = None
        record = OffloadRecord(key, self.ratio(key[0]), offloadable, moved)
        self.records.append(record)
        return record

    def reload(self, key: tuple) -> None:
        """Copy unit ``key``'s offloaded storages back to the device."""
        unit = self._unit(key, "RELOAD")
        for moved in unit.moved:
            data, ready = self.tier.read(moved.host, moved.device)
            unit.waiting.append(ready)
            storage = data.untyped_storage()
            for handle, dtype, offset, size, stride in moved.views:
                view = torch.empty(0, dtype=dtype, device=moved.device)
                handle.held = keep(view.set_(storage, offset, size, stride))
            self.tier.free(moved.host)
        unit.moved = []

    def before_backward(self, key: tuple) -> None:
        """Order the backward of unit ``key`` after its reload's copies."""
        unit = self._units.get(key)
        if unit is not None:
            for ready in unit.waiting:
                self.tier.wait(ready)
            unit.waiting = []

    def release(self, key: tuple) -> None:
        """Forget unit ``key`` after its backward."""
        unit = self._units.pop(key, None)
        if unit is not None and unit.moved:
            for moved in unit.moved:
                self.tier.free(moved.host)
            raise RuntimeError(f"unit {key}: its backward ran with activations still in host "
                               f"memory (no RELOAD)")

    def check_empty(self, where: str) -> None:
        """Raise when a captured unit was never released (a backward is missing)."""
        if self._units:
            raise RuntimeError(f"{where}: saved activations of units {sorted(self._units)} were "
                               f"captured for offloading and never released by a backward")

    def _unit(self, key: tuple, what: str) -> _Unit:
        unit = self._units.get(key)
        if unit is None:
            raise RuntimeError(f"{what} of unit {key}: its forward did not capture its saved "
                               f"activations (the schedule's forward is missing or later)")
        return unit


def _is_model_state(tensor: torch.Tensor) -> bool:
    """A view of a leaf that requires grad (a transposed weight a GEMM saved)."""
    return tensor._base is not None and tensor._base.is_leaf and tensor._base.requires_grad


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``tensor`` as a one-dimensional ``uint8`` tensor."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
