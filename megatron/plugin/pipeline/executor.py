"""The one interpreter of schedule IR on real ranks, honouring Megatron's forward-backward contract.

:func:`run_schedule` executes one rank's action list: a dispatch loop that posts each run of
transfers as one batch and hands every other action to the handler of its kind
(:data:`HANDLERS`: a new kind of action is a new entry), or to the schedule's part program for
an action with a part; :class:`StageRun` keeps the bookkeeping between them.

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
  (``deallocate_pipeline_outputs``) once sent, as in Megatron. With ``forward_only`` the
  gradient transfers and backwards are skipped.
* Gradient synchronisation: ``no_sync_func`` is entered at the start; it is left just before
  this rank's last backward (Megatron's rule, including "only rank 0 when a
  ``grad_sync_func`` exists"), then ``grad_sync_func`` and ``finalize_model_grads_func`` run.

Document chunks (``StageContext.chunks``, the elastic and SPPO schedules): forwards record and
read K/V context in a :class:`~megatron.plugin.layers.kv_store.KVStore` (``forward_step_func`` gets
``kv_store=`` and ``record_kv=True``); a forward checkpoints the leading layers the plan gives
for (stage, unit) (:mod:`~megatron.plugin.pipeline.layer_checkpoint`); ``RECOMPUTE`` rebuilds
them; a backward is one multi-root autograd call over the stage output and the unit's own K/V
(with the dK/dV later slices accumulated), split in two at the checkpoint boundary, after which
the unit's K/V are released. The store must be empty when the schedule ends.

Offloading (``StageContext.offload``, an
:class:`~megatron.plugin.pipeline.offload.ActivationOffloader`): the forward of every unit
with an ``OFFLOAD`` in this rank's list runs under its capture hooks; ``OFFLOAD`` moves the
unit's share of saved activations to the host tier, leaving on the device the storages of the
K/V store and the unit's input and output; ``RELOAD`` brings them back, and the backward waits
for the copies first. Nothing may stay captured when the schedule ends. With ``forward_only``
the memory actions are skipped (nothing is saved).

Data order: every rank calls ``forward_step_func`` once per forward, so each rank's forwards
must consume the data iterator in unit order (the validated schedules do). Per-action wall
times (transfer batches under category ``comm``, with each transfer's bytes) are recorded as
:class:`~megatron.plugin.pipeline.chrome_trace.TraceEvent` for the same Chrome trace the simulator
writes.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch.autograd import Variable
from megatron.core.pipeline_parallel import schedules as megatron_schedules

from megatron.plugin.layers.memory import storage_key
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.stage_context import ChunkState, StageContext
from megatron.plugin.pipeline.stage_run import StageRun


def run_backward(tensors: list, grads: list) -> None:
    """One autograd call from several roots (outputs may be pseudo-deallocated, as in
    Megatron's ``custom_backward``)."""
    Variable._execution_engine.run_backward(
        tensors=tuple(tensors), grad_tensors=tuple(grads), keep_graph=False,
        create_graph=False, inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


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


def chunk_backward(chunks: ChunkState, unit: int, input_tensor, output, output_grad, stash,
                   config):
    """Backward of one document chunk on one stage; returns the input's gradient.

    Megatron's ``backward_step`` plus the unit's K/V as extra roots: first from the output (the
    loss scaled by ``grad_scale_func`` on the last stage) and the K/V of layers the forward ran
    with autograd, down to the input or the checkpoint boundary; then, when layers were
    checkpointed, from the recomputed boundary and those layers' K/V down to the input.
    """
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_grad is None:
        if config.grad_scale_func is not None:
            output = config.grad_scale_func(output)
        output_grad = torch.ones_like(output)
    store, slices = chunks.kv_store, chunks.slices(unit)

    def targets(layers):
        tensors, grads = [], []
        for doc_key, index in slices:
            more, more_grads = store.backward_targets(doc_key, index, layers)
            tensors += more
            grads += more_grads
        return tensors, grads

    tensors, grads = targets(set(chunks.layers.graph_layers(stash)))
    run_backward([output, *tensors], [output_grad, *grads])
    if stash is not None:
        if stash.recomputed is None:
            raise RuntimeError(f"unit {unit}: checkpointed layers were not recomputed before "
                               f"the backward (missing RECOMPUTE action)")
        tensors, grads = targets(set(chunks.layers.checkpointed_layers(stash)))
        run_backward([stash.recomputed, *tensors], [stash.boundary.grad, *grads])
    for doc_key, index in slices:
        store.release(doc_key, index)
    return input_tensor.grad if input_tensor is not None else None


Handler = Callable[[StageRun, int, Action], "float | None"]
"""Runs one compute or memory action of this rank (``index`` in its list); returns the time its
work started when it first waited for something (traced apart), else ``None``."""


def _transfers(run: StageRun, index: int) -> int:
    """Post the run of transfers starting at ``index`` as one batch (eagerly for a part
    program with ``eager_sends``); returns the index after it."""
    start = time.perf_counter()
    stop = run.batches[index]
    batch = [a for a in run.actions[index:stop]
             if run.training or a.kind in (Kind.SEND_F, Kind.RECV_F)]
    sends = [(a, (run.mailbox if run.claimed(a) else run.to_send).pop(run.route(a)))
             for a in batch if a.is_send()]
    recvs = [(a, torch.empty(run.ctx.shape_of(a), dtype=run.dtype, device=run.device))
             for a in batch if a.is_recv()]
    if run.eager:
        # One post per link (p2p): a receive is waited for with its link's batch, never with a
        # send of this rank (its peer may be waiting for this rank).
        run.in_flight = [p for p in run.in_flight if not p.done()]
        for posted in run.channel.post(sends, recvs):
            if posted.actions[0].is_recv():
                for a in posted.actions:
                    run.arriving[run.route(a)] = posted
            else:
                run.in_flight.append(posted)
    else:
        run.channel.exchange(sends, recvs)
    for a, buffer in recvs:
        (run.mailbox if run.claimed(a) else run.received)[run.route(a)] = buffer
    if run.training:
        _deallocate_sent([(a, t) for a, t in sends if not run.claimed(a)], run.config)
    end = time.perf_counter()
    for a, tensor in sends + recvs:
        run.trace(str(a), start, end, "comm", tensor.numel() * tensor.element_size())
    return stop


def _part(run: StageRun, index: int, action: Action) -> float | None:
    """A compute action of the part program: its tensors from the mailbox (waiting for those
    still arriving), its products back into it."""
    program = run.ctx.program
    if action.kind is Kind.RECOMPUTE:
        if run.training:
            program.recompute(action)
        return None
    if not (run.training or action.kind in (Kind.FORWARD, Kind.ATTN_F)):
        return None
    run.before_backward(index)
    mine = [k for k in run.mailbox if k[:3] == (action.kind, action.unit, action.part)]
    waits = {run.arriving.pop(k) for k in mine if k in run.arriving}
    started = None
    if waits:
        start = time.perf_counter()
        for posted in waits:
            posted.wait()
        started = time.perf_counter()
        run.trace(f"wait for {action}", start, started, "comm")
    given = {k[3]: run.mailbox.pop(k) for k in mine}
    compute = program.forward if action.kind in (Kind.FORWARD, Kind.ATTN_F) \
        else program.backward
    made, num_tokens = compute(action, given)
    run.total_tokens += num_tokens
    for kind, part, name, tensor in made:
        run.mailbox[(kind, action.unit, part, name)] = tensor
    return started


def _forward(run: StageRun, index: int, action: Action) -> None:
    """Megatron's ``forward_step`` on this stage (checkpointing the plan's leading layers and
    capturing saved tensors for an ``OFFLOAD`` where the schedule has them)."""
    ctx, key = run.ctx, (action.unit, action.part)
    chunks = ctx.chunks
    input_tensor = run.received.pop((Kind.RECV_F, *key), None)
    if input_tensor is not None:
        input_tensor.requires_grad_(run.training)
    count = chunks.checkpointed(action.unit) if chunks is not None and run.training else 0
    with chunks.layers.armed(count) if count else contextlib.nullcontext(), \
            ctx.offload.capture(key) if key in run.captured else contextlib.nullcontext():
        output, num_tokens = megatron_schedules.forward_step(
            run.step_func, ctx.data_iterator, run.model, ctx.num_microbatches, input_tensor,
            run.forward_data_store, run.config, cp_group_size=ctx.pg_collection.cp.size(),
            collect_non_loss_data=ctx.collect_non_loss_data,
            is_first_microbatch=megatron_schedules.check_first_val_step(
                ctx.first_val_step, ctx.forward_only, run.forwards_done == 0),
            current_microbatch=action.unit, is_last_stage=ctx.is_last_stage)
    if count:
        run.stashes[key] = chunks.layers.take()
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
    """Megatron's ``backward_step``, or a document chunk's (with its K/V as extra roots)."""
    if not run.training:
        return
    ctx, key = run.ctx, (action.unit, action.part)
    run.before_backward(index)
    output_grad = run.received.pop((Kind.RECV_B, *key), None)
    if key in run.captured:
        ctx.offload.before_backward(key)
    if ctx.chunks is None:
        input_grad = megatron_schedules.backward_step(
            run.inputs.pop(key), run.outputs.pop(key), output_grad, run.config)
    else:
        input_grad = chunk_backward(ctx.chunks, action.unit, run.inputs.pop(key),
                                    run.outputs.pop(key), output_grad,
                                    run.stashes.pop(key, None), run.config)
    if key in run.captured:
        ctx.offload.release(key)
    if not ctx.is_first_stage:
        run.to_send[(Kind.SEND_B, *key)] = input_grad


def _recompute(run: StageRun, index: int, action: Action) -> None:
    """Rebuild the checkpointed leading layers of a chunk before its backward."""
    if not run.training:
        return
    stash = run.stashes.get((action.unit, action.part))
    if stash is None:
        raise RuntimeError(f"{action}: the forward of unit {action.unit} checkpointed no "
                           f"layer on this stage")
    run.ctx.chunks.layers.recompute(stash)


def _offload(run: StageRun, index: int, action: Action) -> None:
    """Move the unit's share of saved activations to the host tier, keeping on the device
    what others still read (its input and output, the K/V store)."""
    if not run.training:
        return
    key = (action.unit, action.part)
    resident = {storage_key(t) for t in (run.inputs.get(key), run.outputs.get(key))
                if t is not None}
    if run.ctx.chunks is not None:
        resident |= run.ctx.chunks.kv_store.storage_keys()
    run.ctx.offload.offload(key, resident)


def _reload(run: StageRun, index: int, action: Action) -> None:
    if run.training:
        run.ctx.offload.reload((action.unit, action.part))


def _weight(run: StageRun, index: int, action: Action) -> None:
    raise ValueError(
        f"{action}: weight-gradient passes (W, the zero-bubble ZB1P baseline) are simulated "
        f"only; the executor runs a backward as one pass (B computes the weight gradients too)")


#: The handler of each action kind the executor runs itself (a part program runs the actions
#: that have a part).
HANDLERS: dict[Kind, Handler] = {
    Kind.FORWARD: _forward, Kind.BACKWARD: _backward, Kind.RECOMPUTE: _recompute,
    Kind.OFFLOAD: _offload, Kind.RELOAD: _reload, Kind.WEIGHT: _weight,
}


def run_schedule(actions: list[Action], ctx: StageContext) -> list:
    """Execute ``actions`` (this rank's list); returns Megatron's ``forward_data_store``."""
    run = StageRun(actions, ctx)
    index = 0
    while index < len(actions):
        action = actions[index]
        if action.is_communication():
            index = _transfers(run, index)
            continue
        handler = _part if run.claimed(action) else HANDLERS.get(action.kind)
        if handler is None:
            raise ValueError(
                f"{action}: the executor runs forward, backward and their transfers; "
                f"{action.kind.name} actions come with the schedules that use them")
        if ctx.device_times:
            _wait_for_device()
        start = time.perf_counter()
        start = handler(run, index, action) or start
        if ctx.device_times:
            _wait_for_device()
        run.trace(str(action), start, time.perf_counter())
        index += 1
    return run.finish()
