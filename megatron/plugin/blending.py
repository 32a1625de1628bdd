"""Megatron-LM's dataset blending, applied to documents.

Megatron-LM blends ``--data-path W1 P1 W2 P2 ...`` sample by sample: its compiled helper
``build_blending_indices`` gives sample ``i`` of the run to the dataset whose count lags its
weight's share the most, so that over any prefix of the run each dataset has given its weight's
share of the samples to within one. A Megatron sample is ``--seq-length`` tokens, so the
weights share out *tokens*.

Here a sample is a document (or a piece of a longer one, :mod:`megatron.plugin.sources`), of
any length up to ``--seq-length`` labels. :class:`Blend` keeps Megatron's meaning by running
Megatron's own helper over blocks of ``--seq-length`` tokens: block ``i`` of the run belongs to
the dataset Megatron's sample ``i`` would come from, and, when that is dataset ``k``'s ``j``-th
sample, it holds the units of dataset ``k``'s stream that start within that stream's tokens
``[j * seq_length, (j + 1) * seq_length)``. The run's units are the blocks' units in block order.
Each dataset therefore contributes, over any prefix of the run, the tokens Megatron's blend
gives it to within one unit (at most ``--seq-length`` labels), whatever its documents' lengths.

The blend is a pure function of the streams and the weights: unit ``n`` of the run is the same
in every process and after a resume. The block table grows by doubling as the run reads on
(Megatron's helper is prefix-stable: a longer table starts with the shorter one).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
from megatron.core.datasets import helpers_cpp


class UnitStream(Protocol):
    """What the blend reads of a dataset: its endless sequence of units."""

    def units_before(self, tokens: np.ndarray) -> np.ndarray:
        """For each token offset of the stream (sorted), the number of units that start
        before it."""


class Blend:
    """``units(start, count)``: which dataset's which unit are units ``start`` on of the run."""

    def __init__(self, streams: Sequence[UnitStream], weights: Sequence[float],
                 seq_length: int):
        if len(streams) != len(weights) or not streams:
            raise ValueError("a blend needs one positive weight per dataset")
        weights = np.asarray(weights, dtype=np.float64)
        if (weights <= 0).any():
            raise ValueError("a blend's weights must be positive")
        self.streams = list(streams)
        self.weights = weights / weights.sum()
        self.seq_length = seq_length
        self._dataset = np.zeros(0, dtype=np.int16)  # the dataset of each block
        self._first = np.zeros(0, dtype=np.int64)    # its dataset's index of its first unit
        self._ends = np.zeros(0, dtype=np.int64)     # units of the run up to its end

    def units(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(dataset, unit index in that dataset's stream)`` of the run's units
        ``[start, start + count)``."""
        while not len(self._ends) or self._ends[-1] < start + count:
            self._grow(max(1024, 2 * len(self._ends)))
        positions = np.arange(start, start + count, dtype=np.int64)
        blocks = np.searchsorted(self._ends, positions, side="right")
        begins = np.where(blocks > 0, self._ends[np.maximum(blocks - 1, 0)], 0)
        units = self._first[blocks] + positions - begins
        return [(int(k), int(u)) for k, u in zip(self._dataset[blocks], units)]

    def _grow(self, size: int) -> None:
        dataset = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(dataset, sample, self.weights, len(self.weights),
                                           size, False)
        old = len(self._dataset)
        new_dataset, new_sample = dataset[old:], sample[old:]
        first = np.zeros(size - old, dtype=np.int64)
        counts = np.zeros(size - old, dtype=np.int64)
        for k, stream in enumerate(self.streams):
            mine = new_dataset == k
            if not mine.any():
                continue
            samples = new_sample[mine]  # consecutive: j, j + 1, ...
            edges = stream.units_before(np.append(samples, samples[-1] + 1) * self.seq_length)
            first[mine] = edges[:-1]
            counts[mine] = np.diff(edges)
        done = self._ends[-1] if old else 0
        self._dataset = dataset
        self._first = np.concatenate((self._first, first))
        self._ends = np.concatenate((self._ends, done + np.cumsum(counts)))
