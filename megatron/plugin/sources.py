"""Document-level batches from Megatron ``.bin/.idx`` datasets (or mock data).

Each iteration draws ``--global-batch-size`` units: documents, or pieces of documents longer
than ``--seq-length``. The draw is a pure function of ``(seed, split, iteration)``, so every rank
computes the same batch without communication and a run resumed at iteration ``i`` continues
with exactly the units it would have seen (the data position is Megatron-LM's
``consumed_train_samples``, in units, stored in the checkpoint).

Choices, written down:

* **Split**: ``--split 969,30,1`` cuts each dataset's *documents* into contiguous train / valid /
  test ranges, as Megatron-LM's ``get_split_indices`` does.
* **Long documents**: a document longer than ``--seq-length`` inputs is cut into pieces of
  ``seq_length + 1`` tokens that overlap by one, each trained as a document of its own, as
  Megatron-LM's samples cut it: every token is trained (:class:`_DatasetStream`). Start-up logs
  how many were cut (:meth:`DocumentSource.summary`). Documents shorter than 2 tokens (no
  input/label pair) have nothing to train.
* **Order**: per dataset, an endless stream of epochs, each a seeded permutation of the split's
  units.
* **Blending** (``--data-path W1 P1 W2 P2 ...``): Megatron-LM's blend, whose weights share out
  tokens, over the run and not batch by batch (:mod:`megatron.plugin.blending`); a dataset with
  a small weight is read as often as Megatron reads it.
* **Reading**: ``.bin`` files are memory-mapped unless ``--no-mmap-bin-files`` (then read
  into memory, as Megatron-LM's ``IndexedDataset`` does). No index files are built (the draws
  are computed), so ``--data-cache-path`` has nothing to hold and is accepted as is.
* **Splits weighted 0** (``--split 99,1,0``) are not built: the provider hands Megatron-LM
  ``None`` for them, and its loop skips evaluating them, as with its own datasets. A split with
  a positive weight but no documents is refused at start when ``--eval-iters`` reads it.
* **Evaluation**: Megatron-LM's loop reads the ``valid`` split's batches in order, on from
  where the previous evaluation stopped (``consumed_valid_samples``).
"""
from __future__ import annotations

import argparse
import os
import struct
from typing import Sequence

import numpy as np
import torch.distributed as dist
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.plugin.blending import Blend
from megatron.plugin.corpus import embedded_corpus

SPLITS = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """``[prefix]``, ``[prefix, prefix, ...]`` or ``[w1, p1, w2, p2, ...]`` -> (weight, prefix)."""
    if not data_path:
        raise ValueError("--data-path needs at least one dataset prefix")
    try:
        float(data_path[0])
    except ValueError:
        return [(1.0, prefix) for prefix in data_path]
    if len(data_path) % 2:
        raise ValueError("--data-path with weights takes pairs 'WEIGHT PREFIX ...'")
    pairs = [(float(w), p) for w, p in zip(data_path[0::2], data_path[1::2])]
    if any(w < 0 for w, _ in pairs) or sum(w for w, _ in pairs) <= 0:
        raise ValueError("--data-path weights must be non-negative with a positive sum")
    return pairs


def split_weights(split: str) -> list[float]:
    """``"969,30,1"`` -> the train / valid / test weights (missing ones are 0)."""
    parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: give three non-negative weights, e.g. 969,30,1")
    return parts


def split_ranges(split: str, count: int) -> list[tuple[int, int]]:
    """Megatron-LM's document split: ``"969,30,1"`` -> contiguous [start, stop) per split."""
    parts = split_weights(split)
    total = sum(parts)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / total * count)))
    shift = bounds[-1] - count
    bounds = [bounds[0]] + [b - shift for b in bounds[1:]]
    return [(max(a, 0), max(b, 0)) for a, b in zip(bounds, bounds[1:])]


