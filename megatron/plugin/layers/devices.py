"""Where the tensors the plugin makes for itself live.

Collectives take tensors on the backend's device: NCCL only moves CUDA tensors, gloo CPU ones
(the CPU tests exercise the same calls through gloo).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The device a tensor must be on for a collective over ``group`` (default: the world)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
