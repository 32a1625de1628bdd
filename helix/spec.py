"""``--pipeline-schedule=helix``: HelixPipe's parts run by the executor.

Model: every pipeline rank builds :class:`~helix.model.HelixGPTModel` for its stage (the
training loop asks the schedule for it through ``build_model``), so the parameters follow the
helix mapping while checkpoints keep ``GPTModel``'s keys.

Input (:func:`~helix.batches.prepare_input`): Megatron's packed ``--seq-length`` micro-batches
of this data-parallel rank, as for ``1f1b``; every stage keeps the list, because a foreign
attention needs the document layout of the micro-batch it attends over. Stage 0 reads the tokens
through ``forward_step_func`` (the embedding runs there); the count of empty micro-batches that
complete the schedule to a multiple of ``p x folds`` is :attr:`HelixBatches.padding` (their
slots are left out of the schedule, see :mod:`helix.schedule`).

Execution (:class:`~helix.program.HelixProgram`, a
:class:`~megatron.plugin.pipeline.parts.PartProgram`): every part starts from leaves
(``detach().requires_grad_()`` of what it receives, or of what this stage handed itself), so
each forward has its own graph and each backward is one multi-root autograd call over the part's
outputs; gradients of the shipped QKV weight and bias (and, with ``--qk-layernorm``, of the
Q/K norms' weights and biases) come back as the gradients of the ``w``/``wb`` (``qn``/``qnb``/
``kn``/``knb``) outputs, whose roots are the owner's parameters, so autograd accumulates them
(and Megatron DDP's hooks fire) on the owner.

LM head and loss in backward: the forward of boundary ``L`` stops at the final norm; its
backward computes the logits, the per-token loss (Megatron's ``forward_step`` applies
``loss_func``, the per-token count and the loss dict) and runs backward at once, so the
``[s, b, vocab]`` logits never wait through the forward phase. Under ``forward_only`` the loss
is computed in the forward. With ``--helix-mlp-chunk-size`` the LM head and the loss run over
the same sequence chunks as the MLP (:mod:`helix.chunked_loss`), so only one chunk's logits
exist at a time.

Attention parts run :mod:`megatron.plugin.layers.packed_attention` (a block kernel per
document, one output buffer, the log-sum-exp kept) or, under recomputation without attention,
:mod:`helix.attention`, on every device and with dropout; Megatron's ``SelfAttention`` with
the project's core attention runs only an attention output gate.

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

import functools

from megatron.core.utils import get_attr_wrapped_model, get_model_config

from helix.batches import HelixBatches, prepare_input
from helix.flags import add_arguments, add_draw_arguments, check_args
from helix.model import HelixGPTModel, shipped_weights
from helix.program import HelixProgram
from helix.proofs import PROOFS, REFUSALS
from helix.schedule import PRE_TENSORS, HelixFlow, helix_ir, planned_helix
from helix.stage_model import build_model, helix_process_groups
from megatron.plugin.executor_call import run_this_rank
from megatron.plugin.pipeline.parts import Parts
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec

from longctx.model_flags import add_num_layers


def _transfer_shapes(config, seq_length: int, micro_batch_size: int, tp: int):
    """Shape of each helix tensor on one tensor- and context-parallel rank (``1/cp`` of the
    rows under context parallelism)."""
    hidden = config.hidden_size
    seq_length //= config.context_parallel_size
    seq = seq_length // tp if config.sequence_parallel else seq_length
    heads_dim = config.kv_channels * config.num_attention_heads // tp
    groups_dim = config.kv_channels * config.num_query_groups // tp
    qkv = heads_dim + 2 * groups_dim
    head = (config.kv_channels,)
    return {"x": (seq, micro_batch_size, hidden), "r": (seq, micro_batch_size, hidden),
            "res": (seq, micro_batch_size, hidden), "w": (qkv, hidden), "wb": (qkv,),
            "qn": head, "qnb": head, "kn": head, "knb": head,
            "o": (seq_length, micro_batch_size, heads_dim)}


def run(call: RankCall) -> list:
    """This rank's parts of the helix schedule over ``call.input`` (:class:`HelixBatches`)."""
    batches = call.input
    module = get_attr_wrapped_model(call.model, "pre_layers", return_model_obj=True)
    config = get_model_config(call.model)
    groups = helix_process_groups()
    pp, tp = groups.pp.size(), groups.tp.size()
    pre_tensors = PRE_TENSORS[:2] + _shipped_names(module)
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
                           shape_of=lambda action: shapes[action.tensor],
                           extensions=[Parts(program, sync_each_part=True)])
    return store + result


def _shipped_names(module: HelixGPTModel) -> tuple:
    """The weights a pre-attention part ships (every layer's attention has the same)."""
    layer = next(iter(module.pre_layers.values()))
    return tuple(shipped_weights(layer.self_attention))


@functools.lru_cache(maxsize=64)
def _planned(pp, num_layers, microbatches, folds, recompute, pre_tensors):
    return planned_helix(pp, num_layers, microbatches, folds, recompute, pre_tensors)


SPEC = ScheduleSpec("helix", run=run, input_type=HelixBatches,
                    argument_groups=(add_arguments,), check_args=check_args,
                    build_model=build_model, prepare_input=prepare_input,
                    report=lambda batches: {
                        "padding_microbatches": batches.padding,
                        "planned_activation_bytes": batches.planned_activation_bytes},
                    build_ir=helix_ir, draw_arguments=(add_num_layers, add_draw_arguments),
                    proofs=PROOFS, refusals=REFUSALS)
