"""A FlexSP-style baseline: heterogeneous Ulysses sequence-parallel groups under ZeRO-3.

FlexSP (Wang et al., ASPLOS'25) splits the cluster into Ulysses SP groups of different sizes
that run side by side, each on its own share of the batch: short documents go to small groups
(all-to-all inside a node, or none), long ones to large groups spanning nodes. It is priced here
by the project's cost model and simulator, with the choices below:

- **Layout.** Group sizes are powers of two that partition the ``gpus`` GPUs (a multiset from
  one group of all of them to ``gpus`` groups of one). Each group is the cost model's
  ``ParallelConfig(pp=1, sp=size, dp=gpus // size, zero3=True)``: ZeRO-3 shards weights,
  gradients and optimizer states over the whole cluster (InfiniPipe L358), whatever the group's
  size. A group of all the GPUs is exactly the DeepSpeed-Ulysses baseline's layout (SP 32,
  ZeRO-3), so FlexSP is never slower than it.
- **A group's time.** Its documents (in batch order) packed first-fit-decreasing into
  micro-batches of at most its *capacity*, run one after another, with the fewest layers
  checkpointed that fit (:func:`elastic_pipe.baselines.packed_1f1b`, the DeepSpeed and
  Megatron-LM baselines' rule). The capacity is the context (the paper packs FlexSP's
  micro-batches as DeepSpeed's, L347) or, when less, the most tokens one micro-batch of the group
  fits in ``memory_gb`` (a micro-batch of whole documents needs memory for its tokens only, so
  every packed micro-batch fits); a document longer than every group's capacity is refused.
- **Steps.** FlexSP re-plans its groups for each step of an iteration. Here an iteration is
  one step over the whole batch, or -- when some documents fit no group smaller than the whole
  cluster -- two: those documents first on one group of all the GPUs, then the rest; the faster
  of the two by predicted time. (One long document would otherwise hold every GPU in one
  group for the whole batch.) Each step's groups start together.
- **Iteration time.** Each step's slowest group's time, summed, plus what is not overlapped.
  The groups' ZeRO-3 gathers and reduce-scatters span the cluster; the cost model takes them as
  overlapped with compute (DeepSpeed prefetches them) and prices none of their time, as it does
  for the DeepSpeed-Ulysses baseline -- so nothing is added.
- **Search.** A step tries every partition of ``gpus`` into powers of two (202 for 32 GPUs)
  whose largest group holds its longest document. For each, documents are assigned by longest
  processing time first: longest document first, to the group that would finish it earliest
  (its load plus the document's time there, the document timed alone as one micro-batch by the
  cost model) among those whose capacity holds it, ties to the larger group; then each group's
  exact time is computed as above. The partition with the smallest slowest-group time wins.
  FlexSP solves a MILP over the same choices (group sizes, document-to-group assignment,
  balanced group times); this is a heuristic stand-in, not a weakened one: it searches every
  group-size multiset the MILP could pick, and the greedy rule is the classic makespan
  approximation (within 4/3 of the optimum for identical machines) on a batch of hundreds of
  documents where a few long ones dominate and are placed first. Its result is never worse than
  the one-group (DeepSpeed-Ulysses) layout, which is one of the candidates.
- **Balance.** The search times groups with the same cost model the simulator runs, so a
  step's groups finish within a few percent of each other. InfiniPipe measured FlexSP's
  computation at 1.33-1.46x its own (DeepSpeed's at 1.11x) and attributes it to unbalanced SP
  groups (L373-378) without saying how large the imbalance is for a batch or what leaves it;
  no imbalance beyond this planner's is modelled (``docs/papers.md``).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from elastic_pipe.baselines import packed_1f1b
from elastic_pipe.evaluation import report
from elastic_pipe.plan_types import Plan
from elastic_pipe.scheduler import check_lengths
from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig


@dataclass(frozen=True)
class Group:
    """One SP group of a FlexSP plan."""

    size: int
    """GPUs of the group (its Ulysses degree)."""
    documents: tuple[int, ...]
    """Indices (in the batch) of the documents it trains, in batch order."""
    cost: CostModel
    """The group's cost model (``sp = size``, ZeRO-3 over all the GPUs)."""
    plan: Plan | None
    """Its packed micro-batches, ``None`` for a group without documents."""

    @property
    def predicted_time_s(self) -> float:
        return 0.0 if self.plan is None else self.plan.predicted_time_s

    def simulated_time_s(self) -> float:
        """The simulator's time of the group's micro-batches (0 for an idle group)."""
        return 0.0 if self.plan is None else \
            report(self.plan, self.cost, with_schedule=False)["iteration_time_s"]


