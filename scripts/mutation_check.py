"""Mutation check of the honoured cells' proofs: with an option's effect switched off in the
process under test, the test named as its proof must fail.

For each cell (option, schedule) of :func:`megatron.plugin.option_classes.cells` the proof
runs with ``LONGCTX_MUTATE=DEST=VALUE`` and ``tests/mutation`` first on ``PYTHONPATH``: that
folder's ``sitecustomize.py`` sets the option to ``VALUE`` right after Megatron-LM's parser
returns, in every process except the golden harness's initial weights and reference, which
keep it. ``VALUE`` is the option's no-effect value: :data:`NO_EFFECT`'s where Megatron's
default does something (dropout's 0.1), else the default the training script gives it.

* ``golden:TAG``: ``tests/distributed/test_golden_megatron.py`` with ``LONGCTX_GOLDEN_TAGS=TAG``
  (every test about that layout).
* ``PATH::TEST``: that test.
* ``PATH`` alone (a GPU check's script) is not run here.

Verdicts: ``caught`` (a test failed: their names are kept), ``caught (the run failed)`` (no
test failed but some errored, as every test of a golden layout does when its launch fails: the
first error's lines are kept), ``NOT CAUGHT`` (every
test passed), ``NOT CAUGHT (no-effect value)`` (the proof runs the option at ``VALUE`` itself:
there is no effect to remove, nothing is run), ``not run`` (a GPU script, or pytest collected
nothing). With ``--baseline`` the unmutated proof runs first; a proof that fails unmutated gets
``proof fails unmutated``.

Usage::

    python scripts/mutation_check.py hidden_dropout:1f1b swiglu:elastic   # named cells
    python scripts/mutation_check.py hidden_dropout:1f1b=golden:pp2_dropout_1f1b  # a new proof
    python scripts/mutation_check.py --dest swiglu                          # an option's cells
    python scripts/mutation_check.py --all                                  # the slow tier
    python scripts/mutation_check.py --all --shard 2/7                      # its 2nd seventh

Each cell's verdict is printed as it comes and merged into ``--out`` (JSON, one entry per
cell; default ``benchmarks/results/mutation_check.json``).
"""
import argparse
import datetime
import enum
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = os.path.join(REPO, "tests", "mutation")
GOLDEN = "tests/distributed/test_golden_megatron.py"
OUT = os.path.join(REPO, "benchmarks", "results", "mutation_check.json")

#: Options whose default is not their no-effect value: the value that removes the effect.
NO_EFFECT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


@functools.lru_cache(maxsize=1)
def _parser():
    """The training script's parser with the golden worker's flags that layouts pass."""
    from megatron.plugin import arguments

    parser = arguments.build_parser()
    for flag in ("--golden-docs", "--golden-eod-every", "--golden-aux-loss-coeff"):
        parser.add_argument(flag)
    parser.add_argument("--golden-keyed-dropout", action="store_true")
    return parser


