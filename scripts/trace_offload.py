"""Whether SPPO's offload copies overlap compute on a GPU: one iteration's trace, read back.

    python scripts/trace_offload.py [--seq-length 32768] [--json OUT] [--trace OUT.json.gz]

Runs ``sppo`` on one GPU (PP = 1, bf16, Megatron-LM's default dropout) with
``--sppo-offload 1`` (every subsequence but a document's last moves its saved activations to
pinned host memory and back) under Megatron-LM's ``--profile --use-pytorch-profiler``, which
writes a Chrome trace of the third iteration. Then reads that trace: every copy between device
and host (the profiler's ``gpu_memcpy`` events), the part of its time during which a kernel ran
on another stream (overlapped), and whether its host side was pinned. Prints the totals and
the overlapped fraction per direction; ``--json`` writes them, ``--trace`` keeps the trace
(open it in Perfetto or chrome://tracing).
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

import bench_memory

COPY_NAMES = {"DtoH": "offload (device to host)", "HtoD": "reload (host to device)"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=32768)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--slices", type=int, default=8, help="--sppo-subsequences")
    parser.add_argument("--timeout", type=float, default=240, help="seconds for the run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default=None, help="where to keep the trace (.json.gz)")
    return parser.parse_args(argv)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def copy_overlap(trace: dict) -> dict:
    """Per copy direction (``DtoH``, ``HtoD``): count, bytes, microseconds, microseconds during
    which a kernel ran on another stream, and microseconds whose host side was pinned, from a
    torch-profiler Chrome trace."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels: dict[object, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            kernels.setdefault(e["args"].get("stream"), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    unions = {stream: _union(spans) for stream, spans in kernels.items()}
    totals = {}
    for e in events:
        if e.get("cat") != "gpu_memcpy":
            continue
        direction = next((d for d in COPY_NAMES if d in e["name"]), None)
        if direction is None:
            continue
        start, dur = float(e["ts"]), float(e["dur"])
        stream = e["args"].get("stream")
        others = _union([span for s, u in unions.items() if s != stream for span in u])
        row = totals.setdefault(direction, {"copies": 0, "bytes": 0, "us": 0.0,
                                            "overlapped_us": 0.0, "pinned_us": 0.0})
        row["copies"] += 1
        row["bytes"] += int(e["args"].get("bytes", 0))
        row["us"] += dur
        row["overlapped_us"] += _covered(start, start + dur, others)
        if "Pinned" in e["name"]:
            row["pinned_us"] += dur
    for row in totals.values():
        row["overlapped_fraction"] = row["overlapped_us"] / row["us"] if row["us"] else 0.0
        row["pinned_fraction"] = row["pinned_us"] / row["us"] if row["us"] else 0.0
        row["gb_per_s"] = row["bytes"] / (row["us"] * 1e3) if row["us"] else 0.0
    return totals


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device visible: the offload copies run on a GPU's copy stream; "
              "run this on a GPU machine", file=sys.stderr)
        return 2
    bench = bench_memory.parse_args(["--seq-length", str(args.seq_length),
                                     "--global-batch-size", str(args.global_batch_size),
                                     "--num-layers", str(args.num_layers),
                                     "--hidden-size", str(args.hidden_size),
                                     "--num-attention-heads", str(args.num_attention_heads),
                                     "--slices", str(args.slices), "--iters", "4"])
    with tempfile.TemporaryDirectory() as workdir:
        metrics = os.path.join(workdir, "sppo.jsonl")
        command = bench_memory.training_command(bench, "sppo", metrics) + [
            "--sppo-offload", "1", "--profile", "--use-pytorch-profiler",
            "--profile-step-start", "2", "--profile-step-end", "3"]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=args.timeout, cwd=workdir)
        except subprocess.TimeoutExpired:
            print(f"error: the run timed out after {args.timeout:g} s", file=sys.stderr)
            return 1
        # Megatron-LM writes the trace to <--tensorboard-dir>/../torch_profile; without the
        # flag that is torch_profile/ in the working directory.
        path = os.path.join(workdir, "torch_profile", "rank-0.json.gz")
        if done.returncode != 0 or not os.path.exists(path):
            print(f"error: exit {done.returncode}, no trace\n"
                  f"{(done.stdout + done.stderr)[-3000:]}", file=sys.stderr)
            return 1
        with gzip.open(path, "rt") as f:
            totals = copy_overlap(json.load(f))
        if args.trace:
            shutil.copyfile(path, args.trace)
        with open(metrics) as f:
            record = [json.loads(line) for line in f][-1]
    for direction, row in sorted(totals.items()):
        print(f"{COPY_NAMES[direction]:26s} {row['copies']:5d} copies "
              f"{row['bytes'] / 2**20:9.1f} MiB {row['us'] / 1e3:8.2f} ms "
              f"{row['gb_per_s']:6.1f} GB/s  overlapped with compute "
              f"{row['overlapped_fraction']:6.1%}  pinned {row['pinned_fraction']:6.1%}")
    if not totals:
        print("no device-host copies in the trace: nothing was offloaded")
    report = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "setup": vars(args), "copies": totals,
              "tokens_per_s": record.get("tokens_per_s"),
              "peak_activation_bytes": record.get("peak_activation_bytes"),
              "planned_activation_bytes": record.get("planned_activation_bytes"),
              "device_peak_bytes": record.get("device_peak_bytes")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if totals else 1


if __name__ == "__main__":
    sys.exit(main())
