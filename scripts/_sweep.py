"""``bench_schedules.py --sweep``: every schedule on every workload at PP = 1 and PP = 2, side
by side, with the verdicts of issue 44's targets.

One launch per pipeline size on the 2 CPU ranks (gloo, one thread each; PP = 1 is two
data-parallel replicas, PP = 2 one pipeline): one model and optimizer per schedule of
:data:`SCHEDULES` (each built as its schedule builds it, with the same flags), a refusal of
the flags by a schedule recorded in place of its figures. Every round draws one global batch
of each workload (``scripts/_workloads.py``: ``short``, ``long``, ``github-like``, each its
own number of documents, :data:`BATCHES`) and runs it under each schedule in turn, after one
warm-up round, so drift of the machine hits all alike; with the refit on, the layer
coefficients are refitted once after the warm-up round to its measured action times
(``bench_schedules.py``'s step 1; a degenerate fit keeps the profile, and the refit line says
why). Measured per schedule and workload: tokens/s over the timed
rounds (the planning of a batch left out, as a run's background planner does it), units per
batch (median), the padding share and the peak saved-activation bytes per stage.

Verdicts (:func:`verdicts`): every document schedule at least :data:`FLOOR` times ``1f1b``'s
tokens/s on every workload at both sizes; ``elastic`` at least :data:`ELASTIC_OVER_1F1B` times
``1f1b``'s and :data:`ELASTIC_OVER_SEQ1F1B` times ``seq1f1b``'s on the skewed mixture
(``github-like``) at PP = 2.
"""
import copy
import json
import os
import statistics
import sys

from _launch import Job, stage_peaks, timed_step

#: Megatron's schedule first (the baseline), then the document schedules.
SCHEDULES = ("1f1b", "elastic", "seq1f1b", "sppo", "helix")
BASELINE = "1f1b"
#: Documents (or pieces) per global batch of each workload at the sweep's --seq-length 2048.
BATCHES = {"short": 32, "long": 4, "github-like": 12}
SKEWED = "github-like"
FLOOR = 0.97
ELASTIC_OVER_1F1B = 1.15
ELASTIC_OVER_SEQ1F1B = 1.1
#: ``--elastic-refit-interval`` while the warm-up round records: its steps are many more than
#: the rounds, and the one refit is the worker's.
NEVER = 10**9


def variants(job: Job) -> tuple[dict, dict]:
    """``({schedule: (args, job)}, {schedule: refusal})``: one model and optimizer per schedule
    that takes the job's flags."""
    from megatron.training.global_vars import set_args

    from megatron.plugin import arguments, launch

    built, refused = {}, {}
    for name in SCHEDULES:
        args = copy.copy(job.args)
        args.pipeline_schedule = name
        try:
            arguments.check_args(args)
        except ValueError as refusal:
            refused[name] = str(refusal)
            continue
        set_args(args)
        own = copy.copy(job)
        own.model, own.optimizer, own.scheduler, own.config = launch.setup_model_and_optimizer()
        built[name] = (args, own)
    set_args(job.args)
    return built, refused


def sources(job: Job, workloads: dict) -> dict:
    """Each workload's train split, ``workloads[name] = [--data-path PREFIX ...]``."""
    from megatron.training import get_tokenizer

    from megatron.plugin.sources import build_document_sources

    found = {}
    for name, flags in workloads.items():
        args = copy.copy(job.args)
        args.data_path = [flags[flags.index("--data-path") + 1]]
        args.split = "100,0,0"
        args.global_batch_size = BATCHES[name]
        found[name] = build_document_sources(args, get_tokenizer().vocab_size)["train"]
    return found


