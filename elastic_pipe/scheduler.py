"""InfiniPipe's chunk scheduler: documents grouped into back-to-back 1F1B pipelines (eq. 14).

Documents are sorted by length (longest first). A group is a run of consecutive documents in
that order; it is chunked on its own (:mod:`elastic_pipe.sequence_processor`, ``N`` tuned for
the group) and run as one 1F1B pipeline whose checkpointing CP-SAT chooses
(:mod:`elastic_pipe.checkpointing`). The dynamic programme

    T(j) = min over i < j of T(i) + P(i, j)

picks the cut points, where ``P(i, j)`` is the optimised time of the pipeline of documents
``i..j-1``: more pipelines pay more warm-up and cool-down bubbles, fewer pipelines mix long and
short documents under one chunk size and one memory window and pay in recomputation.

Where the paper is vague:
- cut points are restricted to the boundaries where the cumulative token count crosses
  ``1/g, 2/g, ...`` of the total (``g = SchedulerConfig.group_cuts``), so the programme solves
  at most ``g (g + 1) / 2`` candidate pipelines; ``group_cuts = 1`` is one pipeline (the
  ``elastic_no_grouping`` ablation);
- inside a group, ``N``, the packing perturbation and the forward lookahead of the per-rank
  order (``SchedulerConfig.lookaheads``; :mod:`elastic_pipe.pipeline_order`) are chosen by a
  fast memory-aware estimate: the dependency-graph makespan of the actual per-rank order
  (:func:`elastic_pipe.pipeline_order.makespan`) with the smallest per-stage uniform
  checkpointing that fits; CP-SAT then refines that candidate's table. The paper's ``sum_t C_t``
  stays CP-SAT's objective, but it does not see the order a split document's reversed
  backwards and the lookahead give, so pipeline times (DP costs, the kept table) are makespans: the CP-SAT table is kept
  when its makespan beats the uniform table's, else the uniform one ("uniform" fallback);
- a candidate is solved only when it can matter: the programme is first run with each
  candidate's uniform-checkpointing time (an upper bound) and with its time without any
  checkpointing (a lower bound); a candidate whose best lower-bound path cannot beat the
  upper-bound plan keeps its uniform table ("bounded"), one that needs no checkpointing keeps
  the all-zero table ("trivial");
- the candidates left open are solved by branch and bound (:func:`solve_open`): the most
  promising first, each solve making its candidate's time exact, and a candidate is dropped
  ("bounded") once its best path over lower bounds -- the stronger
  :func:`elastic_pipe.bounds.makespan_floor`, which counts the recomputation the memory
  budget forces -- is slower than the best plan known. The plan is the one solving every open
  candidate gives (the proof is in :func:`solve_open`); only fewer solves run;
- one pool of ``workers`` forked processes chunks the candidate groups and then runs the
  solves; solves are memoised by their integer problem (chunk signatures, in-flight sets,
  budgets). Worker faults never change the plan: solves not answered within a wall-clock guard
  (four times their limit plus ten seconds) are solved in this process instead, and a pool
  broken by a dead worker is replaced by planning in this process, each with a warning;
- with Megatron's ``--recompute-granularity full`` (``SchedulerConfig.fixed``) the table is the
  one its flags fix (:mod:`longctx.fixed_checkpointing`): every candidate is chunked,
  priced and kept with it (status ``fixed``) and none is solved.

Branch and bound keeps the plan. The plan P that solving every open candidate gives is no slower
than the incumbent (the best plan over the candidates' upper times), and every plan through a
dropped candidate, at the times solving would give (never below the floors), is slower than the
incumbent, so P and every plan as fast as P avoid the dropped candidates; the programme's choices
along P (the first predecessor that reaches each point's best time) compare the same sums, since
raising the times of the dropped candidates changes neither those sums nor the best times along
P. Which candidates get solved may depend on the order the workers finish in; given the solves'
answers, the plan does not.
"""
from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import logging
import math
import multiprocessing
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from elastic_pipe import checkpointing
from elastic_pipe.bounds import makespan_floor
from elastic_pipe.checkpointing import CheckpointProblem, CheckpointSolution
from longctx.fixed_checkpointing import FixedCheckpointing
from longctx.chunks import Chunk
from longctx.cost_model import GB, CostModel
from elastic_pipe.pipeline_order import backward_order, inflight_sets, makespan, rank_orders
from elastic_pipe.plan_types import Plan, PipelinePlan
from elastic_pipe.presolve import stop_workers
from elastic_pipe.sequence_processor import (Chunking, ChunkingConfig, best_chunking,
                                             chunk_balance, make_chunks, slice_candidates)

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
GUARD_FACTOR = 4.0
GUARD_SLACK_S = 10.0
"""A worker's solve not answered within ``GUARD_FACTOR`` times the deterministic limit plus
``GUARD_SLACK_S`` seconds (wall clock) is taken from the workers and solved in this process: a
guard against a stopped or starved worker, not a time limit (CP-SAT stops on its deterministic
limit, so the solve here gives the answer the worker would have given)."""
_MEMO_SIZE = 512
_memo: OrderedDict = OrderedDict()
FALLBACK_REASONS = {
    "feasible": "CP-SAT time limit: best feasible table, not proven optimal",
    "full": "CP-SAT returned no table in time: full checkpointing",
    "bounded": "not solved (its lower bound cannot beat the chosen plan): uniform "
               "per-stage checkpointing",
    "uniform": "the CP-SAT table (optimising sum C_t) was not faster than uniform per-stage "
               "checkpointing in the dependency-graph time: uniform kept",
}


