"""Core attention for packed documents with optional K/V context, and its layer spec.

Every schedule (Megatron's own included) feeds the model *packed* micro-batches: several
documents concatenated in one row, each attending causally only to itself, with positions that
restart at 0 per document. A document cut into slices (elastic chunks, SPPO subsequences) also
attends to the K/V of its earlier slices, held in a
:class:`~megatron.plugin.layers.kv_store.KVStore`.

How the batch layout reaches the attention: :class:`PackedDocuments` is a ``PackedSeqParams``
(Megatron passes that object untouched from ``GPTModel.forward`` down to every core attention)
with ``qkv_format="sbhd"``, so no Megatron code path treats it as THD.

Positions: learned-absolute embeddings take the true ``position_ids`` through ``GPTModel``.
RoPE is applied *here*, at the true positions (``PackedDocuments.position_ids``), with the
frequency table of Megatron's own ``RotaryEmbedding`` (same base, percent and interleaving);
the ``GPTModel`` is therefore built with ``position_embedding_type="none"`` when RoPE is asked
for. RoPE has no parameters, so checkpoints are unaffected. K/V are stored after RoPE, so context
keys carry their true positions.

Ulysses sequence parallelism (``--context-parallel-size > 1`` under the document-level
schedules): every rank of Megatron's context-parallel group holds a contiguous ``1/cp`` of the
row's tokens (:meth:`~megatron.plugin.batches.MicroBatch.context_share`); the attention trades
that split for a split of the heads with one all-to-all each for Q, K and V (Megatron's
``all_to_all_sp2hp``, autograd-aware), attends over the whole row for its ``heads/cp`` heads --
the document layout and the K/V store see whole rows, so slicing and packing work unchanged --
and trades back with one all-to-all of the output.

Backends. Every row runs :mod:`megatron.plugin.layers.packed_attention`: consecutive whole
documents of a row in one kernel call (:mod:`megatron.plugin.layers.document_batches`), and
each segment with context over its K/V context blocks (a later slice: each earlier slice's K/V
as the store holds it; a multiplexed share: what the share returns) and causally over its own
keys, one kernel call per block merged by log-sum-exp
(:mod:`megatron.plugin.layers.context_attention`), into one output buffer that the output
projection saves as its input too. No concatenated copy of the
context and no ``[s, c+s]`` mask exists, on every device, with dropout and grouped-query heads
alike (:mod:`megatron.plugin.layers.attention_kernels` picks the kernel). On CUDA a row without
context runs flash-attn varlen instead, once per packed row with the row's documents as
``cu_seqlens``, when it is importable, the inputs are fp16 or bf16 (fp32 falls back, with a
warning) and ``--attention-backend`` is ``auto`` or ``flash``; under ``--deterministic-mode``
(``torch.use_deterministic_algorithms(True)``) it runs its deterministic backward.
``--attention-backend`` picks the block kernel (``fused``: torch's memory-efficient operator,
``unfused``: the matrix products) as
:func:`~megatron.plugin.layers.attention_kernels.block_kernel` documents.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule

from megatron.plugin.layers import packed_attention
from megatron.plugin.layers.layout import PackedDocuments, Segment

try:  # optional GPU backend
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeSettings:
    """RoPE applied inside the core attention (see module docstring)."""

    rotary_base: int = 10000
    rotary_percent: float = 1.0
    seq_len_interpolation_factor: float | None = None


def _has_context(layout) -> bool:
    """Whether some segment of ``layout`` attends to K/V outside the micro-batch (a later
    slice of a document, or a multiplexed share)."""
    return layout is not None and (layout.share is not None or any(
        seg.slice_index > 0 for row in layout.segments for seg in row))


def _last_without_graph(seg: Segment, context: list, key: torch.Tensor) -> bool:
    """Whether ``seg`` is its document's last slice (its context and its own tokens make the
    whole document) and its forward builds no graph (a checkpointed forward): no later slice
    reads its K/V and its recomputation records them with their graph, so the store keeps
    nothing of it until then."""
    return (not key.requires_grad and bool(seg.doc_tokens)
            and sum(block.shape[0] for block, _ in context) + key.shape[0] == seg.doc_tokens)


class DocumentAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron's ``SelfAttention`` (``ModuleSpec`` submodule).

    Inputs are ``[s, b, heads, dim]`` query/key/value for this tensor-parallel rank; output is
    ``[s, b, heads*dim]``. Without ``PackedDocuments`` each row is one causal sequence.
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, rope: RopeSettings | None = None):
        super().__init__(config=config)
        del attn_mask_type, attention_type, cp_comm_type, pg_collection
        self.layer_number = layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.backend = attention_backend(config)
        self.rope = None
        self._rope_table = None
        if rope is not None:
            self.rope = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rope.rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=rope.seq_len_interpolation_factor,
                rotary_base=rope.rotary_base,
                use_cpu_initialization=True,
            )

    # ----------------------------------------------------------------------------- positions
    def _rope_freqs(self, position_ids: torch.Tensor, needed: int, device) -> torch.Tensor:
        """``[s, b, 1, dim]`` rotary angles at the given true positions, all below
        ``needed``."""
        if self._rope_table is None or self._rope_table.shape[0] < needed \
                or self._rope_table.device != device:
            size = max(needed, 2 * (0 if self._rope_table is None else self._rope_table.shape[0]))
            self.rope.inv_freq = self.rope.inv_freq.to(device, non_blocking=True)
            freqs = self.rope.get_freqs_non_repeated(size)
            if self.config.rotary_interleaved:
                table = torch.stack((freqs, freqs), dim=-1).view(size, -1)
            else:
                table = torch.cat((freqs, freqs), dim=-1)
            self._rope_table = table
        return self._rope_table[position_ids.to(device, non_blocking=True)].transpose(0, 1) \
            .unsqueeze(2)

    def _apply_rope(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=self.config.rotary_interleaved)

    def rotate(self, query, key, layout: PackedDocuments | None):
        """``query``/``key`` (``[s, b, heads, dim]``) with RoPE at the layout's true positions
        (from 0 per row without a layout); unchanged without RoPE."""
        if self.rope is None:
            return query, key
        seq, batch = query.shape[0], query.shape[1]
        if layout is not None and layout.position_ids is not None:
            positions, needed = layout.position_ids, layout.rotary_length()
        else:
            positions = torch.arange(seq, device=query.device).unsqueeze(0).expand(batch, seq)
            needed = seq
        freqs = self._rope_freqs(positions, needed, query.device)
        return self._apply_rope(query, freqs), self._apply_rope(key, freqs)

    # ----------------------------------------------------------------------------- forward
    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        del attention_mask, attn_mask_type
        if attention_bias is not None:
            raise ValueError("DocumentAttention does not support an attention bias")
        group = None
        if self.config.context_parallel_size > 1:
            group = parallel_state.get_context_parallel_group()
            query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
        with self.dropout_rng():
            out = self._attend(query, key, value, packed_seq_params)
        if group is not None:
            out = heads_to_sequence(out, group)
        return out

    def dropout_rng(self):
        """Where the attention dropout draws, as in Megatron's ``DotProductAttention``: from
        the model-parallel RNG state (``seed + 2718 + tp_rank``) unless sequence parallelism
        is on, whose ``TransformerBlock`` runs every layer under that state already; so each
        tensor-parallel rank's heads get their own masks."""
        if self.training and self.dropout > 0 and not self.config.sequence_parallel:
            return get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _attend(self, query, key, value, packed_seq_params):
        """``[s, b, heads*dim]`` attention of whole rows."""
        seq, batch = query.shape[0], query.shape[1]
        layout = packed_seq_params if isinstance(packed_seq_params, PackedDocuments) else None
        if packed_seq_params is not None and layout is None:
            raise ValueError("DocumentAttention needs PackedDocuments, got a THD PackedSeqParams")
        query, key = self.rotate(query, key, layout)
        dropout = self.dropout if self.training else 0.0
        if not _has_context(layout):
            self._record(key, value, layout)
            if self.backend in ("auto", "flash") and flash_usable(query):
                return self._flash_rows(query, key, value, layout, dropout)
            return packed_attention.packed_attention(
                query, key, value, packed_attention.row_segments(layout, batch),
                self.softmax_scale, dropout, backend=self.backend)
        rows = layout.segments or ((Segment(0, seq),),) * batch
        contexts = [[self._context(key[:, b], value[:, b], seg, layout) for seg in row]
                    for b, row in enumerate(rows)]
        return packed_attention.packed_attention(query, key, value, rows, self.softmax_scale,
                                                 dropout, contexts, self.backend)

    def _record(self, key, value, layout) -> None:
        """Put the K/V of the layout's recorded segments (first slices of split documents)
        into its store, as :meth:`_context` does one segment at a time."""
        if layout is None or layout.kv_store is None or not layout.record_kv:
            return
        for b, row in enumerate(layout.segments):
            for seg in row:
                if seg.doc_key is not None:
                    layout.kv_store.record(seg.doc_key, seg.slice_index, self.layer_number,
                                           key[seg.start:seg.stop, b],
                                           value[seg.start:seg.stop, b])

    def _context(self, k, v, seg: Segment, layout) -> list:
        """The K/V context blocks of one segment (of row ``k``/``v``, ``[s, groups, dim]``),
        recording its own K/V in the store when the layout asks."""
        k, v = k[seg.start:seg.stop], v[seg.start:seg.stop]
        if layout.share is not None:
            return layout.share.context(k, v, self.layer_number)
        if seg.doc_key is not None and layout.kv_store is not None:
            context = layout.kv_store.context(seg.doc_key, seg.slice_index, self.layer_number)
            if layout.record_kv and not _last_without_graph(seg, context, k):
                layout.kv_store.record(seg.doc_key, seg.slice_index, self.layer_number, k, v)
            return context
        if seg.slice_index > 0:
            raise ValueError(f"slice {seg.slice_index} of a document needs a KVStore for its context")
        return []

    def _flash_rows(self, query, key, value, layout, dropout):
        """flash-attn varlen once per packed row ``[s, heads, dim]``, its documents (and the
        padding) as the sequences of ``cu_seqlens``: no token attends across a boundary."""
        seq, batch = query.shape[0], query.shape[1]
        layout = layout if layout is not None else PackedDocuments()
        rows = []
        for b in range(batch):
            cu, longest = layout.row_bounds(b, seq, query.device)
            rows.append(flash_attn_varlen_func(
                query[:, b], key[:, b], value[:, b], cu, cu, longest, longest,
                dropout_p=dropout, softmax_scale=self.softmax_scale, causal=True,
                deterministic=torch.are_deterministic_algorithms_enabled()))
        if batch == 1:  # a view: the output projection saves flash-attn's own output
            return rows[0].view(seq, 1, -1)
        return torch.stack(rows, dim=1).reshape(seq, batch, -1)


