"""``--pipeline-schedule=helix``: HelixPipe's parts run by the executor.

Model: every pipeline rank builds :class:`~helix.model.HelixGPTModel` for its stage (the
training loop asks the schedule for it through ``build_model``), so the parameters follow the
helix mapping while checkpoints keep ``GPTModel``'s keys.

Input (:func:`prepare_input`): Megatron's packed ``--seq-length`` micro-batches of this data-
parallel rank, as for ``1f1b``; every stage keeps the list, because a foreign attention needs
the document layout of the micro-batch it attends over. Stage 0 reads the tokens through
``forward_step_func`` (the embedding runs there); the count of empty micro-batches that complete
the schedule to a multiple of ``p x folds`` is :attr:`HelixBatches.padding` (their slots are
left out of the schedule, see :mod:`helix.schedule`).

Execution (:class:`HelixProgram`, a :class:`~megatron.plugin.pipeline.executor.PartProgram`):
every part starts from leaves (``detach().requires_grad_()`` of what it receives, or of what
this stage handed itself), so each forward has its own graph and each backward is one
multi-root autograd call over the part's outputs; gradients of the shipped QKV weight and bias
come back as the gradients of the ``w``/``wb`` outputs, whose roots are the owner's
parameters, so autograd accumulates them (and Megatron DDP's hooks fire) on the owner.

LM head and loss in backward: the forward of boundary ``L`` stops at the final norm; its
backward computes the logits, the per-token loss (Megatron's ``forward_step`` applies
``loss_func``, the per-token count and the loss dict) and runs backward at once, so the
``[s, b, vocab]`` logits never wait through the forward phase. Under ``forward_only`` the loss
is computed in the forward. With ``--helix-mlp-chunk-size`` the LM head and the loss run over
the same sequence chunks as the MLP (:mod:`helix.chunked_loss`), so only one chunk's logits
exist at a time.

Attention parts on CPU run :mod:`megatron.plugin.packed_attention` (the fused flash kernel
per document, one output buffer, the log-sum-exp kept) or, under recomputation without
attention, :mod:`helix.attention`; elsewhere, or with attention dropout in training,
Megatron's ``SelfAttention`` with the project's core attention.

Recomputation without attention (``--helix-recompute-without-attention``): a boundary's
forward runs without autograd and keeps only its inputs (the attention output and residual
it received, or the tokens at boundary 0) and the RNG state; ``RECOMPUTE`` rebuilds it right
before its backward. An attention part keeps its input ``x``, the shipped weight, its output
and the log-sum-exp, and projects Q/K/V again in its backward (the projection belongs to the
pre-attention); the attention itself is never recomputed. Per micro-batch and layer a loop
then keeps about ``4 bsh``: ``x`` and ``o`` on the attention stage, ``o`` (when it came from
another stage) and the residual on the boundary stage. With ``--helix-mlp-chunk-size`` the
MLP's chunks are recomputed one at a time inside the backward (:mod:`helix.chunked_mlp`).
"""
from __future__ import annotations

import argparse
import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from helix import attention as helix_attention
from helix.chunked_loss import chunked_loss
from helix.chunked_mlp import chunked_mlp
from helix.mapping import check_layout
from helix.model import HelixGPTModel
from helix.schedule import (PRE_TENSORS, HelixFlow, helix_ir, padding, part, part_index,
                            planned_helix)
from megatron.plugin import packed_attention
from megatron.plugin.batches import pack_micro_batches
from megatron.plugin.memory import keep
from megatron.plugin.pipeline.executor import PartProgram, run_backward
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.run_rank import megatron_process_groups, run_this_rank
from megatron.plugin.rng import rng_restored, rng_state
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("helix pipeline (HelixPipe)")
    g.add_argument("--helix-folds", type=int, default=2,
                   help="micro-batches in flight per slot (2: the two-fold FILO schedule)")
    g.add_argument("--helix-recompute-without-attention", action="store_true",
                   help="recompute pre/post-attention parts before their backward, never the "
                        "attention")
    g.add_argument("--helix-mlp-chunk-size", type=int, default=None, metavar="TOKENS",
                   help="run each MLP block over chunks of TOKENS sequence positions, keeping "
                        "one chunk's intermediate activations at a time (see "
                        "helix/chunked_mlp.py)")



