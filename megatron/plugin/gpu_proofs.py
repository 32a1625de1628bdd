"""Which options honoured on the strength of the GPU check have a passed verdict yet.

``--bf16``, ``--fp16`` and ``--transformer-impl transformer_engine`` are honoured under a
schedule whose proof of them is ``scripts/gpu_check.py`` (:data:`GPU_CHECK`, run by
``scripts/gpu_check.sh``; :func:`megatron.plugin.option_classes.proof`).
Such an option is proven under a schedule only once a committed report of that check
(``benchmarks/results/gpu/verdicts_*.txt``) holds a passed verdict line for it:
``PASS train/<schedule>/pp<P>/<dtype>`` (Megatron's own schedule, ``default``, is proven by
``1f1b``'s lines). Until then start-up logs one warning line per such option (:func:`warnings`).
Transformer Engine's line is ``train/<schedule>/pp2/bf16-te``, which only a machine with
Transformer Engine can give: it cannot be brought to the lent test machines.
"""
from __future__ import annotations

import re
from pathlib import Path

from megatron.plugin.option_classes import GPU_CHECK, proof

REPORTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
PASSED = re.compile(r"^PASS +train/([a-z0-9-]+)/pp\d+(?:tp\d+)?/"
                    r"(fp32|bf16|fp16|bf16-te)(?:\s|$)")


def passed(reports: Path = REPORTS) -> set[tuple[str, str]]:
    """``(schedule, dtype)`` of every passed training verdict of the committed reports."""
    found = set()
    for path in sorted(reports.glob("verdicts_*.txt")):
        for line in path.read_text().splitlines():
            match = PASSED.match(line)
            if match:
                found.add((match.group(1), match.group(2)))
    return found


def warnings(args, reports: Path = REPORTS) -> list[str]:
    """One line per option of this run that rests on the GPU check without a passed verdict."""
    schedule = args.pipeline_schedule
    verdict_schedule = "1f1b" if schedule == "default" else schedule
    proven = passed(reports)
    lines = []
    for flag, dtype in (("--bf16", "bf16"), ("--fp16", "fp16")):
        if getattr(args, dtype, False) and proof(dtype, schedule) == GPU_CHECK \
                and (verdict_schedule, dtype) not in proven:
            lines.append(f"warning: {flag} under --pipeline-schedule {schedule} is unproven on "
                         f"GPUs: no committed report of {GPU_CHECK} shows its verdict "
                         f"(train/{verdict_schedule}/pp*/{dtype}) passed")
    if getattr(args, "transformer_impl", None) == "transformer_engine" \
            and proof("transformer_impl", schedule) == GPU_CHECK \
            and (verdict_schedule, "bf16-te") not in proven:
        lines.append(f"warning: --transformer-impl transformer_engine under --pipeline-schedule "
                     f"{schedule} is unproven on GPUs: no committed report of {GPU_CHECK} shows "
                     f"its verdict (train/{verdict_schedule}/pp2/bf16-te) passed (the lent test "
                     f"machines cannot carry Transformer Engine)")
    return lines
