"""The layout of a ``--trace-dir``: which file holds which call's timeline.

Each call of an IR schedule writes, per rank, the measured timeline
``call_<n>_rank<r>.json`` (``n`` counts this rank's calls from 1; every rank of a run makes the
same calls, so one ``n`` is one training step or evaluation on all of them). A schedule that
plans each step (``elastic``, ``seq1f1b``) also writes, from the first pipeline stage of each
data-parallel replica, the plan's predicted timeline ``call_<n>_plan_rank<r>.json``. All are
Chrome-trace JSON (:mod:`~megatron.plugin.pipeline.chrome_trace`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

_NAME = re.compile(r"call_(\d+)_(plan_)?rank(\d+)\.json")


def measured_name(call: int, rank: int) -> str:
    return f"call_{call:06d}_rank{rank}.json"


def plan_name(call: int, rank: int) -> str:
    return f"call_{call:06d}_plan_rank{rank}.json"


@dataclass
class Call:
    """The files of one call: global rank -> path."""

    measured: dict[int, str] = field(default_factory=dict)
    planned: dict[int, str] = field(default_factory=dict)


def calls(directory: str) -> dict[int, Call]:
    """The calls traced in ``directory``, by call number; ``ValueError`` when it holds none."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory: give the --trace-dir of a run")
    found: dict[int, Call] = {}
    for name in sorted(os.listdir(directory)):
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        call = found.setdefault(int(match.group(1)), Call())
        files = call.planned if match.group(2) else call.measured
        files[int(match.group(3))] = os.path.join(directory, name)
    if not any(call.measured for call in found.values()):
        raise ValueError(f"{directory} holds no call_<n>_rank<r>.json: run training with "
                         f"--trace-dir {directory} and an IR schedule (--pipeline-schedule "
                         f"elastic, seq1f1b, helix, sppo or 1f1b-ir)")
    return found
