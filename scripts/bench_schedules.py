"""Benchmark: ``elastic``, ``seq1f1b`` and Megatron's native ``1f1b`` on the same documents.

    python scripts/bench_schedules.py [--iters 3] [--seq-length 8192] [--global-batch-size 8]
        [--hidden-size 64] [--num-attention-heads 4] [--profile PROFILE.json] [--no-refit]
        [--data-path PREFIX] [--json OUT]
    python scripts/bench_schedules.py --sweep [--iters 3] [--seq-length 2048] [--json OUT]

``--sweep`` runs every schedule (1f1b, elastic, seq1f1b, sppo, helix) on three workloads (only
short documents, only long ones, the skewed GitHub-like mixture) at PP = 1 and PP = 2 and
prints the verdicts of the targets (``scripts/_sweep.py`` says what it measures); without it,
the following.

1. Unless ``--profile`` is given, ``scripts/profile_costs.py`` measures the bench's layer, its
   embedding and its head on this machine (one thread, the bench's dropout 0) and writes a
   measured profile, so the planner and the simulator price chunks with this machine's
   coefficients. The profiler runs one process alone; in the pipeline two ranks share the
   machine's caches and memory bandwidth and the executor adds its own work, which made the
   same layers 10-20% slower on this 2-core VM. So, unless ``--no-refit``, the warm-up round
   records the executor's measured forward and backward times (``elastic`` and ``seq1f1b``)
   and the layer coefficients are refitted to them once (``elastic_pipe/refit.py``, what
   ``--elastic-refit-interval`` does in training) before the timed iterations are planned and
   predicted; the refit line is printed.
2. The script launches itself on 2 CPU ranks (PP=2, one thread each) with the embedded corpus
   (or the train split of ``--data-path``, a dataset of token ids below 257):
   one model and optimizer; every iteration draws one global batch of documents and runs it
   with each schedule in turn (elastic, seq1f1b, 1f1b), after one warm-up round, so drift of
   the machine hits all alike. Measured per schedule: median iteration time, tokens/s, and the
   peak saved-activation bytes of each stage (the training loop's meter), beside the peak the
   plan predicts for that stage (the simulator's memory timeline less the model state), and
   the share of padding in what it computed (``1f1b`` packs whole documents best-fit
   decreasing into padded ``--seq-length`` rows; the document schedules pad nothing at this
   layout). The batch is planned (packed, for ``1f1b``) before the timed span, as a training
   run's background planner does it off the critical path; the median planning wall time is
   reported as ``prepare_s``, not counted in the iteration time.
3. Predicted iteration time: the plan of that batch (for ``1f1b``, Megatron-LM's own
   micro-batches in one 1F1B pipeline, :func:`elastic_pipe.baselines.megatron_1f1b`) replayed
   by the simulator with the same cost model; the median over the iterations is reported
   beside the measured one.

Each schedule's units (micro-batches or chunks) per batch are reported too (the median).

Prints one line per schedule and the ratios; ``--json OUT`` writes
``{"argv": [...], "schedules": {NAME: {"tokens_per_s", "peak_activation_bytes",
"predicted_iteration_s", "measured_iteration_s", "padding_fraction", ...}}, "setup": {...}}``.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _launch import (CORPUS_FLAGS, REPO, Job, free_port, run_workers, stage_peaks, timed_step,
                     write_json)

SCHEDULES = ("elastic", "seq1f1b", "1f1b")
SEQ_LENGTH = 8192
SWEEP_SEQ_LENGTH = 2048
LAYERS = 4
UNBOUNDED_GB = 1e6


def model_flags(options, profile: str, pp: int = 2) -> list[str]:
    seq_length = options.seq_length
    return ["--num-layers", str(LAYERS), "--hidden-size", str(options.hidden_size),
            "--num-attention-heads", str(options.num_attention_heads),
            "--seq-length", str(seq_length),
            "--max-position-embeddings", str(seq_length), "--micro-batch-size", "1",
            "--global-batch-size", str(options.global_batch_size), "--train-iters", "1000",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0", *CORPUS_FLAGS,
            *(["--data-path", options.data_path, "--split", "100,0,0"]
              if options.data_path else []),
            "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", "elastic",
            "--hardware-profile", profile,
            "--elastic-min-slice-tokens", str(options.min_slice_tokens),
            *(["--elastic-memory-gb", str(options.memory_gb)] if options.memory_gb else [])]


def predicted(name, documents, args, model) -> tuple[float, list[float]]:
    """Simulated iteration time and per-stage activation peak of this batch under ``name``."""
    from elastic_pipe.baselines import megatron_1f1b
    from longctx.cost_model import CostModel
    from elastic_pipe.planning import plan_schedule
    from elastic_pipe.lowering import activation_peaks, simulate_plan
    from elastic_pipe.flags import scheduler_config
    from elastic_pipe.run_costs import elastic_cost_model

    cost = elastic_cost_model(args, model)
    lengths = [len(doc) - 1 for doc in documents]
    if name == "1f1b":  # Megatron's 1F1B recomputes nothing, whatever --memory-gb says
        cost = CostModel(cost.model, cost.hardware,
                         dataclasses.replace(cost.parallel, memory_gb=UNBOUNDED_GB))
        plan = megatron_1f1b(lengths, cost, args.seq_length, args.micro_batch_size)
    else:
        plan = plan_schedule(tuple(lengths), name, cost.model, cost.hardware, cost.parallel,
                             scheduler_config(args))
    schedule, result = simulate_plan(plan, cost)
    return result.iteration_time, activation_peaks(schedule, plan, cost)


def worker(argv) -> int:
    import torch.distributed as dist

    from megatron.plugin import registry
    from elastic_pipe.run_costs import refit_cost_model

    iters = int(os.environ["BENCH_ITERS"])
    refit = os.environ["BENCH_REFIT"] == "1"
    job = Job(argv)
    args = job.args
    if refit:  # record the warm-up round's action times; no refit on the way
        args.elastic_refit_interval = iters + 2
    model = job.model
    results = {name: {"times": [], "tokens": [], "peaks": [], "predicted": [], "planned": [],
                       "prepare": [], "padding": [], "units": []}
               for name in SCHEDULES}
    summary = None
    for i in range(iters + 1):
        if i == 1 and refit:
            summary = refit_cost_model("bench", args, model)
            args.elastic_refit_interval = 0
        documents = job.documents(i)
        for name in SCHEDULES:
            registry.use_schedule(name)
            result, took, peaks = timed_step(job, documents)
            if i == 0:
                continue
            entry = results[name]
            entry["times"].append(took)
            entry["tokens"].append(result["num_tokens"])
            entry["peaks"].append(peaks)
            entry["prepare"].append(result["prepare_s"])
            entry["padding"].append(result.get("padding_fraction", 0.0))
            entry["units"].append(result["num_microbatches"])
            if dist.get_rank() == 0:
                seconds, peaks = predicted(name, documents, args, model)
                entry["predicted"].append(seconds)
                entry["planned"].append(peaks)
    if dist.get_rank() == 0:
        report = {}
        for name, entry in results.items():
            measured = statistics.median(entry["times"])
            stages = stage_peaks(entry["peaks"])
            planned = stage_peaks(entry["planned"])
            report[name] = {
                "tokens_per_s": sum(entry["tokens"]) / sum(entry["times"]),
                "peak_activation_bytes": max(stages),
                "peak_activation_bytes_per_stage": stages,
                "planned_activation_bytes_per_stage": planned,
                "measured_iteration_s": measured,
                "predicted_iteration_s": statistics.median(entry["predicted"]),
                "prepare_s": statistics.median(entry["prepare"]),
                "padding_fraction": statistics.mean(entry["padding"]),
                "units": statistics.median(entry["units"]),
            }
        print(json.dumps({"schedules": report, "refit": summary}))
    dist.destroy_process_group()
    return 0


def profile(path: str, options) -> None:
    tokens = [t for t in (512, 1024, 2048, 4096, 8192) if t <= options.seq_length]
    # contexts up to half the run's: a late slice's attention over a long context runs
    # slower per key than a short one's (cache), so the fit must see the lengths it prices
    contexts = sorted({0, options.seq_length // 4, options.seq_length // 2})
    command = [sys.executable, "scripts/profile_costs.py", "--hidden-size",
               str(options.hidden_size), "--num-attention-heads",
               str(options.num_attention_heads), "--tokens", *map(str, tokens),
               "--contexts", *map(str, contexts), "--repeats", "2",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--output", path]
    subprocess.run(command, cwd=REPO, check=True, stdout=sys.stderr,
                   env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))


def measured_profile(options, scratch: str) -> str:
    """``--profile``, or a profile of this machine measured now into ``scratch``."""
    if options.profile is not None:
        return options.profile
    path = os.path.join(scratch, "profile.json")
    print("measuring the layer on this machine (scripts/profile_costs.py) ...", flush=True)
    profile(path, options)
    return path


def sweep(options) -> int:
    """``--sweep`` (scripts/_sweep.py): one launch per pipeline size, one profile for both."""
    import _sweep
    import _workloads

    sizes = {"pp1": 1, "pp2": 2}
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        path = measured_profile(options, scratch)
        with open(path) as f:
            fit = json.load(f)
        if options.save_profile:
            with open(options.save_profile, "w") as f:
                json.dump(fit, f, indent=2)
        workloads = {name: _workloads.data_flags(name, options.seq_length, scratch)
                     for name in _sweep.BATCHES}
        first = next(iter(workloads.values()))
        for key, pp in sizes.items():
            options.global_batch_size = 2  # the start-up's; each workload draws its own
            flags = [*model_flags(options, path, pp), *first]
            runs[key] = run_workers(os.path.join(os.path.dirname(__file__), "_sweep.py"), flags,
                                    free_port(), BENCH_ITERS=str(options.iters),
                                    BENCH_REFIT=str(int(options.refit)),
                                    BENCH_WORKLOADS=json.dumps(workloads))
            _sweep.add_ratios(runs[key]["workloads"])
            print(f"{key}: PP={pp} x DP={2 // pp} on 2 CPU ranks, one thread each, "
                  f"--seq-length {options.seq_length}, {options.iters} timed rounds; model "
                  f"{LAYERS} layers x hidden {options.hidden_size}; profile: "
                  f"{fit.get('source')} on {fit.get('machine')}", flush=True)
            _sweep.print_run(key, runs[key])
    found = _sweep.verdicts(runs)
    _sweep.print_verdicts(found)
    if options.json:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        setup = {"seq_length": options.seq_length, "batches": _sweep.BATCHES,
                 "iterations": options.iters, "schedules": _sweep.SCHEDULES,
                 "hidden_size": options.hidden_size, "layers": LAYERS, "profile": fit}
        write_json(options.json, {"repo_commit": commit, "runs": runs, "verdicts": found,
                                  "setup": setup})
    return 0


def main() -> int:
    if os.environ.get("BENCH_WORKER"):
        return worker(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=None,
                        help=f"default {SEQ_LENGTH}, {SWEEP_SEQ_LENGTH} with --sweep")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="default 8 (--sweep: each workload its own, _sweep.BATCHES)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--min-slice-tokens", type=int, default=512,
                        help="--elastic-min-slice-tokens of elastic and seq1f1b")
    parser.add_argument("--memory-gb", type=float,
                        help="--elastic-memory-gb of elastic and seq1f1b (default: the CPU "
                             "default, which needs no checkpointing here)")
    parser.add_argument("--profile", help="measured profile JSON (default: measure now)")
    parser.add_argument("--data-path", help="a Megatron dataset prefix to draw the batches from "
                                            "(its train split; default: the embedded corpus)")
    parser.add_argument("--no-refit", dest="refit", action="store_false",
                        help="plan and predict with the profile alone (default: refit its layer "
                             "coefficients to the warm-up round's measured action times)")
    parser.add_argument("--save-profile", help="keep the measured profile here")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sweep", action="store_true",
                        help="every schedule on the short, long and github-like workloads at "
                             "PP = 1 and PP = 2, with the verdicts (scripts/_sweep.py)")
    options = parser.parse_args()
    if options.sweep and (options.global_batch_size or options.data_path):
        parser.error("--sweep draws its own workloads (scripts/_workloads.py) with their own "
                     "batch sizes: leave out --global-batch-size and --data-path")
    if options.seq_length is None:
        options.seq_length = SWEEP_SEQ_LENGTH if options.sweep else SEQ_LENGTH
    if options.sweep:
        return sweep(options)
    options.global_batch_size = options.global_batch_size or 8
    with tempfile.TemporaryDirectory() as scratch:
        path = measured_profile(options, scratch)
        out = run_workers(__file__, model_flags(options, path), 29561,
                          BENCH_ITERS=str(options.iters), BENCH_REFIT=str(int(options.refit)))
        report = out["schedules"]
        with open(path) as f:
            fit = json.load(f)
        if options.save_profile:
            with open(options.save_profile, "w") as f:
                json.dump(fit, f, indent=2)
    print(f"PP=2 on 2 CPU ranks, one thread each; embedded corpus, --seq-length "
          f"{options.seq_length}, {options.global_batch_size} documents a batch, "
          f"{options.iters} iterations; model {LAYERS} layers x hidden {options.hidden_size}; "
          f"profile: "
          f"{fit.get('source')} on {fit.get('machine')}")
    if out["refit"]:
        print(f"cost model after the warm-up round: {out['refit']}")
    def mib(values):
        return [round(b / 2**20, 1) for b in values]

    for name, entry in report.items():
        error = entry["predicted_iteration_s"] / entry["measured_iteration_s"] - 1
        print(f"{name:8s} {entry['tokens_per_s']:9.1f} tokens/s | measured "
              f"{entry['measured_iteration_s']:.3f} s, predicted "
              f"{entry['predicted_iteration_s']:.3f} s ({100 * error:+.1f}%) | peak activation "
              f"{entry['peak_activation_bytes'] / 2**20:.1f} MiB per stage "
              f"{mib(entry['peak_activation_bytes_per_stage'])}, planned "
              f"{mib(entry['planned_activation_bytes_per_stage'])} | padding "
              f"{100 * entry['padding_fraction']:.1f}% | {entry['units']:g} units | planned in "
              f"{entry['prepare_s']:.2f} s (not timed)")
    elastic = report["elastic"]
    for base in ("seq1f1b", "1f1b"):
        speed = elastic["tokens_per_s"] / report[base]["tokens_per_s"]
        memory = elastic["peak_activation_bytes"] / report[base]["peak_activation_bytes"]
        print(f"elastic / {base}: tokens/s x{speed:.3f}, peak activation x{memory:.3f}")
    for name in ("elastic", "seq1f1b"):
        speed = report[name]["tokens_per_s"] / report["1f1b"]["tokens_per_s"]
        predicted = (report["1f1b"]["predicted_iteration_s"]
                     / report[name]["predicted_iteration_s"])
        print(f"{name} / 1f1b: tokens/s x{speed:.3f} (predicted x{predicted:.3f}), units "
              f"{report[name]['units']:g} / {report['1f1b']['units']:g}")
    if options.json:
        write_json(options.json, {"schedules": report, "setup": {
            "seq_length": options.seq_length, "global_batch_size": options.global_batch_size,
            "data_path": options.data_path,
            "iterations": options.iters, "pp": 2, "profile": fit, "refit": out["refit"]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
