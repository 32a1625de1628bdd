"""A load-balancing loss of the project's own, ``--moe-per-document-aux-loss-coeff``: the formula
of Megatron's auxiliary loss (``aux_loss``) over each document's own tokens, for the schedules
whose router calls are document chunks (``elastic``, ``seq1f1b``), which cannot compute
Megatron's per micro-batch and refuse ``--moe-aux-loss-coeff``: :class:`DocumentRouter` and the
layer that hands it its call's layout (:class:`DocumentRoutedLayer`). The coefficient reaches
the router as the config's ``moe_aux_loss_coeff`` (:func:`megatron.plugin.model.model_config`).

Definition, per MoE layer. Megatron's router applies the Switch Transformer's formula to the
tokens of one call, which its schedules make once per micro-batch. Here it is applied to the
real tokens of each document ``d`` of the step alone (no padding), ``T_d`` of them:

    aux_d = E / (k x T_d^2) x sum_e P_{d,e} x N_{d,e}

with ``E`` experts, top-``k`` routing, ``P_{d,e}`` the sum over ``d``'s tokens of expert
``e``'s score (Megatron's ``compute_routing_scores_for_aux_loss``) and ``N_{d,e}`` how many of
them route to ``e`` (no gradient through ``N``, as in Megatron). The step's term is
``coeff x sum_d w_d x aux_d``:

* ``--calculate-per-token-loss``: ``w_d = T_d / L``, ``L`` the step's loss tokens. Megatron
  attaches a micro-batch's loss times the micro-batch's routed tokens and its finalize step
  divides every gradient by ``L``; here each document is attached times its own tokens.
* Megatron's default loss: ``w_d = DP / G``, ``G`` the documents of the global batch
  (``--global-batch-size`` counts documents) and ``DP`` the data-parallel replicas: after
  DDP's average over the replicas, the mean of ``aux_d`` over the global batch's documents,
  whichever replica computes which. Megatron weighs each micro-batch's by ``1 / M``, ``M``
  its micro-batches per replica.

Both equal Megatron's value whenever each of Megatron's micro-batches holds exactly one
document without padding (its tokens are then the document's, and ``M = G / DP``). Otherwise
Megatron's value depends on how it packs the documents and this one does not: it is the same
however a schedule cuts and packs them. The logged ``load_balancing_loss`` (Megatron's
tracker, which the training log divides by Megatron's number of micro-batches ``M`` and
averages over the replicas) is recorded as ``aux_d x M x DP / G`` per document, so that it
shows the mean of ``aux_d`` over the documents under either loss. Only ``aux_loss`` is built
(the start-up refuses the other balancing types).

Tensor (sequence) and context parallelism: a router call then holds one contiguous part of
each row, the ranks of Megatron's ``tp_cp_group`` the others: context-parallel rank ``c``
holds the ``c``-th of ``CP`` contiguous shares of the row
(:meth:`~megatron.plugin.batches.MicroBatch.context_share`), and under sequence parallelism
tensor-parallel rank ``t`` the ``t``-th contiguous part of that share (Megatron's scatter to
the sequence-parallel region). Each call lists every document of its rows (the same list on
each rank of the group), counts the routings of the tokens it holds and sums the counts over
the group, as Megatron's router sums its call's ``tokens_per_expert``; ``P`` stays the call's
own (each token's gradient needs only ``N``), and the logged value, a sum over the group's
calls like Megatron's, adds up the parts.

Runtime. Each call learns its rows' segments from the layout the layer passes (the same
:class:`~megatron.plugin.layers.layout.PackedDocuments` every attention gets). A whole
document's ``N`` and ``P`` are the call's own. A document cut into slices runs them in separate
calls: each slice's forward adds its tokens' ``N`` and ``P`` into a per-layer store under the
document's key (also a forward without autograd, as checkpointed layers run, so that the counts
exist before any backward); a recomputed forward (the ``RECOMPUTE`` of per-chunk
checkpointing) is recognised by its layout object and counts nothing again. The gradient of a
slice's scores, ``coeff x w_d x E / (k x T_d^2) x N_{d,e}`` on each of its tokens (times the
loss scale of ``grad_scale_func``), is computed at that slice's backward from the store: the
document schedules run every slice's forward before the first of the document's backwards (a
slice's backward needs the K/V gradients of all later slices, whose forwards need its K/V), and
a backward that finds the document's counts incomplete raises. The backward of slice 0, the
document's last, logs its value and releases its entry; an entry a new step's slice 0 finds
still held means a backward was missing, and raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (get_current_global_batch_size,
                                                       get_num_microbatches)
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer


@dataclass
class _Document:
    """One document (or slice of one) in a router call."""

    key: object
    """The document's key in the store (``None``: the call holds the whole document)."""
    slice_index: int
    tokens: int
    """``T_d``: the whole document's tokens."""
    length: int
    """The tokens of it this call holds."""
    counts: torch.Tensor | None = None
    """``N_d`` and ``P_d`` (detached) of a whole document; a slice's are in the store."""
    scores: torch.Tensor | None = None


