"""Megatron-LM's checks of each micro-batch's local loss, as ``pretrain_gpt.py`` makes them.

``--check-for-nan-in-loss-and-grad`` (on by default): a NaN or an Inf loss is fatal;
``--check-for-spiky-loss``: a loss more than :data:`SPIKY_LOSS_FACTOR` times the largest seen
so far is reported (not fatal). Both go through Megatron's rerun state machine, so
``--rerun-mode`` keeps its meaning: ``disabled`` raises at once, naming the rank and iteration;
``validate_results`` (the default) reruns the iteration to tell a transient fault from a
reproducible one, and, like Megatron, does not validate the first iteration. The gradient half
of ``--check-for-nan-in-loss-and-grad`` is Megatron's DDP, which every schedule's gradients
go through. Outside Megatron's train step (no parsed arguments, or a loss computed by hand, as
``scripts/profile_costs.py`` does) nothing is checked.

Inside :func:`once_per_step` (every schedule's call, :mod:`megatron.plugin.registry`) a
unit's loss is only recorded, on its device; the step's losses come to the host together once
this rank's forwards are done and before its gradients are checked (one read back instead of
one per check of each unit) and are checked there in the order of their units, each as
Megatron checks a micro-batch's: the same validation calls in the same sequence, so the rerun
state machine compares a rerun's results call by call as before, and an error names the rank
and the iteration as Megatron's does. With ``--overlap-grad-reduce`` that read back comes
right before the rank's last backward.
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
from megatron.core.rerun_state_machine import RerunMode, RerunState, get_rerun_state_machine
from megatron.training import get_args

SPIKY_LOSS_FACTOR = 10
"""Megatron-LM's: a spiky loss is ten times the largest loss observed."""


def _megatron_args():
    try:
        return get_args()
    except AssertionError:  # no Megatron run in this process
        return None


_PENDING: list[torch.Tensor] | None = None
"""The losses recorded in the step :func:`once_per_step` is collecting (``None``: none)."""


@contextlib.contextmanager
def once_per_step(config):
    """Collect the losses :func:`validate_loss` gets while active and check them after one
    copy of all of them to the host, before anything of the step's gradients is checked: in
    Megatron's 1F1B every loss is checked before Megatron DDP checks the gradients for NaN
    (when the last backward's buckets start their reduction, or in ``finalize_model_grads``),
    so ``config``'s ``no_sync_func`` (on leaving it: before the last backward) and
    ``finalize_model_grads_func`` check what is pending first; what is left is checked when
    the step ends (an evaluation's forwards). Nothing is checked when the step raised."""
    global _PENDING
    outer, _PENDING = _PENDING, []
    saved = config.no_sync_func, config.finalize_model_grads_func
    config.no_sync_func = _each(config.no_sync_func, _checking_on_exit)
    config.finalize_model_grads_func = _each(config.finalize_model_grads_func, _checking_first)
    try:
        yield
        _check_pending()
    finally:
        _PENDING = outer
        config.no_sync_func, config.finalize_model_grads_func = saved


def _each(funcs, wrap):
    if funcs is None:
        return None
    return [wrap(func) for func in funcs] if isinstance(funcs, list) else wrap(funcs)


def _checking_on_exit(no_sync_func):
    @contextlib.contextmanager
    def no_sync():
        with no_sync_func():
            yield
            _check_pending()
    return no_sync


def _checking_first(finalize):
    def finalize_model_grads(*args, **kwargs):
        _check_pending()
        return finalize(*args, **kwargs)
    return finalize_model_grads


def _check_pending() -> None:
    """Check the recorded losses in their order, after one copy to the host, and forget
    them."""
    if _PENDING:
        pending = torch.stack(_PENDING)
        _PENDING.clear()
        for loss_sum in pending.cpu():
            _check(loss_sum)


def validate_loss(loss_sum: torch.Tensor) -> None:
    """Megatron's NaN, Inf and spiky-loss checks of this rank's loss of one micro-batch (or
    of one unit of a document schedule): recorded for the end of the step inside
    :func:`once_per_step`, made at once outside it."""
    if _PENDING is not None:
        _PENDING.append(loss_sum.detach())
        return
    _check(loss_sum)


def _check(loss_sum: torch.Tensor) -> None:
    args = _megatron_args()
    if args is None:
        return
    machine = get_rerun_state_machine()
    if machine.get_mode() != RerunMode.DISABLED and machine.state == RerunState.NOT_RUNNING_YET:
        # Outside Megatron's train step (a profile, a reference computed by hand): the
        # machine validates only inside one, where every training loss is computed;
        # Megatron's evaluation disables it, which validates anywhere.
        return
    if args.check_for_nan_in_loss_and_grad:
        # Forward computations are deterministic: no tolerance.
        machine.validate_result(result=loss_sum, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        machine.validate_result(result=loss_sum, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss_sum,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
