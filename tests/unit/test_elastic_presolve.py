"""Background planning: the worker's result is used when it plans the batch asked for; a
worker that dies is replaced by planning in the foreground with a warning; the worker runs
solver processes of its own, as many as the CPUs Slurm gives the node's task allow, the
training process none."""
import functools
import logging
import multiprocessing
import os
import signal
import time

from elastic_pipe.planning import plan_schedule, plan_schedule_with_workers
from elastic_pipe.presolve import BackgroundPlanner, planner_processes
from test_elastic_plan import CONFIG, cost_for, lengths_for


def square_sum(key, offset):
    return sum(k * k for k in key) + offset


def crash_in_worker(key):
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    return list(key)


def test_the_worker_plans_the_submitted_batch():
    planner = BackgroundPlanner(square_sum, timeout_s=120)
    try:
        planner.submit((1, 2, 3), 10)
        result, timing = planner.take((1, 2, 3), 10)
        assert result == 24 and timing.background
        assert 0 <= timing.waited_s and 0 <= timing.solve_s
        # Another batch than the one submitted: planned here, the submission stays pending.
        planner.submit((4,), 0)
        result, timing = planner.take((5,), 0)
        assert result == 25 and not timing.background
        assert timing.waited_s == timing.solve_s
        result, timing = planner.take((4,), 0)
        assert result == 16 and timing.background
        # The same batch with other arguments (a refitted cost model): planned here again.
        planner.submit((6,), 0)
        result, timing = planner.take((6,), 1)
        assert result == 37 and not timing.background
    finally:
        planner.close()


def where(tag, key):
    return tag, key, multiprocessing.parent_process() is not None


def test_the_worker_runs_its_own_function_and_the_foreground_the_plain_one():
    planner = BackgroundPlanner(functools.partial(where, "plain"), timeout_s=120,
                                worker_fn=functools.partial(where, "with solver processes"))
    try:
        planner.submit((1,))
        assert planner.take((1,))[0] == ("with solver processes", (1,), True)
        assert planner.take((2,))[0] == ("plain", (2,), False)
    finally:
        planner.close()


def test_the_workers_plan_with_solver_processes_is_the_foregrounds():
    """What training submits (:mod:`elastic_pipe.planned_batch`): the worker plans with two
    solver processes of its own, the foreground with none, and the plans are the same."""
    cost = cost_for(memory_gb=6)
    key = tuple(lengths_for(3))
    inputs = ("elastic", cost.model, cost.hardware, cost.parallel, CONFIG)
    planner = BackgroundPlanner(plan_schedule, timeout_s=300,
                                worker_fn=functools.partial(plan_schedule_with_workers, 2))
    try:
        planner.submit(key, *inputs)
        background, timing = planner.take(key, *inputs)
        assert timing.background
    finally:
        planner.close()
    assert background.to_dict() == plan_schedule(key, *inputs).to_dict()


def test_solver_processes_follow_the_cpus_per_task_shared_by_the_ranks():
    # 8 ranks on a task bound to 64 CPUs: 8 each, one of them the rank's own.
    assert planner_processes({"LOCAL_WORLD_SIZE": "8"}, cpus=64) == 7
    # Not bound (the affinity is the node's): Slurm's allotment caps it.
    assert planner_processes({"LOCAL_WORLD_SIZE": "8", "SLURM_CPUS_PER_TASK": "32"},
                             cpus=128) == 3
    assert planner_processes({"LOCAL_WORLD_SIZE": "2", "SLURM_CPUS_PER_TASK": "2"}, cpus=2) == 1
    assert planner_processes({"LOCAL_WORLD_SIZE": "4"}, cpus=2) == 1
    assert planner_processes({}, cpus=6) == 5
    assert planner_processes({"LOCAL_WORLD_SIZE": "", "SLURM_CPUS_PER_TASK": "x"}, cpus=3) == 2
    assert planner_processes({}) == max(1, len(os.sched_getaffinity(0)) - 1)


def test_a_crashed_worker_falls_back_to_the_foreground(caplog):
    planner = BackgroundPlanner(crash_in_worker, timeout_s=120)
    try:
        planner.submit((7, 8))
        with caplog.at_level(logging.WARNING, logger="elastic_pipe.presolve"):
            result, timing = planner.take((7, 8))
        assert result == [7, 8] and not timing.background
        assert "background planning failed" in caplog.text
        # A new worker is started for the next batch.
        planner.submit((1,))
        with caplog.at_level(logging.WARNING, logger="elastic_pipe.presolve"):
            assert planner.take((1,))[0] == [1]
    finally:
        planner.close()


def stall_in_worker(key):
    if multiprocessing.parent_process() is not None:
        time.sleep(3600)
    return list(key)


def test_a_stalled_worker_is_stopped_and_the_batch_planned_in_the_foreground(caplog):
    planner = BackgroundPlanner(stall_in_worker, timeout_s=1.0)
    others = set(multiprocessing.active_children())  # children of earlier tests
    try:
        planner.submit((3, 4))
        workers = [p for p in multiprocessing.active_children() if p not in others]
        with caplog.at_level(logging.WARNING, logger="elastic_pipe.presolve"):
            result, timing = planner.take((3, 4))
        assert result == [3, 4] and not timing.background
        assert "background planning failed (TimeoutError" in caplog.text
        # The stuck worker does not keep its core.
        assert workers, "submit started no worker process"
        for worker in workers:
            worker.join(timeout=10)
        alive = [(worker.pid, worker.exitcode) for worker in workers if worker.is_alive()]
        assert not alive, f"workers still running 10 s after being stopped: {alive}"
    finally:
        planner.close()


def stall_deaf_to_sigterm(key):
    """In the worker: ignore SIGTERM, say so by creating the file ``key[0]``, then stall."""
    if multiprocessing.parent_process() is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(key[0], "w").close()
        time.sleep(3600)
    return list(key)


def test_a_worker_that_outlives_sigterm_is_killed(tmp_path):
    marker = str(tmp_path / "ignoring")
    planner = BackgroundPlanner(stall_deaf_to_sigterm, timeout_s=1.0)
    others = set(multiprocessing.active_children())
    workers = []
    try:
        planner.submit((marker,))
        workers = [p for p in multiprocessing.active_children() if p not in others]
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(marker), "the worker never started ignoring SIGTERM"
        result, timing = planner.take((marker,))
        assert result == [marker] and not timing.background
        # The pool's own thread may reap the worker while this one does: a join can return
        # before the exit code is set, so it is read until set (a worker never killed stays
        # alive, and its exit code None).
        deadline = time.monotonic() + 10
        while any(worker.exitcode is None for worker in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [worker.exitcode for worker in workers] == [-signal.SIGKILL]
    finally:
        planner.close()
        for worker in workers:
            worker.kill()
