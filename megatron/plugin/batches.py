"""Micro-batches of packed documents, Megatron's ``forward_step`` and its loss function.

Convention: a document of ``n + 1`` tokens gives ``n`` inputs (``tokens[:-1]``) and ``n``
labels (``tokens[1:]``); positions restart at 0 for every document (or start at the slice's
context length for a slice of a longer document).

``--eod-mask-loss`` keeps Megatron's meaning (its ``GPTDataset`` zeroes the loss mask wherever
the *input* token is the tokenizer's end-of-document token): :func:`forward_step` masks those
positions of every micro-batch, whatever schedule cut it, and :func:`loss_tokens` counts a
document's loss tokens the same way. Megatron's samples run across documents, so there the
masked positions are mostly the boundaries (the EOD predicting the next document's first
token); here every document is its own sequence, a document's closing EOD is only ever a label,
and what the flag masks is the EOD tokens inside a document.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config
from megatron.training import get_args, get_tokenizer

from megatron.plugin.context_loss import megatron_share_weights
from megatron.plugin.layers.layout import PackedDocuments, Segment
from megatron.plugin.loss_checks import validate_loss
from megatron.plugin.packing import micro_batch_rows


@dataclass
class MicroBatch:
    """A packed micro-batch ``[b, s]`` with its document layout."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    segments: tuple[tuple[Segment, ...], ...]
    share: object = None
    """A sequence-parallel group's range of a slice (see ``PackedDocuments.share``)."""
    loss_weights: torch.Tensor | None = None
    """Per-token weights of the loss under Megatron's default loss when the tokens come from
    several of Megatron's micro-batches (:mod:`megatron.plugin.default_loss`); ``None``: every
    token counts once, as in Megatron's own micro-batches."""
    positions_end: int | None = None
    """One past the largest position id, known when the batch is built (the rotary table's
    length, :class:`~megatron.plugin.layers.layout.PackedDocuments`); ``None``: unknown."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device) -> "MicroBatch":
        """The batch on ``device``, each tensor copied without blocking the host (from the
        pinned memory :func:`micro_batch` builds it in on a CUDA machine; a tensor already
        there is kept)."""
        def moved(t):
            return None if t is None else t.to(device, non_blocking=True)

        return replace(self, tokens=moved(self.tokens), labels=moved(self.labels),
                       loss_mask=moved(self.loss_mask), position_ids=moved(self.position_ids),
                       loss_weights=moved(self.loss_weights))

    def context_share(self, rank: int, size: int) -> "MicroBatch":
        """This context-parallel rank's contiguous ``1/size`` of the tokens (Ulysses), each
        tensor a contiguous copy (rows of several are viewed flat); the segments keep
        describing whole rows."""
        seq = self.seq_length
        if seq % size:
            raise ValueError(f"a {seq}-token row cannot be split over {size} context-parallel "
                             f"ranks")
        part = slice(rank * seq // size, (rank + 1) * seq // size)

        def share(t):
            return None if t is None else t[:, part].contiguous()

        return replace(self, tokens=share(self.tokens), labels=share(self.labels),
                       loss_mask=share(self.loss_mask), position_ids=share(self.position_ids),
                       loss_weights=share(self.loss_weights))

    def layout(self, kv_store=None, record_kv=False) -> PackedDocuments:
        return PackedDocuments(segments=self.segments, position_ids=self.position_ids,
                               kv_store=kv_store, record_kv=record_kv, share=self.share,
                               positions_end=self.positions_end)


def pack_row(docs: Sequence[np.ndarray], pad_to: int | None = None,
             slices: Sequence[tuple[object, int, int]] | None = None,
             doc_tokens: Sequence[int] | None = None):
    """One packed row from documents (each ``n + 1`` tokens), optionally padded.

    ``slices`` gives, per document, ``(doc_key, slice_index, context_length)`` for slices of
    longer documents (positions then start at ``context_length``), and ``doc_tokens`` the
    inputs of the whole document each slice comes from (``Segment.doc_tokens``; 0 for a whole
    document). Padding forms its own segment, masked out of the loss. Returns ``(tokens,
    labels, mask, positions, segments)``.
    """
    tokens, labels, mask, positions, segments = [], [], [], [], []
    start = 0
    for i, doc in enumerate(docs):
        doc = np.asarray(doc, dtype=np.int64)
        n = len(doc) - 1
        if n < 1:
            raise ValueError("a document needs at least 2 tokens (1 input, 1 label)")
        key, index, offset = (None, 0, 0) if slices is None else slices[i]
        tokens.append(doc[:-1])
        labels.append(doc[1:])
        mask.append(np.ones(n, dtype=np.float32))
        positions.append(np.arange(offset, offset + n, dtype=np.int64))
        whole = 0 if doc_tokens is None else int(doc_tokens[i])
        segments.append(Segment(start, start + n, key, index, whole))
        start += n
    if pad_to is not None:
        if start > pad_to:
            raise ValueError(f"{start} tokens do not fit a row of {pad_to}")
        if start < pad_to:
            pad = pad_to - start
            tokens.append(np.zeros(pad, dtype=np.int64))
            labels.append(np.zeros(pad, dtype=np.int64))
            mask.append(np.zeros(pad, dtype=np.float32))
            positions.append(np.arange(pad, dtype=np.int64))
            segments.append(Segment(start, pad_to, padding=True))
    return (np.concatenate(tokens), np.concatenate(labels), np.concatenate(mask),
            np.concatenate(positions), tuple(segments))


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a host tensor for a batch: in pinned memory on a CUDA machine, so that the
    unit's copy to the device (:meth:`MicroBatch.to`) does not block the host."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def micro_batch(rows) -> MicroBatch:
    """Stack rows from :func:`pack_row` (equal lengths) into a :class:`MicroBatch` (host
    tensors, :func:`host_tensor`); its ``positions_end`` read from the rows' positions."""
    tokens, labels, mask, positions, segments = zip(*rows)
    as_tensor = lambda arrays: host_tensor(np.stack(arrays))  # noqa: E731
    return MicroBatch(as_tensor(tokens), as_tensor(labels), as_tensor(mask),
                      as_tensor(positions), tuple(segments),
                      positions_end=int(max(p.max() for p in positions)) + 1)


