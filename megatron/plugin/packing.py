"""Megatron-LM's micro-batches of a batch of whole documents, as document indices: the rows
Megatron's schedules run here (:func:`~megatron.plugin.batches.pack_micro_batches`) and the
units the document schedules compare themselves with (their planners try Megatron's
micro-batches as one candidate, :mod:`elastic_pipe.sequence_processor`). Pure Python: the
planners import it without torch or Megatron."""
from __future__ import annotations

from typing import Sequence


def pack_rows(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Document indices per row: documents of ``lengths`` inputs packed best-fit decreasing
    into rows of at most ``seq_length`` inputs.

    Best-fit decreasing (longest document first, each into the row it leaves the least room
    in) pads the fewest tokens of the simple packers; padding is work a schedule does for
    nothing, so a baseline packed first-fit in arrival order would look slower than it is.
    """
    rows: list[list[int]] = []
    fill: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        n = lengths[index]
        if n > seq_length:
            raise ValueError(f"a document of {n} inputs exceeds --seq-length {seq_length}")
        fits = [i for i, used in enumerate(fill) if used + n <= seq_length]
        if fits:
            i = max(fits, key=lambda i: fill[i])
            rows[i].append(index)
            fill[i] += n
        else:
            rows.append([index])
            fill.append(n)
    return rows


def micro_batch_rows(lengths: Sequence[int], seq_length: int, micro_batch_size: int = 1,
                     multiple_of: int = 1) -> list[list[list[int]]]:
    """Megatron-style micro-batches as document indices: :func:`pack_rows`, then
    ``micro_batch_size`` rows per micro-batch, the last completed with empty rows, and the
    number of micro-batches rounded up to ``multiple_of`` (data-parallel size) with empty
    micro-batches, which carry no loss tokens."""
    rows = pack_rows(lengths, seq_length)
    rows += [[] for _ in range(-len(rows) % micro_batch_size)]
    batches = [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    batches += [[[] for _ in range(micro_batch_size)] for _ in range(-len(batches) % multiple_of)]
    return batches
