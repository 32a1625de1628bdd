"""A lower bound on a pipeline's time under every checkpointing table that fits in memory.

The scheduler uses it to skip CP-SAT solves whose pipeline cannot be part of the chosen plan
(:func:`elastic_pipe.scheduler.plan_elastic`). It is the largest of these bounds on the
dependency-graph makespan (:func:`elastic_pipe.pipeline_order.makespan`) of a table ``x``:

    makespan(x) >= start_0(r, s) + work(r, s) + recompute(r, s) + tail(r)

for every rank ``r`` and position ``s`` of its action list, where

- ``start_0(r, s)`` is when action ``s`` starts without any checkpointing (a backward: after
  its recomputation): starts are non-decreasing in every duration, and a table only adds
  recomputation;
- ``work(r, s)`` is the forward and backward time of actions ``s, s+1, ...``: a rank runs its
  actions one after another, each recomputation between the previous action and its backward;
- ``recompute(r, s)`` is a lower bound on the recomputation that any fitting table needs before
  the backwards after ``s``. The chunks in flight at such a backward (its own included) all run
  their backwards at or after it on that rank, so for backwards after ``s`` whose in-flight
  sets are pairwise disjoint (picked greedily from the end) the recomputation of their chunks
  is counted once each. For one in-flight set the
  least recomputation is the fractional knapsack ``min sum rc_k y_k`` s.t.
  ``sum (saving_k + input_k) y_k >= sum full_k - budget``, ``0 <= y_k <= layers``: chunks
  taken in order of recompute time per saved memory unit. It relaxes the checkpointing model's
  constraint (the transient of the rematerialised layer is dropped, every checkpointed layer is
  credited its input although the range keeps one, and ``y`` is fractional), so every fitting
  table satisfies it;
- ``tail(r)`` is the backward and transfer time of the last backward's chunk on ranks
  ``r - 1, ..., 0``, which run after rank ``r``'s last action (every rank ends with the
  backward of the same chunk, the last of the backward order).

With ``s`` the last action the bound is at least the time without checkpointing.
"""
from __future__ import annotations

import math

from elastic_pipe.checkpointing import CheckpointProblem
from elastic_pipe.pipeline_order import FORWARD, start_times


def least_recompute(problem: CheckpointProblem, stage: int, held: tuple[int, ...]) -> float:
    """Least recomputation time (microseconds, fractional) of ``stage`` that keeps the chunks
    ``held`` within its budget (the knapsack relaxation of the module docstring)."""
    need = sum(problem.full[stage][k] for k in held) - problem.budget[stage]
    if need <= 0:
        return 0.0
    recompute = problem.recompute[stage]
    saving = problem.saving[stage] if not problem.inputs else \
        [s + i for s, i in zip(problem.saving[stage], problem.inputs[stage])]
    total = 0.0
    for k in sorted((k for k in held if saving[k] > 0), key=lambda k: recompute[k] / saving[k]):
        take = min(need, saving[k] * problem.layers[stage])
        total += take * recompute[k] / saving[k]
        need -= take
        if need <= 0:
            break
    return total


def makespan_floor(orders: list[list[tuple[str, int]]], problem: CheckpointProblem) -> int:
    """Microseconds that no fitting table of ``problem`` can beat on the per-rank ``orders``."""
    zeros = [[0] * problem.chunks for _ in problem.layers]
    starts = start_times(orders, problem.forward, problem.backward, zeros, problem.transfer)
    best = 0.0
    for rank, actions in enumerate(orders):
        last = actions[-1][1]
        tail = sum(problem.backward[q][last] + problem.transfer[last] for q in range(rank))
        held_at = dict(problem.events[rank])
        work = recompute = 0.0
        counted: set[int] = set()
        for (kind, unit), start in zip(reversed(actions), reversed(starts[rank])):
            work += (problem.forward if kind == FORWARD else problem.backward)[rank][unit]
            best = max(best, start + work + recompute + tail)
            if kind != FORWARD and counted.isdisjoint(held_at[unit]):
                least = least_recompute(problem, rank, held_at[unit])
                if least > 0:
                    recompute += least
                    counted.update(held_at[unit])
    return math.floor(best)
