"""Benchmark: the host's work per unit of each document schedule against Megatron's ``1f1b``.

    python scripts/bench_host.py [--repo CHECKOUT] [--workloads corpus,long,long-sliced]
        [--iters 2] [--json OUT] [model flags ...]

On one CPU rank (pipeline size 1, one thread: the host is all there is, so what a schedule adds
per unit shows in full), for each workload of ``--workloads`` (:data:`WORKLOADS`), one global
batch of its documents runs under each schedule of :data:`SCHEDULES`, each after one warm-up
step with the same documents, in one process (Megatron's start-up again for each,
``launch.reset`` between):

* ``corpus``: 16 documents of the embedded corpus at ``--seq-length`` 4096 (real code, most of
  them longer than a row: nearly every unit a row of one document's piece);
* ``long``: 2 pieces of 8192 tokens of documents three times as long
  (``scripts/_workloads.py``), each schedule at its own slice counts (on this machine they
  keep whole rows);
* ``long-sliced``: the same rows cut into :data:`SLICES` slices by ``elastic``, ``seq1f1b``
  (``--elastic-slices``) and ``sppo`` (``--sppo-subsequences``): every slice after the first
  attends to the K/V context of the earlier ones;
* ``short``, ``github-like``: 32 documents of the workloads of the same name at 4096.

Every schedule runs with its defaults but for ``long-sliced``'s slice counts: the figures are
those of a user's run, and the units column says what each schedule chose. Measured over the
forward-backward call alone (the schedule's input prepared before it, the optimizer step
after it left out):

* ATen operator calls: every operator the dispatcher runs, forward and backward, counted by a
  ``TorchDispatchMode`` in a separate step after the timed ones (the mode slows the host);
* host seconds: the call's wall time (median of ``--iters`` steps);

each per unit (the schedule's micro-batches or chunks) and per 1K tokens, with the ratio of
the per-1K-token figures to ``1f1b``'s, and the operators that make up most of each
schedule's calls. A verdict line per workload holds the goal: no schedule above
:data:`GOAL` times ``1f1b``'s operator calls per 1K tokens; for ``long-sliced``, whose unit
count the flag fixes (a unit there is a quarter of ``1f1b``'s), per unit.

``--repo CHECKOUT`` runs the project code of another checkout (for a before/after pair, a
worktree of the earlier commit); this script and its launcher stay this checkout's.
``--json OUT`` writes ``{"argv", "repo_commit", "model", "goal", "workloads": {WORKLOAD:
{"flags", "schedules": {NAME: {...}}, "verdict"}}}``.
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _workloads
from _launch import CORPUS_FLAGS, REPO, free_port, write_json

#: The schedules compared, with the flags each needs beside the model's; ``1f1b`` first.
SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "elastic": ["--pipeline-schedule", "elastic"],
    "seq1f1b": ["--pipeline-schedule", "seq1f1b"],
    "sppo": ["--pipeline-schedule", "sppo"],
    "helix": ["--pipeline-schedule", "helix"],
}
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--micro-batch-size", "1", "--train-iters", "100",
         "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--position-embedding-type", "rope"]
#: Slices of a row under ``long-sliced``, and the flag that sets them per schedule.
SLICES = 4
SLICE_FLAGS = {"elastic": "--elastic-slices", "seq1f1b": "--elastic-slices",
               "sppo": "--sppo-subsequences"}
#: Workload -> (its documents in ``scripts/_workloads.py``, --seq-length,
#: --global-batch-size, slices forced) (module doc).
WORKLOADS = {"corpus": ("corpus", 4096, 16, None), "long": ("long", 8192, 2, None),
             "long-sliced": ("long", 8192, 2, SLICES), "short": ("short", 4096, 32, None),
             "github-like": ("github-like", 4096, 32, None)}
#: The most operator calls per 1K tokens a schedule may make, over ``1f1b``'s.
GOAL = 1.1
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


def compare(results: dict, metric: str = "operator_calls_per_1k_tokens") -> dict:
    """Add each schedule's per-unit and per-1K-token ratios to ``1f1b``'s; return the
    workload's verdict on ``metric``."""
    base = results["1f1b"]
    for entry in results.values():
        for key in ("operator_calls_per_unit", "operator_calls_per_1k_tokens",
                    "host_s_per_1k_tokens"):
            entry[f"{key}_vs_1f1b"] = entry[key] / base[key]
    above = {name: entry[f"{metric}_vs_1f1b"] for name, entry in results.items()
             if entry[f"{metric}_vs_1f1b"] > GOAL}
    return {"metric": metric, "passed": not above, "above_goal": above}


