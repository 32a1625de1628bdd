"""InfiniPipe's claims (``infinipipe.toml``) priced: its Fig. 8-11 rows from the seeded cells of
:mod:`papers.infinipipe_cells`, and its Table 3 from the cost model's all-to-all.

The cells a section prices are the union of the cells its claims name (a claim's ``models``,
``contexts`` and ``batches``; the run's documents a batch where it names none), each priced
once. The Fig. 8 baselines (DeepSpeed-Ulysses SP 32 with ZeRO-3, Megatron-LM TP 8 x CP 4, FlexSP)
are priced for 13B and 30B only: the paper's 7B layouts leave a factor unstated (L354).
"""
from __future__ import annotations

import dataclasses

import paper_terms

from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig, get_model
from papers import infinipipe_cells
from papers.claims import Claim, Measured, RunOptions, judged, load, term
from papers.infinipipe_cells import BASELINES

PAPER = load("infinipipe")
SYSTEMS = {"elastic": "elastic", "seq1f1b": "Seq1F1B", "deepspeed": "DeepSpeed",
           "megatron": "Megatron-LM", "flexsp": "FlexSP"}
"""The systems of a cell, by their keys."""


@dataclasses.dataclass(frozen=True)
class Cells:
    """The priced cells by ``(model, context, documents)``, and the documents a batch of a claim
    that names none."""

    by_key: dict
    documents: int


def keys(found: Claim, documents: int) -> list[tuple[str, int, int]]:
    """The cells claim ``found`` names: its contexts, then models, then batch sizes."""
    setting = found.setting
    return [(model, context, size) for context in setting["contexts"]
            for model in setting["models"] for size in setting.get("batches", [documents])]


def picked(found: Claim, cells: Cells) -> list[dict]:
    """The claim's cells, in :func:`keys`' order."""
    return [cells.by_key[key] for key in keys(found, cells.documents)]


def by_batch(found: Claim, cells: Cells) -> dict[int, dict]:
    """The claim's cells by their documents a batch (one model and context)."""
    return {key[2]: cells.by_key[key] for key in keys(found, cells.documents)}


def longest(cells: list[dict]) -> str:
    """The batches' longest document and how many were cut to the context."""
    lengths = [n for cell in cells for n in cell["longest_document"]]
    cut = [n for cell in cells[:1] for n in cell["truncated"]]
    span = f"{min(lengths) // 1024}K-{max(lengths) // 1024}K" if min(lengths) != max(lengths) \
        else f"{lengths[0] // 1024}K"
    return f"; longest document {span}, {min(cut)}-{max(cut)} cut"


def best(cells: list[dict], key: str) -> float | None:
    return max((c[key] for c in cells if c.get(key)), default=None)


# -- the terms that account for a disagreement --------------------------------------------------

def zero3_term(cells: list[dict], name: str) -> dict:
    """A Ulysses baseline's why: its exposed ZeRO-3 traffic priced in."""
    worst = max(cells, key=lambda c: c.get(f"{name}_zero3_s") or 0.0)
    return term("ZeRO-3 gathers and reduce-scatters not hidden behind compute",
                worst[f"{name}_zero3_s"], f"s an iteration ({worst['model']}, "
                f"{worst['context'] // 1024}K)", best(cells, f"speedup_{name}_with_zero3"),
                "InfiniPipe L358, Fig. 9 ('ZeRO'); paper_terms.zero3_exposed_s")


RECOMPUTE = ("FlexSP recomputing every layer (the paper runs every system at one checkpointing "
             "configuration made for 96K, L347, and does not give FlexSP's; FlexSP's cost "
             "model leaves checkpointing out, L139)")
RECOMPUTE_SOURCE = ("InfiniPipe L139, L347; elastic_pipe.flexsp.recomputing_fits (layers "
                    "recomputed one at a time, as DeepSpeed and Megatron-LM do)")


