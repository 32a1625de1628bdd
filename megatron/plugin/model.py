"""Megatron GPT model from Megatron-LM arguments: the ``TransformerConfig`` and the model provider."""
from __future__ import annotations

import argparse

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.plugin import registry
from megatron.plugin.layers.attention import RopeSettings, document_layer_spec
from megatron.plugin.layers.te_layers import document_te_layer_spec
from megatron.plugin.cpu_compat import megatron_core_version


def model_config(args: argparse.Namespace) -> TransformerConfig:
    """The ``TransformerConfig`` Megatron-LM builds from the flags, with what the document
    attention needs on top.

    ``batch_p2p_comm`` is off for the interleaved schedule under gloo: with virtual stages the
    last rank's "next" is the first rank, so at PP=2 both receives of a step come from the same
    peer, and gloo's batched isend/irecv (all on one tag) can hand the activation to the
    gradient buffer and vice versa (Megatron-LM issue 750). Megatron's unbatched path orders the
    operations by rank parity on two communicators and stays exact.

    ``deallocate_pipeline_outputs`` is off for the interleaved schedule with
    ``--overlap-p2p-communication`` (Megatron's default there) on megatron-core 0.17: its
    interleaved loop frees a stage's output while the asynchronous send of it may still be
    reading it, and the next stage receives garbage (0.18 waits for the send first). Keeping the
    outputs costs one activation per in-flight micro-batch and changes no number.

    Under a schedule whose plan runs Megatron's full recomputation
    (``ScheduleSpec.plans_recomputation``) the config asks for none: the plan checkpoints the
    layers the flags name.

    ``--moe-per-document-aux-loss-coeff`` is the config's ``moe_aux_loss_coeff``, which only the
    routers read: with it the MoE layers' routers are
    :class:`~megatron.plugin.layers.document_router.DocumentRouter` (:func:`layer_spec`), which
    take the coefficient for their loss per document (the option classes refuse Megatron's
    ``--moe-aux-loss-coeff`` beside it, and the flag under the schedules that build Megatron's
    router).

    Under ``--transformer-impl transformer_engine`` ``disable_parameter_transpose_cache`` is on
    (the config field has no flag). Megatron's TE linears tell TE whether a forward is the first
    micro-batch's (``is_first_microbatch``; without FP8 only the first forward of the run is),
    and with Megatron's gradient-accumulation fusion TE's weight-gradient GEMM in that
    forward's backward overwrites ``main_grad`` instead of adding to it. That is right when the
    first forward's backward runs first, as in Megatron's schedules; ``elastic``, ``seq1f1b``
    and ``sppo`` run a split document's backwards last slice first, so the first slice's would
    drop what the later slices had added. With the field on, TE is not told, and every
    backward adds into ``main_grad``, which Megatron's DDP zeroes at every step. The field's
    other effect, on FP8 weight caches, does not apply: FP8 is refused.

    With ``--overlap-grad-reduce``, and where the schedule computes with borrowed copies of
    weights (``ScheduleSpec.borrows_weights``: sppo's multiplexing helpers run layers on
    broadcast copies of another stage's weights, which have no ``main_grad`` for a fused linear
    to add into), the weight-gradient accumulation is not fused (Megatron's
    ``gradient_accumulation_fusion``, on where CUDA and apex's kernel are; the same
    gradients). A fused linear tells Megatron's DDP that its gradient is in ``main_grad`` by setting
    ``grad_added_to_main_grad`` on the weight autograd restores for its backward (Megatron's
    local linear, and Transformer Engine before 2.15). Every step runs under saved-tensor hooks
    (the activation meter, :mod:`~megatron.plugin.layers.memory`; sppo's offloading), and
    autograd restores a hooked tensor as a new object without the attributes set on the
    parameter: the linear then adds into ``main_grad`` but hands DDP no gradient, and the DDP
    hook of the overlapped reduction asserts one. Unfused, the linear returns the gradient and
    the hook adds it into ``main_grad``.
    """
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.moe_per_document_aux_loss_coeff:
        config.moe_aux_loss_coeff = args.moe_per_document_aux_loss_coeff
    if args.transformer_impl == "transformer_engine":
        config.disable_parameter_transpose_cache = True
    spec = registry.spec(args.pipeline_schedule)
    if args.overlap_grad_reduce or (spec is not None and spec.borrows_weights is not None
                                    and spec.borrows_weights(args)):
        config.gradient_accumulation_fusion = False
    if spec is not None and spec.plans_recomputation:
        config.recompute_granularity = config.recompute_method = None
        config.recompute_num_layers = None
    if config.virtual_pipeline_model_parallel_size and args.distributed_backend == "gloo":
        config.batch_p2p_comm = False
    if (config.virtual_pipeline_model_parallel_size and config.overlap_p2p_comm
            and megatron_core_version().startswith("0.17.")):
        config.deallocate_pipeline_outputs = False
    return config


def layer_spec(args: argparse.Namespace, num_layers: int, rope: RopeSettings | None):
    """The transformer-block spec of ``--transformer-impl``: Megatron's local layers
    (:func:`~megatron.plugin.layers.attention.document_layer_spec`) or its Transformer Engine
    layers (:func:`~megatron.plugin.layers.te_layers.document_te_layer_spec`), with the document
    attention and ``--qk-layernorm`` either way (the start-up refuses MoE layers with
    Transformer Engine); MoE layers take their load-balancing loss per document with
    ``--moe-per-document-aux-loss-coeff`` (accepted only under the schedules whose tables prove
    it, :func:`~megatron.plugin.option_classes.proving`). A schedule's own
    ``build_model`` (helix) takes the local layer: the start-up refuses Transformer Engine
    under it."""
    if args.transformer_impl == "transformer_engine":
        return document_te_layer_spec(num_layers, rope, qk_layernorm=args.qk_layernorm)
    return document_layer_spec(num_layers, args.normalization, rope,
                               qk_layernorm=args.qk_layernorm, num_experts=args.num_experts,
                               per_document_aux=bool(args.num_experts)
                               and args.moe_per_document_aux_loss_coeff > 0)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None,
                   config: TransformerConfig | None = None, pg_collection=None):
    """Megatron-LM's ``model_provider``: this (virtual) stage's ``GPTModel`` with the document
    attention, or what the schedule's ``build_model`` makes (helix places layer parts)."""
    from megatron.training import get_args

    del pg_collection  # Megatron's default groups (parallel_state)
    args = get_args()
    if config is None:
        config = model_config(args)
    rope = None
    if args.position_embedding_type == "rope":
        rope = RopeSettings(rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    gpt_kwargs = dict(
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        # RoPE is applied by DocumentAttention at true positions (see attention.py).
        position_embedding_type="none" if rope else "learned_absolute")
    spec = registry.spec(args.pipeline_schedule)
    if spec is not None and spec.build_model is not None:
        return spec.build_model(args, config, args.padded_vocab_size, layer_spec(args, 1, rope).layer_specs[0],
                                **gpt_kwargs)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec(args, num_layers, rope),
        vocab_size=args.padded_vocab_size, pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, **gpt_kwargs)
