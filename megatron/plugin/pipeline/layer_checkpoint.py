"""Checkpointing of a stage's leading layers, chosen per chunk, recomputed by ``RECOMPUTE``.

InfiniPipe's plans checkpoint the first ``ckpt(p, k)`` layers of stage ``p``'s range for chunk
``k``, a different count for every chunk. Megatron's own recomputation (``--recompute-*``) is a
fixed setting of the model and runs inside the backward, so it cannot serve a per-chunk table nor
an explicit ``RECOMPUTE`` action (the schedules of such tables take its flags as a fixed table
and build the model without it). :class:`LeadingLayers` hooks the stage's ``TransformerLayer``
modules instead:

* forward of a chunk with ``count > 0`` (:meth:`LeadingLayers.armed`): the input and keyword
  arguments of the first layer and the RNG state are kept (the input through
  :func:`~megatron.plugin.layers.memory.keep`, so the activation meter counts it); layers
  ``0..count-1`` run without autograd (nothing of theirs is stashed); the output of layer ``count-1`` is cut off as a fresh
  leaf (the *boundary*) from which the rest of the stage builds its graph as usual;
* ``RECOMPUTE`` (:meth:`LeadingLayers.recompute`): the same layers run again from the kept input
  with autograd, under the kept RNG state, giving the boundary's value with its graph;
* the chunk's backward (:func:`~megatron.plugin.pipeline.chunks.chunk_backward`) then runs in
  two calls: from the stage output down to the boundary (``boundary.grad``), then from the
  recomputed boundary down to the stage input.

K/V of checkpointed layers: the no-autograd forward records them in the K/V store as usual, so
later slices see them as context and accumulate their gradients on the store's leaves; the
recomputation records the same values again, which only re-attaches the slice's own K/V to the
new graph (see :mod:`megatron.plugin.layers.kv_store`): what other slices read is never changed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.utils import get_attr_wrapped_model

from megatron.plugin.layers.memory import keep
from megatron.plugin.layers.rng import rng_restored, rng_state


@dataclass
class Stash:
    """What a checkpointed forward keeps for its recomputation."""

    count: int
    kwargs: dict
    rng_state: dict
    boundary: torch.Tensor
    held: object
    """:func:`~megatron.plugin.layers.memory.keep` handle of the kept input (counted as
    activation)."""
    recomputed: torch.Tensor | None = None


class LeadingLayers:
    """Per-chunk checkpointing of the leading transformer layers of one model chunk."""

    def __init__(self, model: torch.nn.Module):
        decoder = get_attr_wrapped_model(model, "decoder")
        self.layers = list(decoder.layers)
        self.layer_numbers = [layer.layer_number for layer in self.layers]
        self._count = 0
        self._grad_enabled = True
        self._kwargs = self._rng = None
        self._stash: Stash | None = None
        for index, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True)
            layer.register_forward_hook(self._post_hook(index))

    def armed(self, count: int):
        """Context for one forward that checkpoints the first ``count`` layers."""
        if not 0 <= count <= len(self.layers):
            raise ValueError(f"cannot checkpoint {count} layers of a stage with "
                             f"{len(self.layers)}")
        return _Armed(self, count)

    def take(self) -> Stash | None:
        """The stash of the last armed forward (``None`` when it checkpointed nothing)."""
        stash, self._stash = self._stash, None
        return stash

    def recompute(self, stash: Stash) -> None:
        """Run the checkpointed layers again with autograd; sets ``stash.recomputed``."""
        with rng_restored(stash.rng_state), torch.enable_grad():
            kwargs = dict(stash.kwargs)
            hidden = kwargs.pop("hidden_states")
            for layer in self.layers[:stash.count]:
                hidden = layer(hidden_states=hidden, **kwargs)
                if isinstance(hidden, tuple):
                    hidden, kwargs["context"] = hidden
        stash.recomputed = hidden

    def checkpointed_layers(self, stash: Stash | None) -> list[int]:
        """Layer numbers whose graph the recomputation rebuilds."""
        return self.layer_numbers[:stash.count] if stash is not None else []

    def graph_layers(self, stash: Stash | None) -> list[int]:
        """Layer numbers whose graph the forward built."""
        return self.layer_numbers[stash.count:] if stash is not None else self.layer_numbers

    # -- hooks -------------------------------------------------------------------------------
    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            if self._count and index == 0:
                if args:
                    raise RuntimeError("TransformerLayer called with positional arguments; "
                                       "leading-layer checkpointing needs keywords")
                self._kwargs = dict(kwargs)
                self._rng = rng_state()
                self._grad_enabled = torch.is_grad_enabled()
                torch.set_grad_enabled(False)
            return None
        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            if not self._count or index != self._count - 1:
                return None
            torch.set_grad_enabled(self._grad_enabled)
            hidden, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            boundary = hidden.detach().requires_grad_(self._grad_enabled)
            self._stash = Stash(self._count, self._kwargs, self._rng, boundary,
                                keep(self._kwargs["hidden_states"]))
            self._kwargs = self._rng = None
            return (boundary, *rest) if rest is not None else boundary
        return hook


class _Armed:
    def __init__(self, owner: LeadingLayers, count: int):
        self.owner, self.count = owner, count

    def __enter__(self):
        self.owner._stash = None
        self.owner._count = self.count

    def __exit__(self, *exc):
        owner = self.owner
        if owner._count and owner._kwargs is not None:  # the forward failed half-way
            torch.set_grad_enabled(owner._grad_enabled)
            owner._kwargs = owner._rng = None
        owner._count = 0
        return False


def leading_layers(model) -> LeadingLayers:
    """The :class:`LeadingLayers` of ``model`` (one per model: it hooks the model's layers),
    an attribute of the model, so that it lives and dies with the model (a weak-keyed table
    would keep every model alive: its value reaches the key through the layers' config, whose
    ``grad_scale_func`` is the optimizer's, which holds the model)."""
    layers = getattr(model, "_leading_layers", None)
    if layers is None:
        layers = model._leading_layers = LeadingLayers(model)
    return layers
