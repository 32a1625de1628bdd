"""HelixPipe's claims (``helixpipe.toml``) priced by :mod:`helix.pricing` at the paper's layout:
a node of TP 8 a stage, twice as many micro-batches as stages (L237).

``helixpipe``: helix over the faster of the project's 1F1B and ZB1P (the paper's AdaPipe,
adaptive recomputation and partitioning, is not expressible yet) over Fig. 8's grid, every
setting priced once; ``helix_figures``: Fig. 11's cost of recomputation without attention, Fig.
4's 1F1B activation memory and Fig. 10's stage peaks (memory from
:func:`helix.pricing.helix_peaks` and :func:`~helix.pricing.one_f_one_b_peaks`, 1F1B recomputing
only where it does not fit, as the speed rows).
"""
from __future__ import annotations

import dataclasses
import functools

from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig, get_model
from papers.claims import Claim, Measured, RunOptions, judged, load, term

PAPER = load("helixpipe")
HELIX_STEP = 8192
"""Tokens between the lengths the longest-sequence rows of helix try."""


def model(name: str) -> ModelConfig:
    """The paper's Table 3 shape of ``name`` where the data gives one, else the preset."""
    shape = PAPER.tables["models"].get(name)
    return get_model(name) if shape is None else ModelConfig(name, **shape)


def compare_helix(shape: ModelConfig, profile: HardwareProfile, seq: int, stages: int,
                  memory_gb: float | None = None, recompute: bool = True) -> dict:
    """:func:`helix.pricing.compare` at HelixPipe's layout; ``recompute``: helix's
    recomputation without attention."""
    from helix.pricing import compare

    return compare(shape, profile, seq, pp=stages, tp=8, microbatches=2 * stages,
                   helix_recompute=recompute, memory_gb=memory_gb)


def helix_bubble(found: dict) -> str:
    """Helix's simulated idle time beside Table 2's, and the transfers that stay exposed."""
    parts = found["parts_s"]
    exposed = found["helix_idle_s"] - found["table2_idle_s"]
    return (f"helix idles {found['helix_idle_s']:.2f} s an iteration, Table 2's 8(p-1)(t_pre + "
            f"t_post) {found['table2_idle_s']:.2f} s ({exposed:+.2f} s): a hop of "
            f"{parts['hop'] * 1e3:.1f} ms a tensor, two or three a hop, against a boundary's "
            f"t_post of {parts['post'] * 1e3:.1f} ms and an attention part of "
            f"{(parts['qkv'] + parts['attention']) * 1e3:.1f} ms to hide behind; the "
            f"baseline is {found['best_baseline']} (helix / 1F1B {found['speedup_1f1b']:.2f})")


# -- Fig. 8 -------------------------------------------------------------------------------------

def fig8_grid() -> dict[tuple[str, str, int, int], dict]:
    """Fig. 8's grid (the data's ``tables.grid``): ``(testbed, model, stages, length) ->``
    :func:`compare_helix`."""
    grid = PAPER.tables["grid"]
    return {(name, shape, stages, seq): compare_helix(model(shape), PAPER.testbed(name), seq,
                                                      stages)
            for name in grid["testbeds"] for shape in grid["models"]
            for stages in grid["stages"] for seq in grid["lengths"]}


def speedups(grid: dict) -> dict:
    return {"speedups": {f"{cluster} {shape} {stages} stages {seq // 1024}K": found["speedup"]
                         for (cluster, shape, stages, seq), found in grid.items()}}


def speedup(found: Claim, grid: dict) -> Measured:
    """Helix over the best baseline at the claim's grid setting; the detail says how helix's
    idle time differs from Table 2's bubble."""
    (name,), setting = found.testbeds, found.setting
    cell = grid[name, setting["model"], setting["stages"], setting["length"]]
    return Measured(cell["speedup"], detail={**cell, "differs": helix_bubble(cell)})


def least_speedup(found: Claim, grid: dict) -> Measured:
    """The least speedup on the claim's testbed over the grid's settings at its ``lengths``
    (L256: a gain "for all settings other than those with 32k sequence length and A800")."""
    (name,) = found.testbeds
    least = min(cell["speedup"] for (cluster, _, _, seq), cell in grid.items()
                if cluster == name and seq in found.setting["lengths"])
    return Measured(least, detail=speedups(grid))


def growth(_found: Claim, grid: dict) -> Measured:
    """The least ratio of a setting's speedup at a length to its speedup at the next shorter
    one (L256: it grows with the length)."""
    lengths = PAPER.tables["grid"]["lengths"]
    least = min(grid[(*setting, longer)]["speedup"] / grid[(*setting, shorter)]["speedup"]
                for setting in {key[:3] for key in grid}
                for shorter, longer in zip(lengths, lengths[1:]))
    return Measured(least, detail=speedups(grid))