@dataclass
class _Entry:
    """A split document's counts and score sums so far, at one layer."""

    counts: torch.Tensor
    scores: torch.Tensor
    tokens: int
    counted: dict = field(default_factory=dict)
    """Slice index -> the layout whose forward counted it (and its token count)."""

    @property
    def complete(self) -> bool:
        return sum(n for _, n in self.counted.values()) == self.tokens


@dataclass
class _Call:
    owner: torch.Tensor
    """Per routed token, the index of its document in ``documents`` (-1: padding)."""
    documents: list


class DocumentRouter(TopKRouter):
    """Megatron's top-k router with its ``aux_loss`` per document (module docstring); the
    routing itself is Megatron's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layout = None
        """The :class:`PackedDocuments` of the current call (set by the layer)."""
        self._store: dict[object, _Entry] = {}

    def routing(self, logits: torch.Tensor, padding_mask=None):
        """Megatron's routing; a training forward without autograd still counts its
        documents' routings (their backward comes after a recomputation)."""
        if self.training and not torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routed, scores = compute_routing_scores_for_aux_loss(
                logits.reshape(-1, self.config.num_moe_experts), self.topk, self.score_function,
                fused=self.config.moe_router_fusion)
            self._count(scores, routed)
        return super().routing(logits, padding_mask=padding_mask)

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """Counts the call's documents and attaches the per-document gradient to ``probs``
        (in place of Megatron's per-call loss)."""
        if self.get_aux_loss_coeff("aux_loss") == 0:
            return probs
        call = self._count(scores_for_aux_loss.detach(), routing_map)
        return _DocumentAuxGradient.apply(probs, scores_for_aux_loss, self, call)

    def _count(self, scores: torch.Tensor, routed: torch.Tensor) -> _Call:
        layout = self.layout
        if layout is None or not layout.segments:
            raise RuntimeError(f"MoE layer {self.layer_number}: the per-document auxiliary loss "
                               f"needs the call's document layout (PackedDocuments with "
                               f"segments)")
        rows = len(layout.segments)
        held = scores.shape[0] // rows
        group, part = self._row_part()
        parts = group.size()
        length = max(segment.stop for segments in layout.segments for segment in segments)
        if held * parts != length:
            raise RuntimeError(f"MoE layer {self.layer_number}: a router call holds {held} "
                               f"positions of each {length}-token row, not 1/{parts} of it")
        first, last = part * held, (part + 1) * held
        owner = torch.full((scores.shape[0],), -1, dtype=torch.long)
        documents: list[_Document] = []
        for row, segments in enumerate(layout.segments):
            for segment in segments:
                if segment.padding:
                    continue
                if segment.doc_key is not None and not segment.doc_tokens:
                    raise RuntimeError(
                        f"MoE layer {self.layer_number}: slice {segment.slice_index} of document "
                        f"{segment.doc_key!r} carries no document length (Segment.doc_tokens); "
                        f"the per-document auxiliary loss needs it")
                start, stop = max(segment.start, first) - first, min(segment.stop, last) - first
                if start < stop:
                    owner[start * rows + row:stop * rows:rows] = len(documents)
                documents.append(_Document(segment.doc_key, segment.slice_index,
                                           segment.doc_tokens or segment.length,
                                           segment.length))
        keys = [doc.key for doc in documents if doc.key is not None]
        if len(keys) != len(set(keys)):
            raise RuntimeError(f"MoE layer {self.layer_number}: a call holds two slices of one "
                               f"document; each slice needs a call of its own")
        owner = owner.to(scores.device)
        valid = owner >= 0
        counts = torch.zeros(len(documents), scores.shape[1], dtype=torch.float32,
                             device=scores.device)
        sums = torch.zeros_like(counts)
        counts.index_add_(0, owner[valid], routed[valid].float())
        sums.index_add_(0, owner[valid], scores[valid].float())
        if parts > 1:
            torch.distributed.all_reduce(counts, group=group)
        for index, doc in enumerate(documents):
            if doc.key is None:
                doc.counts, doc.scores = counts[index], sums[index]
            else:
                self._add_slice(doc, counts[index], sums[index], layout)
        return _Call(owner, documents)

    def _row_part(self) -> tuple:
        """``(group, part)``: the ranks that hold the contiguous parts of each row, one each
        (``tp_cp_group`` under sequence parallelism, else ``cp_group``), and which part this
        rank holds (module docstring)."""
        if self.config.sequence_parallel and self.tp_group.size() > 1:
            tp = self.tp_group.size()
            return self.tp_cp_group, self.cp_group.rank() * tp + self.tp_group.rank()
        return self.cp_group, self.cp_group.rank()

    def _add_slice(self, doc: _Document, counts, sums, layout) -> None:
        entry = self._store.get(doc.key)
        if doc.slice_index == 0 and entry is not None and \
                entry.counted.get(0, (None,))[0] is not layout:
            raise RuntimeError(
                f"MoE layer {self.layer_number}: routing counts of document {doc.key!r} from "
                f"an earlier step were never released: a slice's backward is missing")
        if entry is None:
            if doc.slice_index != 0:
                raise RuntimeError(
                    f"MoE layer {self.layer_number}: slice {doc.slice_index} of document "
                    f"{doc.key!r} ran its forward before slice 0")
            entry = self._store[doc.key] = _Entry(torch.zeros_like(counts),
                                                  torch.zeros_like(sums), doc.tokens)
        seen = entry.counted.get(doc.slice_index)
        if seen is not None:
            if seen[0] is not layout:
                raise RuntimeError(f"MoE layer {self.layer_number}: slice {doc.slice_index} of "
                                   f"document {doc.key!r} ran two forwards in one step")
            return
        entry.counts += counts
        entry.scores += sums
        entry.counted[doc.slice_index] = (layout, doc.length)

    def _scores_gradient(self, call: _Call, dtype, device) -> torch.Tensor:
        """The gradient of the call's scores: per token, its document's ``coeff x w_d x E /
        (k x T_d^2) x N_d`` times the loss scale; logs and releases the documents whose slice
        0 (or whole self) this call holds."""
        config = self.config
        experts, topk = config.num_moe_experts, self.topk
        coeff = self.get_aux_loss_coeff("aux_loss")
        loss_scale = 1.0
        if config.grad_scale_func is not None:
            loss_scale = config.grad_scale_func(torch.ones(1, device=device))
        replicas = parallel_state.get_data_parallel_world_size()
        documents = get_current_global_batch_size()
        log_weight = get_num_microbatches() * replicas / documents
        rows = []
        for doc in call.documents:
            counts, sums = doc.counts, doc.scores
            if doc.key is not None:
                entry = self._store.get(doc.key)
                if entry is None or not entry.complete:
                    raise RuntimeError(
                        f"MoE layer {self.layer_number}: the backward of slice "
                        f"{doc.slice_index} of document {doc.key!r} came before the forwards "
                        f"of all its slices; the per-document auxiliary loss needs them first")
                counts, sums = entry.counts, entry.scores
                if doc.slice_index == 0:
                    del self._store[doc.key]
            per_token = experts / (topk * doc.tokens ** 2)
            weight = doc.tokens if config.calculate_per_token_loss else replicas / documents
            rows.append(counts * (coeff * per_token * weight))
            if doc.slice_index == 0:
                _track("load_balancing_loss", torch.sum(sums * counts) * per_token * log_weight,
                       self.layer_number, config.num_layers, self.tp_cp_group)
        table = torch.stack(rows) * loss_scale
        grad = table[call.owner.clamp(min=0)] * (call.owner >= 0).unsqueeze(1)
        return grad.to(dtype)


