"""Heuristic solver for SPPO's (SP, PP, N), and the baselines priced by the same simulator.

Methods (one sequence of ``S`` tokens per data-parallel replica; throughput counts all replicas,
``dp x S / iteration time``):

- ``sppo``: ``N`` FLOPs-balanced subsequences pipelined over ``pp`` stages
  (:mod:`sppo_offload.pipeline`), no recomputation, per-subsequence offload ratios
  (:mod:`sppo_offload.offload`);
- ``seq1f1b``: the same subsequence pipeline without offloading; when it does not fit, the
  fewest layers checkpointed uniformly on every stage and subsequence that do (the elastic
  planner's Seq1F1B baseline does the same);
- ``megatron_recompute``: Megatron-LM's tensor parallelism with sequence parallelism over
  ``sp`` GPUs, every layer recomputed, the whole sequence as one micro-batch (pipeline stages,
  if any, run it one after the other: no pipelining of subsequences), no offloading.

"SP" is Megatron's tensor + sequence parallelism (the cost model's ``tp``): it shards weights,
activations and the sequence of each subsequence, so subsequence lengths are multiples of it.

Layouts (the same for all methods, so a comparison isolates the schedule): ``sp`` divides the
GPUs of a node or is a whole number of nodes (a group is a block of GPUs: a part of one node or
whole nodes); an SP group that spans nodes pays for it, its collectives priced as rings that
cross each node's NICs once (:mod:`longctx.collectives`), rather than being left out -- SPPO's
tuned Megatron-LM baseline runs SP 32 and 64 across nodes; ``pp`` any divisor of ``G / sp``
up to the layer count; ``dp = G / (sp pp)``.
Pipeline stages span nodes only when ``sp x pp`` exceeds a node; among plans whose predicted
throughput is within 1% of the best, one whose pipeline fits in a node is preferred, then the
smaller model-parallel group, then fewer subsequences. The data-parallel gradient all-reduce
is not priced (Megatron's DDP overlaps it with the backward).

Subsequence counts: ``N >= pp`` with ``S / (N sp)`` -- tokens per layer per device -- in
``[min_tokens, max_tokens]`` (2K-16K: large enough for efficient GEMMs and attention kernels,
small enough to keep the last subsequence's full activations small); ``N = pp`` when the
sequence is too short for the band. Candidates: ``N`` doubling from the band's low end, and
its high end. The low end stands in for a cost: short subsequences run their kernels below
peak, which the cost model prices only with a profile's ``kernel_efficiency`` curve. Without
one it would rate ever finer subsequences faster (the 7B at 512K on 32 A100s: 256
subsequences of 512 tokens a device 3% faster than the 32 of 2K the band allows; the 65B at
600K on 128, 15%) although they are not. With a curve the cost is priced, and the low end
moves down to the curve's first point (below it the curve is held, not measured):
:func:`token_floor`. The high end keeps the candidate count small and excludes nothing the
simulator rates faster on those two rows and the 7B at 896K (compared with the high end at 2^30
tokens).

Search: every (layout, N) gets the cheapest memory option whose *lower bound* on the peak
(model state plus what every subsequence keeps at the turn from forwards to backwards) fits
the budget -- for ``sppo`` the bandwidth-hidden ratios, then ratios raised a quarter of the way
to 1 at a time (exposed copies, priced); for ``seq1f1b`` 0, 1, 2 ... checkpointed layers. The
candidates are ranked by an analytic time estimate, and replayed in the simulator best first
(a candidate whose simulated peak exceeds the budget moves on to its next memory option)
until ``candidates`` of them fit by their *simulated* peak; the best simulated throughput wins
and its schedule is validated. When nothing fits, :class:`NoFit` names the smallest budget
that does (the most memory-saving option of the layout with the lowest simulated peak, or
its bound where that is higher: the search checks both) and says when that exceeds the
device.

Host memory (``host_memory_gb``, per GPU; ``None``: no limit). Every option's ``auto`` ratios
are lowered largest first until each stage's host bytes fit the cap
(:func:`~sppo_offload.offload.capped`); what then no longer fits the device is rejected like
any other option. A fixed ``--sppo-offload RATIO`` is not lowered: an option whose ratio needs
more host memory than the cap is rejected. When nothing fits under a cap, :class:`NoFit` also
names the smallest host budget with which the device budget fits (found on the layouts'
most memory-saving options: start from the memory bound, replay, add the simulated excess,
until the replay fits), or says that no host budget helps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

from megatron.plugin.pipeline.ir import Schedule
from megatron.plugin.pipeline.passes import add_communication, add_recomputation
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import SimResult, simulate
from megatron.plugin.pipeline.validation import validate

from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig

from sppo_offload.costs import SequenceCosts, subsequence_chunks
from sppo_offload.offload import (AUTO, capped_ratios, offload_ratios, offloadable_bytes,
                                  parse_offload, raised, stage_kind)
from sppo_offload.partition import balanced_lengths
from sppo_offload.pipeline import add_offload, subsequence_schedule

SPPO, MEGATRON, SEQ1F1B = "sppo", "megatron_recompute", "seq1f1b"
METHODS = (SPPO, MEGATRON, SEQ1F1B)
#: Offload levels tried by ``auto`` when the bandwidth-hidden ratios do not fit.
RAISE_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class SolverConfig:
    """What the solver may use and how hard it looks."""

    gpus: int
    """GPUs of the job (``sp x pp x dp``)."""
    memory_gb: float
    """Device memory per GPU, GB (10^9 bytes), the reserved runtime overhead included."""
    offload: str | float = AUTO
    """``--sppo-offload``: ``auto``, ``off`` or a ratio in [0, 1] (``sppo`` only)."""
    subsequences: int | None = None
    """``--sppo-subsequences``: a fixed N, or ``None`` to let the solver choose."""
    min_tokens: int = 2048
    """Fewest tokens per layer per device of a subsequence the solver plans for."""
    max_tokens: int = 16384
    """Most tokens per layer per device of a subsequence the solver plans for."""
    candidates: int = 3
    """Fitting candidates replayed in the simulator before the best is chosen."""
    layout: tuple[int, int] | None = None
    """A fixed ``(sp, pp)`` (``dp`` follows from the GPUs) instead of the search over layouts:
    a published configuration, or a comparison at one layout."""
    host_memory_gb: float | None = None
    """Host memory per GPU for offloaded activations, GB; ``None`` (the default): no limit.
    Uncapped by default because the host memory a GPU may use is a property of the node and
    the job (a DGX A100 has 1 or 2 TB for 8 GPUs, less what the OS, the data loaders and the
    page-locked limit take), which a GPU's hardware profile does not describe; and uncapped
    plans are the ones SPPO publishes. Every plan reports its host bytes per stage."""

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.memory_gb <= ParallelConfig.reserved_gb:
            raise ValueError(f"memory_gb must exceed the {ParallelConfig.reserved_gb} GB "
                             f"reserved for the runtime, got {self.memory_gb}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, "
                             f"{self.max_tokens}")
        if self.subsequences is not None and self.subsequences < 1:
            raise ValueError(f"subsequences must be >= 1 (or None for auto), got "
                             f"{self.subsequences}")
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")
        if self.layout is not None and (min(self.layout) < 1
                                        or self.gpus % (self.layout[0] * self.layout[1])):
            raise ValueError(f"layout (sp, pp) = {self.layout} must divide the {self.gpus} GPUs")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            raise ValueError(f"host_memory_gb must be > 0 (or None for no limit), got "
                             f"{self.host_memory_gb}")
        parse_offload(str(self.offload))

    def check_layout(self, model: ModelConfig, hardware: HardwareProfile) -> None:
        """Refuse a fixed ``layout`` that :func:`layouts` would not consider, saying why."""
        if self.layout is None:
            return
        if not any((l.sp, l.pp) == self.layout for l in layouts(model, hardware, self.gpus)):
            raise ValueError(
                f"layout (sp, pp) = {self.layout} is not one the solver can run on "
                f"{self.gpus} GPUs: sp must divide {model.name}'s {model.num_heads} heads and "
                f"be a block of one {hardware.gpus_per_node}-GPU node or of whole nodes, and "
                f"pp at most its {model.num_layers} layers")


@dataclass(frozen=True)
class Layout:
    sp: int
    """Tensor + sequence parallel degree (inside a node)."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel replicas, each training its own sequence."""


