"""Unattended recovery through the Slurm batch script (``scripts/slurm/pretrain_gpt_elastic.sbatch``)
on one node of 2 CPU ranks, with ``--save DIR --load DIR``:

* a worker killed with SIGKILL, mid-iteration and mid-save, is restarted by torchrun
  (``--max-restarts``) with its peer from the latest complete checkpoint, and the run ends with
  every iteration's loss and token count equal to an uninterrupted run's (no document skipped
  or repeated);
* SIGTERM to the batch script (what Slurm sends before the time limit, ``--signal=B:TERM``)
  makes the training save at the end of its iteration and stop; the script asks Slurm to
  requeue the job and exits 0 within a bounded time, and the requeued job (the same command)
  resumes and ends like the uninterrupted run.

``srun`` and ``scontrol`` are local stand-ins (``test_slurm.py``'s: ``scontrol`` answers
``show hostnames`` and records ``requeue``).
"""
import os
import random
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest

from harness import REPO, free_port, python_path, torchrun
from test_pretrain import TINY, metrics
from test_slurm import SCONTROL, SHIM

SCRIPT = "pretrain_gpt_elastic.py"
BATCH = os.path.join(REPO, "scripts/slurm/pretrain_gpt_elastic.sbatch")
ITERATIONS = 10
SCHEDULE_FLAGS = {"1f1b": [], "elastic": ["--elastic-slices", "2"], "helix": [],
                  "sppo": ["--sppo-subsequences", "2"]}
pytestmark = pytest.mark.timeout(900)


def flags(schedule: str) -> list[str]:
    """TINY with dropout on (resuming must restore the random states), ``schedule``."""
    argv = list(TINY)
    for name in ("--hidden-dropout", "--attention-dropout"):
        argv[argv.index(name) + 1] = "0.1"
    return [*argv, "--train-iters", str(ITERATIONS), "--pipeline-schedule", schedule,
            *SCHEDULE_FLAGS[schedule]]


#: Set in a job's environment, which every process of the job inherits.
JOB_MARK = "LONGCTX_TEST_JOB"


def batch_job(tmp_path, argv, shutdown_s: int) -> tuple[list[str], dict]:
    """The command and environment of the batch script as sbatch runs it (a copy, from its
    spool directory), with the srun and scontrol stand-ins on PATH; torchrun gives its workers
    ``shutdown_s`` seconds to stop after SIGTERM."""
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for name, text in (("srun", SHIM), ("scontrol", SCONTROL)):
        (tools / name).write_text(text)
        (tools / name).chmod((tools / name).stat().st_mode | stat.S_IEXEC)
    job = tmp_path / "slurm_script"
    job.write_text(open(BATCH).read())
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", PYTHON=sys.executable,
               SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1",
               SLURM_CPUS_PER_TASK="2",
               SLURM_SUBMIT_DIR=REPO, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()),
               SRUN_LOG=str(tmp_path / "srun.log"), SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               OMP_NUM_THREADS="1", PYTHONPATH=python_path(), PYTHONWARNINGS="ignore",
               TORCH_CPP_LOG_LEVEL="ERROR", TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(shutdown_s),
               **{JOB_MARK: str(tmp_path)})
    return ["bash", str(job), *argv], env


def kill_leftovers(env: dict) -> None:
    """Kill the processes of the job of ``env`` that outlived it. A rank killed, or stopped by
    torchrun for a restart, leaves the processes it spawned (Megatron's checkpoint writer,
    elastic's planning worker) to init, where they would wait for good, about 550 MB each."""
    for process in psutil.process_iter():
        try:
            if process.environ().get(JOB_MARK) == env[JOB_MARK]:
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def last_records(path) -> dict[int, dict]:
    """Per iteration, its record."""
    return {record["iteration"]: record for record in metrics(path)}


def checkpointed(save) -> int:
    tracker = save / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text()) if tracker.exists() else 0


