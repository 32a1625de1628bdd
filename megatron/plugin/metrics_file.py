"""``--metrics-jsonl``: one JSON object per training step, each with its ``iteration``.

A run resumed from a checkpoint trains the iterations after the checkpoint's again, and a
run started anew on an old file trains its iterations from 1. So the file holds each
iteration once, from the run that trained it last: when a process writes an iteration that is
not past the last one it wrote to the file (always, for its first row), the rows already there
at or after that iteration are dropped first. Rows before it are kept as they are; a row that
is not a JSON object with an ``iteration`` (the torn last line of a rank killed while
writing) is dropped with them. The choice is by iteration number rather than by the
checkpoint loaded, so the rule holds whatever started the run (a resume, a restart by
torchrun, a new run on the same file).

The folder is made at start-up, where a path that cannot be written is refused naming the
flag (the rules of :mod:`megatron.plugin.arguments`).
"""
from __future__ import annotations

import json
import os

_last_written: dict[str, int] = {}
"""Per file (absolute path), the last iteration this process wrote to it."""


def write(path: str, record: dict) -> None:
    """Append ``record`` to ``path``, first dropping the rows at or after its iteration when
    this process has not written past it (see the module docstring)."""
    path = os.path.abspath(path)
    iteration = record["iteration"]
    if path not in _last_written or iteration <= _last_written[path]:
        drop_rows_from(path, iteration)
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    _last_written[path] = iteration


def drop_rows_from(path: str, iteration: int) -> None:
    """Rewrite ``path`` without its rows at or after ``iteration`` and without rows that do not
    parse; a missing file stays missing. The new file replaces the old one whole."""
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return
    kept = [line for line in lines if (found := _iteration(line)) is not None
            and found < iteration]
    if len(kept) == len(lines):
        return
    partial = f"{path}.tmp-{os.getpid()}"
    with open(partial, "w") as handle:
        handle.writelines(line + "\n" for line in kept)
    os.replace(partial, path)


def _iteration(line: str) -> int | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    found = row.get("iteration") if isinstance(row, dict) else None
    return found if isinstance(found, int) else None
