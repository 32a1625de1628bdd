"""Draw a training run's measured pipeline timeline, beside its plan's predicted one, as a PNG.

    python scripts/show_trace.py --trace-dir DIR --out run.png [--call N]
        [--plan SIMULATED.json] [--window START END] [--max-bars 80] [--own-axes]

``DIR`` is the ``--trace-dir`` of a run of ``pretrain_gpt_elastic.py`` with an IR schedule
(``--pipeline-schedule elastic|seq1f1b|helix|sppo|1f1b-ir``). The picture shows one call of the
schedule (one training step; default the last one traced): the measured actions of every rank,
each rank's times counted from its own start of the call, and, above them on the same seconds
axis, the timeline the plan predicted for that step where the run wrote one (``elastic`` and
``seq1f1b`` do) or where ``--plan`` gives a simulated trace (``scripts/show_schedule.py
--trace``). A rank that runs more actions than ``--max-bars`` is drawn as each kind's share of
equal time slots; ``--window`` zooms on a span in seconds.
"""
import argparse
import sys

from megatron.plugin.pipeline import trace_dir
from megatron.plugin.pipeline.chrome_trace import TraceEvent, read_chrome_trace
from megatron.plugin.pipeline.gantt import MAX_BARS, Panel, check_view, write_gantt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-dir", required=True, help="the --trace-dir of a training run")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--call", type=int,
                        help="which call of the schedule to draw (from 1; default the last)")
    parser.add_argument("--plan", help="a simulated Chrome trace to draw as the prediction "
                                       "(scripts/show_schedule.py --trace), in place of the "
                                       "plan the run wrote")
    parser.add_argument("--window", type=float, nargs=2, metavar=("START", "END"),
                        help="draw only this span, in seconds from the start of the call")
    parser.add_argument("--own-axes", action="store_true",
                        help="give the prediction and the measurement a time axis each (a "
                             "plan priced for another device can be hundreds of times "
                             "shorter than a CPU run)")
    parser.add_argument("--max-bars", type=int, default=MAX_BARS,
                        help="most actions a rank may run in the drawn span before the chart "
                             "shows each kind's share of equal time slots instead")
    return parser


def _measured(files: dict[int, str]) -> Panel:
    """Every rank's measured events, one row per global rank."""
    events = []
    for row, rank in enumerate(sorted(files)):
        events += [TraceEvent(row, e.name, e.start, e.duration, e.category, e.bytes)
                   for e in read_chrome_trace(files[rank])]
    return Panel(events, "measured (each rank from its own start of the call)",
                 [f"rank {rank}" for rank in sorted(files)])


def _predicted(path: str, title: str) -> Panel:
    events = read_chrome_trace(path)
    stages = 1 + max((e.rank for e in events), default=0)
    return Panel(events, title, [f"stage {stage}" for stage in range(stages)])


def panels(args: argparse.Namespace) -> tuple[int, list[Panel]]:
    """The call drawn and its panels (prediction first); ``ValueError`` for what is missing."""
    found = trace_dir.calls(args.trace_dir)
    traced = sorted(n for n, call in found.items() if call.measured)
    number = traced[-1] if args.call is None else args.call
    if number not in traced:
        raise ValueError(f"--call {number}: {args.trace_dir} holds calls {traced[0]} to "
                         f"{traced[-1]}")
    call = found[number]
    drawn = []
    if args.plan:
        drawn.append(_predicted(args.plan, f"predicted ({args.plan})"))
    elif call.planned:
        rank = min(call.planned)
        drawn.append(_predicted(call.planned[rank],
                                f"predicted by the plan (cost model), replica of rank {rank}"))
    drawn.append(_measured(call.measured))
    return number, drawn


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_view(args.window, args.max_bars)
        number, drawn = panels(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_gantt(drawn, args.out, title=f"{args.trace_dir}: call {number}",
                window=args.window, max_bars=args.max_bars, shared_axis=not args.own_axes)
    print(f"wrote {args.out}: call {number} of {args.trace_dir}, "
          f"{'predicted and ' if len(drawn) > 1 else ''}measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
