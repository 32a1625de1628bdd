"""The Slurm batch script on one node: Slurm's variables set, ``srun`` a local shim that runs
its command as task 0 of node 0, and a real 2-rank CPU training run behind it."""
import os
import stat
import subprocess
import sys

from harness import REPO, free_port, python_path
from test_pretrain import TINY

SHIM = """#!/usr/bin/env bash
# srun stand-in: record the options, run the command as the only task of node 0.
echo "$@" > "$SRUN_LOG"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@"
"""


def test_sbatch_script_runs_one_node(tmp_path):
    shim = tmp_path / "bin" / "srun"
    shim.parent.mkdir()
    shim.write_text(SHIM)
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{shim.parent}:{os.environ['PATH']}", PYTHON=sys.executable,
               SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1",
               SLURM_SUBMIT_DIR=REPO, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()),
               SRUN_LOG=str(tmp_path / "srun.log"), OMP_NUM_THREADS="1", PYTHONPATH=python_path())
    # sbatch runs a copy of the script from its spool directory, not from the repository.
    job = tmp_path / "slurm_script"
    job.write_text(open(os.path.join(REPO, "scripts/slurm/pretrain_gpt_elastic.sbatch")).read())
    result = subprocess.run(
        ["bash", str(job), *TINY, "--train-iters", "3",
         "--pipeline-schedule", "1f1b"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "1 node(s) x 2 rank(s), rendezvous 127.0.0.1:" in result.stdout
    assert len([line for line in result.stdout.splitlines() if " iteration " in line]) == 3
    srun_options = (tmp_path / "srun.log").read_text()
    assert "--nodes=1 --ntasks-per-node=1" in srun_options
