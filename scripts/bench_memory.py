"""Each schedule's planned activation bytes against what it holds, side by side.

    python scripts/bench_memory.py [--pp 1] [--seq-length 32768] [--schedules default,...]
        [--json OUT]

Launches ``pretrain_gpt_elastic.py`` once per schedule on ``--pp`` ranks (one pipeline; on
CUDA one GPU a rank in bf16, on CPU gloo ranks in fp32), under Megatron-LM's default dropout
0.1, on ``--mock-data`` documents up to ``--seq-length`` tokens (or the train split of a
``--data-path`` dataset whose token ids lie below 257) with a GPT of ``--num-layers``
x ``--hidden-size``, four iterations each, and reads the last iteration of its
``--metrics-jsonl`` (per-stage figures: the largest stage's): the plan's predicted activation
bytes (elastic, seq1f1b, sppo and helix make one), the bytes autograd saved for backward (the training
loop's meter) and the CUDA allocator's peak over the forward-backward call (CUDA only), with
the tokens per second and the units (micro-batches, chunks, subsequences) of the batch.
Prints one line per schedule with measured/planned (per stage too); ``--json`` writes them all.
With ``--trace-dir`` each run also traces its fourth iteration with Megatron-LM's
``--profile --use-pytorch-profiler`` (five iterations are run), keeps the trace there as
``SCHEDULE.json.gz`` and reports how busy the device was (``device_busy_fraction``: a run
that launches kernels slower than the device runs them leaves it idle in between).
The allocator's peak includes the model, its gradients and the optimizer state, so it is
reported beside the saved bytes, not compared with the plan.

The first schedule listed is the baseline (Megatron-LM's, ``default`` or ``1f1b``): a last line
gives every other schedule's tokens/s and units over its, and ``--min-ratio R`` a verdict line
per schedule (``PASS`` where its tokens/s is at least R times the baseline's; the exit status
is 1 where one is not). ``--predict PROFILE`` (a shipped
hardware profile or a profile JSON, several comma-separated) adds what the planners' simulator
predicts for the same batch (the last iteration's documents) and model: each
schedule's iteration seconds, units and speed over Megatron-LM's 1F1B on its own micro-batches
(``elastic`` and ``seq1f1b`` planned as the training run plans them, ``default`` and ``1f1b``
as :func:`elastic_pipe.baselines.megatron_1f1b`; ``sppo`` and ``helix`` are not predicted
here); with ``--predict-only`` nothing is trained, so a CPU gives the figures of a GPU's
profile.
"""
import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from profiler_trace import device_busy, profile_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 1234
VOCAB = 257
#: The model's vocabulary: NullTokenizer's VOCAB ids and its end-of-document id, padded to
#: Megatron-LM's multiple of 128 (--make-vocab-size-divisible-by).
PADDED_VOCAB = -(-(VOCAB + 1) // 128) * 128
MEGATRON = ("default", "1f1b")
REFITTED = 4
"""The first training iteration that ``elastic`` and ``seq1f1b`` plan with their default refit
on CUDA (``--elastic-refit-interval auto``, :mod:`elastic_pipe.run_costs`: iterations 2 and 3
are timed, a wait for the device around every action, and refitted to), and the first they
run untimed: the iteration measured and traced, so that the figures are those of a run that
trains on."""
TRACED_STEP = REFITTED - 1
"""The training iteration traced (0-based)."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the batch and the run's limits (shared with ``trace_offload.py``)."""
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks)")
    parser.add_argument("--seq-length", type=int, default=32768)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--slices", type=slices_flag, default=8,
                        help="--elastic-slices and --sppo-subsequences: N or auto")
    parser.add_argument("--data-path", default=None,
                        help="a Megatron dataset prefix to train on (its train split, --split "
                             "100,0,0) instead of --mock-data")
    parser.add_argument("--iters", type=int, default=REFITTED,
                        help="training iterations; the last is measured (default: the first "
                             "after the document schedules' default refit on CUDA)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--json", default=None)


