"""``python -m elastic_pipe.plan``: plan one global batch, simulate it, compare the baselines.

Example::

    python -m elastic_pipe.plan --lengths lengths.txt.gz --global-batch-size 512 --seed 1 \\
        --seq-length 131072 --model gpt-13b --hardware a800 --pp 4 --sp 8 --json plan.json

Progress goes to stderr while the planner solves; the summary to stdout.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from megatron.plugin.pipeline.gantt import write_gantt
from megatron.plugin.pipeline.chrome_trace import write_chrome_trace

from longctx.cost_model import CostModel, ParallelConfig
from elastic_pipe.evaluation import baseline_plans, baseline_reports, report
from longctx.hardware import load_profile, profiles_help
from elastic_pipe.lowering import simulate_plan
from longctx.models import PRESETS, ModelConfig, get_model
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
from elastic_pipe.workloads import dataset_lengths, read_lengths, sample, truncate

SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "vocab_size")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m elastic_pipe.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", help="file with one document length a line (.gz allowed)")
    source.add_argument("--data-path", help="Megatron dataset prefix (PREFIX.bin/PREFIX.idx)")
    parser.add_argument("--global-batch-size", type=int,
                        help="documents sampled from the source (default: all of them)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed")
    parser.add_argument("--seq-length", type=int, default=131072,
                        help="context length; longer documents are truncated")
    parser.add_argument("--model", default="gpt-13b",
                        help=f"{'|'.join(sorted(PRESETS))}, or 'custom' with the shape flags")
    for flag in SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=int,
                            help="model shape (overrides the preset's value)")
    parser.add_argument("--hardware", default="a800", help=f"{profiles_help()} or a profile .json")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--sp", type=int, default=8, help="Ulysses sequence-parallel degree")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    parser.add_argument("--memory-gb", type=float, help="GB per GPU (default: the profile's)")
    parser.add_argument("--solver-time-limit", type=float, default=0.2,
                        help="CP-SAT time limit per pipeline (deterministic seconds)")
    parser.add_argument("--workers", type=int, default=2, help="solver processes")
    parser.add_argument("--json", help="write the plan, its simulation and the baselines here")
    parser.add_argument("--gantt", help="write a PNG Gantt chart of the simulated schedule")
    parser.add_argument("--trace", help="write the simulated timeline as Chrome-trace JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the planner's steps")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> ModelConfig:
    shape = {flag: getattr(args, flag) for flag in SHAPE_FLAGS if getattr(args, flag)}
    if args.model == "custom":
        missing = [f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if f not in shape]
        if missing:
            raise ValueError(f"--model custom needs {' '.join(missing)}")
        base = {}
    else:
        preset = get_model(args.model)
        base = {"num_layers": preset.num_layers, "hidden_size": preset.hidden_size,
                "num_attention_heads": preset.num_heads,
                "ffn_hidden_size": preset.ffn_hidden_size, "vocab_size": preset.vocab_size}
    base.update(shape)
    name = args.model if not shape else f"{args.model}+custom"
    return ModelConfig(name, base["num_layers"], base["hidden_size"],
                       base["num_attention_heads"], base["ffn_hidden_size"], base["vocab_size"])


def progress_bar(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def summary(result: dict, plan, cost: CostModel) -> str:
    lines = [f"elastic plan: {result['num_chunks']} chunks in {result['num_pipelines']} "
             f"pipeline(s), {result['truncated']} document(s) truncated, solved in "
             f"{result['solve_time_s']:.2f} s",
             f"  chunk time rel. std {result['chunk_time_rsd']:.3f}, chunk length rel. std "
             f"{result['chunk_length_rsd']:.3f}"]
    for number, pipeline in enumerate(plan.pipelines):
        kinds = [chunk.kind for chunk in pipeline.chunks]
        lines.append(f"  pipeline {number}: {len(pipeline.chunks)} chunks (N={pipeline.num_slices}"
                     f"; {kinds.count('split')} split, {kinds.count('hybrid')} hybrid, "
                     f"{kinds.count('batched')} batched), forward lookahead "
                     f"{pipeline.lookahead}, checkpointing {pipeline.status}")
        for stage, row in enumerate(pipeline.ckpt):
            lines.append(f"    stage {stage} ({cost.layers(stage)} layers) checkpointed "
                         f"layers per chunk: {_runs(row)}")
    lines.append(f"simulated iteration {result['iteration_time_s']:.3f} s, bubble ratio "
                 f"{result['bubble_ratio']:.3f}, recompute {result['recompute_time_s']:.3f} s "
                 f"(all stages)")
    lines.append("peak memory per stage (GB): " + ", ".join(
        f"{m:.1f}" for m in result["peak_memory_gb"]) + f" of {result['memory_capacity_gb']:g}")
    for fallback in result["fallbacks"]:
        lines.append(f"fallback: pipeline {fallback['pipeline']}: {fallback['reason']}")
    lines.append("baselines (simulated iteration s, bubble, elastic speed-up):")
    for name, other in result["baselines"].items():
        if other.get("oom"):
            lines.append(f"  {name:20s} OOM")
        else:
            lines.append(f"  {name:20s} {other['iteration_time_s']:9.3f}  "
                         f"{other['bubble_ratio']:.3f}  "
                         f"{other['iteration_time_s'] / result['iteration_time_s']:.2f}x")
    return "\n".join(lines)


def _runs(row) -> str:
    """Run-length form of a ckpt row: ``3x12, 1x10``."""
    parts, start = [], 0
    for index in range(1, len(row) + 1):
        if index == len(row) or row[index] != row[start]:
            parts.append(f"{index - start}x{row[start]}")
            start = index
    return ", ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        lengths = read_lengths(args.lengths) if args.lengths else dataset_lengths(args.data_path)
        if args.global_batch_size:
            lengths = sample(lengths, args.global_batch_size, args.seed)
        lengths, truncated = truncate(lengths, args.seq_length)
        hardware = load_profile(args.hardware)
        parallel = ParallelConfig(pp=args.pp, sp=args.sp, tp=args.tp, dp=args.dp,
                                  memory_gb=args.memory_gb or hardware.hbm_gb)
        cost = CostModel(build_model(args), hardware, parallel)
        config = SchedulerConfig(solver_time_limit=args.solver_time_limit, workers=args.workers)
        plan = plan_elastic(lengths, cost, config, progress=progress_bar)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = report(plan, cost)
    result["truncated"] = truncated
    plans = baseline_plans(lengths, cost, config, args.seq_length, plan)
    result["baselines"] = baseline_reports(plans, cost)
    result["plan"] = plan.to_dict()
    print(summary(result, plan, cost))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    if args.gantt or args.trace:
        _, simulated = simulate_plan(plan, cost, trace=True)
        if args.gantt:
            write_gantt(simulated.events, args.gantt, title=f"elastic plan ({cost.model.name})")
        if args.trace:
            write_chrome_trace(simulated.events, args.trace, name="elastic plan (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