def recompute_term(cells: list[dict], ratio=None) -> dict | None:
    """The FlexSP rows' why: FlexSP planned with every layer recomputed, its extra seconds in
    the cell where they are most, and the row's number with it (``ratio(cell, flexsp_s)``
    maximised over the cells; default elastic's speedup); ``None`` where FlexSP fits in no
    cell."""
    ratio = ratio or (lambda cell, flexsp: flexsp / cell["elastic_s"])
    priced = [c for c in cells if c.get("flexsp_s") and c.get("flexsp_recompute_s")]
    if not priced:
        return None
    worst = max(priced, key=lambda c: c["flexsp_recompute_s"] - c["flexsp_s"])
    return term(RECOMPUTE, worst["flexsp_recompute_s"] - worst["flexsp_s"],
                f"s an iteration more ({worst['model']}, {worst['context'] // 1024}K)",
                max(ratio(c, c["flexsp_recompute_s"]) for c in priced), RECOMPUTE_SOURCE)


def short_documents(cells: list[dict], _name: str) -> dict | None:
    """The batches' longest document below the context: a setting the paper does not state."""
    short = [max(c["longest_document"]) for c in cells
             if max(c["longest_document"]) < c["context"]]
    return None if not short else term(
        "the batches' longest document below the context (Fig. 10's data set is not stated)",
        max(short), "tokens", None, "elastic_pipe.workloads.github_like")


SPEEDUP_TERMS = {"zero3": zero3_term, "recompute": lambda cells, _: recompute_term(cells),
                 "short_documents": short_documents}
"""The terms a ``speedup`` claim's ``why`` names."""
ELASTIC_ZERO3 = ("elastic's ZeRO-3 over each stage's SP group inside a node not hidden behind "
                 "compute")
ELASTIC_ZERO3_SOURCE = "InfiniPipe L133, L331, L358; paper_terms.zero3_exposed_s"


# -- Fig. 8-11 measures -------------------------------------------------------------------------

def baseline_cells(cells: list[dict], name: str) -> list[dict]:
    """The cells' entries of baseline ``name`` (with the model, context and elastic's time)."""
    return [{k: c[k] for k in c if k in ("model", "context", "elastic_s") or k.startswith(name)
             or name in k} for c in cells]


def speedup(found: Claim, cells: Cells) -> Measured:
    """Elastic over the claim's ``baseline``, the most over its cells (``{longest}`` in the
    claim's text: the batches' longest document)."""
    chosen, name = picked(found, cells), found.setting["baseline"]
    why = SPEEDUP_TERMS[found.why](chosen, name) if found.why else None
    detail = {None: {}, "cells": {"cells": chosen},
              "baseline_cells": {"cells": baseline_cells(chosen, name)}}[
        found.setting.get("detail")]
    fields = {"longest": longest(chosen)} if "{longest}" in found.what else {}
    return Measured(best(chosen, f"speedup_{name}"), why, fields, detail)


def flexsp_over(found: Claim, cells: Cells) -> Measured:
    """FlexSP over the claim's ``baseline``, the most over the cells where both fit."""
    name = found.setting["baseline"]
    both = [c for c in picked(found, cells) if c[f"{name}_s"] and c["flexsp_s"]]
    return Measured(max((c[f"{name}_s"] / c["flexsp_s"] for c in both), default=None),
                    recompute_term(both, lambda cell, flexsp: cell[f"{name}_s"] / flexsp))


def single(found: Claim, cells: Cells) -> dict:
    """The one cell a claim names (Fig. 9's)."""
    (cell,) = picked(found, cells)
    return cell


