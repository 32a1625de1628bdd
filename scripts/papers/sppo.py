"""SPPO's claims (``sppo.toml``) priced by :mod:`sppo_offload.solver`: SPPO against Megatron-LM
with full recomputation at Table 4's layouts and subsequence counts (or at the layouts the
solver finds, in the detail), the offload ablation, and the longest sequences each fits.

The breakdown's adaptive-offloading and multiplexing speedups (L286-288) are left out: Fig. 11
is normalized to Megatron-LM (L282), but the 65B's 3.38x and 3.48x there exceed the 3.12x over
Megatron-LM that L276 gives for the same 65B at 640K, so the text's numbers are not all over
Megatron-LM, and which they are over it does not say.
"""
from __future__ import annotations

import dataclasses
import functools

import paper_terms

from longctx.cost_model import GB
from longctx.hardware import HardwareProfile
from longctx.models import get_model
from papers.claims import Claim, Measured, RunOptions, judged, load, term

PAPER = load("sppo")
MEMORY_GB = 80.0
"""The A100-80GB's memory, which every run of the paper has (L243)."""


def testbed(fragmented: bool = False) -> HardwareProfile:
    """The testbed, with the caching allocator's fragmentation where ``fragmented``."""
    found = PAPER.testbed(PAPER.default_testbed)
    return paper_terms.fragmented(found) if fragmented else found


def table4(name: str) -> dict:
    """Table 4's row of model ``name``: ``gpus``, the ``sppo`` and ``megatron`` (SP, PP) and
    SPPO's ``subsequences`` by length (tokens)."""
    row = PAPER.tables["table4"][name]
    return {"gpus": row["gpus"], "sppo": tuple(row["sppo"]), "megatron": tuple(row["megatron"]),
            "subsequences": {int(tokens): n for tokens, n in row["subsequences"].items()}}


def layout_of(method: str, name: str) -> tuple[int, int]:
    """Table 4's (SP, PP) of ``method`` for model ``name``."""
    from sppo_offload.solver import SPPO

    return table4(name)["sppo" if method == SPPO else "megatron"]


# -- speed --------------------------------------------------------------------------------------

def speedup(name: str, gpus: int, tokens: int, layouts: tuple | None = None,
            subsequences: int | None = None) -> tuple[float | None, dict]:
    """SPPO over Megatron-LM for model ``name``, each at its layout of ``layouts`` (``(method,
    (SP, PP))`` pairs; ``None``: searched) with SPPO's ``subsequences``; and the plans' layouts
    (with Megatron-LM's exposed collectives where both fit)."""
    from sppo_offload.solver import MEGATRON, SPPO, SolverConfig, solve

    plans, solved, chosen_layouts = {}, {}, dict(layouts or ())
    for method in (SPPO, MEGATRON):
        config = SolverConfig(gpus=gpus, memory_gb=MEMORY_GB,
                              layout=chosen_layouts.get(method),
                              subsequences=subsequences if method == SPPO else None)
        try:
            solved[method] = solve(method, tokens, get_model(name), testbed(), config)
            plans[method] = solved[method].to_dict()
        except ValueError as error:
            plans[method] = {"error": str(error).splitlines()[0]}
    ok = all("tokens_per_s" in p for p in plans.values())
    ratio = plans[SPPO]["tokens_per_s"] / plans[MEGATRON]["tokens_per_s"] if ok else None
    chosen = {m: {k: p.get(k) for k in ("sp", "pp", "dp", "num_subsequences", "error")
                  if p.get(k) is not None} for m, p in plans.items()}
    if ok:
        chosen["megatron_collectives"] = megatron_collectives(solved[SPPO], solved[MEGATRON])
    return ratio, chosen


@functools.cache
def at_table4(name: str, tokens: int, shared: bool = False) -> tuple[float | None, dict]:
    """:func:`speedup` at Table 4's layouts and N for ``tokens``; ``shared``: both at SPPO's
    layout (Table 4's "Mega. & SPPO")."""
    from sppo_offload.solver import MEGATRON, SPPO

    row = table4(name)
    layouts = ((SPPO, row["sppo"]), (MEGATRON, row["sppo" if shared else "megatron"]))
    return speedup(name, row["gpus"], tokens, layouts, row["subsequences"][tokens])


