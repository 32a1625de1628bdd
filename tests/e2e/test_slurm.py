"""The Slurm batch script on one node: Slurm's variables set, ``srun`` a local stand-in that
runs its command as task 0 of node 0 with the CPUs of its own ``--cpus-per-task`` (Slurm 22.05
and later: a step does not inherit the job's), and behind it a real 2-rank CPU training run, or,
for the script's restart path (SIGTERM, checkpoint, ``scontrol requeue``, the requeued job), a
stand-in for the training that only records what it was given."""
import os
import signal
import stat
import subprocess
import sys
import time

from harness import REPO, free_port, python_path
from test_pretrain import TINY

SHIM = """#!/usr/bin/env bash
# srun stand-in: record the options, run the command as the only task of node 0 with the
# CPUs of srun's own --cpus-per-task (Slurm 22.05 and later: not the job's).
echo "$@" > "$SRUN_LOG"
unset SLURM_CPUS_PER_TASK
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case "$1" in --cpus-per-task=*) export SLURM_CPUS_PER_TASK="${1#*=}" ;; esac
  shift
done
SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
# scontrol stand-in: the node list's hosts, and requeue requests recorded.
case "$1" in
  show) echo "$3" ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""
TRAINING = """#!/usr/bin/env bash
# Stand-in for the training (what the script runs as $PYTHON): records its CPUs and arguments;
# with FINISH set it ends at once (a resumed run that completes), else it runs until SIGTERM
# and exits 0 (Megatron-LM's --exit-signal-handler: save, then stop).
echo "cpus=$SLURM_CPUS_PER_TASK $*" >> "$TRAINING_LOG"
[ -n "${FINISH:-}" ] && exit "${FINISH}"
trap 'echo saved >> "$TRAINING_LOG"; exit 0' TERM
touch "$TRAINING_LOG.ready"
while :; do sleep 0.1; done
"""


def tools(tmp_path, **scripts) -> str:
    """A folder of executable stand-ins (name -> text), for the front of ``PATH``."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    return str(folder)


def job_script(tmp_path) -> str:
    """sbatch runs a copy of the script from its spool directory, not from the repository."""
    job = tmp_path / "slurm_script"
    job.write_text(open(os.path.join(REPO, "scripts/slurm/pretrain_gpt_elastic.sbatch")).read())
    return str(job)


def slurm_env(tmp_path, path: str, **extra) -> dict:
    """What sbatch sets for a one-node job with ``--cpus-per-task 2``."""
    return dict(os.environ, PATH=f"{path}:{os.environ['PATH']}", SLURM_JOB_ID="42",
                SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1", SLURM_CPUS_PER_TASK="2",
                SLURM_SUBMIT_DIR=REPO, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()),
                SRUN_LOG=str(tmp_path / "srun.log"), SCONTROL_LOG=str(tmp_path / "scontrol.log"),
                OMP_NUM_THREADS="1", PYTHONPATH=python_path(), **extra)


def test_sbatch_script_runs_one_node(tmp_path):
    env = slurm_env(tmp_path, tools(tmp_path, srun=SHIM), PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", job_script(tmp_path), *TINY, "--train-iters", "3",
         "--pipeline-schedule", "1f1b"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "1 node(s) x 2 rank(s), 2 CPUs a node, rendezvous 127.0.0.1:" in result.stdout
    assert len([line for line in result.stdout.splitlines() if " iteration " in line]) == 3
    srun_options = (tmp_path / "srun.log").read_text()
    assert "--nodes=1 --ntasks-per-node=1 --cpus-per-task=2" in srun_options


def test_sigterm_requeues_and_the_requeued_job_runs_the_same_command(tmp_path):
    """The time limit's SIGTERM reaches the training, which saves and stops; the script asks
    Slurm to requeue the job and exits 0; Slurm runs it again with the same arguments, and a
    run that ends is not requeued. The training gets srun's --cpus-per-task every time."""
    path = tools(tmp_path, srun=SHIM, scontrol=SCONTROL, training=TRAINING)
    log = tmp_path / "training.log"
    env = slurm_env(tmp_path, path, PYTHON=os.path.join(path, "training"),
                    TRAINING_LOG=str(log))
    command = ["bash", job_script(tmp_path), "--train-iters", "10", "--save", "ckpt",
               "--load", "ckpt"]
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "training.log.ready").exists() and job.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output
    assert "requeueing job 42" in output
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
    started, saved = log.read_text().splitlines()
    assert started.startswith("cpus=2 -m torch.distributed.run --nnodes 1 --node-rank 0 ")
    assert started.endswith(" pretrain_gpt_elastic.py --train-iters 10 --save ckpt --load ckpt "
                            "--exit-signal-handler")
    assert saved == "saved"
    requeued = subprocess.run(command, cwd=tmp_path, env=dict(env, FINISH="0"),
                              capture_output=True, text=True, timeout=60)
    assert requeued.returncode == 0, requeued.stdout
    assert log.read_text().splitlines()[2] == started
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
    failed = subprocess.run(command, cwd=tmp_path, env=dict(env, FINISH="3"),
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 3
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
