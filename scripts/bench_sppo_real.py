"""Benchmark (measured, not a test): ``sppo`` with offloading against ``seq1f1b`` without, on
one long document.

    python scripts/bench_sppo_real.py [--tokens 16384] [--subsequences 8] [--offload 1.0]
        [--iters 3] [--hidden-size 64] [--num-attention-heads 4] [--num-layers 4] [--json OUT]

The script launches itself on 2 CPU ranks (PP=2, one thread each) with the embedded corpus:
one model and optimizer; every iteration builds one document of ``--tokens`` tokens (the
corpus's documents of consecutive batches, concatenated) and runs one training step of it with
each variant in turn, after one warm-up round, so drift of the machine hits all alike:

- ``sppo``: ``--sppo-subsequences N`` FLOPs-balanced subsequences, ``--sppo-offload RATIO``
  (every subsequence but the last moves that share of its offloadable saved bytes -- all but
  K/V and the unit's input and output -- to the host tier and reloads it before its backward);
- ``sppo_no_offload``: the same subsequences with ``--sppo-offload off`` (what the offload
  itself costs and saves);
- ``seq1f1b``: the same document in ``--elastic-slices N`` equal slices, nothing offloaded, no
  checkpointing (the CPU budget is ample);
- ``sppo_multiplex``: ``sppo`` with ``--sppo-multiplex``: the first subsequence split over the
  stages that idle in the warm-up and cool-down (:mod:`sppo_offload.multiplex`), the rest as
  ``sppo``.

Measured per variant: tokens/s over the iterations and the peak device-resident
saved-activation bytes of each stage (the training loop's meter: offloaded bytes leave its
count while they are in the host tier). Printed: both, and sppo over each of the others --
tokens/s over the whole run, and the median over the iterations of the per-iteration speed
ratio (the variants of one iteration run back to back on the same document, so on a shared
machine this is the steadier figure), and tokens per CPU second of the busiest rank (its
process time in the step: the work itself, copies included, without the waits; on a machine
whose cores other jobs share, wall time measures the neighbours as much as the schedule).
The issue's targets, sppo over seq1f1b: peak at least 40% lower, tokens/s at most 15% lower.
On CPU the host tier is the same memory as the "device"; its copies are synchronous (the CUDA
tier copies on a side stream), so what sppo loses here is the copy time itself.

``--json OUT`` writes ``{"argv": [...], "schedules": {NAME: {"tokens_per_s", "tokens_per_cpu_s",
"iteration_s", "busiest_rank_cpu_s", "peak_activation_bytes_per_stage"}}, "ratios": {BASE:
{...}}, "setup": {...}}`` (``ratios``: sppo over ``seq1f1b`` and over ``sppo_no_offload``, and ``sppo_multiplex`` over
``sppo`` under ``"sppo_multiplex/sppo"``).
"""
import argparse
import json
import os
import statistics
import sys
import time

from _launch import CORPUS_FLAGS, Job, run_workers, stage_peaks, timed_step, write_json

#: variant -> (schedule, flags changed from the job's).
VARIANTS = {"sppo": ("sppo", {}), "sppo_no_offload": ("sppo", {"sppo_offload": "off"}),
            "seq1f1b": ("seq1f1b", {}), "sppo_multiplex": ("sppo", {"sppo_multiplex": True})}


def model_flags(options) -> list[str]:
    return ["--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
            "--num-attention-heads", str(options.num_attention_heads),
            "--seq-length", str(options.tokens),
            "--max-position-embeddings", str(options.tokens), "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "1000",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0", *CORPUS_FLAGS,
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "sppo",
            "--sppo-subsequences", str(options.subsequences),
            "--sppo-offload", str(options.offload)]


def long_document(source, tokens: int, first_batch: int):
    """One document of ``tokens`` tokens (plus the shifted label): the corpus's documents from
    batch ``first_batch`` on, concatenated."""
    import numpy as np

    parts, length, batch = [], 0, first_batch
    while length < tokens + 1:
        for doc in source.documents(batch):
            parts.append(doc)
            length += len(doc)
        batch += 1
    return np.concatenate(parts)[:tokens + 1], batch


