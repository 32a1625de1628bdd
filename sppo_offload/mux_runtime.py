"""``--sppo-multiplex``: the multiplexed schedule of :mod:`sppo_offload.multiplex`, run for real.

:class:`MultiplexProgram` is the executor's part program for the ``.mux<k>`` actions; the
steady subsequences run whole-stage beside it (the executor runs exactly the IR that
:func:`~sppo_offload.multiplex.multiplexed_schedule` validated and the simulator prices).

A share of ``u0`` on block ``k`` (member ``k + i`` of ``G_k = {k, ..., p-1}``, the token range
:func:`~sppo_offload.multiplex.share_bounds` gives):

- **Owner** (stage ``k``): Megatron's ``forward_step`` over its own model with the range's row
  (positions at their true offsets) and, after block 0, the pieces it received concatenated in
  token order as the stage input; block ``p - 1`` is stage ``p - 1`` alone, the plain forward
  of ``u0`` with the loss. Its backward is the chunk backward of the executor
  (:func:`~megatron.plugin.pipeline.chunks.chunk_backward`): the output and ``u0``'s K/V
  recorded in the K/V store (with the dK/dV the steady backwards accumulated) as roots.
- **Helper** (stage ``h > k``): its own layer modules run with the owner's tensors
  (``torch.func.functional_call``); for block 0 the embedding of its range is computed from
  the shipped word (and learned position) tables as Megatron's ``LanguageModelEmbedding`` does
  with one tensor-parallel rank (their sum, MuP's ``mup_embedding_mult`` under ``--use-mup``,
  dropout; the runtime refuses multiplexing with TP or CP > 1).

Collectives, over the process group of ``G_k`` (one per block and pipeline, made once by
every rank, :func:`block_groups`), always in this order on every member: at the start of a
Left-SP share the owner broadcasts the block's parameters as one flat buffer (its layout,
the embedding tables' rows included, from the model's shape: no header to read back); in every layer :class:`GroupShare` all-gathers
the range's K/V (an all-reduce of a zero-filled ``u0``-sized buffer, exact: the other ranges
add zeros), whose backward all-reduces the gradient and keeps the range's slice; at the end of
a Right-SP share the helpers' weight gradients are reduced (summed) into the owner, which
hands them to autograd with its parameters as roots, so they accumulate into ``main_grad``
through Megatron DDP's hooks exactly as its own. Every member's autograd graph of a share has
the same per-layer gather nodes, visited last layer first, so the backward all-reduces pair up.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron.plugin.layers.layout import Segment
from megatron.plugin.batches import MicroBatch
from megatron.plugin.pipeline.group_cache import cached_groups
from megatron.plugin.pipeline.chunks import DocumentChunks, chunk_backward
from megatron.plugin.pipeline.extension import run_backward
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.param_gather import wait_for_parameters

from sppo_offload.multiplex import (MultiplexFlow, block_of, grad_name, mux, piece_name,
                                    pieces, share_bounds)


class _GatherRanges(torch.autograd.Function):
    """``[2, t, ...]`` of one member -> ``[2, tokens, ...]`` of the group (module doc)."""

    @staticmethod
    def forward(ctx, local, start, tokens, group):
        full = local.new_zeros((local.shape[0], tokens, *local.shape[2:]))
        full[:, start:start + local.shape[1]] = local
        dist.all_reduce(full, group=group)
        ctx.start, ctx.count, ctx.group = start, local.shape[1], group
        return full

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.start:ctx.start + ctx.count], None, None, None


class GroupShare:
    """One member's range ``[start, ...)`` of a ``tokens``-token slice whose K/V the group
    gathers layer by layer; an owner (``store`` given) records the gathered K/V as the slice's
    ``(doc_key, 0)`` in its K/V store."""

    def __init__(self, group, start: int, tokens: int, store=None, doc_key=None):
        self.group, self.start, self.tokens = group, start, tokens
        self.store, self.doc_key = store, doc_key

    def context(self, key, value, layer: int) -> list:
        full = _GatherRanges.apply(torch.stack([key, value]), self.start, self.tokens,
                                   self.group)
        full_key, full_value = full[0], full[1]
        if self.store is not None:
            self.store.record(self.doc_key, 0, layer, full_key, full_value)
        if self.start == 0:
            return []
        return [(full_key[:self.start], full_value[:self.start])]


@cached_groups(maxsize=4)
def block_groups(pp_ranks: tuple[int, ...]) -> dict[int, tuple[object, tuple[int, ...]]]:
    """``block -> (process group, global ranks)`` of ``G_block`` for the pipeline of
    ``pp_ranks``, for the blocks of two members or more. Every rank takes part in creating the
    groups of every pipeline (``new_group`` requires it)."""
    pipelines = [None] * dist.get_world_size()
    dist.all_gather_object(pipelines, pp_ranks)
    mine = {}
    for ranks in sorted(set(pipelines)):
        for block in range(len(ranks) - 1):
            group = dist.new_group(list(ranks[block:]))
            if ranks == pp_ranks:
                mine[block] = (group, ranks[block:])
    return mine


class MultiplexProgram:
    """The shares of ``u0`` on one stage (module doc): a
    :class:`~megatron.plugin.pipeline.parts.PartProgram`."""

    flow = MultiplexFlow()

    def __init__(self, *, model, u0: MicroBatch, doc_key, stage: int, pp: int, groups: dict,
                 chunks: DocumentChunks, forward_step_func, forward_data_store: list,
                 num_microbatches: int, forward_only: bool, collect_non_loss_data: bool):
        self.model = model
        self.gpt = get_attr_wrapped_model(model, "decoder", return_model_obj=True)
        self.config = get_model_config(model)
        self.u0, self.doc_key, self.stage, self.pp = u0, doc_key, stage, pp
        self.tokens = u0.seq_length
        self.groups, self.chunks = groups, chunks
        self.step_func = functools.partial(forward_step_func, kv_store=chunks.kv_store,
                                           record_kv=True)
        self.store = forward_data_store
        self.num_microbatches = num_microbatches
        self.training = not forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.stash: dict[int, tuple] = {}

    # The executor's interface.
    def forward(self, action: Action, inputs: dict):
        k = block_of(action)
        start, stop = self._range(k)
        given = None
        if k > 0:
            given = torch.cat([inputs.pop(piece_name(s, t))
                               for s, t, _, _ in pieces(self.tokens, self.pp, k - 1)
                               if t == self.stage])
            given = given.detach().requires_grad_(self.training)
        if k == self.pp - 1:
            batch, share = self.u0, None
        else:
            group = self.groups[k][0]
            share = GroupShare(group, start, self.tokens,
                               self.chunks.kv_store if self.stage == k else None, self.doc_key)
            u0 = self.u0
            cut = slice(start, stop)
            weights = None if u0.loss_weights is None else u0.loss_weights[:, cut]
            batch = MicroBatch(u0.tokens[:, cut], u0.labels[:, cut], u0.loss_mask[:, cut],
                               u0.position_ids[:, cut], ((Segment(0, stop - start),),), share,
                               weights, positions_end=u0.positions_end)
        borrowed = None if share is None else self._share_weights(k)
        grad = contextlib.nullcontext() if self.training else torch.no_grad()
        with grad:
            if self.stage == k:
                output, tokens = megatron_schedules.forward_step(
                    self.step_func, iter([batch]), self.model, self.num_microbatches, given,
                    self.store, self.config, cp_group_size=1,
                    collect_non_loss_data=self.collect_non_loss_data,
                    current_microbatch=0, is_last_stage=k == self.pp - 1)
            else:
                output, tokens = self._helper_forward(k, batch, given, borrowed), 0
        if self.training:
            self.stash[k] = (given, output, borrowed)
        made = [(Kind.FORWARD, mux(k + 1), piece_name(s, t),
                 output[lo - start:hi - start].detach())
                for s, t, lo, hi in (pieces(self.tokens, self.pp, k) if k < self.pp - 1 else ())
                if s == self.stage]
        return made, tokens

    def backward(self, action: Action, grads: dict):
        k = block_of(action)
        start, _ = self._range(k)
        given, output, borrowed = self.stash.pop(k)
        output_grad = None
        if k < self.pp - 1:
            output_grad = torch.cat([grads.pop(grad_name(s, t))
                                     for s, t, _, _ in pieces(self.tokens, self.pp, k)
                                     if s == self.stage])
        if self.stage == k:
            input_grad = chunk_backward(self.chunks, 0, given, output, output_grad, None,
                                        self.config)
        else:
            run_backward([output], [output_grad])
            input_grad = None if given is None else given.grad
        del output
        if borrowed is not None:
            self._reduce_weight_grads(k, borrowed)
        made = []
        if k > 0:
            made = [(Kind.BACKWARD, mux(k - 1), grad_name(s, t), input_grad[lo - start:hi - start])
                    for s, t, lo, hi in pieces(self.tokens, self.pp, k - 1) if t == self.stage]
        return made, 0

    def recompute(self, action: Action):
        raise ValueError(f"{action}: multiplexed shares are not recomputed")

    # The shares.
    def _range(self, block: int) -> tuple[int, int]:
        return share_bounds(self.tokens, self.pp, block)[self.stage - block]

    def _owned(self, block: int) -> list:
        """The owner's parameters of ``block`` in shipping order (its embedding tables first,
        :meth:`_table_rows`), once their all-gather after the optimizer's step is in
        (:func:`wait_for_parameters`, as the modules' own forwards would wait)."""
        layers = self.gpt.decoder.layers
        embedding = self.gpt.embedding if block == 0 else None
        wait_for_parameters([*layers.modules(), *(embedding.modules() if embedding else ())])
        tensors = []
        if embedding is not None:
            tensors.append(embedding.word_embeddings.weight)
            positions = getattr(embedding, "position_embeddings", None)
            if positions is not None:
                tensors.append(positions.weight)
        if [t.shape[0] for t in tensors] != [rows for rows in self._table_rows(block) if rows]:
            raise RuntimeError(f"block {block}'s embedding tables have "
                               f"{[t.shape[0] for t in tensors]} rows, the model's shape says "
                               f"{self._table_rows(block)}")
        tensors += [p for _, p in layers.named_parameters()]
        return tensors

    def _table_rows(self, block: int) -> tuple[int, int]:
        """Rows of the word and the learned position embedding table that block ``block``
        ships (0: none), from the model's shape, which every rank of the group knows:
        Megatron's vocabulary split over the tensor-parallel ranks, and
        ``--max-position-embeddings`` rows under learned absolute positions."""
        if block != 0:
            return 0, 0
        words = self.gpt.vocab_size // self.config.tensor_model_parallel_size
        learned = self.gpt.position_embedding_type == "learned_absolute"
        return words, self.gpt.max_sequence_length if learned else 0

    def _share_weights(self, block: int):
        """Broadcast ``block``'s parameters (:meth:`_owned`) from its owner, as one flat
        tensor whose layout every rank knows from the model's shape. A helper gets ``(all
        leaves, layer parameters by layer, embedding tables)``, the owner ``(its parameters,
        None, None)``."""
        group, ranks = self.groups[block]
        owner = ranks[0]
        if self.stage == block:
            tensors = self._owned(block)
            dist.broadcast(torch.cat([t.detach().reshape(-1) for t in tensors]), owner,
                           group=group)
            return tensors, None, None
        hidden = self.config.hidden_size
        shapes = [(rows, hidden) for rows in self._table_rows(block) if rows]
        named = list(self.gpt.decoder.layers.named_parameters())
        shapes += [tuple(p.shape) for _, p in named]
        reference = named[0][1]
        flat = torch.empty(sum(torch.Size(s).numel() for s in shapes), dtype=reference.dtype,
                           device=reference.device)
        dist.broadcast(flat, owner, group=group)
        leaves, offset = [], 0
        for shape in shapes:
            size = torch.Size(shape).numel()
            leaves.append(flat[offset:offset + size].view(shape).detach()
                          .requires_grad_(self.training))
            offset += size
        tables = leaves[:len(leaves) - len(named)]
        layers: dict[int, dict] = {}
        for (name, _), leaf in zip(named, leaves[len(tables):]):
            index, _, rest = name.partition(".")
            layers.setdefault(int(index), {})[rest] = leaf
        return leaves, layers, tables

    def _helper_forward(self, block: int, batch: MicroBatch, given, borrowed):
        _, layers, tables = borrowed
        if block == 0:
            hidden = F.embedding(batch.tokens, tables[0])
            if len(tables) > 1:
                hidden = hidden + F.embedding(batch.position_ids, tables[1])
            hidden = hidden.transpose(0, 1).contiguous()
            if self.config.use_mup and self.config.mup_embedding_mult != 1.0:
                hidden = hidden * self.config.mup_embedding_mult
            hidden = F.dropout(hidden, self.config.hidden_dropout, self.gpt.training)
        else:
            hidden = given
        layout = batch.layout()
        for index, layer in enumerate(self.gpt.decoder.layers):
            hidden, _ = torch.func.functional_call(
                layer, layers[index], (),
                {"hidden_states": hidden, "attention_mask": None, "packed_seq_params": layout})
        return hidden

    def _reduce_weight_grads(self, block: int, borrowed) -> None:
        """Sum the helpers' weight gradients into the owner's parameters (module doc)."""
        group, ranks = self.groups[block]
        leaves = borrowed[0]
        if self.stage == block:
            flat = torch.zeros(sum(t.numel() for t in leaves), dtype=leaves[0].dtype,
                               device=leaves[0].device)
            dist.reduce(flat, ranks[0], group=group)
            grads, offset = [], 0
            for tensor in leaves:
                grads.append(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
            run_backward(leaves, grads)
        else:
            flat = torch.cat([(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                              .reshape(-1) for leaf in leaves])
            dist.reduce(flat, ranks[0], group=group)