@dataclass(frozen=True)
class MethodPlan:
    """One method's plan for one sequence length, with its simulated figures."""

    method: str
    seq_length: int
    layout: Layout
    lengths: tuple[int, ...]
    """Subsequence lengths (one entry for ``megatron_recompute``)."""
    alphas: tuple[tuple[float, ...], ...]
    """Offload ratio per stage and subsequence."""
    checkpointed: tuple[int, ...]
    """Recomputed layers per stage (for every subsequence)."""
    iteration_time_s: float
    bubble_ratio: float
    peak_memory_bytes: tuple[float, ...]
    """Simulated peak device bytes per stage, model state included."""
    host_bytes: tuple[float, ...]
    """Bytes offloaded to host memory per stage (one GPU), all subsequences together."""
    schedule: Schedule = field(repr=False, compare=False, default=None)
    """The validated schedule the figures come from."""
    costs: SequenceCosts = field(repr=False, compare=False, default=None)
    """What the simulator priced it with (its ``cost`` is the layout's cost model)."""
    simulation: SimResult = field(repr=False, compare=False, default=None)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.dp * self.seq_length / self.iteration_time_s

    def to_dict(self) -> dict:
        return {"method": self.method, "seq_length": self.seq_length,
                "sp": self.layout.sp, "pp": self.layout.pp, "dp": self.layout.dp,
                "num_subsequences": len(self.lengths), "lengths": list(self.lengths),
                "alphas": [list(row) for row in self.alphas],
                "checkpointed_layers": list(self.checkpointed),
                "iteration_time_s": self.iteration_time_s, "bubble_ratio": self.bubble_ratio,
                "tokens_per_s": self.tokens_per_s,
                "peak_memory_gb": [b / GB for b in self.peak_memory_bytes],
                "host_memory_gb": [b / GB for b in self.host_bytes]}


