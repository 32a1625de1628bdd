"""CP-SAT checkpointing against an independent brute force on small cases."""
import itertools
import random

import pytest

from elastic_pipe import checkpointing
from elastic_pipe.checkpointing import CheckpointProblem


def brute_force(problem: CheckpointProblem):
    """Best sum over steps of the slowest stage, by enumerating every table (own evaluation)."""
    d, n = problem.stages, problem.chunks
    cells = [(p, k) for p in range(d) for k in range(n)]
    best = None
    for values in itertools.product(*[range(problem.layers[p] + 1) for p, _ in cells]):
        table = [[0] * n for _ in range(d)]
        for (p, k), v in zip(cells, values):
            table[p][k] = v
        ok = True
        for p in range(d):
            for unit, held in problem.events[p]:
                used = sum(problem.full[p][k] - problem.saving[p][k] * table[p][k] for k in held)
                # a chunk in flight keeps one input for its checkpointed layers
                used -= sum(problem.inputs[p][k] * (table[p][k] - 1) for k in held
                            if k != unit and table[p][k] > 1)
                used += problem.transient[p][unit] * table[p][unit]
                ok &= used <= problem.budget[p]
        if not ok:
            continue
        total = 0
        for t in range(n + d - 1):
            total += max(problem.base[p][t - p] + problem.recompute[p][t - p] * table[p][t - p]
                         for p in range(d) if 0 <= t - p < n)
        best = total if best is None else min(best, total)
    return best


def random_problem(seed):
    rng = random.Random(seed)
    d, n = 2, 3
    layers = (2, 1)
    events = []
    for p in range(d):   # 1F1B windows of d - p chunks
        w = d - p
        events.append(tuple((k, tuple(range(max(0, k - w + 1) if k + w <= n else k,
                                            min(n, k + w))))
                            for k in range(n)))
    full = tuple(tuple(rng.randint(10, 40) for _ in range(n)) for _ in range(d))
    saving = tuple(tuple(rng.randint(3, f // (layers[p] + 1)) for f in full[p])
                   for p in range(d))
    forward = tuple(tuple(rng.randint(5, 30) for _ in range(n)) for _ in range(d))
    backward = tuple(tuple(2 * f for f in row) for row in forward)
    return CheckpointProblem(
        layers=layers, forward=forward, backward=backward,
        base=tuple(tuple(3 * f for f in row) for row in forward),
        transfer=(0,) * n,
        recompute=tuple(tuple(rng.randint(1, 10) for _ in range(n)) for _ in range(d)),
        full=full, saving=saving,
        transient=tuple(tuple(s + 1 for s in row) for row in saving),
        budget=tuple(int(sum(sorted(full[p])[-2:]) * rng.uniform(0.55, 0.95))
                     for p in range(d)),
        memory_unit=1.0, events=tuple(events),
        inputs=tuple(tuple(rng.randint(0, 4) for _ in range(n)) for _ in range(d)))


@pytest.mark.parametrize("seed", range(12))
def test_cp_sat_is_optimal_against_brute_force(seed):
    problem = random_problem(seed)
    expected = brute_force(problem)
    solution = checkpointing.solve(problem, time_limit=5.0)
    if expected is None:
        assert solution is None
        return
    assert solution is not None and solution.status in ("optimal", "trivial")
    assert solution.objective == expected
    assert checkpointing.fits(problem, solution.ckpt)


def test_cases_cover_checkpointing_and_infeasibility():
    outcomes = {brute_force(random_problem(seed)) is None for seed in range(12)}
    solved = [checkpointing.solve(random_problem(s), 5.0) for s in range(12)]
    assert any(s is not None and any(map(any, s.ckpt)) for s in solved)
    assert False in outcomes


def test_uniform_table_is_feasible_and_minimal():
    for seed in range(12):
        problem = random_problem(seed)
        table = checkpointing.uniform_table(problem)
        if table is None:
            assert not checkpointing.fits(problem, checkpointing.full_table(problem))
            continue
        assert checkpointing.fits(problem, table)
        for p in range(problem.stages):
            if table[p][0]:
                lower = [list(row) for row in table]
                lower[p] = [table[p][0] - 1] * problem.chunks
                assert not checkpointing.fits(problem, lower)


@pytest.mark.parametrize("budget,unit", [(1e3, 1.0), (2.0 ** 20, 1.0), (2.0 ** 20 + 1, 2.0),
                                         (80e9, 2.0 ** 17)])
def test_memory_unit_keeps_budgets_within_range(budget, unit):
    assert checkpointing.memory_unit(budget) == unit
    assert budget / unit <= checkpointing.BUDGET_UNITS
