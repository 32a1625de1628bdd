"""The CPU benchmarks' launcher: a script runs itself as workers on 2 CPU ranks (one thread
each, ``BENCH_WORKER=1``) and reads the JSON report its rank 0 prints last; the per-stage
peak over iterations that every benchmark reports; and the ``--json`` writer every benchmark
uses, which records the command line arguments."""
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


def free_port() -> int:
    """A TCP port nothing on this machine listens on now, for a launch's rendezvous (the
    benchmarks' fixed ports collide when two of them run at once)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_json(path: str, report: dict, argv: list[str] | None = None) -> None:
    """Write ``report`` to ``path`` as JSON, with the benchmark's command line arguments
    (``argv``; default this process's) under ``"argv"``."""
    with open(path, "w") as f:
        json.dump({"argv": sys.argv[1:] if argv is None else argv, **report}, f, indent=2)


def stage_peaks(runs: list[list[float]]) -> list[float]:
    """Per stage, the largest of the iterations' per-stage values (``runs[i][stage]``)."""
    return [max(column) for column in zip(*runs)]


class Job:
    """A benchmark worker's Megatron start-up without Megatron's loop: the flags parsed by
    Megatron-LM's parser (``launch.initialize``), the model, optimizer and scheduler built by
    Megatron-LM, and the training split's document batches."""

    def __init__(self, argv: list[str]):
        from megatron.plugin import launch
        from megatron.plugin.sources import build_document_sources
        from megatron.training import get_tokenizer

        self.args = launch.initialize(argv)
        self.sources = build_document_sources(self.args, get_tokenizer().vocab_size)
        self.model, self.optimizer, self.scheduler, self.config = \
            launch.setup_model_and_optimizer()

    def documents(self, index: int):
        return self.sources["train"].documents(index)


def timed_step(job: Job, documents, upcoming=None, args=None):
    """One training step (Megatron's ``train_step`` through the selected schedule) between
    barriers, under ``args`` (a variant of the job's flags) when given: ``(record, wall
    seconds, per-stage peak saved-activation bytes)``. The record is the schedule's
    (:mod:`megatron.plugin.reporting`). The wall seconds leave out the preparation of the
    schedule's input (for ``elastic`` and ``seq1f1b``: planning the batch), slowest rank's,
    because a training run prepares it off the critical path (the background planner)."""
    import time

    import torch
    import torch.distributed as dist
    from megatron.training.global_vars import get_args, set_args

    from megatron.plugin import launch
    from megatron.plugin.document_data import GlobalBatch

    saved = get_args()
    set_args(args or job.args)
    try:
        batch = GlobalBatch(documents, lambda: upcoming if upcoming is not None else documents)
        dist.barrier()
        start = time.perf_counter()
        record = launch.train_step(job.model, job.optimizer, job.scheduler, job.config,
                                   iter([batch]))
        dist.barrier()
        took = time.perf_counter() - start
    finally:
        set_args(saved)
    prepare = torch.tensor([record["prepare_s"]], dtype=torch.float64)
    dist.all_reduce(prepare, op=dist.ReduceOp.MAX)
    return record, took - float(prepare), record["peak_activation_bytes_per_stage"]


#: The embedded corpus's tokens (bytes 0-255 and the end-of-document token 256) through
#: Megatron-LM's ``NullTokenizer``; the document schedules' per-token loss.
CORPUS_FLAGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
                "--calculate-per-token-loss"]
