"""Dropout whose masks are a function of each token's identity, for the golden tests
(``golden_run.py --golden-keyed-dropout``): the pipeline run and the single-process reference
then drop the same entries, however the documents are packed, cut and placed.

A token is keyed by its position in its document, its input id and its label (what a micro-batch
holds for it in every layout: the reference runs each document alone, the schedules pack and
slice them); an entry of a dropout site by the token's key, the layer (0: the embedding,
Megatron's ``layer_number`` for a transformer layer), the site's index within that layer's
forward (attention's bias-dropout-add, then the MLP's) and the channel. The mask keeps an entry
where a 32-bit integer hash of that key, divided by 2^32, is at least the dropout probability,
and scales the kept ones by ``1 / (1 - p)``, as ``torch.nn.functional.dropout`` does.

Two tokens of different documents with the same position, input and label share their masks (on
both sides alike): the comparison stays exact; only the masks' independence is less than a
random generator's.

For the duration of :func:`keyed`:

* ``MicroBatch.layout`` gives the layout the micro-batch's token keys (``[b, s]``);
* ``GPTModel.forward`` (the embedding's dropout) and ``TransformerLayer.forward`` (a layer's,
  recomputed ones included: Megatron's recomputation calls the layer again with the same
  layout) make those keys and the layer the current dropout key for their duration;
* ``torch.nn.functional.dropout`` draws the keyed mask where a current key's ``[s, b]`` matches
  the input's first two dimensions, and fails otherwise: a dropout this module does not key
  would draw a mask the other side cannot.

* the document attention (``packed_attention``) runs a matrix-product kernel whose mask of a
  block keeps query ``i``'s probability of key position ``j`` at head ``h`` where the hash of
  (the query token's key, ``j``, the layer, the attention's site, ``h``) is at least the
  dropout probability; a segment's context blocks hold its document's positions from 0 on.

Helix runs its layer parts outside ``TransformerLayer.forward`` (:mod:`helix.program`); the
same keys are made current there:

* a boundary's part (``HelixProgram._boundary``: the embedding at boundary 0, else the
  post-attention of Megatron's layer ``index``, whose attention's bias-dropout-add and then the
  MLP's take sites 0 and 1 as in the layer's forward), its recomputation included;
* an attention part (``HelixProgram._attention_forward``: layer ``index + 1``), through the
  packed attention or, under recomputation without attention, :mod:`helix.attention`'s kernel;
* each chunk of the chunked MLP (``helix.program.chunked_mlp``) takes its rows of the keys,
  captured when the chunks first run, so its backward's recomputation keys them alike.

What it does not cover: the attention of SPPO's own paths and flash-attn's, and inputs split
over ranks (tensor, sequence or context parallelism: a rank holds a part of the rows or of the
heads); a dropout it cannot key fails.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools

import torch

from megatron.plugin.layers import context_attention, packed_attention
from megatron.plugin.layers.attention_kernels import CpuMath

_MASK = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B
_SEED = 0x9E3779B
#: The site of the attention's dropout (the hidden ones count from 0 in each layer).
_ATTENTION_SITE = 1 << 20

#: ``(keys [s, b], positions [s, b], layer, [next site])`` of the forward running now.
_current: contextvars.ContextVar = contextvars.ContextVar("keyed_dropout", default=None)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (in int64, no overflow: the multiplier is below 2^27)."""
    h = (((h >> 16) ^ h) * _MULTIPLIER) & _MASK
    h = (((h >> 16) ^ h) * _MULTIPLIER) & _MASK
    return (h >> 16) ^ h


def _combine(h: torch.Tensor, value) -> torch.Tensor:
    return _mix(h ^ _mix(torch.as_tensor(value, dtype=torch.int64) & _MASK))