def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` for settings helix cannot run (called by the training script's ``check_args``)."""
    check_layout(args.num_layers, args.pipeline_model_parallel_size)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError("helix interleaves layer parts itself: drop "
                         "--num-layers-per-virtual-pipeline-stage")
    if args.context_parallel_size > 1:
        raise ValueError("helix runs each attention on one stage; --context-parallel-size > 1 "
                         "is not supported with it (use elastic for Ulysses)")
    if args.recompute_granularity is not None:
        raise ValueError("helix recomputes its own layer parts: drop --recompute-granularity "
                         "and pass --helix-recompute-without-attention (pre/post-attention "
                         "parts recomputed, attention never)")
    if args.helix_folds < 1:
        raise ValueError(f"--helix-folds must be >= 1, got {args.helix_folds}")
    chunk = args.helix_mlp_chunk_size
    if chunk is not None:
        tp = args.tensor_model_parallel_size
        if chunk < 1:
            raise ValueError(f"--helix-mlp-chunk-size must be >= 1, got {chunk}")
        if args.sequence_parallel and chunk % tp:
            raise ValueError(f"--helix-mlp-chunk-size {chunk} must be a multiple of "
                             f"--tensor-model-parallel-size {tp} with --sequence-parallel "
                             f"(each rank chunks its shard of the sequence)")
        if getattr(args, "num_experts", None):
            raise ValueError("--helix-mlp-chunk-size needs a dense MLP: MoE routing sees the "
                             "whole sequence; drop --num-experts or the chunk size")


# -- model -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _own_rank_group():
    """A one-rank group for this rank (every rank creates all of them, as ``new_group``
    requires): finalize_model_grads' embedding group under helix, where the embedding and the
    output layer live on stage 0 together and nothing is shared across stages."""
    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = group
    return mine


def helix_process_groups(for_model: bool = False) -> ProcessGroupCollection:
    """Megatron's groups with no cross-stage embedding group (``None`` for the model, a
    one-rank group for ``finalize_model_grads``)."""
    groups = megatron_process_groups()
    alone = None if for_model else _own_rank_group()
    groups.embd = alone
    groups.pos_embd = alone
    return groups


def build_model(args: argparse.Namespace, config, vocab_size: int, layer_spec, **gpt_kwargs):
    """This rank's :class:`~helix.model.HelixGPTModel` (one model chunk)."""
    _own_rank_group()  # every rank creates the one-rank groups before any model is built
    return HelixGPTModel(config, layer_spec, vocab_size,
                         stage=parallel_state.get_pipeline_model_parallel_rank(),
                         pg_collection=helix_process_groups(for_model=True), **gpt_kwargs)


# -- input -----------------------------------------------------------------------------------

class HelixBatches:
    """This data-parallel rank's micro-batches; iterating yields them in order (stage 0's
    ``forward_step_func`` reads them), :attr:`batches` gives any by index."""

    def __init__(self, batches, padding_count: int, folds: int, recompute: bool,
                 mlp_rows: int | None = None):
        self.batches = list(batches)
        self.padding = padding_count
        self.folds, self.recompute = folds, recompute
        self.mlp_rows = mlp_rows
        """Sequence rows of this rank per MLP chunk (``None``: no chunking)."""
        self._next = iter(self.batches)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._next)


def prepare_input(documents, args, model):
    del model
    dp = parallel_state.get_data_parallel_world_size()
    batches = pack_micro_batches(documents, args.seq_length, args.micro_batch_size, dp)
    mine = batches[parallel_state.get_data_parallel_rank()::dp]
    empty = padding(len(mine), args.pipeline_model_parallel_size, args.helix_folds)
    rows = args.helix_mlp_chunk_size
    if rows is not None and args.sequence_parallel:
        rows //= args.tensor_model_parallel_size
    return HelixBatches(mine, empty, args.helix_folds,
                        args.helix_recompute_without_attention, rows), len(mine)


# -- execution -------------------------------------------------------------------------------

class _Capture:
    """Stands in for the model when stage 0 calls ``forward_step_func``: keeps what the step
    would feed ``GPTModel.forward`` (tokens, positions, labels, layout)."""

    def __init__(self, model):
        self.model = model
        self.call = None

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids, position_ids, attention_mask, labels=None, **kwargs):
        self.call = dict(input_ids=input_ids, position_ids=position_ids, labels=labels,
                         packed_seq_params=kwargs.get("packed_seq_params"))
        return input_ids


class HelixProgram(PartProgram):
    """The parts of one stage (see the module docstring)."""

    def __init__(self, *, model, module: HelixGPTModel, batches: HelixBatches,
                 forward_step_func, forward_data_store: list, num_microbatches: int,
                 forward_only: bool, collect_non_loss_data: bool, recompute: bool,
                 flow: HelixFlow, pre_tensors):
        self.model, self.module, self.batches = model, module, batches
        self.config = get_model_config(model)
        self.forward_step_func = forward_step_func
        self.store = forward_data_store
        self.num_microbatches = num_microbatches
        self.training = not forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.recompute_boundaries = recompute and self.training
        self.mlp_rows = batches.mlp_rows
        self.flow = flow
        self.pre_tensors = pre_tensors
        self.num_layers = self.config.num_layers
        self.stash: dict[tuple, dict] = {}
        self.steps: dict[int, tuple] = {}

    # The executor's interface.
    def forward(self, action: Action, inputs: dict):
        if action.kind is Kind.ATTN_F:
            return self._attention_forward(action, inputs)
        return self._boundary_forward(action, inputs)

    def backward(self, action: Action, grads: dict):
        entry = self.stash.pop((action.kind is Kind.ATTN_B, action.unit, action.part))
        out, given = _given(entry["out"]), _given(entry["in"])
        tokens = 0
        if action.kind is Kind.BACKWARD and part_index(action.part) == self.num_layers:
            output, tokens = self._loss(action.unit, out["hidden"])
            if self.config.grad_scale_func is not None:
                output = self.config.grad_scale_func(output)
            roots, root_grads = [output], [torch.ones_like(output)]
        else:
            names = [n for n in out if n in grads]
            roots = [out[n] for n in names]
            root_grads = [grads[n] for n in names]
        run_backward(roots, root_grads)
        index = part_index(action.part)
        if action.kind is Kind.ATTN_B:
            made = [(Kind.BACKWARD, action.part, n, grads["res"] if n == "r" else given[n].grad)
                    for n in self.pre_tensors]
        elif index > 0:
            made = [(Kind.ATTN_B, part(index - 1), n, given[n].grad) for n in ("o", "res")]
        else:
            made = []
            del self.steps[action.unit]  # boundary 0 was the last to need the batch
        return made, tokens

    def recompute(self, action: Action):
        entry = self.stash[(False, action.unit, action.part)]
        with rng_restored(entry["rng"]):
            entry["out"] = _kept(self._boundary(action.unit, part_index(action.part),
                                                _given(entry["in"])))

    # The parts.
    def _leaves(self, inputs: dict) -> dict:
        return {n: t.detach().requires_grad_(self.training) for n, t in inputs.items()}

    def _boundary_forward(self, action: Action, inputs: dict):
        unit, index = action.unit, part_index(action.part)
        leaves = self._leaves(inputs)
        if index == 0:
            self._read_batch(unit)
        rng = rng_state() if self.recompute_boundaries else None
        grad = contextlib.nullcontext() if self.training and not self.recompute_boundaries \
            else torch.no_grad()
        with grad:
            out = self._boundary(unit, index, leaves)
        tokens = 0
        if index == self.num_layers:
            if not self.training:
                with torch.no_grad():
                    _, tokens = self._loss(unit, out["hidden"])
                del self.steps[unit]
                return [], tokens
            made = []
        else:
            made = [(Kind.ATTN_F, part(index), n, out[n]) for n in self.pre_tensors]
        if self.recompute_boundaries:
            self.stash[(False, unit, action.part)] = {"in": _kept(leaves), "rng": rng}
        elif self.training:
            self.stash[(False, unit, action.part)] = {"in": _kept(leaves), "out": _kept(out)}
        return made, tokens

    def _boundary(self, unit: int, index: int, leaves: dict) -> dict:
        """``post(index - 1)`` then ``pre(index)`` (or the embedding / final norm)."""
        module = self.module
        if index == 0:
            call = self.steps[unit][1]
            hidden = module.embedding(input_ids=call["input_ids"],
                                      position_ids=call["position_ids"])
        else:
            layer = module.post_layers[index - 1]
            attention = layer.self_attention.linear_proj(leaves["o"])
            with layer.bias_dropout_add_exec_handler():
                hidden = layer.self_attn_bda(layer.training, self.config.bias_dropout_fusion)(
                    attention, leaves["res"], layer.hidden_dropout)
            if self.mlp_rows is None:
                hidden = layer._forward_mlp(hidden)
            else:
                hidden = chunked_mlp(layer._forward_mlp, hidden, self.mlp_rows)
        if index == self.num_layers:
            return {"hidden": module.decoder.final_layernorm(hidden)}
        layer = module.pre_layers[index]
        qkv = layer.self_attention.linear_qkv
        out = {"x": layer.input_layernorm(hidden), "r": hidden, "w": qkv.weight}
        if "wb" in self.pre_tensors:
            out["wb"] = qkv.bias
        return out

    def _attention_forward(self, action: Action, inputs: dict):
        # The residual only passes through: relayed at once, never stashed here (its gradient
        # comes back as the gradient of "res" and goes on unchanged).
        relayed = inputs.pop("r")
        leaves = self._leaves(inputs)
        layout = self.batches.batches[action.unit].layout()
        with contextlib.nullcontext() if self.training else torch.no_grad():
            o = self._attend(leaves["x"], leaves["w"], leaves.get("wb"), layout)
        if self.training:
            self.stash[(True, action.unit, action.part)] = {"in": _kept(leaves),
                                                            "out": _kept({"o": o})}
        following = part(part_index(action.part) + 1)
        return [(Kind.FORWARD, following, "o", o), (Kind.FORWARD, following, "res", relayed)], 0

    def _attend(self, x, weight, bias, layout) -> torch.Tensor:
        """``attn(l)`` with the shipped weights: through the packed CPU kernel where it
        serves (the QKV projection recomputed in the backward under recomputation without
        attention), else through Megatron's ``SelfAttention``."""
        attention = self.module.foreign_attention
        core = attention.core_attention
        dropout = core.dropout if self.training else 0.0
        if self.config.attention_output_gate or not packed_attention.supported(x, dropout):
            attention.linear_qkv.use(weight, bias)
            return attention(x, attention_mask=None, packed_seq_params=layout)[0]

        def project(x, weight, bias):
            attention.linear_qkv.use(weight, bias)
            query, key, value = attention.get_query_key_value_tensors(x)
            return (*core.rotate(query, key, layout), value)

        segments = packed_attention.row_segments(layout, x.shape[1])
        if self.recompute_boundaries:
            return helix_attention.recomputed_attention(project, x, weight, bias, segments,
                                                        core.softmax_scale)
        return packed_attention.packed_attention(*project(x, weight, bias), segments,
                                                 core.softmax_scale)

    def _read_batch(self, unit: int) -> None:
        capture = _Capture(self.module)
        _, loss_func = self.forward_step_func(self.batches, capture)
        self.steps[unit] = (loss_func, capture.call)

    def _loss(self, unit: int, hidden: torch.Tensor):
        """Logits, per-token loss and Megatron's last-stage step for ``unit``."""
        loss_func, call = self.steps[unit]
        module = self.module
        weight = module.shared_embedding_or_output_weight() \
            if module.share_embeddings_and_output_weights else None

        def head_loss(hidden, labels):
            logits, _ = module.output_layer(hidden, weight=weight)
            return module.compute_language_model_loss(labels, logits)

        if self.mlp_rows is None:
            losses = head_loss(hidden, call["labels"])
        else:
            shards = self.config.tensor_model_parallel_size if self.config.sequence_parallel \
                else 1
            losses = chunked_loss(head_loss, hidden, call["labels"], self.mlp_rows, shards)
        return megatron_schedules.forward_step(
            lambda data_iterator, model: (losses, loss_func), None, self.model,
            self.num_microbatches, None, self.store, self.config, cp_group_size=1,
            collect_non_loss_data=self.collect_non_loss_data, current_microbatch=unit,
            is_last_stage=True)


def _kept(tensors: dict) -> dict:
    """Hold a stash's tensors so the activation meter counts them (:func:`keep`)."""
    return {name: keep(tensor) for name, tensor in tensors.items()}


def _given(held: dict) -> dict:
    return {name: handle.tensor for name, handle in held.items()}


def _transfer_shapes(config, seq_length: int, micro_batch_size: int, tp: int):
    """Shape of each helix tensor on one tensor-parallel rank."""
    hidden = config.hidden_size
    seq = seq_length // tp if config.sequence_parallel else seq_length
    heads_dim = config.kv_channels * config.num_attention_heads // tp
    groups_dim = config.kv_channels * config.num_query_groups // tp
    qkv = heads_dim + 2 * groups_dim
    return {"x": (seq, micro_batch_size, hidden), "r": (seq, micro_batch_size, hidden),
            "res": (seq, micro_batch_size, hidden), "w": (qkv, hidden), "wb": (qkv,),
            "o": (seq_length, micro_batch_size, heads_dim)}


def run(call: RankCall) -> list:
    """This rank's parts of the helix schedule over ``call.input`` (:class:`HelixBatches`)."""
    batches = call.input
    module = get_attr_wrapped_model(call.model, "pre_layers", return_model_obj=True)
    config = get_model_config(call.model)
    groups = helix_process_groups()
    pp, tp = groups.pp.size(), groups.tp.size()
    pre_tensors = PRE_TENSORS + (("wb",) if _has_qkv_bias(module) else ())
    schedule = _planned(pp, config.num_layers, call.num_microbatches, batches.folds,
                        batches.recompute, pre_tensors)
    shapes = _transfer_shapes(config, call.seq_length, call.micro_batch_size, tp)
    store: list = []
    program = HelixProgram(
        model=call.model, module=module, batches=batches,
        forward_step_func=call.forward_step_func, forward_data_store=store,
        num_microbatches=call.num_microbatches, forward_only=call.forward_only,
        collect_non_loss_data=call.collect_non_loss_data, recompute=batches.recompute,
        flow=HelixFlow(pp, config.num_layers, batches.folds, call.num_microbatches),
        pre_tensors=pre_tensors)
    result = run_this_rank(schedule, groups, call, data_iterator=batches,
                           shape_of=lambda action: shapes[action.tensor], program=program)
    return store + result


def _has_qkv_bias(module: HelixGPTModel) -> bool:
    return any(layer.self_attention.linear_qkv.bias is not None
               for layer in module.pre_layers.values())


@functools.lru_cache(maxsize=64)
def _planned(pp, num_layers, microbatches, folds, recompute, pre_tensors):
    return planned_helix(pp, num_layers, microbatches, folds, recompute, pre_tensors)


SPEC = ScheduleSpec("helix", run=run, input_type=HelixBatches,
                    argument_groups=(add_arguments,), check_args=check_args,
                    build_model=build_model, prepare_input=prepare_input,
                    report=lambda batches: {"padding_microbatches": batches.padding},
                    build_ir=helix_ir)
