"""Device-agnostic point-to-point transfers between pipeline stages, with timeouts.

The same code runs on gloo (CPU) and NCCL (CUDA): ``torch.distributed.batch_isend_irecv``,
peers named by their pipeline stage. A run of consecutive transfer actions of one rank is
posted as one batch (Megatron's ``send_forward_recv_backward`` and friends) and waited for as a
whole, or per link (below). Shapes come from the plan, so no shape is exchanged at run time.

**Links.** Each ordered pair of stages of a pipeline (``a -> b`` and ``b -> a`` apart) has a
two-rank process group of its own, its *link* (:func:`pipeline_links`); a batch is posted as one
``batch_isend_irecv`` per link it uses. NCCL runs the operations of one communicator in the
order they were posted, one group after the other, and a group completes only when every peer
has posted its side. With one communicator for the whole pipeline, a send posted ahead (helix's
eager sends) would hold back every later receive of its rank until the peer takes it: ranks
sending to each other first and receiving second would wait for each other forever, which gloo,
matching by tag, never shows. On a link only one rank sends and only the other receives, so
in-order execution is exactly the channel order the validator requires (receives posted in send
order), and the dry run (:func:`~megatron.plugin.pipeline.simulator.simulate`) replays one
in-order stream per rank and link: a schedule that passes it cannot hang on NCCL. The price:
a two-rank communicator per link, whose buffers take device memory on NCCL. A schedule declares
the links it uses (:func:`neighbour_links` for the 1F1B family: two per inner rank each way;
:func:`every_link` by default, as helix sends to every stage), :func:`check_links` refuses a
schedule that uses another one before anything runs, and only the declared links are created:
once, at the first schedule run, by every rank (``new_group`` requires it). At ``P`` stages a
rank holds at most four communicators of the 1F1B family instead of ``2(P-1)``.

Matching: NCCL pairs transfers between two ranks by issue order only, gloo by (peer, tag) and
then by order. Each transfer also carries a tag derived from its identity
(:meth:`~megatron.plugin.pipeline.ir.Action.transfer_key`), so gloo cannot pair two different
transfers even if the channel order were broken.

Every wait has a deadline; a missed one names the rank, the action and the peer instead of
hanging. On gloo the host waits, with a timeout, and raises :class:`TransferTimeout`. On NCCL a
wait with a timeout would synchronise the host with the device at every transfer batch, so the
compute stream waits on the batch instead (``work.wait()``) and the process's
:class:`~megatron.plugin.pipeline.p2p_watchdog.TransferWatchdog` holds the deadline: past it,
the same message is logged and the process ends.
Handles and send buffers are released as soon as their batch completes (or, for transfers
posted ahead with :meth:`PeerChannel.post`, when the caller waits for them or polls them
complete).
"""
from __future__ import annotations

import datetime
import itertools
import time
import zlib

import torch
import torch.distributed as dist

from megatron.plugin.pipeline.group_cache import cached_groups
from megatron.plugin.layers.devices import collective_device
from megatron.plugin.pipeline.ir import Action
from megatron.plugin.pipeline.p2p_watchdog import TransferWatchdog

WATCHDOG = TransferWatchdog()
"""The deadlines of this process's transfers on NCCL."""


class TransferTimeout(TimeoutError):
    """A batch of transfers did not complete in time."""


def tag_of(action: Action) -> int:
    """Tag shared by a send and its matching receive (31 bits)."""
    return zlib.crc32(repr(action.transfer_key()).encode()) & 0x7FFFFFFF


Links = frozenset
"""Ordered ``(source stage, destination stage)`` pairs of a pipeline."""


def every_link(stages: int) -> Links:
    """Every ordered pair of ``stages`` stages."""
    return frozenset(itertools.permutations(range(stages), 2))


def neighbour_links(stages: int) -> Links:
    """Each stage to the next and back: the links of the 1F1B family of schedules."""
    return frozenset(pair for s in range(stages - 1) for pair in ((s, s + 1), (s + 1, s)))


def check_links(schedule, links: Links) -> None:
    """Refuse a ``schedule`` (rows of actions, one per stage) with a transfer on a link outside
    ``links``; every rank runs this over the same rows before any transfer."""
    for row in schedule:
        for action in row:
            if action.is_communication() and action.link() not in links:
                raise ValueError(
                    f"{action} travels on link {action.link()}, which the schedule did not "
                    f"declare (its links: {sorted(links)}): declare every link its transfers "
                    f"use (megatron.plugin.pipeline.p2p.every_link by default)")


