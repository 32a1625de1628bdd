"""Resuming megatron-core's distributed optimizer from a ``torch_dist`` checkpoint with fp32
parameters and PyTorch's Adam (no Apex, no Transformer Engine): two spots of megatron-core
0.17 to 0.19 that stop it, each mended by a wrapper of a ``DistributedOptimizer`` method.

megatron-core falls back to PyTorch's ``Adam`` / ``AdamW`` when neither Apex nor Transformer
Engine is installed (always the case on a CPU). Its ``DistributedOptimizer`` builds the state
dict that a ``torch_dist`` checkpoint is loaded into from its own ``state_dict()``, which, with
PyTorch's optimizer, reads the step count off every parameter's state and asserts that it finds
exactly one. Megatron-LM's loader runs before the first step, when PyTorch's optimizer has no
state yet, so every resume stopped there. (Apex's and Transformer Engine's Adam keep the step in
their parameter groups; that path is unchanged.)

Choice: ``DistributedOptimizer.sharded_state_dict`` is wrapped: when it builds the state dict to
load into, with PyTorch's Adam or AdamW and no state yet, every parameter shard gets the state
PyTorch's optimizer creates at its first step (step 0, zero moments); the checkpoint's values
then replace it in place, and Megatron's ``load_state_dict`` sets the step from the checkpoint.
The parameters are not touched (megatron-core's own dummy step with zero gradients, used for
Megatron-FSDP, would apply weight decay to them).

Second, in ``load_state_dict``: with fp32 parameters the distributed optimizer's main
parameters are views of the model's parameters (leaves that require gradients), and it copies
the checkpoint's values into them outside ``torch.no_grad()``, which autograd refuses (with fp16
or bf16 parameters they are separate fp32 copies); and with PyTorch's optimizer it hands every
parameter's state one and the same ``step`` tensor (which PyTorch's Adam would increment in
place once per parameter in every step), then copies every tensor of the state dict built
above into the states, the step too, which the checkpoint's parameter state does not carry
(it is 0 there): the bias corrections after a resume would be those of a first step. Choice:
``load_state_dict`` runs under ``torch.no_grad()`` (loading a state is no differentiable
computation), and afterwards each parameter's state gets its own step tensor holding the step
of its parameter group, which megatron-core has set from the checkpoint.

Installed once, by :func:`install`.
"""
from __future__ import annotations

import functools

import torch

_INSTALLED: list = []


def install() -> None:
    """Wrap ``DistributedOptimizer.sharded_state_dict`` and ``load_state_dict`` (idempotent)."""
    if _INSTALLED:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           *args, **kwargs):
        if is_loading:
            fresh_state(self.optimizer)
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    load = DistributedOptimizer.load_state_dict

    @functools.wraps(load)
    def load_state_dict(self, state_dict):
        with torch.no_grad():
            load(self, state_dict)
        steps_of_the_groups(self.optimizer)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer.load_state_dict = load_state_dict
    _INSTALLED.append(original)


def fresh_state(optimizer) -> None:
    """Give every parameter of a PyTorch ``Adam`` / ``AdamW`` without state the state that
    optimizer creates at its first step; any other optimizer, or one with state, is left
    alone."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("fused"):
            raise ValueError("resuming PyTorch's Adam with amsgrad, capturable or fused state "
                             "is not supported: install Apex or Transformer Engine")
        for param in group["params"]:
            optimizer.state[param] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


def steps_of_the_groups(optimizer) -> None:
    """Give each parameter's state of a PyTorch ``Adam`` / ``AdamW`` a step tensor of its own
    holding its parameter group's ``step``."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" in group:
                state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
