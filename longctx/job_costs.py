"""The cost model of this training job, from Megatron's flags and ``--hardware-profile``.

The model shape comes from the Megatron flags (a mixture-of-experts MLP from ``--num-experts``,
``--moe-router-topk`` and ``--moe-ffn-hidden-size``; the norms, positions and key/value heads
from ``--normalization``, ``--position-embedding-type``, ``--rotary-percent`` and
``--group-query-attention --num-query-groups``, the norms priced as the fused kernels of CUDA
or the composite RMSNorm of a CPU), its bytes per element from ``params_dtype``
(4 in FP32, 2 in BF16 and FP16); the layout from the parallel sizes; the hardware profile from
``--hardware-profile``, by default the shipped profile whose ``device_names`` name the CUDA
device, ``a800`` on CPU (the planners then only see
relative costs); the memory budget is the schedule's (default: the CUDA device's memory,
:data:`CPU_MEMORY_GB` on CPU). Rank 0 logs once which profile the job uses and for which dtype.
"""
from __future__ import annotations

import argparse
import logging
import types

import torch
import torch.distributed as dist
from megatron.core.utils import get_attr_wrapped_model

from longctx.cost_model import CostModel, ParallelConfig
from megatron.plugin import shared_gpu
from longctx.hardware import load_profile, profile_for_device, profiles_help
from longctx.models import ModelConfig

log = logging.getLogger(__name__)
CPU_MEMORY_GB = 16.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every schedule that prices its plan with the cost model."""
    g = parser.add_argument_group("long-context cost model (elastic, seq1f1b, sppo)")
    g.add_argument("--hardware-profile", default=None,
                   help=f"{profiles_help()} or a profile JSON (scripts/profile_costs.py); "
                        "default: matched from the CUDA device name, a800 on CPU")


def device_memory_gb() -> float:
    """One rank's share of the CUDA device's memory, GB (all of it, unless several ranks share
    the device: :mod:`megatron.plugin.shared_gpu`); :data:`CPU_MEMORY_GB` without CUDA."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 1e9 / shared_gpu.budget_divisor()
    return CPU_MEMORY_GB


def megatron_stage_layers(args: argparse.Namespace) -> tuple[int, ...]:
    """Transformer layers per pipeline stage as Megatron builds them: its
    ``get_num_layers_to_build`` for each rank (even, or uneven with
    ``--decoder-first/last-pipeline-num-layers`` or ``--account-for-embedding/loss-in-pipeline-
    split``), given the fields of the ``TransformerConfig`` it reads (one model chunk per
    rank: the schedules that plan with this model run no virtual stages)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = types.SimpleNamespace(
        pipeline_model_parallel_layout=None, virtual_pipeline_model_parallel_size=None,
        num_layers=args.num_layers, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
    return tuple(get_num_layers_to_build(config, pp_rank=rank)
                 for rank in range(args.pipeline_model_parallel_size))


def cost_model_from_args(args: argparse.Namespace, vocab_size: int,
                         memory_gb: float | None = None,
                         reserved_gb: float | None = None) -> CostModel:
    """The cost model of this job's model (in its ``params_dtype``), layout and device
    (``vocab_size`` already padded) within ``memory_gb`` (default: the device's) less
    ``reserved_gb`` (default 2 on CUDA, 0 on CPU); rank 0 logs the profile and dtype."""
    cuda = torch.cuda.is_available()
    profile, origin = args.hardware_profile, "--hardware-profile"
    if profile is None:
        profile, origin = "a800", "the default on CPU"
        if cuda:
            name = torch.cuda.get_device_name()
            matched = profile_for_device(name)
            profile = matched or "a800"
            origin = f"matched from {name}" if matched else f"no shipped profile matches {name}"
    if memory_gb is None:
        memory_gb = device_memory_gb()
    if reserved_gb is None:
        reserved_gb = 2.0 if cuda else 0.0
    model = ModelConfig("custom", args.num_layers, args.hidden_size, args.num_attention_heads,
                        args.ffn_hidden_size, vocab_size,
                        dtype=str(args.params_dtype).removeprefix("torch."),
                        gated_mlp=args.swiglu, hidden_dropout=args.hidden_dropout > 0,
                        dropout_mask_bytes=1 if cuda else args.params_dtype.itemsize,
                        num_experts=args.num_experts or 0, moe_router_topk=args.moe_router_topk,
                        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                        moe_shared_expert_intermediate_size=(
                            args.moe_shared_expert_intermediate_size),
                        moe_shared_expert_gate=args.moe_shared_expert_gate,
                        moe_router_dtype=args.moe_router_dtype,
                        qk_layernorm=args.qk_layernorm,
                        attention_output_gate=args.attention_output_gate,
                        learned_positions=args.position_embedding_type == "learned_absolute",
                        rope=args.position_embedding_type == "rope",
                        rotary_percent=args.rotary_percent, normalization=args.normalization,
                        fused_norms=cuda,
                        num_query_groups=(args.num_query_groups
                                          if args.group_query_attention else None))
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    parallel = ParallelConfig(pp=pp, sp=cp, tp=tp, dp=max(1, world // (tp * pp * cp)),
                              memory_gb=memory_gb, reserved_gb=reserved_gb,
                              distributed_optimizer=args.use_distributed_optimizer)
    cost = CostModel(model, load_profile(profile), parallel, megatron_stage_layers(args))
    if not dist.is_initialized() or dist.get_rank() == 0:
        counted = "measured in" if cost.hardware.activation_coefficients else "derived for"
        log.info("%s planner: hardware profile %s (%s, %s), activation bytes %s %s",
                 args.pipeline_schedule, profile, cost.hardware.source, origin, counted,
                 model.dtype)
    return cost


_COSTS: dict[tuple, CostModel] = {}
_COST_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "params_dtype", "swiglu", "hidden_dropout", "num_experts", "moe_router_topk",
               "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_shared_expert_gate", "moe_router_dtype", "qk_layernorm",
               "attention_output_gate",
               "position_embedding_type", "rotary_percent", "normalization",
               "group_query_attention", "num_query_groups",
               "tensor_model_parallel_size",
               "pipeline_model_parallel_size", "context_parallel_size",
               "use_distributed_optimizer", "hardware_profile")


def _cost_key(args: argparse.Namespace, model, memory_gb, reserved_gb) -> tuple:
    chunk = model[0] if isinstance(model, list) else model
    return (get_attr_wrapped_model(chunk, "vocab_size"), memory_gb, reserved_gb,
            *(getattr(args, flag) for flag in _COST_FLAGS))


def job_cost_model(args: argparse.Namespace, model, memory_gb: float | None = None,
                   reserved_gb: float | None = None) -> CostModel:
    """:func:`cost_model_from_args` for this job, built once per budget (the vocabulary from
    the model), or what :func:`replace_job_cost_model` put in its place."""
    key = _cost_key(args, model, memory_gb, reserved_gb)
    if key not in _COSTS:
        _COSTS[key] = cost_model_from_args(args, key[0], memory_gb, reserved_gb)
    return _COSTS[key]


def replace_job_cost_model(args: argparse.Namespace, model, cost: CostModel,
                           memory_gb: float | None = None,
                           reserved_gb: float | None = None) -> None:
    """Use ``cost`` from now on (a refit to measured times)."""
    _COSTS[_cost_key(args, model, memory_gb, reserved_gb)] = cost
