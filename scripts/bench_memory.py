"""Each schedule's planned activation bytes against what it holds, side by side.

    python scripts/bench_memory.py [--pp 1] [--seq-length 32768] [--schedules default,...]
        [--json OUT]

Launches ``pretrain_gpt_elastic.py`` once per schedule on ``--pp`` ranks (one pipeline; on
CUDA one GPU a rank in bf16, on CPU gloo ranks in fp32), under Megatron-LM's default dropout
0.1, on ``--mock-data`` documents up to ``--seq-length`` tokens with a GPT of ``--num-layers``
x ``--hidden-size``, three iterations each, and reads the last iteration of its
``--metrics-jsonl`` (per-stage figures: the largest stage's): the plan's predicted activation
bytes (elastic, seq1f1b, sppo and helix make one), the bytes autograd saved for backward (the training
loop's meter) and the CUDA allocator's peak over the forward-backward call (CUDA only), with
the tokens per second and the units (micro-batches, chunks, subsequences) of the batch.
Prints one line per schedule with measured/planned (per stage too); ``--json`` writes them all.
With ``--trace-dir`` each run also traces its third iteration with Megatron-LM's
``--profile --use-pytorch-profiler`` (four iterations are run), keeps the trace there as
``SCHEDULE.json.gz`` and reports how busy the device was (``device_busy_fraction``: a run
that launches kernels slower than the device runs them leaves it idle in between).
The allocator's peak includes the model, its gradients and the optimizer state, so it is
reported beside the saved bytes, not compared with the plan.
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

from profiler_trace import PROFILE_FLAGS, device_busy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the batch and the run's limits (shared with ``trace_offload.py``)."""
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks)")
    parser.add_argument("--seq-length", type=int, default=32768)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--slices", type=int, default=8,
                        help="--elastic-slices and --sppo-subsequences")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--json", default=None)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--schedules", default=None,
                        help="comma-separated; default: default,elastic,seq1f1b,sppo, and "
                             "helix with --pp 2 or more (it needs two stages)")
    parser.add_argument("--trace-dir", default=None,
                        help="keep a profiler trace of each run here (CUDA)")
    args = parser.parse_args(argv)
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
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--mock-data",
        "--seed", "1234", "--pipeline-model-parallel-size", str(args.pp),
        "--pipeline-schedule", schedule, "--metrics-jsonl", metrics]
    if torch.cuda.is_available():
        command.append("--bf16")
    if schedule in ("elastic", "seq1f1b"):
        command += ["--elastic-slices", str(args.slices)]
    if schedule == "sppo":
        command += ["--sppo-subsequences", str(args.slices)]
    return command


def run_schedule(args, schedule: str, workdir: str, extra=(), trace: bool = False) -> dict:
    """One training run of ``schedule`` (with ``extra`` flags); its last metrics record, or
    the error's tail. With ``trace``, the third iteration is traced: ``trace_path`` names the
    trace and ``device_busy_fraction`` says how busy the device was."""
    rundir = os.path.join(workdir, schedule)
    os.makedirs(rundir, exist_ok=True)
    metrics = os.path.join(rundir, "metrics.jsonl")
    iters = max(args.iters, 4) if trace else args.iters
    command = training_command(args, schedule, metrics, iters) + list(extra)
    if trace:
        command += PROFILE_FLAGS
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


def main(argv=None):
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for schedule in args.schedules.split(","):
            results[schedule] = result = run_schedule(args, schedule, workdir,
                                                      trace=args.trace_dir is not None)
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
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                shutil.copyfile(result.pop("trace_path"),
                                os.path.join(args.trace_dir, f"{schedule}.json.gz"))
            if ratio and args.pp > 1:
                stages = " ".join(f"{r:.2f}" for r in result["measured_over_planned_per_stage"])
                print(f"{'':8s} measured/planned per stage: {stages}", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"argv": sys.argv[1:], "device": device,
              "torch": torch.__version__, "setup": vars(args), "schedules": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
