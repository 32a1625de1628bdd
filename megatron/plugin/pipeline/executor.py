"""The one interpreter of schedule IR on real ranks, honouring Megatron's forward-backward contract.

:func:`run_schedule` executes one rank's action list:

* ``FORWARD``/``BACKWARD`` call megatron-core's own ``forward_step`` / ``backward_step`` (the
  functions Megatron's 1F1B calls), so loss dicts, per-token loss (``num_tokens`` summed into the
  global count handed to ``finalize_model_grads_func``), ``grad_scale_func`` and
  ``deallocate_pipeline_outputs`` behave exactly as in Megatron's loop.
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
read K/V context in a :class:`~megatron.plugin.kv_store.KVStore` (``forward_step_func`` gets
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
:class:`~megatron.plugin.pipeline.trace.TraceEvent` for the same Chrome trace the simulator
writes.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from torch.autograd import Variable
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.utils import get_model_config

from megatron.plugin.kv_store import KVStore
from megatron.plugin.memory import storage_key
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers
from megatron.plugin.pipeline.offload import ActivationOffloader
from megatron.plugin.pipeline.p2p import PeerChannel
from megatron.plugin.pipeline.simulator import transfer_batches
from megatron.plugin.pipeline.trace import TraceEvent


@dataclass
class ChunkState:
    """What schedules of document chunks add to a stage (see the module docstring)."""

    kv_store: KVStore
    layers: LeadingLayers
    checkpointed: Callable[[int], int]
    """Unit -> leading layers of this stage to checkpoint."""
    slices: Callable[[int], Sequence[tuple]]
    """Unit -> ``(doc_key, slice_index)`` of its pieces that record K/V."""


@dataclass
class StageContext:
    """What an execution needs besides the actions (one model chunk, one pipeline rank)."""

    forward_step_func: Callable
    data_iterator: object
    model: torch.nn.Module
    num_microbatches: int
    shape_of: Callable[[Action], tuple]
    pp_group: object
    pg_collection: object
    is_first_stage: bool
    is_last_stage: bool
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: bool | None = None
    timeout_s: float = 600.0
    chunks: ChunkState | None = None
    program: "PartProgram | None" = None
    """Part schedules (helix): runs every compute action (see :class:`PartProgram`)."""
    offload: ActivationOffloader | None = None
    """Runs ``OFFLOAD`` / ``RELOAD`` (see the module docstring)."""
    events: list = field(default_factory=list)
    device_times: bool = False
    """Wait for the device around every compute action, so that its traced duration is the
    device's time rather than the launch's (CUDA; costs overlap; the elastic refit needs it)."""


class PartProgram(Protocol):
    """What a schedule of layer *parts* supplies to the executor (helix, SPPO multiplexing).

    The program runs every compute action that has a part, and the transfers named by a part
    carry its tensors; actions without a part (the steady subsequences beside SPPO's
    multiplexed shares) run whole-stage as in a schedule without a program.

    Tensors flow between compute actions by name: ``forward(action, inputs)`` and
    ``backward(action, grads)`` take ``{tensor name: tensor}`` and return
    ``([(consumer kind, consumer part, tensor name, tensor), ...], loss tokens)``; the consumer
    is the compute action of the same unit that uses the tensor, on this stage (handed over
    directly) or on another (a transfer named by the consumer's part carries it; ``flow``
    gives the consumer of a transfer). ``recompute(action)`` rebuilds a forward's graph.
    Sent tensors are not pseudo-deallocated: a part's outputs may be its own inputs or
    parameters (the relayed residual, the shipped weight). With ``flow.eager_sends`` a batch is
    posted without waiting: each receive is waited for right before the first action that
    consumes it (traced as ``wait for <action>``), sends are released once polled complete and
    waited for at the end at the latest.
    """

    flow: object

    def forward(self, action: Action, inputs: dict) -> tuple[list, int]: ...

    def backward(self, action: Action, grads: dict) -> tuple[list, int]: ...

    def recompute(self, action: Action) -> None: ...


class _GradSync:
    """Megatron's ``disable_grad_sync`` / ``enable_grad_sync`` pair."""

    def __init__(self, config):
        self.no_sync = config.no_sync_func or contextlib.nullcontext
        self.context = None

    def disable(self):
        if self.context is None:
            self.context = self.no_sync()
            self.context.__enter__()

    def enable(self):
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


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