def wait_for(condition, job: subprocess.Popen, log, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended early ({job.returncode}): " \
                                   f"{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out: {log.read_text()[-3000:]}"
        time.sleep(0.01)


def workers(job: subprocess.Popen) -> list[psutil.Process]:
    return [child for child in psutil.Process(job.pid).children(recursive=True)
            if SCRIPT in " ".join(child.cmdline()) and "torch.distributed.run" not in
            " ".join(child.cmdline())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per schedule, the records of an uninterrupted run (computed once)."""
    found = {}

    def run(schedule):
        if schedule not in found:
            path = tmp_path_factory.mktemp(schedule) / "whole.jsonl"
            torchrun(2, SCRIPT, [*flags(schedule), "--metrics-jsonl", str(path)])
            found[schedule] = last_records(path)
        return found[schedule]

    return run


def assert_same_run(path, expected: dict) -> None:
    """One row per iteration (a restarted run replaces the rows of the iterations it trains
    again), each with the uninterrupted run's tokens and loss."""
    assert [record["iteration"] for record in metrics(path)] == list(range(1, ITERATIONS + 1))
    got = last_records(path)
    assert [got[i]["num_tokens"] for i in sorted(got)] == \
        [expected[i]["num_tokens"] for i in sorted(expected)]
    assert [got[i]["lm_loss"] for i in sorted(got)] == \
        [expected[i]["lm_loss"] for i in sorted(expected)]


@pytest.mark.parametrize("schedule", ["1f1b", "elastic", "helix", "sppo"])
def test_killed_workers_are_restarted_and_the_run_ends_as_if_uninterrupted(
        tmp_path, uninterrupted, schedule):
    expected = uninterrupted(schedule)
    save, part = tmp_path / "ckpt", tmp_path / "part.jsonl"
    command, env = batch_job(tmp_path, [
        *flags(schedule), "--save", str(save), "--load", str(save), "--save-interval", "1",
        "--metrics-jsonl", str(part)], shutdown_s=5)
    chance = random.Random(f"{schedule} kills")
    log = tmp_path / "job.log"
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=open(log, "w"),
                           stderr=subprocess.STDOUT, text=True)
    try:
        # 1. Mid-iteration: a random moment after the second iteration was recorded.
        wait_for(lambda: part.exists() and len(metrics(part)) >= 2, job, log)
        time.sleep(chance.uniform(0.0, 0.3))
        chance.choice(workers(job)).send_signal(signal.SIGKILL)
        killed_at = len(metrics(part))
        # 2. Mid-save: the next checkpoint's directory exists, its tracker not yet updated.
        wait_for(lambda: len(metrics(part)) > killed_at + 1, job, log)
        done = checkpointed(save)
        wait_for(lambda: (save / f"iter_{done + 1:07d}").exists(), job, log)
        chance.choice(workers(job)).send_signal(signal.SIGKILL)
        job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
        kill_leftovers(env)
    output = log.read_text()
    assert job.returncode == 0, output[-4000:]
    assert output.count("will not load any checkpoints") == 1  # the first start only
    assert_same_run(part, expected)
    assert checkpointed(save) == ITERATIONS


@pytest.mark.parametrize("schedule", ["1f1b", "elastic"])
def test_sigterm_saves_requeues_and_the_requeued_job_resumes(tmp_path, uninterrupted,
                                                              schedule):
    expected = uninterrupted(schedule)
    save, part = tmp_path / "ckpt", tmp_path / "part.jsonl"
    command, env = batch_job(tmp_path, [
        *flags(schedule), "--save", str(save), "--load", str(save), "--save-interval", "100",
        "--metrics-jsonl", str(part)], shutdown_s=60)
    log = tmp_path / "job.log"
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=open(log, "w"),
                           stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: part.exists() and len(metrics(part)) >= 3, job, log)
        job.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        job.wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            job.kill()
        kill_leftovers(env)
    output = log.read_text()
    assert job.returncode == 0, output[-4000:]
    assert took < 60, took
    stopped = checkpointed(save)
    assert 3 <= stopped < ITERATIONS, output[-3000:]
    assert sorted(last_records(part)) == list(range(1, stopped + 1))
    assert "requeueing job 42" in output
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
    # Slurm runs the requeued job's script again with the same arguments.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "will not load any checkpoints" not in result.stdout
    assert_same_run(part, expected)
    assert checkpointed(save) == ITERATIONS
