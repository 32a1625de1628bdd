"""Stage-aware chunk-level checkpointing of one 1F1B pipeline as a CP-SAT model (eq. 15-20).

Decision: ``ckpt[p][k]`` in ``[0, L_p]``, the number of leading layers of stage ``p`` whose
activations chunk ``k`` drops and recomputes before its backward.

Time: the 1F1B pipeline of ``n`` chunks on ``d`` stages takes ``n + d - 1`` steps; in step ``t``
stage ``p`` works on chunk ``k = t - p`` (forward + backward + recomputation), so with integer
``C_t >= base[p][k] + recompute[p][k] * ckpt[p][k]`` for every such pair the pipeline time is
modelled as ``sum_t C_t``, minimised.

Memory: at every backward of stage ``p`` (from :func:`elastic_pipe.pipeline_order.inflight_sets`,
the 1F1B windows ``|W_p|`` with the split documents' prefill) the other chunks in flight stash
``full - saving * ckpt - input * max(ckpt - 1, 0)`` each (the runtime keeps one input for the
checkpointed range, so every checkpointed layer after the first also saves its input), and the
chunk about to run its backward holds ``full - saving * ckpt`` and rematerialises every one of
its checkpointed layers (``transient * ckpt``: the runtime's ``RECOMPUTE`` rebuilds the whole
checkpointed range from the kept input before the backward,
:mod:`megatron.plugin.pipeline.layer_checkpoint`), so during its own backward a chunk holds its
full stash again; the sum stays within the stage's activation budget. Checkpointing therefore
lowers a stage's peak only through the *other* chunks in flight. Times are integers in
microseconds; memory in MiB, rounded so that an integer-feasible table is feasible in bytes:
budgets down, stashes and transients up, savings (inputs included) down.

The search is reproducible: one CP-SAT worker and a deterministic time limit only (CP-SAT's
deterministic time counts work, not seconds, so the solve ends whatever the machine's load; a
wall-clock limit would make the table, and so the plan, depend on the load: the ranks of a
training run plan independently and must agree). The scheduler guards its worker processes
with a wall-clock timeout (:func:`elastic_pipe.scheduler.solve_open`).

Memory unit: a power of two chosen per problem so that the largest stage budget is at most
``2**20`` units (one byte at least): MiB-scale for 80 GB devices, bytes for the tiny models of
the CPU tests, whose whole activation budget is a few hundred KiB.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from longctx.chunks import Chunk
from longctx.cost_model import CostModel

TIME_UNIT = 1e-6
BUDGET_UNITS = 2 ** 20


@dataclass(frozen=True)
class CheckpointProblem:
    """Integer data of one pipeline's checkpointing problem."""

    layers: tuple[int, ...]
    """Layers per stage (upper bound of ``ckpt[p][k]``)."""
    forward: tuple[tuple[int, ...], ...]
    """``[p][k]`` forward time in microseconds."""
    backward: tuple[tuple[int, ...], ...]
    """``[p][k]`` backward time in microseconds."""
    base: tuple[tuple[int, ...], ...]
    """``[p][k]`` forward + backward time in microseconds."""
    transfer: tuple[int, ...]
    """``[k]`` stage-to-stage transfer time in microseconds."""
    recompute: tuple[tuple[int, ...], ...]
    """``[p][k]`` time to recompute one layer, microseconds."""
    full: tuple[tuple[int, ...], ...]
    """``[p][k]`` stash without checkpointing, memory units rounded up."""
    saving: tuple[tuple[int, ...], ...]
    """``[p][k]`` stash saved per checkpointed layer, its input not included, memory units
    rounded down."""
    transient: tuple[tuple[int, ...], ...]
    """``[p][k]`` one rematerialised layer, memory units rounded up (times ``ckpt[p][k]``)."""
    budget: tuple[int, ...]
    """Activation budget per stage, memory units rounded down."""
    memory_unit: float
    """Bytes per memory unit (see the module docstring)."""
    events: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]
    """Per stage: (chunk about to run its backward, chunks in flight)."""
    workspace: tuple[int, ...] = ()
    """Per stage: memory units set aside beside the activations (the largest workspace of the
    running stage), already taken out of ``budget``; none when empty."""
    inputs: tuple[tuple[int, ...], ...] = ()
    """``[p][k]`` one layer's input, memory units rounded down: what a chunk in flight saves
    for each checkpointed layer after the first (the range keeps only its own input); none
    when empty."""

    @property
    def stages(self) -> int:
        return len(self.layers)

    @property
    def chunks(self) -> int:
        return len(self.base[0])


