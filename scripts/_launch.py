"""The CPU benchmarks' launcher: a script runs itself as workers on 2 CPU ranks (one thread
each, ``BENCH_WORKER=1``) and reads the JSON report its rank 0 prints last; and the per-stage
peak over iterations that every benchmark reports."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_workers(script: str, flags: list[str], port: int, **env: str) -> dict:
    """Run ``script flags`` under ``torch.distributed.run`` on 2 CPU ranks with ``env`` added;
    return the JSON object of its last stdout line, or exit with the workers' status and the
    tail of their output when they fail."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={port}", script, *flags]
    full = dict(os.environ, BENCH_WORKER="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO,
                PYTHONWARNINGS="ignore", **env)
    done = subprocess.run(command, cwd=REPO, env=full, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(done.returncode)
    return json.loads(done.stdout.strip().splitlines()[-1])


def stage_peaks(runs: list[list[float]]) -> list[float]:
    """Per stage, the largest of the iterations' per-stage values (``runs[i][stage]``)."""
    return [max(column) for column in zip(*runs)]
