"""Faults of the planner's worker pool never change the plan: a worker that dies, or a solve
that does not answer within the guard, gives the plan of planning in this process, with a
warning, and leaves no worker running."""
import dataclasses
import logging
import multiprocessing
import os
import time

from elastic_pipe import checkpointing, scheduler
from elastic_pipe.scheduler import plan_elastic
from test_elastic_plan import CONFIG, cost_for, lengths_for

POOLED = dataclasses.replace(CONFIG, workers=2)
SOLVE = checkpointing.solve


def die(i, j):
    """Stands in for the chunking of group ``(i, j)`` in a worker: the worker dies."""
    del i, j
    os._exit(9)


def stall_in_worker(problem, limit):
    if multiprocessing.parent_process() is not None:
        time.sleep(3600)
    return SOLVE(problem, limit)


def foreground_plan(lengths, cost):
    scheduler._memo.clear()
    return plan_elastic(lengths, cost, CONFIG).to_dict()


def assert_no_worker_left():
    for worker in multiprocessing.active_children():
        worker.join(timeout=10)
    assert not multiprocessing.active_children()


def test_a_dead_worker_gives_the_plan_of_this_process(monkeypatch, caplog):
    lengths, cost = lengths_for(7), cost_for(1.4)
    expected = foreground_plan(lengths, cost)
    monkeypatch.setattr(scheduler, "_group_chunking_in_worker", die)
    scheduler._memo.clear()
    with caplog.at_level(logging.WARNING, logger="elastic_pipe.scheduler"):
        got = plan_elastic(lengths, cost, POOLED).to_dict()
    assert got == expected
    assert "a planning worker died" in caplog.text
    assert_no_worker_left()


def test_a_stalled_solve_is_solved_here_and_its_worker_stopped(monkeypatch, caplog):
    lengths, cost = lengths_for(7), cost_for(1.4)
    expected = foreground_plan(lengths, cost)
    monkeypatch.setattr(checkpointing, "solve", stall_in_worker)
    monkeypatch.setattr(scheduler, "GUARD_SLACK_S", 1.0)
    scheduler._memo.clear()
    with caplog.at_level(logging.WARNING, logger="elastic_pipe.scheduler"):
        got = plan_elastic(lengths, cost, POOLED).to_dict()
    assert got == expected
    assert "no checkpointing solve returned within" in caplog.text
    assert "run in this process (same plan)" in caplog.text
    assert_no_worker_left()
