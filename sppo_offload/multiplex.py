"""Multiplexed sequence partitioning: the edge subsequence computed by the stages that would idle.

In the subsequence pipeline (:mod:`sppo_offload.pipeline`) stage ``k`` idles for ``k`` forwards
while the first subsequence travels down the pipeline (warm-up) and for ``p - 1 - k`` backwards
at the end while the first subsequence's gradient travels back (cool-down). Multiplexing splits
that edge subsequence (``u0``) further, over sequence-parallel groups made of the idle stages:

- **Left-SP** (warm-up): the forward of ``u0`` through stage ``k``'s layers (block ``k``) runs
  on the group ``G_k = {k, ..., p-1}``, each member a ``1/|G_k|`` share of ``u0``'s tokens;
  stages after ``k`` have nothing of their own to do yet. Stage 0 is then free after a
  ``1/p`` share and starts the steady pipeline early; block ``k``'s group finishes its share
  and hands over stage ``k``'s part of the output (``0SEND_F0.mux0>1`` ...) to the next group,
  and the helpers give stage ``k`` their shares of ``u0``'s K/V for block ``k``
  (``tensor kv``), which every later subsequence on stage ``k`` attends to.
- **Steady**: subsequences ``1 .. N-1`` as in the plain pipeline (forwards in order, backwards
  last-first), with their offloads and reloads.
- **Right-SP** (cool-down): the backward of ``u0`` through block ``k`` runs on the same group
  ``G_k``, where the forward left each member's share of the activations. Block ``p-1`` first
  (stage ``p-1`` finishes its steady backwards first), down to block 0 on all stages. Stage
  ``k`` sends its members the dK/dV of ``u0`` that its steady backwards accumulated
  (``tensor dkv``), and the gradient of stage ``k - 1``'s share goes back to stage ``k - 1``.

Weights: a helper needs block ``k``'s weights. Chosen: stage ``k`` broadcasts them (BF16, its
TP shard; block 0 includes the embedding table) to each helper right before the Left-SP
forward, the helper drops them after its share, fetches them again for the Right-SP backward
and reduces its weight-gradient share back to stage ``k``. Each fetch and the reduction are
priced as a transfer of the block's weight bytes on the stage-to-stage link, on the helper's
critical path (not overlapped), and the borrowed weights are not charged to the helper's
memory (they are transient, one block at a time). Inside a group, the causal attention of the
shares exchanges ``u0``'s K/V for the block (dK/dV in the backward): priced as
``(|G_k| - 1) / |G_k|`` of the block's K/V bytes over the same link.

Memory: a member keeps ``1/|G_k|`` of ``u0``'s offloadable activations of block ``k``; stage
``k`` also keeps the whole K/V and dK/dV of ``u0`` for block ``k`` (later subsequences read
them), a helper its own share. A member offloads the fraction ``alpha`` of stage ``k``'s
ratio for ``u0`` of its share (issued before its next forward, reloaded one backward ahead,
as in the plain pipeline).

IR: the shares are ``FORWARD`` / ``BACKWARD`` actions of unit 0 with part ``.mux<k>`` on the
member's own stage; :class:`MultiplexFlow` tells the validator which compute produces and
consumes each of the extra transfers.
"""
from __future__ import annotations

from typing import Sequence

from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import SimResult, simulate
from megatron.plugin.pipeline.validation import LayerwiseFlow, validate

from elastic_pipe.cost_model import ACT_BYTES, GB, CostModel

from sppo_offload.costs import SequenceCosts, subsequence_chunks
from sppo_offload.offload import offloadable_bytes, resident_bytes
from sppo_offload.pipeline import add_offload

Schedule = list[list[Action]]
KV, DKV = "kv", "dkv"


def mux(block: int) -> str:
    """Part name of a share of ``u0`` on block ``block``'s layers."""
    return f".mux{block}"


def block_of(action: Action) -> int:
    return int(action.part[len(".mux"):])


class MultiplexFlow(LayerwiseFlow):
    """Producers and consumers of the Left-SP / Right-SP transfers (module doc)."""

    def producer(self, transfer: Action) -> tuple:
        if transfer.part is None:
            return super().producer(transfer)
        if transfer.kind is Kind.SEND_F:
            return Kind.FORWARD, 0, transfer.part
        if transfer.tensor == DKV:
            return Kind.BACKWARD, 1, None
        return Kind.BACKWARD, 0, transfer.part

    def consumer(self, transfer: Action) -> tuple:
        if transfer.part is None:
            return super().consumer(transfer)
        k = block_of(transfer)
        if transfer.kind is Kind.RECV_F:
            return (Kind.FORWARD, 1, None) if transfer.tensor == KV else \
                (Kind.FORWARD, 0, mux(k + 1))
        if transfer.tensor == DKV:
            return Kind.BACKWARD, 0, transfer.part
        return Kind.BACKWARD, 0, mux(k - 1)


