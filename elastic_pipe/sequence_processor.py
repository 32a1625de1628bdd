"""InfiniPipe's sequence processor (Algorithm 1): documents -> workload-balanced chunks.

For a slice count ``N``:

1. *Mesh.* The longest document is cut into ``N`` slices of equal forward work. The work of the
   first ``x`` tokens is ``W(x) = alpha1 x^2 + a x`` (``a``: every per-token term, collectives
   included), so boundary ``j`` solves ``W(b_j) = j W(L) / N``; earlier slices come out longer
   because later ones attend to more context. Boundaries are rounded to whole tokens and kept
   strictly increasing.
2. *Thresholds.* The time threshold is the layer-forward time of the heaviest mesh slice; the
   token threshold is the first (longest) slice's token count, which bounds a chunk's memory.
3. *Long documents.* A document longer than the first slice is split on the same mesh (its last
   slice, the *tail*, is whatever remains); every slice but the tail is a chunk of its own.
4. *Packing.* Short documents and tails, heaviest first, go best-fit-decreasing into chunks under
   both thresholds: among the chunks an item fits, the one with the lowest time per token
   (the paper's preference, which spreads attention-heavy items over chunks of cheap tokens) and
   then the least remaining time wins; a new chunk is opened when none fits. A chunk never takes
   a second tail.
5. *Perturbation.* Packing is repeated with both thresholds enlarged by each factor in
   ``perturbations`` (the mesh stays); ``N`` runs over ``slice_counts`` (automatic: 1, 2, 3, 4,
   6, 8, 12, ... while the longest slice keeps at least ``min_slice_tokens`` tokens). The caller
   scores every candidate (the scheduler's memory-aware pipeline estimate) and keeps the best,
   the smaller ``N`` and perturbation winning ties.
6. *Megatron's micro-batches.* When ``N = 1`` is among the slice counts (always under the
   automatic range) and every document fits one of Megatron-LM's rows (``seq_length``), the
   micro-batches Megatron-LM's own schedules would run on these documents
   (:func:`megatron_chunking`) are scored last, as one more candidate.

Where the paper is vague: the perturbation is applied to the packing thresholds only, not to the
mesh; the "finest split" is the largest automatic ``N``.

Choice made for short documents (step 6): Algorithm 1 sizes every packed chunk by the longest
document's first slice, so a batch whose documents are all much shorter than ``--seq-length``
is cut into many more, smaller units than Megatron-LM runs for it (``tests/unit/
test_short_documents.py``'s batches of documents under a quarter of a 4K context: 15-18 chunks
against Megatron's 5 micro-batches). Each unit pays
fixed costs that the cost model prices (the profile's per-layer ``beta`` per chunk, collective
latencies, the spec-derived kernel-efficiency curve of small chunks) but that the candidate
space could not avoid: none of its thresholds reaches a micro-batch. Scoring Megatron's own
micro-batches as a candidate bounds the plan by them: its predicted time is never above what
the same estimate gives Megatron's micro-batches (per-stage uniform checkpointing: none where
they fit), and it keeps any plan that estimate finds faster. A fixed ``N > 1`` is the slice
count asked for and gets no such candidate: it cuts the longest document however short.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron.plugin.packing import micro_batch_rows

from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel


@dataclass(frozen=True)
class ChunkingConfig:
    """Search space of the sequence processor."""

    min_slice_tokens: int = 4096
    """Smallest first-slice length the automatic ``N`` range goes down to (the finest split)."""
    slice_counts: tuple[int, ...] | None = None
    """Slice counts to try; ``None`` tries 1, 2, 3, 4, 6, 8, 12, ... down to the finest split."""
    perturbations: tuple[float, ...] = (0.0, 0.15)
    """Relative enlargements of the packing thresholds to try for each ``N``."""
    seq_length: int | None = None
    """Inputs of one of Megatron-LM's packed rows (``--seq-length``): with it, Megatron's
    micro-batches are a candidate (step 6); ``None``: not tried."""
    micro_batch_size: int = 1
    """Rows of one of Megatron-LM's micro-batches (``--micro-batch-size``)."""

    def __post_init__(self):
        if self.min_slice_tokens < 1:
            raise ValueError(f"min_slice_tokens must be >= 1, got {self.min_slice_tokens}")
        if self.slice_counts is not None and (not self.slice_counts or
                                              min(self.slice_counts) < 1):
            raise ValueError(f"slice_counts must be positive integers, got {self.slice_counts}")
        if not self.perturbations or min(self.perturbations) < 0:
            raise ValueError(f"perturbations must be a non-empty tuple of factors >= 0, "
                             f"got {self.perturbations}")
        if self.seq_length is not None and self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1 or None, got {self.seq_length}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")