def _track(name: str, value: torch.Tensor, layer_number: int, num_layers: int, group) -> None:
    """Add ``value`` to Megatron's auxiliary-loss tracker at ``layer_number``, summed over
    ``group`` and averaged over the data-parallel replicas when reported (megatron-core
    0.19's metrics tracker, or 0.17's tracker function)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker
        save_to_aux_losses_tracker(name, value, layer_number, num_layers, reduce_group=group)
        return
    get_moe_metrics_tracker().record(name, value, layer_number, num_layers, reduce_group=group)


class _DocumentAuxGradient(torch.autograd.Function):
    """Identity on ``probs``; at the backward, the per-document gradient of ``scores``."""

    @staticmethod
    def forward(ctx, probs, scores, router: DocumentRouter, call: _Call):
        ctx.router, ctx.call = router, call
        ctx.dtype, ctx.device = scores.dtype, scores.device
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        return (grad_probs, ctx.router._scores_gradient(ctx.call, ctx.dtype, ctx.device), None,
                None)


class DocumentRoutedLayer(TransformerLayer):
    """Megatron's transformer layer that hands its :class:`DocumentRouter` the call's layout
    (``packed_seq_params``) for the duration of each forward."""

    def forward(self, *args, **kwargs):
        router = self.mlp.router
        router.layout = kwargs.get("packed_seq_params")
        try:
            return super().forward(*args, **kwargs)
        finally:
            router.layout = None
