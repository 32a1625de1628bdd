"""Schedules of layer parts (helix, SPPO multiplexing): what such a schedule supplies
(:class:`PartProgram`) and the executor extension that runs it (:class:`Parts`).

The program runs every compute action that has a part, and the transfers named by a part carry
its tensors; actions without a part (the steady subsequences beside SPPO's multiplexed shares)
run whole-stage as in a schedule without a program.

Tensors flow between compute actions by name through a mailbox keyed by their consumer: the
compute action of the same unit that uses the tensor, on this stage (handed over directly) or on
another (a transfer named by the consumer's part carries it; ``flow.consumer`` gives the consumer
of a transfer). Sent tensors are not pseudo-deallocated: a part's outputs may be its own inputs
or parameters (the relayed residual, the shipped weight). With ``flow.eager_sends`` a batch is
posted without waiting (one post per link): each receive is waited for right before the first
action that consumes it (traced as ``wait for <action>``), sends are released once polled
complete and waited for at the end at the latest. Megatron takes the loss-token count from the
last stage; a part schedule may compute the loss elsewhere (helix: stage 0), so every stage gets
the total before ``finalize_model_grads_func``.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from megatron.plugin.pipeline.extension import StageExtension
from megatron.plugin.pipeline.ir import Action, Kind


class PartProgram(Protocol):
    """The parts of one stage.

    ``forward(action, inputs)`` and ``backward(action, grads)`` take ``{tensor name: tensor}``
    and return ``([(consumer kind, consumer part, tensor name, tensor), ...], loss tokens)``;
    ``recompute(action)`` rebuilds a forward's graph; ``flow`` names the consumer of a transfer
    (``consumer``) and whether sends are eager (``eager_sends``).
    """

    flow: object

    def forward(self, action: Action, inputs: dict) -> tuple[list, int]: ...

    def backward(self, action: Action, grads: dict) -> tuple[list, int]: ...

    def recompute(self, action: Action) -> None: ...


class Parts(StageExtension):
    """Runs a :class:`PartProgram`'s actions and carries its tensors (module docstring)."""

    def __init__(self, program: PartProgram, sync_each_part: bool = False):
        self.program = program
        self.sync_each_part = sync_each_part
        """Whether every backward of a part touches the same parameters (helix's boundaries),
        so that each parameter's last gradient of the step comes in the last backward of some
        part: those run with gradient sync enabled (:meth:`grad_sync_backwards`)."""
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.arriving: dict[tuple, object] = {}
        """Route -> the posted batch of receives that brings it (eager sends)."""
        self.in_flight: list = []
        """Posted batches of sends not yet complete (eager sends)."""

    def handler(self, action: Action):
        return self._run if action.part is not None else None

    def claims(self, transfer: Action) -> bool:
        return transfer.part is not None

    def grad_sync_backwards(self, actions: list[Action]) -> set[int] | None:
        if not self.sync_each_part:
            return None
        last = {a.part: i for i, a in enumerate(actions)
                if a.kind is Kind.BACKWARD and a.part is not None}
        return set(last.values())

    def outgoing(self, transfer: Action):
        return self.mailbox.pop(self._route(transfer))

    def incoming(self, transfer: Action, buffer) -> None:
        self.mailbox[self._route(transfer)] = buffer

    def post(self, run, sends: list, recvs: list) -> bool:
        if not self.program.flow.eager_sends:
            return False
        # One post per link (p2p): a receive is waited for with its link's batch, never with a
        # send of this rank (its peer may be waiting for this rank).
        self.in_flight = [p for p in self.in_flight if not p.done()]
        for posted in run.channel.post(sends, recvs):
            if posted.actions[0].is_recv():
                for a in posted.actions:
                    self.arriving[self._route(a)] = posted
            else:
                self.in_flight.append(posted)
        return True

    def finish(self, run) -> None:
        for posted in self.in_flight + list(self.arriving.values()):
            posted.wait()
        if self.mailbox:
            raise RuntimeError(f"pipeline rank {run.rank}: the schedule left tensors nobody "
                               f"consumed: {sorted(str(k) for k in self.mailbox)[:8]}")

    def finalize(self, run) -> None:
        torch.distributed.all_reduce(run.total_tokens, group=run.ctx.pp_group)

    def _route(self, transfer: Action) -> tuple:
        if not self.claims(transfer):
            return (transfer.kind, transfer.unit, transfer.part)
        return (*self.program.flow.consumer(transfer), transfer.tensor)

    def _run(self, run, index: int, action: Action) -> float | None:
        """A compute action of the program: its tensors from the mailbox (waiting for those
        still arriving), its products back into it."""
        if action.kind is Kind.RECOMPUTE:
            if run.training:
                self.program.recompute(action)
            return None
        if not (run.training or action.kind in (Kind.FORWARD, Kind.ATTN_F)):
            return None
        run.before_backward(index)
        mine = [k for k in self.mailbox if k[:3] == (action.kind, action.unit, action.part)]
        waits = {self.arriving.pop(k) for k in mine if k in self.arriving}
        started = None
        if waits:
            start = time.perf_counter()
            for posted in waits:
                posted.wait()
            started = time.perf_counter()
            run.trace(f"wait for {action}", start, started, "comm")
        given = {k[3]: self.mailbox.pop(k) for k in mine}
        compute = self.program.forward if action.kind in (Kind.FORWARD, Kind.ATTN_F) \
            else self.program.backward
        made, num_tokens = compute(action, given)
        run.total_tokens += num_tokens
        for kind, part, name, tensor in made:
            self.mailbox[(kind, action.unit, part, name)] = tensor
        return started
