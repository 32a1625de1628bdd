"""The helix part program: every part of one stage run by the executor (see
:mod:`helix.spec`)."""
from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import get_model_config

from helix import attention as helix_attention
from helix.batches import HelixBatches
from helix.chunked_loss import chunked_loss
from helix.chunked_mlp import chunked_mlp
from helix.model import HelixGPTModel, before_shipping, shipped_weights, use_shipped
from helix.schedule import HelixFlow, part, part_index
from megatron.plugin.layers import packed_attention
from megatron.plugin.layers.attention import heads_to_sequence, sequence_to_heads
from megatron.plugin.layers.memory import keep
from megatron.plugin.pipeline.extension import run_backward
from megatron.plugin.pipeline.parts import PartProgram
from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.layers.rng import rng_restored, rng_state


class _Capture:
    """Stands in for the model when stage 0 calls ``forward_step_func``: keeps what the step
    would feed ``GPTModel.forward`` (tokens, positions, labels, layout)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        """The model's config (the step reads it under context parallelism)."""
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
            with self._layer_rng():
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
        before_shipping(layer.self_attention)
        return {"x": layer.input_layernorm(hidden), "r": hidden,
                **shipped_weights(layer.self_attention)}

    def _attention_forward(self, action: Action, inputs: dict):
        # The residual only passes through: relayed at once, never stashed here (its gradient
        # comes back as the gradient of "res" and goes on unchanged).
        relayed = inputs.pop("r")
        leaves = self._leaves(inputs)
        shipped = {n: t for n, t in leaves.items() if n != "x"}
        layout = self.batches.batches[action.unit].layout()
        with contextlib.nullcontext() if self.training else torch.no_grad(), self._layer_rng():
            o = self._attend(leaves["x"], shipped, layout)
        if self.training:
            self.stash[(True, action.unit, action.part)] = {"in": _kept(leaves),
                                                            "out": _kept({"o": o})}
        following = part(part_index(action.part) + 1)
        return [(Kind.FORWARD, following, "o", o), (Kind.FORWARD, following, "res", relayed)], 0

    def _layer_rng(self):
        """Under sequence parallelism Megatron's ``TransformerBlock`` runs its layers under the
        model-parallel RNG state (each tensor-parallel rank holds other tokens, so each draws
        its own dropout masks); the layer parts run here outside a block and fork the same way.
        Without it they fork nothing, like the block (the attention forks for its own heads)."""
        if self.config.sequence_parallel:
            return get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _attend(self, x, shipped: dict, layout) -> torch.Tensor:
        """``attn(l)`` with the ``shipped`` weights (by transfer name): through the packed
        attention (the QKV projection and the Q/K norms recomputed in the backward under
        recomputation without attention; dropout drawing where the core attention draws), or
        through Megatron's ``SelfAttention`` for an attention output gate."""
        attention = self.module.foreign_attention
        core = attention.core_attention
        if self.config.attention_output_gate:
            use_shipped(attention, shipped)
            return attention(x, attention_mask=None, packed_seq_params=layout)[0]
        with core.dropout_rng():
            return self._attend_packed(attention, x, shipped, layout)

    def _attend_packed(self, attention, x, shipped: dict, layout) -> torch.Tensor:
        """The packed attention of ``x`` (this rank's ``1/cp`` of the rows under context
        parallelism: Q, K and V trade it for ``heads/cp`` of the whole rows by Ulysses'
        all-to-alls, inside the projection, so the recomputation without attention redoes
        them, and the output trades back)."""
        core = attention.core_attention
        dropout = core.dropout if self.training else 0.0
        names = tuple(shipped)
        group = parallel_state.get_context_parallel_group() \
            if self.config.context_parallel_size > 1 else None

        def project(x, *weights):
            use_shipped(attention, dict(zip(names, weights)))
            query, key, value = attention.get_query_key_value_tensors(x)
            if group is not None:
                query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
            return (*core.rotate(query, key, layout), value)

        segments = packed_attention.row_segments(layout, x.shape[1])
        weights = tuple(shipped.values())
        if self.recompute_boundaries:
            out = helix_attention.recomputed_attention(project, x, weights, segments,
                                                       core.softmax_scale, dropout, core.backend)
        else:
            out = packed_attention.packed_attention(*project(x, *weights), segments,
                                                    core.softmax_scale, dropout,
                                                    backend=core.backend)
        return out if group is None else heads_to_sequence(out, group)

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
            return module.compute_language_model_loss(labels, module._scale_logits(logits))

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