@dataclass(frozen=True)
class Chunking:
    """Chunks of one group of documents and how they were made."""

    chunks: tuple[Chunk, ...]
    """In pipeline order: each split document's slices as one consecutive block (longest
    document first), then the packed chunks from the heaviest to the lightest (the lightest
    drain the pipeline, shortening the cool-down)."""
    num_slices: int
    """The ``N`` of the mesh."""
    mesh: tuple[int, ...]
    """Slice boundaries of the longest document, ``0 = b_0 < ... < b_N = L``."""
    time_threshold: float
    """Layer-forward seconds a packed chunk may take (perturbation included)."""
    token_threshold: int
    """Tokens a packed chunk may hold (perturbation included)."""


def slice_candidates(longest: int, config: ChunkingConfig) -> list[int]:
    """The ``N`` values to try for a longest document of ``longest`` tokens."""
    if config.slice_counts is not None:
        return sorted({n for n in config.slice_counts if n <= longest})
    finest = max(1, longest // config.min_slice_tokens)
    counts, n = [], 1
    while n <= finest:
        counts.append(n)
        n = n + 1 if n < 4 else n + n // 2 if n % 3 else n + n // 3
    return counts


def balanced_mesh(length: int, num_slices: int, cost: CostModel) -> tuple[int, ...]:
    """Boundaries cutting ``length`` tokens into ``num_slices`` slices of equal work."""
    if not 1 <= num_slices <= length:
        raise ValueError(f"cannot cut {length} tokens into {num_slices} slices")
    a2, a1 = cost.linear_per_token, cost.alpha1
    total = a1 * length * length + a2 * length
    bounds = [0]
    for j in range(1, num_slices):
        target = total * j / num_slices
        x = target / a2 if a1 == 0 else (-a2 + math.sqrt(a2 * a2 + 4 * a1 * target)) / (2 * a1)
        low, high = bounds[-1] + 1, length - (num_slices - j)
        bounds.append(min(max(round(x), low), high))
    bounds.append(length)
    return tuple(bounds)


def split_document(doc: int, length: int, mesh: Sequence[int]) -> list[Piece]:
    """Slices of a document on the mesh (one whole piece when it fits the first slice)."""
    cuts = [b for b in mesh[:-1] if b < length] + [length]
    return [Piece(doc, j, cuts[j], cuts[j + 1], final=j + 2 == len(cuts))
            for j in range(len(cuts) - 1)]


def make_chunks(docs: Sequence[tuple[int, int]], num_slices: int, cost: CostModel,
                perturbation: float = 0.0) -> Chunking:
    """Algorithm 1 for one ``N`` and one perturbation; ``docs`` are ``(index, length)``."""
    if not docs:
        raise ValueError("no documents to chunk")
    docs = sorted(docs, key=lambda d: (-d[1], d[0]))
    mesh = balanced_mesh(docs[0][1], num_slices, cost)
    slice_time = max(cost.chunk_constant + cost.piece_work(mesh[j], mesh[j + 1] - mesh[j])
                     for j in range(num_slices))
    time_threshold = slice_time * (1 + perturbation)
    token_threshold = int(mesh[1] * (1 + perturbation))
    heads, items = {}, []
    for doc, length in docs:
        pieces = split_document(doc, length, mesh)
        if len(pieces) > 1:
            heads[doc] = [Chunk((piece,)) for piece in pieces[:-1]]
        items.append(pieces[-1])
    packed = _pack(items, cost, time_threshold, token_threshold)
    return Chunking(layout(heads, packed), num_slices, mesh, time_threshold, token_threshold)


def layout(heads: dict[int, list[Chunk]], packed: list[Chunk]) -> tuple[Chunk, ...]:
    """Pipeline order: each split document's head slices then the chunk holding its tail (in
    ``heads`` order), then the remaining packed chunks in their given order."""
    holder = {piece.doc: chunk for chunk in packed for piece in chunk.pieces if piece.is_tail}
    ordered = []
    for doc, chunks in heads.items():
        ordered.extend(chunks)
        ordered.append(holder[doc])
    placed = set(holder.values())
    ordered.extend(chunk for chunk in packed if chunk not in placed)
    return tuple(ordered)

def _pack(items: list[Piece], cost: CostModel, time_limit: float,
          token_limit: int) -> list[Chunk]:
    """Best-fit-decreasing packing of whole documents and tails (numpy over open chunks)."""
    work = [cost.piece_work(p.context, p.tokens) for p in items]
    order = sorted(range(len(items)), key=lambda i: (-work[i], -items[i].tokens, items[i].doc))
    times = np.zeros(len(items))
    tokens = np.zeros(len(items), dtype=np.int64)
    tails = np.zeros(len(items), dtype=bool)
    members: list[list[Piece]] = []
    for i in order:
        piece, w = items[i], work[i]
        open_ = len(members)
        fits = (times[:open_] + w <= time_limit) & (tokens[:open_] + piece.tokens <= token_limit)
        if piece.is_tail:
            fits &= ~tails[:open_]
        candidates = np.flatnonzero(fits)
        if candidates.size:
            per_token = times[candidates] / tokens[candidates]
            slack = time_limit - times[candidates] - w
            best = candidates[np.lexsort((slack, per_token))[0]]
        else:
            best = open_
            members.append([])
            times[best] = cost.chunk_constant
        members[best].append(piece)
        times[best] += w
        tokens[best] += piece.tokens
        tails[best] |= piece.is_tail
    ranked = sorted(range(len(members)), key=lambda b: (-times[b], -tokens[b], members[b][0]))
    return [Chunk(tuple(members[b])) for b in ranked]


def megatron_chunking(docs: Sequence[tuple[int, int]], cost: CostModel,
                      config: ChunkingConfig) -> Chunking | None:
    """Step 6: the micro-batches Megatron-LM's schedules run on ``docs`` (``(index, length)``),
    one chunk each -- its best-fit-decreasing rows of ``config.seq_length`` inputs
    (:func:`megatron.plugin.packing.micro_batch_rows`), ``config.micro_batch_size`` rows a
    chunk -- heaviest first; ``None`` without a ``seq_length`` or when a document is longer."""
    if config.seq_length is None or max(length for _, length in docs) > config.seq_length:
        return None
    rows = micro_batch_rows([length for _, length in docs], config.seq_length,
                            config.micro_batch_size)
    members = [[docs[i] for row in batch for i in row] for batch in rows]
    work = [cost.chunk_constant + sum(cost.piece_work(0, length) for _, length in batch)
            for batch in members]
    order = sorted(range(len(members)), key=lambda b: (-work[b], min(members[b])))
    chunks = tuple(Chunk(tuple(Piece(doc, 0, 0, length, final=True)
                               for doc, length in sorted(members[b])))
                   for b in order)
    longest = max(length for _, length in docs)
    return Chunking(chunks, 1, (0, longest), max(work),
                    config.seq_length * config.micro_batch_size)


def best_chunking(docs: Sequence[tuple[int, int]], cost: CostModel, config: ChunkingConfig,
                  score: Callable[[list[Chunk]], float]) -> tuple[Chunking, float]:
    """Algorithm 1 with ``N`` and the perturbation tuned, then Megatron's micro-batches where
    ``N = 1`` was tried (step 6): the candidate of lowest ``score``, the first of equals.

    ``score`` returns ``math.inf`` for chunkings that do not fit in memory; when every candidate
    scores ``inf`` the finest one is returned with ``inf`` (the caller decides what to report).
    """
    longest = max(length for _, length in docs)
    best, best_score, finest = None, math.inf, None
    counts = slice_candidates(longest, config)
    for n in counts:
        for perturbation in config.perturbations:
            chunking = make_chunks(docs, n, cost, perturbation)
            value = score(list(chunking.chunks))
            if value < best_score:
                best, best_score = chunking, value
            if perturbation == min(config.perturbations):
                finest = chunking
    megatron = megatron_chunking(docs, cost, config) if 1 in counts else None
    if megatron is not None:
        value = score(list(megatron.chunks))
        if value < best_score:
            best, best_score = megatron, value
    return (best, best_score) if best is not None else (finest, math.inf)

def relative_std(values: Sequence[float]) -> float:
    """Standard deviation over mean (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    array = np.asarray(values, dtype=float)
    return float(array.std() / array.mean())


def chunk_balance(chunks: Sequence[Chunk], cost: CostModel) -> tuple[float, float]:
    """(relative std of chunk layer-forward time, relative std of chunk tokens) (Table 2)."""
    return (relative_std([cost.layer_forward(c) for c in chunks]),
            relative_std([c.tokens for c in chunks]))