def token_keys(position_ids: torch.Tensor, tokens: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    """Each token's key (``[b, s]``, int64 below 2^32)."""
    h = _combine(torch.full_like(position_ids, _SEED, dtype=torch.int64), position_ids)
    return _combine(_combine(h, tokens), labels)


def keyed_mask(keys: torch.Tensor, layer: int, site: int, channels: int) -> torch.Tensor:
    """The uniform draws in ``[0, 1)`` of ``keys`` (``[s, b]``) at ``(layer, site)``, one per
    channel: ``[s, b, channels]``, float64."""
    h = _combine(_combine(keys, layer), site).unsqueeze(-1)
    h = _combine(h, torch.arange(channels, dtype=torch.int64))
    return h.to(torch.float64) / float(_MASK + 1)


def attention_mask(query_keys: torch.Tensor, key_positions: torch.Tensor, layer: int,
                   heads: int, p: float) -> torch.Tensor:
    """The kept entries ``[1, heads, s, t]`` of a block's attention probabilities: query
    ``i`` (its token's key) and key position ``j`` of the same document, per head."""
    h = _combine(_combine(query_keys.view(-1, 1), key_positions.view(1, -1)), layer)
    h = _combine(_combine(h, _ATTENTION_SITE).unsqueeze(0),
                 torch.arange(heads, dtype=torch.int64).view(-1, 1, 1))
    return (h.to(torch.float64) / float(_MASK + 1) >= p).unsqueeze(0)


class _KeyedMath(CpuMath):
    """The matrix-product block kernel with the blocks' masks given (:attr:`masks`, one per
    block in the order the kernel is called); the mask is the state its backward replays."""

    def __init__(self, dropout: float, scale: float | None):
        super().__init__(dropout, scale)
        self.masks = iter(())

    def forward(self, q, k, v, causal: bool):
        p, lse = self._probabilities(q, k, causal)
        mask = next(self.masks).to(p.device)
        out = torch.matmul(self._keep(p, mask), v.to(p.dtype))
        return out.to(q.dtype), lse, mask

    def _keep(self, p, mask):
        return p * mask.to(p.dtype) / (1.0 - self.dropout)

    @staticmethod
    def _replayed(state, device):
        return state


#: ``[row, token range]`` of the segment the attention runs now.
_segment: list = [None, None]


def _segment_masks(query: torch.Tensor, blocks, p: float) -> list:
    """The masks of one segment's blocks: its context blocks hold the document's positions
    from 0 on, its own block the segment's."""
    current = _current.get()
    if current is None:
        raise RuntimeError("keyed dropout: an attention outside a keyed layer forward")
    keys, positions, layer, _ = current
    b, rows = _segment
    query_positions = positions[rows, b].to("cpu")
    lengths = [key.shape[2] for key, _, _ in blocks[:-1]]
    if lengths and sum(lengths) != int(query_positions[0]):
        raise RuntimeError(f"keyed dropout: context blocks of {lengths} tokens before a "
                           f"segment at position {int(query_positions[0])}")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    key_positions = [torch.arange(start, start + length)
                     for start, length in zip(starts, lengths)] + [query_positions]
    query_keys = keys[rows, b].to("cpu")
    return [attention_mask(query_keys, kp, layer, query.shape[1], p) for kp in key_positions]


def _keyed_kernel(block_kernel):
    @functools.wraps(block_kernel)
    def kernel(query, dropout, scale, backend="auto"):
        if dropout > 0.0 and _current.get() is not None:
            return _KeyedMath(dropout, scale)
        return block_kernel(query, dropout, scale, backend)
    return kernel


def _tracking(documents):
    @functools.wraps(documents)
    def tracked(*args, **kwargs):
        for b, rows, context in documents(*args, **kwargs):
            _segment[:] = [b, rows]
            yield b, rows, context
    return tracked


def _masked(merged_forward):
    @functools.wraps(merged_forward)
    def forward(kernel, query, blocks):
        if isinstance(kernel, _KeyedMath):
            kernel.masks = iter(_segment_masks(query, blocks, kernel.dropout))
        return merged_forward(kernel, query, blocks)
    return forward


@contextlib.contextmanager
def _keyed(layout, layer: int):
    keys = getattr(layout, "dropout_keys", None)
    if keys is None:
        yield
        return
    token = _current.set((keys.t(), layout.position_ids.t(), layer, [0]))
    try:
        yield
    finally:
        _current.reset(token)


def _dropout(original):
    @functools.wraps(original)
    def dropout(x, p=0.5, training=True, inplace=False):
        current = _current.get()
        if current is None or not training or p == 0.0:
            return original(x, p=p, training=training, inplace=inplace)
        keys, _, layer, site = current
        if x.dim() != 3 or tuple(x.shape[:2]) != tuple(keys.shape):
            raise RuntimeError(f"keyed dropout: an input of shape {tuple(x.shape)} under keys "
                               f"of {tuple(keys.shape)} (layer {layer}): a dropout this test "
                               "cannot key")
        kept = keyed_mask(keys.to("cpu"), layer, site[0], x.shape[-1]).to(x.device) >= p
        site[0] += 1
        return x * kept.to(x.dtype) / (1.0 - p)
    return dropout


def _with_layer_key(forward, layer_of):
    @functools.wraps(forward)
    def keyed_forward(self, *args, **kwargs):
        with _keyed(kwargs.get("packed_seq_params"), layer_of(self)):
            return forward(self, *args, **kwargs)
    return keyed_forward


def _with_keys(layout):
    @functools.wraps(layout)
    def keyed_layout(batch, *args, **kwargs):
        packed = layout(batch, *args, **kwargs)
        packed.dropout_keys = token_keys(batch.position_ids, batch.tokens, batch.labels)
        return packed
    return keyed_layout


def _helix_boundary(boundary):
    @functools.wraps(boundary)
    def keyed_boundary(self, unit, index, leaves):
        with _keyed(self.batches.batches[unit].layout(), index):
            return boundary(self, unit, index, leaves)
    return keyed_boundary


def _helix_attention(attention_forward):
    from helix.schedule import part_index

    @functools.wraps(attention_forward)
    def keyed_attention(self, action, inputs):
        with _keyed(self.batches.batches[action.unit].layout(), part_index(action.part) + 1):
            return attention_forward(self, action, inputs)
    return keyed_attention


def _chunk_keyed(chunked_mlp):
    @functools.wraps(chunked_mlp)
    def keyed_chunks(block, hidden, rows):
        current = _current.get()
        if current is None:
            return chunked_mlp(block, hidden, rows)
        keys, positions, layer, site = current
        first, chunks, calls = site[0], -(-hidden.shape[0] // rows), itertools.count()

        def keyed_block(piece):
            # Every pass (the forward's, the backward's recomputation) runs the chunks in order.
            start = next(calls) % chunks * rows
            rows_of = slice(start, start + rows)
            chunk_site = [first]
            token = _current.set((keys[rows_of], positions[rows_of], layer, chunk_site))
            try:
                return block(piece)
            finally:
                _current.reset(token)
                site[0] = chunk_site[0]
        return chunked_mlp(keyed_block, hidden, rows)
    return keyed_chunks


def _patches() -> list:
    """``(owner, attribute, wrapper)`` of every function :func:`keyed` wraps."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from helix import attention as helix_attention
    from helix import program as helix_program
    from megatron.plugin.batches import MicroBatch

    return [
        (MicroBatch, "layout", _with_keys),
        (GPTModel, "forward", lambda forward: _with_layer_key(forward, lambda model: 0)),
        (TransformerLayer, "forward",
         lambda forward: _with_layer_key(forward, lambda layer: layer.layer_number)),
        (torch.nn.functional, "dropout", _dropout),
        (packed_attention, "block_kernel", _keyed_kernel),
        (packed_attention, "_documents", _tracking),
        (context_attention, "merged_forward", _masked),
        (helix_program.HelixProgram, "_boundary", _helix_boundary),
        (helix_program.HelixProgram, "_attention_forward", _helix_attention),
        (helix_program, "chunked_mlp", _chunk_keyed),
        (helix_attention, "block_kernel", _keyed_kernel),
    ]


@contextlib.contextmanager
def keyed():
    """Key every hidden dropout of this process for the duration (see the module's
    docstring)."""
    patches = _patches()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, wrapper in patches:
        setattr(owner, name, wrapper(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