@functools.lru_cache(maxsize=1)
def _golden_layouts() -> dict:
    """tag -> (ranks, the layout's whole command line)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from harness import TINY_MODEL

    spec = importlib.util.spec_from_file_location("golden_layouts", os.path.join(REPO, GOLDEN))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {tag: (ranks, [*TINY_MODEL, *model_flags, *flags])
            for model_flags, layouts in module.VARIANTS.values()
            for tag, (ranks, flags) in layouts.items()}


def no_effect_value(dest: str):
    """The value the mutation sets ``dest`` to (an enumeration's member by its name, which
    the hook turns back into the member)."""
    from megatron.plugin import arguments

    if dest in NO_EFFECT:
        return NO_EFFECT[dest]
    value = arguments.DEFAULTS.get(dest, _parser().get_default(dest))
    return value.name if isinstance(value, enum.Enum) else value


def proof_value(dest: str, proof: str):
    """The value a golden layout runs ``dest`` at (``None`` for other proofs: unknown)."""
    if not proof.startswith("golden:"):
        return None
    _, argv = _golden_layouts()[proof.removeprefix("golden:")]
    return getattr(_parser().parse_args(argv), dest)


def runs_at_no_effect(dest: str, proof: str) -> bool:
    """Whether ``proof`` is a golden layout that runs ``dest`` at :func:`no_effect_value`
    itself: a mutation could remove nothing, so it cannot fail (found without running it)."""
    return proof.startswith("golden:") and proof_value(dest, proof) == no_effect_value(dest)


def all_cells() -> list[tuple[str, str, str]]:
    from megatron.plugin import option_classes

    return option_classes.cells()


def select(names: list[str], dests: list[str], every: bool) -> list[tuple[str, str, str]]:
    cells = all_cells()
    if every:
        return cells
    by_name = {f"{dest}:{schedule}": (dest, schedule, proof) for dest, schedule, proof in cells}
    proposed = [name.partition("=") for name in names]
    unknown = [name for name, sep, _ in proposed if not sep and name not in by_name]
    if unknown:
        raise SystemExit(f"no honoured cell {unknown}: name cells as DEST:SCHEDULE, for "
                         f"instance swiglu:elastic (schedule '*' for every schedule), or "
                         f"DEST:SCHEDULE=PROOF for a proof not yet named")
    chosen = [(*name.split(":", 1), proof) if sep else by_name[name]
              for name, sep, proof in proposed]
    chosen += [cell for cell in cells if cell[0] in dests and cell not in chosen]
    if not chosen:
        raise SystemExit("name cells (DEST:SCHEDULE), --dest DEST or --all")
    return chosen


def shard(cells: list, spec: str) -> list:
    """The ``I``-th of ``N`` shares of ``cells`` (``spec`` ``I/N``, ``1 <= I <= N``): every
    ``N``-th cell from the ``I``-th, so that the shares of one cell list cover it once and the
    slow cells (each option's layouts come together) spread over them."""
    index, sep, count = spec.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        index = count = 0
    if not sep or not 1 <= index <= count:
        raise SystemExit(f"--shard {spec}: write I/N with 1 <= I <= N, for instance 2/7")
    return cells[index - 1::count]


def proof_command(proof: str) -> tuple[list[str], dict] | None:
    """The pytest command line and environment that run ``proof`` (``None``: a script)."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    if proof.startswith("golden:"):
        return [*pytest, GOLDEN], {"LONGCTX_GOLDEN_TAGS": proof.removeprefix("golden:")}
    if "::" not in proof:
        return None
    return [*pytest, proof], {}


def _outcome(output: str) -> dict:
    """The tests that failed, how many errored (a fixture that failed errors every test using
    it) and why: the exception lines of the first failure pytest printed (``E`` lines naming
    an error or an assertion), else its last ``E`` lines."""
    block = []
    for line in output.splitlines():
        if line.startswith("E "):
            block.append(line[1:].strip())
        elif block:
            break
    named = [line for line in block
             if re.search(r"\w+(Error|Exception|Refusals):|^assert|Mismatched", line)
             and "elastic/errors" not in line]
    return {"failed": re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE),
            "errors": len(re.findall(r"^ERROR \S+", output, flags=re.MULTILINE)),
            "why": (named or [line for line in block if line])[-6:]}


def run_proof(proof: str, mutation: str | None, timeout: float) -> dict:
    """Run ``proof`` (with ``LONGCTX_MUTATE=mutation`` when given): ``{"rc", "seconds",
    "failed", "errors", "why"}``."""
    command, env = proof_command(proof)
    env = dict(os.environ, **env, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (HOOK, REPO, os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("LONGCTX_MUTATE", None)
    if mutation is not None:
        env["LONGCTX_MUTATE"] = mutation
    start = time.monotonic()
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=timeout)
        rc, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        rc, output = "timeout", (expired.stdout or b"").decode(errors="replace")
    return {"rc": rc, "seconds": round(time.monotonic() - start, 1), **_outcome(output)}


def check(dest: str, schedule: str, proof: str, baseline: bool, timeout: float) -> dict:
    value = no_effect_value(dest)
    entry = {"dest": dest, "schedule": schedule, "proof": proof, "mutated_to": value,
             "date": datetime.date.today().isoformat()}
    if proof_command(proof) is None:
        return {**entry, "verdict": "not run", "why": "a GPU check's script"}
    if runs_at_no_effect(dest, proof):
        return {**entry, "verdict": "NOT CAUGHT (no-effect value)",
                "why": f"the proof runs {dest} at {value!r} itself"}
    if baseline:
        unmutated = run_proof(proof, None, timeout)
        if unmutated["rc"] != 0:
            return {**entry, "verdict": "proof fails unmutated", "baseline": unmutated}
    mutated = run_proof(proof, f"{dest}={json.dumps(value)}", timeout)
    if mutated["rc"] == 0:
        verdict = "NOT CAUGHT"
    elif mutated["rc"] == 1:
        verdict = "caught" if mutated["failed"] else "caught (the run failed)"
    elif mutated["rc"] == 5:
        verdict = "not run"
    else:
        verdict = f"error (rc {mutated['rc']})"
    return {**entry, "verdict": verdict, "run": mutated}


def save(entries: list[dict], path: str) -> None:
    merged = {}
    if os.path.exists(path):
        with open(path) as f:
            merged = {f"{e['dest']}:{e['schedule']}": e for e in json.load(f)["cells"]}
    merged.update({f"{e['dest']}:{e['schedule']}": e for e in entries})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"cells": [merged[key] for key in sorted(merged)]}, f, indent=1)
        f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="*",
                        help="DEST:SCHEDULE of honoured cells, or DEST:SCHEDULE=PROOF to check "
                             "a proof the cell does not name yet")
    parser.add_argument("--dest", action="append", default=[], help="every cell of DEST")
    parser.add_argument("--all", action="store_true", help="every honoured cell (slow tier)")
    parser.add_argument("--shard", metavar="I/N",
                        help="only the I-th of N shares of the cells selected (every N-th "
                             "from the I-th): the slow tier over N runs, merged into --out")
    parser.add_argument("--baseline", action="store_true",
                        help="run each proof unmutated first")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per proof run")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    entries = []
    chosen = select(args.cells, args.dest, args.all)
    if args.shard:
        chosen = shard(chosen, args.shard)
    for dest, schedule, proof in chosen:
        entry = check(dest, schedule, proof, args.baseline, args.timeout)
        entries.append(entry)
        run = entry.get("run", {})
        failed = [name.rpartition("::")[2] for name in run.get("failed", [])]
        detail = entry.get("why") or (f"{len(failed)} failed: {', '.join(failed[:3])}"
                                      if failed else " | ".join(run.get("why", [])[-2:]))
        print(f"{dest}:{schedule} {proof}: {entry['verdict']} {detail}".rstrip(), flush=True)
        save(entries, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
