"""Adaptive offload ratios and SPPO's two-level activation management.

Two levels. What a stage keeps for subsequence ``i`` between its forward and its backward
(:meth:`longctx.cost_model.CostModel.stash_bytes`, no checkpointing) splits into

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

Host-memory cap (:func:`capped`). At the turn from forwards to backwards every offloaded
subsequence of a stage is in host memory at once, so a stage's host bytes are
``sum_i alpha_i x A_i``. Under a cap the ``auto`` ratios are lowered *largest first*
(water-filling): every subsequence moves ``min(alpha_i x A_i, L)`` bytes, with the level ``L``
chosen so that the sum meets the cap. Any lowering puts the same bytes back on the device in
all, but the copies that exceed the hidden ``M_threshold`` (the raised ratios) are the large
ones, so cutting them first removes exposed copy time first, and the hidden copies of the
shorter subsequences are kept. A fixed ``RATIO`` is never lowered: it is what the flag asks to
move, and a cap that cannot hold it is an error that names the host memory it needs.
"""
from __future__ import annotations

import math
from typing import Sequence

from longctx.chunks import Chunk
from longctx.cost_model import GB, CostModel

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
    """``M_threshold``: device bytes the device-to-host link frees during one balanced forward
    (it moves live bytes; the allocator's overhead on them is freed with them)."""
    forward = sum(cost.stage_forward(stage, chunk) for chunk in chunks) / len(chunks)
    return host_gbps * GB * forward * cost.allocator


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


def capped(ratios: Sequence[float], sizes: Sequence[float], cap_bytes: float) -> tuple[float, ...]:
    """One stage's ``ratios`` lowered largest first so that the bytes they move,
    ``sum(ratio x size)`` over the subsequences of ``sizes`` offloadable bytes, stay within
    ``cap_bytes`` (module doc); unchanged when they fit. The level is a whole number of bytes
    rounded down, less one, so that the moved bytes stay within the cap after floating-point
    rounding."""
    moved = [r * s for r, s in zip(ratios, sizes)]
    if math.fsum(moved) <= cap_bytes:
        return tuple(ratios)
    level = max(0.0, math.floor(_level(moved, cap_bytes)) - 1.0)
    return tuple(r if r * s <= level else level / s for r, s in zip(ratios, sizes))


def capped_ratios(cost: CostModel, chunks: Sequence[Chunk], alphas: tuple[tuple[float, ...], ...],
                  cap_bytes: float) -> tuple[tuple[float, ...], ...]:
    """:func:`capped` on every stage of ``cost``'s layout for the subsequences ``chunks``."""
    rows: dict[tuple, tuple[float, ...]] = {}
    result = []
    for stage, row in enumerate(alphas):
        key = (stage_kind(cost, stage), row)
        if key not in rows:  # the host holds live bytes: the allocator's overhead stays
            sizes = [offloadable_bytes(cost, stage, chunk) / cost.allocator for chunk in chunks]
            rows[key] = capped(row, sizes, cap_bytes)
        result.append(rows[key])
    return tuple(result)


def host_bytes(cost: CostModel, chunks: Sequence[Chunk],
               alphas: tuple[tuple[float, ...], ...]) -> tuple[float, ...]:
    """Bytes each stage moves to host memory for the subsequences ``chunks`` of one sequence:
    all of them are there at once, at the turn from forwards to backwards. Live bytes: the
    device bytes the offload frees, less the allocator's overhead on them."""
    return tuple(math.fsum(a * offloadable_bytes(cost, stage, chunk)
                           for a, chunk in zip(row, chunks) if a) / cost.allocator
                 for stage, row in enumerate(alphas))


def _level(moved: Sequence[float], cap_bytes: float) -> float:
    """``L`` with ``sum(min(m, L) for m in moved) == cap_bytes`` (``cap_bytes < sum(moved)``)."""
    ordered = sorted(moved, reverse=True)
    tail = math.fsum(ordered)
    for k, largest in enumerate(ordered[:-1], start=1):
        tail -= largest
        level = (cap_bytes - tail) / k
        if level >= ordered[k]:
            return level
    return cap_bytes / len(ordered)
