"""The activation bytes helix's parts keep, and each stage's planned peak.

Per micro-batch of ``S = seq_length x micro_batch_size`` tokens (``/ cp`` of them on each
context-parallel rank: every count below is of this rank's tokens, apart from RoPE's tables of
the whole rows) on one tensor-parallel rank,
``T`` of them in the sequence-parallel parts (``S / tp`` with ``--sequence-parallel``, else
``S``), ``e`` bytes an element of the model's dtype, ``h`` the hidden size, ``f`` the MLP's
width after its activation and ``w`` its first projection's (``f``, or ``2f`` gated), ``q``
the QKV projection's width (``h + 2 groups x kv_channels``), ``H`` the heads, all per rank
(``/ tp``) where tensor parallelism splits them. What :class:`~helix.program.HelixProgram`
keeps, as the training loop's meter counts it (autograd's saved tensors and the stash's
:func:`~megatron.plugin.layers.memory.keep`, one count per storage):

- *boundary* ``b`` (``post(b - 1)`` then ``pre(b)``) with its graph:
  ``post``: the attention-output dropout mask, the pre-MLP norm's input and statistics, the
  MLP's input ``T h``, its first projection's output ``S w`` and its second's input ``S f`` (a
  mixture of experts' MLP: the cost model's per-token bytes of it instead,
  :func:`longctx.cost_model.mlp_saved_per_token`), the MLP dropout mask, the residual
  ``res`` it received ``T h`` and the attention output ``o`` (``S h``) when that came from
  another stage (from this stage it is the attention's own output, counted there); ``pre``:
  the input norm's input (the residual ``r`` it sends: the same storage) and statistics and
  its output ``x``; boundary 0 has the embedding's token and
  position ids and its dropout mask instead of a ``post``; boundary ``L`` the final norm
  instead of a ``pre``;
- *attention* of layer ``l``: the QKV projection's output ``S q`` (Q, K and V are views of
  it; with RoPE also the rotated Q and K), the output ``S h`` and the log-sum-exp ``S H`` in
  FP32; the input ``x`` when it came from another stage (from this stage it is the boundary's
  output, counted there); the shipped QKV weight (and bias) per received copy; on the
  boundary's own stage the weight is the parameter's storage, counted once while any of that
  layer's local attentions holds it; with ``--qk-layernorm`` the Q and K norms' statistics
  (their inputs are views of the projection's output), their normalized inputs where the
  norm is a composite and, without RoPE, their outputs (the attention saves the normed Q and
  K; with RoPE the rotated ones, counted already), per received copy also the norms' weights;
  under context parallelism the output twice (the whole rows' ``heads / cp``, which the
  attention saves, and this rank's rows after the all-to-all back, the part's output) and, with
  Q/K norms, the projection's output on this rank's rows besides Q, K and V after the
  all-to-all (the norms' saved inputs view it);
- *under* ``--helix-recompute-without-attention``: a boundary keeps only what it received
  (``res``, and ``o`` from another stage); its ``RECOMPUTE`` rebuilds the rest right before
  the backward. An attention keeps ``x`` (the boundary no longer does), the weight, ``o`` and
  the log-sum-exp; its backward projects Q/K/V again (a workspace of ``S q``, and of what
  the Q and K norms keep);
- *under* ``--helix-mlp-chunk-size R``: the MLP block (pre-MLP norm, MLP, dropout-add) keeps
  only its input; its backward rebuilds one chunk of ``R`` positions at a time, a workspace of
  that chunk's share of the block less what the backward released before reaching it (the
  statistics of the norm after the block and, at boundary ``L``, that norm's input); the LM
  head and loss keep the labels and one chunk's logits at a time;
- the *loss*, computed in boundary ``L``'s backward: FP32 logits ``4 S V`` (the cross
  entropy's copy, ``V`` the padded vocabulary per rank), its masks and targets and the loss
  mask's product, a workspace of that backward.

Dropout masks are the elements of what the dropout multiplied by: one byte each on CUDA
(torch's fused dropout keeps a boolean mask), ``e`` on a CPU (torch keeps the scaled noise in
the input's dtype). A norm keeps its input and two FP32 statistics a token (LayerNorm;
RMSNorm one), on a CPU RMSNorm also its normalized input (torch's composite; CUDA's fused
kernel does not), with ``--apply-layernorm-1p`` the ``1 + weight`` it scales by. RoPE keeps the
rotated Q and K and, per rotation, its cosines and sines (``[S, rotary dim]`` twice).

The stash follows the simulator's rule (:mod:`megatron.plugin.pipeline.simulator`): a
forward's or recomputation's bytes join its part's stash when it ends and leave at that
part's backward; workspaces count on top while their action runs. Helix's order is first in,
last out within a loop, so the first local attention of a layer in a loop is the last of them
to run its backward: it is charged the layer's weight. The planned peak of a stage is the
simulated peak of the schedule it runs.

Choices where the paper is silent: the model counts what this runtime keeps, not the paper's
``about 4bsh a layer`` estimate; an attention output gate (which runs Megatron's
``SelfAttention``) is priced as the packed attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from longctx.cost_model import mlp_saved_per_token
from longctx.models import ModelConfig
from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.simulator import CostDefaults, simulate

from helix.mapping import attention_stage
from helix.schedule import HelixFlow, part_index, planned_helix

_INDEX_BYTES = 8
_FP32 = 4


@dataclass(frozen=True)
class HelixShape:
    """What the bytes of helix's parts depend on, per tensor-parallel rank."""

    tokens: int
    """``S``: sequence length x micro-batch size."""
    sequence_parallel_tokens: int
    """``T``: tokens of the sequence-parallel parts on this rank."""
    hidden: int
    attention: int
    """The attention output's width on this rank (heads x kv_channels / tp)."""
    mlp_first: int
    """The MLP's first projection's output width on this rank (``w / tp``)."""
    mlp_second: int
    """The MLP's second projection's input width on this rank (``f / tp``)."""
    qkv: int
    """The QKV projection's output width on this rank."""
    heads: int
    """Attention heads on this rank."""
    vocab: int
    """Padded vocabulary on this rank."""
    element_bytes: int
    mask_bytes: int
    """Bytes a hidden-dropout mask keeps per element (``0``: no dropout)."""
    norm_statistics: int
    """FP32 values a norm keeps per token."""
    norm_normalized: bool
    """A norm also keeps its normalized input (torch's RMSNorm on a CPU, a composite)."""
    norm_weight: bool
    """A norm keeps ``1 + weight`` (``--apply-layernorm-1p``)."""
    position_ids: bool
    """The embedding adds learned positions (it keeps their ids)."""
    rope_dim: int
    """Rotary dimensions per head (0: no RoPE)."""
    qkv_bias: bool
    recompute: bool
    mlp_chunk_rows: int | None
    """Rows of this rank's sequence-parallel shard per MLP chunk (``None``: no chunking)."""
    qk_norm_rows: int = 0
    """Rows per token the Q and K norms normalise (``(heads + groups) / tp``; 0: no
    ``--qk-layernorm``)."""
    moe_bytes: int = 0
    """Bytes per token a mixture-of-experts MLP keeps beyond its input, in place of the dense
    ``mlp_first + mlp_second`` (:func:`longctx.cost_model.mlp_saved_per_token`: permuted
    copies, expert intermediates, router tensors); 0: a dense MLP."""
    context_parallel: int = 1
    """``cp``: ``tokens`` is this rank's ``1/cp`` of the rows; the attention runs ``heads /
    cp`` of the whole rows (Ulysses)."""


