"""Print a pipeline schedule's per-rank action grid and its simulated bubble ratio.

    python scripts/show_schedule.py --schedule 1f1b --pp 4 --microbatches 8 \
        [--json OUT.json] [--gantt OUT.png [--gantt-window START END]] [--trace OUT.json]
    python scripts/show_schedule.py --schedule helix --pp 4 --microbatches 8 --num-layers 8 \
        [--helix-folds 2] [--recompute] [--pre-cost 1 --attention-cost 1 --post-cost 2]
    python scripts/show_schedule.py --schedule zb1p --pp 4 --microbatches 8
    python scripts/show_schedule.py --schedule elastic --pp 4 --lengths LENGTHS.txt \
        [--workers 1 --solver-time-limit 0.05]
    python scripts/show_schedule.py --schedule seq1f1b --pp 4 --workload github-like \
        --global-batch-size 64 --seed 1 --seq-length 32768

Every drawable schedule is offered: the registered ones with an IR builder, with the drawing
flags their specs declare (``--help`` lists them by schedule), and the simulate-only ``zb1p``.
Costs are uniform units (forward 1, backward 2, recompute 1, free transfers, one memory unit per
stashed forward) unless overridden; helix prices its parts separately (pre-attention, attention,
post-attention; backward twice the forward) and stashes one unit per part; zb1p splits the
backward evenly into its B and W passes; elastic and seq1f1b plan a batch of documents and are
priced in seconds and bytes by the cost model. The grid lists compute and transfer actions in
the order each rank runs them.
"""
import json
import sys

from megatron.plugin import registry
from megatron.plugin.drawing import DrawCommand
from megatron.plugin.pipeline.gantt import check_view, write_gantt
from megatron.plugin.pipeline.simulator import simulate
from megatron.plugin.pipeline.chrome_trace import write_chrome_trace
from megatron.plugin.pipeline.validation import format_grid


def main(argv=None) -> int:
    command = DrawCommand(registry.drawables(), description=__doc__.splitlines()[0])
    args = command.parse(argv)
    try:
        check_view(args.gantt_window, args.gantt_max_bars)
        built = command.build(registry.drawable(args.schedule), args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    schedule = built.schedule
    units = args.microbatches or len({action.unit for row in schedule for action in row})
    result = simulate(schedule, built.costs, eager_sends=built.eager_sends)
    print(format_grid(schedule))
    print(f"\nschedule {args.schedule}: pp={args.pp} microbatches={units} "
          f"iteration time {result.iteration_time:g} {built.time_unit}, bubble ratio "
          f"{result.bubble_ratio:.4f}, peak {built.memory_unit} per stage "
          f"{[round(m, 3) for m in result.peak_memory]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schedule": args.schedule, "pp": args.pp, "microbatches": units,
                       "iteration_time": result.iteration_time,
                       "bubble_ratio": result.bubble_ratio,
                       "peak_memory_units": result.peak_memory,
                       "busy": result.busy, "idle": result.idle}, f, indent=1)
    if args.gantt:
        write_gantt(result.events, args.gantt,
                    title=f"{args.schedule}, pp={args.pp}, m={units}",
                    time_unit=built.time_unit, window=args.gantt_window,
                    max_bars=args.gantt_max_bars)
    if args.trace:
        write_chrome_trace(result.events, args.trace, name=f"{args.schedule} (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