class NoFit(ValueError):
    """No layout fits the budget. ``min_budget_gb``: the smallest device budget that does at
    the configured host budget (``None`` when a fixed ``--sppo-offload`` ratio overflows the
    host budget on every layout); ``min_host_gb``: the smallest host budget with which the
    configured device budget fits (``None``: no host cap, or no host budget helps)."""

    def __init__(self, message: str, min_budget_gb: float | None,
                 min_host_gb: float | None = None):
        self.min_budget_gb = min_budget_gb
        self.min_host_gb = min_host_gb
        super().__init__(message)


@dataclass
class _Candidate:
    method: str
    seq_length: int
    layout: Layout
    cost: CostModel
    lengths: tuple[int, ...]
    alphas: tuple[tuple[float, ...], ...]
    checkpointed: tuple[int, ...]
    bound: float
    estimate: float
    host_gbps: float | None
    host: float
    """Most bytes a stage moves to host memory."""


def layouts(model: ModelConfig, hardware: HardwareProfile, gpus: int) -> list[Layout]:
    """Every ``(sp, pp, dp)`` the solver considers on ``gpus`` GPUs (module doc)."""
    found = []
    for sp in _divisors(gpus):
        node = hardware.gpus_per_node
        if (node % sp and sp % node) or model.num_heads % sp:
            continue
        for pp in _divisors(gpus // sp):
            if pp <= model.num_layers:
                found.append(Layout(sp, pp, gpus // (sp * pp)))
    return found


def token_floor(cost: CostModel, config: SolverConfig) -> int:
    """The fewest tokens per layer per device a candidate subsequence has: ``min_tokens``, or
    the first point of the kernel-efficiency curve that ``cost`` prices short chunks with, when
    that is lower (module doc)."""
    if not cost.curved:
        return config.min_tokens
    return min(config.min_tokens, cost.hardware.kernel_efficiency[0][0])


def subsequence_counts(seq_length: int, layout: Layout, config: SolverConfig,
                       floor: int | None = None) -> list[int]:
    """Candidate N for one layout (module doc); ``floor`` tokens per layer per device at the
    least (default ``config.min_tokens``; :func:`token_floor`)."""
    if config.subsequences is not None:
        return [config.subsequences]
    per_device = seq_length // layout.sp
    low = max(layout.pp, math.ceil(per_device / config.max_tokens))
    floor = config.min_tokens if floor is None else floor
    high = min(per_device, max(low, per_device // floor))
    if low > high:
        return []
    counts, n = [], low
    while n < high:
        counts.append(n)
        n *= 2
    return counts + [high]


def solve(method: str, seq_length: int, model: ModelConfig, hardware: HardwareProfile,
          config: SolverConfig) -> MethodPlan:
    """The best plan of ``method`` for one ``seq_length``-token sequence per replica."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if seq_length < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_length}")
    budget, host_cap = config.memory_gb * GB, _host_cap(config)
    fitting, savers = [], []
    for layout, cost, n in _shapes(method, seq_length, model, hardware, config):
        options = list(_options(method, seq_length, layout, cost, n, hardware, config, host_cap))
        savers.append(options[-1])
        options = [c for c in options if c.bound <= budget and c.host <= host_cap]
        if options:
            fitting.append(options)
    if not savers:
        raise ValueError(f"{method}: no layout of {config.gpus} GPUs can run a "
                         f"{seq_length}-token sequence (sequence length must be a multiple of "
                         f"the SP degree, and N >= PP subsequences of at least SP tokens)")
    fitting.sort(key=lambda options: (-options[0].layout.dp * seq_length / options[0].estimate,
                                      _preference(options[0], hardware)))
    plans = []
    for options in fitting[:4 * config.candidates]:
        for candidate in options:
            plan = _replay(candidate)
            if max(plan.peak_memory_bytes) <= budget:
                plans.append(plan)
                break
        if len(plans) == config.candidates:
            break
    if not plans:
        raise _no_fit(method, seq_length, config, hardware, savers)
    best = max(p.tokens_per_s for p in plans)
    chosen = min((p for p in plans if p.tokens_per_s >= 0.99 * best),
                 key=lambda p: (_spans_nodes(p.layout, hardware), p.layout.sp * p.layout.pp,
                                len(p.lengths), -p.tokens_per_s))
    validate(chosen.schedule)
    return chosen


def fits(method: str, seq_length: int, model: ModelConfig, hardware: HardwareProfile,
         config: SolverConfig, replay: bool = True) -> bool:
    """Whether ``method`` trains ``seq_length`` tokens within the budget on the configured GPUs.

    Only layouts with ``dp = 1`` are tried: spreading one sequence over more GPUs shrinks each
    GPU's share of its activations, and the model state per GPU, ``P / (sp pp) x (6 + 12 /
    dp)`` bytes, is smallest with every GPU in the model-parallel group too. Each layout's
    most memory-saving option at its largest N is bounded; with ``replay`` the lowest bounds
    are replayed in the simulator, else the bound alone decides (a necessary condition)."""
    budget, host_cap = config.memory_gb * GB, _host_cap(config)
    savers = []
    for layout, cost, n in _shapes(method, seq_length, model, hardware, config, largest=True):
        saver = next(_options(method, seq_length, layout, cost, n, hardware, config, host_cap,
                              most_saving=True))
        if saver.bound <= budget and saver.host <= host_cap:
            savers.append(saver)
    if not replay:
        return bool(savers)
    savers.sort(key=lambda c: c.bound)
    return any(max(_replay(c).peak_memory_bytes) <= budget
               for c in savers[:config.candidates])


def largest_length(method: str, model: ModelConfig, hardware: HardwareProfile,
                   config: SolverConfig, granularity: int = 16384) -> int:
    """The longest sequence, a multiple of ``granularity`` tokens, that ``method`` fits on the
    configured GPUs (0 when not even ``granularity`` tokens do).

    Doubling then bisection on the memory bound (cheap, and never below the simulated peak),
    then the result is confirmed by replay; when the replay refuses it, a bisection on
    replays below it."""
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")

    def search(ok, high: int) -> int:
        """Largest ``units < high`` with ``ok(units)`` (0 if none), ``ok`` monotone."""
        low = 0
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if ok(middle) else (low, middle)
        return low

    def bounded(units: int) -> bool:
        return fits(method, units * granularity, model, hardware, config, replay=False)

    def replayed(units: int) -> bool:
        return fits(method, units * granularity, model, hardware, config)

    high = 1
    while bounded(high):
        high *= 2
    units = search(bounded, high)
    if units and not replayed(units):
        units = search(replayed, units)
    return units * granularity


def build(method: str, pp: int, n: int, checkpointed, alphas) -> Schedule:
    """The schedule a method's plan runs: compute, recomputation, transfers, offload."""
    compute = one_f_one_b(pp, 1) if method == MEGATRON else subsequence_schedule(pp, n)
    if any(checkpointed):
        compute = add_recomputation(compute, lambda a: checkpointed[a.stage] > 0)
    schedule = add_communication(compute, num_stages=pp)
    return add_offload(schedule, lambda a: alphas[a.stage][a.unit] > 0)


# -- internals --------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _spans_nodes(layout: Layout, hardware: HardwareProfile) -> bool:
    """Whether the model-parallel group (SP x PP) leaves one node."""
    return layout.sp * layout.pp > hardware.gpus_per_node


def _host_cap(config: SolverConfig) -> float:
    return math.inf if config.host_memory_gb is None else config.host_memory_gb * GB


def _preference(candidate: _Candidate, hardware: HardwareProfile) -> tuple:
    return (_spans_nodes(candidate.layout, hardware),
            candidate.layout.sp * candidate.layout.pp, len(candidate.lengths))


def _shapes(method, seq_length, model, hardware, config,
            largest: bool = False) -> Iterator[tuple[Layout, CostModel, int]]:
    """(layout, cost model, N) for every candidate; ``largest``: only ``dp = 1`` layouts, each
    at its largest N (see :func:`fits`)."""
    config.check_layout(model, hardware)
    if largest and config.layout and config.gpus != config.layout[0] * config.layout[1]:
        raise ValueError(f"the longest sequence is searched over layouts with dp = 1; layout "
                         f"(sp, pp) = {config.layout} leaves dp = "
                         f"{config.gpus // (config.layout[0] * config.layout[1])}")
    for layout in layouts(model, hardware, config.gpus):
        if seq_length % layout.sp or (largest and layout.dp > 1):
            continue
        if config.layout is not None and (layout.sp, layout.pp) != config.layout:
            continue
        cost = CostModel(model, hardware, ParallelConfig(
            pp=layout.pp, tp=layout.sp, dp=layout.dp, memory_gb=config.memory_gb))
        if method == MEGATRON:
            yield layout, cost, 1
            continue
        counts = [n for n in subsequence_counts(seq_length, layout, config,
                                                token_floor(cost, config))
                  if layout.pp <= n <= seq_length // layout.sp]
        for n in counts[-1:] if largest else counts:
            yield layout, cost, n


def _options(method, seq_length, layout, cost, n, hardware, config, host_cap: float,
             most_saving: bool = False) -> Iterator[_Candidate]:
    """Memory options of one (layout, N), least memory-saving first (``most_saving``: only
    the last); ``auto`` ratios capped to ``host_cap`` bytes per stage (module doc)."""
    lengths = tuple(balanced_lengths(seq_length, n, cost.linear_per_token, cost.alpha1,
                                     layout.sp))
    chunks = subsequence_chunks(lengths)
    zeros = tuple((0.0,) * n for _ in range(cost.pp))
    host = hardware.host_gbps_per_gpu

    def make(alphas, checkpointed):
        return _candidate(method, seq_length, layout, cost, lengths, chunks, alphas,
                          checkpointed, host)

    if method == MEGATRON:
        yield make(zeros, tuple(cost.layers(s) for s in range(cost.pp)))
    elif method == SEQ1F1B:
        most = max(cost.layers(s) for s in range(cost.pp))
        for count in range(most if most_saving else 0, most + 1):
            yield make(zeros, tuple(min(count, cost.layers(s)) for s in range(cost.pp)))
    else:
        base = offload_ratios(cost, chunks, config.offload, host)
        steps = RAISE_STEPS if config.offload == AUTO else (0.0,)
        previous = None
        for step in steps[-1:] if most_saving else steps:
            alphas = raised(base, step) if step else base
            if config.offload == AUTO and host_cap < math.inf:
                alphas = capped_ratios(cost, chunks, alphas, host_cap)
            if alphas != previous:
                yield make(alphas, (0,) * cost.pp)
            previous = alphas


def _candidate(method, seq_length, layout, cost, lengths, chunks, alphas, checkpointed,
               host) -> _Candidate:
    bound, estimate, most_moved, seen = 0.0, 0.0, 0.0, set()
    for s in range(cost.pp):
        kind = (stage_kind(cost, s), checkpointed[s], alphas[s])
        if kind in seen:
            continue
        seen.add(kind)
        held = forward = backward = copied = 0.0
        stage_moved = []
        for j, chunk in enumerate(chunks):
            moved = alphas[s][j] * offloadable_bytes(cost, s, chunk) if alphas[s][j] else 0.0
            stage_moved.append(moved)
            held += cost.stash_bytes(s, chunk, checkpointed[s], per_layer=True) - moved
            forward += cost.stage_forward(s, chunk)
            backward += cost.stage_backward(s, chunk) + checkpointed[s] * cost.layer_forward(chunk)
            copied += moved / (host * GB * cost.allocator) if moved else 0.0
        if checkpointed[s]:  # the baselines recompute like Megatron: one layer at a time
            held += max(cost.layer_saving(chunk) + cost.recompute_boundary(chunk)
                        for chunk in chunks)
        bound = max(bound, cost.static_bytes(s) + held)
        most_moved = max(most_moved, math.fsum(stage_moved) / cost.allocator)
        estimate = max(estimate, max(forward, copied) + max(backward, copied))
    if method == MEGATRON:
        estimate *= cost.pp
    else:
        estimate *= 1 + (cost.pp - 1) / len(chunks)
    return _Candidate(method, seq_length, layout, cost, lengths, alphas, checkpointed, bound,
                      estimate, host, most_moved)


def _replay(candidate: _Candidate) -> MethodPlan:
    c = candidate
    schedule = build(c.method, c.layout.pp, len(c.lengths), c.checkpointed, c.alphas)
    chunks = subsequence_chunks(c.lengths)
    offloaded = [[c.alphas[s][j] * offloadable_bytes(c.cost, s, chunk)
                  for j, chunk in enumerate(chunks)] for s in range(c.cost.pp)]
    costs = SequenceCosts(c.cost, c.lengths, offloaded, c.checkpointed, c.host_gbps,
                          per_layer_recompute=True)
    result = simulate(schedule, costs, trace=False)
    return MethodPlan(c.method, c.seq_length, c.layout, c.lengths, c.alphas, c.checkpointed,
                      result.iteration_time, result.bubble_ratio, tuple(result.peak_memory),
                      tuple(math.fsum(row) for row in offloaded), schedule, costs, result)


def _no_fit(method, seq_length, config, hardware, savers) -> NoFit:
    capped = method == SPPO and config.host_memory_gb is not None
    within = sorted((c for c in savers if c.host <= _host_cap(config)),
                    key=lambda c: c.bound)[:config.candidates]
    host = _smallest_host(seq_length, config, hardware, savers) if capped else None
    where = f"{config.memory_gb:g} GB per GPU" + (
        f" with {config.host_memory_gb:g} GB of host memory per GPU" if capped else "")
    message = f"{method}: a {seq_length}-token sequence does not fit {where} on {config.gpus} GPUs"
    need = None
    if within:
        # the budget must pass the search's bound as well as hold the simulated peak
        least, bound = min(((_replay(c), c.bound) for c in within),
                           key=lambda pair: max(*pair[0].peak_memory_bytes, pair[1]))
        need = _ceil_tenth(max(*least.peak_memory_bytes, bound))
        how = {SPPO: "fully offloaded: K/V, dK/dV and the last subsequence stay on the device"
               if config.offload == AUTO else f"--sppo-offload {config.offload}",
               MEGATRON: "full recomputation", SEQ1F1B: "every layer checkpointed"}[method]
        if capped and config.offload == AUTO:
            how += f", at most {config.host_memory_gb:g} GB in host memory"
        message += (f"; the smallest budget that fits is {need:g} GB (sp={least.layout.sp}, "
                    f"pp={least.layout.pp}, N={len(least.lengths)}, {how})")
        if need > hardware.hbm_gb and not (method == SPPO and config.offload != AUTO):
            message += f", more than the {hardware.hbm_gb:g} GB of one {hardware.name} GPU"
            if host is None:
                message += (": it cannot fit even " + ("fully offloaded" if method == SPPO
                                                       else f"with {how}")
                            + "; use more GPUs or a shorter sequence")
    else:
        message += (f"; --sppo-offload {config.offload} moves more than "
                    f"{config.host_memory_gb:g} GB per GPU to host memory on every layout")
    if host is not None:
        gb, plan = host
        message += (f"; or, keeping {config.memory_gb:g} GB per GPU, the smallest host budget "
                    f"that fits is {gb:g} GB per GPU (sp={plan.layout.sp}, pp={plan.layout.pp}, "
                    f"N={len(plan.lengths)})")
    if method == SPPO and config.offload != AUTO:
        message += "; or let SPPO choose the offload ratios (--sppo-offload auto)"
    return NoFit(message, need, None if host is None else host[0])


def _smallest_host(seq_length, config, hardware, savers) -> tuple[float, MethodPlan] | None:
    """The smallest host budget per GPU (GB, to 0.1) with which some layout's most
    memory-saving ``sppo`` option fits the device budget, and that option's plan; ``None``
    when none fits even uncapped. The layouts tried are the ``candidates`` whose uncapped
    option fits the budget by its bound and whose start is the lowest; each starts from the
    host bytes that bring its bound down to the budget (moving a byte to the host takes it
    off the device at the turn) and adds the replay's excess until the replay fits (at most
    the uncapped host bytes, which fit). Below the start the bound, hence the peak, exceeds
    the budget, and a byte more on the host takes at most a byte off the device, so the result
    is the layout's smallest to 0.1 GB."""
    budget = config.memory_gb * GB

    def start(option: _Candidate) -> float:
        return option.host - (budget - option.bound) if config.offload == AUTO else option.host

    free = sorted((next(_options(SPPO, seq_length, c.layout, c.cost, len(c.lengths), hardware,
                                 config, math.inf, most_saving=True)) for c in savers),
                  key=start)
    found = None
    for option in [c for c in free if c.bound <= budget][:config.candidates]:
        uncapped = _replay(option)
        if max(uncapped.peak_memory_bytes) > budget:
            continue
        gb = _ceil_tenth(start(option))
        while True:
            if gb * GB >= option.host:
                gb, plan = _ceil_tenth(option.host), uncapped
                break
            plan = _replay(next(_options(SPPO, seq_length, option.layout, option.cost,
                                         len(option.lengths), hardware, config, gb * GB,
                                         most_saving=True)))
            excess = max(plan.peak_memory_bytes) - budget
            if excess <= 0:
                break
            gb = _ceil_tenth(gb * GB + excess)
        if found is None or gb < found[0]:
            found = (gb, plan)
    return found


def _ceil_tenth(nbytes: float) -> float:
    """``nbytes`` in GB, rounded up to 0.1 GB (at least 0.1)."""
    return max(1, math.ceil(nbytes / GB * 10)) / 10