@dataclass(frozen=True)
class HelixMemory(CostDefaults):
    """Activation and workspace bytes of each helix action (module doc); a costs object for
    :func:`~megatron.plugin.pipeline.simulator.simulate` (every compute lasts 1, transfers are
    free: a stage's memory depends only on its own order)."""

    shape: HelixShape
    flow: HelixFlow
    weight_holders: frozenset = field(default=frozenset())
    """``(stage, unit, layer)`` of the attentions charged their layer's local weight."""

    # -- bytes of the pieces ---------------------------------------------------------------
    def _hidden(self, tokens: int | None = None) -> float:
        s = self.shape
        return (s.sequence_parallel_tokens if tokens is None else tokens) * s.hidden \
            * s.element_bytes

    def _norm(self, tokens: int) -> float:
        """A norm over ``tokens`` rows: its input and :meth:`_norm_extra`."""
        return self._hidden(tokens) + self._norm_extra(tokens)

    def _norm_extra(self, tokens: int) -> float:
        """What a norm keeps besides its input: statistics, the normalized input where the
        kernel is a composite, ``1 + weight`` with ``--apply-layernorm-1p``."""
        s = self.shape
        return (tokens * s.norm_statistics * _FP32
                + (self._hidden(tokens) if s.norm_normalized else 0.0)
                + (s.hidden * s.element_bytes if s.norm_weight else 0.0))

    def _mlp_block(self, tokens: int) -> float:
        """What the MLP block keeps beyond its input (the pre-MLP norm's) over ``tokens``
        sequence-parallel rows: the norm's statistics and output, the MLP's wide tensors and
        its dropout mask."""
        s = self.shape
        wide = tokens * s.tokens // s.sequence_parallel_tokens
        mlp = wide * (s.moe_bytes or (s.mlp_first + s.mlp_second) * s.element_bytes)
        return (self._norm_extra(tokens) + self._hidden(tokens) + mlp
                + tokens * s.hidden * s.mask_bytes)

    def _post(self, remote_o: bool) -> float:
        """``post(b - 1)`` with its graph, the received ``res`` (and ``o``) included: the
        attention-output dropout mask, the MLP block's input, and the block unless chunked."""
        s = self.shape
        mlp = 0.0 if s.mlp_chunk_rows is not None \
            else self._mlp_block(s.sequence_parallel_tokens)
        return (s.sequence_parallel_tokens * s.hidden * s.mask_bytes + self._hidden() + mlp
                + self._received(remote_o))

    def _output(self) -> float:
        s = self.shape
        return s.tokens * s.attention * s.element_bytes

    def _received(self, remote_o: bool) -> float:
        return self._hidden() + (self._output() if remote_o else 0.0)

    def _pre(self) -> float:
        """The input norm (the final norm at boundary ``L``): its input (the residual ``r``
        it sends) and statistics, and its output (``x``)."""
        return self._norm(self.shape.sequence_parallel_tokens) + self._hidden()

    def _embedding(self) -> float:
        s = self.shape
        ids = s.tokens * _INDEX_BYTES * (2 if s.position_ids else 1)
        return ids + s.sequence_parallel_tokens * s.hidden * s.mask_bytes

    def _qkv(self) -> float:
        """The projection's output (under context parallelism Q, K and V after the
        all-to-all, the same bytes, and with Q/K norms also the projection's output on this
        rank's rows, which the norms' saved inputs view); with RoPE also the rotated Q and K
        and the cosines and sines each rotation keeps (of the whole rows)."""
        s = self.shape
        cp = s.context_parallel
        rotated = s.tokens * (s.qkv + s.attention) // 2 + s.tokens * cp * 4 * s.rope_dim \
            if s.rope_dim else 0
        local = s.tokens * s.qkv if cp > 1 and s.qk_norm_rows else 0
        return (s.tokens * s.qkv + local + rotated) * s.element_bytes

    def _qk_norm(self) -> float:
        """What the Q and K norms keep beyond the projection's output (their input): their
        statistics, their normalized inputs where the norm is a composite and, without RoPE,
        their outputs."""
        s = self.shape
        row = (s.attention // s.heads) * s.element_bytes
        copies = int(s.norm_normalized) + int(not s.rope_dim)
        return s.tokens * s.qk_norm_rows * (s.norm_statistics * _FP32 + copies * row)

    def _weight(self) -> float:
        s = self.shape
        bias = s.qkv if s.qkv_bias else 0
        # The Q and K norms' weights, and their biases unless RMSNorm (one statistic).
        norms = 2 * (s.attention // s.heads) * (1 if s.norm_statistics == 1 else 2) \
            if s.qk_norm_rows else 0
        return (s.qkv * s.hidden + bias + norms) * s.element_bytes

    def _loss(self) -> float:
        """The cross entropy's FP32 logits, masks and targets (one chunk's, and the labels,
        with chunked MLPs), and the loss mask's product."""
        s = self.shape
        per_row = s.vocab * _FP32 + 1 + _INDEX_BYTES
        if s.mlp_chunk_rows is None:
            return s.tokens * (per_row + _FP32)
        # The loss mask's product is released before the chunks' backward runs.
        rows = min(s.tokens, s.mlp_chunk_rows * s.tokens // s.sequence_parallel_tokens)
        return s.tokens * _INDEX_BYTES + max(s.tokens * _FP32, rows * per_row)

    def _boundary(self, index: int, remote_o: bool) -> float:
        """Boundary ``index`` with its graph (what a recomputation rebuilds, and more)."""
        first = self._embedding() if index == 0 else self._post(remote_o)
        return first + self._pre()

    # -- the costs interface -----------------------------------------------------------------
    def _remote_o(self, action: Action) -> bool:
        index = part_index(action.part)
        return index > 0 and self.flow.attention_stage(index - 1, action.unit) != action.stage

    def activation_bytes(self, action: Action) -> float:
        s = self.shape
        index = part_index(action.part)
        if action.kind is Kind.ATTN_F:
            local_x = self.flow.attention_stage(index, action.unit) == index % self.flow.pp
            # Under context parallelism the output of whole rows (the attention's saved
            # output) and this rank's rows of it (the part's output) are two tensors.
            kept = self._output() * (2 if s.context_parallel > 1 else 1) \
                + s.tokens * s.heads * _FP32
            kept += 0.0 if s.recompute else self._qkv() + self._qk_norm()
            if s.recompute or not local_x:
                kept += self._hidden()
            if not local_x or (action.stage, action.unit, index) in self.weight_holders:
                kept += self._weight()
            return kept
        received = 0.0 if index == 0 else self._received(self._remote_o(action))
        whole = self._boundary(index, self._remote_o(action))
        if action.kind is Kind.FORWARD and s.recompute:
            return received
        if action.kind is Kind.RECOMPUTE:
            return whole - received
        return whole

    def workspace_bytes(self, action: Action) -> float:
        s = self.shape
        if action.kind is Kind.ATTN_B and s.recompute:
            return self._qkv() + self._qk_norm()
        if action.kind is not Kind.BACKWARD:
            return 0.0
        index = part_index(action.part)
        last = index == self.flow.num_layers
        chunk = 0.0
        if index > 0 and s.mlp_chunk_rows is not None:
            # By then the backward has passed the norm after the MLP and released what it
            # saved but the stash's handles hold: all but its input, and at boundary L that too.
            tokens = s.sequence_parallel_tokens
            released = self._norm_extra(tokens) + (self._hidden() if last else 0.0)
            chunk = self._mlp_block(min(s.mlp_chunk_rows, tokens)) - released
        return max(chunk, self._loss()) if last else chunk

    def duration(self, action: Action) -> float:
        return 1.0 if action.is_compute() else 0.0



def weight_holders(schedule: Schedule, flow: HelixFlow) -> frozenset:
    """``(stage, unit, layer)`` of each attention that finds its layer's weight not held by an
    earlier local attention of the same stage still waiting for its backward."""
    holders = set()
    for actions in schedule:
        held: dict[int, tuple] = {}
        for a in actions:
            if a.kind not in (Kind.ATTN_F, Kind.ATTN_B):
                continue
            layer = part_index(a.part)
            if attention_stage(layer, flow.slots[a.unit], flow.pp) != layer % flow.pp:
                continue
            key = (a.stage, a.unit, layer)
            if a.kind is Kind.ATTN_F and layer not in held:
                held[layer] = key
                holders.add(key)
            elif a.kind is Kind.ATTN_B and held.get(layer) == key:
                del held[layer]
    return frozenset(holders)


@functools.lru_cache(maxsize=64)
def planned_peaks(shape: HelixShape, pp: int, num_layers: int, microbatches: int, folds: int,
                  recompute: bool) -> tuple[float, ...]:
    """Each stage's simulated peak of activation bytes in the helix schedule of
    ``microbatches`` micro-batches (module doc)."""
    flow = HelixFlow(pp, num_layers, folds, microbatches)
    schedule = planned_helix(pp, num_layers, microbatches, folds, recompute)
    memory = HelixMemory(shape, flow, weight_holders(schedule, flow))
    return tuple(simulate(schedule, memory, trace=False, eager_sends=True).peak_memory)


def helix_shape(config, args, device_type: str) -> HelixShape:
    """The :class:`HelixShape` of a run: its model ``config`` (megatron-core's
    ``TransformerConfig``), Megatron's ``args`` (sequence length, micro-batch size, padded
    vocabulary, position embedding, helix flags) and the parameters' device type."""
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    tokens = args.seq_length * args.micro_batch_size // cp
    local = tokens // tp if config.sequence_parallel else tokens
    heads, groups = config.num_attention_heads, config.num_query_groups or \
        config.num_attention_heads
    ffn = config.ffn_hidden_size
    element = torch.tensor([], dtype=config.params_dtype).element_size()
    mask = 0
    if config.hidden_dropout > 0:
        mask = 1 if device_type == "cuda" else element
    rms = config.normalization == "RMSNorm"
    rows = args.helix_mlp_chunk_size
    if rows is not None:
        rows //= cp * (tp if config.sequence_parallel else 1)
    return HelixShape(
        tokens=tokens, sequence_parallel_tokens=local, hidden=config.hidden_size,
        attention=heads * config.kv_channels // tp,
        mlp_first=ffn * (2 if config.gated_linear_unit else 1) // tp, mlp_second=ffn // tp,
        qkv=(heads + 2 * groups) * config.kv_channels // tp, heads=heads // tp,
        vocab=args.padded_vocab_size // tp, element_bytes=element, mask_bytes=mask,
        norm_statistics=1 if rms else 2, norm_normalized=rms and device_type == "cpu",
        norm_weight=bool(config.layernorm_zero_centered_gamma),
        position_ids=args.position_embedding_type == "learned_absolute",
        rope_dim=int(config.kv_channels * args.rotary_percent)
        if args.position_embedding_type == "rope" else 0,
        qkv_bias=bool(config.add_bias_linear or config.add_qkv_bias),
        recompute=args.helix_recompute_without_attention, mlp_chunk_rows=rows,
        qk_norm_rows=(heads + groups) // tp if config.qk_layernorm else 0,
        moe_bytes=_moe_bytes(config, args), context_parallel=cp)


def model_shape(model: ModelConfig, seq: int, tp: int, recompute: bool) -> HelixShape:
    """The :class:`HelixShape` of a priced model (:class:`~longctx.models.ModelConfig`, one
    ``seq``-token sequence a micro-batch, TP ``tp`` with sequence parallelism on CUDA), as
    :func:`helix_shape` reads a run: GPT's LayerNorm and biases, learned positions or full
    RoPE, no Q/K norms, no MLP chunks; ``recompute``: recomputation without attention. A model
    with Q/K norms or the attention output gate is refused (their bytes are not in this
    reading)."""
    unread = [flag for flag, on in (("qk_layernorm", model.qk_layernorm),
                                    ("attention_output_gate", model.attention_output_gate)) if on]
    if unread:
        raise ValueError(f"model {model.name}: helix's priced shape does not read "
                         f"{', '.join(unread)}; price it from a run's arguments (helix_shape)")
    h, ffn = model.hidden_size, model.ffn_hidden_size
    head = h // model.num_heads
    return HelixShape(
        tokens=seq, sequence_parallel_tokens=seq // tp, hidden=h, attention=h // tp,
        mlp_first=model.mlp_width // tp, mlp_second=ffn // tp, qkv=3 * h // tp,
        heads=model.num_heads // tp, vocab=model.vocab_size // tp,
        element_bytes=model.element_bytes,
        mask_bytes=model.dropout_mask_bytes if model.hidden_dropout else 0,
        norm_statistics=2, norm_normalized=False, norm_weight=False,
        position_ids=model.learned_positions, rope_dim=0 if model.learned_positions else head,
        qkv_bias=True, recompute=recompute, mlp_chunk_rows=None,
        moe_bytes=mlp_saved_per_token(model) if model.num_experts else 0)


def _moe_bytes(config, args) -> int:
    """:attr:`HelixShape.moe_bytes` of a run (0 without experts)."""
    if not config.num_moe_experts:
        return 0
    model = ModelConfig("helix", config.num_layers, config.hidden_size,
                        config.num_attention_heads, config.ffn_hidden_size,
                        args.padded_vocab_size,
                        dtype=str(config.params_dtype).removeprefix("torch."),
                        gated_mlp=config.gated_linear_unit, num_experts=config.num_moe_experts,
                        moe_router_topk=config.moe_router_topk,
                        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                        moe_shared_expert_intermediate_size=(
                            config.moe_shared_expert_intermediate_size),
                        moe_shared_expert_gate=config.moe_shared_expert_gate,
                        moe_router_dtype=config.moe_router_dtype)
    return mlp_saved_per_token(model)
