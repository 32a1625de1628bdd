"""Multiplexed sequence partitioning: the edge subsequence computed by the stages that would idle.

In the subsequence pipeline (:mod:`sppo_offload.pipeline`) stage ``k`` idles for ``k`` forwards
while the first subsequence travels down the pipeline (warm-up) and for ``p - 1 - k`` backwards
at the end while the first subsequence's gradient travels back (cool-down). Multiplexing splits
that edge subsequence (``u0``, ``T`` tokens) further, over sequence-parallel groups made of the
idle stages:

- **Left-SP** (warm-up): the forward of ``u0`` through stage ``k``'s layers (block ``k``) runs
  on the group ``G_k = {k, ..., p-1}``; member ``k + i`` computes the ``i``-th of ``|G_k|``
  contiguous, near-equal token ranges of ``u0`` (:func:`share_bounds`), the owner ``k`` the
  first. Stages after ``k`` have nothing of their own to do yet; stage ``k`` is free after its
  share and starts the steady pipeline early. From block ``k`` to block ``k + 1`` the owner
  drops out and the ranges widen: every member of ``G_k`` keeps the part of its output that its
  range for block ``k + 1`` still covers and sends the rest -- a suffix, the owner's whole
  output -- to the next stage (:func:`pieces`; ``T >= p (p - 1)`` keeps every piece
  non-empty). In the IR a piece is a transfer of tensor ``h<s>to<t>`` named by its consumer's
  part, ``1RECV_F0.mux1<0:h0to1``; block ``p - 1`` is stage ``p - 1`` alone, the plain forward
  of ``u0`` with the loss.
- **Steady**: subsequences ``1 .. N-1`` as in the plain pipeline (forwards in order, backwards
  last-first), with their offloads and reloads.
- **Right-SP** (cool-down): the backward of ``u0`` through block ``k`` runs on the same group
  ``G_k``, where the forward left each member's share of the activations, block ``p - 1``
  first (stage ``p - 1`` finishes its steady backwards first) down to block 0 on all stages.
  The gradient of a piece ``h<s>to<t>`` goes back as ``d<s>to<t>``.

Inside a share (the collectives run within its compute action, over the group's own process
group, in the same order on every member: blocks in ascending order in Left-SP, descending in
Right-SP, layer by layer inside a block):

- **Weights**: chosen: the owner broadcasts block ``k``'s parameters (its TP shard; block 0
  includes the embedding tables) to the helpers at the start of the Left-SP share, after
  waiting for their all-gather as its modules' forwards would (``--overlap-param-gather``:
  :mod:`megatron.plugin.pipeline.param_gather`); a helper
  runs its own layer modules with those tensors and keeps them, referenced by its share's saved
  activations, until its Right-SP backward, which ends with a reduction of the helpers'
  weight-gradient shares into the owner's parameters (where autograd, and Megatron DDP's
  hooks, accumulate them as from the owner's own backward). So one broadcast and one reduction
  per block and iteration, and the borrowed weights count as the helper's memory between them.
- **K/V**: each layer all-gathers ``u0``'s K/V over the group; a member attends to the gathered
  K/V of the ranges before its own as context (the K/V-context attention of the slices) and to
  its own causally. The owner records the gathered K/V in its K/V store as ``u0``'s, which
  every later subsequence on stage ``k`` attends to; the dK/dV those steady backwards
  accumulate enter the owner's share backward, whose per-layer reduction of the gathered K/V's
  gradient hands every member the dK/dV of its own range.

Offloading: the steady subsequences offload as in the plain pipeline; the shares of ``u0``
are not offloaded (``u0`` is the one subsequence whose backward comes last anyway).

Costs (:class:`MultiplexCosts`): a share costs its ``1/|G_k|`` of the block's work plus, in a
group of two or more, the K/V exchange (``(|G_k| - 1) / |G_k|`` of the block's K/V bytes) and
the weight broadcast (forward) or reduction (backward) of the block's weight bytes on the
stage-to-stage link; the collectives are priced inside each member's compute, not synchronised
across the members. A share stashes its range's offloadable activations, the whole gathered
K/V, and on a helper the borrowed weights.

IR: the shares are ``FORWARD`` / ``BACKWARD`` actions of unit 0 with part ``.mux<k>`` on the
member's own stage; :class:`MultiplexFlow` tells the validator which compute produces and
consumes each piece. :mod:`sppo_offload.mux_runtime` runs this IR for real (``--sppo-multiplex``).
"""
from __future__ import annotations

from typing import Sequence

