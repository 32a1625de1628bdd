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
- inside a group, ``N`` and the packing perturbation are chosen by a fast memory-aware estimate:
  the dependency-graph makespan of the actual per-rank order
  (:func:`elastic_pipe.pipeline_order.makespan`) with the smallest per-stage uniform
  checkpointing that fits; CP-SAT then refines that candidate's table. The paper's ``sum_t C_t``
  stays CP-SAT's objective, but it does not see the drain a split document's reversed backwards
  cause, so pipeline times (DP costs, the kept table) are makespans: the CP-SAT table is kept
  when its makespan beats the uniform table's, else the uniform one ("uniform" fallback);
- a candidate is solved only when it can matter: the programme is first run with each
  candidate's uniform-checkpointing time (an upper bound) and with its time without any
  checkpointing (a lower bound); a candidate whose best lower-bound path cannot beat the
  upper-bound plan keeps its uniform table ("bounded"), one that needs no checkpointing keeps
  the all-zero table ("trivial");
- solves are memoised by their integer problem (chunk signatures, in-flight sets, budgets) and
  run in ``workers`` processes; a solve that has not answered within four times its limit plus
  ten seconds is abandoned for full checkpointing (recorded in ``fallbacks``).
"""
from __future__ import annotations

import concurrent.futures as futures
import logging
import math
import multiprocessing
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from elastic_pipe import checkpointing
from elastic_pipe.checkpointing import CheckpointProblem, CheckpointSolution
from elastic_pipe.chunks import Chunk
from elastic_pipe.cost_model import GB, CostModel
from elastic_pipe.pipeline_order import backward_order, inflight_sets, makespan, rank_orders
from elastic_pipe.plan_types import Plan, PipelinePlan
from elastic_pipe.sequence_processor import (Chunking, ChunkingConfig, best_chunking,
                                             chunk_balance, make_chunks, slice_candidates)

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
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

    def __post_init__(self):
        if self.group_cuts < 1:
            raise ValueError(f"group_cuts must be >= 1, got {self.group_cuts}")
        if self.solver_time_limit <= 0:
            raise ValueError(f"solver_time_limit must be > 0 seconds, "
                             f"got {self.solver_time_limit}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")


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
    problem: CheckpointProblem
    """The integer checkpointing problem."""

    def time(self, ckpt) -> int:
        """Dependency-graph makespan (microseconds) with the table ``ckpt``."""
        p = self.problem
        recompute = [[r * c for r, c in zip(rr, cc)] for rr, cc in zip(p.recompute, ckpt)]
        return round(makespan(list(self.orders), p.forward, p.backward, recompute, p.transfer))


def pipeline_case(cost: CostModel, chunks: Sequence[Chunk]) -> PipelineCase:
    """Orders and checkpointing problem of one pipeline over ``chunks``."""
    border = backward_order(list(chunks))
    orders = rank_orders(cost.pp, border)
    problem = checkpointing.build_problem(cost, list(chunks), inflight_sets(orders))
    return PipelineCase(tuple(chunks), tuple(border), tuple(map(tuple, orders)), problem)


def estimate(cost: CostModel, chunks: Sequence[Chunk]) -> float:
    """Predicted seconds of one pipeline with per-stage uniform checkpointing (inf: OOM)."""
    case = pipeline_case(cost, chunks)
    table = checkpointing.uniform_table(case.problem)
    if table is None:
        return math.inf
    return case.time(table) * checkpointing.TIME_UNIT


def _solve_memoised(problem: CheckpointProblem, limit: float) -> CheckpointSolution | None:
    key = (problem, limit)
    if key in _memo:
        _memo.move_to_end(key)
        return _memo[key]
    solution = checkpointing.solve(problem, limit)
    _memo[key] = solution
    if len(_memo) > _MEMO_SIZE:
        _memo.popitem(last=False)
    return solution


def solve_all(problems: list[CheckpointProblem], config: SchedulerConfig,
              progress: Progress | None = None) -> list[CheckpointSolution | None]:
    """Solve every problem (memoised; in ``config.workers`` processes when more than one is
    new); ``None`` for a problem that does not fit even with full checkpointing."""
    limit = config.solver_time_limit
    results: list = [_memo.get((problem, limit)) for problem in problems]
    pending = [i for i, answer in enumerate(results) if answer is None]
    done = len(problems) - len(pending)
    if progress and problems:
        progress(done, len(problems), "checkpointing")
    if config.workers == 1 or len(pending) <= 1:
        for index in pending:
            results[index] = _solve_memoised(problems[index], limit)
            done += 1
            if progress:
                progress(done, len(problems), "checkpointing")
        return results
    guard = limit * checkpointing.WALL_FACTOR + 10.0
    workers = min(config.workers, len(pending))
    pool = futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    try:
        submitted = {pool.submit(checkpointing.solve, problems[i], limit): i for i in pending}
        waves = math.ceil(len(pending) / workers)
        for future in futures.as_completed(submitted, timeout=guard * waves):
            index = submitted[future]
            results[index] = _memo[(problems[index], limit)] = future.result()
            done += 1
            if progress:
                progress(done, len(problems), "checkpointing")
    except futures.TimeoutError:
        log.warning("checkpointing solves did not return within %.1f s; full checkpointing "
                    "for the rest", guard)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for index in pending:
        if results[index] is None:
            problem = problems[index]
            table = checkpointing.full_table(problem)
            if checkpointing.fits(problem, table):
                results[index] = CheckpointSolution(
                    table, checkpointing.objective(problem, table), "full")
    return results


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


def plan_elastic(lengths: Sequence[int], cost: CostModel,
                 config: SchedulerConfig = SchedulerConfig(),
                 progress: Progress | None = None) -> Plan:
    """The elastic plan for documents of ``lengths`` (already truncated to the context)."""
    started = time.perf_counter()
    check_lengths(lengths)
    docs = sorted(((i, int(n)) for i, n in enumerate(lengths)), key=lambda d: (-d[1], d[0]))
    points = cut_points(docs, config.group_cuts)
    score = lambda chunks: estimate(cost, chunks)  # noqa: E731 -- the processor's score
    candidates: dict[tuple[int, int], Chunking] = {}
    for a in range(len(points)):
        for b in range(a + 1, len(points)):
            i, j = points[a], points[b]
            chunking, value = best_chunking(docs[i:j], cost, config.chunking, score)
            if math.isfinite(value):
                candidates[(i, j)] = chunking
    if len(docs) not in _shortest(points, {key: 0 for key in candidates})[0]:
        raise ValueError(_infeasible_message(docs, cost, config.chunking, points))
    keys = sorted(candidates)
    log.info("chunked %d candidate pipelines in %.2f s", len(keys),
             time.perf_counter() - started)
    cases = {key: pipeline_case(cost, candidates[key].chunks) for key in keys}
    uniform = {key: checkpointing.uniform_table(cases[key].problem) for key in keys}
    upper = {key: cases[key].time(uniform[key]) for key in keys}
    lower = {key: cases[key].time(_zeros(cases[key].problem)) for key in keys}
    incumbent, _ = _shortest(points, upper)
    reach_lower, _ = _shortest(points, lower)
    rest_lower, _ = _shortest(points[::-1], {(b, a): v for (a, b), v in lower.items()})
    worth = [key for key in keys if upper[key] > lower[key] and
             reach_lower.get(key[0], math.inf) + lower[key] + rest_lower.get(key[1], math.inf)
             < incumbent[len(docs)]]
    log.info("solving %d of %d candidate pipelines with CP-SAT (the rest are bounded out or "
             "need no checkpointing)", len(worth), len(keys))
    answers = dict(zip(worth, solve_all([cases[key].problem for key in worth], config,
                                        progress)))
    solved = {}
    for key in keys:
        status = "trivial" if upper[key] == lower[key] else "bounded"
        solved[key] = (CheckpointSolution(uniform[key], upper[key], status), upper[key])
        answer = answers.get(key)
        if answer is not None and cases[key].time(answer.ckpt) < upper[key]:
            solved[key] = (answer, cases[key].time(answer.ckpt))
        elif answer is not None:
            solved[key] = (CheckpointSolution(uniform[key], upper[key], "uniform"), upper[key])
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
                                      candidates[key].num_slices))
        if solution.status in FALLBACK_REASONS:
            fallbacks.append({"pipeline": number, "status": solution.status,
                              "reason": FALLBACK_REASONS[solution.status]})
        peaks = [max(x, y) for x, y in zip(peaks, checkpointing.memory_peaks(case.problem,
                                                                             solution.ckpt))]
    all_chunks = [chunk for pipeline in pipelines for chunk in pipeline.chunks]
    time_rsd, length_rsd = chunk_balance(all_chunks, cost)
    return Plan(tuple(pipelines), sum(p.predicted_time_s for p in pipelines),
                tuple(cost.static_bytes(s) + peaks[s] * case.problem.memory_unit
                      for s in range(cost.pp)),
                time_rsd, length_rsd, time.perf_counter() - started, tuple(fallbacks))


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


def _infeasible_message(docs, cost: CostModel, chunking: ChunkingConfig,
                        points: list[int]) -> str:
    """Why no plan fits, with the smallest per-GPU memory that fits: every candidate group at
    its finest split with full checkpointing, the grouping whose largest need is smallest."""
    need, finest = {}, {}
    for a in range(len(points)):
        for b in range(a + 1, len(points)):
            group = docs[points[a]:points[b]]
            slices = slice_candidates(group[0][1], chunking)[-1]
            problem = pipeline_case(cost, make_chunks(group, slices, cost).chunks).problem
            peaks = checkpointing.memory_peaks(problem, checkpointing.full_table(problem))
            need[(points[a], points[b])] = max(
                cost.static_bytes(s) + (peaks[s] + 1) * problem.memory_unit
                for s in range(cost.pp))
            finest[(points[a], points[b])] = slices
    best = {points[0]: 0.0}
    for index, b in enumerate(points[1:], 1):
        best[b] = min(max(best[a], need[(a, b)]) for a in points[:index])
    have = cost.parallel.memory_gb
    return (f"no plan fits {have:g} GB per GPU even with full checkpointing at the finest "
            f"split (N={finest[(points[0], points[-1])]} for the longest document); the "
            f"smallest budget that fits is {_round_up(best[points[-1]] / GB):g} GB: raise the "
            f"memory budget (--memory-gb, or --elastic-memory-gb when training), add pipeline "
            f"stages or sequence parallelism, or shorten --seq-length")


def _round_up(value: float, digits: int = 3) -> float:
    """``value`` rounded up to ``digits`` significant digits."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale) / scale
