"""HelixPipe's attention-parallel partition of Megatron's GPT model.

Every transformer layer ``l`` is cut into three parts, built from Megatron's own
``TransformerLayer`` submodules (same classes, same parameter names):

* **pre-attention** ``pre(l)``: ``input_layernorm``, then the QKV projection ``linear_qkv``;
* **attention** ``attn(l)``: the parameter-free core attention;
* **post-attention** ``post(l)``: ``linear_proj``, residual, ``pre_mlp_layernorm``, MLP,
  residual.

The helix mapping: stage ``s`` of ``p`` owns the *boundaries* ``b = s, s + p, ...`` (``b`` in
``0..L``); boundary ``b`` is ``post(b - 1)`` followed by ``pre(b)``. Boundary 0 starts with the
embedding; boundary ``L`` (on stage 0, since ``p`` divides ``L``) ends with the final norm, the
LM head and the loss. Stage 0 therefore holds the embedding and the output layer together
(tied weights stay one parameter; no embedding group is needed).

Weight shipping: ``pre(b)`` does not project Q/K/V itself. It sends the normed input ``x``,
the residual ``r``, the QKV weight (and bias) and, with ``--qk-layernorm``, the Q and K norms'
weights (and biases) to the stage that runs ``attn(b)``, which projects, normalises and attends
there (:class:`ShippedQKV`, :class:`ShippedNorm`; :func:`shipped_weights` names them); the
weight gradients flow back to the owner and are accumulated into its parameters by autograd
(Megatron DDP's hooks see them as usual).

Checkpoints: each stage's layers are the halves of Megatron ``TransformerLayer`` objects with
their *global* layer numbers, and :meth:`HelixGPTModel.sharded_state_dict` writes them under
the keys ``GPTModel`` uses (``decoder.layers.*`` sharded over the layer dimension), so a
distributed checkpoint written under ``1f1b`` loads under ``helix`` and back.
"""
from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                         TransformerBlockSubmodules)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import sharded_state_dict_default

from helix.mapping import boundaries_of, check_layout
from megatron.plugin.layers.norm import SequenceParallelNorm
from megatron.plugin.pipeline.param_gather import wait_for_parameters


class ShippedQKV(torch.nn.Module):
    """Stand-in for ``linear_qkv`` on the stage that runs a foreign attention: the matmul of
    Megatron's ``ColumnParallelLinear`` (sequence-parallel all-gather and tensor-parallel
    gradient all-reduce included) with the weight and bias that came with the input
    (:meth:`use`). It holds no parameter and no state."""

    def __init__(self, input_size, output_size, *, config, tp_group=None, **unused):
        super().__init__()
        del input_size, output_size, unused
        self.tp_group = tp_group
        self.sequence_parallel = bool(config.sequence_parallel)
        self.allreduce_dgrad = (config.tensor_model_parallel_size > 1
                                and not self.sequence_parallel)
        self.weight = None
        self.bias = None

    def use(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def forward(self, x):
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, self.weight, self.bias, gradient_accumulation_fusion=False,
            allreduce_dgrad=self.allreduce_dgrad, sequence_parallel=self.sequence_parallel,
            tp_group=self.tp_group)
        self.weight = self.bias = None
        return out, None


class ShippedNorm(torch.nn.Module):
    """Stand-in for ``q_layernorm`` / ``k_layernorm`` on the stage that runs a foreign
    attention: the layer's own norm (:class:`SequenceParallelNorm`, same kind, epsilon and
    zero-centred gamma) run with the weight and bias that came with the input (:meth:`use`).
    It holds no parameter: the norm it runs is kept outside the module tree."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        del unused
        self._norm = (SequenceParallelNorm(config, hidden_size, eps).requires_grad_(False),)
        self.weights = None

    def use(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weights = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}

    def forward(self, x):
        out = torch.func.functional_call(self._norm[0], self.weights, (x,))
        self.weights = None
        return out


#: The tensors of a layer's attention that ``pre(l)`` ships, by transfer name:
#: ``(submodule of SelfAttention, parameter)``.
SHIPPED = {"w": ("linear_qkv", "weight"), "wb": ("linear_qkv", "bias"),
           "qn": ("q_layernorm", "weight"), "qnb": ("q_layernorm", "bias"),
           "kn": ("k_layernorm", "weight"), "knb": ("k_layernorm", "bias")}


def shipped_weights(self_attention) -> dict:
    """The parameters ``pre(l)`` ships with its attention (:data:`SHIPPED`), absent ones
    left out."""
    found = {}
    for name, (module, param) in SHIPPED.items():
        owner = getattr(self_attention, module, None)
        tensor = getattr(owner, param, None) if owner is not None else None
        if tensor is not None:
            found[name] = tensor
    return found


def before_shipping(self_attention) -> None:
    """Wait for the parameters ``pre(l)`` ships (:func:`wait_for_parameters`): the modules'
    forwards run on the attention's stage with the shipped tensors."""
    modules = (getattr(self_attention, name, None)
               for name in dict.fromkeys(module for module, _ in SHIPPED.values()))
    wait_for_parameters(module for module in modules if module is not None)


