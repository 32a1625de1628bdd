"""Megatron-LM's own variable-length configurations as baselines, priced by the project's cost
model and simulator, each with Megatron-LM's memory terms.

Configurations (each a :data:`CONFIGS` entry, priced by :func:`price`):

- ``static-cp`` -- packing with per-document attention and a fixed context-parallel size
  (``--context-parallel-size``, THD with per-sequence zigzag balancing, megatron-core 0.19's
  inter-document masking): whole documents packed best-fit-decreasing into ``--seq-length``
  rows (what this project's ``default`` schedule runs,
  :func:`~elastic_pipe.sequence_processor.megatron_chunking`), the rows dealt to the
  data-parallel replicas in turn, each replica a 1F1B pipeline of its rows. Zigzag balancing
  splits every document's causal work evenly over the ring, which is what the cost model's
  ``cp`` prices (compute and activations over ``cp``, the ring's K/V passes exposed beyond
  the attention).
- ``dp-balanced`` -- ``--sequence-packing-scheduler dp_balanced`` at a fixed CP size: the packs
  of :func:`elastic_pipe.megatron_packing.dp_balanced`, replica ``d`` running pack ``i dp + d``
  of every micro-batch, each replica a 1F1B pipeline of its packs.
- ``dynamic-cp`` -- ``--dynamic-context-parallel --sequence-packing-scheduler
  default_dynamic_cp``: the micro-batches of :func:`elastic_pipe.megatron_packing.dynamic_cp`
  over the ``dp x cp`` ranks of each stage, one 1F1B pipeline of them. A micro-batch's groups
  run side by side and their rings do not wait for each other, but the next micro-batch's
  groups are made of other ranks, so the choice here: a micro-batch (on a stage) takes its
  slowest group's time and its largest group's stash, as a step in lockstep (an upper bound on
  the dependency graph's time and on each rank's memory). Each group is priced by the cost
  model at its own CP size (``ParallelConfig(cp=size, dp=dp x cp / size)``: the model state
  sharded as at the run's layout).
- ``chunked-pp`` -- Megatron-LM PR #3116 (open; ``--chunked-pipeline-model-parallel-splits
  k``): every ``--seq-length`` row split along the sequence into ``k`` equal spans run as
  1F1B units with a K/V cache of the row's earlier spans, the warm-up ``k - 1`` units deeper
  (Seq1F1B with Megatron's fixed splits). Its data iterator splits the ``[b, s]`` tokens and
  refuses an attention mask, so a row has no per-document masking: the row is priced as one
  causal sequence, its documents concatenated as Megatron's ``GPTDataset`` builds rows (the
  batch's tokens cut into ``ceil(tokens / seq_length)`` rows). PR #3116 refuses full
  recomputation with it, so nothing is recomputed; context parallelism is not combined with
  it here (``cp = 1``).

Recomputation (the other three): Megatron-LM's ``--recompute-granularity full
--recompute-method block --recompute-num-layers k`` (each stage's first ``k`` layers, one at a
time in the backward), ``k`` the smallest that fits on every stage and replica, as a user
tunes it. The iteration time is the slowest replica's simulated pipeline; where nothing fits
the configuration is ``None``. Gradient all-reduce and the packing schedulers' data exchange
are not priced (as for every schedule compared with them).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.plugin.pipeline.passes import add_communication, add_recomputation
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import simulate

from elastic_pipe import checkpointing
from elastic_pipe.baselines import fixed_chunks, single_pipeline_plan
from elastic_pipe.evaluation import report
from elastic_pipe.megatron_packing import dp_balanced, dynamic_cp
from elastic_pipe.scheduler import pipeline_case
from elastic_pipe.sequence_processor import ChunkingConfig, megatron_chunking
from longctx import collectives
from longctx.chunk_costs import ChunkCosts
from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig

CONFIGS = ("static-cp", "dp-balanced", "dynamic-cp", "chunked-pp")


@dataclass(frozen=True)
class Layout:
    """A Megatron-LM parallel layout of ``tp x cp x pp x dp`` GPUs."""

    tp: int
    cp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}"


@dataclass(frozen=True)
class Priced:
    """One configuration at one layout and setting, simulated."""

    config: str
    layout: Layout
    setting: dict
    """The configuration's own knobs: ``max_seqlen_per_dp_cp_rank``, ``splits``,
    ``recompute_num_layers``."""
    iteration_time_s: float
    micro_batches: int
    """Micro-batches (units) of the slowest replica's pipeline."""
    peak_memory_gb: float
    """The largest stage peak, model state included."""
    compute_s: float
    """The slowest replica's compute seconds a stage, the mean over its stages (the rest of
    the iteration is idle: bubbles, imbalance)."""

    def describe(self) -> str:
        knobs = ", ".join(f"{key} {value}" for key, value in self.setting.items())
        return f"{self.config} {self.layout}" + (f" ({knobs})" if knobs else "")


