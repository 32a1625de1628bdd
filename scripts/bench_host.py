"""Benchmark: the host's work per unit of each document schedule against Megatron's ``1f1b``.

    python scripts/bench_host.py [--repo CHECKOUT] [--iters 2] [--json OUT] [model flags ...]

On one CPU rank (pipeline size 1, one thread: the host is all there is, so what a schedule adds
per unit shows in full) one global batch of the embedded corpus's documents runs under each
schedule of :data:`SCHEDULES`, each after one warm-up step with the same documents, in one
process (Megatron's start-up again for each, ``launch.reset`` between). Measured over the
forward-backward call alone (the schedule's input prepared before it, the optimizer step
after it left out):

* ATen operator calls: every operator the dispatcher runs, forward and backward, counted by a
  ``TorchDispatchMode`` in a separate step after the timed ones (the mode slows the host);
* host seconds: the call's wall time (median of ``--iters`` steps);

each per unit (the schedule's micro-batches or chunks) and per 1K tokens, with the ratio of
the per-1K-token figures to ``1f1b``'s, and the operators that make up most of each
schedule's calls.

``--repo CHECKOUT`` runs the project code of another checkout (for a before/after pair, a
worktree of the earlier commit); this script and its launcher stay this checkout's.
``--json OUT`` writes ``{"argv", "repo_commit", "model", "schedules": {NAME: {...}}}``.
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

from _launch import CORPUS_FLAGS, REPO, write_json

#: The schedules compared, with the flags each needs beside the model's; ``1f1b`` first.
SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "elastic": ["--pipeline-schedule", "elastic"],
    "seq1f1b": ["--pipeline-schedule", "seq1f1b"],
    "sppo": ["--pipeline-schedule", "sppo"],
    "helix": ["--pipeline-schedule", "helix"],
}
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "4096", "--max-position-embeddings", "4096",
         "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "100",
         "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--position-embedding-type", "rope"]
#: Operators listed per schedule, most called first.
TOP_OPERATORS = 12


def count_operators(call):
    """``(result, Counter of ATen operator overloads)`` of ``call()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as counting:
        result = call()
    return result, counting.calls


def measure(name: str, argv: list[str], iters: int) -> dict:
    """One schedule's figures (module doc) after Megatron's start-up with ``argv``."""
    from megatron.core.pipeline_parallel import schedules

    from megatron.plugin import launch
    from megatron.plugin.document_data import GlobalBatch
    from megatron.plugin.sources import build_document_sources
    from megatron.training import get_tokenizer

    args = launch.initialize(argv)
    documents = build_document_sources(args, get_tokenizer().vocab_size)["train"].documents(0)
    model, optimizer, scheduler, config = launch.setup_model_and_optimizer()
    schedule = schedules.get_forward_backward_func()  # the registry's, once initialised
    inner = schedule.schedule
    seconds, counted = [], {}

    def timed(**kwargs):
        start = time.perf_counter()
        result = inner(**kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    def counting(**kwargs):
        result, counted["calls"] = count_operators(lambda: inner(**kwargs))
        return result

    records = []
    for step, wrapper in enumerate([timed] * (iters + 1) + [counting]):
        schedule.schedule = wrapper
        records.append(launch.train_step(model, optimizer, scheduler, config,
                                         iter([GlobalBatch(documents, lambda: documents)]),
                                         step))
    schedule.schedule = inner
    record = records[-1]
    units, tokens = record["num_microbatches"], record["num_tokens"]
    calls = counted["calls"]
    host_s = statistics.median(seconds[1:])
    total = sum(calls.values())
    launch.reset()
    return {"units": units, "tokens": tokens, "operator_calls": total,
            "operator_calls_per_unit": total / units,
            "operator_calls_per_1k_tokens": 1000 * total / tokens,
            "host_s": host_s, "host_s_per_unit": host_s / units,
            "host_s_per_1k_tokens": 1000 * host_s / tokens,
            "top_operators": dict(calls.most_common(TOP_OPERATORS))}


def worker(argv: list[str]) -> int:
    iters = int(os.environ["BENCH_ITERS"])
    results = {name: measure(name, [*argv, *flags], iters) for name, flags in SCHEDULES.items()}
    base = results["1f1b"]
    for entry in results.values():
        entry["operator_calls_per_1k_tokens_vs_1f1b"] = \
            entry["operator_calls_per_1k_tokens"] / base["operator_calls_per_1k_tokens"]
        entry["host_s_per_1k_tokens_vs_1f1b"] = \
            entry["host_s_per_1k_tokens"] / base["host_s_per_1k_tokens"]
    from megatron.plugin import launch

    launch.shutdown()
    print(json.dumps(results))
    return 0


def main() -> int:
    if "RANK" in os.environ:
        return worker(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=REPO, help="the checkout whose project code runs")
    parser.add_argument("--iters", type=int, default=2, help="timed steps per schedule")
    parser.add_argument("--json", help="write every figure here")
    known, rest = parser.parse_known_args()
    repo = os.path.abspath(known.repo)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               "--master-addr=127.0.0.1", "--master-port=29547", os.path.abspath(__file__),
               *MODEL, *CORPUS_FLAGS, *rest]
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_ITERS=str(known.iters),
               PYTHONPATH=repo, PYTHONWARNINGS="ignore")
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        return done.returncode
    results = json.loads(done.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"{'schedule':10} {'units':>5} {'ops/unit':>9} {'ops/1K tok':>10} {'x1f1b':>6} "
          f"{'host ms/unit':>12} {'host s/1K tok':>13} {'x1f1b':>6}")
    for name, entry in results.items():
        print(f"{name:10} {entry['units']:5d} {entry['operator_calls_per_unit']:9.0f} "
              f"{entry['operator_calls_per_1k_tokens']:10.0f} "
              f"{entry['operator_calls_per_1k_tokens_vs_1f1b']:6.2f} "
              f"{1000 * entry['host_s_per_unit']:12.1f} {entry['host_s_per_1k_tokens']:13.3f} "
              f"{entry['host_s_per_1k_tokens_vs_1f1b']:6.2f}")
    if known.json:
        write_json(known.json, {"repo_commit": commit, "model": [*MODEL, *CORPUS_FLAGS, *rest],
                                "schedules": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