@dataclass(frozen=True)
class SchedulerConfig:
    """Search space and solver limits of the chunk scheduler."""

    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    """Sequence-processor search space."""
    group_cuts: int = 4
    """Candidate cut points at each 1/g of the batch's tokens; 1 keeps one pipeline."""
    solver_time_limit: float = 0.2
    """CP-SAT deterministic time limit per pipeline (about seconds on one core)."""
    workers: int = 2
    """Worker processes solving candidate pipelines in parallel (1: solve in this process)."""
    lookaheads: tuple[int, ...] = (0, 64)
    """Forward lookaheads to try for each pipeline
    (:func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`): 0 keeps the smallest
    windows; a larger one overlaps a split document's prefill with the backwards before it and
    holds more chunks for longer."""
    fixed: FixedCheckpointing | None = None
    """Megatron's ``--recompute-*`` table (:mod:`longctx.fixed_checkpointing`): every
    candidate is priced and planned with it, CP-SAT chooses nothing; ``None``: CP-SAT chooses."""

    def __post_init__(self):
        if self.group_cuts < 1:
            raise ValueError(f"group_cuts must be >= 1, got {self.group_cuts}")
        if self.solver_time_limit <= 0:
            raise ValueError(f"solver_time_limit must be > 0 seconds, "
                             f"got {self.solver_time_limit}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not self.lookaheads or min(self.lookaheads) < 0:
            raise ValueError(f"lookaheads must be a non-empty tuple of backwards >= 0, "
                             f"got {self.lookaheads}")


def check_lengths(lengths: Sequence[int]) -> None:
    """Refuse an empty batch and non-positive lengths, naming the first offender."""
    if len(lengths) == 0:
        raise ValueError("no document lengths given; pass at least one positive length")
    for index, length in enumerate(lengths):
        if int(length) != length or length <= 0:
            raise ValueError(f"document {index} has length {length}; every length must be a "
                             f"positive integer (drop empty documents)")


@dataclass(frozen=True)
class PipelineCase:
    """One candidate pipeline: its chunks, orders and checkpointing problem."""

    chunks: tuple[Chunk, ...]
    """Forward order."""
    backward: tuple[int, ...]
    """Backward order (local indices)."""
    orders: tuple
    """Per-rank ``(F|B, chunk)`` lists."""
    lookahead: int
    """The forward lookahead the orders were made with."""
    problem: CheckpointProblem
    """The integer checkpointing problem."""

    def time(self, ckpt) -> int:
        """Dependency-graph makespan (microseconds) with the table ``ckpt``."""
        p = self.problem
        recompute = [[r * c for r, c in zip(rr, cc)] for rr, cc in zip(p.recompute, ckpt)]
        return round(makespan(list(self.orders), p.forward, p.backward, recompute, p.transfer))


def pipeline_case(cost: CostModel, chunks: Sequence[Chunk], lookahead: int) -> PipelineCase:
    """Orders and checkpointing problem of one pipeline over ``chunks`` with the forward
    ``lookahead`` (:func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`)."""
    return pipeline_cases(cost, chunks, (lookahead,))[0]


def pipeline_cases(cost: CostModel, chunks: Sequence[Chunk],
                   lookaheads: Sequence[int]) -> list[PipelineCase]:
    """:func:`pipeline_case` for each of ``lookaheads``, the chunks' cost tables built once."""
    border = backward_order(list(chunks))
    cases, problem = [], None
    for lookahead in lookaheads:
        orders = tuple(map(tuple, rank_orders(cost.pp, border, lookahead)))
        events = inflight_sets(list(orders))
        problem = (checkpointing.build_problem(cost, list(chunks), events) if problem is None
                   else dataclasses.replace(problem, events=tuple(map(tuple, events))))
        cases.append(PipelineCase(tuple(chunks), tuple(border), orders, lookahead, problem))
    return cases


def start_table(problem: CheckpointProblem, fixed: FixedCheckpointing | None):
    """The table a candidate is priced with before any solve: Megatron's fixed table where it
    fits, the smallest per-stage uniform one without it; ``None`` when it does not fit."""
    if fixed is None:
        return checkpointing.uniform_table(problem)
    table = fixed.table(problem.layers, problem.chunks)
    return table if checkpointing.fits(problem, table) else None


def estimate(cost: CostModel, chunks: Sequence[Chunk], lookaheads: Sequence[int],
             fixed: FixedCheckpointing | None = None) -> tuple[float, int]:
    """Predicted seconds of one pipeline with its :func:`start_table` (inf: OOM) and the
    lookahead giving it: the fastest of ``lookaheads``, the first of equals (lookaheads giving
    the same orders are timed once)."""
    best, timed = (math.inf, lookaheads[0]), {}
    for case in pipeline_cases(cost, chunks, lookaheads):
        if case.orders not in timed:
            table = start_table(case.problem, fixed)
            timed[case.orders] = (math.inf if table is None
                                  else case.time(table) * checkpointing.TIME_UNIT)
        if timed[case.orders] < best[0]:
            best = (timed[case.orders], case.lookahead)
    return best


def _remember(key: tuple, solution: CheckpointSolution | None) -> None:
    _memo[key] = solution
    _memo.move_to_end(key)
    if len(_memo) > _MEMO_SIZE:
        _memo.popitem(last=False)


def _solved_here(problem: CheckpointProblem, limit) -> CheckpointSolution | None:
    """The memoised answer of ``problem``, or its solve in this process (then memoised)."""
    key = (problem, limit)
    if key in _memo:
        _memo.move_to_end(key)
        return _memo[key]
    answer = checkpointing.solve(problem, limit)
    _remember(key, answer)
    return answer


def settle(case: PipelineCase, answer: CheckpointSolution | None, uniform,
           upper: int) -> tuple[CheckpointSolution, int]:
    """The table kept for a solved candidate and its makespan: CP-SAT's when it beats the
    uniform table ``uniform`` (makespan ``upper``), else the uniform one."""
    if answer is None:
        return CheckpointSolution(uniform, upper, "bounded"), upper
    time = case.time(answer.ckpt)
    if time < upper:
        return answer, time
    return CheckpointSolution(uniform, upper, "uniform"), upper


def solve_open(cases: dict, uniform: dict, upper: dict, floor: dict, open_keys: list,
               points: list[int], config: SchedulerConfig,
               pool: futures.ProcessPoolExecutor | None,
               progress: Progress | None = None) -> dict:
    """Solve the candidate pipelines ``open_keys`` that can still be part of the plan, the most
    promising first (branch and bound over eq. 14); ``{key: settle(...)}`` of those solved.

    ``upper[key]`` is an achievable time of every candidate (its uniform table) and
    ``floor[key]`` one that no fitting table of it beats (equal to ``upper`` for candidates not
    open: they keep their uniform table). A solve makes its candidate's time exact, raising its
    floor and lowering its upper time. Before each solve the *incumbent* is the best plan over
    the upper times and a candidate's *bound* the best plan through it over the floors; a
    candidate whose bound exceeds the incumbent is dropped for good (the incumbent only falls,
    bounds only rise) and keeps its uniform table; the plan is the one solving every open
    candidate gives (module doc, "Branch and bound keeps the plan").

    Solves run in ``pool`` (``config.workers`` processes; in this process without one) and are
    memoised by their integer problem; past the guard (:data:`GUARD_SLACK_S`) the rest run in
    this process, with a warning (module doc).
    """
    limit = config.solver_time_limit
    values, floors = dict(upper), dict(floor)
    solved: dict = {}
    waiting = list(open_keys)
    running: dict[futures.Future, tuple[int, int]] = {}

    def record(key, answer):
        solved[key] = settle(cases[key], answer, uniform[key], upper[key])
        values[key] = floors[key] = solved[key][1]

    guard, reported = limit * GUARD_FACTOR + GUARD_SLACK_S, (0, 0)
    while True:
        waiting = _promising(waiting, values, floors, points)
        counts = (len(solved), len(solved) + len(running) + len(waiting))
        if progress and counts[1] and counts != reported:
            progress(*counts, "checkpointing")
            reported = counts
        if waiting and (pool is None or (cases[waiting[0]].problem, limit) in _memo):
            key = waiting.pop(0)
            record(key, _solved_here(cases[key].problem, limit))
        elif waiting and len(running) < config.workers:
            key = waiting.pop(0)
            running[pool.submit(checkpointing.solve, cases[key].problem, limit)] = key
        elif running:
            finished, _ = futures.wait(running, timeout=guard,
                                       return_when=futures.FIRST_COMPLETED)
            if not finished:
                log.warning("no checkpointing solve returned within %.1f s: planning workers "
                            "stopped, the remaining %d solves run in this process (same plan)",
                            guard, len(running) + len(waiting))
                stop_workers(pool)
                pool, waiting, running = None, [*running.values(), *waiting], {}
                continue
            for future in finished:
                key = running.pop(future)
                _remember((cases[key].problem, limit), future.result())
                record(key, future.result())
        else:
            return solved


def _promising(keys: list, values: dict, floors: dict, points: list[int]) -> list:
    """``keys`` whose bound (best plan through them over ``floors``) does not exceed the best
    plan over ``values``, lowest bound first (ties by key)."""
    incumbent = _shortest(points, values)[0][points[-1]]
    reach = _shortest(points, floors)[0]
    rest = _shortest(points[::-1], {(b, a): v for (a, b), v in floors.items()})[0]
    bound = {key: reach.get(key[0], math.inf) + floors[key] + rest.get(key[1], math.inf)
             for key in keys}
    return sorted((key for key in keys if bound[key] <= incumbent),
                  key=lambda key: (bound[key], key))


def cut_points(docs: Sequence[tuple[int, int]], groups: int) -> list[int]:
    """Indices into the sorted documents where the cumulative tokens cross each 1/groups."""
    total = sum(length for _, length in docs)
    points, running, target = [0], 0, 1
    for index, (_, length) in enumerate(docs):
        running += length
        while target < groups and running >= total * target / groups:
            if index + 1 < len(docs) and points[-1] != index + 1:
                points.append(index + 1)
            target += 1
    points.append(len(docs))
    return points


def group_chunking(docs: Sequence[tuple[int, int]], cost: CostModel,
                   config: SchedulerConfig) -> tuple[Chunking, int, float]:
    """The sequence processor's chunking of one group and its forward lookahead, ``N``, the
    perturbation and the lookahead tuned together by :func:`estimate` (among equals, the
    first of ``config.lookaheads``)."""
    chosen = {}

    def score(chunks: list[Chunk]) -> float:
        value, chosen[tuple(chunks)] = estimate(cost, chunks, config.lookaheads, config.fixed)
        return value

    chunking, value = best_chunking(docs, cost, config.chunking, score)
    return chunking, chosen[chunking.chunks], value


_inherited: tuple | None = None
"""A worker's (sorted documents, cost model, scheduler config): inherited through ``fork``,
since the cost model's per-signature cache does not pickle."""


def _adopt(docs, cost: CostModel, config: SchedulerConfig) -> None:
    global _inherited
    _inherited = (docs, cost, config)


def _group_chunking_in_worker(i: int, j: int) -> tuple[Chunking, int, float]:
    docs, cost, config = _inherited
    return group_chunking(docs[i:j], cost, config)


def chunk_groups(docs: Sequence[tuple[int, int]], cost: CostModel, config: SchedulerConfig,
                 points: list[int], pool: futures.ProcessPoolExecutor | None) -> dict:
    """``{(i, j): (chunking, lookahead)}`` of every candidate group that fits in memory, chunked
    in ``pool``
    (the groups with the most documents first, so that the workers finish together) or in this
    process without one."""
    groups = sorted(((points[a], points[b]) for a in range(len(points))
                     for b in range(a + 1, len(points))), key=lambda g: (g[0] - g[1], g))
    if pool is None:
        found = {(i, j): group_chunking(docs[i:j], cost, config) for i, j in groups}
    else:
        submitted = {(i, j): pool.submit(_group_chunking_in_worker, i, j) for i, j in groups}
        found = {key: future.result() for key, future in submitted.items()}
    return {key: (chunking, lookahead) for key, (chunking, lookahead, value)
            in sorted(found.items()) if math.isfinite(value)}


def plan_elastic(lengths: Sequence[int], cost: CostModel,
                 config: SchedulerConfig = SchedulerConfig(),
                 progress: Progress | None = None) -> Plan:
    """The elastic plan for documents of ``lengths`` (already truncated to the context).

    With ``config.workers > 1`` one pool of forked processes chunks the candidate groups and
    then solves their checkpointing. A worker that dies (killed, out of memory) breaks the
    pool: the plan is then made again in this process, with a warning (the same plan; the
    solves already answered are memoised)."""
    started = time.perf_counter()
    check_lengths(lengths)
    docs = sorted(((i, int(n)) for i, n in enumerate(lengths)), key=lambda d: (-d[1], d[0]))
    pool = None
    if config.workers > 1:
        pool = futures.ProcessPoolExecutor(
            config.workers, mp_context=multiprocessing.get_context("fork"),
            initializer=_adopt, initargs=(docs, cost, config))
    try:
        return _plan(docs, cost, config, pool, progress, started)
    except BrokenProcessPool as error:
        log.warning("a planning worker died (%s): planning again in this process (same plan)",
                    error)
        return _plan(docs, cost, config, None, progress, started)
    finally:
        if pool is not None:
            stop_workers(pool)


def _plan(docs: list[tuple[int, int]], cost: CostModel, config: SchedulerConfig,
          pool: futures.ProcessPoolExecutor | None, progress: Progress | None,
          started: float) -> Plan:
    points = cut_points(docs, config.group_cuts)
    candidates = chunk_groups(docs, cost, config, points, pool)
    if len(docs) not in _shortest(points, {key: 0 for key in candidates})[0]:
        raise ValueError(_infeasible_message(docs, cost, config, points))
    keys = sorted(candidates)
    log.debug("chunked %d candidate pipelines in %.2f s", len(keys),
              time.perf_counter() - started)
    cases = {key: pipeline_case(cost, candidates[key][0].chunks, candidates[key][1])
             for key in keys}
    uniform = {key: start_table(cases[key].problem, config.fixed) for key in keys}
    upper = {key: cases[key].time(uniform[key]) for key in keys}
    lower = {key: cases[key].time(_zeros(cases[key].problem)) for key in keys}
    incumbent, _ = _shortest(points, upper)
    reach_lower, _ = _shortest(points, lower)
    rest_lower, _ = _shortest(points[::-1], {(b, a): v for (a, b), v in lower.items()})
    worth = [key for key in keys if config.fixed is None and upper[key] > lower[key] and
             reach_lower.get(key[0], math.inf) + lower[key] + rest_lower.get(key[1], math.inf)
             < incumbent[len(docs)]]
    floor = {key: upper[key] for key in keys}
    floor.update({key: max(lower[key], makespan_floor(list(cases[key].orders),
                                                      cases[key].problem))
                  for key in worth})
    solved = {key: (CheckpointSolution(uniform[key], upper[key],
                                       _unsolved_status(config, upper[key], lower[key])),
                    upper[key])
              for key in keys}
    answered = solve_open(cases, uniform, upper, floor, worth, points, config, pool, progress)
    solved.update(answered)
    log.debug("solved %d of %d candidate pipelines with CP-SAT (the rest are bounded out or "
              "need no checkpointing)", len(answered), len(keys))
    _, choice = _shortest(points, {key: value for key, (_, value) in solved.items()})
    bounds, end = [], len(docs)
    while end:
        bounds.append((choice[end], end))
        end = choice[end]
    pipelines, fallbacks, peaks = [], [], [0] * cost.pp
    for number, key in enumerate(reversed(bounds)):
        (solution, value), case = solved[key], cases[key]
        pipelines.append(PipelinePlan(case.chunks, case.backward, solution.ckpt,
                                      value * checkpointing.TIME_UNIT, solution.status,
                                      candidates[key][0].num_slices, case.lookahead))
        if solution.status in FALLBACK_REASONS:
            fallbacks.append({"pipeline": number, "status": solution.status,
                              "reason": FALLBACK_REASONS[solution.status]})
        peaks = [max(x, y) for x, y in zip(peaks, checkpointing.peak_bytes(
            cost, case.problem, checkpointing.memory_peaks(case.problem, solution.ckpt)))]
    all_chunks = [chunk for pipeline in pipelines for chunk in pipeline.chunks]
    time_rsd, length_rsd = chunk_balance(all_chunks, cost)
    return Plan(tuple(pipelines), sum(p.predicted_time_s for p in pipelines),
                tuple(peaks), time_rsd, length_rsd, time.perf_counter() - started,
                tuple(fallbacks))


def _unsolved_status(config: SchedulerConfig, upper: int, lower: int) -> str:
    """How the table of a candidate left unsolved was found (``CheckpointSolution.status``)."""
    if config.fixed is not None:
        return "fixed"
    return "trivial" if upper == lower else "bounded"


def _zeros(problem: CheckpointProblem) -> tuple[tuple[int, ...], ...]:
    return tuple((0,) * problem.chunks for _ in problem.layers)


def _shortest(points: list[int], cost: dict) -> tuple[dict, dict]:
    """Eq. 14 over ``points`` (in walking order): best cost to reach each point and the
    predecessor achieving it; ``cost[(a, b)]`` is the pipeline over documents between them."""
    best, choice = {points[0]: 0}, {}
    for index, b in enumerate(points[1:], 1):
        for a in points[:index]:
            if a in best and (a, b) in cost and best[a] + cost[(a, b)] < best.get(b, math.inf):
                best[b], choice[b] = best[a] + cost[(a, b)], a
    return best, choice


def _infeasible_message(docs, cost: CostModel, config: SchedulerConfig,
                        points: list[int]) -> str:
    """Why no plan fits, with the smallest per-GPU memory that fits: every candidate group at
    its finest split with full checkpointing (with Megatron's fixed table under
    ``config.fixed``) and the smallest lookahead, the grouping whose largest need is
    smallest."""
    need, finest = {}, {}
    for a in range(len(points)):
        for b in range(a + 1, len(points)):
            group = docs[points[a]:points[b]]
            slices = slice_candidates(group[0][1], config.chunking)[-1]
            problem = pipeline_case(cost, make_chunks(group, slices, cost).chunks,
                                    min(config.lookaheads)).problem
            table = checkpointing.full_table(problem) if config.fixed is None \
                else config.fixed.table(problem.layers, problem.chunks)
            peaks = checkpointing.memory_peaks(problem, table)
            need[(points[a], points[b])] = max(checkpointing.peak_bytes(
                cost, problem, [peak + 1 for peak in peaks]))
            finest[(points[a], points[b])] = slices
    best = {points[0]: 0.0}
    for index, b in enumerate(points[1:], 1):
        best[b] = min(max(best[a], need[(a, b)]) for a in points[:index])
    have, smallest = cost.parallel.memory_gb, _round_up(best[points[-1]] / GB)
    split = f"at the finest split (N={finest[(points[0], points[-1])]} for the longest document)"
    if config.fixed is not None:
        more = ("add pipeline stages or sequence parallelism, or shorten --seq-length"
                if config.fixed.method == "uniform" else
                "recompute more layers (a larger --recompute-num-layers, or --recompute-method "
                "uniform), or drop the --recompute-* flags and let the planner choose per chunk")
        return (f"no plan fits {have:g} GB per GPU with the checkpointing table "
                f"{config.fixed.flags()} fixes, even {split}; the smallest budget that fits it "
                f"is {smallest:g} GB: raise --elastic-memory-gb, or {more}")
    return (f"no plan fits {have:g} GB per GPU even with full checkpointing {split}; the "
            f"smallest budget that fits is {smallest:g} GB: raise the "
            f"memory budget (--memory-gb, or --elastic-memory-gb when training), add pipeline "
            f"stages or sequence parallelism, or shorten --seq-length")


def _round_up(value: float, digits: int = 3) -> float:
    """``value`` rounded up to ``digits`` significant digits."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale) / scale