class LockstepCosts:
    """The simulator's cost protocol for micro-batches whose groups run side by side: each
    action takes its slowest group's time and its largest group's bytes (module doc);
    ``checkpointed`` layers of each stage (at most its own) recomputed per layer, as
    Megatron-LM does."""

    def __init__(self, units: Sequence[Sequence[tuple[CostModel, Chunk]]], checkpointed: int):
        by_cost: dict[int, tuple[CostModel, list[Chunk]]] = {}
        self.units = []
        for unit in units:
            members = []
            for cost, chunk in unit:
                entry = by_cost.setdefault(id(cost), (cost, []))
                members.append((id(cost), len(entry[1])))
                entry[1].append(chunk)
            self.units.append(members)
        self.costs = {key: ChunkCosts(cost, chunks, lambda stage, unit, cost=cost: min(
            checkpointed, cost.layers(stage)), True) for key, (cost, chunks) in by_cost.items()}
        self.first = next(iter(by_cost.values()))[0]

    def _most(self, name: str, action) -> float:
        return max(getattr(self.costs[key], name)(dataclasses.replace(action, unit=index))
                   for key, index in self.units[action.unit])

    def duration(self, action) -> float:
        return self._most("duration", action)

    def transfer_time(self, action) -> float:
        return self._most("transfer_time", action)

    def activation_bytes(self, action) -> float:
        return self._most("activation_bytes", action)

    def workspace_bytes(self, action) -> float:
        return self._most("workspace_bytes", action)

    def head_bytes(self, action) -> float:
        return self._most("head_bytes", action)

    def gradient_sums(self, action) -> tuple:
        return ()

    def backward_layers(self, action) -> int:
        return self.first.layers(action.stage)

    def static_bytes(self, rank: int) -> float:
        return self.first.static_bytes(rank)


def _pipeline(units, checkpointed: int):
    """Simulated 1F1B over ``units`` (each a list of ``(cost, chunk)`` groups): the result,
    and whether every stage's peak fits its memory."""
    first = units[0][0][0]
    costs = LockstepCosts(units, checkpointed)
    schedule = one_f_one_b(first.pp, len(units))
    if checkpointed:
        schedule = add_recomputation(schedule, lambda action: True)
    schedule = add_communication(schedule, num_stages=first.pp)
    result = simulate(schedule, costs, trace=False)
    fits = all(peak - first.static_bytes(rank) <= first.activation_budget(rank)
               for rank, peak in enumerate(result.peak_memory))
    return result, fits


def _fewest_recomputed(replicas, layers: int):
    """The smallest ``--recompute-num-layers`` (0 to ``layers``) with which every replica's
    pipeline fits, and the replicas' results with it; ``None`` when none fits."""
    def run(count):
        found = [_pipeline(units, count) for units in replicas if units]
        return found if all(fits for _, fits in found) else None

    low, high = 0, layers
    best = run(high)
    if best is None:
        return None
    best = (high, best)
    while low < high:
        middle = (low + high) // 2
        found = run(middle)
        if found is None:
            low = middle + 1
        else:
            best, high = (middle, found), middle
    return best


