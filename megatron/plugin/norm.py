"""Layer norms for the plugin's layer spec that also work with sequence parallelism.

Megatron's ``WrappedTorchNorm`` (its fallback without Transformer Engine or apex) refuses
sequence parallelism. With sequence parallelism the norms see a shard of the sequence, so their
weight gradients are partial sums over the tensor-parallel group; Megatron's
``finalize_model_grads`` all-reduces exactly the parameters flagged ``sequence_parallel``. This
module builds the same ``torch.nn.LayerNorm`` / ``RMSNorm`` (same parameter names, so
checkpoints are unchanged) and sets that flag.
"""
from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Factory with the ``(config, hidden_size, eps)`` signature Megatron's specs expect."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        del kwargs
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centred gamma needs Transformer Engine: drop the flag")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"--normalization {config.normalization} is not supported; use LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
