"""Counting what hands a tensor's value to the host or copies blocking: the no-host-sync
tests' instrument (``tests/distributed/test_host_syncs.py``, ``tests/unit/test_loss_checks.py``)."""
import collections
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode

#: Tensor methods that hand a tensor's value to the host: each waits for the device.
TO_HOST = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"}
#: Tensor methods that copy between devices.
COPIES = {"to", "copy_", "cuda"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _target_device(name, args, kwargs):
    """The device a copy names (``None``: a dtype change only, or ``copy_``'s source's)."""
    if name == "cuda":
        return torch.device("cuda")
    if name == "copy_":
        return args[0].device if isinstance(args[0], torch.Tensor) else None
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _is_blocking_copy(name, args, kwargs) -> bool:
    """A copy that names a device and waits for it: not ``non_blocking`` and either between
    two devices or to the host (a copy to the host waits on CUDA whatever its source: on a
    CPU-only run the source is the host too, so the rule is by the call, not by the devices
    of this run)."""
    if name not in COPIES or kwargs.get("non_blocking") or \
            (len(args) > 2 and args[-1] is True):
        return False
    target = _target_device(name, args, kwargs)
    if target is None:
        return False
    return target.type == "cpu" or target != args[0].device


def _caller() -> str:
    """The innermost frame of this repository outside this file, as ``path:line``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path.startswith(REPO) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, REPO)}:{frame.lineno}"
    return "?"


class HostSyncCounter(TorchFunctionMode):
    """Counts, while active, each tensor-to-host conversion and blocking copy."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in TO_HOST or _is_blocking_copy(name, args, kwargs):
            self.seen[f"{name} at {_caller()}"] += 1
        return func(*args, **kwargs)
