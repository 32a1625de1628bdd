"""Timelines of schedule actions as Chrome-trace JSON (Perfetto, chrome://tracing).

The simulator (predicted) and the executor (measured) both produce :class:`TraceEvent` lists
and write them with :func:`write_chrome_trace`, so the two timelines open side by side: one
process per trace, one thread row per pipeline rank, one complete event (``"ph": "X"``) per
action, times in microseconds; a transfer's payload is in its ``args.bytes``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class TraceEvent:
    """One action on one rank: ``start`` and ``duration`` in seconds from the trace origin."""

    rank: int
    name: str
    start: float
    duration: float
    category: str = "compute"
    bytes: int = 0
    """Payload of a transfer (what the executor sent or received; 0 for compute)."""


def chrome_trace(events: Iterable[TraceEvent], name: str = "schedule", pid: int = 0) -> dict:
    """The Chrome-trace document for ``events`` (one process named ``name``)."""
    events = list(events)
    trace = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}]
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank,
                      "args": {"name": f"rank {rank}"}})
    for e in events:
        event = {"name": e.name, "cat": e.category, "ph": "X", "pid": pid, "tid": e.rank,
                 "ts": e.start * 1e6, "dur": e.duration * 1e6}
        if e.bytes:
            event["args"] = {"bytes": e.bytes}
        trace.append(event)
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TraceEvent], path: str, name: str = "schedule") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events, name), f)


def read_chrome_trace(path: str) -> list[TraceEvent]:
    """The events of a trace this module wrote (the inverse of :func:`write_chrome_trace`);
    ``ValueError`` naming the file when it is not one."""
    try:
        with open(path) as f:
            document = json.load(f)
        return [TraceEvent(int(e["tid"]), e["name"], e["ts"] / 1e6, e["dur"] / 1e6,
                           e.get("cat", "compute"), int(e.get("args", {}).get("bytes", 0)))
                for e in document["traceEvents"] if e.get("ph") == "X"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a Chrome trace of pipeline actions ({err})") from None