def a2a_share(found: Claim, cells: Cells) -> Measured:
    """Elastic's all-to-all seconds (the stages' mean) over its iteration; the why adds its
    own ZeRO-3 to both."""
    cell = single(found, cells)
    with_zero3 = cell["elastic_a2a_s"] + cell["elastic_zero3_s"]
    return Measured(cell["elastic_a2a_s"] / cell["elastic_s"], term(
        ELASTIC_ZERO3, cell["elastic_zero3_s"], "s an iteration (the stages' mean)",
        with_zero3 / (cell["elastic_s"] + cell["elastic_zero3_s"]), ELASTIC_ZERO3_SOURCE))


def a2a_over(found: Claim, cells: Cells) -> Measured:
    """The ``baseline``'s all-to-all and exposed ZeRO-3 seconds over elastic's all-to-all; the
    why adds elastic's own ZeRO-3."""
    cell, name = single(found, cells), found.setting["baseline"]
    if cell[f"{name}_s"] is None:
        return Measured(None)
    theirs = cell[f"{name}_a2a_s"] + cell[f"{name}_zero3_s"]
    with_zero3 = cell["elastic_a2a_s"] + cell["elastic_zero3_s"]
    return Measured(theirs / cell["elastic_a2a_s"], term(
        ELASTIC_ZERO3, cell["elastic_zero3_s"], "s an iteration (the stages' mean)",
        theirs / with_zero3, ELASTIC_ZERO3_SOURCE))


def bubble(found: Claim, cells: Cells) -> Measured:
    return Measured(single(found, cells)["elastic_bubble"])


def computation(found: Claim, cells: Cells) -> Measured:
    """Fig. 9's "Others" of the ``baseline`` over elastic's. Elastic's: its busy time (the
    iteration less its bubble ratio's share) less its all-to-alls, both the stages' means; the
    baseline's: its seconds less its all-to-alls (its exposed ZeRO-3 is not in its seconds;
    FlexSP's groups' imbalance is, as L373 attributes it to FlexSP's computation). The
    ``recompute`` why: FlexSP's recomputing plan with its own all-to-alls."""
    cell, name = single(found, cells), found.setting["baseline"]
    if cell[f"{name}_s"] is None:
        return Measured(None)
    elastic = cell["elastic_s"] * (1 - cell["elastic_bubble"]) - cell["elastic_a2a_s"]
    recomputing = cell["flexsp_recompute_s"] if found.why == "recompute" else None
    why = None if recomputing is None else term(
        RECOMPUTE, recomputing - cell["flexsp_s"], "s an iteration more",
        (recomputing - cell["flexsp_recompute_a2a_s"]) / elastic, RECOMPUTE_SOURCE)
    return Measured((cell[f"{name}_s"] - cell[f"{name}_a2a_s"]) / elastic, why)


def throughput(cell: dict, name: str) -> float | None:
    """Tokens a second of system ``name`` in ``cell``: the batches' mean tokens over their
    mean seconds (``None`` where it misses any batch)."""
    seconds = cell[f"{name}_s"]
    return None if seconds is None else cell["tokens"] / seconds


def kept_shares(found: Claim, cells: Cells) -> tuple[dict[str, float], dict]:
    """Each system's throughput in the claim's second cell over its first (a system missing a
    batch of either left out), and the detail naming them."""
    short, long = picked(found, cells)
    kept = {name: None if throughput(short, name) is None or throughput(long, name) is None
            else throughput(long, name) / throughput(short, name) for name in SYSTEMS}
    kept = {name: share for name, share in kept.items() if share is not None}
    return kept, {f"share_of_{short['context'] // 1024}k_throughput_kept": kept}


def share_kept(found: Claim, cells: Cells) -> Measured:
    kept, detail = kept_shares(found, cells)
    return Measured(max(kept.values()), detail=detail)


def share_kept_over(found: Claim, cells: Cells) -> Measured:
    """The ``system``'s share kept over the ``over`` (``largest`` or ``smallest``) share another
    system keeps."""
    kept, detail = kept_shares(found, cells)
    name, pick = found.setting["system"], {"largest": max, "smallest": min}[found.setting["over"]]
    others = [share for other, share in kept.items() if other != name]
    if name not in kept or not others:
        return Measured(None, detail=detail)
    return Measured(kept[name] / pick(others), detail=detail)


