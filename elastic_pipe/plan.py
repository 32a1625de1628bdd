"""``python -m elastic_pipe.plan``: plan one global batch, simulate it, compare the baselines.

Example::

    python -m elastic_pipe.plan --lengths lengths.txt.gz --global-batch-size 512 --seed 1 \\
        --seq-length 131072 --model gpt-13b --hardware a800 --pp 4 --sp 8 --json plan.json
    python -m elastic_pipe.plan --workload github-like --global-batch-size 512 --seed 1

Progress goes to stderr while the planner solves; the summary to stdout.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from megatron.plugin.pipeline.gantt import write_gantt
from megatron.plugin.pipeline.chrome_trace import write_chrome_trace

from longctx.cost_model import CostModel
from longctx.model_flags import add_num_layers
from elastic_pipe.batch_flags import add_arguments, planning_inputs
from elastic_pipe.evaluation import baseline_plans, baseline_reports, report
from elastic_pipe.lowering import simulate_plan
from elastic_pipe.scheduler import plan_elastic


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m elastic_pipe.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    add_num_layers(parser)
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--json", help="write the plan, its simulation and the baselines here")
    parser.add_argument("--gantt", help="write a PNG Gantt chart of the simulated schedule")
    parser.add_argument("--trace", help="write the simulated timeline as Chrome-trace JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the planner's steps")
    return parser.parse_args(argv)


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
        inputs = planning_inputs(args)
        plan = plan_elastic(inputs.lengths, inputs.cost, inputs.config, progress=progress_bar)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cost = inputs.cost
    result = report(plan, cost)
    result["truncated"] = inputs.truncated
    plans = baseline_plans(inputs.lengths, cost, inputs.config, args.seq_length, plan)
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
