"""A rank that stops (``SIGSTOP``: a frozen node, a process swapped out) makes every other rank
fail within the configured timeout, naming the operation, and the log names the stopped rank
(:mod:`megatron.plugin.hang_report`); no rank waits forever.

Two paths of waiting: the executor's transfers (every schedule of the project runs on it;
``elastic`` here), which time out after ``--pipeline-timeout-s``, and Megatron-LM's own
schedules and every collective, which time out after ``--distributed-timeout-minutes``
(``1f1b`` here, the rank stopped being the first).
"""
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import REPO, free_port, python_path
from test_pretrain import TINY, metrics
from test_recovery import workers

SCRIPT = "pretrain_gpt_elastic.py"
pytestmark = pytest.mark.timeout(600)


def stop_a_rank(tmp_path, schedule: str, flags: list[str], rank: int,
                mid_schedule: bool = False) -> tuple[str, float]:
    """Train, stop ``rank`` once two iterations are recorded; (output, seconds until the job
    ended). The last rank records an iteration at the end of its forward-backward, before the
    gradient collectives, so a stop then leaves the other rank waiting in a collective. With
    ``mid_schedule`` the stop waits for a third record instead and aims at the middle of the
    next forward-backward (the records' period less half their ``forward_backward_s``), where
    the other rank waits in a pipeline transfer; it may still land in a collective."""
    records, log = tmp_path / "metrics.jsonl", tmp_path / "job.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", SCRIPT, *TINY,
               "--train-iters", "100000", "--pipeline-schedule", schedule, *flags,
               "--metrics-jsonl", str(records)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path(), PYTHONWARNINGS="ignore",
               TORCH_CPP_LOG_LEVEL="ERROR", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2")
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log, "w"),
                           stderr=subprocess.STDOUT)
    stopped = None
    try:
        deadline = time.monotonic() + 240
        seen = []
        while len(seen) < (3 if mid_schedule else 2):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            count = len(metrics(records)) if records.exists() else 0
            seen += [time.monotonic()] * (count - len(seen))
            time.sleep(0.01)
        stopped = next(p for p in workers(job) if p.environ().get("RANK") == str(rank))
        if mid_schedule:
            period = seen[2] - seen[1]
            schedule_s = metrics(records)[2]["forward_backward_s"]
            time.sleep(max(0.0, seen[2] + period - schedule_s / 2 - time.monotonic()))
        stopped.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        job.wait(timeout=400)
        return log.read_text(), time.monotonic() - start
    finally:
        if job.poll() is None:
            if stopped is not None:
                stopped.kill()
            job.kill()


#: Megatron-LM's timeout of every process group (whole minutes; the finer
#: ``--distributed-timeout-seconds-after-init`` needs CUDA).
COLLECTIVES = ["--distributed-timeout-minutes", "1"]


def test_a_stopped_rank_is_named_under_the_executor_and_megatrons_schedule(tmp_path):
    """Both jobs at once (each spends most of its time waiting for its timeout). Under the
    executor the stop is aimed at a pipeline transfer (10 s timeout); a stop that lands in a
    gradient collective instead must end the job after the collectives' minute, naming that
    operation. Under Megatron's schedule the stopped first rank leaves the other waiting in a
    collective."""
    # 96 documents a batch: the forward-backward takes ~90% of an iteration (~0.3 s on 2 CPU
    # cores), so the aim is far wider than the stop's latency.
    for name in ("executor", "megatron"):
        (tmp_path / name).mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        executor = pool.submit(stop_a_rank, tmp_path / "executor", "elastic",
                               ["--global-batch-size", "96", "--pipeline-timeout-s", "10",
                                *COLLECTIVES], 1, mid_schedule=True)
        megatron = pool.submit(stop_a_rank, tmp_path / "megatron", "1f1b", COLLECTIVES, 0)
        output, took = executor.result()
        assert "error on rank 0 of 2: timed out waiting; rank(s) 1 stopped answering" in output, \
            output[-3000:]
        if "Timed out waiting 60000ms" in output:
            assert took < 60 + 60
        else:
            assert "pipeline rank 0: " in output and "(peer stage 1) did not complete within " \
                "10.0s" in output, output[-3000:]
            assert took < 10 + 60
        output, took = megatron.result()
        assert "Timed out waiting 60000ms" in output, output[-3000:]
        assert "error on rank 1 of 2: timed out waiting; rank(s) 0 stopped answering" in output
        assert took < 60 + 60