def slices_flag(value: str):
    """``--slices``: ``auto`` (both schedules' own choice) or a positive integer."""
    if value != "auto" and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return value if value == "auto" else int(value)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--schedules", default=None,
                        help="comma-separated; default: default,elastic,seq1f1b,sppo, and "
                             "helix with --pp 2 or more (it needs two stages)")
    parser.add_argument("--trace-dir", default=None,
                        help="keep a profiler trace of each run here (CUDA)")
    parser.add_argument("--predict", default=None,
                        help="hardware profiles (comma-separated names or JSON files) to "
                             "predict the batch's iteration time with")
    parser.add_argument("--predict-only", action="store_true",
                        help="train nothing: only the --predict figures")
    parser.add_argument("--min-ratio", type=float, default=None,
                        help="print a verdict per schedule: its tokens/s at least this times "
                             "the first schedule's; exit 1 where one is not")
    args = parser.parse_args(argv)
    if args.predict_only and not args.predict:
        parser.error("--predict-only needs --predict PROFILE")
    if args.schedules is None:
        args.schedules = "default,elastic,seq1f1b,sppo" + (",helix" if args.pp >= 2 else "")
    return args


def training_command(args, schedule: str, metrics: str, iters: int) -> list[str]:
    """The ``pretrain_gpt_elastic.py`` launch of ``schedule`` for ``iters`` iterations that
    writes ``metrics``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.pp),
        "--master-port", "29531", os.path.join(ROOT, "pretrain_gpt_elastic.py"),
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch_size),
        "--lr", "1e-4", "--train-iters", str(iters), "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "0", "--calculate-per-token-loss",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *data_flags(args),
        "--seed", str(SEED), "--pipeline-model-parallel-size", str(args.pp),
        "--pipeline-schedule", schedule, "--metrics-jsonl", metrics]
    if torch.cuda.is_available():
        command.append("--bf16")
    if schedule in ("elastic", "seq1f1b"):
        command += ["--elastic-slices", str(args.slices)]
    if schedule == "sppo":
        command += ["--sppo-subsequences", str(args.slices)]
    return command


def data_flags(args) -> list[str]:
    return ["--data-path", args.data_path, "--split", "100,0,0"] if args.data_path \
        else ["--mock-data"]


def batch_lengths(args) -> tuple[int, ...]:
    """The document lengths (inputs) of the last iteration's batch, as the runs read it."""
    from megatron.plugin.sources import build_document_sources

    flags = argparse.Namespace(mock_data=not args.data_path, data_path=[args.data_path],
                               split="100,0,0", seed=SEED, mmap_bin_files=True, eval_iters=0,
                               global_batch_size=args.global_batch_size,
                               seq_length=args.seq_length)
    source = build_document_sources(flags, VOCAB)["train"]
    last = iterations(args, args.trace_dir is not None) - 1
    return tuple(len(doc) - 1 for doc in source.documents(last))


def iterations(args, trace: bool, step: int = TRACED_STEP) -> int:
    """Training iterations of each run (when traced, at least one after the traced ``step``:
    four for the third)."""
    return max(args.iters, step + 2) if trace else args.iters


