"""The one interpreter of schedule IR on real ranks, honouring Megatron's forward-backward contract.

:func:`run_schedule` executes one rank's action list: a dispatch loop that posts each run of
transfers as one batch and hands every other action to the first extension with a handler for
it, else to the executor's handler of its kind (:data:`HANDLERS`); :class:`StageRun` keeps the
bookkeeping between them.

* ``FORWARD``/``BACKWARD`` call megatron-core's own ``forward_step`` / ``backward_step`` (the
  functions Megatron's 1F1B calls), so loss dicts, per-token loss (``num_tokens`` summed into the
  global count handed to ``finalize_model_grads_func``), ``grad_scale_func`` and
  ``deallocate_pipeline_outputs`` behave exactly as in Megatron's loop.
* ``W`` (weight gradients split from the backward: the ZB1P baseline) is simulated only; its
  handler refuses it (``ValueError``).
* ``SEND_*``/``RECV_*``: each run of consecutive transfers is one batch posted and waited for
  together through :class:`~megatron.plugin.pipeline.p2p.PeerChannel` (with a timeout), the
  simulator's model of a step; receive buffers take their shapes from ``shape_of(action)``
  (the plan), never from a runtime shape exchange. Activations are pseudo-deallocated
  (``deallocate_pipeline_outputs``) once sent, as in Megatron (not the tensors of transfers an
  extension claims). With ``forward_only`` the
  gradient transfers and backwards are skipped.
* Gradient synchronisation (:mod:`~megatron.plugin.pipeline.grad_sync`): ``no_sync_func`` is
  entered at the start; it is left just before this rank's last backward (Megatron's rule,
  including "only rank 0 when a ``grad_sync_func`` exists"), so with
  ``--overlap-grad-reduce`` the buckets' reductions start from Megatron DDP's hooks during that
  backward; then ``grad_sync_func`` and ``finalize_model_grads_func`` run.

Extensions (``StageContext.extensions``, :mod:`~megatron.plugin.pipeline.extension`): what a
schedule adds -- document chunks (:mod:`~megatron.plugin.pipeline.chunks`), activation
offloading (:mod:`~megatron.plugin.pipeline.offloading`), part programs
(:mod:`~megatron.plugin.pipeline.parts`) -- comes through their hooks: the handlers of the action
kinds they own (``RECOMPUTE``, ``OFFLOAD``, ``RELOAD``) or of the actions they claim, the
keyword arguments of ``forward_step_func``, contexts around a forward and a backward, a unit's
backward in place of Megatron's, the tensors of the transfers they claim and the checks at the
end.

Data order: every rank calls ``forward_step_func`` once per forward, so each rank's forwards
must consume the data iterator in unit order (the validated schedules do). Per-action wall
times (transfer batches under category ``comm``, with each transfer's bytes) are recorded as
:class:`~megatron.plugin.pipeline.chrome_trace.TraceEvent` for the same Chrome trace the simulator
writes.
"""
from __future__ import annotations

import contextlib
import time

import torch
from megatron.core.pipeline_parallel import schedules as megatron_schedules

from megatron.plugin.pipeline.extension import Handler
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.stage_context import StageContext
from megatron.plugin.pipeline.stage_run import StageRun


def _wait_for_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _deallocate_sent(sends: list, config) -> None:
    """Pseudo-deallocate the stage outputs just sent (Megatron's
    ``deallocate_pipeline_outputs``); a checkpoint boundary that is the stage output is a
    leaf and keeps its data."""
    for action, tensor in sends:
        if action.kind is Kind.SEND_F and tensor.grad_fn is not None:
            megatron_schedules.deallocate_output_tensor(tensor,
                                                        config.deallocate_pipeline_outputs)


def _transfers(run: StageRun, index: int) -> int:
    """Post the run of transfers starting at ``index`` as one batch (or hand it to the
    extension that posts it); returns the index after it."""
    start = time.perf_counter()
    stop = run.batches[index]
    batch = [a for a in run.actions[index:stop]
             if run.training or a.kind in (Kind.SEND_F, Kind.RECV_F)]
    sends = [(a, run.outgoing(a)) for a in batch if a.is_send()]
    recvs = [(a, torch.empty(run.ctx.shape_of(a), dtype=run.dtype, device=run.device))
             for a in batch if a.is_recv()]
    if not any(ext.post(run, sends, recvs) for ext in run.extensions):
        run.channel.exchange(sends, recvs)
    for a, buffer in recvs:
        run.incoming(a, buffer)
    if run.training:
        _deallocate_sent([(a, t) for a, t in sends if run.owner(a) is None], run.config)
    end = time.perf_counter()
    for a, tensor in sends + recvs:
        run.trace(str(a), start, end, "comm", tensor.numel() * tensor.element_size())
    return stop


