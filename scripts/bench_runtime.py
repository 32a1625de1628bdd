"""Benchmark: the executor (``1f1b-ir``) against Megatron's native ``1f1b`` loop, side by side.

    python scripts/bench_runtime.py [--iters 12] [--pp 2] [--json OUT] [model flags ...]

Launches itself on ``--pp`` CPU ranks (one thread each). One model, one optimizer and the same
document batches; iterations alternate between the two schedules (native, IR, native, ...) so
that drift of the machine hits both alike, after one warm-up iteration of each. Prints the
median iteration time of each and the throughput ratio IR / native (1.00 = the same speed).
First it times the simulator on a 64-stage x 512-micro-batch 1F1B (validation separately).
``--json OUT`` (written by rank 0) holds ``{"argv": [...], "simulator": {...}, "runtime":
{"pp", "iterations", "native_iteration_s", "ir_iteration_s", "throughput_ratio", ...}}``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _launch import CORPUS_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "1024", "--max-position-embeddings", "1024",
         "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "1",
         "--lr", "1e-4",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def worker(argv) -> int:
    import torch.distributed as dist
    from _launch import Job, timed_step, write_json

    from megatron.plugin import registry

    iters = int(os.environ["BENCH_ITERS"])
    job = Job(argv)
    args = job.args
    times = {"1f1b": [], "1f1b-ir": []}
    for i in range(2 * (iters + 1)):
        name = ("1f1b", "1f1b-ir")[i % 2]
        registry.use_schedule(name)
        _, took, _ = timed_step(job, job.documents(i // 2))
        if i >= 2:
            times[name].append(took)
    if dist.get_rank() == 0:
        native, ir = (statistics.median(times[n]) for n in ("1f1b", "1f1b-ir"))
        print(f"pp={args.pipeline_model_parallel_size} iterations={iters} each, "
              f"CPU ranks with one thread")
        print(f"native 1f1b : {1000 * native:8.1f} ms / iteration (median)")
        print(f"1f1b-ir     : {1000 * ir:8.1f} ms / iteration (median)")
        print(f"throughput ratio 1f1b-ir / 1f1b = {native / ir:.3f} "
              f"(executor overhead {100 * (ir / native - 1):+.1f}%)")
        if os.environ["BENCH_JSON"]:
            write_json(os.environ["BENCH_JSON"], {
                "simulator": json.loads(os.environ["BENCH_SIMULATOR"]),
                "runtime": {"pp": args.pipeline_model_parallel_size, "iterations": iters,
                            "native_iteration_s": native, "ir_iteration_s": ir,
                            "throughput_ratio": native / ir,
                            "executor_overhead": ir / native - 1,
                            "native_iterations_s": times["1f1b"],
                            "ir_iterations_s": times["1f1b-ir"]}},
                json.loads(os.environ["BENCH_ARGV"]))
    dist.destroy_process_group()
    return 0


def simulator_timing(pp: int = 64, microbatches: int = 512) -> dict:
    from megatron.plugin.pipeline.passes import add_communication
    from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
    from megatron.plugin.pipeline.simulator import simulate
    from megatron.plugin.pipeline.validation import validate

    schedule = add_communication(one_f_one_b(pp, microbatches))
    actions = sum(len(row) for row in schedule)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        result = simulate(schedule)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    validate(schedule)
    validation = time.perf_counter() - start
    print(f"simulator: 1f1b pp={pp} m={microbatches} ({actions} actions): "
          f"{statistics.median(times):.3f} s (median of 3), bubble ratio "
          f"{result.bubble_ratio:.4f}; validation {validation:.3f} s", flush=True)
    return {"pp": pp, "microbatches": microbatches, "actions": actions,
            "simulate_s": statistics.median(times), "bubble_ratio": result.bubble_ratio,
            "validate_s": validation}


def main() -> int:
    if "RANK" in os.environ:
        return worker(sys.argv[1:])
    simulator = simulator_timing()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--json", help="write every figure here")
    known, rest = parser.parse_known_args()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={known.pp}",
               "--master-addr=127.0.0.1", "--master-port=29531", os.path.abspath(__file__),
               *MODEL, *CORPUS_FLAGS, "--pipeline-model-parallel-size", str(known.pp), *rest]
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_ITERS=str(known.iters),
               BENCH_JSON=os.path.abspath(known.json) if known.json else "",
               BENCH_SIMULATOR=json.dumps(simulator), BENCH_ARGV=json.dumps(sys.argv[1:]),
               PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    return subprocess.call(command, cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
