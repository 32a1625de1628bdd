"""InfiniPipe's cells: one seeded batch of the GitHub-like mixture priced for elastic and the
paper's baselines, and a cell (model, context, documents a batch) as the means over its batches.

The testbed is 32 A800 GPUs as Ulysses SP 8 inside a node x PP 4 across nodes (InfiniPipe
L341); 512 documents a batch by default (L347), truncated to the context. The paper gives no
model shapes: the project's presets are used.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

import paper_terms

from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import get_model

BASELINES = ("seq1f1b", "deepspeed", "megatron", "flexsp")
"""The cells' baselines; the Ulysses ones (DeepSpeed, FlexSP) for 13B and 30B only."""


def elastic_speedup(model: str, context: int, profile: HardwareProfile, documents: int,
                    seed: int) -> dict:
    """One seeded batch: elastic's and each baseline's simulated seconds, with the terms the
    simulation leaves out (:mod:`paper_terms`): the Ulysses baselines' ZeRO-3 over the cluster,
    elastic's over each stage's SP group (averaged over the stages, as its all-to-all)."""
    from elastic_pipe.evaluation import baseline_plans, baseline_reports, report
    from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
    from elastic_pipe.workloads import github_like, truncate

    raw = github_like(documents, seed)
    lengths, cut = truncate(raw, context)
    cost = CostModel(get_model(model), profile, ParallelConfig(pp=4, sp=8, memory_gb=80.0))
    config = SchedulerConfig()
    plan = plan_elastic(lengths, cost, config)
    ours = report(plan, cost, with_schedule=False)
    seq = baseline_reports({"seq1f1b": baseline_plans(lengths, cost, config, context, plan)
                            ["seq1f1b"]}, cost, with_schedule=False)["seq1f1b"]
    a2a = paper_terms.all_to_all_s(plan, cost)
    zero3 = [paper_terms.zero3_exposed_s(plan, cost, cost.parallel.sp, stage)
             for stage in range(cost.pp)]
    found = {"seed": seed, "elastic_s": ours["iteration_time_s"],
             "elastic_a2a_s": sum(a2a) / len(a2a), "elastic_zero3_s": sum(zero3) / len(zero3),
             "elastic_bubble": ours["bubble_ratio"],
             "seq1f1b_s": None if seq.get("oom") else seq["iteration_time_s"],
             "tokens": sum(lengths), "longest_document": max(raw), "truncated": cut}
    if model != "gpt-7b":
        found.update(sequence_parallel_baselines(model, context, profile, lengths))
    return found


def sequence_parallel_baselines(model: str, context: int, profile: HardwareProfile,
                                lengths: list[int]) -> dict[str, float | None]:
    """The paper's DeepSpeed (Ulysses SP 32, ZeRO-3) and Megatron-LM (TP 8 x CP 4 ring
    attention, distributed optimizer) layouts for 13B and 30B (L354, L358): whole documents
    packed into context-long micro-batches run one after another, the fewest layers
    checkpointed uniformly that fit; and FlexSP, heterogeneous Ulysses SP groups over the 32
    GPUs with ZeRO-3 over all of them (:mod:`elastic_pipe.flexsp`): ``NAME_s`` seconds
    (``None`` when nothing fits), and for the Ulysses ones ``NAME_zero3_s`` (the exposed ZeRO-3
    traffic) and ``NAME_a2a_s``; ``flexsp_recompute_s`` and ``flexsp_recompute_a2a_s``, FlexSP
    with every layer recomputed (:data:`RECOMPUTE`). Ulysses over 32 GPUs needs a head count
    that 32 divides: the presets' 40 and 56 heads become 64 for it (the cost model's time and
    memory do not depend on the split)."""
    from elastic_pipe.baselines import packed_1f1b
    from elastic_pipe.evaluation import report
    from elastic_pipe.flexsp import plan_flexsp

    gpus = 32
    shape = get_model(model)
    ulysses = dataclasses.replace(shape, num_heads=64)
    layouts = {
        "deepspeed": (ulysses, ParallelConfig(pp=1, sp=gpus, zero3=True, memory_gb=80.0)),
        "megatron": (shape, ParallelConfig(pp=1, tp=8, cp=4, memory_gb=80.0)),
    }
    found = {}
    for name, (layer_shape, parallel) in layouts.items():
        cost = CostModel(layer_shape, profile, parallel)
        plan = packed_1f1b(lengths, cost, context)
        found[f"{name}_s"] = None if plan is None else \
            report(plan, cost, with_schedule=False)["iteration_time_s"]
        if name == "deepspeed":
            found["deepspeed_zero3_s"] = None if plan is None else \
                paper_terms.zero3_exposed_s(plan, cost, gpus)
            found["deepspeed_a2a_s"] = None if plan is None else \
                paper_terms.all_to_all_s(plan, cost)[0]
    try:
        flexsp = plan_flexsp(lengths, ulysses, profile, gpus, 80.0, context)
    except ValueError:
        found.update(flexsp_s=None, flexsp_zero3_s=None, flexsp_a2a_s=None)
    else:
        found.update({f"flexsp_{key}": value for key, value in
                      paper_terms.flexsp_terms(flexsp, gpus).items()})
    try:
        recomputing = plan_flexsp(lengths, ulysses, profile, gpus, 80.0, context,
                                  checkpointed=ulysses.num_layers)
    except ValueError:
        found.update(flexsp_recompute_s=None, flexsp_recompute_a2a_s=None)
    else:
        terms = paper_terms.flexsp_terms(recomputing, gpus)
        found.update(flexsp_recompute_s=recomputing.iteration_time_s(),
                     flexsp_recompute_a2a_s=terms["a2a_s"])
    return found


