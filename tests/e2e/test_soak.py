"""Soak (slow tier, ``-m slow``): 320 iterations of a small model under each of the project's
schedules, with memory flat after warm-up -- a leak fails the test.

Measured from outside: the anonymous memory of every worker (``psutil``: resident minus
file-backed and shared pages) once iteration :data:`WARM` is recorded and again near the end
must not have grown by more than :data:`ANON_SLACK` (measured: 1.4 MiB over 600 iterations of
``1f1b``; a leak of one activation row, 16 KiB, per micro-batch would add over 16 MiB).
Resident memory itself grows by about 25 MiB over the first 300 iterations under every schedule,
Megatron's included, and then stays flat: pages of the memory-mapped dataset and of libraries
read for the first time, which the kernel can drop. Inside, the activation meter must be empty
after every iteration.
"""
import contextlib
import os
import subprocess
import sys
import time

import psutil
import pytest

from harness import REPO, free_port, python_path
from test_pretrain import TINY, metrics
from test_recovery import workers

SCRIPT = "pretrain_gpt_elastic.py"
ITERATIONS, WARM = 320, 60
ANON_SLACK = 8 * 2**20
#: The project's schedules (Megatron's 1F1B, measured once, stays flat too: 1.4 MiB over 600).
SCHEDULES = {"elastic": ["--elastic-slices", "2"], "helix": [],
             "sppo": ["--sppo-subsequences", "2"]}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def anonymous(job: subprocess.Popen) -> dict[int, int]:
    """Anonymous resident bytes of each worker (none of the workers that are ending)."""
    found = {}
    with contextlib.suppress(psutil.Error):
        for worker in workers(job):
            with contextlib.suppress(psutil.Error):
                memory = worker.memory_info()
                found[worker.pid] = memory.rss - memory.shared
    return found


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_memory_stays_flat_over_a_long_run(tmp_path, schedule):
    records, log = tmp_path / "metrics.jsonl", tmp_path / "job.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", SCRIPT, *TINY,
               "--train-iters", str(ITERATIONS), "--pipeline-schedule", schedule,
               *SCHEDULES[schedule], "--log-interval", "50", "--metrics-jsonl", str(records)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path(), PYTHONWARNINGS="ignore",
               TORCH_CPP_LOG_LEVEL="ERROR")
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log, "w"),
                           stderr=subprocess.STDOUT)
    try:
        warm = last = None
        while job.poll() is None:
            done = records.read_text().count("\n") if records.exists() else 0
            if WARM <= done < ITERATIONS - 5:  # while every worker trains
                sample = anonymous(job)
                if warm is None:
                    warm = sample
                if len(sample) == len(warm):
                    last = sample
            time.sleep(0.2)
        assert job.returncode == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    rows = metrics(records)
    assert len(rows) == ITERATIONS
    assert warm and last and set(warm) == set(last)
    growth = {pid: last[pid] - warm[pid] for pid in warm}
    assert max(growth.values()) <= ANON_SLACK, growth
    # Nothing the meter counted outlives its iteration, so the activation peak cannot creep:
    # each iteration's peak is its own batch's.
    assert all(row["live_activation_bytes"] == 0 and row["peak_activation_bytes"] > 0
               for row in rows)
