"""Adaptive offload ratios and SPPO's two-level activation management.

Two levels. What a stage keeps for subsequence ``i`` between its forward and its backward
(:meth:`elastic_pipe.cost_model.CostModel.stash_bytes`, no checkpointing) splits into

- the *resident* tier, never offloaded: every layer's K and V (``4h / tp`` bytes a token; the
  forward and the backward of every later subsequence read them) and, for every subsequence
  but the last, the dK/dV accumulator (``4h / tp``; every later backward adds into it). Both
  are touched once per later subsequence, so moving them would cost a round trip per use;
- the *offloadable* tier ``A_i``: everything else (the inputs of the LayerNorms and GEMMs, Q,
  the attention output and softmax statistics, the MLP activations, dropout masks and, on the
  last stage, the logits). Each is read once, by the subsequence's own backward.

Ratios. The offload of subsequence ``i`` overlaps the forward of ``i + 1``
(:mod:`sppo_offload.pipeline`); with FLOPs-balanced subsequences every forward on a stage
takes about ``T = (forward time of the whole sequence on the stage) / N``, so the bytes that a
copy hides behind one forward are ``M_threshold = B_d2h x T`` and

    alpha_i = clip(M_threshold / A_i, 0, 1)        (alpha_i x A_i = M_threshold)

per stage (stages differ in layers, and the last stage adds the output layer). Earlier
subsequences are longer (larger ``A_i``) and get smaller ratios. The last subsequence is never
offloaded: its backward follows its forward at once, so a copy would only add a round trip.
The reload of ``i`` overlaps the backward of ``i + 1``, which takes ``backward_factor`` times
as long as a forward, so with equal link speeds in both directions a reload that hides its
offload hides too.

``--sppo-offload``: ``auto`` (the formula), ``off`` (nothing offloaded), or a ``RATIO`` in
``[0, 1]`` used for every subsequence but the last (the copies may then be exposed; the
simulator prices that).
"""
from __future__ import annotations

from typing import Sequence

from elastic_pipe.chunks import Chunk
from elastic_pipe.cost_model import GB, CostModel

AUTO, OFF = "auto", "off"


def parse_offload(text: str) -> str | float:
    """``"auto"``, ``"off"`` or a ratio in ``[0, 1]`` from the ``--sppo-offload`` value."""
    if text in (AUTO, OFF):
        return text
    try:
        ratio = float(text)
    except ValueError:
        raise ValueError(f"--sppo-offload takes auto, off or a ratio in [0, 1], got "
                         f"{text!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--sppo-offload ratio must be in [0, 1], got {ratio}")
    return ratio


def resident_bytes(cost: CostModel, stage: int, chunk: Chunk) -> float:
    """Bytes of ``chunk`` that stay on ``stage``'s device: K/V and the dK/dV accumulator."""
    per_token = sum(p.tokens * (cost.kv_per_token + (0.0 if p.final else cost.dkv_per_token))
                    for p in chunk.pieces)
    return cost.layers(stage) * per_token


def offloadable_bytes(cost: CostModel, stage: int, chunk: Chunk) -> float:
    """``A_i``: the bytes of ``chunk`` on ``stage`` that the offload ratio applies to."""
    return cost.stash_bytes(stage, chunk) - resident_bytes(cost, stage, chunk)


def threshold_bytes(cost: CostModel, stage: int, chunks: Sequence[Chunk],
                    host_gbps: float) -> float:
    """``M_threshold``: bytes the device-to-host link moves during one balanced forward."""
    forward = sum(cost.stage_forward(stage, chunk) for chunk in chunks) / len(chunks)
    return host_gbps * GB * forward


def offload_ratios(cost: CostModel, chunks: Sequence[Chunk], mode: str | float,
                   host_gbps: float | None) -> tuple[tuple[float, ...], ...]:
    """``alpha[stage][i]`` for the subsequences ``chunks`` of one sequence (see module doc)."""
    last = len(chunks) - 1
    if mode == OFF:
        return tuple((0.0,) * len(chunks) for _ in range(cost.pp))
    if mode != AUTO:
        ratio = parse_offload(str(mode))
        return tuple(tuple(ratio if i < last else 0.0 for i in range(len(chunks)))
                     for _ in range(cost.pp))
    if host_gbps is None:
        raise ValueError(f"profile {cost.hardware.name} has no host_link_gbps; add the "
                         f"host<->device bandwidth to it or use --sppo-offload off|RATIO")
    rows: dict[tuple, tuple[float, ...]] = {}
    for stage in range(cost.pp):
        kind = stage_kind(cost, stage)
        if kind not in rows:
            threshold = threshold_bytes(cost, stage, chunks, host_gbps)
            sizes = [offloadable_bytes(cost, stage, chunk) for chunk in chunks]
            rows[kind] = tuple(0.0 if i == last or size <= 0 else min(1.0, threshold / size)
                               for i, size in enumerate(sizes))
    return tuple(rows[stage_kind(cost, stage)] for stage in range(cost.pp))


def stage_kind(cost: CostModel, stage: int) -> tuple[int, bool, bool]:
    """What a stage's costs depend on: its layer count, and whether it holds the embedding
    (first) or the output layer (last). Stages of one kind cost the same."""
    return cost.layers(stage), stage == 0, stage == cost.pp - 1


def raised(alphas: tuple[tuple[float, ...], ...], step: float) -> tuple[tuple[float, ...], ...]:
    """``alphas`` moved a fraction ``step`` of the way to 1 (the last subsequence stays 0):
    what the solver tries when the bandwidth-hidden ratios do not fit the budget."""
    return tuple(tuple(a if i == len(row) - 1 else a + step * (1.0 - a)
                       for i, a in enumerate(row)) for row in alphas)
