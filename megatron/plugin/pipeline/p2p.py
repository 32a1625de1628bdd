"""Device-agnostic point-to-point transfers between pipeline stages, with timeouts.

The same code runs on gloo (CPU) and NCCL (CUDA): ``torch.distributed.batch_isend_irecv`` on
Megatron's pipeline group, peers named by their pipeline stage. A run of consecutive transfer
actions of one rank is posted as one batch (Megatron's ``send_forward_recv_backward`` and
friends) and waited for as a whole: on NCCL a batch is one group call, so a rank that sends to
and receives from the same peer in one step cannot deadlock. Shapes come from the plan, so no
shape is exchanged at run time.

Matching: NCCL pairs transfers between two ranks by issue order only, gloo by (peer, tag) and
then by order. The validator guarantees that receives are posted in send order on every
channel; each transfer also carries a tag derived from its identity
(:meth:`~megatron.plugin.pipeline.ir.Action.transfer_key`), so gloo cannot pair two different
transfers even if that guarantee were broken.

Every wait has a timeout; the error names the rank, the action and the peer instead of hanging.
Handles and send buffers are released as soon as their batch completes (or, for transfers
posted ahead with :meth:`PeerChannel.post`, when the caller waits for them or polls them
complete).
"""
from __future__ import annotations

import datetime
import time
import zlib

import torch
import torch.distributed as dist

from megatron.plugin.pipeline.ir import Action


class TransferTimeout(TimeoutError):
    """A batch of transfers did not complete in time."""


def tag_of(action: Action) -> int:
    """Tag shared by a send and its matching receive (31 bits)."""
    return zlib.crc32(repr(action.transfer_key()).encode()) & 0x7FFFFFFF


class PeerChannel:
    """Batched transfers of one rank over the pipeline group."""

    def __init__(self, group, rank_label: str, timeout_s: float):
        self.group = group
        self.rank_label = rank_label
        self.timeout_s = timeout_s

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def exchange(self, sends: list[tuple[Action, torch.Tensor]],
                 recvs: list[tuple[Action, torch.Tensor]]) -> None:
        """Post every send and every receive (into the given buffers) together, then wait for
        all of them."""
        self.post(sends, recvs).wait()

    def post(self, sends: list[tuple[Action, torch.Tensor]],
             recvs: list[tuple[Action, torch.Tensor]]) -> "Posted":
        """Post every send and every receive together; :meth:`Posted.wait` waits for them."""
        ops, actions = [], []
        for action, tensor in sends:
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(),
                                  self._global(action.peer), self.group, tag_of(action)))
            actions.append(action)
        for action, buffer in recvs:
            ops.append(dist.P2POp(dist.irecv, buffer, self._global(action.peer), self.group,
                                  tag_of(action)))
            actions.append(action)
        works = dist.batch_isend_irecv(ops) if ops else []
        return Posted(self, actions, works, ops)


class Posted:
    """Transfers posted together; the send buffers stay referenced until :meth:`wait` or until
    :meth:`done` finds them complete."""

    def __init__(self, channel: PeerChannel, actions: list[Action], works: list, ops: list):
        self.channel, self.actions, self.works, self.ops = channel, actions, works, ops

    def done(self) -> bool:
        """Whether every transfer has completed (then the buffers are released); never
        blocks."""
        if all(work.is_completed() for work in self.works):
            self.wait()
            return True
        return False

    def wait(self) -> None:
        """Wait for every transfer, or raise :class:`TransferTimeout` naming what is missing."""
        actions, works = self.actions, self.works
        start = time.monotonic()
        deadline = start + self.channel.timeout_s
        # NCCL coalesces a batch into one handle: then the error names the whole batch.
        named = zip(actions, works) if len(works) == len(actions) else \
            ((None, work) for work in works)
        for action, work in named:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as err:
                waited = time.monotonic() - start
                if action is None:
                    what = "batch " + " ".join(str(a) for a in actions)
                    peers = sorted({a.peer for a in actions})
                    peer = f"peer stages {peers}"
                else:
                    what = ("send of " if action.is_send() else "receive of ") + str(action)
                    peer = f"peer stage {action.peer}"
                raise TransferTimeout(
                    f"{self.channel.rank_label}: {what} ({peer}) did not complete within "
                    f"{waited:.1f}s: the peer never posted the matching transfer or stopped; "
                    f"raise --pipeline-timeout-s if the peer is only slow ({err})") from err
        self.works = self.ops = []