def speed_detail(name: str, tokens: int) -> dict:
    """A speed row's detail: the ratio at the layouts the solver finds, and with Megatron-LM at
    SPPO's layout."""
    searched, searched_layouts = speedup(name, table4(name)["gpus"], tokens)
    return {"speedup_at_searched_layouts": searched, "searched_layouts": searched_layouts,
            "speedup_megatron_at_sppo_layout": at_table4(name, tokens, shared=True)[0]}


@functools.cache
def length_cells(name: str, lengths: tuple[int, ...]) -> list[dict]:
    """Each of ``lengths``: the speedup at Table 4's layouts, its layouts and the detail."""
    cells = []
    for tokens in lengths:
        ratio, chosen = at_table4(name, tokens)
        detail = speed_detail(name, tokens)
        cells.append({"seq_length": tokens, "speedup": ratio, "layouts": chosen,
                      "speedup_at_searched_layouts": detail["speedup_at_searched_layouts"],
                      "searched_layouts": detail["searched_layouts"],
                      "speedup_megatron_at_sppo_layout":
                          detail["speedup_megatron_at_sppo_layout"]})
    return cells


PICKS = {"lowest": min, "highest": max}


def speedup_end(found: Claim, _state) -> Measured:
    """The ``pick`` of the speedups over ``lengths``; its why is the collectives term of the
    length whose speedup with them hidden is the ``pick``."""
    name, pick = found.setting["model"], PICKS[found.setting["pick"]]
    cells = length_cells(name, tuple(found.setting["lengths"]))
    priced = [c for c in cells if c["speedup"]]
    value, why = None, None
    if priced:
        value = pick(c["speedup"] for c in priced)
        cell = pick(priced, key=lambda c: c["layouts"]["megatron_collectives"]["speedup_hidden"])
        why = collectives_term(cell["layouts"], cell["seq_length"], testbed())
    return Measured(value, why, detail={"cells": cells})


def speedup_at(found: Claim, _state) -> Measured:
    """The speedup at one length, Table 4's layouts; its why the collectives term."""
    name, tokens = found.setting["model"], found.setting["tokens"]
    ratio, chosen = at_table4(name, tokens)
    why = None if ratio is None else collectives_term(chosen, tokens, testbed())
    return Measured(ratio, why, detail={"layouts": chosen, **speed_detail(name, tokens)})


def speedup_range(found: Claim, _state) -> Measured:
    """The ``pick`` of the speedups over ``cells`` (``[model, tokens]`` pairs)."""
    others = {f"{name} {tokens // 1024}K": at_table4(name, tokens)
              for name, tokens in found.setting["cells"]}
    speedups = {key: ratio for key, (ratio, _) in others.items()}
    detail = {"speedups": speedups,
              "layouts": {key: chosen for key, (_, chosen) in others.items()}}
    return Measured(PICKS[found.setting["pick"]](speedups.values()), detail=detail)


def offload(found: Claim, _state) -> Measured:
    """SPPO's throughput with full offloading over none, at Table 4's layout and N; where the
    run without offload does not fit, its why is the memory it needs beyond the paper's."""
    from sppo_offload.solver import SPPO, NoFit, SolverConfig, solve

    name, tokens = found.setting["model"], found.setting["tokens"]
    row = table4(name)

    def rate(offloaded, memory_gb=MEMORY_GB):
        return solve(SPPO, tokens, get_model(name), testbed(), SolverConfig(
            gpus=row["gpus"], memory_gb=memory_gb, layout=row["sppo"],
            subsequences=row["subsequences"][tokens], offload=offloaded)).tokens_per_s

    full, why, ratio = rate(1.0), None, None
    try:
        ratio = full / rate("off")
    except NoFit as error:
        why = term("the device memory the simulated run without offload needs beyond the "
                   "80 GB the paper ran it in", error.min_budget_gb - MEMORY_GB, "GB",
                   full / rate("off", error.min_budget_gb), "sppo_offload.solver.NoFit")
    return Measured(ratio, why)


# -- memory -------------------------------------------------------------------------------------

@functools.cache
def longest_k(method: str, name: str, gpus: int, layout: tuple[int, int] | None = None,
              fragmented: bool = False) -> float:
    """The longest sequence ``method`` fits, K tokens (:func:`sppo_offload.solver.largest_length`
    from 64K)."""
    from sppo_offload.solver import SolverConfig, largest_length

    return largest_length(method, get_model(name), testbed(fragmented), SolverConfig(
        gpus=gpus, memory_gb=MEMORY_GB, layout=layout), 65536) / 1024