def cluster_ratio(found: Claim, grid: dict) -> Measured:
    """The least ratio of the first testbed's speedup over the second's (L256: smaller on the
    A800). Its why: the baseline recomputing every layer on the second where it fits the
    first, those settings of the second priced with the first's memory (the paper's AdaPipe,
    which recomputes only what memory needs, is not expressible)."""
    first, second = found.testbeds
    memory = PAPER.testbed(first).hbm_gb
    ratios, priced, moved = [], [], 0
    for (cluster, shape, stages, seq), theirs in grid.items():
        if cluster != second:
            continue
        other = grid[first, shape, stages, seq]
        ratios.append(other["speedup"] / theirs["speedup"])
        if theirs["1f1b_recompute"] and not other["1f1b_recompute"]:
            moved += 1
            theirs = compare_helix(model(shape), PAPER.testbed(cluster), seq, stages, memory)
        priced.append(other["speedup"] / theirs["speedup"])
    why = term("the baseline recomputing every layer on the A800 (80 GB) where it fits the "
               "H20 (96 GB): the A800's side of those settings priced with 96 GB",
               moved, f"of {len(ratios)} settings", min(priced),
               "helix.pricing.compare (1f1b_recompute, memory_gb); longctx/profiles a800.json, "
               "h20.json (hbm_gb)")
    return Measured(min(ratios), why, detail=speedups(grid))


def helixpipe(_run: RunOptions) -> list[dict]:
    return judged(PAPER.sections["helixpipe"], MEASURES["helixpipe"], fig8_grid())


# -- Fig. 4, 10, 11 -----------------------------------------------------------------------------

def recompute_cost(found: Claim, _state) -> Measured:
    """Helix's seconds without recomputation without attention over with it."""
    (name,), setting = found.testbeds, found.setting
    times = {flag: compare_helix(model(setting["model"]), PAPER.testbed(name),
                                 setting["length"], setting["stages"], recompute=flag)["helix_s"]
             for flag in (True, False)}
    return Measured(times[False] / times[True], detail={"helix_s": times})


def stash_gb(found: Claim, _state) -> Measured:
    """1F1B's activations held by the setting's ``stage`` (FP16, TP 8, as many micro-batches in
    flight as the stages after it, at most the pipeline's 2 x stages), GB."""
    (name,), setting = found.testbeds, found.setting
    profile = PAPER.testbed(name)
    shape = dataclasses.replace(model(setting["model"]), dtype="float16")
    cost = CostModel(shape, profile, ParallelConfig(pp=setting["stages"], tp=8,
                                                    memory_gb=profile.hbm_gb))
    chunk = Chunk((Piece(0, 0, 0, setting["length"], True),))
    stage = setting["stage"]
    return Measured(min(cost.pp - stage, 2 * setting["stages"]) *
                    cost.stash_bytes(stage, chunk) / 1e9)


@functools.cache
def peaks(testbed: str, shape: str, seq: int, stages: int) -> dict:
    """Helix's stage peaks (recomputation without attention) and 1F1B's, GB."""
    from helix.pricing import helix_peaks

    profile = PAPER.testbed(testbed)
    helix = helix_peaks(model(shape), profile, seq, pp=stages, tp=8, microbatches=2 * stages,
                        recompute=True)
    baseline = compare_helix(model(shape), profile, seq, stages)
    return {"helix_peak_gb": [p / GB for p in helix], "1f1b_peak_gb": baseline["1f1b_peak_gb"],
            "1f1b_recompute": baseline["1f1b_recompute"]}


def setting_peaks(found: Claim) -> dict:
    (name,), setting = found.testbeds, found.setting
    return peaks(name, setting["model"], setting["length"], setting["stages"])


def peak_ratio(found: Claim, _state) -> Measured:
    """Helix's highest stage peak over 1F1B's (L288: the lowest)."""
    found_peaks = setting_peaks(found)
    ours, theirs = found_peaks["helix_peak_gb"], found_peaks["1f1b_peak_gb"]
    return Measured(max(ours) / max(theirs), detail=found_peaks)


def balance(found: Claim, _state) -> Measured:
    """Helix's highest stage peak over its lowest, over 1F1B's (L288: the most balanced)."""
    found_peaks = setting_peaks(found)
    ours, theirs = found_peaks["helix_peak_gb"], found_peaks["1f1b_peak_gb"]
    return Measured((max(ours) / min(ours)) / (max(theirs) / min(theirs)), detail=found_peaks)


def longest_k(found: Claim, _state) -> Measured:
    """The longest length, in steps of :data:`HELIX_STEP`, whose highest helix stage fits the
    GPU, with or without recomputation without attention (``recompute``), K tokens."""
    from helix.pricing import helix_peaks

    (name,), setting = found.testbeds, found.setting
    profile, shape, stages = PAPER.testbed(name), model(setting["model"]), setting["stages"]
    tokens = 0
    while max(helix_peaks(shape, profile, tokens + HELIX_STEP, pp=stages, tp=8,
                          microbatches=2 * stages, recompute=setting["recompute"])) \
            <= profile.hbm_gb * GB:
        tokens += HELIX_STEP
    return Measured(tokens / 1024, fields={"hbm_gb": profile.hbm_gb})


def helix_figures(_run: RunOptions) -> list[dict]:
    return judged(PAPER.sections["helix_figures"], MEASURES["helix_figures"], None)


MEASURES = {"helixpipe": {"speedup": speedup, "least_speedup": least_speedup, "growth": growth,
                          "cluster_ratio": cluster_ratio},
            "helix_figures": {"recompute_cost": recompute_cost, "stash_gb": stash_gb,
                              "peak_ratio": peak_ratio, "balance": balance,
                              "longest_k": longest_k}}
"""Each section's measures by the name its claims give (no claim names a why: each measure
computes its own)."""
WHYS = frozenset()
SECTIONS = {"helixpipe": helixpipe, "helix_figures": helix_figures}