from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import SimResult, simulate
from megatron.plugin.pipeline.validation import LayerwiseFlow, validate

from longctx.cost_model import GB, CostModel

from sppo_offload.costs import SequenceCosts, subsequence_chunks
from sppo_offload.offload import offloadable_bytes, resident_bytes
from sppo_offload.pipeline import add_offload


def mux(block: int) -> str:
    """Part name of a share of ``u0`` on block ``block``'s layers."""
    return f".mux{block}"


def block_of(action: Action) -> int:
    return int(action.part[len(".mux"):])


def piece_name(source: int, target: int) -> str:
    """Tensor name of the piece of ``u0`` stage ``source`` hands stage ``target``."""
    return f"h{source}to{target}"


def grad_name(source: int, target: int) -> str:
    """Tensor name of the gradient of :func:`piece_name` ``(source, target)``."""
    return f"d{source}to{target}"


def min_tokens(pp: int) -> int:
    """Fewest tokens of ``u0`` for which every range and every sent piece is non-empty."""
    return pp * (pp - 1)


def share_bounds(tokens: int, pp: int, block: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``u0``'s tokens per member ``block .. pp-1`` of block ``block``."""
    size = pp - block
    return [(i * tokens // size, (i + 1) * tokens // size) for i in range(size)]


def pieces(tokens: int, pp: int, block: int) -> list[tuple[int, int, int, int]]:
    """``(source stage, target stage, start, stop)``: how block ``block``'s outputs become
    block ``block + 1``'s inputs (every non-empty overlap of a source's range with a target's),
    in token order."""
    old = share_bounds(tokens, pp, block)
    new = share_bounds(tokens, pp, block + 1)
    found = []
    for i, (a, b) in enumerate(old):
        for j, (c, d) in enumerate(new):
            if max(a, c) < min(b, d):
                found.append((block + i, block + 1 + j, max(a, c), min(b, d)))
    return found


def piece_tokens(transfer: Action, tokens: int, pp: int) -> int:
    """Tokens a piece transfer (or its gradient) of a ``tokens``-token ``u0`` carries."""
    forward = transfer.kind in (Kind.SEND_F, Kind.RECV_F)
    block = block_of(transfer) - (1 if forward else 0)
    source = transfer.stage if transfer.kind in (Kind.SEND_F, Kind.RECV_B) else transfer.peer
    target = transfer.peer if source == transfer.stage else transfer.stage
    return sum(stop - start for s, t, start, stop in pieces(tokens, pp, block)
               if (s, t) == (source, target))


class MultiplexFlow(LayerwiseFlow):
    """Producers and consumers of the pieces of ``u0`` (a piece is named by its consumer's
    part, see the module doc)."""

    def producer(self, transfer: Action) -> tuple:
        if transfer.part is None:
            return super().producer(transfer)
        k = block_of(transfer)
        if transfer.kind in (Kind.SEND_F, Kind.RECV_F):
            return Kind.FORWARD, 0, mux(k - 1)
        return Kind.BACKWARD, 0, mux(k + 1)

    def consumer(self, transfer: Action) -> tuple:
        if transfer.part is None:
            return super().consumer(transfer)
        kind = Kind.FORWARD if transfer.kind in (Kind.SEND_F, Kind.RECV_F) else Kind.BACKWARD
        return kind, 0, transfer.part


def multiplexed_schedule(pp: int, num_subsequences: int,
                         offloaded=lambda action: False) -> Schedule:
    """The validated multiplexed schedule; ``offloaded(forward)`` marks the steady forwards to
    offload (placement as in :func:`sppo_offload.pipeline.add_offload`; shares of ``u0`` are
    never offloaded)."""
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
                row.append(Action(h, Kind.RECV_F, 0, mux(k), h - 1, piece_name(h - 1, h)))
            row.append(Action(h, Kind.FORWARD, 0, mux(k)))
            if h < p - 1:
                row.append(Action(h, Kind.SEND_F, 0, mux(k + 1), h + 1, piece_name(h, h + 1)))
        row += steady[h]
        for k in range(h, -1, -1):
            if h < p - 1:
                row.append(Action(h, Kind.RECV_B, 0, mux(k), h + 1, grad_name(h, h + 1)))
            row.append(Action(h, Kind.BACKWARD, 0, mux(k)))
            if k >= 1:
                row.append(Action(h, Kind.SEND_B, 0, mux(k - 1), h - 1, grad_name(h - 1, h)))
        schedule.append(row)
    schedule = add_offload(schedule, lambda a: a.part is None and offloaded(a))
    validate(schedule, flow=MultiplexFlow())
    return schedule


class MultiplexCosts(SequenceCosts):
    """:class:`SequenceCosts` plus the shares of ``u0``, their collectives and pieces."""

    def __init__(self, cost: CostModel, lengths: Sequence[int],
                 alphas: Sequence[Sequence[float]] | None = None,
                 host_gbps: float | None = None):
        alphas = alphas or [[0.0] * len(lengths) for _ in range(cost.pp)]
        offloaded = [[0.0] + [a * offloadable_bytes(cost, s, chunk) for a, chunk in
                              zip(alphas[s][1:], subsequence_chunks(lengths)[1:])]
                     for s in range(cost.pp)]
        super().__init__(cost, lengths, offloaded, None, host_gbps)
        hw, par = cost.hardware, cost.parallel
        inter = par.tp * par.pp > hw.gpus_per_node
        self.bandwidth = (hw.cross_node_gbps if inter else hw.intra_node_gbps) * GB
        self.latency = hw.inter_node_latency_s if inter else hw.intra_node_latency_s

    def _group(self, block: int) -> int:
        return self.cost.pp - block

    def _link(self, size: float) -> float:
        return self.latency + size / self.bandwidth

    def weight_bytes(self, block: int) -> float:
        """Weights of block ``block`` on one GPU (its TP shard), in the model's dtype."""
        m = self.cost.model
        params = self.cost.layers(block) * m.params_per_layer()
        if block == 0:
            params += m.vocab_size * m.hidden_size
        return m.element_bytes * params / self.cost.parallel.tp

    def kv_bytes(self, block: int) -> float:
        """K/V of ``u0`` on block ``block`` (one GPU of the TP group), live bytes (what a link
        moves: the cost model's figure less the allocator's overhead)."""
        return self.cost.layers(block) * self.chunks[0].tokens * self.cost.kv_per_token \
            / self.cost.allocator

    def duration(self, action: Action) -> float:
        if action.part is None:
            return super().duration(action)
        k, g = block_of(action), self._group(block_of(action))
        chunk = self.chunks[0]
        work = (self.cost.stage_forward(k, chunk) if action.kind is Kind.FORWARD
                else self.cost.stage_backward(k, chunk))
        if g == 1:
            return work
        return work / g + self._link(self.kv_bytes(k) * (g - 1) / g) + \
            self._link(self.weight_bytes(k))

    def transfer_time(self, action: Action) -> float:
        if action.part is None:
            return super().transfer_time(action)
        tokens = piece_tokens(action, self.chunks[0].tokens, self.cost.pp)
        model = self.cost.model
        return self._link(model.element_bytes * tokens * model.hidden_size / self.cost.parallel.tp)

    def activation_bytes(self, action: Action) -> float:
        if action.part is None:
            return super().activation_bytes(action)
        k, g = block_of(action), self._group(block_of(action))
        chunk = self.chunks[0]
        borrowed = self.weight_bytes(k) if action.stage != k else 0.0
        return offloadable_bytes(self.cost, k, chunk) / g + resident_bytes(self.cost, k, chunk) \
            + borrowed


def _multiplexed_run(cost: CostModel, lengths: Sequence[int],
                     alphas: Sequence[Sequence[float]], host_gbps: float | None) -> SimResult:
    schedule = multiplexed_schedule(cost.pp, len(lengths), lambda a: alphas[a.stage][a.unit] > 0)
    return simulate(schedule, MultiplexCosts(cost, lengths, alphas, host_gbps))


def multiplexed_peaks(cost: CostModel, lengths: Sequence[int],
                      alphas: Sequence[Sequence[float]],
                      host_gbps: float | None = None) -> list[float]:
    """Simulated peak device bytes per stage of one sequence cut into ``lengths`` under the
    multiplexed schedule (the helpers also hold the weights they borrow); the copies at
    ``host_gbps`` as in :func:`sppo_offload.batch_plan.replay` (default: the profile's link)."""
    link = cost.hardware.host_gbps_per_gpu if host_gbps is None else host_gbps
    return list(_multiplexed_run(cost, lengths, alphas, link).peak_memory)


def compare(plan) -> tuple[SimResult, SimResult]:
    """Simulated runs of an ``sppo`` plan (:class:`sppo_offload.solver.MethodPlan`) without
    and with multiplexing: same layout, subsequences and offload ratios."""
    plain = simulate(plan.schedule, plan.costs)
    multiplexed = _multiplexed_run(plan.costs.cost, plan.lengths, plan.alphas,
                                   plan.costs.host_gbps)
    return plain, multiplexed