class _DatasetStream:
    """Seeded epochs over the training units of one split of one dataset.

    A unit is a document of 2 to ``seq_length + 1`` tokens, or a piece of a longer one: a
    document of ``n`` tokens is ``ceil((n - 1) / seq_length)`` pieces, piece ``p`` its tokens
    ``[p * seq_length, (p + 1) * seq_length + 1)`` (the last one shorter). Consecutive pieces
    share one token, the label of one being the first input of the next, as Megatron-LM's
    samples of one document do; so each of the document's ``n - 1`` labels is trained once an
    epoch. A piece is a document of its own for attention and positions, as Megatron's sample
    is (its tokens see none of the sample before, its positions start at 0). Documents of
    fewer than 2 tokens (no input/label pair) have no unit.
    """

    def __init__(self, dataset: IndexedDataset, first: int, stop: int, seed: int,
                 seq_length: int):
        self.dataset = dataset
        index = dataset.index
        bounds = np.asarray(index.document_indices, dtype=np.int64)
        ends = np.concatenate(([0], np.cumsum(index.sequence_lengths, dtype=np.int64)))
        lengths = ends[bounds[first + 1:stop + 1]] - ends[bounds[first:stop]]
        pieces = np.where(lengths >= 2, -(-(lengths - 1) // seq_length), 0)
        self.unit_document = np.repeat(np.arange(first, stop, dtype=np.int64), pieces)
        first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
        self.unit_start = (np.arange(len(self.unit_document)) - first_piece) * seq_length
        self.unit_labels = np.minimum(seq_length,
                                      np.repeat(lengths, pieces) - 1 - self.unit_start)
        self.documents = int(np.count_nonzero(pieces))
        self.documents_cut = int(np.count_nonzero(pieces > 1))
        self.tokens_per_epoch = int(self.unit_labels.sum())
        self.seed = seed
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.unit_document)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's order of the units, and the token offset (in labels) where each of them
        starts within the epoch."""
        if epoch not in self._epochs:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            labels = self.unit_labels[order]
            if len(self._epochs) == 2:
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = (order, np.cumsum(labels) - labels)
        return self._epochs[epoch]

    def units_before(self, tokens: np.ndarray) -> np.ndarray:
        """For each token offset of the endless stream (sorted), the number of units that
        start before it."""
        epochs = tokens // self.tokens_per_epoch
        counts = np.empty_like(tokens)
        for epoch in np.unique(epochs):
            mine = epochs == epoch
            starts = self._epoch(int(epoch))[1]
            counts[mine] = epoch * len(self) + np.searchsorted(
                starts, tokens[mine] - epoch * self.tokens_per_epoch, side="left")
        return counts

    def read(self, unit: int) -> np.ndarray:
        """The tokens of the stream's ``unit``-th unit."""
        epoch, offset = divmod(unit, len(self))
        chosen = int(self._epoch(epoch)[0][offset])
        start = int(self.unit_start[chosen])
        return self._tokens(int(self.unit_document[chosen]), start,
                            start + int(self.unit_labels[chosen]) + 1)

    def _tokens(self, document: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of a document (which may span several index sequences)."""
        bounds = self.dataset.index.document_indices
        pieces, offset = [], 0
        for seq in range(int(bounds[document]), int(bounds[document + 1])):
            length = int(self.dataset.index.sequence_lengths[seq])
            lo, hi = max(start - offset, 0), min(stop - offset, length)
            if lo < hi:
                pieces.append(self.dataset.get(seq, lo, hi - lo))
            offset += length
            if offset >= stop:
                break
        return np.concatenate(pieces).astype(np.int64)


class DocumentSource:
    """``documents(iteration)``: the global batch of one split at one iteration, the next
    ``--global-batch-size`` units of the split's blend (:class:`~megatron.plugin.blending.Blend`)."""

    def __init__(self, streams: list[_DatasetStream], weights: list[float],
                 global_batch_size: int, seq_length: int, vocab_size: int, name: str):
        live = [(s, w) for s, w in zip(streams, weights) if w > 0 and len(s)]
        self.streams = [s for s, _ in live]
        self.blend = Blend(self.streams, [w for _, w in live], seq_length) if live else None
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.name = name

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams)

    def summary(self) -> str:
        """The start-up line that says what the split holds and what was cut."""
        documents = sum(s.documents for s in self.streams)
        cut = sum(s.documents_cut for s in self.streams)
        tokens = sum(s.tokens_per_epoch for s in self.streams)
        return (f"{self.name} split: {documents} documents, {tokens} tokens to train an epoch; "
                f"{cut} documents longer than --seq-length {self.seq_length} + 1 tokens are "
                f"cut into {len(self) - documents + cut} pieces, each trained as a document "
                "of its own")

    def documents(self, iteration: int) -> list[np.ndarray]:
        if not self.streams:
            raise ValueError(f"the {self.name} split has no documents: adjust --split")
        batch = self.global_batch_size
        docs = [self.streams[k].read(unit)
                for k, unit in self.blend.units(iteration * batch, batch)]
        for doc in docs:
            if int(doc.max()) >= self.vocab_size:
                raise ValueError(
                    f"token id {int(doc.max())} is outside the {self.vocab_size}-token vocabulary "
                    "of --tokenizer-type: preprocess the data with the same tokenizer")
        return docs


class MockSource:
    """``--mock-data``: seeded synthetic documents with a skewed (log-normal) length mix.

    Each document is a learnable pattern (an arithmetic progression of byte values with a
    random start and stride, modulo the vocabulary when it is smaller), so the loss falls as
    it trains.
    """

    def __init__(self, global_batch_size: int, seq_length: int, seed: int, split: int,
                 vocab_size: int):
        self.modulus = min(256, vocab_size)
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self.name = SPLITS[split]

    def __len__(self) -> int:
        return self.global_batch_size

    def summary(self) -> str:
        """The start-up line that says what the split holds."""
        return (f"{self.name} split: --mock-data, {self.global_batch_size} generated documents "
                f"of 2 to {self.seq_length + 1} tokens an iteration")

    def documents(self, iteration: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, self.split, iteration])
        lengths = np.clip(rng.lognormal(np.log(self.seq_length / 4), 1.0,
                                        self.global_batch_size).astype(np.int64),
                          2, self.seq_length + 1)
        return [(rng.integers(0, 256) + rng.integers(1, 8) * np.arange(n)) % self.modulus
                for n in lengths]


