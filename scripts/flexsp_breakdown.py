"""Report: one simulated iteration of elastic, FlexSP and DeepSpeed-Ulysses taken apart, beside
InfiniPipe's Fig. 9 breakdown (not a test; SIMULATED, nothing measured).

    PYTHONPATH=. python scripts/flexsp_breakdown.py [--model gpt-13b] [--context 49152]
        [--seeds 0 1 2] [--json OUT]

The setting is the reproduction table's Fig. 9 cell (``scripts/reproduce_papers.py``): 512
documents of the GitHub-like mixture (seeded, truncated to the context), the InfiniPipe
testbed (4 nodes of 8 A800s, 400 Gb/s a node), elastic at Ulysses SP 8 x PP 4, DeepSpeed at
SP 32 with ZeRO-3, FlexSP's SP groups over the 32 GPUs with ZeRO-3 over all of them
(:mod:`elastic_pipe.flexsp`). Each system's iteration is split into the parts Fig. 9 names
(L371: "ZeRO", "A2A", "Bubble & P2P", "Others"), Others split further into layer compute,
recomputation and the rest, all in seconds on the critical path:

- elastic: per stage, its actions' layer compute, all-to-alls and recomputation, averaged over
  the stages; its bubble the simulator's idle time (bubble ratio x iteration); its ZeRO the
  exposed part of ZeRO-3 over each stage's SP group (:func:`paper_terms.zero3_exposed_s`,
  added to the iteration as the reproduction table's why adds it);
- FlexSP: per step, the slowest group's time with its exposed ZeRO-3 (as
  :func:`paper_terms.flexsp_terms` prices it); each part the mean over the 32 GPUs of their
  group's, and as idle the step less the GPUs' mean busy time (the groups' imbalance);
- FlexSP again with every layer recomputed, one layer at a time (its checkpointing the paper
  does not state, L139, L347: the reproduction table's term for the FlexSP rows);
- DeepSpeed: one group, its parts as FlexSP's.

Each part is printed in seconds and over elastic's iteration (Fig. 9 gives its bars relative
to InfiniPipe's), beside what Fig. 9 and its text (L373-378) say of the part.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paper_terms  # noqa: E402
from papers import infinipipe  # noqa: E402

from longctx.cost_model import CostModel, ParallelConfig  # noqa: E402
from longctx.models import get_model  # noqa: E402

GPUS = 32
PARTS = ("iteration", "compute", "recompute", "a2a", "zero3", "idle", "rest")
"""The parts of an iteration: ``compute`` (the layers' forward and backward compute),
``recompute`` (recomputed forwards), ``a2a`` (Ulysses all-to-alls), ``zero3`` (exposed ZeRO-3
traffic), ``idle`` (pipeline bubble, or the SP groups' imbalance), ``rest`` (embedding, head,
transfers and host time: the iteration less the others)."""
PAPER = {
    "elastic": {"iteration": "1 (the reference)", "a2a": "ZeRO + A2A 0.17 (L378)",
                "idle": "bubble < 0.20 (L378)",
                "compute": "Others: 1 / 1.11 of DeepSpeed's (L373)"},
    "flexsp": {"iteration": "1.52 (L378)", "a2a": "ZeRO + A2A 3.2 x 0.17 = 0.54 (L378)",
               "idle": "in Others: groups' imbalance (L378)",
               "compute": "Others 1.33-1.46 x elastic's (L373)"},
    "flexsp_recompute": {"iteration": "FlexSP's, had it recomputed every layer: its "
                                      "checkpointing is not stated (L139, L347)"},
    "deepspeed": {"iteration": "1.71 (L378)", "a2a": "ZeRO + A2A 5.7 x 0.17 = 0.97 (L378)",
                  "compute": "Others 1.11 x elastic's (L373)"},
}


def plan_parts(plan, cost: CostModel, stage: int) -> dict[str, float]:
    """Busy seconds of ``stage`` of ``plan`` (:class:`elastic_pipe.plan_types.Plan`): its layer
    compute, the recomputation's compute and all the all-to-alls (the recomputed forwards'
    included), and all its actions' time."""
    compute = recompute = busy = 0.0
    for chunk, checkpointed in zip(plan.chunks(), plan.ckpt_table()[stage]):
        compute += cost.layers(stage) * (1 + cost.hardware.backward_factor) * \
            cost.layer_compute(chunk)
        recompute += checkpointed * cost.layer_compute(chunk)
        busy += cost.stage_time(stage, chunk, checkpointed)
    return {"compute": compute, "recompute": recompute,
            "a2a": paper_terms.all_to_all_s(plan, cost)[stage], "busy": busy}


