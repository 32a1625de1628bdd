"""Chunks of documents as the executor's input: one packed row per unit (elastic, seq1f1b and
sppo), whose split pieces carry their document key and slice index for the K/V context."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from megatron.plugin.batches import MicroBatch, host_tensor, micro_batch, pack_row
from megatron.plugin.pipeline.ir import Action, Schedule

from longctx.chunks import Chunk, Piece


@dataclass
class ChunkRows:
    """A schedule of document chunks and its input: one packed row per unit."""

    schedule: Schedule
    batches: list[MicroBatch]
    slices: list[tuple[tuple[int, int], ...]]
    """Per unit: ``(doc_key, slice_index)`` of the pieces that belong to split documents."""
    hidden_size: int
    token_divisor: int

    def __len__(self) -> int:
        return len(self.batches)

    def shape_of(self, action: Action) -> tuple[int, int, int]:
        return (self.batches[action.unit].seq_length // self.token_divisor, 1,
                self.hidden_size)


def is_split(piece: Piece) -> bool:
    """Whether ``piece`` is a slice of a document cut into several."""
    return piece.slice > 0 or not piece.final


def chunk_row(chunk: Chunk, documents, doc_ids, multiple: int) -> tuple:
    """The packed row of one chunk (pieces in order), padded to a multiple of ``multiple``."""
    docs, slices, totals = [], [], []
    for piece in chunk.pieces:
        doc = doc_ids[piece.doc]
        docs.append(documents[doc][piece.start:piece.end + 1])
        split = is_split(piece)
        slices.append((doc, piece.slice, piece.start) if split else (None, 0, 0))
        totals.append(len(documents[doc]) - 1 if split else 0)
    return pack_row(docs, pad_to=math.ceil(chunk.tokens / multiple) * multiple, slices=slices,
                    doc_tokens=totals)


def chunk_batch(chunk: Chunk, documents, doc_ids, multiple: int,
                weights=None) -> MicroBatch:
    """The micro-batch of one chunk's row (:func:`chunk_row`); with ``weights`` (per document
    of ``documents``, one per input: :func:`~megatron.plugin.default_loss.unit_weights`) every
    token carries its input's as its loss weight, padding none."""
    batch = micro_batch([chunk_row(chunk, documents, doc_ids, multiple)])
    if weights is None:
        return batch
    row = np.zeros((1, batch.seq_length), dtype=np.float32)
    start = 0
    for piece in chunk.pieces:
        row[0, start:start + piece.tokens] = weights[doc_ids[piece.doc]][piece.start:piece.end]
        start += piece.tokens
    return dataclasses.replace(batch, loss_weights=host_tensor(row))
