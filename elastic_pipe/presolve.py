"""Planning off the critical path: the next batch's plan is solved while this batch trains.

:class:`BackgroundPlanner` keeps one worker process (``spawn``: it shares nothing with the
training process's threads or communicators) that runs a planning function on the document
lengths of the *next* iteration, submitted by :meth:`BackgroundPlanner.submit` right after the
current batch has been handed to the schedule. :meth:`BackgroundPlanner.take` returns that plan
when asked for the same lengths, waiting for it if it is not done yet; the time spent waiting is
the part of the solve that was *not* hidden behind training.

The worker may run solver processes of its own (:func:`planner_processes`: the CPUs
Slurm's ``--cpus-per-task`` gives the node's task, shared by its ranks); the training process
never forks them (a fork copies its threads' locks and communicators).

Failures never stop training: when the worker dies, raises or has not answered within
``timeout_s`` of being asked, :meth:`take` logs a warning, stops the worker and plans in the
foreground (the planner is deterministic, so the plan is the one the worker would have
returned), and the next submission starts a new worker.
"""
from __future__ import annotations

import concurrent.futures as futures
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanTiming:
    """How one plan was obtained."""

    solve_s: float
    """Seconds the planner took (in the worker or in the foreground)."""
    waited_s: float
    """Seconds the training loop waited for it; ``solve_s - waited_s`` was hidden."""
    background: bool
    """True when the worker's plan was used."""


def _timed(fn: Callable, args: tuple):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


class BackgroundPlanner:
    """Runs ``fn(key, *args)`` for the next batch in a worker process.

    ``fn`` must be a module-level function (it is pickled by reference); ``key`` identifies the
    batch (the document lengths). :meth:`take` uses the worker's result only for the same key
    *and* the same arguments (a cost model refitted since the submission is planned again).
    """

    def __init__(self, fn: Callable, timeout_s: float = 600.0,
                 worker_fn: Callable | None = None):
        self.fn = fn
        self.timeout_s = timeout_s
        self.worker_fn = worker_fn or fn
        """What the worker runs in place of ``fn``: the same result, with what the training
        process must not use (solver processes of its own: :func:`planner_processes`)."""
        self._pool: futures.ProcessPoolExecutor | None = None
        self._pending: tuple[object, futures.Future] | None = None

    def submit(self, key, *args) -> None:
        """Start planning batch ``key`` in the background (replacing any unused submission)."""
        if self._pending is not None:
            self._pending[1].cancel()
        try:
            if self._pool is None:
                self._pool = futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"))
            self._pending = ((key, args), self._pool.submit(_timed, self.worker_fn,
                                                            (key, *args)))
        except Exception as error:  # noqa: BLE001 -- a broken pool must not stop training
            log.warning("could not start background planning (%s); planning in the "
                        "foreground", error)
            self._reset()

    def take(self, key, *args):
        """``(result, PlanTiming)`` for batch ``key``: the worker's if it was submitted,
        otherwise (or when the worker failed) computed here. A submission for another batch
        stays pending (an evaluation between two training steps does not discard the next
        training batch's plan)."""
        pending = self._pending
        if pending is not None and pending[0] == (key, args):
            self._pending = None
            start = time.perf_counter()
            try:
                result, solve = pending[1].result(timeout=self.timeout_s)
                return result, PlanTiming(solve, time.perf_counter() - start, True)
            except Exception as error:  # noqa: BLE001 -- any worker failure falls back
                log.warning("background planning failed (%s: %s); planning this iteration in "
                            "the foreground", type(error).__name__, error)
                self._reset()
        start = time.perf_counter()
        result = self.fn(key, *args)
        took = time.perf_counter() - start
        return result, PlanTiming(took, took, False)

    def close(self) -> None:
        self._reset()

    def _reset(self) -> None:
        if self._pool is not None:
            stop_workers(self._pool)
        self._pool = None
        self._pending = None


def planner_processes(environ=os.environ, cpus: int | None = None) -> int:
    """Solver processes for one rank's background planner: the CPUs this process may run on
    (``cpus``, default its affinity: what Slurm binds a task to from ``--cpus-per-task``;
    ``SLURM_CPUS_PER_TASK`` when smaller, where Slurm does not bind) shared by the node's ranks
    (torchrun's ``LOCAL_WORLD_SIZE``), less one for the rank itself; at least 1 (the worker then
    solves in its own process)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    allotted = environ.get("SLURM_CPUS_PER_TASK", "")
    if allotted.isdigit() and int(allotted) > 0:
        cpus = min(cpus, int(allotted))
    ranks = environ.get("LOCAL_WORLD_SIZE", "")
    share = cpus // int(ranks) if ranks.isdigit() and int(ranks) > 0 else cpus
    return max(1, share - 1)


STOP_GRACE_S = 2.0
"""Seconds a worker has to end after SIGTERM before :func:`stop_workers` sends SIGKILL."""


def stop_workers(pool: futures.ProcessPoolExecutor) -> None:
    """Stop ``pool``'s worker processes and shut it down: a stuck solve would otherwise keep
    its core until it ends. Each worker gets SIGTERM, and SIGKILL if it has not ended
    :data:`STOP_GRACE_S` later. ``ProcessPoolExecutor`` has no public call for this before
    Python 3.14 (``terminate_workers``); its process table is read instead."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    # A worker's sentinel is ready once it has ended, reaped or not: the pool's own thread may
    # reap it meanwhile, so a worker is killed only while its sentinel says it still runs.
    running = {process.sentinel: process for process in processes}
    deadline = time.monotonic() + STOP_GRACE_S
    while running and (left := deadline - time.monotonic()) > 0:
        for ended in connection.wait(list(running), left):
            del running[ended]
    for process in running.values():
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
