"""Megatron-LM's dataset provider for document-level batches.

Megatron-LM's loop (``--dataloader-type external``) calls ``next()`` on the iterators this
provider returns; each call yields one :class:`GlobalBatch`: ``--global-batch-size`` whole documents, the
same on every rank. The schedule's forward-backward function
(:mod:`megatron.plugin.registry`) takes one global batch per step and cuts it for its layout:
Megatron's own schedules get this replica's packed ``--seq-length`` micro-batches, the
document-level schedules plan the documents.

A sample is a document under every schedule (Megatron-LM's is a sequence of ``--seq-length``
tokens): ``--global-batch-size`` and the other options that count samples
(:data:`~megatron.plugin.option_classes.COUNT_DOCUMENTS`) count documents, and so do Megatron's
``consumed_train_samples`` (and ``consumed_valid_samples``), so a resumed run starts at the
batch after the last one it trained on. Start-up logs it (:func:`sample_meaning`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron.plugin.option_classes import COUNT_DOCUMENTS
from megatron.plugin.sources import build_document_sources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's documents, and a way to read the next step's (a schedule may plan it while
    this one trains; ``None`` when there is no way)."""

    documents: list[np.ndarray]
    upcoming: Callable[[], list[np.ndarray] | None]

    def __reduce__(self):
        """Pickled without the way to the next batch. Megatron's rerun state machine keeps the
        batches of the step it may replay and saves them in the checkpoint it requests when a
        NaN reproduces (``--rerun-mode validate_results``); a batch read back from there
        cannot look ahead, and its schedule plans without prefetching."""
        return GlobalBatch, (self.documents, no_upcoming)


def no_upcoming() -> None:
    """The next batch of a :class:`GlobalBatch` read back from a checkpoint: unknown."""
    return None


class GlobalBatches:
    """Endless iterator over the global batches of one split, from batch ``start`` on."""

    def __init__(self, source, start: int):
        self.source = source
        self.index = start

    def __iter__(self):
        return self

    def __next__(self) -> GlobalBatch:
        index = self.index
        self.index += 1
        return GlobalBatch(self.source.documents(index),
                           lambda: self.source.documents(index + 1))


def sample_meaning(args) -> str:
    """The start-up line that says what a sample is under the chosen schedule."""
    flags = sorted("--" + dest.replace("_", "-") for dest in COUNT_DOCUMENTS
                   if dest != "global_batch_size")
    return (f"pretrain_gpt_elastic.py: a sample is one document (or a piece of "
            f"{args.seq_length + 1} tokens of a longer one) under --pipeline-schedule "
            f"{args.pipeline_schedule}, not a sequence of --seq-length tokens as in Megatron-LM: "
            f"--global-batch-size {args.global_batch_size} is {args.global_batch_size} "
            f"documents per step, and {', '.join(flags)} count documents")


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """``(train, valid, test)`` iterators of global batches (Megatron's provider contract);
    ``None`` for a split weighted 0 by ``--split``."""
    from megatron.training import get_args, get_tokenizer

    del train_val_test_num_samples, vp_stage  # every batch is drawn by its index
    args = get_args()
    sources = build_document_sources(args, get_tokenizer().vocab_size)
    if args.rank == 0:
        for source in sources.values():
            if source is not None:
                log.info("pretrain_gpt_elastic.py: %s", source.summary())
    batch = args.global_batch_size
    starts = {"train": args.consumed_train_samples // batch,
              "valid": args.consumed_valid_samples // batch, "test": 0}
    return tuple(None if sources[name] is None else GlobalBatches(sources[name], start)
                 for name, start in starts.items())


# Every rank builds its own iterators (they are cheap and need no broadcast): without this,
# Megatron builds them on tensor-parallel rank 0 only and hands the other ranks ``None``.
train_valid_test_datasets_provider.is_distributed = True