def worker(argv) -> int:
    import copy

    import torch.distributed as dist

    from megatron.plugin import registry

    iters = int(os.environ["BENCH_ITERS"])
    job = Job(argv)
    args = job.args
    variants = {}
    for name, (schedule, flags) in VARIANTS.items():
        variants[name] = copy.copy(args)
        vars(variants[name]).update(flags, pipeline_schedule=schedule)
    # seq1f1b cuts the document into as many slices as sppo has subsequences (its flag is
    # refused under --pipeline-schedule sppo, so it is set here).
    variants["seq1f1b"].elastic_slices = args.sppo_subsequences
    results = {name: {"times": [], "cpu": [], "tokens": [], "peaks": []} for name in VARIANTS}
    batch = 0
    for i in range(iters + 1):
        document, batch = long_document(job.sources["train"], args.seq_length, batch)
        for name, variant in variants.items():
            registry.use_schedule(variant.pipeline_schedule)
            start = time.process_time()
            result, took, peaks = timed_step(job, [document], args=variant)
            cpu = [None] * dist.get_world_size()
            dist.all_gather_object(cpu, time.process_time() - start)
            if i == 0:
                continue
            entry = results[name]
            entry["times"].append(took)
            entry["cpu"].append(max(cpu))
            entry["tokens"].append(result["num_tokens"])
            entry["peaks"].append(peaks)
    if dist.get_rank() == 0:
        report = {}
        for name, entry in results.items():
            stages = stage_peaks(entry["peaks"])
            report[name] = {"tokens_per_s": sum(entry["tokens"]) / sum(entry["times"]),
                            "tokens_per_cpu_s": sum(entry["tokens"]) / sum(entry["cpu"]),
                            "busiest_rank_cpu_s": entry["cpu"],
                            "iteration_s": entry["times"],
                            "peak_activation_bytes_per_stage": stages}
        print(json.dumps(report))
    dist.destroy_process_group()
    return 0


def main() -> int:
    if os.environ.get("BENCH_WORKER"):
        return worker(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the document")
    parser.add_argument("--subsequences", type=int, default=8,
                        help="sppo subsequences and seq1f1b slices of the document")
    parser.add_argument("--offload", default="1.0",
                        help="--sppo-offload of the sppo run (a ratio, or auto)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    report = run_workers(__file__, model_flags(options), 29581, BENCH_ITERS=str(options.iters))
    print(f"MEASURED: PP=2 on 2 CPU ranks, one thread each; one document of {options.tokens} "
          f"tokens (embedded corpus) per iteration, {options.iters} iterations after a warm-up; "
          f"{options.num_layers} layers x hidden {options.hidden_size}; sppo: "
          f"{options.subsequences} subsequences, --sppo-offload {options.offload}; seq1f1b: "
          f"{options.subsequences} slices, no offload")
    for name, entry in report.items():
        stages = entry["peak_activation_bytes_per_stage"]
        print(f"  {name:15s} {entry['tokens_per_s']:8.1f} tokens/s, "
              f"{entry['tokens_per_cpu_s']:8.1f} tokens per CPU second | peak device-resident saved "
              f"activations per stage {[round(b / 2**20, 1) for b in stages]} MiB")
    ratios = {base: _ratios(report["sppo"], report[base])
              for base in ("seq1f1b", "sppo_no_offload")}
    for base, ratio in ratios.items():
        targets = " (targets: >= 0.85, <= 0.60)" if base == "seq1f1b" else ""
        print(f"  sppo / {base}: tokens/s x{ratio['tokens_per_s']:.3f} (median per iteration "
              f"x{ratio['median_iteration_speed']:.3f}; per CPU second "
              f"x{ratio['tokens_per_cpu_s']:.3f}), peak activation "
              f"x{ratio['peak_activation']:.3f}{targets}; per stage "
              f"{[round(r, 3) for r in ratio['peak_activation_per_stage']]}")
    ratios["sppo_multiplex/sppo"] = _ratios(report["sppo_multiplex"], report["sppo"])
    ratio = ratios["sppo_multiplex/sppo"]
    print(f"  sppo_multiplex / sppo: tokens/s x{ratio['tokens_per_s']:.3f} (median per "
          f"iteration x{ratio['median_iteration_speed']:.3f}; per CPU second "
          f"x{ratio['tokens_per_cpu_s']:.3f}), peak activation x{ratio['peak_activation']:.3f}; "
          f"per stage {[round(r, 3) for r in ratio['peak_activation_per_stage']]}")
    if options.json:
        write_json(options.json, {"schedules": report, "ratios": ratios, "setup": {
            "tokens": options.tokens, "subsequences": options.subsequences,
            "offload": options.offload, "iterations": options.iters, "pp": 2,
            "num_layers": options.num_layers, "hidden_size": options.hidden_size,
            "num_attention_heads": options.num_attention_heads}})
    return 0


def _ratios(entry: dict, base: dict) -> dict:
    """``entry`` over ``base``: tokens/s, the median per-iteration speed ratio, and peak
    activation bytes overall and per stage."""
    mine, theirs = (e["peak_activation_bytes_per_stage"] for e in (entry, base))
    speed = [b / a for a, b in zip(entry["iteration_s"], base["iteration_s"])]
    return {"tokens_per_s": entry["tokens_per_s"] / base["tokens_per_s"],
            "median_iteration_speed": statistics.median(speed),
            "tokens_per_cpu_s": entry["tokens_per_cpu_s"] / base["tokens_per_cpu_s"],
            "peak_activation": max(mine) / max(theirs),
            "peak_activation_per_stage": [a / b for a, b in zip(mine, theirs)]}


if __name__ == "__main__":
    sys.exit(main())
