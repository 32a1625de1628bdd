"""The verdicts of ``scripts/gpu_check.sh``: each step's log read and judged on numbers.

Pure (no torch, no GPU): ``tests/unit/test_gpu_verdicts.py`` feeds it recorded log snippets.

A verdict is one line, ``PASS``, ``FAIL`` or ``SKIP``, a key, and what was measured:

* ``train/<schedule>/pp<P>/<dtype>``: the run exited 0 and logged a finite ``lm loss`` at every
  one of its iterations; for bf16 and fp16 every iteration's loss lies within :data:`BANDS` of
  the fp32 run's at the same iteration (same schedule, same PP: the same initial weights and
  documents); for fp16 Megatron-LM's loss scaler skipped no iteration (``number of skipped
  iterations`` 0 at every logged iteration: the initial loss scale lets it apply its updates).
* ``golden/<schedule>/pp<P>[tp2]/fp32``: every golden test of the layouts of that schedule and
  layout passed (:func:`golden_key` reads the layout from its tag); one ``golden/test/...``
  line per failed test, naming it.
* ``unit``: the unit tests' counts; one ``unit/<test id>`` line per failed test, naming it.
* ``step/<name>``: a step that ran past its time limit or exited without its result file.

The report's first lines say the commit and device (:func:`report`).
"""
from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass

#: Largest relative difference per iteration from the fp32 run's loss. bf16 keeps 8 bits of
#: mantissa (relative rounding 2^-8 ~ 4e-3 per element, far less on a mean over thousands of
#: tokens); fp16 keeps 11 bits. A skipped or wrong update moves the tiny model's loss by about
#: 1e-2 over the six iterations at the check's learning rate, outside both bands.
BANDS = {"bf16": 5e-3, "fp16": 2e-3}
LOSS = re.compile(r"lm loss: ([0-9.eE+-]+|nan|inf)", re.IGNORECASE)
SKIPPED = re.compile(r"number of skipped iterations: +(\d+)")


@dataclass(frozen=True)
class Verdict:
    outcome: str  # PASS, FAIL or SKIP
    key: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.outcome:<5} {self.key}" + (f"  {self.detail}" if self.detail else "")


def parse_line(line: str) -> Verdict | None:
    """A report line back into its verdict (``None`` for a header or blank line)."""
    match = re.match(r"(PASS|FAIL|SKIP) +(\S+)(?:  (.*))?$", line.rstrip("\n"))
    return Verdict(*match.groups(default="")) if match else None


def losses(log: str) -> list[float]:
    """Every ``lm loss`` Megatron-LM logged, in order."""
    return [float(value) for value in LOSS.findall(log)]


def skipped(log: str) -> list[int]:
    """Megatron-LM's ``number of skipped iterations`` at every logged iteration."""
    return [int(value) for value in SKIPPED.findall(log)]


def _relative(got: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, reference))


def training(key: str, log: str, returncode: int, iterations: int,
             fp32_log: str | None = None, dtype: str = "fp32") -> Verdict:
    """The verdict of one training run (module doc)."""
    if returncode != 0:
        return Verdict("FAIL", key, f"exit code {returncode}")
    notes = []
    if dtype == "fp16":
        skips = skipped(log)
        if len(skips) != iterations or any(skips):
            return Verdict("FAIL", key, f"fp16 skipped iterations per logged iteration: {skips} "
                                        f"(every update must be applied)")
        notes.append("0 skipped iterations")
    got = losses(log)
    if len(got) != iterations:
        return Verdict("FAIL", key, f"{len(got)} losses logged, {iterations} iterations asked")
    if not all(math.isfinite(value) for value in got):
        return Verdict("FAIL", key, f"non-finite loss: {got}")
    if dtype == "fp32":
        return Verdict("PASS", key, f"{iterations} finite losses, first {got[0]:.6f} last "
                                    f"{got[-1]:.6f}")
    if fp32_log is None:
        return Verdict("FAIL", key, "no fp32 run to compare with")
    reference = losses(fp32_log)
    if len(reference) != iterations:
        return Verdict("FAIL", key, f"the fp32 run logged {len(reference)} losses")
    worst = _relative(got, reference)
    band = BANDS[dtype]
    outcome = "PASS" if worst <= band else "FAIL"
    return Verdict(outcome, key, ", ".join(
        [f"losses within {band:.0e} of fp32 (largest relative difference {worst:.1e})", *notes]))


