"""What has run on a GPU, as one table (schedule x PP x dtype), from the committed reports.

    python scripts/gpu_table.py [--write]

Reads ``benchmarks/results/gpu/verdicts_*.txt`` (``scripts/gpu_check.sh``'s reports, one
verdict per line: :mod:`scripts.gpu_verdicts`) and the earlier reports
``benchmarks/results/gpu/gpu_check*.txt``, which recorded exit codes only (``ok
train-<schedule>-<dtype>``: one GPU, PP = 1). A cell is ``pass`` where a verdict line of a report
passed for it (a training run's or a golden layout's), ``FAIL`` where verdicts exist and none
passed, ``ran`` where only an exit code was recorded (``ran, no update`` for fp16: those runs'
loss scaler skipped every iteration), and ``-`` where nothing has run. Prints
the table; ``--write`` puts it into README.md between its markers
(``tests/unit/test_gpu_table.py`` checks that README.md holds what this prints).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import gpu_verdicts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu"
README = ROOT / "README.md"
START, END = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"
ROWS = ("default", "1f1b", "interleaved", "1f1b-ir", "elastic", "seq1f1b", "helix", "sppo",
        "sppo-multiplex")
COLUMNS = (("pp1", "fp32"), ("pp1", "bf16"), ("pp1", "fp16"),
           ("pp2", "fp32"), ("pp2", "bf16"), ("pp2", "fp16"),
           ("pp4", "fp32"), ("pp4", "bf16"), ("pp4", "fp16"), ("pp2tp2", "fp32"))
LEGACY = re.compile(r"^ok +train-([a-z0-9-]+)-(fp32|bf16|fp16)$")


def cells(results: Path = RESULTS) -> dict[tuple, str]:
    """(schedule, layout, dtype) -> ``pass``, ``FAIL`` or ``ran`` (module doc)."""
    found: dict[tuple, set] = {}
    for path in sorted(results.glob("verdicts_*.txt")):
        for line in path.read_text().splitlines():
            verdict = gpu_verdicts.parse_line(line)
            if verdict is None or verdict.outcome == "SKIP":
                continue
            parts = verdict.key.split("/")
            if len(parts) == 4 and parts[0] in ("train", "golden"):
                found.setdefault(tuple(parts[1:]), set()).add(verdict.outcome)
    ran = set()
    for path in sorted(results.glob("gpu_check*.txt")):
        for line in path.read_text().splitlines():
            match = LEGACY.match(line.strip())
            if match:
                ran.add((match.group(1), "pp1", match.group(2)))
    table = {cell: "pass" if "PASS" in outcomes else "FAIL" for cell, outcomes in found.items()}
    table.update({cell: "ran, no update" if cell[2] == "fp16" else "ran"
                  for cell in ran if cell not in table})
    return table


def table(results: Path = RESULTS) -> str:
    known = cells(results)
    head = ["schedule", *(f"{layout.upper().replace('TP', ' x TP')} {dtype}"
                          for layout, dtype in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for schedule in ROWS:
        row = [f"`{schedule}`", *(known.get((schedule, layout, dtype), "-")
                                  for layout, dtype in COLUMNS)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str:
    """What README.md holds between its markers."""
    return text.split(START, 1)[1].split(END, 1)[0].lstrip("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the table into README.md")
    args = parser.parse_args(argv)
    text = table()
    if args.write:
        readme = README.read_text()
        before, rest = readme.split(START, 1)
        README.write_text(f"{before}{START}\n{text}{END}{rest.split(END, 1)[1]}")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