def mean(values: list) -> float | None:
    return None if not values or any(v is None for v in values) else statistics.fmean(values)


def seeded(model: str, context: int, profile: HardwareProfile, documents: int, seed: int,
           cache: str | None) -> dict:
    """:func:`elastic_speedup`, kept as ``cache/MODEL-CONTEXT-DOCUMENTS-SEED.json`` when a
    ``cache`` folder is given and read back from there on a later run (so that a long run can
    be resumed; a change to the planners or the pricing needs an empty folder)."""
    if cache is None:
        return elastic_speedup(model, context, profile, documents, seed)
    path = os.path.join(cache, f"{model}-{context}-{documents}-{seed}.json")
    if os.path.exists(path):
        with open(path) as handle:
            return json.load(handle)
    found = elastic_speedup(model, context, profile, documents, seed)
    os.makedirs(cache, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(found, handle)
    return found


def elastic_cell(model: str, context: int, profile: HardwareProfile, documents: int,
                 seeds: list[int], cache: str | None = None) -> dict:
    """Elastic and its baselines over ``seeds`` (one batch each): each time averaged over the
    batches (the paper averages 20 iterations, L347) and each speedup a ratio of averages,
    with the spread of the per-batch ratios."""
    runs = [seeded(model, context, profile, documents, seed, cache) for seed in seeds]
    cell = {"model": model, "context": context, "seeds": list(seeds),
            "longest_document": [r["longest_document"] for r in runs],
            "truncated": [r["truncated"] for r in runs]}
    for key in runs[0]:
        if key not in ("seed", "longest_document", "truncated"):
            cell[key] = mean([r[key] for r in runs])
    for name in BASELINES:
        if f"{name}_s" not in cell:
            continue
        cell[f"speedup_{name}"] = None if cell[f"{name}_s"] is None else \
            cell[f"{name}_s"] / cell["elastic_s"]
        ratios = [r[f"{name}_s"] / r["elastic_s"] for r in runs if r[f"{name}_s"] is not None]
        cell[f"spread_{name}"] = [min(ratios), max(ratios)] if ratios else None
        if name == "flexsp" and cell[f"{name}_s"] is not None and \
                cell.get("flexsp_recompute_s") is not None:
            cell["speedup_flexsp_recompute"] = cell["flexsp_recompute_s"] / cell["elastic_s"]
        if f"{name}_zero3_s" in cell and cell[f"{name}_s"] is not None:
            cell[f"speedup_{name}_with_zero3"] = (cell[f"{name}_s"] + cell[f"{name}_zero3_s"]) \
                / (cell["elastic_s"] + cell["elastic_zero3_s"])
    return cell


def cells(keys: list[tuple[str, int, int]], profile: HardwareProfile, seeds: list[int],
          cache: str | None = None) -> dict[tuple[str, int, int], dict]:
    """Each ``(model, context, documents)`` of ``keys`` as :func:`elastic_cell`. With a
    ``cache``, the batches are priced seed by seed first, so that an interrupted run leaves
    whole batches of every cell there."""
    if cache is not None:
        for seed in seeds:
            for model, context, documents in keys:
                seeded(model, context, profile, documents, seed, cache)
    return {(model, context, documents): elastic_cell(model, context, profile, documents, seeds,
                                                      cache)
            for model, context, documents in keys}