def elastic_parts(lengths: list[int], model: str, profile) -> dict[str, float]:
    from elastic_pipe.evaluation import report
    from elastic_pipe.scheduler import SchedulerConfig, plan_elastic

    cost = CostModel(get_model(model), profile, ParallelConfig(pp=4, sp=8, memory_gb=80.0))
    plan = plan_elastic(lengths, cost, SchedulerConfig())
    found = report(plan, cost, with_schedule=False)
    stages = [plan_parts(plan, cost, stage) for stage in range(cost.pp)]
    zero3 = statistics.fmean(paper_terms.zero3_exposed_s(plan, cost, cost.parallel.sp, stage)
                             for stage in range(cost.pp))
    parts = {name: statistics.fmean(s[name] for s in stages) for name in stages[0]}
    parts.update(iteration=found["iteration_time_s"] + zero3, zero3=zero3,
                 idle=found["bubble_ratio"] * found["iteration_time_s"])
    return finish(parts)


def group_parts(groups, gpus: int) -> dict[str, float]:
    """One step of SP groups side by side: its time (the slowest group with its exposed
    ZeRO-3), each part the mean over the ``gpus`` GPUs of their group's, and as idle the step
    less the GPUs' mean busy time (the groups' imbalance)."""
    step = 0.0
    parts = dict.fromkeys(("compute", "recompute", "a2a", "busy", "zero3"), 0.0)
    for group in groups:
        if group.plan is None:
            continue
        mine = plan_parts(group.plan, group.cost, 0)
        mine["zero3"] = paper_terms.zero3_exposed_s(group.plan, group.cost, gpus)
        step = max(step, mine["busy"] + mine["zero3"])
        for name in parts:
            parts[name] += group.size * mine[name] / gpus
    parts.update(iteration=step, idle=step - parts["busy"] - parts["zero3"])
    return parts


def flexsp_parts(lengths: list[int], model: str, profile, context: int,
                 checkpointed: int | None = None) -> dict[str, float]:
    from elastic_pipe.flexsp import plan_flexsp

    ulysses = dataclasses.replace(get_model(model), num_heads=64)
    plan = plan_flexsp(lengths, ulysses, profile, GPUS, 80.0, context,
                       checkpointed=checkpointed)
    steps = [group_parts(step, GPUS) for step in plan.steps]
    parts = {name: sum(s[name] for s in steps) for name in steps[0]}
    parts["steps"] = len(plan.steps)
    parts["group_sizes"] = [list(sizes) for sizes in plan.sizes]
    return finish(parts)


def deepspeed_parts(lengths: list[int], model: str, profile, context: int) -> dict[str, float]:
    from elastic_pipe.baselines import packed_1f1b
    from elastic_pipe.flexsp import Group

    ulysses = dataclasses.replace(get_model(model), num_heads=64)
    cost = CostModel(ulysses, profile, ParallelConfig(pp=1, sp=GPUS, zero3=True,
                                                      memory_gb=80.0))
    plan = packed_1f1b(lengths, cost, context)
    return finish(group_parts((Group(GPUS, tuple(range(len(lengths))), cost, plan),), GPUS))


def finish(parts: dict) -> dict:
    """``rest``: the iteration less its named parts."""
    named = sum(parts[name] for name in ("compute", "recompute", "a2a", "zero3", "idle"))
    parts["rest"] = parts["iteration"] - named
    parts.pop("busy", None)
    return parts


def breakdown(model: str, context: int, seed: int) -> dict[str, dict]:
    from elastic_pipe.workloads import github_like, truncate

    profile = infinipipe.PAPER.testbed("infinipipe-a800")
    lengths, _ = truncate(github_like(512, seed), context)
    return {"seed": seed, "tokens": sum(lengths), "longest": max(lengths),
            "elastic": elastic_parts(lengths, model, profile),
            "flexsp": flexsp_parts(lengths, model, profile, context),
            "flexsp_recompute": flexsp_parts(lengths, model, profile, context,
                                             get_model(model).num_layers),
            "deepspeed": deepspeed_parts(lengths, model, profile, context)}


def table(found: dict) -> str:
    reference = found["elastic"]["iteration"]
    flexsp = found["flexsp"]
    more = " ..." if flexsp["steps"] > 3 else ""
    lines = [f"seed {found['seed']}: {found['tokens']} tokens, longest {found['longest']}; "
             f"FlexSP {flexsp['steps']} step(s), group sizes {flexsp['group_sizes'][:3]}{more}",
             f"{'part':10s} " + " ".join(f"{name:>20s}" for name in PAPER)]
    for part in PARTS:
        cells = [f"{found[name][part]:7.2f} s = {found[name][part] / reference:5.3f}"
                 for name in PAPER]
        lines.append(f"{part:10s} " + " ".join(f"{cell:>20s}" for cell in cells))
    lines.append("Fig. 9 and its text, relative to InfiniPipe's iteration:")
    for name, said in PAPER.items():
        lines.append(f"  {name}: " + "; ".join(f"{part} {text}" for part, text in said.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-13b")
    parser.add_argument("--context", type=int, default=49152)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--json", help="write every batch's parts here")
    args = parser.parse_args(argv)
    print("SIMULATED with the InfiniPipe testbed's spec-derived profile; not measured")
    found = [breakdown(args.model, args.context, seed) for seed in args.seeds]
    for batch in found:
        print(table(batch))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"simulated": True, "model": args.model, "context": args.context,
                       "batches": found}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
