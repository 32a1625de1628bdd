"""Whether SPPO's offload copies overlap compute on a GPU: one iteration's trace, read back.

    python scripts/trace_offload.py [--seq-length 32768] [--json OUT] [--trace OUT.json.gz]

Runs ``sppo`` on one GPU (``--pp 1`` by default; with more, the first stage is traced; bf16,
Megatron-LM's default dropout) with ``--sppo-offload 1`` (every subsequence but a document's
last moves its saved activations to pinned host memory and back) under Megatron-LM's
``--profile --use-pytorch-profiler``, which writes a Chrome trace of the fifth iteration
(:data:`TRACED_STEP`). Then reads that trace: every copy between device and host (the
profiler's ``gpu_memcpy`` events), the part of its time during which a kernel ran on another
stream (overlapped), and whether its host side was pinned. Prints the totals and the
overlapped fraction per direction, and the time the host spent pinning new buffers
(``cudaHostAlloc``) within the traced iteration: torch's caching host allocator pins a new
block when none of its free ones fits, and while it pins, the host launches nothing (an H200
under Firecracker pinned about 1.8 GB/s). ``--json`` writes them, ``--trace`` keeps the trace
(open it in Perfetto or chrome://tracing).
"""
import argparse
import gzip
import json
import shutil
import sys
import tempfile

import torch

import bench_memory
from profiler_trace import COPY_NAMES, copy_overlap, host_allocations

TRACED_STEP = 4
"""The iteration traced (0-based: the fifth): four before it have offloaded and reloaded, so
torch's caching host allocator holds their pinned blocks (the third lending's trace of the
third iteration spent 3.3 of its 5.0 s pinning new ones)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_memory.add_run_arguments(parser)
    parser.add_argument("--trace", default=None, help="where to keep the trace (.json.gz)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device visible: the offload copies run on a GPU's copy stream; "
              "run this on a GPU machine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        result = bench_memory.run_schedule(args, "sppo", workdir, ["--sppo-offload", "1"],
                                           trace=True, trace_step=TRACED_STEP)
        if "error" in result:
            print(f"error: {result['error']}\n{result.get('tail', '')}", file=sys.stderr)
            return 1
        with gzip.open(result["trace_path"], "rt") as f:
            trace = json.load(f)
        totals, allocations = copy_overlap(trace), host_allocations(trace)
        if args.trace:
            shutil.copyfile(result["trace_path"], args.trace)
    for direction, row in sorted(totals.items()):
        print(f"{COPY_NAMES[direction]:26s} {row['copies']:5d} copies "
              f"{row['bytes'] / 2**20:9.1f} MiB {row['us'] / 1e3:8.2f} ms "
              f"{row['gb_per_s']:6.1f} GB/s  overlapped with compute "
              f"{row['overlapped_fraction']:6.1%}  pinned {row['pinned_fraction']:6.1%}")
    if not totals:
        print("no device-host copies in the trace: nothing was offloaded")
    print(f"pinned host allocations (cudaHostAlloc): {allocations['calls']} calls, "
          f"{allocations['us'] / 1e3:.1f} ms of the traced iteration's "
          f"{allocations['step_us'] / 1e3:.1f} ms")
    report = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "setup": vars(args), "copies": totals,
              "host_allocations": allocations,
              **{key: result.get(key) for key in (
                  "tokens_per_s", "peak_activation_bytes", "planned_activation_bytes",
                  "device_peak_bytes", "device_busy_fraction")}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if totals else 1


if __name__ == "__main__":
    sys.exit(main())
