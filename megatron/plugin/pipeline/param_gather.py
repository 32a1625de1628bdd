"""Megatron's overlapped parameter all-gather where a schedule reads parameters outside their
modules' forwards.

With the distributed optimizer and ``--overlap-param-gather``, each rank's step updates its
shard of every bucket; the other shards arrive by an all-gather that Megatron's DDP waits for
in a forward pre-hook on each module holding parameters, right before that module's forward
(the hook also dispatches the next bucket group's all-gather). A schedule that hands a module's
weights to another rank before the module's own forward runs (helix ships the QKV projection's
and the Q/K norms' weights to the attention stage; SPPO's multiplexed owner broadcasts a
block's parameters to its helpers) runs those hooks first, or the receivers would compute with
the previous step's values of the shards this rank did not update.
"""
from __future__ import annotations

from typing import Iterable

import torch


def wait_for_parameters(modules: Iterable[torch.nn.Module]) -> None:
    """Run the forward pre-hooks of each of ``modules`` that holds parameters of its own, as
    its forward would before reading them (a no-op where no hook is registered: without
    ``--overlap-param-gather``, or while Megatron has the hooks disabled)."""
    for module in modules:
        if next(module.parameters(recurse=False), None) is None:
            continue
        with_kwargs = module._forward_pre_hooks_with_kwargs
        for key, hook in tuple(module._forward_pre_hooks.items()):
            if key in with_kwargs:
                hook(module, (), {})
            else:
                hook(module, ())