@cached_groups(maxsize=4)
def pipeline_links(pipeline: tuple[int, ...], links: Links) -> dict[tuple[int, int], object]:
    """``(source stage, destination stage) -> two-rank group`` for the declared ``links`` of the
    pipeline whose global ranks are ``pipeline`` that have this rank at one end (module doc).

    Every rank takes part in creating the links of every pipeline (``new_group`` requires it),
    at its first call, all pipelines declaring the same ``links``; each link then runs one
    collective so that NCCL sets its communicator up while both ranks are here (a first
    point-to-point batch must involve all of a group's ranks).
    """
    pipelines = [None] * dist.get_world_size()
    dist.all_gather_object(pipelines, pipeline)
    mine = {}
    for ranks in sorted(set(pipelines)):
        for src, dst in sorted(links):
            group = dist.new_group([ranks[src], ranks[dst]])
            if dist.get_rank() in (ranks[src], ranks[dst]):
                mine[(src, dst)] = group
    for group in mine.values():
        dist.all_reduce(torch.zeros(1, device=collective_device(group)), group=group)
    return mine


class PeerChannel:
    """Batched transfers of one rank with its pipeline's other stages, over the links."""

    def __init__(self, group, rank_label: str, timeout_s: float, links: Links | None = None):
        self.group = group
        self.rank_label = rank_label
        self.timeout_s = timeout_s
        ranks = tuple(dist.get_process_group_ranks(group))
        self.links = pipeline_links(ranks, every_link(len(ranks)) if links is None else links)
        self.host_waits = dist.get_backend(group) != "nccl"
        """Whether waits block the host (gloo); on NCCL the stream waits (module doc)."""

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def exchange(self, sends: list[tuple[Action, torch.Tensor]],
                 recvs: list[tuple[Action, torch.Tensor]]) -> None:
        """Post every send and every receive (into the given buffers), then wait for all of
        them."""
        for posted in self.post(sends, recvs):
            posted.wait()

    def post(self, sends: list[tuple[Action, torch.Tensor]],
             recvs: list[tuple[Action, torch.Tensor]]) -> list["Posted"]:
        """Post every send and every receive at once, one batch per link; each
        :class:`Posted` waits for the transfers of its link."""
        per_link: dict[tuple[int, int], list] = {}
        for action, tensor in sends + recvs:
            link = action.link()
            op = dist.isend if action.is_send() else dist.irecv
            if action.is_send():
                tensor = tensor.detach().contiguous()
            per_link.setdefault(link, []).append(
                (action, dist.P2POp(op, tensor, self._global(action.peer), self.links[link],
                                    tag_of(action))))
        posted = []
        for link in sorted(per_link):
            actions = [action for action, _ in per_link[link]]
            ops = [op for _, op in per_link[link]]
            posted.append(Posted(self, actions, dist.batch_isend_irecv(ops), ops))
        return posted


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
        """Wait for every transfer: on the host, raising :class:`TransferTimeout` naming what is
        missing (gloo); or by making the compute stream wait and handing the works to the
        watchdog with the same deadline (NCCL: the host goes on)."""
        if self.channel.host_waits:
            self._wait_on_host()
        else:
            for work in self.works:
                work.wait()
            actions = self.actions
            WATCHDOG.watch(self.works, self.channel.timeout_s,
                           lambda waited: _missing(self.channel, actions, None, waited,
                                                   "watchdog"))
        self.works = self.ops = []

    def _wait_on_host(self) -> None:
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
                raise TransferTimeout(_missing(self.channel, actions, action,
                                               time.monotonic() - start, err)) from err


def _missing(channel: PeerChannel, actions: list[Action], action: Action | None,
             waited: float, cause) -> str:
    """What a timeout names: the rank, the transfer (``action``) or the whole batch, the peer."""
    if action is None:
        what = "batch " + " ".join(str(a) for a in actions)
        peer = f"peer stages {sorted({a.peer for a in actions})}"
    else:
        what = ("send of " if action.is_send() else "receive of ") + str(action)
        peer = f"peer stage {action.peer}"
    return (f"{channel.rank_label}: {what} ({peer}) did not complete within {waited:.1f}s: the "
            f"peer never posted the matching transfer or stopped; raise --pipeline-timeout-s if "
            f"the peer is only slow ({cause})")
