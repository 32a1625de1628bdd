"""The bookkeeping of one rank's execution of a schedule (:class:`StageRun`), apart from the
executor's dispatch loop (:mod:`megatron.plugin.pipeline.executor`)."""
from __future__ import annotations

import functools
import time

import torch
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.utils import get_model_config

from megatron.plugin.pipeline.grad_sync import GradSync
from megatron.plugin.pipeline.ir import Action, Kind, transfer_batches
from megatron.plugin.pipeline.p2p import PeerChannel
from megatron.plugin.pipeline.stage_context import StageContext
from megatron.plugin.pipeline.chrome_trace import TraceEvent


class StageRun:
    """The bookkeeping of one rank's execution: what the actions hand each other (stage inputs
    and outputs, received and outgoing tensors), the gradient-sync state and the token count;
    :meth:`finish` checks that nothing is left and runs Megatron's end of step."""

    def __init__(self, actions: list[Action], ctx: StageContext):
        self.actions = actions
        self.ctx = ctx
        self.extensions = ctx.extensions
        self.model = ctx.model
        self.config = get_model_config(ctx.model)
        self.dtype = self.config.pipeline_dtype or torch.float32
        self.device = next(ctx.model.parameters()).device
        self.rank = ctx.pp_group.rank()
        self.channel = PeerChannel(ctx.pp_group, f"pipeline rank {self.rank}", ctx.timeout_s,
                                   ctx.links)
        self.training = not ctx.forward_only
        self.embedding_module = None
        if self.training and self.config.finalize_model_grads_func is not None:
            self.embedding_module = megatron_schedules.clear_embedding_activation_buffer(
                self.config, ctx.model, ctx.is_last_stage)
        self.sync = GradSync(self.config, ctx.model)
        self.sync.disable()
        last_backward = max((i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD),
                            default=None)
        chosen = [found for ext in self.extensions
                  if (found := ext.grad_sync_backwards(actions)) is not None]
        if len(chosen) > 1:
            raise ValueError(f"pipeline rank {self.rank}: {len(chosen)} extensions choose the "
                             f"backwards that run with gradient sync; at most one may")
        self.sync_backwards = chosen[0] if chosen else \
            ({last_backward} if last_backward is not None else set())
        """Indices of the backwards that run with gradient sync enabled."""
        self.batches = dict(transfer_batches(actions))
        self.total_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.forward_data_store: list = []
        self.inputs: dict[tuple, torch.Tensor | None] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.received: dict[tuple, torch.Tensor] = {}
        self.to_send: dict[tuple, torch.Tensor | None] = {}
        kwargs = {k: v for ext in self.extensions for k, v in ext.step_kwargs().items()}
        self.step_func = functools.partial(ctx.forward_step_func, **kwargs) if kwargs \
            else ctx.forward_step_func
        backwards = [ext.unit_backward for ext in self.extensions
                     if ext.unit_backward is not None]
        if len(backwards) > 1:
            raise ValueError(f"pipeline rank {self.rank}: {len(backwards)} extensions replace "
                             f"the backward of a unit; at most one may")
        self.unit_backward = backwards[0] if backwards else _megatron_backward
        self.forwards_done = 0
        self.origin = time.perf_counter()
        for ext in self.extensions:
            ext.start(self)

    def owner(self, transfer: Action):
        """The extension that claims ``transfer``'s tensor, else ``None``."""
        return next((ext for ext in self.extensions if ext.claims(transfer)), None)

    def outgoing(self, send: Action):
        owner = self.owner(send)
        return owner.outgoing(send) if owner else \
            self.to_send.pop((send.kind, send.unit, send.part))

    def incoming(self, recv: Action, buffer) -> None:
        owner = self.owner(recv)
        if owner:
            owner.incoming(recv, buffer)
        else:
            self.received[(recv.kind, recv.unit, recv.part)] = buffer

    def before_backward(self, index: int) -> None:
        """Megatron's rule: gradient sync resumes right before the last backward (only on
        rank 0 when a ``grad_sync_func`` exists); with an extension's choice
        (:meth:`StageExtension.grad_sync_backwards`) it runs during the backwards chosen and
        is off during the others."""
        if self.actions[index].kind is not Kind.BACKWARD:
            return
        if index in self.sync_backwards and (self.config.grad_sync_func is None
                                             or self.rank == 0):
            self.sync.enable()
        else:
            self.sync.disable()

    def trace(self, name: str, start: float, end: float, category: str = "compute",
              nbytes: int = 0) -> None:
        self.ctx.events.append(TraceEvent(self.rank, name, start - self.origin, end - start,
                                          category, nbytes))

    def finish(self) -> list:
        """Let the extensions wait for what is in flight and check what they hold, check that
        the schedule left nothing behind, then Megatron's end of step (gradient sync,
        ``finalize_model_grads_func``); returns the ``forward_data_store``."""
        for ext in self.extensions:
            ext.finish(self)
        if self.inputs or self.outputs or self.received or self.to_send:
            left = sorted({k[0] for k in self.inputs} | {k[0] for k in self.outputs} |
                          {k[1] for k in self.received} | {k[1] for k in self.to_send})
            raise RuntimeError(f"pipeline rank {self.rank}: the schedule left stashed tensors "
                               f"of units {left}: every forward needs its backward and "
                               f"transfers")
        if self.training:
            self._end_of_step()
        return self.forward_data_store

    def _end_of_step(self) -> None:
        ctx, config = self.ctx, self.config
        self.sync.check_ready_counts(self.rank, self.sync.context is not None
                                     and config.grad_sync_func is not None)
        if self.sync.context is not None:
            self.sync.enable()
            if config.grad_sync_func is not None:
                config.grad_sync_func(self.model.parameters())
        if config.finalize_model_grads_func is not None:
            for ext in self.extensions:
                ext.finalize(self)
            megatron_schedules.finish_embedding_wgrad_compute(
                config, self.embedding_module, ctx.is_last_stage, ctx.pg_collection.tp)
            config.finalize_model_grads_func(
                [self.model], self.total_tokens if config.calculate_per_token_loss else None,
                pg_collection=ctx.pg_collection)


def _megatron_backward(run: StageRun, action: Action, input_tensor, output, output_grad):
    """Megatron's ``backward_step`` of a whole-stage unit."""
    return megatron_schedules.backward_step(input_tensor, output, output_grad, run.config)
