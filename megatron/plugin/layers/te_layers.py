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

Under ``sppo``, read against Transformer Engine 2.8 and 2.18 (``LayerNormLinear``, ``Linear``):

* Layer structure: the subsequence pipeline, the K/V store and the offloading name no
  submodule or parameter. The K/V store holds the K and V the document attention is handed,
  views of the QKV projection's output under either implementation (Megatron's self-attention
  splits ``linear_qkv``'s output alike), and the offloader keeps those storages on the device.
  Checkpointing, when a plan asks for it, hooks whole ``TransformerLayer`` modules.
* Saved tensors: TE's autograd functions save through ``ctx.save_for_backward`` (plain tensors
  pass ``prepare_for_saving`` as they are), so the offloader's saved-tensor hooks see all of
  them: the input (on a stage's first layer a view of its received input, a leaf that requires
  grad: kept), the norm's output and fp32 mean and inverse deviation (offloadable), and the
  weight twice, as GEMM operand and as parameter. Without FP8 both are the parameter itself:
  ``cast_if_needed`` returns it when it has the activations' dtype, as under Megatron's bf16
  module. So the rules hold: a leaf that requires grad passes untouched, and nothing TE saves
  is a view of a weight. FP8 (quantized weight storages) is refused.
* Identity: autograd hands a backward a new tensor object for whatever a saved-tensor hook
  returned, so the weight TE restores lacks the attributes Megatron sets on the parameter
  (``main_grad``, ``grad_added_to_main_grad``). That holds under every schedule, whose steps run
  under the activation meter's hooks (:mod:`~megatron.plugin.layers.memory`). TE up to 2.14
  reads ``grad_added_to_main_grad`` off the restored weight; with Megatron's gradient-
  accumulation fusion its backward then returns no weight gradient, having added it into
  ``main_grad`` through a closure over the real parameter (right, but Megatron's DDP asserts a
  gradient under ``--overlap-grad-reduce``, where :func:`~megatron.plugin.model.model_config`
  turns the fusion off); TE 2.15 and later keep a weak reference to the parameter instead.
  Megatron's local linear reads the attribute the same way.
* The first micro-batch's weight gradient: :func:`~megatron.plugin.model.model_config`.
* ``--sppo-multiplex`` runs another stage's layers on broadcast copies of its weights
  (``torch.func.functional_call``), which TE's modules have not done on a GPU: refused with TE
  (``megatron/plugin/arguments.py``).
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
