"""Benchmark of the elastic planner (not a test): simulated iteration times against the baselines.

Workloads: the Wikipedia lengths at ``../shared/data/wikipedia_doc_lengths.txt.gz`` (skipped,
with a message, when absent) and the GitHub-like generator of ``elastic_pipe.workloads``;
512 documents, contexts 64K/128K/192K, gpt-13b and gpt-30b, 32 A800 (pp 4 x sp 8), 80 GB.
Every time is the project simulator's replay of the lowered schedule with the spec-derived
A800 profile. Plan time is the median of ``--repeats`` fresh plans (the memo cleared).
``--json OUT`` writes ``{"argv": [...], "simulated": true, ..., "cells": [{"workload",
"context", "model", "elastic": {...}, "baselines": {NAME: {...}}, "speedup": {NAME: ...},
"plan_time_s", ...}]}`` (a cell whose elastic plan does not fit has ``"elastic_oom"``).

    python scripts/bench_planner.py [--repeats 3] [--contexts 65536 131072 196608] [--json OUT]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

from _launch import write_json
from elastic_pipe import scheduler
from longctx.cost_model import CostModel, ParallelConfig
from elastic_pipe.evaluation import baseline_plans, baseline_reports, report
from longctx.hardware import load_profile
from longctx.models import get_model
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
from elastic_pipe.workloads import github_like, read_lengths, sample, truncate

HARDWARE = "a800"
PARALLEL = ParallelConfig(pp=4, sp=8, memory_gb=80.0)
WIKIPEDIA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                         "wikipedia_doc_lengths.txt.gz")


def workloads(count: int, seed: int) -> dict[str, list[int]]:
    found = {"github-like": github_like(count, seed)}
    if os.path.exists(WIKIPEDIA):
        found["wikipedia"] = sample(read_lengths(WIKIPEDIA), count, seed)
    else:
        print(f"wikipedia lengths not found at {os.path.normpath(WIKIPEDIA)}: skipped")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072, 196608])
    parser.add_argument("--models", nargs="+", default=["gpt-13b", "gpt-30b"])
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    config = SchedulerConfig()
    header = (f"{'workload':12s} {'ctx':>4s} {'model':8s} {'elastic':>8s} {'seq1f1b':>8s} "
              f"{'packed':>8s} {'fullck':>8s} {'nogroup':>8s} {'x seq':>6s} {'x pack':>6s} "
              f"{'bubble':>6s} {'plan s':>6s} {'pipes':>5s} {'fallbk':>6s}")
    print(header)
    found, rows = workloads(args.documents, args.seed), []
    for name, raw in found.items():
        for context in args.contexts:
            lengths, _ = truncate(raw, context)
            for model in args.models:
                cost = CostModel(get_model(model), load_profile(HARDWARE), PARALLEL)
                row = {"workload": name, "context": context, "model": model}
                rows.append(row)
                times = []
                try:
                    for _ in range(args.repeats):
                        scheduler._memo.clear()
                        started = time.perf_counter()
                        plan = plan_elastic(lengths, cost, config)
                        times.append(time.perf_counter() - started)
                except ValueError as error:
                    row["elastic_oom"] = str(error)
                    print(f"{name:12s} {context // 1024:3d}K {model:8s} elastic OOM: {error}")
                    continue
                ours = report(plan, cost, with_schedule=False)
                others = baseline_reports(baseline_plans(lengths, cost, config, context, plan),
                                          cost, with_schedule=False)
                speedup = {k: None if others[k].get("oom") else
                           others[k]["iteration_time_s"] / ours["iteration_time_s"]
                           for k in ("seq1f1b", "1f1b_packed")}
                row.update(elastic=ours, baselines=others, speedup=speedup,
                           plan_time_s=statistics.median(times), plan_times_s=times)
                cells = [f"{'OOM':>8s}" if o.get("oom") else f"{o['iteration_time_s']:8.2f}"
                         for o in others.values()]
                ratios = [f"{'OOM':>6s}" if r is None else f"{r:6.2f}" for r in speedup.values()]
                print(f"{name:12s} {context // 1024:3d}K {model:8s} "
                      f"{ours['iteration_time_s']:8.2f} {' '.join(cells)} {' '.join(ratios)} "
                      f"{ours['bubble_ratio']:6.3f} {row['plan_time_s']:6.2f} "
                      f"{ours['num_pipelines']:5d} {len(ours['fallbacks']):6d}", flush=True)
    if args.json:
        write_json(args.json, {"simulated": True, "hardware": HARDWARE,
                               "parallel": dataclasses.asdict(PARALLEL),
                               "documents": args.documents, "seed": args.seed,
                               "repeats": args.repeats, "workloads": list(found),
                               "cells": rows})


if __name__ == "__main__":
    main()
