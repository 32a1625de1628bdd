"""Gantt charts of schedule timelines as PNG (for people who would rather look than read).

One row per rank, the time axis labelled with its unit (seconds for a cost model's or a
measured timeline). Works on predicted (simulator) and measured (executor) events alike;
transfer waits are left out. Two views, chosen per panel:

- **bars**, when every rank runs at most ``max_bars`` actions in the window: one bar per
  compute action coloured by kind, labelled with its unit when wide enough; offloads and
  reloads, which run on the rank's copy stream beside its compute, are thin bars just below
  the row;
- **shares**, when some rank runs more (a paper-scale plan would draw as a barcode): the window
  is cut into ``max_bars`` equal slots and each slot of a row is a column whose coloured parts
  are the shares of the slot each kind kept the rank busy (white: idle), the copy stream a thin
  strip below. The drawn patches are then at most ``ranks x max_bars x kinds`` whatever the
  plan's size; ``window`` zooms on a span (one pipeline of an elastic plan, say) to see bars.

Several panels (a predicted and a measured timeline) share one time axis, or each has its own
when their lengths differ too much to read both on one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from megatron.plugin.pipeline.ir import parse
from megatron.plugin.pipeline.chrome_trace import TraceEvent

_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "R": "#c44e52",
            "ATTN_F": "#8172b2", "ATTN_B": "#64b5cd", "OFFLOAD": "#ccb974",
            "RELOAD": "#937860"}
_OTHER = "#999999"
MAX_BARS = 80
"""Default most actions a rank may run in the window before the panel switches to shares."""


@dataclass(frozen=True)
class Panel:
    """One timeline to draw: its events, a title and the names of its rows (default
    ``rank r``)."""

    events: Sequence[TraceEvent]
    title: str = ""
    row_names: Sequence[str] | None = None


@dataclass(frozen=True)
class _Bar:
    row: float
    start: float
    width: float
    kind: str
    height: float
    label: str = ""
    edged: bool = True
    """A white outline separating neighbouring actions (not between the slots of shares)."""


def _clip(events: Iterable[TraceEvent], window: tuple[float, float] | None) -> list[TraceEvent]:
    """The compute and copy-stream events, cut to ``window`` (all of them without one)."""
    kept = [e for e in events if e.category != "comm"]
    if window is None:
        return kept
    low, high = window
    clipped = []
    for e in kept:
        start, end = max(e.start, low), min(e.start + e.duration, high)
        if end > start or (e.duration == 0 and low <= e.start <= high):
            clipped.append(TraceEvent(e.rank, e.name, start, end - start, e.category))
    return clipped


def check_view(window: tuple[float, float] | None, max_bars: int) -> None:
    """``ValueError`` saying what to change in a window or bar bound that draws nothing."""
    if window is not None and not window[1] > window[0] >= 0:
        raise ValueError(f"window {window[0]:g}..{window[1]:g}: give START END with "
                         f"0 <= START < END")
    if max_bars < 1:
        raise ValueError(f"max bars {max_bars}: give at least 1")


def _span(panels: Sequence[list[TraceEvent]],
          window: tuple[float, float] | None) -> tuple[float, float]:
    if window is not None:
        return window
    end = max((e.start + e.duration for events in panels for e in events), default=0.0)
    return 0.0, end or 1.0


def _row(kind: str) -> tuple[float, float]:
    """The row offset and height of a ``kind``: copy-stream actions are a thin strip below."""
    return (0.5, 0.15) if kind in ("OFFLOAD", "RELOAD") else (0.0, 0.8)


def _kind_order(kind: str) -> int:
    return list(_COLOURS).index(kind) if kind in _COLOURS else len(_COLOURS)


def is_shares(events: Sequence[TraceEvent], max_bars: int) -> bool:
    """Whether a panel of ``events`` draws shares rather than one bar per action."""
    per_rank: dict[int, int] = {}
    for e in events:
        per_rank[e.rank] = per_rank.get(e.rank, 0) + 1
    return max(per_rank.values(), default=0) > max_bars


def bars(events: Sequence[TraceEvent], span: tuple[float, float], max_bars: int) -> list[_Bar]:
    """What one panel draws: an action per bar, or the shares of ``max_bars`` slots per row
    when some rank runs more than ``max_bars`` actions (the module's docstring)."""
    if is_shares(events, max_bars):
        return _shares(events, span, max_bars)
    drawn = []
    for e in events:
        action = parse(e.name)
        kind = action.kind.value
        offset, height = _row(kind)
        wide = e.duration > (span[1] - span[0]) / 60
        drawn.append(_Bar(e.rank + offset, e.start, e.duration, kind, height,
                          str(action.unit) if wide and not offset else ""))
    return drawn


def _shares(events: Sequence[TraceEvent], span: tuple[float, float], slots: int) -> list[_Bar]:
    """Per rank, slot and kind, the part of the slot the kind kept the rank busy, as a bar
    whose height is that share of the row's; a slot's kinds stack up from the row's foot."""
    low, high = span
    slot = (high - low) / slots
    busy: dict[tuple[int, int, str], float] = {}
    for e in events:
        kind = parse(e.name).kind.value
        end = e.start + e.duration
        for index in range(min(int((e.start - low) / slot), slots - 1), slots):
            a, b = low + index * slot, low + (index + 1) * slot
            if a >= end:
                break
            key = (e.rank, index, kind)
            busy[key] = busy.get(key, 0.0) + max(0.0, min(end, b) - max(e.start, a))
    drawn = []
    filled: dict[tuple[int, int, float], float] = {}
    for (rank, index, kind), seconds in sorted(
            busy.items(), key=lambda item: (*item[0][:2], _kind_order(item[0][2]))):
        offset, height = _row(kind)
        below = filled.get((rank, index, offset), 0.0)
        share = min(seconds / slot, 1.0 - below)
        if share <= 0:
            continue
        filled[(rank, index, offset)] = below + share
        foot = rank + offset + height / 2 - below * height  # the y axis points down
        drawn.append(_Bar(foot - share * height / 2, low + index * slot, slot, kind,
                          share * height, edged=False))
    return drawn


def _draw(ax, panel_events: list[TraceEvent], panel: Panel, span, max_bars: int,
          time_unit: str, window: tuple[float, float] | None) -> set[str]:
    drawn = bars(panel_events, span, max_bars)
    for bar in drawn:
        ax.barh(bar.row, bar.width, left=bar.start, height=bar.height,
                color=_COLOURS.get(bar.kind, _OTHER), edgecolor="white",
                linewidth=0.5 if bar.edged else 0)
        if bar.label:
            ax.text(bar.start + bar.width / 2, bar.row, bar.label, ha="center", va="center",
                    fontsize=7, color="white")
    ranks = 1 + max((e.rank for e in panel_events), default=0)
    names = panel.row_names or [f"rank {r}" for r in range(ranks)]
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.3, -0.6)
    end = max((e.start + e.duration for e in panel_events), default=0.0)
    title = f"{panel.title}: ends at {end:.4g} {time_unit}" if panel.title else panel.title
    if window is not None:
        title += f" (window {window[0]:g} to {window[1]:g} {time_unit})"
    if is_shares(panel_events, max_bars):
        slot = (span[1] - span[0]) / max_bars
        title += (f"\n(more than {max_bars} actions on a rank: each column is a "
                  f"{_format_slot(slot, time_unit)} slot, coloured by the share each kind kept the rank "
                  f"busy; zoom with a window)")
    ax.set_title(title, fontsize=9)
    return {bar.kind for bar in drawn}