def multiplexed_schedule(pp: int, num_subsequences: int,
                         offloaded=lambda action: False) -> Schedule:
    """The validated multiplexed schedule; ``offloaded(forward)`` marks the forwards (steady
    subsequences and shares of ``u0``) to offload (placement as in
    :func:`sppo_offload.pipeline.add_offload`)."""
    n, p = num_subsequences, pp
    if p < 2 or n < 2:
        raise ValueError(f"multiplexing needs pp >= 2 and at least 2 subsequences, got pp={p}, "
                         f"N={n}")
    steady = [[Action(a.stage, a.kind, a.unit + 1) for a in row]
              for row in one_f_one_b(p, n - 1, list(range(n - 2, -1, -1)))]
    steady = add_communication(steady, num_stages=p)
    schedule = []
    for h in range(p):
        row: list[Action] = []
        for k in range(h + 1):
            if k >= 1:
                row.append(Action(h, Kind.RECV_F, 0, mux(k - 1), k - 1))
            row.append(Action(h, Kind.FORWARD, 0, mux(k)))
            if h == k:
                row += [Action(k, Kind.SEND_F, 0, mux(k), j) for j in range(k + 1, p)]
                row += [Action(k, Kind.RECV_F, 0, mux(k), j, KV) for j in range(k + 1, p)]
            else:
                row.append(Action(h, Kind.SEND_F, 0, mux(k), k, KV))
        row += steady[h]
        for k in range(h, -1, -1):
            if h == k:
                if k < p - 1:
                    row.append(Action(k, Kind.RECV_B, 0, mux(k + 1), k + 1))
                row += [Action(k, Kind.SEND_B, 0, mux(k), j, DKV) for j in range(k + 1, p)]
                row.append(Action(k, Kind.BACKWARD, 0, mux(k)))
                if k >= 1:
                    row.append(Action(k, Kind.SEND_B, 0, mux(k), k - 1))
            else:
                row.append(Action(h, Kind.RECV_B, 0, mux(k), k, DKV))
                row.append(Action(h, Kind.BACKWARD, 0, mux(k)))
        schedule.append(row)
    schedule = add_offload(schedule, offloaded)
    validate(schedule, flow=MultiplexFlow())
    return schedule


class MultiplexCosts(SequenceCosts):
    """:class:`SequenceCosts` plus the shares, weight fetches and group exchanges of ``u0``."""

    def __init__(self, cost: CostModel, lengths: Sequence[int],
                 alphas: Sequence[Sequence[float]] | None = None,
                 host_gbps: float | None = None):
        alphas = alphas or [[0.0] * len(lengths) for _ in range(cost.pp)]
        offloaded = [[0.0] + [a * offloadable_bytes(cost, s, chunk) for a, chunk in
                              zip(alphas[s][1:], subsequence_chunks(lengths)[1:])]
                     for s in range(cost.pp)]
        super().__init__(cost, lengths, offloaded, None, host_gbps)
        self.share_alpha = [alphas[k][0] for k in range(cost.pp)]
        """Offload ratio of each member's share of ``u0`` on block ``k``."""
        hw, par = cost.hardware, cost.parallel
        inter = par.tp * par.pp > hw.gpus_per_node
        self.bandwidth = (hw.inter_node_gbps if inter else hw.intra_node_gbps) * GB
        self.latency = hw.inter_node_latency_s if inter else hw.intra_node_latency_s

    def _group(self, block: int) -> int:
        return self.cost.pp - block

    def _link(self, size: float) -> float:
        return self.latency + size / self.bandwidth

    def weight_bytes(self, block: int) -> float:
        """BF16 weights of block ``block`` on one GPU (its TP shard)."""
        m = self.cost.model
        params = self.cost.layers(block) * m.params_per_layer()
        if block == 0:
            params += m.vocab_size * m.hidden_size
        return ACT_BYTES * params / self.cost.parallel.tp

    def kv_bytes(self, block: int) -> float:
        """K/V of ``u0`` on block ``block`` (one GPU of the TP group)."""
        return self.cost.layers(block) * self.chunks[0].tokens * self.cost.kv_per_token

    def share_offload(self, block: int) -> float:
        """Bytes a member offloads of its share of ``u0`` on block ``block``."""
        return self.share_alpha[block] * offloadable_bytes(self.cost, block, self.chunks[0]) \
            / self._group(block)

    def duration(self, action: Action) -> float:
        if action.part is None:
            return super().duration(action)
        if action.is_memory():
            return self.share_offload(block_of(action)) / (self.host_gbps * GB)
        k, g = block_of(action), self._group(block_of(action))
        chunk = self.chunks[0]
        work = (self.cost.stage_forward(k, chunk) if action.kind is Kind.FORWARD
                else self.cost.stage_backward(k, chunk))
        time = work / g + (self._link(self.kv_bytes(k) * (g - 1) / g) if g > 1 else 0.0)
        if action.stage != k:
            time += self._link(self.weight_bytes(k)) * (1 if action.kind is Kind.FORWARD else 2)
        return time

    def transfer_time(self, action: Action) -> float:
        if action.part is None:
            return super().transfer_time(action)
        k = block_of(action)
        if action.tensor in (KV, DKV):
            return self._link(self.kv_bytes(k) / self._group(k))
        share = self.chunks[0].tokens / self._group(k)
        return self._link(ACT_BYTES * share * self.cost.model.hidden_size / self.cost.parallel.tp)

    def activation_bytes(self, action: Action) -> float:
        if action.part is None:
            return super().activation_bytes(action)
        if action.is_memory():
            return self.share_offload(block_of(action))
        k, g = block_of(action), self._group(block_of(action))
        chunk = self.chunks[0]
        resident = resident_bytes(self.cost, k, chunk)
        return offloadable_bytes(self.cost, k, chunk) / g + \
            (resident if action.stage == k else resident / g)


def compare(plan) -> tuple[SimResult, SimResult]:
    """Simulated runs of an ``sppo`` plan (:class:`sppo_offload.solver.MethodPlan`) without
    and with multiplexing: same layout, subsequences and offload ratios."""
    plain = simulate(plan.schedule, plan.costs)
    schedule = multiplexed_schedule(
        plan.layout.pp, len(plan.lengths),
        lambda a: plan.alphas[a.stage if a.part is None else block_of(a)][a.unit] > 0)
    multiplexed = simulate(schedule, MultiplexCosts(plan.costs.cost, plan.lengths, plan.alphas,
                                                    plan.costs.host_gbps))
    return plain, multiplexed
