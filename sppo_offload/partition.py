"""FLOPs-balanced subsequence lengths for one causal sequence.

Subsequence ``j`` of ``s`` tokens that starts after ``c`` context tokens costs, per layer,

    linear * s + quadratic * ((c + s)^2 - c^2)  =  linear * s + 2 quadratic * s * (c + s/2)

(``linear``: the GEMMs and element-wise work per token; ``quadratic``: causal attention per
unit of ``(c+s)^2 - c^2``, InfiniPipe's eq. 1 -- :class:`longctx.cost_model.CostModel`'s
``linear_per_token`` and ``alpha1``). The work of the prefix ``[0, x)`` is
``W(x) = linear x + quadratic x^2``, so equal shares put boundary ``k`` at ``W(x_k) = k W(S) / N``:
the positive root of a quadratic, computed as ``2 w / (linear + sqrt(linear^2 + 4 quadratic w))``
(no cancellation when the linear term dominates). Later subsequences attend to more context,
so they come out shorter.

Short documents (:func:`packed_documents`): SPPO cuts one long sequence and says nothing of
short ones. Cut like a long one, a document shorter than the batch's subsequences becomes
``N`` tiny units (or as many one-token units as it has tokens), each a pipeline step with its
fixed costs. Instead the batch plan (:mod:`sppo_offload.batch_plan`) packs whole documents of
at most one subsequence's length into rows of at most that length -- what a long document's
subsequence holds -- as the elastic schedule packs its short documents (each keeps its own
causal attention in the packed row); a longer document is cut into no more pieces than it
takes to keep them at about that length (at most ``N``).

Rounding: every length must be a multiple of ``multiple`` (Megatron's sequence parallelism
splits each subsequence evenly over the TP/SP group). Each interior boundary is rounded to the
nearest multiple, then pushed apart so that every subsequence keeps at least ``multiple``
tokens; the lengths are finally sorted longest first, which keeps their sum and restores the
"earlier is longer" order that rounding can break between two neighbours of nearly equal
length. Each subsequence's work is then within the work of ``multiple`` tokens at the end of the
sequence of the balanced share (checked by the tests).
"""
from __future__ import annotations

import math
from typing import Sequence


def subsequence_work(length: int, context: int, linear: float, quadratic: float) -> float:
    """Work of one subsequence (the formula above)."""
    return linear * length + quadratic * ((context + length) ** 2 - context * context)


def balanced_lengths(seq_length: int, num_subsequences: int, linear: float, quadratic: float,
                     multiple: int = 1) -> list[int]:
    """Lengths of ``num_subsequences`` subsequences of a ``seq_length``-token sequence with
    equal work under causal context, each a multiple of ``multiple``, summing to
    ``seq_length``, non-increasing.

    Raises ``ValueError`` when ``num_subsequences < 1``, ``multiple < 1``, the coefficients are
    negative or both zero, ``seq_length`` is not a multiple of ``multiple``, or the sequence has
    fewer than ``multiple`` tokens per subsequence.
    """
    n, m, total = num_subsequences, multiple, seq_length
    if n < 1:
        raise ValueError(f"the number of subsequences must be >= 1, got {n}")
    if m < 1:
        raise ValueError(f"the length multiple must be >= 1, got {m}")
    if linear < 0 or quadratic < 0 or linear + quadratic <= 0:
        raise ValueError(f"cost coefficients must be non-negative and not both zero, got "
                         f"linear={linear}, quadratic={quadratic}")
    if total % m:
        raise ValueError(f"sequence length {total} is not a multiple of {m} (the TP/SP degree); "
                         f"pad it to {math.ceil(total / m) * m} tokens")
    if total < n * m:
        raise ValueError(f"a {total}-token sequence cannot be cut into {n} subsequences of at "
                         f"least {m} tokens; use at most {total // m} subsequences")
    whole = linear * total + quadratic * total * total
    bounds = [0]
    for k in range(1, n):
        share = k * whole / n
        x = 2 * share / (linear + math.sqrt(linear * linear + 4 * quadratic * share))
        bounds.append(round(x / m) * m)
    bounds.append(total)
    for k in range(1, n):
        bounds[k] = max(bounds[k], bounds[k - 1] + m)
    for k in range(n - 1, 0, -1):
        bounds[k] = min(bounds[k], bounds[k + 1] - m)
    return sorted((bounds[k + 1] - bounds[k] for k in range(n)), reverse=True)


def starts(lengths: list[int]) -> list[int]:
    """Context (first token) of each subsequence."""
    out, at = [], 0
    for length in lengths:
        out.append(at)
        at += length
    return out


def packed_documents(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The documents of at most ``capacity`` tokens (indices into ``lengths``) packed into
    groups of at most ``capacity`` tokens: first fit in decreasing length (ties in document
    order), each group in document order, the groups in the order of their first document."""
    short = sorted((i for i, tokens in enumerate(lengths) if tokens <= capacity),
                   key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in short:
        fit = next((g for g, left in enumerate(room) if lengths[i] <= left), None)
        if fit is None:
            groups.append([])
            room.append(capacity)
            fit = len(groups) - 1
        groups[fit].append(i)
        room[fit] -= lengths[i]
    return sorted(sorted(group) for group in groups)