def predictions(args, profile: str) -> dict:
    """``{schedule: {"iteration_s", "units"}}``: the simulator's figures for the last
    iteration's batch priced with ``profile``, for the schedules planned here (module doc)."""
    from elastic_pipe.baselines import megatron_1f1b
    from elastic_pipe.planning import plan_schedule
    from elastic_pipe.lowering import simulate_plan
    from elastic_pipe.scheduler import SchedulerConfig
    from elastic_pipe.sequence_processor import ChunkingConfig
    from longctx.cost_model import CostModel, ParallelConfig
    from longctx.hardware import load_profile
    from longctx.models import ModelConfig

    lengths = batch_lengths(args)
    hardware = load_profile(profile)
    model = ModelConfig("bench", args.num_layers, args.hidden_size, args.num_attention_heads,
                        4 * args.hidden_size, PADDED_VOCAB, hidden_dropout=True,
                        dtype="bfloat16" if torch.cuda.is_available() else "float32")
    parallel = ParallelConfig(pp=args.pp, memory_gb=hardware.hbm_gb)
    cost = CostModel(model, hardware, parallel)
    chunking = ChunkingConfig(slice_counts=None if args.slices == "auto" else (args.slices,),
                              seq_length=args.seq_length)
    config = SchedulerConfig(chunking, workers=1)
    found = {}
    for schedule in args.schedules.split(","):
        if schedule in MEGATRON:
            plan = megatron_1f1b(lengths, cost, args.seq_length)
        elif schedule in ("elastic", "seq1f1b"):
            plan = plan_schedule(lengths, schedule, model, hardware, parallel, config)
        else:
            continue
        found[schedule] = {"iteration_s": simulate_plan(plan, cost)[1].iteration_time,
                           "units": len(plan.chunks())}
    return found


def print_predictions(profile: str, found: dict) -> None:
    base = next((found[name] for name in MEGATRON if name in found), None)
    cells = [f"{name} {entry['units']} units {entry['iteration_s'] * 1e3:.1f} ms"
             + (f" {base['iteration_s'] / entry['iteration_s']:.2f}x" if base else "")
             for name, entry in found.items()]
    print(f"predicted with {profile}: " + " | ".join(cells), flush=True)


def print_ratios(results: dict) -> None:
    """Each schedule's tokens/s and units over the first schedule's (the baseline)."""
    measured = {name: r for name, r in results.items() if "error" not in r}
    if len(measured) < 2:
        return
    base_name, base = next(iter(measured.items()))
    cells = [f"{name} x{r['tokens_per_s'] / base['tokens_per_s']:.2f} tokens/s, "
             f"{r['num_microbatches']} / {base['num_microbatches']} units"
             for name, r in measured.items() if name != base_name]
    print(f"over {base_name}: " + "; ".join(cells), flush=True)


def verdicts(results: dict, min_ratio: float) -> list[str]:
    """``--min-ratio``: a line per schedule after the first (the baseline), ``PASS`` where its
    tokens/s is at least ``min_ratio`` times the baseline's, ``FAIL`` where it is below or its
    run failed; one ``FAIL`` line alone where the baseline's run failed."""
    (base_name, base), *others = results.items()
    if "error" in base:
        return [f"verdict FAIL: {base_name} (the baseline) did not run: {base['error']}"]
    lines = []
    for name, result in others:
        if "error" in result:
            lines.append(f"verdict FAIL: {name} did not run: {result['error']}")
            continue
        ratio = result["tokens_per_s"] / base["tokens_per_s"]
        word = "PASS" if ratio >= min_ratio else "FAIL"
        lines.append(f"verdict {word}: {name} x{ratio:.3f} {base_name}'s tokens/s "
                     f"(target >= {min_ratio:g}), {result['num_microbatches']} / "
                     f"{base['num_microbatches']} units")
    return lines


