"""A paper's claims as data, and the one place a row's verdict is made.

A paper's claims live in ``scripts/papers/NAME.toml`` beside the module that prices them
(``NAME.py``). The file is TOML: it is data a reader can check line by line against the paper
(no code runs when it is read, unlike a Python literal), it keeps integers and floats apart (a
published 896 stays an integer, 1.0 a float, as the table prints them), it nests a row's setting
(a list of models, a layout) where a CSV would need a language of its own, and its comments cite
the paper's words beside the rows (JSON has none). Python reads it with :mod:`tomllib`.

A file holds:

- ``paper``: the name the rows carry; ``text``: the document its ``L`` numbers are lines of;
- ``testbed``: the testbed a claim names when it names none;
- ``[testbeds.NAME]``: a shipped hardware profile (``profile``), the values the paper states
  over it (``overrides``) and where it states them (``source``);
- ``[tables.NAME]``: a table of the paper that the module reads as a whole (a layout per model,
  the model shapes the paper gives);
- ``[claims]``: one list per section (``SECTION = [...]``), a claim a line, in the order the
  rows are printed.

A claim is an inline table: ``measure`` (the module's function that prices it), ``what`` (the
row's text; ``{name}`` fields are filled from what the measure reports), ``source`` (the
paper's line), ``kind`` (the quantity: ``ratio``, ``share``, ``seconds``, ``GB``, ``K
tokens``), exactly one of ``value`` (a number the paper gives), ``product`` (numbers the paper
gives whose product is the claim: Table 3's all-to-all seconds are its end-to-end seconds
times its share), ``at_least`` or ``at_most`` (a bound: the number is in a figure only, or the
paper demonstrates a length without its maximum); optionally ``why`` (which term accounts for
a disagreement, by the module's name for it, where its measure has several), ``testbeds`` (the
file's ``testbed`` where none is named) and ``setting`` (the model, length, GPUs, layout,
workload or cells the measure reads).

A document that is not a paper (a project's example README with a table of its own) is a
"paper" here too: its ``text`` names the document, and ``source`` a line of it.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import tomllib
from pathlib import Path
from typing import Any

from longctx.hardware import HardwareProfile, load_profile

HERE = Path(__file__).resolve().parent
BAND = 0.15
"""A row agrees when simulated / published is within this of 1 (a bound row: when the simulated
number is on the bound's side); a row that does not is accounted for when its computed term,
priced in, brings it within the same band (a bound row: onto the bound's side). A bound row
neither agreeing nor accounted for is near when it misses the bound by at most this of it."""
VERDICTS = ("agrees", "accounted", "near", "open")
"""The verdicts, in the order :func:`verdict` tries them."""
FORMS = ("value", "product", "at_least", "at_most")
"""The keys of which a claim holds exactly one: what the paper states."""
KINDS = ("ratio", "share", "seconds", "GB", "K tokens")
"""The quantities a claim states (its ``kind``)."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One row of a paper's table (the fields are the data file's, see the module)."""

    paper: str
    section: str
    measure: str
    what: str
    source: str
    kind: str
    testbeds: tuple[str, ...]
    published: float | None = None
    """The number the paper gives (``None`` for a bound)."""
    bound: tuple[str, float] | None = None
    """``("<=", x)`` or ``(">=", x)`` for a bound."""
    why: str | None = None
    setting: dict = dataclasses.field(default_factory=dict)

    @property
    def profile(self) -> str:
        """The row's profile column: its testbeds' names."""
        return ", ".join(self.testbeds)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a measure found for a claim: the simulated number (``None`` where nothing fits),
    the row's why (:func:`term`; kept only where the row disagrees), the values that fill the
    claim's ``what`` and the detail kept beside the row."""

    simulated: float | None
    why: dict | None = None
    fields: dict = dataclasses.field(default_factory=dict)
    detail: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Paper:
    """A paper's data file, read."""

    name: str
    text: str
    default_testbed: str
    testbeds: dict[str, dict]
    tables: dict[str, Any]
    sections: dict[str, tuple[Claim, ...]]

    def testbed(self, name: str) -> HardwareProfile:
        """The shipped profile of testbed ``name`` with the values the paper states."""
        bed = self.testbeds[name]
        profile = load_profile(bed["profile"])
        notes = dict(profile.notes, testbed=bed["source"])
        return dataclasses.replace(profile, name=name, notes=notes, **bed["overrides"])


def claim(paper: str, section: str, default_testbed: str, entry: dict) -> Claim:
    """One claim from its inline table, checked: a clear error names the row and what to fix."""
    where = f"{paper} {section}: {entry.get('what', entry)!r}"
    forms = [key for key in FORMS if key in entry]
    if len(forms) != 1:
        raise ValueError(f"{where}: give exactly one of {', '.join(FORMS)} (found {forms})")
    known = {"measure", "what", "source", "kind", "why", "testbeds", "setting", *FORMS}
    missing = {"measure", "what", "source", "kind"} - set(entry)
    if missing or set(entry) - known:
        raise ValueError(f"{where}: needs {sorted(missing)} and takes only {sorted(known)} "
                         f"(unknown: {sorted(set(entry) - known)})")
    if entry["kind"] not in KINDS:
        raise ValueError(f"{where}: kind {entry['kind']!r} is not one of {KINDS}")
    form, number = forms[0], entry[forms[0]]
    return Claim(paper=paper, section=section, measure=entry["measure"], what=entry["what"],
                 source=entry["source"], kind=entry["kind"],
                 testbeds=tuple(entry.get("testbeds", [default_testbed])),
                 published=number if form == "value" else
                 math.prod(number) if form == "product" else None,
                 bound={"at_least": (">=", number), "at_most": ("<=", number)}.get(form),
                 why=entry.get("why"), setting=entry.get("setting", {}))


def load(name: str, folder: Path = HERE) -> Paper:
    """``folder/NAME.toml`` read into a :class:`Paper`."""
    with open(folder / f"{name}.toml", "rb") as handle:
        data = tomllib.load(handle)
    sections = {section: tuple(claim(data["paper"], section, data["testbed"], entry)
                               for entry in entries)
                for section, entries in data["claims"].items()}
    for section, claims in sections.items():
        for found in claims:
            unknown = set(found.testbeds) - set(data["testbeds"])
            if unknown:
                raise ValueError(f"{name}.toml {section}: {found.what!r} names testbeds "
                                 f"{sorted(unknown)}; the file has {sorted(data['testbeds'])}")
    return Paper(name=data["paper"], text=data["text"], default_testbed=data["testbed"],
                 testbeds=data["testbeds"],
                 tables=data.get("tables", {}), sections=sections)


# -- verdicts -----------------------------------------------------------------------------------

def term(name: str, size: float, unit: str, simulated_with: float | None, source: str) -> dict:
    """Why a row differs: the named term (or setting) the simulation leaves out or holds
    otherwise, its computed ``size`` in ``unit``, and the row's simulated number with it priced
    in (``None`` where it cannot be priced: the row stays open)."""
    return {"name": name, "size": size, "unit": unit, "simulated_with": simulated_with,
            "source": source}


def within(value: float | None, published: float) -> bool:
    return value is not None and abs(value / published - 1) <= BAND


def on_side(value: float | None, op: str, bound: float, slack: float = 0.0) -> bool:
    """``value`` is on the side ``op`` of ``bound`` (the bound itself included), or misses it
    by at most ``slack`` of it."""
    if value is None:
        return False
    return value <= bound * (1 + slack) if op == "<=" else value >= bound * (1 - slack)


def verdict(agrees: bool, why: dict | None, accounts: bool, near: bool = False) -> str:
    """``agrees``; else ``accounted`` where the row's why, priced in, agrees; else ``near``
    where ``near`` is given (a bound row missing its bound by at most :data:`BAND`); else
    ``open``."""
    if agrees:
        return "agrees"
    if why is not None and accounts:
        return "accounted"
    return "near" if near else "open"


def row(paper: str, what: str, published: float, simulated: float | None, profile: str,
        why: dict | None = None, **detail) -> dict:
    """A row with a published number; ``why`` (:func:`term`) is kept only where the row
    disagrees."""
    ratio = None if simulated is None or not published else simulated / published
    agrees = within(simulated, published)
    why = None if agrees else why
    accounts = why is not None and within(why["simulated_with"], published)
    return {"paper": paper, "what": what, "published": published, "simulated": simulated,
            "simulated_over_published": ratio, "profile": profile,
            "verdict": verdict(agrees, why, accounts), "why": why, **detail}


def bound_row(paper: str, what: str, bound: tuple[str, float], simulated: float, profile: str,
              why: dict | None = None, **detail) -> dict:
    """A row whose paper states a bound: ``bound`` is ``("<=", x)`` or ``(">=", x)``. It has
    no ratio; it agrees only on the bound's side, and a row that misses it by at most
    :data:`BAND` of it, with no term bringing it onto that side, is ``near``."""
    op, value = bound
    agrees = on_side(simulated, op, value)
    why = None if agrees else why
    accounts = why is not None and on_side(why["simulated_with"], op, value)
    near = on_side(simulated, op, value, BAND)
    return {"paper": paper, "what": what, "published": None,
            "published_bound": f"{op} {value:g}", "simulated": simulated,
            "simulated_over_published": None, "profile": profile,
            "verdict": verdict(agrees, why, accounts, near), "why": why, **detail}


def judge(found: Claim, measured: Measured) -> dict:
    """The row of claim ``found`` with what its measure found."""
    what = found.what.format(**measured.fields)
    if found.bound is not None:
        return bound_row(found.paper, what, found.bound, measured.simulated, found.profile,
                         measured.why, **measured.detail)
    return row(found.paper, what, found.published, measured.simulated, found.profile,
               measured.why, **measured.detail)


def judged(claims: tuple[Claim, ...], measures: dict, state: Any,
           whys: frozenset[str] = frozenset()) -> list[dict]:
    """Every claim's row, priced by ``measures[claim.measure](claim, state)``; a claim naming a
    measure or a why (of ``whys``) that the module does not have is refused before any is
    priced."""
    for found in claims:
        if found.measure not in measures:
            raise ValueError(f"{found.paper}: {found.what!r} names measure {found.measure!r}; "
                             f"the module prices {sorted(measures)}")
        if found.why is not None and found.why not in whys:
            raise ValueError(f"{found.paper}: {found.what!r} names why {found.why!r}; the "
                             f"module's terms are {sorted(whys)}")
    return [judge(found, measures[found.measure](found, state)) for found in claims]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What a run of the table may change: InfiniPipe's documents a batch (where a claim names
    none), the seeds its cells average over and the folder keeping its batches' numbers."""

    documents: int = 512
    seeds: tuple[int, ...] = tuple(range(20))
    cache: str | None = None


def summary(rows: list[dict]) -> dict:
    """How the rows with a ratio stand: their count, the median of |simulated / published - 1|,
    how many are within :data:`BAND`; and the rows of each verdict (:data:`VERDICTS`)."""
    off = [abs(r["simulated_over_published"] - 1) for r in rows
           if r["simulated_over_published"] is not None]
    verdicts = {name: sum(r["verdict"] == name for r in rows) for name in VERDICTS}
    return {"rows": len(rows), "ratios": len(off),
            "median_abs_off": statistics.median(off) if off else None,
            "within_band": sum(x <= BAND for x in off), "band": BAND, "verdicts": verdicts}
