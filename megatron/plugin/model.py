"""Megatron GPT model from Megatron-LM arguments: ``TransformerConfig`` and per-stage models."""
from __future__ import annotations

import argparse

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.plugin import registry
from megatron.plugin.attention import RopeSettings, document_layer_spec


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by x TP``."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """The ``TransformerConfig`` Megatron-LM would build from the same flags.

    ``calculate_per_token_loss`` is always on: the loss is a per-token mean over the global
    batch, so every schedule gives the same gradients however the batch is cut.

    ``batch_p2p_comm`` is off for the interleaved schedule under gloo: with virtual stages the
    last rank's "next" is the first rank, so at PP=2 both receives of a step come from the same
    peer, and gloo's batched isend/irecv (all on one tag) can hand the activation to the
    gradient buffer and vice versa (Megatron-LM issue 750). Megatron's unbatched path orders the
    operations by rank parity on two communicators and stays exact.
    """
    vp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        vp = args.num_layers // args.pipeline_model_parallel_size \
            // args.num_layers_per_virtual_pipeline_stage
    dtype = dtype_of(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=True,
        perform_initialization=True,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        batch_p2p_comm=not (vp and args.distributed_backend == "gloo"),
    )


def build_model_chunks(args: argparse.Namespace, config: TransformerConfig,
                       vocab_size: int) -> list[GPTModel]:
    """One ``GPTModel`` per (virtual) pipeline stage held by this rank, or what the schedule's
    ``build_model`` makes (helix places layer parts itself)."""
    vp_size = config.virtual_pipeline_model_parallel_size
    rope = None
    if args.position_embedding_type == "rope":
        rope = RopeSettings(rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    build = registry.schedule_hook(args.pipeline_schedule, "build_model")
    if build is not None:
        return build(
            args, config, padded_vocab_size(vocab_size, args),
            document_layer_spec(1, args.normalization, rope).layer_specs[0],
            max_sequence_length=args.max_position_embeddings,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="none" if rope else "learned_absolute")
    chunks = []
    for vp_stage in range(vp_size or 1):
        stage = vp_stage if vp_size else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        num_layers = get_num_layers_to_build(config, vp_stage=stage)
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=document_layer_spec(num_layers, args.normalization, rope),
            vocab_size=padded_vocab_size(vocab_size, args),
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            # RoPE is applied by DocumentAttention at true positions (see attention.py).
            position_embedding_type="none" if rope else "learned_absolute",
            vp_stage=stage,
        ))
    return chunks
