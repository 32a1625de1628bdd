"""The bookkeeping of one rank's execution of a schedule (:class:`StageRun`), apart from the
executor's dispatch loop (:mod:`megatron.plugin.pipeline.executor`)."""
from __future__ import annotations

import contextlib
import functools
import time

import torch
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.utils import get_model_config

from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.p2p import PeerChannel
from megatron.plugin.pipeline.simulator import transfer_batches
from megatron.plugin.pipeline.stage_context import StageContext
from megatron.plugin.pipeline.chrome_trace import TraceEvent


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


class StageRun:
    """The bookkeeping of one rank's execution: what the actions hand each other (stage inputs
    and outputs, received and outgoing tensors, checkpoint stashes, a part program's
    mailbox), the gradient-sync state and the token count; :meth:`finish` checks that nothing
    is left and runs Megatron's end of step."""

    def __init__(self, actions: list[Action], ctx: StageContext):
        self.actions = actions
        self.ctx = ctx
        self.model = ctx.model
        self.config = get_model_config(ctx.model)
        self.dtype = self.config.pipeline_dtype or torch.float32
        self.device = next(ctx.model.parameters()).device
        self.rank = ctx.pp_group.rank()
        self.channel = PeerChannel(ctx.pp_group, f"pipeline rank {self.rank}", ctx.timeout_s)
        self.training = not ctx.forward_only
        self.embedding_module = None
        if self.training and self.config.finalize_model_grads_func is not None:
            self.embedding_module = megatron_schedules.clear_embedding_activation_buffer(
                self.config, ctx.model, ctx.is_last_stage)
        self.sync = _GradSync(self.config)
        self.sync.disable()
        self.last_backward = max((i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD),
                                 default=None)
        self.batches = dict(transfer_batches(actions))
        self.total_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.forward_data_store: list = []
        self.inputs: dict[tuple, torch.Tensor | None] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.received: dict[tuple, torch.Tensor] = {}
        self.to_send: dict[tuple, torch.Tensor | None] = {}
        self.stashes: dict[tuple, object] = {}
        self.step_func = ctx.forward_step_func
        if ctx.chunks is not None:
            self.step_func = functools.partial(self.step_func, kv_store=ctx.chunks.kv_store,
                                               record_kv=True)
        self.forwards_done = 0
        self.origin = time.perf_counter()
        self.captured = {(a.unit, a.part) for a in actions if a.kind is Kind.OFFLOAD} \
            if self.training else set()
        if self.captured and (ctx.offload is None
                              or any(part is not None for _, part in self.captured)):
            raise ValueError(f"pipeline rank {self.rank}: OFFLOAD actions need an activation "
                             f"offloader (StageContext.offload) and whole-stage compute, not a "
                             f"part")
        self.eager = ctx.program is not None and ctx.program.flow.eager_sends
        self.in_flight: list = []
        self.arriving: dict[tuple, object] = {}
        self.mailbox: dict[tuple, torch.Tensor] = {}

    def claimed(self, action: Action) -> bool:
        """Whether the part program runs ``action`` (or its transfer carries a part's
        tensor)."""
        return self.ctx.program is not None and action.part is not None

    def route(self, action: Action) -> tuple:
        if not self.claimed(action):
            return (action.kind, action.unit, action.part)
        return (*self.ctx.program.flow.consumer(action), action.tensor)

    def before_backward(self, index: int) -> None:
        """Megatron's rule: gradient sync resumes right before the last backward (only on
        rank 0 when a ``grad_sync_func`` exists)."""
        if index == self.last_backward and (self.config.grad_sync_func is None
                                            or self.rank == 0):
            self.sync.enable()

    def trace(self, name: str, start: float, end: float, category: str = "compute",
              nbytes: int = 0) -> None:
        self.ctx.events.append(TraceEvent(self.rank, name, start - self.origin, end - start,
                                          category, nbytes))

    def finish(self) -> list:
        """Wait for what is in flight, check that the schedule left nothing behind, then
        Megatron's end of step (gradient sync, ``finalize_model_grads_func``); returns the
        ``forward_data_store``."""
        ctx, rank, config = self.ctx, self.rank, self.config
        for posted in self.in_flight + list(self.arriving.values()):
            posted.wait()
        if self.mailbox:
            raise RuntimeError(f"pipeline rank {rank}: the schedule left tensors nobody "
                               f"consumed: {sorted(str(k) for k in self.mailbox)[:8]}")
        if self.captured:
            ctx.offload.check_empty(f"pipeline rank {rank}")
        if ctx.chunks is not None:
            if ctx.forward_only:
                ctx.chunks.kv_store.clear()
            elif len(ctx.chunks.kv_store):
                raise RuntimeError(f"pipeline rank {rank}: K/V of {len(ctx.chunks.kv_store)} "
                                   f"slices were never released: a slice's backward is missing")
        if self.inputs or self.outputs or self.received or self.to_send or self.stashes:
            left = sorted({k[0] for k in self.inputs} | {k[0] for k in self.outputs} |
                          {k[1] for k in self.received} | {k[1] for k in self.to_send})
            raise RuntimeError(f"pipeline rank {rank}: the schedule left stashed tensors of "
                               f"units {left}: every forward needs its backward and transfers")
        if self.training:
            if self.sync.context is not None:
                self.sync.enable()
                if config.grad_sync_func is not None:
                    config.grad_sync_func(self.model.parameters())
            if config.finalize_model_grads_func is not None:
                if ctx.program is not None:
                    # Megatron takes the token count from the last stage; a part schedule may
                    # compute the loss elsewhere (helix: stage 0), so every stage gets the
                    # total.
                    torch.distributed.all_reduce(self.total_tokens, group=ctx.pp_group)
                megatron_schedules.finish_embedding_wgrad_compute(
                    config, self.embedding_module, ctx.is_last_stage, ctx.pg_collection.tp)
                config.finalize_model_grads_func(
                    [self.model],
                    self.total_tokens if config.calculate_per_token_loss else None,
                    pg_collection=ctx.pg_collection)
        return self.forward_data_store
