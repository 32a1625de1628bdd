"""What a schedule adds to the executor: :class:`StageExtension`, a set of hooks with no effect
by default, and the multi-root autograd call extensions and part programs build on
(:func:`run_backward`).

A schedule passes its extensions in ``StageContext.extensions``; the executor
(:mod:`~megatron.plugin.pipeline.executor`) calls every extension's hook at the same point of
every action, in list order (contexts are entered in list order and left in reverse), so the
order of operations on a rank is fixed by the schedule's list. The extensions of the project:
document chunks (:mod:`~megatron.plugin.pipeline.chunks`), activation offloading
(:mod:`~megatron.plugin.pipeline.offloading`) and part programs
(:mod:`~megatron.plugin.pipeline.parts`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

from torch.autograd import Variable

from megatron.plugin.pipeline.ir import Action

Handler = Callable[[object, int, Action], "float | None"]
"""Runs one compute or memory action of this rank: ``handler(run, index, action)`` with the
rank's :class:`~megatron.plugin.pipeline.stage_run.StageRun` and the action's index in its list;
returns the time its work started when it first waited for something (traced apart), else
``None``."""


def run_backward(tensors: list, grads: list) -> None:
    """One autograd call from several roots (outputs may be pseudo-deallocated, as in
    Megatron's ``custom_backward``)."""
    Variable._execution_engine.run_backward(
        tensors=tuple(tensors), grad_tensors=tuple(grads), keep_graph=False,
        create_graph=False, inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


class StageExtension:
    """Hooks a schedule adds to one rank's execution; every hook does nothing by default.

    ``run`` is the rank's :class:`~megatron.plugin.pipeline.stage_run.StageRun` (its stage
    inputs and outputs by ``(unit, part)``, ``training``, ``config``, ``trace``).
    """

    unit_backward: Callable | None = None
    """``unit_backward(run, action, input_tensor, output, output_grad)`` -> the input's
    gradient: the backward of a whole-stage unit in place of Megatron's ``backward_step``
    (extra roots, a split at a checkpoint boundary); at most one extension of a rank has
    one."""

    def start(self, run) -> None:
        """Check the rank's actions (``run.actions``) before anything runs."""

    def grad_sync_backwards(self, actions: list[Action]) -> set[int] | None:
        """Indices of the backwards of ``actions`` (the rank's list) to run with gradient sync
        enabled, when it is not only the rank's last backward (Megatron's rule): each must hold
        the last gradients of the step of the parameters it touches."""
        return None

    def step_kwargs(self) -> dict:
        """Keyword arguments ``forward_step_func`` gets on every forward."""
        return {}

    def handler(self, action: Action) -> Handler | None:
        """The handler of an action this extension runs (an action kind it owns, or an action
        it claims), else ``None``; the first extension with one runs the action."""
        return None

    def forward(self, run, action: Action):
        """Context around the forward of a whole-stage unit (what the forward records)."""
        return contextlib.nullcontext()

    def backward(self, run, action: Action):
        """Context around the backward of a whole-stage unit."""
        return contextlib.nullcontext()

    def claims(self, transfer: Action) -> bool:
        """Whether the tensor of ``transfer`` is this extension's (then :meth:`outgoing` gives
        a send's tensor and :meth:`incoming` takes a receive's buffer, and a sent tensor is not
        pseudo-deallocated)."""
        return False

    def outgoing(self, transfer: Action):
        """The tensor a claimed send carries (called only for transfers :meth:`claims`
        accepts: an extension that claims transfers defines it)."""
        raise TypeError(f"{type(self).__name__} claims {transfer} but gives no tensor for it")

    def incoming(self, transfer: Action, buffer) -> None:
        """Take the buffer a claimed receive filled (called only for transfers :meth:`claims`
        accepts: an extension that claims transfers defines it)."""
        raise TypeError(f"{type(self).__name__} claims {transfer} but takes no buffer for it")

    def post(self, run, sends: list, recvs: list) -> bool:
        """Post a batch of transfers itself (``True``), or leave it to the executor's one
        exchange of the batch (``False``)."""
        return False

    def finish(self, run) -> None:
        """Wait for what is in flight and check that the schedule left nothing behind."""

    def finalize(self, run) -> None:
        """Right before Megatron's ``finalize_model_grads_func`` (training only)."""