def run_schedule(args, schedule: str, workdir: str, extra=(), trace: bool = False,
                 trace_step: int = TRACED_STEP) -> dict:
    """One training run of ``schedule`` (with ``extra`` flags); its last metrics record, or
    the error's tail. With ``trace``, iteration ``trace_step`` (0-based) is traced:
    ``trace_path`` names the trace and ``device_busy_fraction`` says how busy the device was."""
    rundir = os.path.join(workdir, schedule)
    os.makedirs(rundir, exist_ok=True)
    metrics = os.path.join(rundir, "metrics.jsonl")
    iters = iterations(args, trace, trace_step)
    command = training_command(args, schedule, metrics, iters) + list(extra)
    if trace:
        command += profile_flags(trace_step)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              cwd=rundir)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    if done.returncode != 0 or not os.path.exists(metrics):
        return {"error": f"exit {done.returncode}", "tail": (done.stdout + done.stderr)[-3000:]}
    with open(metrics) as f:
        record = [json.loads(line) for line in f][-1]
    keep = ("lm_loss", "num_tokens", "num_microbatches", "tokens_per_s", "forward_backward_s",
            "peak_activation_bytes", "planned_activation_bytes", "device_peak_bytes",
            "peak_activation_bytes_per_stage", "planned_activation_bytes_per_stage")
    result = {key: record[key] for key in keep if key in record}
    if trace:
        result["trace_path"] = os.path.join(rundir, "torch_profile", "rank-0.json.gz")
        if not os.path.exists(result["trace_path"]):
            return {"error": "no profiler trace written", "tail": done.stdout[-3000:]}
        with gzip.open(result["trace_path"], "rt") as f:
            result["device_busy_fraction"] = device_busy(json.load(f))["busy_fraction"]
    if result.get("planned_activation_bytes"):
        result["measured_over_planned"] = (result["peak_activation_bytes"]
                                           / result["planned_activation_bytes"])
        result["measured_over_planned_per_stage"] = [
            measured / planned for measured, planned in
            zip(result["peak_activation_bytes_per_stage"],
                result["planned_activation_bytes_per_stage"])]
    return result


def write_report(args, results: dict, predicted: dict, judged: list[str] = ()) -> None:
    """``--json``: every run, prediction and verdict so far (rewritten after each, so that a
    time limit keeps what finished)."""
    if not args.json:
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"argv": sys.argv[1:], "device": device,
              "torch": torch.__version__, "setup": vars(args), "schedules": results,
              "predicted": predicted, "verdicts": list(judged)}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    results, predicted = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        for schedule in [] if args.predict_only else args.schedules.split(","):
            results[schedule] = result = run_schedule(args, schedule, workdir,
                                                      trace=args.trace_dir is not None)
            if "trace_path" in result:
                os.makedirs(args.trace_dir, exist_ok=True)
                shutil.copyfile(result.pop("trace_path"),
                                os.path.join(args.trace_dir, f"{schedule}.json.gz"))
            write_report(args, results, predicted)
            if "error" in result:
                print(f"{schedule:8s} FAILED {result['error']}\n{result.get('tail', '')}",
                      flush=True)
                continue
            ratio = result.get("measured_over_planned")
            planned = result.get("planned_activation_bytes")
            print(f"{schedule:8s} saved {result['peak_activation_bytes'] / 2**20:9.1f} MiB  "
                  f"planned {planned / 2**20 if planned else float('nan'):9.1f} MiB  "
                  f"measured/planned {ratio if ratio else float('nan'):6.2f}  "
                  f"device peak {result.get('device_peak_bytes', float('nan')) / 2**20:9.1f} "
                  f"MiB  {result['tokens_per_s']:10.0f} tokens/s  "
                  f"{result['num_microbatches']} units"
                  + (f"  device busy {result['device_busy_fraction']:6.1%}"
                     if args.trace_dir else ""), flush=True)
            if ratio and args.pp > 1:
                stages = " ".join(f"{r:.2f}" for r in result["measured_over_planned_per_stage"])
                print(f"{'':8s} measured/planned per stage: {stages}", flush=True)
    print_ratios(results)
    judged = verdicts(results, args.min_ratio) if args.min_ratio and results else []
    for line in judged:
        print(line, flush=True)
    for profile in args.predict.split(",") if args.predict else []:
        predicted[profile] = predictions(args, profile)
        print_predictions(profile, predicted[profile])
        write_report(args, results, predicted, judged)
    write_report(args, results, predicted, judged)
    failed = any("error" in r for r in results.values()) \
        or any(line.startswith("verdict FAIL") for line in judged)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
