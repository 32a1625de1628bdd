"""Layer norms for the plugin's layer spec that also work with sequence parallelism.

Megatron's ``WrappedTorchNorm`` (its fallback without Transformer Engine or apex) refuses
sequence parallelism. With sequence parallelism the norms see a shard of the sequence, so their
weight gradients are partial sums over the tensor-parallel group; Megatron's
``finalize_model_grads`` all-reduces exactly the parameters flagged ``sequence_parallel``. This
module builds the same ``torch.nn.LayerNorm`` / ``RMSNorm`` (same parameter names, so
checkpoints are unchanged) and sets that flag.

``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``) stores ``gamma - 1``: the weight
starts at zero and the norm scales by ``1 + weight``, as Transformer Engine's and apex's
zero-centred-gamma norms do, so such checkpoints load into either.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _ZeroCentredLayerNorm(torch.nn.LayerNorm):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _ZeroCentredRMSNorm(torch.nn.RMSNorm):
    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class SequenceParallelNorm:
    """Factory with the ``(config, hidden_size, eps)`` signature Megatron's specs expect."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        del kwargs
        centred = config.layernorm_zero_centered_gamma
        if config.normalization == "LayerNorm":
            norm = (_ZeroCentredLayerNorm if centred else torch.nn.LayerNorm)(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = (_ZeroCentredRMSNorm if centred else torch.nn.RMSNorm)(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"--normalization {config.normalization} is not supported; use LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