def attention_backend(config) -> str:
    """Megatron-LM's ``--attention-backend`` of ``config`` as a name (``auto`` when the
    release has none); :func:`~megatron.plugin.layers.attention_kernels.block_kernel` maps it
    to a kernel."""
    backend = getattr(config, "attention_backend", None)
    return "auto" if backend is None else getattr(backend, "name", str(backend))


_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_warned_fp32 = []


def flash_usable(x: torch.Tensor) -> bool:
    """Whether flash-attn serves ``x``: installed, on CUDA, in fp16 or bf16 (the only dtypes it
    takes). CUDA tensors in fp32 fall back to SDPA, with one warning per process."""
    if flash_attn_varlen_func is None or not x.is_cuda:
        return False
    if x.dtype in _FLASH_DTYPES:
        return True
    if not _warned_fp32:
        _warned_fp32.append(True)
        logger.warning("flash-attn takes fp16 or bf16 only; attention in %s runs through torch "
                       "SDPA (train with --bf16 or --fp16 to use flash-attn)", x.dtype)
    return False


def sequence_to_heads(t: torch.Tensor, group) -> torch.Tensor:
    """``[s/cp, b, heads, dim]`` on each rank -> ``[s, b, heads/cp, dim]`` (Ulysses)."""
    size = group.size()
    local, batch, heads, dim = t.shape
    if heads % size:
        raise ValueError(f"{heads} attention heads per tensor-parallel rank are not divisible "
                         f"by the Ulysses degree (--context-parallel-size) {size}")
    out = all_to_all_sp2hp(t.reshape(local * batch, heads * dim), group)
    return out.view(local * size, batch, heads // size, dim)


def heads_to_sequence(out: torch.Tensor, group) -> torch.Tensor:
    """``[s, b, heads/cp x dim]`` attention output -> ``[s/cp, b, heads x dim]`` on each
    rank (Ulysses' way back)."""
    batch = out.shape[1]
    out = all_to_all_hp2sp(out.reshape(-1, out.shape[-1]), group)
    return out.view(-1, batch, out.shape[-1])


def document_layer_spec(num_layers: int, normalization: str = "LayerNorm",
                        rope: RopeSettings | None = None, qk_layernorm: bool = False,
                        num_experts: int | None = None, per_document_aux: bool = False):
    """Transformer-block spec: Megatron's local GPT layer with :class:`DocumentAttention` as
    core attention and :class:`~megatron.plugin.layers.norm.SequenceParallelNorm` norms (the Q
    and K norms too, with ``qk_layernorm``); with ``num_experts``, Megatron's MoE layer with its
    local experts (``SequentialMLP``) in every layer, and with ``per_document_aux`` its router's
    auxiliary loss per document (:mod:`megatron.plugin.layers.document_router`).

    ``num_layers`` is the number of layers this pipeline stage builds (Megatron's
    ``get_num_layers_to_build``).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron.plugin.layers.norm import SequenceParallelNorm

    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization,
                                    qk_layernorm=qk_layernorm)
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = ModuleSpec(
        module=DocumentAttention, params={"rope": rope})
    layer.input_layernorm = SequenceParallelNorm
    layer.pre_mlp_layernorm = SequenceParallelNorm
    if qk_layernorm:
        layer.self_attention.submodules.q_layernorm = SequenceParallelNorm
        layer.self_attention.submodules.k_layernorm = SequenceParallelNorm
    if num_experts and per_document_aux:
        spec = document_routed(spec)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers,
                                      layer_norm=SequenceParallelNorm)


def document_routed(spec):
    """``spec`` (Megatron's MoE layer) with :class:`~megatron.plugin.layers.document_router.
    DocumentRouter` as its router and the layer that hands the router its call's layout; the MoE
    layer's spec is a ``ModuleSpec`` (megatron-core 0.17, 0.18) or a ``functools.partial``
    (0.19), rebuilt either way rather than changed in place."""
    import dataclasses
    import functools

    from megatron.plugin.layers.document_router import DocumentRoutedLayer, DocumentRouter

    mlp = spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        routed = dataclasses.replace(mlp.keywords["submodules"], router=DocumentRouter)
        mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": routed})
    else:
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules,
                                                                      router=DocumentRouter))
    return dataclasses.replace(spec, module=DocumentRoutedLayer,
                               submodules=dataclasses.replace(spec.submodules, mlp=mlp))
