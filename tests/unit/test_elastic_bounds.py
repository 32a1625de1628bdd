"""The planner's makespan floor against brute force: no table that fits beats it."""
import itertools
import random

import pytest

from elastic_pipe import checkpointing
from elastic_pipe.bounds import makespan_floor
from elastic_pipe.checkpointing import CheckpointProblem
from elastic_pipe.pipeline_order import inflight_sets, makespan, rank_orders


def random_case(seed, layers, border):
    """A random problem whose in-flight sets are those of the 1F1B orders over ``border``."""
    rng = random.Random(seed)
    d, n = len(layers), len(border)
    orders = rank_orders(d, border, seed % 3)
    events = inflight_sets(orders)
    full = tuple(tuple(rng.randint(10, 40) for _ in range(n)) for _ in range(d))
    saving = tuple(tuple(rng.randint(f // (2 * layers[p] + 2), f // (layers[p] + 1))
                         for f in full[p]) for p in range(d))
    forward = tuple(tuple(rng.randint(5, 30) for _ in range(n)) for _ in range(d))
    backward = tuple(tuple(2 * f for f in row) for row in forward)
    largest = [max(sum(full[p][k] for k in held) for _, held in events[p]) for p in range(d)]
    problem = CheckpointProblem(
        layers=tuple(layers), forward=forward, backward=backward,
        base=tuple(tuple(f + b for f, b in zip(*rows)) for rows in zip(forward, backward)),
        transfer=tuple(rng.randint(0, 4) for _ in range(n)),
        recompute=tuple(tuple(rng.randint(1, 12) for _ in range(n)) for _ in range(d)),
        full=full, saving=saving,
        transient=tuple(tuple(s + 1 for s in row) for row in saving),
        budget=tuple(int(largest[p] * rng.uniform(0.85, 0.99)) for p in range(d)),
        memory_unit=1.0, events=tuple(tuple(e) for e in events),
        inputs=tuple(tuple(rng.randint(0, 3) for _ in range(n)) for _ in range(d)))
    return orders, problem


def time_of(orders, problem, table):
    recompute = [[r * c for r, c in zip(rr, cc)] for rr, cc in zip(problem.recompute, table)]
    return round(makespan(orders, problem.forward, problem.backward, recompute,
                          problem.transfer))


def fitting_tables(problem):
    d, n = problem.stages, problem.chunks
    for values in itertools.product(*[range(problem.layers[p] + 1)
                                      for p in range(d) for _ in range(n)]):
        table = tuple(tuple(values[p * n:(p + 1) * n]) for p in range(d))
        if checkpointing.fits(problem, table):
            yield table


@pytest.mark.parametrize("seed", range(32))
@pytest.mark.parametrize("layers, border", [
    ((2, 1), [0, 1, 2]), ((2, 1), [1, 0, 2]), ((1, 1, 1), [2, 1, 0]), ((1, 2, 1), [0, 2, 1])])
def test_no_fitting_table_beats_the_floor(seed, layers, border):
    orders, problem = random_case(seed, layers, border)
    floor = makespan_floor(orders, problem)
    zeros = tuple((0,) * problem.chunks for _ in layers)
    assert floor >= time_of(orders, problem, zeros)
    times = [time_of(orders, problem, table) for table in fitting_tables(problem)]
    if times:
        assert min(times) >= floor


def test_one_stage_floor_is_the_forced_recomputation():
    """One stage, chunks one at a time: each must drop 2 of 3 layers (10 units, budget 6, 2
    saved per layer) at 5 us each, so the floor is the work plus 10 us per chunk -- and the
    uniform table reaches it."""
    n = 4
    problem = CheckpointProblem(
        layers=(3,), forward=((10,) * n,), backward=((20,) * n,), base=((30,) * n,),
        transfer=(0,) * n, recompute=((5,) * n,), full=((10,) * n,), saving=((2,) * n,),
        transient=((0,) * n,), budget=(6,), memory_unit=1.0,
        events=(tuple((k, (k,)) for k in range(n)),))
    orders = rank_orders(1, list(range(n)), 0)
    assert makespan_floor(orders, problem) == n * (30 + 10)
    assert time_of(orders, problem, checkpointing.uniform_table(problem)) == n * (30 + 10)