def worker(argv: list[str]) -> int:
    iters = int(os.environ["BENCH_ITERS"])
    report = {}
    for workload, flags in json.loads(os.environ["BENCH_WORKLOADS"]).items():
        slices = WORKLOADS[workload][3]
        results = {name: measure(name, [*flags, *argv, *schedule, *(
                       [SLICE_FLAGS[name], str(slices)] if slices and name in SLICE_FLAGS
                       else [])], iters)
                   for name, schedule in SCHEDULES.items()}
        metric = "operator_calls_per_unit" if slices else "operator_calls_per_1k_tokens"
        report[workload] = {"flags": flags, "slices": slices, "schedules": results,
                            "verdict": compare(results, metric)}
    from megatron.plugin import launch

    launch.shutdown()
    print(json.dumps(report))
    return 0


def workload_flags(names: list[str], directory: str) -> dict[str, list[str]]:
    """Each workload's flags (module doc): its sizes and its data, written under
    ``directory``."""
    flags = {}
    for name in names:
        documents, seq_length, batch, _ = WORKLOADS[name]
        flags[name] = ["--seq-length", str(seq_length), "--max-position-embeddings",
                       str(seq_length), "--global-batch-size", str(batch),
                       *_workloads.data_flags(documents, seq_length, directory)]
    return flags


def print_workload(name: str, entry: dict) -> None:
    sliced = f", rows cut into {entry['slices']} slices" if entry["slices"] else ""
    print(f"workload {name}: {' '.join(entry['flags'][:6])}{sliced}")
    print(f"{'schedule':10} {'units':>5} {'ops/unit':>9} {'x1f1b':>6} {'ops/1K tok':>10} "
          f"{'x1f1b':>6} {'host ms/unit':>12} {'host s/1K tok':>13} {'x1f1b':>6}")
    for schedule, figures in entry["schedules"].items():
        print(f"{schedule:10} {figures['units']:5d} {figures['operator_calls_per_unit']:9.0f} "
              f"{figures['operator_calls_per_unit_vs_1f1b']:6.2f} "
              f"{figures['operator_calls_per_1k_tokens']:10.0f} "
              f"{figures['operator_calls_per_1k_tokens_vs_1f1b']:6.2f} "
              f"{1000 * figures['host_s_per_unit']:12.1f} "
              f"{figures['host_s_per_1k_tokens']:13.3f} "
              f"{figures['host_s_per_1k_tokens_vs_1f1b']:6.2f}")
    verdict = entry["verdict"]
    above = ", ".join(f"{schedule} {ratio:.2f}x"
                      for schedule, ratio in verdict["above_goal"].items())
    per = "unit" if verdict["metric"] == "operator_calls_per_unit" else "1K tokens"
    print(f"verdict {name}: {'PASS' if verdict['passed'] else 'FAIL'} (goal: every schedule "
          f"at most {GOAL:g}x 1f1b's operator calls per {per}"
          + (f"; above it: {above})" if above else ")"))


def main() -> int:
    if "RANK" in os.environ:
        return worker(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=REPO, help="the checkout whose project code runs")
    parser.add_argument("--workloads", default="corpus,long,long-sliced",
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--iters", type=int, default=2, help="timed steps per schedule")
    parser.add_argument("--json", help="write every figure here")
    known, rest = parser.parse_known_args()
    names = known.workloads.split(",")
    _workloads.check_names(names, tuple(WORKLOADS))
    repo = os.path.abspath(known.repo)
    with tempfile.TemporaryDirectory() as scratch:
        flags = workload_flags(names, scratch)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                   os.path.abspath(__file__), *MODEL, *CORPUS_FLAGS, *rest]
        env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_ITERS=str(known.iters),
                   BENCH_WORKLOADS=json.dumps(flags), PYTHONPATH=repo,
                   PYTHONWARNINGS="ignore")
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        return done.returncode
    report = json.loads(done.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for name, entry in report.items():
        print_workload(name, entry)
    if known.json:
        write_json(known.json, {"repo_commit": commit, "model": [*MODEL, *CORPUS_FLAGS, *rest],
                                "goal": GOAL, "workloads": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