def worker(argv: list[str]) -> int:
    import torch.distributed as dist

    from megatron.plugin import registry
    from elastic_pipe.run_costs import refit_cost_model

    iters = int(os.environ["BENCH_ITERS"])
    refit = os.environ["BENCH_REFIT"] == "1"
    job = Job(argv)
    built, refused = variants(job)
    for args, _ in built.values():  # record the warm-up round's action times, no refit yet
        args.elastic_refit_interval = NEVER if refit else 0
    draws = sources(job, json.loads(os.environ["BENCH_WORKLOADS"]))
    seen = {(w, s): {"times": [], "tokens": [], "units": [], "padding": [], "peaks": []}
            for w in draws for s in built}
    summary = None
    for i in range(iters + 1):
        if i == 1 and refit:
            some_args, some_job = next(iter(built.values()))
            summary = refit_cost_model("sweep", some_args, some_job.model)
            for args, _ in built.values():
                args.elastic_refit_interval = 0
        for workload, source in draws.items():
            documents = source.documents(i)
            for name, (args, own) in built.items():
                registry.use_schedule(name)
                record, took, peaks = timed_step(own, documents, args=args)
                if i == 0:
                    continue
                entry = seen[workload, name]
                entry["times"].append(took)
                entry["tokens"].append(record["num_tokens"])
                entry["units"].append(record["num_microbatches"])
                entry["padding"].append(record.get("padding_fraction", 0.0))
                entry["peaks"].append(peaks)
    if dist.get_rank() == 0:
        report = {workload: {} for workload in draws}
        for (workload, name), entry in seen.items():
            report[workload][name] = {
                "tokens_per_s": sum(entry["tokens"]) / sum(entry["times"]),
                "iteration_s": entry["times"],
                "tokens": statistics.median(entry["tokens"]),
                "units": statistics.median(entry["units"]),
                "padding_fraction": statistics.mean(entry["padding"]),
                "peak_activation_bytes_per_stage": stage_peaks(entry["peaks"])}
        print(json.dumps({"workloads": report, "refused": refused, "refit": summary}))
    dist.destroy_process_group()
    return 0


def add_ratios(workloads: dict) -> None:
    """Each schedule's tokens/s over ``1f1b``'s, and ``elastic``'s over ``seq1f1b``'s."""
    for schedules in workloads.values():
        base = schedules.get(BASELINE)
        for entry in schedules.values():
            if base:
                entry["vs_1f1b"] = entry["tokens_per_s"] / base["tokens_per_s"]
        if "elastic" in schedules and "seq1f1b" in schedules:
            schedules["elastic"]["vs_seq1f1b"] = (schedules["elastic"]["tokens_per_s"]
                                                  / schedules["seq1f1b"]["tokens_per_s"])


def verdicts(runs: dict) -> list[dict]:
    """The targets (module doc) over ``runs = {"pp1": {"workloads": {...}}, "pp2": ...}``
    with their ratios: ``[{"target", "passed", "found"}]``; a target whose figures are missing
    (a schedule refused, a size not run) is reported with ``passed`` ``None``."""
    found = []
    for pp, run in runs.items():
        for workload, schedules in run["workloads"].items():
            low = {name: entry["vs_1f1b"] for name, entry in schedules.items()
                   if name != BASELINE and "vs_1f1b" in entry}
            below = {name: ratio for name, ratio in low.items() if ratio < FLOOR}
            found.append({"target": f"{pp} {workload}: every document schedule >= {FLOOR:g}x "
                                    f"1f1b tokens/s",
                          "passed": not below if low else None,
                          "found": ", ".join(f"{n} {r:.3f}" for n, r in low.items())})
    skewed = runs.get("pp2", {}).get("workloads", {}).get(SKEWED, {}).get("elastic", {})
    for key, bound, over in (("vs_1f1b", ELASTIC_OVER_1F1B, "1f1b"),
                             ("vs_seq1f1b", ELASTIC_OVER_SEQ1F1B, "seq1f1b")):
        ratio = skewed.get(key)
        found.append({"target": f"pp2 {SKEWED}: elastic >= {bound:g}x {over} tokens/s",
                      "passed": None if ratio is None else ratio >= bound,
                      "found": "missing" if ratio is None else f"elastic {ratio:.3f}"})
    return found


def print_run(pp: str, run: dict) -> None:
    for name, refusal in run["refused"].items():
        print(f"{pp}: {name} refused the flags: {refusal}")
    if run["refit"]:
        print(f"{pp}: cost model after the warm-up round: {run['refit']}")
    for workload, schedules in run["workloads"].items():
        print(f"{pp} {workload}:")
        for name, entry in schedules.items():
            versus = f" x{entry['vs_1f1b']:.3f} 1f1b" if "vs_1f1b" in entry else ""
            if "vs_seq1f1b" in entry:
                versus += f", x{entry['vs_seq1f1b']:.3f} seq1f1b"
            stages = [round(b / 2**20, 1) for b in entry["peak_activation_bytes_per_stage"]]
            print(f"  {name:8s} {entry['tokens_per_s']:9.1f} tokens/s{versus} | "
                  f"{entry['units']:g} units, {entry['tokens']:g} tokens a batch | padding "
                  f"{100 * entry['padding_fraction']:.1f}% | peak activation {stages} MiB")


def print_verdicts(found: list[dict]) -> None:
    for verdict in found:
        word = {True: "PASS", False: "FAIL", None: "SKIP"}[verdict["passed"]]
        print(f"verdict {word}: {verdict['target']} ({verdict['found']})")


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