@dataclass(frozen=True)
class FlexSPPlan:
    """The steps of an iteration, each a set of SP groups running side by side."""

    steps: tuple[tuple[Group, ...], ...]
    """In execution order; each step's groups largest first."""
    capacity: dict[int, int]
    """Tokens a micro-batch of a group of each size holds (context- or memory-bound)."""

    @property
    def sizes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(group.size for group in step) for step in self.steps)

    @property
    def predicted_time_s(self) -> float:
        """Each step's slowest group's predicted time, summed (exposed ZeRO-3 traffic: none,
        see above)."""
        return sum(max(group.predicted_time_s for group in step) for step in self.steps)

    def iteration_time_s(self) -> float:
        """Each step's slowest group's simulated time, summed."""
        return sum(max(group.simulated_time_s() for group in step) for step in self.steps)

    def assignment(self) -> dict[int, tuple[int, int]]:
        """Document index -> (step, group index in the step)."""
        return {doc: (number, index) for number, step in enumerate(self.steps)
                for index, group in enumerate(step) for doc in group.documents}


def partitions(gpus: int, largest: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every multiset of powers of two summing to ``gpus``, parts at most ``largest``, each in
    non-increasing order, largest parts first."""
    if gpus == 0:
        yield ()
        return
    size = 1 << (gpus.bit_length() - 1) if largest is None else largest
    while size > gpus:
        size //= 2
    while size >= 1:
        for rest in partitions(gpus - size, size):
            yield (size,) + rest
        size //= 2


def group_cost(model: ModelConfig, hardware: HardwareProfile, size: int, gpus: int,
               memory_gb: float) -> CostModel:
    """The cost model of an SP group of ``size`` GPUs, ZeRO-3 sharded over all ``gpus``."""
    return CostModel(model, hardware, ParallelConfig(pp=1, sp=size, dp=gpus // size,
                                                     zero3=True, memory_gb=memory_gb))


def group_capacity(cost: CostModel, context: int) -> int:
    """The most tokens (at most ``context``) one micro-batch of ``cost``'s group fits, 0 when
    not even one token does (bisection: a micro-batch's memory grows with its tokens)."""
    def fits(tokens: int) -> bool:
        return packed_1f1b([tokens], cost, tokens) is not None

    if fits(context):
        return context
    low, high = 0, context
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def assign(lengths: Sequence[int], sizes: Sequence[int], capacity: dict[int, int],
           seconds: Callable[[int, int], float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Longest processing time first: each document, longest first (ties by index), goes to
    the group that would finish it earliest -- its load plus ``seconds(size, length)`` --
    among the groups whose ``capacity`` holds it, ties to the larger group, then the earlier.

    Returns each document's group index and the groups' loads. Groups of one size are
    interchangeable, so only the least loaded of each size is a candidate."""
    heaps = {size: [] for size in sizes}
    for index, size in enumerate(sizes):
        heapq.heappush(heaps[size], (0.0, index))
    order = sorted(range(len(lengths)), key=lambda doc: (-lengths[doc], doc))
    groups = [0] * len(lengths)
    loads = [0.0] * len(sizes)
    for doc in order:
        best = None
        for size in sorted(heaps, reverse=True):
            if lengths[doc] <= capacity[size]:
                load, index = heaps[size][0]
                finish = load + seconds(size, lengths[doc])
                if best is None or finish < best[0]:
                    best = (finish, size, index)
        if best is None:
            raise ValueError(f"document {doc} of {lengths[doc]} tokens fits no group of "
                             f"{tuple(sizes)} (capacities {capacity})")
        finish, size, index = best
        heapq.heapreplace(heaps[size], (finish, index))
        groups[doc], loads[index] = index, finish
    return tuple(groups), tuple(loads)


def _check_batch(lengths: Sequence[int], gpus: int, context: int) -> None:
    """Refuse a batch or GPU count FlexSP cannot plan, saying what to change."""
    check_lengths(lengths)
    if gpus < 1 or gpus & (gpus - 1):
        raise ValueError(f"gpus must be a power of two (ZeRO-3 shards over gpus / size "
                         f"replicas of each group), got {gpus}")
    if max(lengths) > context:
        raise ValueError(f"a document of {max(lengths)} tokens exceeds the context {context}; "
                         f"truncate the lengths first")


def _check_capacity(lengths: Sequence[int], capacity: dict[int, int], memory_gb: float) -> None:
    """Refuse a batch whose longest document fits no SP group's micro-batch."""
    if max(lengths) > max(capacity.values()):
        doc = max(range(len(lengths)), key=lambda d: lengths[d])
        largest = max(capacity, key=capacity.get)
        raise ValueError(f"document {doc} of {lengths[doc]} tokens fits no SP group: the "
                         f"largest, SP {largest}, holds at most {capacity[largest]} tokens a "
                         f"micro-batch in {memory_gb:g} GB per GPU; add GPUs, raise the memory "
                         f"or truncate to a shorter context")


def plan_flexsp(lengths: Sequence[int], model: ModelConfig, hardware: HardwareProfile,
                gpus: int, memory_gb: float, context: int,
                layouts: Sequence[tuple[int, ...]] | None = None) -> FlexSPPlan:
    """The fastest FlexSP plan (by predicted time) of the documents of ``lengths`` (truncated
    to ``context``) over the group-size multisets ``layouts`` (default: every partition of
    ``gpus`` into powers of two). ``model``'s head count must be divisible by every group size.

    Raises ``ValueError`` for a document longer than the context or than what the largest
    group fits in ``memory_gb``."""
    _check_batch(lengths, gpus, context)
    layouts = [tuple(sorted(layout, reverse=True))
               for layout in (partitions(gpus) if layouts is None else layouts)]
    costs = {size: group_cost(model, hardware, size, gpus, memory_gb)
             for size in sorted({size for layout in layouts for size in layout})}
    capacity = {size: group_capacity(cost, context) for size, cost in costs.items()}
    _check_capacity(lengths, capacity, memory_gb)
    alone: dict[tuple[int, int], float] = {}

    def seconds(size: int, length: int) -> float:
        if (size, length) not in alone:
            alone[size, length] = costs[size].stage_time(
                0, Chunk((Piece(0, 0, 0, length, True),)))
        return alone[size, length]

    def step(docs: Sequence[int], sizes: tuple[int, ...]) -> tuple[Group, ...]:
        owner, _ = assign([lengths[doc] for doc in docs], sizes, capacity, seconds)
        groups = []
        for index, size in enumerate(sizes):
            mine = tuple(doc for doc, group in zip(docs, owner) if group == index)
            plan = packed_1f1b([lengths[doc] for doc in mine], costs[size], capacity[size]) \
                if mine else None
            if mine and plan is None:
                raise RuntimeError(f"SP {size}: micro-batches of at most {capacity[size]} "
                                   f"tokens do not fit, yet one of that many tokens does")
            groups.append(Group(size, mine, costs[size], plan))
        return tuple(groups)

    def best_step(docs: Sequence[int]) -> tuple[Group, ...]:
        longest = max(lengths[doc] for doc in docs)
        steps = [step(docs, sizes) for sizes in layouts
                 if max(capacity[size] for size in sizes) >= longest]
        return min(steps, key=lambda groups: FlexSPPlan((groups,), capacity).predicted_time_s)

    everything = range(len(lengths))
    candidates = [FlexSPPlan((best_step(everything),), capacity)]
    smaller = max((capacity[size] for size in capacity if size < gpus), default=0)
    forced = [doc for doc in everything if lengths[doc] > smaller]
    if (gpus,) in layouts and 0 < len(forced) < len(lengths):
        rest = [doc for doc in everything if lengths[doc] <= smaller]
        candidates.append(FlexSPPlan((step(forced, (gpus,)), best_step(rest)), capacity))
    return min(candidates, key=lambda plan: plan.predicted_time_s)
