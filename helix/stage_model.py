"""This rank's helix model (layer parts placed by the helix mapping) and the process groups
it runs with (no cross-stage embedding group: the embedding and the head live on stage 0)."""
from __future__ import annotations

import argparse

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from helix.model import HelixGPTModel
from megatron.plugin.executor_call import megatron_process_groups
from megatron.plugin.pipeline.group_cache import cached_groups


@cached_groups(maxsize=1)
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
    one-rank group for ``finalize_model_grads``), and the expert groups Megatron's MoE layer
    builds with (its ``get_default_pg_collection``)."""
    groups = megatron_process_groups()
    experts = get_default_pg_collection()
    for name in ("ep", "expt_tp", "expt_dp", "expt_dp_gtp_remat", "tp_ep", "tp_cp",
                 "tp_dp_cp"):
        if hasattr(experts, name):  # megatron-core 0.17 has no expt_dp_gtp_remat
            setattr(groups, name, getattr(experts, name))
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