def _format_slot(seconds: float, time_unit: str) -> str:
    if time_unit != "s":
        return f"{seconds:.3g} {time_unit}"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def figure(events: Iterable[TraceEvent] | Sequence[Panel], title: str = "",
           time_unit: str = "s", window: tuple[float, float] | None = None,
           max_bars: int = MAX_BARS, shared_axis: bool = True):
    """The matplotlib figure of ``events`` (or of several :class:`Panel`, on one time axis
    unless ``shared_axis`` is false: each then spans its own events).

    ``time_unit`` names what the event times count (``"s"`` for seconds, or e.g. ``"units"``
    for uniform unit costs); ``window`` is ``(start, end)`` in that unit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_view(window, max_bars)
    events = list(events)
    panels = events if events and isinstance(events[0], Panel) else [Panel(events, title)]
    clipped = [_clip(panel.events, window) for panel in panels]
    spans = [_span(clipped, window)] * len(panels) if shared_axis else \
        [_span([events], window) for events in clipped]
    rows = [len(p.row_names) if p.row_names else 1 + max((e.rank for e in c), default=0)
            for p, c in zip(panels, clipped)]
    fig, axes = plt.subplots(len(panels), 1, sharex=shared_axis, squeeze=False,
                             figsize=(14, sum(0.45 * r + 1.0 for r in rows) + 0.6),
                             gridspec_kw={"height_ratios": [r + 1.5 for r in rows]})
    used: set[str] = set()
    unit = "seconds" if time_unit == "s" else time_unit
    for ax, panel, panel_events, span in zip(axes[:, 0], panels, clipped, spans):
        used |= _draw(ax, panel_events, panel, span, max_bars, time_unit, window)
        ax.set_xlim(*span)
        if not shared_axis:
            ax.set_xlabel(f"time ({unit})")
        ax.grid(axis="x", color="#dddddd", linewidth=0.5)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    kinds = [k for k in _COLOURS if k in used]
    axes[0, 0].legend([plt.Rectangle((0, 0), 1, 1, color=_COLOURS[k]) for k in kinds], kinds,
                      loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
                      ncol=len(kinds) or 1, frameon=False)
    if len(panels) > 1 and title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_gantt(events: Iterable[TraceEvent] | Sequence[Panel], path: str, title: str = "",
                time_unit: str = "s", window: tuple[float, float] | None = None,
                max_bars: int = MAX_BARS, shared_axis: bool = True) -> None:
    """Draw :func:`figure` of the same arguments into a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(events, title, time_unit, window, max_bars, shared_axis)
    fig.savefig(path, dpi=100)
    plt.close(fig)
