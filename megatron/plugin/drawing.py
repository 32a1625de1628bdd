"""The command line of ``scripts/show_schedule.py``: its own flags, then the drawing flags of
every drawable schedule, one group per function that adds them, titled by the schedules that
declare it (``ScheduleSpec.draw_arguments``).

A drawable is a registered schedule with an IR builder or a simulate-only one
(:func:`megatron.plugin.registry.drawables`). Two functions that add the same flag are refused
when the command is built; the registry builds it whenever a schedule registers, so that is a
registration error. A drawing flag of another schedule set away from its default is refused
when drawing: the drawn schedule would ignore it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Sequence

from megatron.plugin.pipeline.catalog import Built, Options
from megatron.plugin.pipeline.gantt import MAX_BARS


@dataclass(frozen=True)
class Drawable:
    """A schedule as the drawing command sees it; the fields mean what ``ScheduleSpec``'s
    of the same names do."""

    name: str
    build_ir: Callable[..., Built]
    draw_arguments: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    draw_units: bool = True
    draw_missing: Callable[[argparse.Namespace], list[str]] | None = None


def _add_own_arguments(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    parser.add_argument("--schedule", required=True,
                        help="a schedule with an IR builder: " + ", ".join(names))
    parser.add_argument("--pp", type=int, help="pipeline stages (required)")
    parser.add_argument("--microbatches", type=int,
                        help="units to schedule (micro-batches; subsequences for sppo); left "
                             "out for a schedule that makes its own from its flags")
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    parser.add_argument("--transfer-cost", type=float, default=0.0)
    parser.add_argument("--json", help="write the summary as JSON")
    parser.add_argument("--gantt", help="write a PNG Gantt chart (time axis in the costs' "
                                        "unit: seconds for a cost model's plan)")
    parser.add_argument("--gantt-window", type=float, nargs=2, metavar=("START", "END"),
                        help="draw only this span of the timeline (zoom, e.g. on one "
                             "pipeline of an elastic plan)")
    parser.add_argument("--gantt-max-bars", type=int, default=MAX_BARS,
                        help="most actions a rank may run in the drawn span before the "
                             "chart shows each kind's share of equal time slots instead")
    parser.add_argument("--trace", help="write the simulated timeline as Chrome-trace JSON")


class DrawCommand:
    """show_schedule's parser over ``drawables`` (:attr:`parser`); :meth:`build` builds the
    schedule the parsed flags name."""

    def __init__(self, drawables: Sequence[Drawable], description: str | None = None):
        self.parser = argparse.ArgumentParser(description=description)
        _add_own_arguments(self.parser, [drawable.name for drawable in drawables])
        self.owners: dict[Callable, list[str]] = {}
        for drawable in drawables:
            for add in drawable.draw_arguments:
                self.owners.setdefault(add, []).append(drawable.name)
        self.flags: dict[Callable, list[tuple[str, str, object]]] = {}
        """Each function -> ``(flag, dest, default)`` of the flags it added."""
        for add, names in self.owners.items():
            group = self.parser.add_argument_group(f"drawing flags of {', '.join(names)}")
            before = len(self.parser._actions)
            try:
                add(group)
            except argparse.ArgumentError as error:
                raise ValueError(f"schedule {' / '.join(names)}: {error}, already a flag of "
                                 f"{self._declared_by(error.argument_name.split('/'))}: "
                                 f"share the function that adds it") from None
            self.flags[add] = [(action.option_strings[0], action.dest, action.default)
                               for action in self.parser._actions[before:]]

    def _declared_by(self, option_strings: list[str]) -> str:
        for add, flags in self.flags.items():
            if any(flag in option_strings for flag, _, _ in flags):
                return " / ".join(self.owners[add])
        return "show_schedule itself"

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        return self.parser.parse_args(argv)

    def build(self, drawable: Drawable, args: argparse.Namespace) -> Built:
        """``drawable``'s IR from the parsed ``args``: the unit costs, ``--microbatches`` and
        its own drawing flags; ``ValueError`` for a flag it does not take."""
        mine = set(drawable.draw_arguments)
        for add, flags in self.flags.items():
            for flag, dest, default in flags:
                if add not in mine and getattr(args, dest) != default:
                    raise ValueError(f"{flag} is a drawing flag of "
                                     f"{' / '.join(self.owners[add])} and would do nothing "
                                     f"for {drawable.name}: drop it")
        if not drawable.draw_units and args.microbatches is not None:
            raise ValueError(f"{drawable.name} makes its units from its own flags: drop "
                             f"--microbatches")
        knobs = {dest: getattr(args, dest) for add in drawable.draw_arguments
                 for _, dest, _ in self.flags[add]}
        missing = [flag for flag, absent in (("--pp", args.pp is None), (
            "--microbatches", drawable.draw_units and args.microbatches is None)) if absent]
        if drawable.draw_missing is not None:
            missing += drawable.draw_missing(argparse.Namespace(**knobs))
        if missing:
            raise ValueError(f"{drawable.name} needs {'; '.join(missing)}")
        options = Options(forward=args.forward_cost, backward=args.backward_cost,
                          transfer=args.transfer_cost)
        return drawable.build_ir(args.pp, args.microbatches, options, **knobs)