def run_schedule(actions: list[Action], ctx: StageContext) -> list:
    """Execute ``actions`` (this rank's list); returns Megatron's ``forward_data_store``."""
    model = ctx.model
    config = get_model_config(model)
    dtype = config.pipeline_dtype or torch.float32
    device = next(model.parameters()).device
    rank = ctx.pp_group.rank()
    channel = PeerChannel(ctx.pp_group, f"pipeline rank {rank}", ctx.timeout_s)
    training = not ctx.forward_only
    if training and config.finalize_model_grads_func is not None:
        embedding_module = megatron_schedules.clear_embedding_activation_buffer(
            config, model, ctx.is_last_stage)
    sync = _GradSync(config)
    sync.disable()
    last_backward = max((i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD),
                        default=None)
    batches = dict(transfer_batches(actions))

    total_tokens = torch.zeros([], dtype=torch.int, device=device)
    forward_data_store: list = []
    inputs: dict[tuple, torch.Tensor | None] = {}
    outputs: dict[tuple, torch.Tensor] = {}
    received: dict[tuple, torch.Tensor] = {}
    to_send: dict[tuple, torch.Tensor | None] = {}
    stashes: dict[tuple, object] = {}
    chunks = ctx.chunks
    step_func = ctx.forward_step_func
    if chunks is not None:
        step_func = functools.partial(step_func, kv_store=chunks.kv_store, record_kv=True)
    forwards_done = 0
    origin = time.perf_counter()
    program = ctx.program
    offloader = ctx.offload
    captured = {(a.unit, a.part) for a in actions if a.kind is Kind.OFFLOAD} if training \
        else set()
    if captured and (offloader is None or any(part is not None for _, part in captured)):
        raise ValueError(f"pipeline rank {rank}: OFFLOAD actions need an activation offloader "
                         f"(StageContext.offload) and whole-stage compute, not a part")
    eager = program is not None and program.flow.eager_sends
    in_flight = []
    arriving: dict[tuple, object] = {}
    mailbox: dict[tuple, torch.Tensor] = {}

    def claimed(a: Action) -> bool:
        """Whether the part program runs ``a`` (or its transfer carries a part's tensor)."""
        return program is not None and a.part is not None

    def route(a: Action) -> tuple:
        if not claimed(a):
            return (a.kind, a.unit, a.part)
        return (*program.flow.consumer(a), a.tensor)

    index = 0
    while index < len(actions):
        action = actions[index]
        if ctx.device_times and not action.is_communication():
            _wait_for_device()
        start = time.perf_counter()
        if action.is_communication():
            stop = batches[index]
            batch = [a for a in actions[index:stop]
                     if training or a.kind in (Kind.SEND_F, Kind.RECV_F)]
            sends = [(a, (mailbox if claimed(a) else to_send).pop(route(a)))
                     for a in batch if a.is_send()]
            recvs = [(a, torch.empty(ctx.shape_of(a), dtype=dtype, device=device))
                     for a in batch if a.is_recv()]
            if eager:
                # One post per link (p2p): a receive is waited for with its link's batch, never
                # with a send of this rank (its peer may be waiting for this rank).
                in_flight = [p for p in in_flight if not p.done()]
                for posted in channel.post(sends, recvs):
                    if posted.actions[0].is_recv():
                        for a in posted.actions:
                            arriving[route(a)] = posted
                    else:
                        in_flight.append(posted)
            else:
                channel.exchange(sends, recvs)
            for a, buffer in recvs:
                (mailbox if claimed(a) else received)[route(a)] = buffer
            if training:
                _deallocate_sent([(a, t) for a, t in sends if not claimed(a)], config)
            took = time.perf_counter() - start
            ctx.events.extend(TraceEvent(rank, str(a), start - origin, took, "comm",
                                         tensor.numel() * tensor.element_size())
                              for a, tensor in sends + recvs)
            # Names left bound to a sent output would keep its graph's nodes alive (see below).
            del sends, recvs
            index = stop
            continue
        key = (action.unit, action.part)
        if claimed(action):
            if action.kind is Kind.RECOMPUTE:
                if training:
                    program.recompute(action)
            elif training or action.kind in (Kind.FORWARD, Kind.ATTN_F):
                if index == last_backward and (config.grad_sync_func is None or rank == 0):
                    sync.enable()
                mine = [k for k in mailbox if k[:3] == (action.kind, action.unit, action.part)]
                waits = {arriving.pop(k) for k in mine if k in arriving}
                if waits:
                    for posted in waits:
                        posted.wait()
                    waited = time.perf_counter()
                    ctx.events.append(TraceEvent(rank, f"wait for {action}", start - origin,
                                                 waited - start, "comm"))
                    start = waited
                given = {k[3]: mailbox.pop(k) for k in mine}
                run = program.forward if action.kind in (Kind.FORWARD, Kind.ATTN_F) \
                    else program.backward
                made, num_tokens = run(action, given)
                total_tokens += num_tokens
                for kind, part, name, tensor in made:
                    mailbox[(kind, action.unit, part, name)] = tensor
        elif action.kind is Kind.FORWARD:
            input_tensor = received.pop((Kind.RECV_F, *key), None)
            if input_tensor is not None:
                input_tensor.requires_grad_(training)
            count = chunks.checkpointed(action.unit) if chunks is not None and training else 0
            with chunks.layers.armed(count) if count else contextlib.nullcontext(), \
                    offloader.capture(key) if key in captured else contextlib.nullcontext():
                output, num_tokens = megatron_schedules.forward_step(
                    step_func, ctx.data_iterator, model, ctx.num_microbatches,
                    input_tensor, forward_data_store, config,
                    cp_group_size=ctx.pg_collection.cp.size(),
                    collect_non_loss_data=ctx.collect_non_loss_data,
                    is_first_microbatch=megatron_schedules.check_first_val_step(
                        ctx.first_val_step, ctx.forward_only, forwards_done == 0),
                    current_microbatch=action.unit,
                    is_last_stage=ctx.is_last_stage,
                )
            if count:
                stashes[key] = chunks.layers.take()
            forwards_done += 1
            total_tokens += num_tokens
            if not ctx.is_last_stage:
                to_send[(Kind.SEND_F, *key)] = output
            if training:
                inputs[key] = input_tensor
                outputs[key] = output
            # The stashes own them now. A name left bound to the last forward's output would
            # keep its graph's nodes -- and through them the K/V context leaves of every earlier
            # slice, with their gradients -- alive through all the backwards.
            del input_tensor, output
        elif action.kind is Kind.BACKWARD:
            if not training:
                index += 1
                continue
            if index == last_backward and (config.grad_sync_func is None or rank == 0):
                sync.enable()
            output_grad = received.pop((Kind.RECV_B, *key), None)
            if key in captured:
                offloader.before_backward(key)
            if chunks is None:
                input_grad = megatron_schedules.backward_step(
                    inputs.pop(key), outputs.pop(key), output_grad, config)
            else:
                input_grad = chunk_backward(chunks, action.unit, inputs.pop(key),
                                            outputs.pop(key), output_grad,
                                            stashes.pop(key, None), config)
            if key in captured:
                offloader.release(key)
            if not ctx.is_first_stage:
                to_send[(Kind.SEND_B, *key)] = input_grad
        elif action.kind is Kind.RECOMPUTE:
            if training:
                stash = stashes.get(key)
                if stash is None:
                    raise RuntimeError(f"{action}: the forward of unit {action.unit} "
                                       f"checkpointed no layer on this stage")
                chunks.layers.recompute(stash)
                del stash  # bound past its backward, it would keep the recomputed graph alive
        elif action.kind is Kind.OFFLOAD:
            if training:
                resident = {storage_key(t) for t in (inputs.get(key), outputs.get(key))
                            if t is not None}
                if chunks is not None:
                    resident |= chunks.kv_store.storage_keys()
                offloader.offload(key, resident)
        elif action.kind is Kind.RELOAD:
            if training:
                offloader.reload(key)
        else:
            raise ValueError(
                f"{action}: the executor runs forward, backward and their transfers; "
                f"{action.kind.name} actions come with the schedules that use them")
        if ctx.device_times:
            _wait_for_device()
        ctx.events.append(TraceEvent(rank, str(action), start - origin,
                                     time.perf_counter() - start))
        index += 1
    for posted in in_flight + list(arriving.values()):
        posted.wait()
    if mailbox:
        raise RuntimeError(f"pipeline rank {rank}: the schedule left tensors nobody consumed: "
                           f"{sorted(str(k) for k in mailbox)[:8]}")
    if captured:
        offloader.check_empty(f"pipeline rank {rank}")
    if chunks is not None:
        if ctx.forward_only:
            chunks.kv_store.clear()
        elif len(chunks.kv_store):
            raise RuntimeError(f"pipeline rank {rank}: K/V of {len(chunks.kv_store)} slices "
                               f"were never released: a slice's backward is missing")
    if inputs or outputs or received or to_send or stashes:
        left = sorted({k[0] for k in inputs} | {k[0] for k in outputs} |
                      {k[1] for k in received} | {k[1] for k in to_send})
        raise RuntimeError(f"pipeline rank {rank}: the schedule left stashed tensors of "
                           f"units {left}: every forward needs its backward and transfers")
    if training:
        if sync.context is not None:
            sync.enable()
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
        if config.finalize_model_grads_func is not None:
            if program is not None:
                # Megatron takes the token count from the last stage; a part schedule may
                # compute the loss elsewhere (helix: stage 0), so every stage gets the total.
                torch.distributed.all_reduce(total_tokens, group=ctx.pp_group)
            megatron_schedules.finish_embedding_wgrad_compute(
                config, embedding_module, ctx.is_last_stage, ctx.pg_collection.tp)
            config.finalize_model_grads_func(
                [model], total_tokens if config.calculate_per_token_loss else None,
                pg_collection=ctx.pg_collection)
    return forward_data_store