@dataclass(frozen=True)
class CheckpointSolution:
    """A checkpointing table and how it was obtained."""

    ckpt: tuple[tuple[int, ...], ...]
    """``[p][k]`` checkpointed layers."""
    objective: int
    """``sum_t C_t`` in microseconds."""
    status: str
    """``optimal``, ``feasible`` (time limit hit), ``trivial`` (no checkpointing fits, no
    solve), ``full`` (time limit hit without a solution: full checkpointing); the scheduler's
    tables without a solve: ``bounded``, ``uniform`` (:data:`elastic_pipe.scheduler.
    FALLBACK_REASONS`) and ``fixed`` (Megatron's ``--recompute-*`` table,
    :mod:`longctx.fixed_checkpointing`)."""


def build_problem(cost: CostModel, chunks: list[Chunk],
                  events: list[list[tuple[int, tuple[int, ...]]]]) -> CheckpointProblem:
    """The integer problem for ``chunks`` (in forward order) with the given in-flight sets; the
    budget of each stage sets aside its largest workspace over the chunks (TP + SP's
    full-sequence buffers, the loss's on the last stage,
    :meth:`~longctx.cost_model.CostModel.stage_workspace`)."""
    stages = range(cost.pp)
    unit = memory_unit(max(cost.activation_budget(p) for p in stages))
    up = lambda x: math.ceil(x / unit)  # noqa: E731 -- three tables share the rounding
    forward = tuple(tuple(round(cost.stage_forward(p, c) / TIME_UNIT) for c in chunks)
                    for p in stages)
    backward = tuple(tuple(round(cost.stage_backward(p, c) / TIME_UNIT) for c in chunks)
                     for p in stages)
    saving = [cost.layer_saving(c) for c in chunks]
    workspace = tuple(math.ceil(max((cost.stage_workspace(p, c) for c in chunks), default=0.0)
                                / unit) for p in stages)
    return CheckpointProblem(
        layers=tuple(cost.layers(p) for p in stages),
        forward=forward, backward=backward,
        base=tuple(tuple(f + b for f, b in zip(*rows)) for rows in zip(forward, backward)),
        transfer=tuple(round(cost.p2p_time(c) / TIME_UNIT) for c in chunks),
        recompute=(tuple(round(cost.layer_forward(c) / TIME_UNIT) for c in chunks),) * cost.pp,
        full=tuple(tuple(up(cost.stash_bytes(p, c)) for c in chunks) for p in stages),
        saving=(tuple(math.floor(s / unit) for s in saving),) * cost.pp,
        transient=(tuple(up(s) for s in saving),) * cost.pp,
        budget=tuple(math.floor(cost.activation_budget(p) / unit) - workspace[p]
                     for p in stages),
        memory_unit=unit,
        events=tuple(tuple(stage_events) for stage_events in events), workspace=workspace,
        inputs=(tuple(math.floor(cost.ckpt_per_token * c.tokens / unit) for c in chunks),)
        * cost.pp)


def memory_unit(largest_budget: float) -> float:
    """The power-of-two byte count that keeps ``largest_budget`` within ``BUDGET_UNITS``."""
    if largest_budget <= BUDGET_UNITS:
        return 1.0
    return float(2 ** math.ceil(math.log2(largest_budget / BUDGET_UNITS)))


def objective(problem: CheckpointProblem, ckpt) -> int:
    """``sum_t max_p`` stage time of the chunk in step ``t``."""
    d, n = problem.stages, problem.chunks
    return sum(max(problem.base[p][t - p] + problem.recompute[p][t - p] * ckpt[p][t - p]
                   for p in range(d) if 0 <= t - p < n)
               for t in range(n + d - 1))


def stage_peak(problem: CheckpointProblem, p: int, row: Sequence[int]) -> int:
    """The largest in-flight stash plus transient of stage ``p`` over its backwards (units),
    with ``row[k]`` layers checkpointed for chunk ``k``."""
    inputs = problem.inputs[p] if problem.inputs else (0,) * problem.chunks
    peak = 0
    for unit, held in problem.events[p]:
        total = sum(problem.full[p][k] - problem.saving[p][k] * row[k] for k in held)
        total -= sum(inputs[k] * max(row[k] - 1, 0) for k in held if k != unit)
        total += problem.transient[p][unit] * row[unit]
        peak = max(peak, total)
    return peak