def pack_micro_batches(docs: Sequence[np.ndarray], seq_length: int,
                       micro_batch_size: int = 1, multiple_of: int = 1) -> list[MicroBatch]:
    """The micro-batches of :func:`micro_batch_rows`, each row padded to ``seq_length``."""
    layout = micro_batch_rows([len(doc) - 1 for doc in docs], seq_length, micro_batch_size,
                              multiple_of)
    return [micro_batch([pack_row([docs[i] for i in row], pad_to=seq_length) for row in rows])
            for rows in layout]


def padding_fraction(batches: Sequence[MicroBatch]) -> float:
    """Share of the token slots of ``batches`` that hold padding (no loss token)."""
    slots = sum(batch.loss_mask.numel() for batch in batches)
    return 1.0 - sum(float(batch.loss_mask.sum()) for batch in batches) / max(slots, 1)


class MicroBatches:
    """An iterator over packed micro-batches that tells how much of the global batch's packing
    is padding (:attr:`padding_fraction`, for the step's report)."""

    def __init__(self, batches: Sequence[MicroBatch], padding: float):
        self._batches = iter(batches)
        self.padding_fraction = padding

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        return next(self._batches)


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor,
              loss_weights: torch.Tensor | None = None):
    """Megatron's 3-tuple ``(loss, tokens, {"lm loss": [sum, tokens]})`` of the per-token
    losses ``output``, the sum checked as Megatron's ``pretrain_gpt.py`` checks it
    (:mod:`megatron.plugin.loss_checks`).

    The loss is the sum over ``loss_mask``, or with ``loss_weights`` (Megatron's default loss
    over units that are not its micro-batches, :mod:`megatron.plugin.default_loss`) the
    weighted sum times the token count, which Megatron's ``forward_step`` divides by again.
    The reported sum is always the plain one: the logged ``lm loss`` is the per-token mean."""
    losses = output.float().view(-1)
    loss_sum = torch.sum(losses * loss_mask.view(-1).to(losses.dtype))
    num_tokens = loss_mask.sum().to(torch.int)
    validate_loss(loss_sum)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().to(torch.float)])
    loss = loss_sum
    if loss_weights is not None:
        loss = torch.sum(losses * loss_mask.view(-1).to(losses.dtype)
                         * loss_weights.view(-1).to(losses.dtype)) \
            * torch.clamp(num_tokens, min=1).to(losses.dtype)
    return loss, num_tokens, {"lm loss": report}


def eod_mask_token() -> int | None:
    """The input token whose positions carry no loss: the tokenizer's end-of-document token
    under ``--eod-mask-loss``; ``None`` without the flag, or outside a Megatron run (no parsed
    arguments: a loss computed by hand)."""
    try:
        args = get_args()
    except AssertionError:
        return None
    return get_tokenizer().eod if args.eod_mask_loss else None


def document_loss_mask(doc: np.ndarray) -> np.ndarray:
    """The loss mask of a document of ``n + 1`` tokens: ``n`` ones, a zero at each input
    ``--eod-mask-loss`` masks (as :func:`forward_step` masks it)."""
    eod = eod_mask_token()
    inputs = np.asarray(doc)[:-1]
    return np.ones(len(inputs)) if eod is None else (inputs != eod).astype(np.float64)


def loss_tokens(doc: np.ndarray) -> int:
    """The loss tokens of a document of ``n + 1`` tokens: its ``n`` inputs, less those
    ``--eod-mask-loss`` masks."""
    return int(document_loss_mask(doc).sum())


def forward_step(data_iterator, model, kv_store=None, record_kv=False):
    """Megatron ``forward_step_func``: next micro-batch through ``model`` (this rank's share of
    its tokens under Ulysses sequence parallelism; the layout stays whole), its loss masked at
    end-of-document inputs under ``--eod-mask-loss``. One of Megatron's micro-batches (no
    ``loss_weights``) under context parallelism and Megatron's default loss weighs its tokens
    as Megatron's own context-parallel split does (:mod:`megatron.plugin.context_loss`)."""
    batch: MicroBatch = next(data_iterator)
    device = next(model.parameters()).device
    batch = batch.to(device)
    layout = batch.layout(kv_store, record_kv)
    eod = eod_mask_token()
    if eod is not None:
        batch = replace(batch, loss_mask=batch.loss_mask
                        * (batch.tokens != eod).to(batch.loss_mask.dtype))
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        if batch.loss_weights is None and not get_model_config(model).calculate_per_token_loss:
            batch = replace(batch, loss_weights=megatron_share_weights(batch.loss_mask, cp))
        batch = batch.context_share(parallel_state.get_context_parallel_rank(), cp)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                   packed_seq_params=layout)
    return output, partial(loss_func, batch.loss_mask, loss_weights=batch.loss_weights)