def gain(cells: dict[int, dict], name: str, size: int) -> float | None:
    """``name``'s throughput at a batch of ``size`` sequences over that at the smallest."""
    small, large = throughput(cells[min(cells)], name), throughput(cells[size], name)
    return None if small is None or large is None else large / small


def elastic_growth(found: Claim, cells: Cells) -> Measured:
    """Elastic's throughput over its own at the smallest batch, the most over the others."""
    batches = by_batch(found, cells)
    low = min(batches)
    detail = [{k: c[k] for k in c if k in ("seeds", "tokens", "elastic_bubble")
               or k.endswith("_s") or k.startswith("speedup_")} | {"documents": size}
              for size, c in sorted(batches.items())]
    growth = {size: gain(batches, "elastic", size) for size in batches if size != low}
    return Measured(max(growth.values()), detail={"cells": detail})


def throughput_gain(found: Claim, cells: Cells) -> Measured:
    batches = by_batch(found, cells)
    return Measured(gain(batches, found.setting["system"], max(batches)))


def gain_contrast(found: Claim, cells: Cells) -> Measured:
    """Elastic's throughput gain from the smallest batch to the largest over each baseline's,
    the least; the why is the larger batch's shorter documents, which every system gains
    from."""
    batches = by_batch(found, cells)
    low, high = min(batches), max(batches)
    elastic = gain(batches, "elastic", high)
    gains = {name: gain(batches, name, high) for name in BASELINES}
    contrast = {name: elastic / value for name, value in gains.items() if value}
    per_document = {size: batches[size]["tokens"] / size for size in (low, high)}
    mixture = term("the larger batches' shorter documents, which every system gains from: the "
                   "largest batch's mean document", per_document[high] / per_document[low],
                   "x the smallest batch's", None,
                   "elastic_pipe.workloads.github_like; the cells' tokens")
    return Measured(min(contrast.values()), mixture, detail={"gain_over": contrast})


def bubble_trend(found: Claim, cells: Cells) -> Measured:
    batches = by_batch(found, cells)
    return Measured(batches[max(batches)]["elastic_bubble"] /
                    batches[min(batches)]["elastic_bubble"])


def least_speedup(found: Claim, cells: Cells) -> Measured:
    """Elastic's least speedup over every baseline priced in every cell (named by the
    setting's ``name``); the detail gives each baseline's least and the cell it is in."""
    named = {found.setting["name"].format(model=model, context_k=context // 1024,
                                          documents=size): cells.by_key[model, context, size]
             for model, context, size in keys(found, cells.documents)}
    least = {}
    for name in BASELINES:
        priced = [(cell[f"speedup_{name}"], where) for where, cell in named.items()
                  if cell.get(f"speedup_{name}")]
        if priced:
            least[name] = dict(zip(("speedup", "cell"), min(priced)))
    return Measured(min(entry["speedup"] for entry in least.values()), detail={"least": least})


FIGURES = {"speedup": speedup, "flexsp_over": flexsp_over, "a2a_share": a2a_share,
            "a2a_over": a2a_over, "bubble": bubble, "computation": computation,
            "share_kept": share_kept, "share_kept_over": share_kept_over,
            "elastic_growth": elastic_growth, "throughput_gain": throughput_gain,
            "gain_contrast": gain_contrast, "bubble_trend": bubble_trend,
            "least_speedup": least_speedup}


def infinipipe(run: RunOptions) -> list[dict]:
    """Fig. 8-11's rows: every cell the claims name priced over the run's seeds."""
    claims = PAPER.sections["infinipipe"]
    needed = list(dict.fromkeys(key for found in claims for key in keys(found, run.documents)))
    profile = PAPER.testbed(PAPER.default_testbed)
    priced = infinipipe_cells.cells(needed, profile, list(run.seeds), run.cache)
    return judged(claims, MEASURES["infinipipe"], Cells(priced, run.documents), WHYS)


