"""Gantt charts of schedule timelines as PNG (for people who would rather look than read).

One row per rank, one bar per compute action coloured by kind (transfer waits are left out), labelled with the unit when the
bar is wide enough; offloads and reloads, which run on the rank's copy stream beside its
compute, are thin bars just below the row. Works on predicted (simulator) and measured (executor) events alike.
"""
from __future__ import annotations

from typing import Iterable

from megatron.plugin.pipeline.ir import parse
from megatron.plugin.pipeline.chrome_trace import TraceEvent

_COLOURS = {"F": "#4c72b0", "B": "#55a868", "R": "#c44e52", "ATTN_F": "#8172b2",
            "ATTN_B": "#64b5cd", "OFFLOAD": "#ccb974", "RELOAD": "#937860"}


def write_gantt(events: Iterable[TraceEvent], path: str, title: str = "") -> None:
    """Draw ``events`` into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in events if e.category != "comm"]
    ranks = 1 + max((e.rank for e in events), default=0)
    end = max((e.start + e.duration for e in events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(24, 4 + 0.35 * len(events) / ranks), 0.6 * ranks + 1.2))
    for e in events:
        action = parse(e.name)
        if action.is_memory():  # the copy stream: a thin bar just below the row
            ax.barh(e.rank + 0.5, e.duration, left=e.start, height=0.15, linewidth=0, zorder=3,
                    color=_COLOURS[action.kind.value])
            continue
        ax.barh(e.rank, e.duration, left=e.start, height=0.8, edgecolor="white", linewidth=0.5,
                color=_COLOURS.get(action.kind.value, "#999999"))
        if e.duration > end / 60:
            ax.text(e.start + e.duration / 2, e.rank, str(action.unit), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    used = {parse(e.name).kind.value for e in events}
    ax.legend([h for h, k in zip(handles, _COLOURS) if k in used],
              [k for k in _COLOURS if k in used], loc="upper right", fontsize=7, ncol=4)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