#: Words of a golden layout's tag -> its schedule (the first found, in this order).
_SCHEDULE_WORDS = (("mux", "sppo-multiplex"), ("sppo", "sppo"), ("helix", "helix"),
                   ("seq1f1b", "seq1f1b"), ("elastic", "elastic"), ("ir", "1f1b-ir"),
                   ("interleaved", "interleaved"))


def golden_key(tag: str) -> str:
    """``golden/<schedule>/pp<P>[tp2]/fp32`` of a golden layout's tag (``pp4_sppo_mux_n5``:
    ``golden/sppo-multiplex/pp4/fp32``); Megatron's 1F1B where no schedule word appears."""
    words = tag.split("_")
    schedule = next((name for word, name in _SCHEDULE_WORDS if word in words), "1f1b")
    pp = next((word for word in words if re.fullmatch(r"pp\d+", word)), "pp1")
    tp = "tp2" if "tp2" in words else ""
    return f"golden/{schedule}/{pp}{tp}/fp32"


def junit_cases(xml: str) -> list[tuple[str, str, str]]:
    """``(test id, outcome, message)`` of every test case of a pytest JUnit XML report;
    outcome ``passed``, ``failed`` (failures and errors) or ``skipped``."""
    cases = []
    for case in ElementTree.fromstring(xml).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test_id = f"{path}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "").splitlines()[:1]
                message = message[0] if message else child.tag
                break
            if child.tag == "skipped":
                outcome = "skipped"
        cases.append((test_id, outcome, message))
    return cases


def _tag(test_id: str) -> str | None:
    match = re.search(r"\[(?:[^\]-]*-)?([^\]]+)\]$", test_id)
    return match.group(1) if match else None


def golden(xml: str) -> list[Verdict]:
    """One verdict per golden layout key (every test naming one of its tags passed), then one
    per failed test; tests of no single layout count only when they fail."""
    verdicts, keys = [], {}
    for test_id, outcome, message in junit_cases(xml):
        tag = _tag(test_id)
        if outcome == "failed":
            verdicts.append(Verdict("FAIL", "golden/test/" + test_id.split("::")[-1], message))
        if tag is None or outcome == "skipped":
            continue
        keys.setdefault(golden_key(tag), []).append((tag, outcome))
    for key, results in sorted(keys.items()):
        tags = sorted({tag for tag, _ in results})
        failed = sorted({tag for tag, outcome in results if outcome == "failed"})
        outcome = "FAIL" if failed else "PASS"
        detail = (f"failed: {', '.join(failed)}" if failed else
                  f"{len(results)} test(s) of {', '.join(tags)} passed")
        verdicts.append(Verdict(outcome, key, detail))
    return sorted(verdicts, key=lambda v: (v.key.startswith("golden/test/"), v.key))


def unit(xml: str) -> list[Verdict]:
    """``unit`` with the counts, then one line per failed test, named."""
    cases = junit_cases(xml)
    failed = [(test_id, message) for test_id, outcome, message in cases if outcome == "failed"]
    counts = {outcome: sum(1 for _, o, _ in cases if o == outcome)
              for outcome in ("passed", "failed", "skipped")}
    summary = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    return [Verdict("FAIL" if failed or not cases else "PASS", "unit", summary),
            *(Verdict("FAIL", f"unit/{test_id}", message) for test_id, message in failed)]


def report(commit: str, device: str, verdicts: list[Verdict]) -> str:
    """The report file's text: the commit and device, one line per verdict, the counts."""
    counts = {outcome: sum(v.outcome == outcome for v in verdicts)
              for outcome in ("PASS", "FAIL", "SKIP")}
    lines = [f"commit {commit}", f"device {device}",
             *(verdict.line() for verdict in verdicts),
             "summary " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items())]
    return "\n".join(lines) + "\n"