# -- Table 3 ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Table3:
    """Table 3's pricing: the testbed, the same with NVLink at NCCL's rate, and the model (the
    preset's 13B with 64 heads, so that Ulysses over 32 GPUs divides them; the all-to-all's
    bytes do not depend on the split, and the paper gives no shape)."""

    profile: HardwareProfile
    nccl: HardwareProfile
    model: ModelConfig

    def seconds(self, found: Claim) -> tuple[float, float, float]:
        """The layers' forward and backward all-to-all seconds at the claim's ``sp`` and
        ``context`` (one sequence), the same at NCCL's NVLink rate, and the layers' forward
        and backward seconds."""
        sp, context = found.setting["sp"], found.setting["context"]
        chunk = Chunk((Piece(0, 0, 0, context, True),))
        cost = CostModel(self.model, self.profile, ParallelConfig(pp=1, sp=sp))
        at_nccl = CostModel(self.model, self.nccl, ParallelConfig(pp=1, sp=sp))
        layers = self.model.num_layers
        return (2 * cost.layer_collectives(chunk) * layers,
                2 * at_nccl.layer_collectives(chunk) * layers,
                (cost.layer_forward(chunk) + cost.layer_backward(chunk)) * layers)

    def inside(self, found: Claim) -> bool:
        return found.setting["sp"] <= self.profile.gpus_per_node


def a2a_seconds(found: Claim, table: Table3) -> Measured:
    """The all-to-all seconds; inside a node the why is NVLink at NCCL's rate."""
    comm, comm_nccl, _ = table.seconds(found)
    why = None if not table.inside(found) else term(
        "NVLink at the rate NCCL reaches (20 of a link's 25 GB/s: 128-byte payloads)",
        table.nccl.intra_node_gbps, "GB/s", comm_nccl,
        "NVIDIA/nccl-tests#149, #212; paper_terms.nccl_nvlink")
    return Measured(comm, why)


def table3_share(found: Claim, table: Table3) -> Measured:
    """The all-to-all over the layers' forward and backward (the embedding, head and ZeRO
    traffic of the paper's end-to-end time left out); the why is the paper's denominator, its
    end-to-end seconds (L462), with NVLink at NCCL's rate inside a node."""
    comm, comm_nccl, layers = table.seconds(found)
    seconds, inside = found.setting["end_to_end_s"], table.inside(found)
    return Measured(comm / layers, term(
        "the share of the paper's end-to-end seconds, not of the simulated layers' time" +
        (", the all-to-all at NCCL's NVLink rate" if inside else ""), layers,
        f"s the simulated layers take (the paper's end-to-end: {seconds:g} s)",
        comm_nccl / seconds, "InfiniPipe Table 3 (L462-467)" +
        ("; paper_terms.nccl_nvlink" if inside else "")))


def table3_pricing() -> Table3:
    """Table 3's pricing on the InfiniPipe testbed."""
    profile = PAPER.testbed(PAPER.default_testbed)
    model = dataclasses.replace(get_model("gpt-13b"), num_heads=64)
    return Table3(profile, paper_terms.nccl_nvlink(profile), model)


def table3(_run: RunOptions) -> list[dict]:
    return judged(PAPER.sections["table3"], MEASURES["table3"], table3_pricing())


MEASURES = {"infinipipe": FIGURES, "table3": {"a2a_share": table3_share,
                                              "a2a_seconds": a2a_seconds}}
"""Each section's measures by the name its claims give."""
WHYS = frozenset(SPEEDUP_TERMS)
"""The terms a claim's ``why`` may name (``recompute`` also in ``computation``); the other
measures compute their own."""
SECTIONS = {"infinipipe": infinipipe, "table3": table3}