def _forward(run: StageRun, index: int, action: Action) -> None:
    """Megatron's ``forward_step`` on this stage, inside every extension's forward context."""
    ctx, key = run.ctx, (action.unit, action.part)
    input_tensor = run.received.pop((Kind.RECV_F, *key), None)
    if input_tensor is not None:
        input_tensor.requires_grad_(run.training)
    with contextlib.ExitStack() as hooks:
        for ext in run.extensions:
            hooks.enter_context(ext.forward(run, action))
        output, num_tokens = megatron_schedules.forward_step(
            run.step_func, ctx.data_iterator, run.model, ctx.num_microbatches, input_tensor,
            run.forward_data_store, run.config, cp_group_size=ctx.pg_collection.cp.size(),
            collect_non_loss_data=ctx.collect_non_loss_data,
            is_first_microbatch=megatron_schedules.check_first_val_step(
                ctx.first_val_step, ctx.forward_only, run.forwards_done == 0),
            current_microbatch=action.unit, is_last_stage=ctx.is_last_stage)
    run.forwards_done += 1
    run.total_tokens += num_tokens
    if not ctx.is_last_stage:
        run.to_send[(Kind.SEND_F, *key)] = output
    if run.training:
        run.inputs[key] = input_tensor
        run.outputs[key] = output
    # Returning drops this frame's references: a name left bound to the last forward's output
    # would keep its graph's nodes -- and through them the K/V context leaves of every earlier
    # slice, with their gradients -- alive through all the backwards.


def _backward(run: StageRun, index: int, action: Action) -> None:
    """The unit's backward (Megatron's ``backward_step`` or an extension's), inside every
    extension's backward context."""
    if not run.training:
        return
    key = (action.unit, action.part)
    run.before_backward(index)
    output_grad = run.received.pop((Kind.RECV_B, *key), None)
    with contextlib.ExitStack() as hooks:
        for ext in run.extensions:
            hooks.enter_context(ext.backward(run, action))
        input_grad = run.unit_backward(run, action, run.inputs.pop(key), run.outputs.pop(key),
                                       output_grad)
    if not run.ctx.is_first_stage:
        run.to_send[(Kind.SEND_B, *key)] = input_grad


def _weight(run: StageRun, index: int, action: Action) -> None:
    raise ValueError(
        f"{action}: weight-gradient passes (W, the zero-bubble ZB1P baseline) are simulated "
        f"only; the executor runs a backward as one pass (B computes the weight gradients too)")


#: The handler of each action kind the executor runs itself (extensions run the others).
HANDLERS: dict[Kind, Handler] = {
    Kind.FORWARD: _forward, Kind.BACKWARD: _backward, Kind.WEIGHT: _weight,
}


def _handler(run: StageRun, action: Action) -> Handler:
    """The first extension's handler of ``action``, else the executor's own."""
    for ext in run.extensions:
        handler = ext.handler(action)
        if handler is not None:
            return handler
    handler = HANDLERS.get(action.kind)
    if handler is None:
        raise ValueError(
            f"{action}: the executor runs forward, backward and their transfers; "
            f"{action.kind.name} actions come with the schedules that use them")
    return handler


def run_schedule(actions: list[Action], ctx: StageContext) -> list:
    """Execute ``actions`` (this rank's list); returns Megatron's ``forward_data_store``."""
    run = StageRun(actions, ctx)
    index = 0
    while index < len(actions):
        action = actions[index]
        if action.is_communication():
            index = _transfers(run, index)
            continue
        handler = _handler(run, action)
        if ctx.device_times:
            _wait_for_device()
        start = time.perf_counter()
        start = handler(run, index, action) or start
        if ctx.device_times:
            _wait_for_device()
        run.trace(str(action), start, time.perf_counter())
        index += 1
    return run.finish()