def longest(found: Claim, _state) -> Measured:
    """The longest sequence of ``method`` on ``gpus`` (Table 4's count where none is given), at
    Table 4's layout (``layout = "table4"``) or the one the solver finds."""
    method, name = found.setting["method"], found.setting["model"]
    gpus = found.setting.get("gpus", table4(name)["gpus"])
    layout = layout_of(method, name) if found.setting.get("layout") == "table4" else None
    return Measured(longest_k(method, name, gpus, layout))


def megatron_longest(found: Claim, _state) -> Measured:
    """Megatron-LM's longest sequence at Table 4's layout, against the paper's (the claim's
    number, K tokens): where longer, the fragmentation term and the memory ledger at the
    paper's length; the memory at the simulated longest; and the longest at SPPO's layout."""
    from sppo_offload.solver import MEGATRON

    name, published = found.setting["model"], found.published
    row = table4(name)
    gpus, shared, layout = row["gpus"], row["sppo"], row["megatron"]
    model = get_model(name)
    simulated = longest_k(MEGATRON, name, gpus, layout)
    why, ledger = None, {}
    if simulated > published:
        why, ledger = megatron_memory(testbed(), model, gpus, layout, published,
                                      longest_k(MEGATRON, name, gpus, layout, True))
    if simulated:
        ledger["memory_at_longest_gb"] = longest_ledger(testbed(), model, gpus, layout,
                                                        int(simulated * 1024))
    ledger["longest_at_sppo_layout_k"] = {f"SP {shared[0]} x PP {shared[1]}": longest_k(
        MEGATRON, name, gpus, shared)}
    return Measured(simulated, why, detail=ledger)


def longest_over_tuned(found: Claim, _state) -> Measured:
    """The longest 7B sequence of ``method`` on ``gpus`` over Megatron-LM's on ``base_gpus``,
    both at the layouts the solver finds; the why prices the allocator's fragmentation in
    both."""
    from sppo_offload.solver import MEGATRON

    method, gpus, base = (found.setting[key] for key in ("method", "gpus", "base_gpus"))
    with_it = longest_k(method, "gpt-7b", gpus, fragmented=True) / \
        longest_k(MEGATRON, "gpt-7b", base, fragmented=True)
    why = term(FRAGMENTATION, 100 * paper_terms.GMLAKE_FRAGMENTATION,
               "% of the reservation, in both lengths", with_it, FRAGMENTATION_SOURCE)
    tuned = longest_k(MEGATRON, "gpt-7b", base)
    return Measured(longest_k(method, "gpt-7b", gpus) / tuned if tuned else None, why)


MEASURES = {"sppo": {"speedup_end": speedup_end, "speedup": speedup_at,
                    "speedup_range": speedup_range, "offload": offload, "longest": longest,
                    "megatron_longest": megatron_longest,
                    "longest_over_tuned": longest_over_tuned}}
"""The section's measures by the name its claims give (no claim names a why: each measure
computes its own)."""
WHYS = frozenset()


def sppo(_run: RunOptions) -> list[dict]:
    return judged(PAPER.sections["sppo"], MEASURES["sppo"], None)


SECTIONS = {"sppo": sppo}


# -- terms --------------------------------------------------------------------------------------


COLLECTIVES_SOURCE = ("the cost model's layer collectives (rings over the nodes' NICs, "
                      "longctx.collectives) in the forward, backward and recomputed forward; "
                      "paper_terms.plan_collectives_s")


def collectives_term(layouts: dict, tokens: int, profile: HardwareProfile) -> dict:
    """The SPPO speed rows' why: Megatron-LM's TP + SP collectives hidden, at ``tokens``, from a
    speed cell's ``layouts`` (its ``megatron_collectives``, :func:`megatron_collectives`, and
    Megatron-LM's TP) on ``profile``'s nodes."""
    from sppo_offload.solver import MEGATRON

    exposed, tp = layouts["megatron_collectives"], layouts[MEGATRON]["sp"]
    nodes = tp // profile.gpus_per_node
    return term(f"Megatron-LM's TP + SP all-gathers and reduce-scatters (TP {tp} over {nodes} "
                f"nodes) left exposed between its GEMMs; hidden, at {tokens // 1024}K",
                exposed["seconds"], f"s of Megatron-LM's {exposed['iteration_s']:.3g} s "
                f"iteration", exposed["speedup_hidden"], COLLECTIVES_SOURCE)