_REWRITE = "write the dataset again with scripts/preprocess_data.py"


def _open(prefix: str, mmap: bool) -> IndexedDataset:
    """Megatron-LM's ``IndexedDataset`` of ``prefix``, after checking that its two files
    belong together: a damaged ``.idx`` or a ``.bin`` of another size than the index describes
    (truncated by a full disk or an interrupted copy, or from another dataset) is refused here,
    naming the file, rather than failing or reading wrong tokens in the middle of training."""
    if not IndexedDataset.exists(prefix):
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.exists(p)]
        written = f"{prefix}_text_document"
        hint = (f"; {written}.bin/.idx exist: pass --data-path {written}"
                if IndexedDataset.exists(written) else "")
        raise FileNotFoundError(
            f"--data-path {prefix}: {', '.join(missing)} not found; give the prefix of a dataset "
            "written by scripts/preprocess_data.py or Megatron-LM's tools/preprocess_data.py "
            "(PREFIX_text_document, without .bin/.idx), or omit --data-path to use the embedded "
            f"corpus{hint}")
    try:
        dataset = IndexedDataset(prefix, mmap=mmap)
    except (AssertionError, ValueError, struct.error) as error:
        raise ValueError(f"--data-path {prefix}: {prefix}.idx cannot be read ({error}): it is "
                         f"damaged or not a Megatron-LM index; {_REWRITE}") from error
    index = dataset.index
    described = 0
    if index.sequence_count:
        described = int(index.sequence_pointers[-1]) \
            + int(index.sequence_lengths[-1]) * index.dtype_size
    size = os.path.getsize(prefix + ".bin")
    if size != described:
        what = "truncated" if size < described else "not the one its index was written with"
        raise ValueError(f"--data-path {prefix}: {prefix}.bin holds {size} bytes where "
                         f"{prefix}.idx describes {described}: the .bin is {what}; {_REWRITE}")
    return dataset


def build_document_sources(args: argparse.Namespace, vocab_size: int):
    """``{"train": ..., "valid": ..., "test": ...}`` from the data flags; token ids must lie
    below ``vocab_size`` (the tokenizer's, unpadded).

    The embedded corpus is built by rank 0 (others wait at a barrier) when no ``--data-path``
    and no ``--mock-data`` is given.
    """
    if args.mock_data:
        return {name: MockSource(args.global_batch_size, args.seq_length, args.seed, i,
                                 vocab_size)
                for i, name in enumerate(SPLITS)}
    if args.data_path:
        pairs = parse_data_path(args.data_path)
    else:
        if not dist.is_initialized() or dist.get_rank() == 0:
            embedded_corpus()
        if dist.is_initialized():
            dist.barrier()
        pairs = [(1.0, embedded_corpus())]
    datasets = [_open(prefix, args.mmap_bin_files) for _, prefix in pairs]
    split = args.split or "969, 30, 1"  # Megatron-LM's default with --data-path
    sources = {}
    for i, (name, weight) in enumerate(zip(SPLITS, split_weights(split))):
        if weight == 0 and name != "train":
            sources[name] = None
            continue
        streams = []
        for k, dataset in enumerate(datasets):
            start, stop = split_ranges(split, len(dataset.index.document_indices) - 1)[i]
            streams.append(_DatasetStream(dataset, start, stop, args.seed * 1000 + 10 * k + i,
                                          args.seq_length))
        sources[name] = DocumentSource(streams, [w for w, _ in pairs], args.global_batch_size,
                                       args.seq_length, vocab_size, name)
    if len(sources["train"]) == 0:
        raise ValueError("the train split has no documents of 2 tokens or more: check "
                         "--data-path and --split")
    for name in SPLITS[1:]:
        if sources[name] is not None and args.eval_iters > 0 and len(sources[name]) == 0:
            raise ValueError(f"--split {split} leaves the {name} split without documents "
                             f"of 2 tokens or more, and --eval-iters {args.eval_iters} "
                             "evaluates on it: adjust --split, add documents, or set "
                             "--eval-iters 0")
    return sources