def memory_peaks(problem: CheckpointProblem, ckpt) -> list[int]:
    """Per stage, the largest in-flight stash plus transient over all backwards (units)."""
    return [stage_peak(problem, p, ckpt[p]) for p in range(problem.stages)]


def peak_bytes(cost: CostModel, problem: CheckpointProblem, peaks: Sequence[int]) -> tuple:
    """Device bytes per stage at the ``peaks`` (units) of :func:`memory_peaks`: model state,
    activations and the workspace set aside."""
    workspace = problem.workspace or (0,) * cost.pp
    return tuple(cost.static_bytes(s) + (peaks[s] + workspace[s]) * problem.memory_unit
                 for s in range(cost.pp))


def fits(problem: CheckpointProblem, ckpt) -> bool:
    return all(peak <= budget for peak, budget in zip(memory_peaks(problem, ckpt),
                                                      problem.budget))


def full_table(problem: CheckpointProblem) -> tuple[tuple[int, ...], ...]:
    """Every layer of every stage checkpointed for every chunk."""
    return tuple((layers,) * problem.chunks for layers in problem.layers)


def uniform_table(problem: CheckpointProblem) -> tuple[tuple[int, ...], ...] | None:
    """Per stage the smallest uniform count that fits, or ``None`` when even all layers do not."""
    table = []
    for p in range(problem.stages):
        needed = next((count for count in range(problem.layers[p] + 1)
                       if stage_peak(problem, p, (count,) * problem.chunks)
                       <= problem.budget[p]), None)
        if needed is None:
            return None
        table.append((needed,) * problem.chunks)
    return tuple(table)

def solve(problem: CheckpointProblem, time_limit: float) -> CheckpointSolution | None:
    """The best table CP-SAT finds within ``time_limit``; ``None`` when none fits at all."""
    start = uniform_table(problem)
    if start is None:
        return None
    if not any(any(row) for row in start):
        return CheckpointSolution(start, objective(problem, start), "trivial")
    d, n = problem.stages, problem.chunks
    model = cp_model.CpModel()
    ckpt = [[model.NewIntVar(0, problem.layers[p], f"c{p}_{k}") for k in range(n)]
            for p in range(d)]
    for p in range(d):
        for k in range(n):
            model.AddHint(ckpt[p][k], start[p][k])
    steps = []
    for t in range(n + d - 1):
        pairs = [(p, t - p) for p in range(d) if 0 <= t - p < n]
        top = max(problem.base[p][k] + problem.recompute[p][k] * problem.layers[p]
                  for p, k in pairs)
        step = model.NewIntVar(0, top, f"C{t}")
        for p, k in pairs:
            model.Add(step >= problem.base[p][k] + problem.recompute[p][k] * ckpt[p][k])
        steps.append(step)
    # beyond[p][k] = max(ckpt[p][k] - 1, 0): the checkpointed layers whose input is not kept
    beyond = [[model.NewIntVar(0, max(problem.layers[p] - 1, 0), f"e{p}_{k}") for k in range(n)]
              for p in range(d)]
    for p in range(d):
        for k in range(n):
            model.AddMaxEquality(beyond[p][k], [ckpt[p][k] - 1, 0])
    inputs = problem.inputs or ((0,) * n,) * d
    for p, stage_events in enumerate(problem.events):
        for unit, held in stage_events:
            full = sum(problem.full[p][k] for k in held)
            if full <= problem.budget[p]:
                continue
            model.Add(sum(problem.saving[p][k] * ckpt[p][k] for k in held) * -1
                      - sum(inputs[p][k] * beyond[p][k] for k in held if k != unit)
                      + problem.transient[p][unit] * ckpt[p][unit]
                      <= problem.budget[p] - full)
    model.Minimize(sum(steps))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit
    status = solver.Solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        table = tuple(tuple(int(solver.Value(v)) for v in row) for row in ckpt)
        return CheckpointSolution(table, objective(problem, table),
                                  "optimal" if status == cp_model.OPTIMAL else "feasible")
    table = full_table(problem)
    return CheckpointSolution(table, objective(problem, table), "full")