def megatron_collectives(sppo_plan, megatron_plan) -> dict:
    """Megatron-LM's layer collectives in its plan's iteration (:mod:`paper_terms`), and SPPO's
    speedup over it with them hidden (taken off its iteration)."""
    seconds = paper_terms.plan_collectives_s(megatron_plan)
    iteration = megatron_plan.iteration_time_s
    hidden = megatron_plan.tokens_per_s * iteration / (iteration - seconds)
    return {"seconds": seconds, "iteration_s": iteration,
            "speedup_hidden": sppo_plan.tokens_per_s / hidden}


FRAGMENTATION = "the caching allocator's fragmentation at GMLake's A100-80GB mean"
FRAGMENTATION_SOURCE = (f"GMLake (ASPLOS 2024, arXiv 2401.08156): "
                        f"{paper_terms.GMLAKE_FRAGMENTATION:.0%} of the reservation on average "
                        f"over eight LLMs; paper_terms.fragmented")


def megatron_memory(profile: HardwareProfile, model, gpus: int, layout: tuple[int, int],
                    published_k: int, longest_fragmented_k: float) -> tuple[dict, dict]:
    """Why Megatron-LM's simulated longest sequence exceeds the paper's, and the memory ledger
    at the paper's length (one GPU's peak, GB): the device memory the simulation leaves free,
    the TP + SP full-sequence buffers and the loss's buffers already in it, NCCL's buffers
    beside the 2 GB the cost model reserves for them and the CUDA context
    (:mod:`paper_terms`). The term priced: the allocator's fragmentation, its GB at the
    paper's length and the longest sequence with it."""
    from sppo_offload.costs import subsequence_chunks
    from sppo_offload.solver import MEGATRON, SolverConfig, solve

    config = SolverConfig(gpus=gpus, memory_gb=80.0, layout=layout)
    tokens = published_k * 1024
    plain = solve(MEGATRON, tokens, model, profile, config)
    # Full recomputation has one memory option: a budget that cannot refuse it prices the peak.
    roomy = dataclasses.replace(config, memory_gb=1e6)
    fragments = solve(MEGATRON, tokens, model, paper_terms.fragmented(profile), roomy)
    cost, (chunk,) = plain.costs.cost, subsequence_chunks(plain.lengths)
    last = cost.pp - 1
    ledger = {"memory_at_published_gb": {
        "peak": max(plain.peak_memory_bytes) / GB,
        "free": 80.0 - max(plain.peak_memory_bytes) / GB,
        "tp_sp_buffers": cost.layer_workspace(chunk) / GB,
        "loss_buffers": cost.loss_workspace(chunk) / GB,
        "recompute_boundary": cost.recompute_boundary(chunk) / GB,
        "fp32_logits": cost.logits_per_token * chunk.tokens / GB,
        "nccl_buffers": paper_terms.nccl_buffer_bytes(*layout) / GB,
        "nccl_communicators": paper_terms.megatron_communicators(*layout),
        "reserved": cost.parallel.reserved_gb,
        "model_state": (cost.static_bytes(last) / GB - cost.parallel.reserved_gb)}}
    why = term(f"{FRAGMENTATION} ({paper_terms.GMLAKE_FRAGMENTATION:.0%} of the reservation), "
               f"GB at the paper's length",
               (max(fragments.peak_memory_bytes) - max(plain.peak_memory_bytes)) / GB, "GB",
               longest_fragmented_k, FRAGMENTATION_SOURCE)
    return why, ledger


def longest_ledger(profile: HardwareProfile, model, gpus: int, layout: tuple[int, int],
                   tokens: int) -> dict:
    """One GPU's memory at Megatron-LM's simulated longest sequence, GB, term by term: the
    simulation's and megatron-core's (:func:`paper_terms.megatron_recompute_ledger`) on the
    stage whose simulated peak is the highest."""
    from sppo_offload.solver import MEGATRON, SolverConfig, solve

    plan = solve(MEGATRON, tokens, model, profile, SolverConfig(gpus=gpus, memory_gb=80.0,
                                                                layout=layout))
    stage = max(range(len(plan.peak_memory_bytes)), key=plan.peak_memory_bytes.__getitem__)
    ledger = paper_terms.megatron_recompute_ledger(plan.costs.cost, tokens, stage)
    return {"tokens_k": tokens / 1024, "stage": stage,
            "simulated": {k: v / GB for k, v in ledger["simulated"].items()},
            "megatron_core": {k: v / GB for k, v in ledger["megatron_core"].items()},
            "megatron_core_moment": ledger["megatron_core_moment"],
            "over_counted": ledger["over_counted"] / GB}
