"""Refitting the cost model to a training run's measured action times
(``--elastic-refit-interval``, :mod:`elastic_pipe.run_costs` says when).

The executor times the forwards and backwards it runs. When a refit is due in a run of
``elastic`` or ``seq1f1b`` the ranks pool those times (:func:`observations`, gathered from
every rank so that all of them fit the same figures and keep planning identically) and
:func:`refit` replaces the profile's eq. 1 coefficients and backward factor with a fit to them.

Model of one stage forward of chunk ``c`` on stage ``s`` with ``L_s`` layers, after the cost
model's own figures for the collectives and for the work outside the layers (embedding on the
first stage, head on the last: :meth:`CostModel.end_forward`, measured or FLOP-derived) and
the profile's host time of an action outside its layers (``host_action_s``, which the cost
model adds to every stage forward and backward) are subtracted, so that none is counted
twice::

    t = L_s (alpha1 Q_c + alpha2 S_c + beta)

``Q_c = sum over pieces ((C + s)^2 - C^2)`` and ``S_c`` its tokens. The ends are not refitted:
with two stages every stage is an end, and a per-token end term would be indistinguishable
from ``alpha2`` (the columns are collinear), so the profile's figures are kept. The fit
minimises relative residuals with exact non-negative least squares, as
``scripts/profile_costs.py`` does on its grid. The backward factor is the ratio of all
measured backwards (less their collectives and ends) to their forwards' fitted layer times
(recomputation is its own action and is in neither).

Choices: the stages' layers are assumed alike (one set of coefficients, as eq. 1 has); a fit
needs at least four distinct chunk shapes, otherwise the profile is kept and the reason
logged; a fit that fails the acceptance criteria below is rejected the same way; the refitted
profile is marked ``"measured"`` with a note saying where it came from;
each refit uses only the iterations since the previous one (the model follows the machine);
the executor waits for the device around each timed action (CUDA launches are asynchronous).
The host terms are the profile's, not refitted: the layers' host time is inside the measured
times and lands in the fitted coefficients (mostly ``beta``), where the cost model's
``max(host, device)`` does not count it again; so does an action's fixed time beyond the
profile's ``host_action_s`` (a spec-derived profile prices none), as ``L_s beta`` per unit on
stage ``s``: a unit's price then carries what the machine paid for it, which is what the
planners' choice of a unit count needs (with the same layer count on every stage, and always
at PP = 1, a per-action term and ``L_s beta`` cannot be told apart;
``tests/unit/test_unit_fixed_cost.py`` recovers a 50 ms per action cost this way). The fit
extrapolates: from large chunks alone the per-chunk constant ``beta`` is not pinned down (it
may come out 0), the planner may then cut finer than it should for one interval, and the next
refit, which sees those small chunks, corrects it.

Acceptance (a refit that fails one keeps the profile and says which; measured times that a
loaded machine or a stall distorts must not price the plans):

- every measured forward and backward is longer than the figures taken out of it (otherwise
  the profile's collectives, ends or host time do not describe this machine, and a remainder
  near 0 would dominate a fit to relative residuals and the backward factor's ratio);
- ``alpha1`` or ``alpha2`` is positive (forwards that do not grow with the chunk give a cost
  model in which no chunk costs more than another, which the profile refuses);
- the fit's mean relative error is at most :data:`MAX_MEAN_ERROR` (0.3), and every chunk
  shape is priced within a factor :data:`MAX_SHAPE_RATIO` (2) of its measured forwards (the
  median over the shape's measurements of price / measured time, so that one stalled action, a
  first allocation or a collection, does not reject a fit that prices every shape well; a
  single action's error is reported, not bounded);
- the backward factor is within :data:`BACKWARD_FACTOR_RANGE` ([0.5, 6]): a backward computes
  the input and the weight gradients, about twice the forward's FLOPs (attention's about 2.5
  times); below 1 only where the forward's Python, not the device, sets its time, which a small
  model on a GPU can show.

The bounds come from the committed refits, all on CPU (no GPU refit log is committed): on a
2-core machine shared with other jobs (``benchmarks/results/bench_schedules_*.txt``) the fits'
mean errors were 0.05, 0.11, 0.24 and 0.29 (accepted) and 0.35 to 0.58 (rejected: load
averages up to 160, under which ``benchmarks/results/README.md`` finds the refitted
predictions far from the measured times), their backward factors 1.5 to 5.6. A CUDA run
times each action with the device waited for, which a shared CPU does not give, so its fits
should be at least as close; a bound it fails is logged with the fit's figures.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from longctx.chunks import Chunk
from longctx.cost_model import CostModel
from longctx.fitting import nnls
from longctx.hardware import HardwareProfile, LayerCoefficients

MIN_SHAPES = 4
"""Distinct chunk shapes ``(Q, S)`` a refit needs (stages alone do not tell eq. 1's terms
apart: they only scale all three by the stage's layer count)."""
MAX_MEAN_ERROR = 0.3
"""Largest mean relative error of an accepted fit (module doc)."""
MAX_SHAPE_RATIO = 2.0
"""Largest factor, either way, between an accepted fit's price of a chunk shape and its
measured forwards (the median over the shape's measurements; module doc)."""
BACKWARD_FACTOR_RANGE = (0.5, 6.0)
"""Backward factors an accepted fit may have (module doc)."""


@dataclass(frozen=True)
class Observation:
    """One measured forward and backward of a chunk on a stage."""

    stage: int
    quadratic: float
    """``Q``: sum over the chunk's pieces of ``(C + s)^2 - C^2``."""
    tokens: int
    forward_s: float
    backward_s: float


def chunk_terms(chunk: Chunk) -> tuple[float, int]:
    """``(Q, S)`` of eq. 1 for ``chunk``."""
    quadratic = sum((p.context + p.tokens) ** 2 - p.context ** 2 for p in chunk.pieces)
    return float(quadratic), chunk.tokens


def observations(stage: int, chunks: Sequence[Chunk], times: dict[int, tuple[float, float]]
                 ) -> list[Observation]:
    """This stage's observations from ``times``: ``{unit: (forward s, backward s)}``."""
    found = []
    for unit, (forward, backward) in sorted(times.items()):
        quadratic, tokens = chunk_terms(chunks[unit])
        found.append(Observation(stage, quadratic, tokens, forward, backward))
    return found


def refit(cost: CostModel, seen: Iterable[Observation]) -> tuple[HardwareProfile | None, str]:
    """``(refitted profile, summary)``, or ``(None, why not)`` when the data cannot pin eq. 1
    down or the fit fails the acceptance criteria (module doc). Never raises for the data:
    the same observations give every rank the same answer."""
    seen = [o for o in seen if o.forward_s > 0 and o.backward_s > 0]
    shapes = {(o.quadratic, o.tokens) for o in seen}
    if len(shapes) < MIN_SHAPES:
        return None, (f"refit skipped: {len(shapes)} distinct chunk shapes measured, "
                      f"{MIN_SHAPES} needed")
    rows, forward, backward = [], [], []
    for o in seen:
        layers = cost.layers(o.stage)
        rows.append([layers * o.quadratic, layers * o.tokens, layers])
        outside = layers * (cost.comm_per_token * o.tokens + cost.comm_latency) \
            + cost.host_action
        forward.append(o.forward_s - outside - cost.end_forward(o.stage, o.tokens))
        backward.append(o.backward_s - outside - cost.end_backward(o.stage, o.tokens))
    a, y, backward = np.asarray(rows), np.asarray(forward), np.asarray(backward)
    short = int(np.sum(y <= 0)) + int(np.sum(backward <= 0))
    if short:
        return None, (f"refit rejected, profile kept: {short} of the {2 * len(seen)} measured "
                      f"forwards and backwards are no longer than the collectives, pipeline "
                      f"ends and host time the profile prices in them (its figures for those "
                      f"do not describe this machine)")
    x = nnls(a / y[:, None], np.ones_like(y))
    alpha1, alpha2, beta = (float(v) for v in x[:3])
    if alpha1 == alpha2 == 0:
        return None, (f"refit rejected, profile kept: the measured forwards do not grow with "
                      f"the chunks (alpha1 and alpha2 fit 0, beta {beta:.3e} s: no chunk would "
                      f"cost more than another)")
    ratios = a @ x / y
    error = np.abs(ratios - 1)
    backward_factor = float(np.sum(backward) / np.sum(a @ x))
    summary = (f"{len(seen)} measured chunks ({len(shapes)} shapes): alpha1 "
               f"{alpha1:.3e} s, alpha2 {alpha2:.3e} s, beta {beta:.3e} s, backward factor "
               f"{backward_factor:.3f}; fit relative error max {error.max():.3f} mean "
               f"{error.mean():.3f}")
    why = rejection(seen, ratios, backward_factor)
    if why:
        return None, f"refit rejected, profile kept: {why} (fit of {summary})"
    summary = f"refit from {summary}"
    old = cost.hardware
    coefficients = LayerCoefficients(alpha1, alpha2, beta, cost.model.hidden_size,
                                     cost.parallel.sp, cost.parallel.tp, cost.model.mlp_label)
    notes = dict(old.notes, layer_coefficients=summary,
                 backward_factor="refitted to the training run's measured backwards")
    return dataclasses.replace(old, source="measured", layer_coefficients=coefficients,
                               kernel_efficiency=None,  # the fit prices the chunk size
                               backward_factor=backward_factor, notes=notes), summary


def rejection(seen: Sequence[Observation], ratios: np.ndarray, backward_factor: float) -> str:
    """Why a fit with positive ``alpha1`` or ``alpha2`` fails the acceptance criteria (module
    doc), or ``""``. ``ratios``: the fit's price over each observation's measured forward, in
    ``seen``'s order (positive: every chunk has tokens)."""
    mean = float(np.mean(np.abs(ratios - 1)))
    if mean > MAX_MEAN_ERROR:
        return f"mean relative error {mean:.3f} above {MAX_MEAN_ERROR}"
    by_shape: dict[tuple[float, int], list[float]] = {}
    for o, ratio in zip(seen, ratios):
        by_shape.setdefault((o.quadratic, o.tokens), []).append(float(ratio))
    shape, ratio = max(((k, float(np.median(v))) for k, v in by_shape.items()),
                       key=lambda item: max(item[1], 1 / item[1]))
    if max(ratio, 1 / ratio) > MAX_SHAPE_RATIO:
        return (f"chunks of {shape[1]} tokens priced at {ratio:.2f} times their measured "
                f"forwards (median; a factor of at most {MAX_SHAPE_RATIO} accepted)")
    low, high = BACKWARD_FACTOR_RANGE
    if not low <= backward_factor <= high:
        return f"backward factor {backward_factor:.3g} outside [{low}, {high}]"
    return ""
