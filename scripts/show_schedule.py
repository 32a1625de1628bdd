"""Print a pipeline schedule's per-rank action grid and its simulated bubble ratio.

    python scripts/show_schedule.py --schedule 1f1b --pp 4 --microbatches 8 \
        [--json OUT.json] [--gantt OUT.png] [--trace OUT.json]
    python scripts/show_schedule.py --schedule helix --pp 4 --microbatches 8 --num-layers 8 \
        [--helix-folds 2] [--recompute] [--pre-cost 1 --attention-cost 1 --post-cost 2]

Costs are uniform units (forward 1, backward 2, recompute 1, free transfers, one memory unit per
stashed forward) unless overridden; helix prices its parts separately (pre-attention, attention,
post-attention; backward twice the forward) and stashes one unit per part. The grid lists
compute and transfer actions in the order each rank runs them.
"""
import argparse
import json
import sys

from megatron.plugin import registry
from megatron.plugin.pipeline import catalog
from megatron.plugin.pipeline.gantt import write_gantt
from megatron.plugin.pipeline.simulator import simulate
from megatron.plugin.pipeline.chrome_trace import write_chrome_trace
from megatron.plugin.pipeline.validation import format_grid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True,
                        help="a registered schedule with an IR builder: "
                             + ", ".join(registry.drawable_names()))
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    parser.add_argument("--transfer-cost", type=float, default=0.0)
    parser.add_argument("--num-layers", type=int, help="helix: layers (default 2 x pp)")
    parser.add_argument("--helix-folds", type=int, default=2)
    parser.add_argument("--recompute", action="store_true",
                        help="helix: recompute pre/post-attention parts before their backward")
    parser.add_argument("--offload", action="store_true",
                        help="sppo: offload every subsequence but the last, reload it before "
                             "its backward")
    parser.add_argument("--pre-cost", type=float, default=1.0, help="helix: pre-attention")
    parser.add_argument("--attention-cost", type=float, default=1.0, help="helix: attention")
    parser.add_argument("--post-cost", type=float, default=2.0, help="helix: post-attention")
    parser.add_argument("--json", help="write the summary as JSON")
    parser.add_argument("--gantt", help="write a PNG Gantt chart")
    parser.add_argument("--trace", help="write the simulated timeline as Chrome-trace JSON")
    args = parser.parse_args(argv)
    options = catalog.Options(
        forward=args.forward_cost, backward=args.backward_cost, transfer=args.transfer_cost,
        num_layers=args.num_layers, folds=args.helix_folds, recompute=args.recompute,
        offload=args.offload,
        t_pre=args.pre_cost, t_attn=args.attention_cost, t_post=args.post_cost)
    try:
        built = registry.build_ir(args.schedule)(args.pp, args.microbatches, options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    schedule = built.schedule
    result = simulate(schedule, built.costs, eager_sends=built.eager_sends)
    print(format_grid(schedule))
    print(f"\nschedule {args.schedule}: pp={args.pp} microbatches={args.microbatches} "
          f"iteration time {result.iteration_time:g} units, bubble ratio "
          f"{result.bubble_ratio:.4f}, peak stashed units per stage "
          f"{[round(m, 3) for m in result.peak_memory]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schedule": args.schedule, "pp": args.pp,
                       "microbatches": args.microbatches,
                       "iteration_time": result.iteration_time,
                       "bubble_ratio": result.bubble_ratio,
                       "peak_memory_units": result.peak_memory,
                       "busy": result.busy, "idle": result.idle}, f, indent=1)
    if args.gantt:
        write_gantt(result.events, args.gantt,
                    title=f"{args.schedule}, pp={args.pp}, m={args.microbatches}")
    if args.trace:
        write_chrome_trace(result.events, args.trace, name=f"{args.schedule} (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
