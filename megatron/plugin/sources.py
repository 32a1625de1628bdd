"""Document-level batches from Megatron ``.bin/.idx`` datasets (or mock data).

Each iteration draws ``--global-batch-size`` whole documents. The draw is a pure function of
``(seed, split, iteration)``, so every rank computes the same batch without communication and a
run resumed at iteration ``i`` continues with exactly the documents it would have seen (the data
position is Megatron-LM's ``consumed_train_samples``, in documents, stored in the checkpoint).

Choices, written down:

* **Split**: ``--split 969,30,1`` cuts each dataset's *documents* into contiguous train / valid /
  test ranges, as Megatron-LM's ``get_split_indices`` does.
* **Order**: per dataset, an endless stream of epochs, each a seeded permutation of the split's
  documents; iteration ``i`` takes the next ``c_k`` documents of dataset ``k``'s stream.
* **Blending** (``--data-path W1 P1 W2 P2 ...``): ``c_k`` is the weight's share of the global
  batch, rounded by largest remainder (fixed for the run; each dataset with a positive weight
  gets at least its rounded share).
* **Truncation**: a document longer than ``--seq-length`` inputs keeps its first
  ``seq_length + 1`` tokens. Documents shorter than 2 tokens (no input/label pair) are skipped.
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


def batch_shares(weights: Sequence[float], batch: int) -> list[int]:
    """Documents per dataset per batch: ``weights`` scaled to ``batch``, largest remainder."""
    total = sum(weights)
    exact = [w / total * batch for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])
    for i in order[:batch - sum(shares)]:
        shares[i] += 1
    return shares


class _DatasetStream:
    """Seeded epochs over the usable documents of one split of one dataset."""

    def __init__(self, dataset: IndexedDataset, first: int, stop: int, seed: int):
        self.dataset = dataset
        index = dataset.index
        bounds = np.asarray(index.document_indices)
        lengths = np.add.reduceat(np.asarray(index.sequence_lengths, dtype=np.int64),
                                  bounds[first:stop]) if stop > first else np.zeros(0, np.int64)
        ids = np.arange(first, stop)
        self.doc_ids = ids[lengths >= 2] if len(lengths) == len(ids) else ids[:0]
        self.seed = seed
        self._epoch: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.doc_ids)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch = (epoch, self.doc_ids[rng.permutation(len(self.doc_ids))])
        return self._epoch[1]

    def take(self, start: int, count: int, max_tokens: int) -> list[np.ndarray]:
        docs = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, len(self.doc_ids))
            docs.append(self._read(int(self._permutation(epoch)[offset]), max_tokens))
        return docs

    def _read(self, doc_id: int, max_tokens: int) -> np.ndarray:
        bounds = self.dataset.index.document_indices
        pieces, remaining = [], max_tokens
        for seq in range(int(bounds[doc_id]), int(bounds[doc_id + 1])):
            if remaining == 0:
                break
            length = min(int(self.dataset.index.sequence_lengths[seq]), remaining)
            pieces.append(self.dataset.get(seq, 0, length))
            remaining -= length
        return np.concatenate(pieces).astype(np.int64)


class DocumentSource:
    """``documents(iteration)``: the global batch of one split at one iteration."""

    def __init__(self, streams: list[_DatasetStream], weights: list[float],
                 global_batch_size: int, seq_length: int, vocab_size: int, name: str):
        live = [(s, w) for s, w in zip(streams, weights) if w > 0 and len(s)]
        self.streams = [s for s, _ in live]
        self.shares = batch_shares([w for _, w in live], global_batch_size) if live else []
        self.max_tokens = seq_length + 1
        self.vocab_size = vocab_size
        self.name = name

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams)

    def documents(self, iteration: int) -> list[np.ndarray]:
        if not self.streams:
            raise ValueError(f"the {self.name} split has no documents: adjust --split")
        docs = []
        for stream, share in zip(self.streams, self.shares):
            docs.extend(stream.take(iteration * share, share, self.max_tokens))
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
            streams.append(_DatasetStream(dataset, start, stop, seed=args.seed * 1000 + 10 * k + i))
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