def _cost(model: ModelConfig, hardware: HardwareProfile, layout: Layout, memory_gb: float,
          cp: int | None = None) -> CostModel:
    """The cost model of one CP group of ``cp`` ranks (default the layout's) at ``layout``."""
    cp = layout.cp if cp is None else cp
    return CostModel(model, hardware, ParallelConfig(
        pp=layout.pp, tp=layout.tp, cp=cp, dp=layout.dp * layout.cp // cp, memory_gb=memory_gb))


def _whole(documents: Sequence[int], lengths: Sequence[int]) -> Chunk:
    return Chunk(tuple(Piece(doc, 0, 0, lengths[doc], True) for doc in documents))


def static_cp(lengths, model, hardware, layout: Layout, memory_gb: float,
              seq_length: int, ceiling: float = math.inf) -> Priced | None:
    """``static-cp`` (module doc) at ``--seq-length seq_length``."""
    cost = _cost(model, hardware, layout, memory_gb)
    chunking = megatron_chunking(list(enumerate(lengths)), cost,
                                 ChunkingConfig(seq_length=seq_length))
    if chunking is None:
        raise ValueError(f"a document of {max(lengths)} tokens exceeds --seq-length "
                         f"{seq_length}; truncate the lengths first")
    rows = list(chunking.chunks)
    replicas = [[[(cost, chunk)] for chunk in rows[d::layout.dp]] for d in range(layout.dp)]
    return _settle("static-cp", layout, {}, replicas, cost, ceiling)


def balanced_cp(lengths, model, hardware, layout: Layout, memory_gb: float,
                max_seqlen_per_rank: int, ceiling: float = math.inf) -> Priced | None:
    """``dp-balanced`` (module doc) at ``--max-seqlen-per-dp-cp-rank max_seqlen_per_rank``."""
    cost = _cost(model, hardware, layout, memory_gb)
    steps = dp_balanced(lengths, layout.cp, layout.dp, max_seqlen_per_rank)
    replicas = [[[(cost, _whole(step[d], lengths))] for step in steps]
                for d in range(layout.dp)]
    return _settle("dp-balanced", layout, {"max_seqlen_per_dp_cp_rank": max_seqlen_per_rank},
                   replicas, cost, ceiling)


def dynamic(lengths, model, hardware, layout: Layout, memory_gb: float,
            max_seqlen_per_rank: int, min_cp: int = 1,
            ceiling: float = math.inf) -> Priced | None:
    """``dynamic-cp`` (module doc) at ``--max-seqlen-per-dp-cp-rank max_seqlen_per_rank`` and
    ``--min-dynamic-context-parallel-size min_cp``."""
    steps = dynamic_cp(lengths, layout.dp * layout.cp, max_seqlen_per_rank, min_cp)
    costs = {size: _cost(model, hardware, layout, memory_gb, size)
             for size in {group.size for step in steps for group in step}}
    units = [[(costs[group.size], _whole(group.documents, lengths)) for group in step]
             for step in steps]
    return _settle("dynamic-cp", layout, {"max_seqlen_per_dp_cp_rank": max_seqlen_per_rank},
                   [units], next(iter(costs.values())), ceiling)


class Pruned(Exception):
    """A configuration whose lower bound is no faster than the ceiling it was priced under."""


def _bound(replicas, pp: int) -> float:
    """A lower bound on the iteration: the slowest replica's busiest stage's forwards and
    backwards, nothing recomputed, no bubble."""
    return max(max(sum(max(cost.stage_forward(stage, chunk) + cost.stage_backward(stage, chunk)
                           for cost, chunk in unit) for unit in units)
                   for stage in range(pp)) for units in replicas if units)


def _settle(config, layout, setting, replicas, cost, ceiling=math.inf) -> Priced | None:
    """The fewest-recomputation pipelines of ``replicas``; ``Pruned`` when their
    :func:`_bound` is at least ``ceiling`` (the search's best so far)."""
    if any(cost.activation_budget(stage) <= 0 for stage in range(cost.pp)):
        return None
    if _bound(replicas, cost.pp) >= ceiling:
        raise Pruned(config)
    found = _fewest_recomputed(replicas, max(cost.layers(s) for s in range(cost.pp)))
    if found is None:
        return None
    count, results = found
    slowest = max((result for result, _ in results), key=lambda r: r.iteration_time)
    units = max(len(units) for units in replicas)
    return Priced(config, layout, {**setting, "recompute_num_layers": count},
                  slowest.iteration_time, units,
                  max(max(result.peak_memory) for result, _ in results) / GB,
                  sum(slowest.busy) / len(slowest.busy))


def chunked_pp(lengths, model, hardware, layout: Layout, memory_gb: float, seq_length: int,
               splits: int) -> Priced | None:
    """``chunked-pp`` (module doc) at ``--seq-length seq_length`` and ``splits`` spans."""
    if layout.cp != 1:
        raise ValueError("chunked-pp is priced at cp = 1 only")
    if seq_length % splits:
        raise ValueError(f"--seq-length {seq_length} is not divisible by "
                         f"--chunked-pipeline-model-parallel-splits {splits}")
    cost = _cost(model, hardware, layout, memory_gb)
    tokens = sum(lengths)
    rows = [seq_length] * (tokens // seq_length) + ([tokens % seq_length]
                                                   if tokens % seq_length else [])
    results, units = [], 0
    for d in range(layout.dp):
        mine = rows[d::layout.dp]
        if not mine:
            continue
        case = pipeline_case(cost, fixed_chunks(mine, seq_length // splits), 0)
        nothing = tuple((0,) * case.problem.chunks for _ in case.problem.layers)
        if not checkpointing.fits(case.problem, nothing):
            return None
        plan = single_pipeline_plan(cost, case, nothing, splits)
        found = report(plan, cost, with_schedule=False)
        results.append(found)
        units = max(units, case.problem.chunks)
    slowest = max(results, key=lambda found: found["iteration_time_s"])
    return Priced("chunked-pp", layout, {"splits": splits, "recompute_num_layers": 0},
                  slowest["iteration_time_s"], units,
                  max(max(found["peak_memory_gb"]) for found in results),
                  slowest["iteration_time_s"] * (1 - slowest["bubble_ratio"]))


def layouts(gpus: int, model: ModelConfig, max_tp: int = 8, max_pp: int = 8,
            max_cp: int | None = None) -> list[Layout]:
    """Every layout a user would try: powers of two, TP within a node (``max_tp``) dividing
    the head count, PP at most ``max_pp`` and the layer count, CP up to ``max_cp``."""
    found = []
    powers = [1 << i for i in range(gpus.bit_length()) if gpus % (1 << i) == 0]
    for tp in powers:
        for cp in powers:
            for pp in powers:
                if gpus % (tp * cp * pp) or tp > max_tp or pp > max_pp or \
                        pp > model.num_layers or model.num_heads % tp or \
                        (max_cp is not None and cp > max_cp):
                    continue
                found.append(Layout(tp, cp, pp, gpus // (tp * cp * pp)))
    return found


def per_rank_settings(context: int, ranks: int) -> list[int]:
    """``--max-seqlen-per-dp-cp-rank`` values a user would try: powers of two from 2K up to
    the context, the ones with which a ``context``-token document still fits ``ranks``
    ranks."""
    return [1 << i for i in range(11, context.bit_length())
            if (1 << i) <= context and (1 << i) * ranks >= context]


def price(config: str, lengths, model, hardware, layout: Layout, memory_gb: float,
          context: int, knob: int | None = None, ceiling: float = math.inf) -> Priced | None:
    """One configuration at one layout; ``knob`` the per-rank length (``dp-balanced``,
    ``dynamic-cp``) or the splits (``chunked-pp``). ``None`` when it does not fit;
    :class:`Pruned` when it cannot beat ``ceiling`` (not for ``chunked-pp``)."""
    if config == "static-cp":
        return static_cp(lengths, model, hardware, layout, memory_gb, context, ceiling)
    if config == "dp-balanced":
        return balanced_cp(lengths, model, hardware, layout, memory_gb, knob, ceiling)
    if config == "dynamic-cp":
        return dynamic(lengths, model, hardware, layout, memory_gb, knob, ceiling=ceiling)
    if config == "chunked-pp":
        return chunked_pp(lengths, model, hardware, layout, memory_gb, context, knob)
    raise ValueError(f"unknown configuration {config!r}; valid: {', '.join(CONFIGS)}")


def knobs(config: str, layout: Layout, context: int) -> list[int | None]:
    """The settings of ``config`` searched at ``layout``."""
    if config in ("dp-balanced", "dynamic-cp"):
        ranks = layout.cp if config == "dp-balanced" else layout.cp * layout.dp
        return per_rank_settings(context, ranks)
    if config == "chunked-pp":
        return [k for k in (1, 2, 4, 8) if context % k == 0] if layout.cp == 1 and \
            layout.pp > 1 else []
    return [None]


@dataclass(frozen=True)
class Search:
    """Every configuration, layout and setting tried, and the fastest."""

    tried: tuple[dict, ...]
    """``{"config", "layout", "knob", "outcome", "setting", "time_s"}``: ``outcome``
    ``priced``, ``out of memory`` or ``bound above the best`` (its lower bound, the busiest
    stage's compute without bubbles, no faster than the best priced before it; not
    simulated)."""
    best: Priced | None

    def best_of(self, config: str) -> dict | None:
        fits = [t for t in self.tried if t["config"] == config and t["time_s"] is not None]
        return min(fits, key=lambda t: t["time_s"], default=None)


def search(lengths, model, hardware, gpus: int, memory_gb: float, context: int,
           configs: Sequence[str] = CONFIGS, **layout_limits) -> Search:
    """Every configuration of ``configs`` at every :func:`layouts` layout and setting:
    the fastest that fits (``None`` when none does) and what was tried."""
    tried, best = [], None
    for layout in layouts(gpus, model, **layout_limits):
        for config in configs:
            for knob in knobs(config, layout, context):
                ceiling = math.inf if best is None else best.iteration_time_s
                entry = {"config": config, "layout": str(layout), "knob": knob}
                try:
                    found = price(config, lengths, model, hardware, layout, memory_gb,
                                  context, knob, ceiling)
                except ValueError:
                    continue
                except Pruned:
                    tried.append({**entry, "time_s": None, "outcome": "bound above the best"})
                    continue
                tried.append({**entry, "setting": None if found is None else found.setting,
                              "time_s": None if found is None else found.iteration_time_s,
                              "outcome": "out of memory" if found is None else "priced"})
                if found is not None and (best is None or
                                          found.iteration_time_s < best.iteration_time_s):
                    best = found
    return Search(tuple(tried), best)


def gradient_sync_s(cost: CostModel) -> float:
    """Seconds of the distributed optimizer's gradient reduce-scatter and parameter all-gather
    an iteration on the stage holding the most parameters, not overlapped with compute: a
    ring all-reduce's bytes (:func:`longctx.collectives.all_reduce_per_byte`) of the stage's
    ``params / tp`` in the model's dtype over its ``dp x cp x sp`` replicas, which Megatron's
    rank order places ``tp`` GPUs apart. The simulator prices neither it nor its overlap
    (``--overlap-grad-reduce``, ``--overlap-param-gather``) for any schedule; it is reported
    beside the simulated times as the term that a layout of many replicas pays."""
    parallel, model = cost.parallel, cost.model
    replicas = parallel.dp * parallel.cp * parallel.sp
    if replicas == 1:
        return 0.0
    most = 0.0
    for stage in range(cost.pp):
        params = cost.layers(stage) * model.params_per_layer()
        if stage == 0:
            params += model.vocab_size * model.hidden_size
        if stage == cost.pp - 1:
            params += model.vocab_size * model.hidden_size
        most = max(most, params / parallel.tp)
    per_byte = collectives.all_reduce_per_byte(cost.hardware, replicas, replicas * parallel.tp)
    return 2 * (replicas - 1) * collectives.latency(cost.hardware, replicas * parallel.tp) + \
        most * model.element_bytes * per_byte
