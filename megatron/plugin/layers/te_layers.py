"""The layer spec of ``--transformer-impl transformer_engine``: Megatron's Transformer Engine
GPT layer with the document attention as core attention.

The spec is megatron-core's own ``get_gpt_layer_with_transformer_engine_spec``: the input norm
fused into the QKV projection (``TELayerNormColumnParallelLinear``), the pre-MLP norm fused into
the first MLP projection, TE's row-parallel output projections, and ``TENorm`` after the last
layer (what Megatron's ``TransformerBlock`` uses when TE is installed). One submodule is
replaced: TE's ``TEDotProductAttention`` by :class:`~megatron.plugin.layers.attention.DocumentAttention`,
because every schedule feeds packed rows of whole documents (and elastic, seq1f1b and SPPO
slices with K/V context) that TE's attention does not take in the project's layout. The choice
made for every schedule, Megatron's own included, although TE's attention with packed-sequence
(THD) parameters could serve rows without context: one attention for every row, so that the
attention's numbers do not depend on ``--transformer-impl``.

Checkpoints. Every parameter has the name it has in Megatron-LM's TE model
(``self_attention.linear_qkv.{weight,bias,layer_norm_weight,layer_norm_bias}``,
``mlp.linear_fc1.layer_norm_*``, ``linear_proj``, ``linear_fc2``, ``decoder.final_layernorm``);
the TE linears keep their ``_extra_state`` (FP8 metadata). The document attention has no state,
so the one key of a Megatron-LM TE checkpoint that has no counterpart is each layer's
``self_attention.core_attention._extra_state`` (TE attention's FP8 metadata, empty without FP8).
Megatron's local spec, which ``--transformer-impl local`` builds, saves its separate norms
under the same fused names (its ``sharded_state_dict_keys_map``), so a distributed checkpoint
moves between ``local`` and ``transformer_engine`` apart from the ``_extra_state`` entries.

TE needs CUDA and the ``transformer_engine`` package: :func:`missing` says which is absent, and
the start-up refuses the flag with it (``megatron/plugin/arguments.py``). Nothing else in the
project depends on the implementation, so the CPU tests cover the rest of the model.
"""
from __future__ import annotations

import torch

from megatron.plugin.layers.attention import DocumentAttention, RopeSettings


def missing() -> str | None:
    """What ``--transformer-impl transformer_engine`` lacks here: ``"CUDA"``, ``"the
    transformer_engine package"``, both, or ``None`` when both are present."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    absent = [what for what, present in (("CUDA", torch.cuda.is_available()),
                                         ("the transformer_engine package", HAVE_TE))
              if not present]
    return " and ".join(absent) or None


def document_te_layer_spec(num_layers: int, rope: RopeSettings | None = None,
                           qk_layernorm: bool = False):
    """Transformer-block spec of ``num_layers`` layers (this pipeline stage's, Megatron's
    ``get_num_layers_to_build``): Megatron's TE GPT layer (with its Q and K norms under
    ``qk_layernorm``) with :class:`DocumentAttention` as core attention, ``TENorm`` as the final
    norm. The norm kind (LayerNorm or RMSNorm) is the ``TransformerConfig``'s, as in Megatron's
    TE layers."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=DocumentAttention, params={"rope": rope})
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TENorm)
