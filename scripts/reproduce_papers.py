"""The papers' evaluation rows beside the project's simulated numbers (not a test).

    python scripts/reproduce_papers.py [--only infinipipe table3 helixpipe helix_figures sppo]
        [--json OUT] [--markdown OUT] [--seeds N] [--cache DIR] [--documents N]

Each paper's claims are data, ``scripts/papers/NAME.toml``: a claim a line, with its published
number or bound, the line of the paper's text, the kind of quantity and the setting (model,
length, GPUs, layout, workload). One module a paper (``scripts/papers/NAME.py``) maps a claim's
setting to the simulator call that prices it; :mod:`papers.claims` reads the files and gives
every row its verdict. This script runs the papers' sections and writes the table.

Every simulated number is the project's simulator with a spec-derived hardware profile (named in
each row; nothing here is measured). The papers' numbers are facts to compare with, not targets:
no constant is tuned to make a row agree. Each paper's testbed is the shipped profile of its GPU
with the network the paper states (each data file's ``testbeds`` cite the line of the paper's
text); what a paper does not state is the shipped profile's. Each row gives the published
number, the simulated one, simulated over published, and a verdict in the band
:data:`papers.claims.BAND` (15%): ``agrees`` (within it; a row whose paper states a bound -- a
number in a figure only, or a length it demonstrates -- has no ratio and agrees only on the
bound's side); otherwise its ``why``: the term (or setting) that differs, its computed size and
the simulated number with it priced in (:mod:`paper_terms`), ``accounted`` when that is within
the band (a bound row's: on the bound's side), else ``near`` for a bound row that misses its
bound by at most the band, and ``open`` otherwise. No row carries a hand-written label;
``tests/unit/test_reproduction_table.py`` reads the committed table and fails on a row that
drifts. A summary gives the median |simulated / published - 1| and the count within the band.

Sections (each paper module's docstring and data file say what its rows price):

- ``infinipipe``: InfiniPipe's Fig. 8-11, elastic against Seq1F1B, DeepSpeed-Ulysses,
  Megatron-LM and FlexSP on 32 A800s over seeded GitHub-like batches (``--seeds`` of them a
  cell, ``--documents`` each; the paper averages 20 iterations of 512 sequences, L347);
- ``table3``: InfiniPipe's Table 3, the all-to-all of GPT-13B under Ulysses SP 8-32;
- ``helixpipe``: HelixPipe's Fig. 8, helix against 1F1B and ZB1P on its H20 and A800 clusters;
- ``helix_figures``: HelixPipe's Fig. 4, 10 and 11 (recomputation without attention, memory);
- ``sppo``: SPPO's Fig. 10-12, SPPO against Megatron-LM at Table 4's layouts, and the longest
  sequences.
"""
from __future__ import annotations

import argparse
import sys

from _launch import write_json

from papers import helixpipe, infinipipe, sppo
from papers.claims import BAND, RunOptions, summary

PAPERS = (infinipipe, helixpipe, sppo)
"""The paper modules, each with its data (``PAPER``) and its ``SECTIONS``."""
SECTIONS = {name: section for paper in PAPERS for name, section in paper.SECTIONS.items()}


def explain(r: dict) -> str:
    """The why column: the verdict, and for a row that disagrees its computed term."""
    why = r["why"]
    if why is None:
        return r["verdict"]
    size = f"{why['size']:.3g} {why['unit']}"
    priced = "cannot be priced" if why["simulated_with"] is None else \
        f"with it {why['simulated_with']:.3g}"
    return f"{r['verdict']}: {why['name']}, {size}; {priced}"


def markdown(rows: list[dict]) -> str:
    lines = ["| paper | row | published | simulated | sim / pub | why |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        simulated = "-" if r["simulated"] is None else f"{r['simulated']:.3g}"
        ratio = "-" if r["simulated_over_published"] is None else \
            f"{r['simulated_over_published']:.2f}"
        published = r.get("published_bound") or f"{r['published']:.3g}"
        lines.append(f"| {r['paper']} | {r['what']} | {published} | {simulated} | "
                     f"{ratio} | {explain(r)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--documents", type=int, default=512,
                        help="documents a global batch (InfiniPipe: 512 sequences, L347)")
    parser.add_argument("--seeds", type=int, default=20,
                        help="batches (seeds 0..N-1) each InfiniPipe cell averages over (the "
                             "paper averages 20 iterations, L347)")
    parser.add_argument("--cache", help="a folder keeping each InfiniPipe batch's numbers, to "
                        "resume a long run (empty it after a change to the planners or pricing)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    print("SIMULATED with spec-derived profiles and each paper's stated network; not measured")
    run = RunOptions(args.documents, tuple(range(args.seeds)), args.cache)
    rows = []
    for name in args.only:
        made = SECTIONS[name](run)
        rows += made
        print(markdown(made), end="", flush=True)
    stand = summary(rows)
    if stand["ratios"]:
        print(f"{stand['ratios']} rows with a ratio; median |simulated / published - 1| "
              f"{stand['median_abs_off']:.3f}, within {BAND:.0%}: {stand['within_band']}; "
              f"verdicts {stand['verdicts']}")
    if args.json:
        testbeds = {name: bed for paper in PAPERS for name, bed in paper.PAPER.testbeds.items()}
        write_json(args.json, {"simulated": True, "testbeds": testbeds, "summary": stand,
                               "rows": rows})
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
