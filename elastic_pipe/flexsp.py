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
  ZeRO-3).
- **Steps in lockstep.** ZeRO-3 over the whole cluster gathers every layer's weights before
  the layer runs and reduce-scatters its gradients after its backward (InfiniPipe L88, L358),
  each a collective of all ``gpus`` GPUs: no group can run a layer of its micro-batch before
  every group has joined that layer's gather. So the groups cannot run their own queues of
  micro-batches side by side and meet only at the end of the iteration; they run in steps,
  each step one micro-batch on every group (its documents packed into one, as DeepSpeed's,
  InfiniPipe L347), and a step takes its slowest group's time. This is FlexSP's own
  formulation as InfiniPipe describes it: SP groups chosen for each set of sequences, shorter
  ones on smaller groups (L360), with the imbalance across groups a step holds (L360, L378).
  The choice: the lockstep is priced per micro-batch, not per layer (the layers of one
  micro-batch cost alike, so the slowest group is the slowest at every layer).
- **A group's micro-batch.** At most its *capacity*: the context (the paper packs FlexSP's
  micro-batches as DeepSpeed's, L347) or, when less, the most tokens one micro-batch of the
  group fits in ``memory_gb`` with the fewest layers checkpointed that fit
  (:func:`elastic_pipe.baselines.packed_1f1b`, the DeepSpeed and Megatron-LM baselines' rule);
  a document longer than every group's capacity is refused. With ``checkpointed`` set, every
  micro-batch recomputes that many layers instead, one at a time as DeepSpeed and Megatron-LM
  recompute them (:func:`recomputing_fits`), its capacity what that memory holds: one
  configuration for the whole run, as the InfiniPipe paper runs its baselines (L347).
- **Iteration time.** Each step's slowest group's time, summed. The groups' ZeRO-3 gathers and
  reduce-scatters are taken as overlapped with compute (DeepSpeed prefetches them) and priced
  at none of their time, as for the DeepSpeed-Ulysses baseline (what is not hidden is the
  reproduction table's term, ``scripts/paper_terms.py``).
- **Forming the steps.** Documents that fit no group smaller than the whole cluster run first,
  in a step of one group of all the GPUs (a group alone has no one to wait for: its documents
  packed first-fit-decreasing into micro-batches run one after another). The others are
  spread over ``m`` steps, longest processing time first: each document to the step with the
  least work so far (its work: its time alone on the smallest group that holds it, times that
  group's GPUs) whose tokens stay within what one step can hold (the largest total capacity of
  a partition); ``m`` runs from the fewest steps those tokens need to that many plus
  :data:`EXTRA_STEPS`, and the plan with the smallest time wins.
- **A step's groups.** Every partition of ``gpus`` into powers of two (202 for 32 GPUs) whose
  capacities hold the step's tokens and longest document. For each, documents are assigned by
  longest processing time first: longest document first, to the group that would finish it
  earliest (its load plus the document's time there, the document timed alone by the cost
  model) among those with room for it, ties to the larger group; the :data:`FINALISTS`
  partitions with the smallest makespan are packed and timed exactly, the fastest kept.
  FlexSP solves a MILP over the same choices (group sizes, document-to-group assignment,
  balanced group times); this is a heuristic stand-in: it searches every group-size multiset
  the MILP could pick, and the greedy rule is the classic makespan approximation (within 4/3
  of the optimum for identical machines). Every document in the step of the whole cluster is
  the DeepSpeed-Ulysses baseline exactly (``layouts=[(gpus,)]`` gives it), and one of the
  candidates: FlexSP is never slower than it.
- **Balance.** InfiniPipe measured FlexSP's computation at 1.33-1.46x its own (DeepSpeed's at
  1.11x) and attributes it to unbalanced SP groups (L373-378): here the steps' imbalance, where
  a step's long documents set its time and its short ones do not fill the other groups to it
  (their capacity caps them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from elastic_pipe.baselines import first_fit, packed_1f1b, single_pipeline_plan
from elastic_pipe.evaluation import report
from elastic_pipe.plan_types import Plan
from elastic_pipe.scheduler import check_lengths, pipeline_case
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
    """Its packed micro-batches (one in a step of several groups, which run in lockstep; any
    number in a step of one group of all the GPUs), ``None`` for a group without documents."""

    @property
    def predicted_time_s(self) -> float:
        return 0.0 if self.plan is None else self.plan.predicted_time_s

    def simulated_time_s(self) -> float:
        """The simulator's time of the group's micro-batches (0 for an idle group)."""
        return 0.0 if self.plan is None else \
            report(self.plan, self.cost, with_schedule=False)["iteration_time_s"]


@dataclass(frozen=True)
class FlexSPPlan:
    """The steps of an iteration, each a set of SP groups running side by side in lockstep."""

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


def group_capacity(cost: CostModel, context: int, checkpointed: int | None = None) -> int:
    """The most tokens (at most ``context``) one micro-batch of ``cost``'s group fits, 0 when
    not even one token does (bisection: a micro-batch's memory grows with its tokens): with the
    fewest layers checkpointed that fit, or with ``checkpointed`` layers recomputed one at a
    time (:func:`recomputing_fits`)."""
    def fits(tokens: int) -> bool:
        if checkpointed is None:
            return packed_1f1b([tokens], cost, tokens) is not None
        return recomputing_fits(cost, tokens, checkpointed)

    if fits(context):
        return context
    low, high = 0, context
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def recomputing_fits(cost: CostModel, tokens: int, checkpointed: int) -> bool:
    """Whether one micro-batch of ``tokens`` fits ``cost``'s group (one stage) with
    ``checkpointed`` layers recomputed as DeepSpeed's and Megatron-LM's layer checkpointing
    recomputes them: a checkpointed layer keeps its input, and its other activations live
    again only while its own backward runs, one layer at a time. Two moments bound it, priced
    as the simulator prices Megatron's recomputation (:class:`longctx.chunk_costs.ChunkCosts`
    with ``per_layer_recompute``): the forward's end and the head's backward (the cost model's
    stash and the stage's workspace), and a layer's backward after the head has freed its share
    (the stash less :meth:`~longctx.cost_model.CostModel.head_bytes`, one layer
    rematerialised, :meth:`~longctx.cost_model.CostModel.recompute_boundary` and a layer's
    workspace)."""
    chunk = Chunk((Piece(0, 0, 0, tokens, True),))
    stash = cost.stash_bytes(0, chunk, checkpointed, per_layer=True)
    peak = stash + cost.stage_workspace(0, chunk)
    if checkpointed:
        peak = max(peak, stash - cost.head_bytes(0, chunk) + cost.layer_saving(chunk)
                   + cost.recompute_boundary(chunk) + cost.layer_workspace(chunk))
    return peak <= cost.activation_budget(0)


def layers_to_hold(cost: CostModel, tokens: int) -> int | None:
    """The fewest layers recomputed one at a time (:func:`recomputing_fits`) with which a
    micro-batch of ``tokens`` fits ``cost``'s group; ``None`` when even all of them do not."""
    return next((count for count in range(cost.layers(0) + 1)
                 if recomputing_fits(cost, tokens, count)), None)


def recomputing_plan(lengths: Sequence[int], cost: CostModel, capacity: int,
                     checkpointed: int) -> Plan:
    """Whole documents packed first-fit-decreasing into micro-batches of ``capacity`` tokens,
    each recomputing ``checkpointed`` layers (the memory is :func:`recomputing_fits`')."""
    items = [Piece(doc, 0, 0, length, final=True) for doc, length in enumerate(lengths)]
    case = pipeline_case(cost, first_fit(items, capacity), 0)
    table = ((checkpointed,) * case.problem.chunks,)
    return single_pipeline_plan(cost, case, table, 1)


def assign(lengths: Sequence[int], sizes: Sequence[int], capacity: dict[int, int],
           seconds: Callable[[int, int], float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Longest processing time first: each document, longest first (ties by index), goes to
    the group that would finish it earliest -- its load plus ``seconds(size, length)`` --
    among the groups with room for it (their documents' tokens and its own within
    ``capacity`` of the group's size: one micro-batch), ties to the larger group, then the
    earlier.

    Returns each document's group index and the groups' loads; ``ValueError`` when a document
    finds no group with room."""
    order = sorted(range(len(lengths)), key=lambda doc: (-lengths[doc], doc))
    groups = [0] * len(lengths)
    loads = [0.0] * len(sizes)
    tokens = [0] * len(sizes)
    for doc in order:
        best = None
        for index, size in enumerate(sizes):
            if tokens[index] + lengths[doc] <= capacity[size]:
                key = (loads[index] + seconds(size, lengths[doc]), -size, index)
                if best is None or key < best:
                    best = key
        if best is None:
            raise ValueError(f"document {doc} of {lengths[doc]} tokens finds no room in the "
                             f"groups {tuple(sizes)} (capacities {capacity})")
        finish, _, index = best
        groups[doc], loads[index] = index, finish
        tokens[index] += lengths[doc]
    return tuple(groups), tuple(loads)


def spread(lengths: Sequence[int], docs: Sequence[int], steps: int, budget: int,
           work: Callable[[int], float]) -> list[list[int]] | None:
    """``docs`` over ``steps`` steps, longest processing time first: each document (longest
    first, ties by index) to the step with the least ``work`` so far whose tokens stay within
    ``budget`` with it (ties to the earlier); ``None`` when one finds no such step."""
    parts: list[list[int]] = [[] for _ in range(steps)]
    loads = [(0.0, step, 0) for step in range(steps)]
    for doc in sorted(docs, key=lambda d: (-lengths[d], d)):
        room = [entry for entry in loads if entry[2] + lengths[doc] <= budget]
        if not room:
            return None
        load, step, tokens = min(room)
        loads[step] = (load + work(doc), step, tokens + lengths[doc])
        parts[step].append(doc)
    return [sorted(part) for part in parts if part]


EXTRA_STEPS = 4
"""Step counts tried beyond the fewest the documents' tokens need (module doc)."""
FINALISTS = 3
"""Partitions of a step, by the assignment's makespan, packed and timed exactly."""


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
                layouts: Sequence[tuple[int, ...]] | None = None,
                checkpointed: int | None = None) -> FlexSPPlan:
    """The fastest FlexSP plan (by predicted time) of the documents of ``lengths`` (truncated
    to ``context``) over the group-size multisets ``layouts`` (default: every partition of
    ``gpus`` into powers of two), its steps formed as the module doc says. ``model``'s head
    count must be divisible by every group size. Each micro-batch checkpoints the fewest
    layers that fit, or with ``checkpointed`` every micro-batch recomputes that many layers,
    one at a time (:func:`recomputing_fits`: one configuration for the whole run, as the
    InfiniPipe paper runs its baselines, L347).

    Raises ``ValueError`` for a document longer than the context or than what the largest
    group fits in ``memory_gb``, or a batch that no step count fits into ``layouts``."""
    _check_batch(lengths, gpus, context)
    layouts = [tuple(sorted(layout, reverse=True))
               for layout in (partitions(gpus) if layouts is None else layouts)]
    costs = {size: group_cost(model, hardware, size, gpus, memory_gb)
             for size in sorted({size for layout in layouts for size in layout})}
    capacity = {size: group_capacity(cost, context, checkpointed)
                for size, cost in costs.items()}
    _check_capacity(lengths, capacity, memory_gb)
    alone: dict[tuple[int, int], float] = {}

    def seconds(size: int, length: int) -> float:
        if (size, length) not in alone:
            alone[size, length] = costs[size].stage_time(
                0, Chunk((Piece(0, 0, 0, length, True),)), checkpointed or 0)
        return alone[size, length]

    def groups_of(docs: Sequence[int], sizes: tuple[int, ...],
                  owner: Sequence[int]) -> tuple[Group, ...]:
        groups = []
        for index, size in enumerate(sizes):
            mine = tuple(doc for doc, group in zip(docs, owner) if group == index)
            mine_lengths = [lengths[doc] for doc in mine]
            plan = None if not mine else \
                packed_1f1b(mine_lengths, costs[size], capacity[size]) if checkpointed is None \
                else recomputing_plan(mine_lengths, costs[size], capacity[size], checkpointed)
            if mine and plan is None:
                raise RuntimeError(f"SP {size}: micro-batches of at most {capacity[size]} "
                                   f"tokens do not fit, yet one of that many tokens does")
            groups.append(Group(size, mine, costs[size], plan))
        return tuple(groups)

    def lockstep(docs: Sequence[int]) -> tuple[Group, ...] | None:
        """The step's fastest groups, one micro-batch each; ``None`` when no layout holds
        the documents."""
        need, longest = sum(lengths[doc] for doc in docs), max(lengths[doc] for doc in docs)
        tried = []
        for sizes in layouts:
            if sum(capacity[size] for size in sizes) < need or \
                    max(capacity[size] for size in sizes) < longest:
                continue
            try:
                owner, loads = assign([lengths[doc] for doc in docs], sizes, capacity, seconds)
            except ValueError:
                continue
            tried.append((max(loads), sizes, owner))
        tried.sort(key=lambda found: found[0])
        steps = [groups_of(docs, sizes, owner) for _, sizes, owner in tried[:FINALISTS]]
        return min(steps, key=lambda groups: FlexSPPlan((groups,), capacity).predicted_time_s,
                   default=None)

    def whole(docs: Sequence[int]) -> tuple[Group, ...]:
        """One group of all the GPUs running the documents' micro-batches in turn."""
        return groups_of(docs, (gpus,), [0] * len(docs))

    everything = range(len(lengths))
    smaller = max((capacity[size] for size in capacity if size < gpus), default=0)
    forced = [doc for doc in everything if lengths[doc] > smaller]
    rest = [doc for doc in everything if lengths[doc] <= smaller]
    head = (whole(forced),) if forced else ()
    candidates = [FlexSPPlan((whole(list(everything)),), capacity)] \
        if (gpus,) in layouts else []
    if rest:
        budget = max(sum(capacity[size] for size in sizes) for sizes in layouts)
        smallest = {length: min(size for size in capacity if capacity[size] >= length)
                    for length in {lengths[doc] for doc in rest}}

        def work(doc: int) -> float:
            size = smallest[lengths[doc]]
            return size * seconds(size, lengths[doc])

        fewest = -(-sum(lengths[doc] for doc in rest) // budget)
        for count in range(fewest, fewest + EXTRA_STEPS + 1):
            parts = spread(lengths, rest, count, budget, work)
            steps = None if parts is None else [lockstep(part) for part in parts]
            if steps is not None and all(step is not None for step in steps):
                candidates.append(FlexSPPlan(head + tuple(steps), capacity))
    elif forced:
        candidates.append(FlexSPPlan(head, capacity))
    if not candidates:
        raise ValueError(f"no step count from the fewest to {EXTRA_STEPS} more fits the batch "
                         f"into the layouts {layouts}; allow more layouts (the default: every "
                         f"partition of {gpus} into powers of two)")
    return min(candidates, key=lambda plan: plan.predicted_time_s)