def use_shipped(attention, shipped: dict) -> None:
    """Hand the foreign ``attention``'s stand-ins the weights ``shipped`` (by transfer
    name)."""
    attention.linear_qkv.use(shipped["w"], shipped.get("wb"))
    if attention.q_layernorm is not None:
        attention.q_layernorm.use(shipped["qn"], shipped.get("qnb"))
        attention.k_layernorm.use(shipped["kn"], shipped.get("knb"))


class PassThrough(torch.nn.Module):
    """Stand-in for ``linear_proj`` on the attention stage: the projection belongs to the
    post-attention part, which runs on the next boundary's stage."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        del args, kwargs

    def forward(self, x):
        return x, None


class HelixGPTModel(GPTModel):
    """The parameters of one helix stage (see the module docstring).

    ``decoder.layers`` holds, in boundary order, ``post(b - 1)`` and ``pre(b)`` halves of
    Megatron ``TransformerLayer`` objects (``pre_layers`` / ``post_layers`` map the global layer
    number to them); ``foreign_attention`` is a parameter-free ``SelfAttention`` that runs any
    layer's attention with shipped QKV weights.
    """

    def __init__(self, config, layer_spec: ModuleSpec, vocab_size: int,
                 max_sequence_length: int, stage: int, pg_collection: ProcessGroupCollection,
                 share_embeddings_and_output_weights: bool, position_embedding_type: str):
        num_stages, num_layers = config.pipeline_model_parallel_size, config.num_layers
        check_layout(num_layers, num_stages)
        first = stage == 0
        super().__init__(
            config=config,
            transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[],
                                                              layer_norm=SequenceParallelNorm),
            vocab_size=vocab_size, max_sequence_length=max_sequence_length,
            pre_process=first, post_process=first,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type, pg_collection=pg_collection)
        self.stage, self.num_stages = stage, num_stages
        # TransformerLayer adds Megatron's layer-wise offset of this rank; undo it so that the
        # halves carry their global layer numbers.
        offset = get_transformer_layer_offset(config, None, stage)
        self.pre_layers: dict[int, torch.nn.Module] = {}
        self.post_layers: dict[int, torch.nn.Module] = {}
        halves = []
        for b in boundaries_of(stage, num_stages, num_layers):
            if b > 0:
                layer = build_module(layer_spec, config=config, layer_number=b - offset,
                                     pg_collection=pg_collection)
                _keep_post_attention(layer)
                self.post_layers[b - 1] = layer
                halves.append(layer)
            if b < num_layers:
                layer = build_module(layer_spec, config=config, layer_number=b + 1 - offset,
                                     pg_collection=pg_collection)
                _keep_pre_attention(layer)
                self.pre_layers[b] = layer
                halves.append(layer)
        self.decoder.layers = torch.nn.ModuleList(halves)
        self.decoder.__class__ = HelixBlock
        attention_spec = layer_spec.submodules.self_attention
        attention_spec = ModuleSpec(
            module=attention_spec.module, params=attention_spec.params,
            submodules=type(attention_spec.submodules)(
                linear_qkv=ShippedQKV,
                core_attention=attention_spec.submodules.core_attention,
                linear_proj=PassThrough,
                q_layernorm=ShippedNorm if config.qk_layernorm else None,
                k_layernorm=ShippedNorm if config.qk_layernorm else None))
        self.foreign_attention = build_module(attention_spec, config=config, layer_number=1,
                                              pg_collection=pg_collection)


class HelixBlock(TransformerBlock):
    """``TransformerBlock`` whose layers are helix halves at arbitrary global layer numbers:
    local keys follow the module list, sharded keys the global layer offset."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        state = {}
        for index, layer in enumerate(self.layers):
            local = f"{prefix}layers.{index}."
            layer_state = layer.sharded_state_dict(
                local, [(0, layer.layer_number - 1, self.config.num_layers)], metadata)
            replace_prefix_for_sharding(layer_state, local, f"{prefix}layers.")
            state.update(layer_state)
        for name, module in self.named_children():
            if module is not self.layers:
                state.update(sharded_state_dict_default(module, f"{prefix}{name}.",
                                                        sharded_offsets, metadata,
                                                        tp_group=self.tp_group))
        return state


def _keep_pre_attention(layer) -> None:
    """Drop what ``post(l)`` owns from layer ``l``: the projection, the MLP and its norm."""
    layer.self_attention.linear_proj = None
    layer.self_attention.core_attention = None
    layer.pre_mlp_layernorm = None
    layer.mlp = None


def _keep_post_attention(layer) -> None:
    """Drop what ``pre(l)`` owns from layer ``l``: the input norm, the QKV projection and the
    Q/K norms."""
    layer.input_layernorm = None
    layer.self_attention.linear_qkv = None
    layer.self_attention.q_layernorm = None
    layer.self_attention.k_layernorm = None
    layer.self_attention.core_attention = None
